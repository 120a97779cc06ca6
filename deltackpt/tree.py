"""State trees: flatten a nested training state into a JSON-safe skeleton plus a list of array leaves, and back.

Where it sits: first step of ``save`` and last step of ``load``. :func:`flatten` walks the user's state and
returns the skeleton that goes into the manifest and the tensors/arrays whose bytes the store chunks;
:func:`unflatten` rebuilds the same structure from the skeleton and the loaded arrays. No code is ever
executed to decode a skeleton: every node is one of a closed set of tags, and pickle is used only when both
the save and the load opted in.

Skeleton nodes are JSON lists whose first element is a tag::

    ["N"]                     None                ["b", true]            bool
    ["i", "123"]              int (any size)      ["f", "3ff8000000000000"]  float, exact bits (nan, -0.0)
    ["s", "text"]             str                 ["y", "base64"]        bytes
    ["d", [keys], [values]]   dict (order kept)   ["o", [keys], [values]] OrderedDict
    ["l", [values]]           list                ["t", [values]]        tuple
    ["T", i] / ["A", i]       torch tensor / numpy array: leaf i of the tensor table
    ["dt", "float32"]         torch.dtype         ["dv", "cuda:0"]       torch.device
    ["sz", [2, 3]]            torch.Size          ["ns", "<f8", "hex"]   numpy scalar
    ["x", name, node]         registered type     ["p", "base64"]        pickled (opt-in only)

and, from manifest format version 2 (written only by states that hold one of them, see :func:`format_version`)::

    ["c", "hex", "hex"]       complex (two floats' bits)
    ["S", [values]]           set                 ["F", [values]]        frozenset
    ["C", [keys], [values]]   collections.Counter ["q", [values], maxlen] collections.deque (maxlen null or int)
    ["D", factory, [keys], [values]]  collections.defaultdict; factory is null or one of DEFAULT_FACTORIES

and, from version 3 (written only by states that hold one of them)::

    ["o", [keys], [values], metadata]  OrderedDict with a module state_dict()'s ``_metadata`` (a node)
    ["dt", "qint8"]           a quantized torch dtype (qint8, quint8, qint32, quint4x2, quint2x4)

Dict keys are nodes too: str and int, and from version 2 any hashable plain value (None, bool, float,
complex, bytes, numpy scalars, torch dtypes and devices, and tuples and frozensets of those). Set elements are
hashable plain values likewise. An array met twice is one leaf referenced twice: the same object, or another
tensor (array) viewing the same memory the same way (:func:`alias_key`), such as the two entries of a tied
model's ``state_dict()``; it loads as one object.
"""

from __future__ import annotations

import base64
import functools
import pickle
import re
import struct
import sys
from collections import Counter, OrderedDict, defaultdict, deque
from collections.abc import Callable, Hashable, Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from deltackpt import _lazy
from deltackpt.errors import CorruptManifestError, InvalidNameError, UnsafeLoadError, UnsupportedTypeError

if TYPE_CHECKING:
    import torch
else:
    torch = _lazy.module("torch", globals())


@dataclass
class Leaf:
    """One array leaf of a state: where it was first met, the object, and its description."""

    path: str
    obj: torch.Tensor | np.ndarray
    kind: str  # "torch" or "numpy"
    dtype: str  # torch dtype name ("float32") or numpy dtype str ("<f4")
    shape: tuple[int, ...]
    nbytes: int
    width: int  # element width for byte planes: 1, 2, 4 or 8
    requires_grad: bool = False
    parameter: bool = False
    device: str = "cpu"


@dataclass(frozen=True)
class _TypeHook:
    cls: type
    name: str
    encode: Callable[[Any], Any]
    decode: Callable[[Any], Any]


_HOOKS_BY_TYPE: dict[type, _TypeHook] = {}
_HOOKS_BY_NAME: dict[str, _TypeHook] = {}


def _stored_natively(cls: type) -> bool:
    """Whether saves store values of type ``cls`` themselves (no hook of :func:`register_type` may take them)."""
    if cls in _BUILTIN_TYPES or cls is type(None) or cls in (torch.Tensor, torch.nn.Parameter, torch.Size, np.ndarray,
                                                              torch.dtype, torch.device):
        return True
    if issubclass(cls, np.generic):
        try:
            return np.dtype(cls).kind in _NUMPY_KINDS
        except TypeError:  # (an abstract scalar type, np.floating say: no value is of it)
            return False
    return False


def register_type(
    cls: type, name: str, encode: Callable[[Any], Any], decode: Callable[[Any], Any]
) -> None:
    """Teach deltackpt a user type.

    ``encode(obj)`` returns a storable value (any state tree: dicts, lists, tensors, plain values);
    ``decode(value)`` rebuilds the object from it. ``name`` is what the manifest records: keep it stable.
    The decoder must be registered in the loading process too, else load raises UnsupportedTypeError.
    Registering ``cls`` again replaces its hooks (and its name). A name already registered for another class
    raises :class:`~deltackpt.errors.InvalidNameError`: loads would build the wrong class from what either saved.
    """
    if not isinstance(cls, type):
        raise TypeError(f"register_type needs a class, got {cls!r:.60}")
    if _stored_natively(cls):
        raise TypeError(f"{cls.__qualname__} is a type deltackpt stores itself: a hook for it would never run, or "
                        "would take its values away from the store's own encoding (a tensor's chunks, say)")
    if not isinstance(name, str):
        raise TypeError(f"register_type({cls.__qualname__}): name must be a str, got {type(name).__name__} "
                        f"{name!r:.40}")
    if not name:
        raise ValueError(f"register_type({cls.__qualname__}): a registered type needs a non-empty name")
    for what, fn in (("encode", encode), ("decode", decode)):
        if not callable(fn):
            raise TypeError(f"register_type({cls.__qualname__}): {what} must be a callable, got {type(fn).__name__}")
    taken = _HOOKS_BY_NAME.get(name)
    if taken is not None and taken.cls is not cls:
        raise InvalidNameError(
            f"type name {name!r} is already registered for {taken.cls.__module__}.{taken.cls.__qualname__}: give "
            f"{cls.__module__}.{cls.__qualname__} a name of its own (or unregister_type the other first)")
    old = _HOOKS_BY_TYPE.get(cls)
    if old is not None and old.name != name:
        del _HOOKS_BY_NAME[old.name]
    hook = _TypeHook(cls, name, encode, decode)
    _HOOKS_BY_TYPE[cls] = hook
    _HOOKS_BY_NAME[name] = hook


def unregister_type(cls: type) -> None:
    """Forget what :func:`register_type` taught for ``cls`` (nothing happens if it was not registered)."""
    hook = _HOOKS_BY_TYPE.pop(cls, None)
    if hook is not None and _HOOKS_BY_NAME.get(hook.name) is hook:
        del _HOOKS_BY_NAME[hook.name]


@dataclass(frozen=True)
class Encoded:
    """An object of a registered type, already encoded: saved as the object would be (``["x", name, value]``).
    An async save's snapshot holds one in place of the live object, with copies of its tensors, so that the
    background save never encodes an object the training loop goes on changing."""

    name: str
    value: Any


def registered_types() -> frozenset[type]:
    """The types :func:`register_type` taught deltackpt, as of now."""
    return frozenset(_HOOKS_BY_TYPE)


def encode_registered(obj: Any) -> Encoded | None:
    """``obj`` encoded by the hook registered for its type (:func:`register_type`), or None if there is none."""
    hook = _HOOKS_BY_TYPE.get(type(obj))
    return None if hook is None else Encoded(hook.name, hook.encode(obj))


@functools.cache
def _dtypes() -> dict[str, torch.dtype]:
    """torch's dtypes by the name stored for them (``float32``, ``bfloat16``, ...): looked up in this table, not
    with getattr(torch, name), where a stored name like ``_dynamo`` would import a submodule (torch's module
    __getattr__)."""
    return {name: obj for name, obj in vars(torch).items() if isinstance(obj, torch.dtype)}


def dtype_named(name: Any) -> torch.dtype | None:
    """The torch dtype a stored name names, or None; nothing is imported or evaluated."""
    return _dtypes().get(name) if type(name) is str else None


#: the element sizes of torch's dtypes by stored name (torch 2.13's, but the quantized ones), so that reading a
#: manifest (``deltackpt ls``, ``du``, ``show``) needs no torch: a name not here is looked up in torch
_TORCH_ITEMSIZE: dict[str, int] = {
    **dict.fromkeys(("bool", "uint8", "int8", "uint1", "uint2", "uint3", "uint4", "uint5", "uint6", "uint7", "bit",
                     "int1", "int2", "int3", "int4", "int5", "int6", "int7", "bits1x8", "bits2x4", "bits4x2", "bits8",
                     "float8_e5m2", "float8_e4m3fn", "float8_e5m2fnuz", "float8_e4m3fnuz", "float8_e8m0fnu",
                     "float4_e2m1fn_x2"), 1),
    **dict.fromkeys(("int16", "short", "uint16", "float16", "half", "bfloat16", "bits16"), 2),
    **dict.fromkeys(("int32", "int", "uint32", "float32", "float", "complex32", "chalf"), 4),
    **dict.fromkeys(("int64", "long", "uint64", "float64", "double", "complex64", "cfloat"), 8),
    **dict.fromkeys(("complex128", "cdouble"), 16),
}


def torch_itemsize(name: str) -> int:
    """The element size of the torch dtype ``name``; a name not in the table is looked up in torch, raising as
    :func:`torch_dtype` does."""
    size = _TORCH_ITEMSIZE.get(name) if type(name) is str else None
    return size if size is not None else torch_dtype(name).itemsize


#: dtypes every torch that deltackpt runs on (torch>=2.3) knows, by stored name: a check that this torch knows a
#: tensor's dtype needs no torch for them (deltackpt resume-info, as ls, runs without importing it)
_EVERY_TORCH_KNOWS = frozenset(("bool", "uint8", "int8", "int16", "int32", "int64", "float16", "bfloat16", "float32",
                                "float64", "complex64", "complex128"))


def check_known_torch_dtype(name: str) -> None:
    """Raise as :func:`torch_dtype` does for a tensor entry's dtype ``name`` (UnsupportedTypeError: one this torch
    does not know), importing torch only for a name outside those every supported torch knows."""
    if not (type(name) is str and name in _EVERY_TORCH_KNOWS):
        torch_dtype(name)


def torch_dtype(name: str, *, value: bool = False) -> torch.dtype:
    """torch dtype from its name, without evaluating anything. Quantized dtypes are refused for tensor entries, as
    saves refuse their tensors: they hold fewer bytes than elements (``quint4x2``: two per byte), and no writer
    stores one. A ``dt`` node (``value``: a dtype held as a value, a model config's say) may name one."""
    if not (isinstance(name, str) and name.isidentifier()):
        raise CorruptManifestError(f"malformed torch dtype name {name!r:.60}")
    dt = dtype_named(name)
    if dt is None:  # (a dtype of a newer torch, float4_e2m1fn_x2 say: no damage of the store)
        raise UnsupportedTypeError(f"torch dtype {name!r:.60} is unknown to this torch ({torch.__version__}): "
                                   "the checkpoint was written by a newer one")
    if name in QUANTIZED_NAMES and not value:
        raise CorruptManifestError(f"quantized torch dtype {name!r} in a tensor entry (saves refuse them)")
    return dt


#: the names of torch's quantized dtypes: their tensors are not storable (their bytes are not the elements'; a
#: quantizer goes with them); as values (``dt`` nodes) they are, from manifest version 3
QUANTIZED_NAMES = frozenset({"qint8", "quint8", "qint32", "quint4x2", "quint2x4"})


def numpy_dtype(name: str) -> np.dtype:
    """numpy dtype from its string, of a kind deltackpt stores (bool, integers, floats, complex)."""
    try:
        dt = np.dtype(name) if isinstance(name, str) else None
    except Exception:  # (TypeError mostly; a string numpy evaluates as a tuple spec can raise SyntaxError)
        dt = None
    if dt is None or dt.kind not in _NUMPY_KINDS:
        raise CorruptManifestError(f"unknown or unsupported numpy dtype {name!r:.60}")
    return dt


def dtype_name(dt: torch.dtype) -> str:
    return str(dt).removeprefix("torch.")


def _plane_width(itemsize: int, is_complex: bool) -> int:
    size = itemsize // 2 if is_complex else itemsize
    for w in (8, 4, 2, 1):
        if size % w == 0:
            return w
    return 1


_NUMPY_KINDS = set("biufc")

#: defaultdict factories a skeleton may name: builtin types, looked up in this table (nothing is evaluated)
DEFAULT_FACTORIES: dict[str, type] = {
    cls.__name__: cls
    for cls in (int, float, complex, bool, str, bytes, list, tuple, dict, set, frozenset, OrderedDict, Counter, deque)
}
_CONTAINERS = frozenset({dict, OrderedDict, Counter, defaultdict, list, tuple, deque})
#: the exact types :meth:`_Flattener._node` stores before it looks for a registered hook
_BUILTIN_TYPES = frozenset({bool, int, float, str, bytes, complex, set, frozenset, *_CONTAINERS})
#: tags of manifest format version 2 (:func:`format_version`)
V2_TAGS = frozenset({"c", "S", "F", "C", "q", "D"})
_HASHABLE = (type(None), bool, int, float, complex, str, bytes)


def _short_repr(value: Any) -> str:
    """``repr(value)`` cut to 60 characters, for messages; never raises (an int of more digits than Python
    converts at once, a ``__repr__`` that fails)."""
    try:
        return f"{value!r:.60}"
    except Exception:
        return f"<{type(value).__name__}>"


def child_path(path: str, key: Any) -> str:
    """The key path of ``key`` under ``path``, as errors and manifests name it: ``a.b``, ``a[0]``, ``a[(1, 2)]``."""
    if type(key) is int:
        return f"{path}[{int_text(key)}]"
    if type(key) is str:
        return f"{path}.{key}" if path else key
    try:
        return f"{path}[{key!r}]"
    except ValueError:  # e.g. a tuple holding an int of more digits than Python converts at once
        return f"{path}[<{type(key).__name__}>]"


class _Flattener:
    def __init__(self, allow_pickle: bool, opaque: bool = False, metadata: bool = False) -> None:
        self.allow_pickle = allow_pickle
        self.opaque = opaque
        self.metadata = metadata  # (checkpoint metadata, which neither a registered type nor a pickle may hold)
        self.leaves: list[Leaf] = []
        self._seen: dict[Hashable, int] = {}
        self._open: set[int] = set()  # ids of the containers around the node being flattened

    def leaf(self, obj: torch.Tensor | np.ndarray, path: str) -> list[Any]:
        key = alias_key(obj)
        idx = self._seen.get(key)
        is_torch = isinstance(obj, torch.Tensor)
        if idx is None:
            leaf = (_torch_leaf(obj, path, saving=not self.opaque) if is_torch  # type: ignore[arg-type]
                    else _numpy_leaf(obj, path, saving=not self.opaque))  # type: ignore[arg-type]
            idx = len(self.leaves)
            self.leaves.append(leaf)
            self._seen[key] = idx
        return ["T" if is_torch else "A", idx]

    def attribute(self, value: Any, path: str, name: str) -> list[Any]:
        """The node of attribute ``name`` of the container at ``path`` (a module ``state_dict()``'s
        ``_metadata``: the version of each module, which ``load_state_dict`` hands to the modules' migrations):
        any value the state could hold but arrays."""
        inner = _Flattener(self.allow_pickle)
        inner._open = self._open  # (the containers around it: a _metadata holding its OrderedDict is a cycle)
        node = inner.node(value, f"{path}.{name}" if path else name)
        if inner.leaves:
            raise UnsupportedTypeError(f"cannot store {path or '<root>'}: its {name} attribute holds a tensor or array "
                                       f"({inner.leaves[0].path})")
        return node

    def plain(self, value: Any, path: str, what: str, depth: int = 0) -> list[Any]:
        """The node of a dict key or set element: a hashable plain value (str, int, None, bool, float,
        complex, bytes, a numpy scalar, a torch dtype or device, or a tuple or frozenset of those)."""
        t = type(value)
        if t in _HASHABLE or t is torch.dtype or t is torch.device or (
            isinstance(value, np.generic) and value.dtype.kind in _NUMPY_KINDS
        ):
            return self.node(value, path)
        if t is tuple or t is frozenset:
            if depth >= MAX_DEPTH:
                raise UnsupportedTypeError(
                    f"cannot store {path or '<root>'}: a {what} nested more than {MAX_DEPTH} levels deep")
            inner = [self.plain(v, path, what, depth + 1) for v in value]
            return ["t", inner] if t is tuple else ["F", inner]
        raise UnsupportedTypeError(
            f"cannot store {path or '<root>'}: unsupported type {t.__module__}.{t.__qualname__} as a {what} "
            f"({_short_repr(value)}); dict keys and set elements must be str, int, None, bool, float, complex, bytes, "
            "numpy scalars, torch dtypes or devices, or tuples or frozensets of those"
        )

    def node(self, obj: Any, path: str) -> list[Any]:
        t = type(obj)
        # (an object of a registered type counts as a container: its encoder may return it again, or another one)
        if t in _CONTAINERS or t is Encoded or t in _HOOKS_BY_TYPE:
            if id(obj) in self._open:
                raise UnsupportedTypeError(f"cannot store {path or '<root>'}: it contains itself (a reference cycle)")
            if len(self._open) >= MAX_DEPTH:
                raise UnsupportedTypeError(
                    f"cannot store {path or '<root>'}: containers nested more than {MAX_DEPTH} levels deep")
            self._open.add(id(obj))
            try:
                return self._node(obj, path, t)
            finally:
                self._open.discard(id(obj))
        return self._node(obj, path, t)

    def registered(self, obj: Any, path: str, t: type) -> list[Any]:
        """The ``x`` node of an object of a registered type: what its encoder returns, flattened (:meth:`node`
        checks it for cycles and depth as a container)."""
        if t is Encoded:
            encoded = obj
        else:
            try:
                encoded = encode_registered(obj)
            except Exception as exc:
                raise UnsupportedTypeError(f"cannot store {path or '<root>'}: the encoder registered for "
                                           f"{t.__qualname__} failed: {exc!r:.200}") from exc
        return ["x", encoded.name, self.node(encoded.value, path)]

    def _node(self, obj: Any, path: str, t: type) -> list[Any]:
        if obj is None:
            return ["N"]
        if t is bool:
            return ["b", obj]
        if t is int:
            return ["i", int_text(obj)]
        if t is float:
            return ["f", struct.pack(">d", obj).hex()]
        if t is str:
            return ["s", obj]
        if t is bytes:
            return ["y", base64.b64encode(obj).decode()]
        if t is dict or t is OrderedDict or t is Counter or t is defaultdict:
            keys, vals = [], []
            for k, v in obj.items():
                keys.append(self.plain(k, path, "dict key"))
                vals.append(self.node(v, child_path(path, k)))
            if t is defaultdict:
                factory = obj.default_factory
                name = None if factory is None else getattr(factory, "__name__", None)
                if factory is not None and DEFAULT_FACTORIES.get(name) is not factory:  # type: ignore[arg-type]
                    raise UnsupportedTypeError(
                        f"cannot store {path or '<root>'}: unsupported type defaultdict with default_factory "
                        f"{factory!r}; the factory must be None or one of {', '.join(DEFAULT_FACTORIES)} "
                        "(or convert it to a dict)"
                    )
                return ["D", name, keys, vals]
            if t is OrderedDict and (meta := getattr(obj, "_metadata", None)) is not None:
                return ["o", keys, vals, self.attribute(meta, path, "_metadata")]
            return ["d" if t is dict else "o" if t is OrderedDict else "C", keys, vals]
        if t is list or t is tuple:
            tag = "l" if t is list else "t"
            return [tag, [self.node(v, child_path(path, i)) for i, v in enumerate(obj)]]
        if t is deque:
            return ["q", [self.node(v, child_path(path, i)) for i, v in enumerate(obj)], obj.maxlen]
        if t is set or t is frozenset:
            return ["S" if t is set else "F", [self.plain(v, path, "set element") for v in obj]]
        if t is complex:
            return ["c", struct.pack(">d", obj.real).hex(), struct.pack(">d", obj.imag).hex()]
        if t is torch.Size:
            return ["sz", [int(x) for x in obj]]
        if t is Encoded or t in _HOOKS_BY_TYPE:  # (before tensors: a registered tensor subclass is encoded)
            return self.registered(obj, path, t)
        if isinstance(obj, torch.Tensor):
            return self.leaf(obj, path)
        if t is np.ndarray:
            return self.leaf(obj, path)
        if self.opaque and isinstance(obj, np.ndarray):  # (a load's target: an np.memmap is filled as any array)
            if isinstance(obj, np.ma.MaskedArray):
                raise UnsupportedTypeError(f"cannot store {path or '<root>'}: it is a numpy masked array, whose "
                                           "mask no stored array fills; give np.asarray(...) of it, its data")
            return self.leaf(obj, path)
        if t is torch.dtype:
            return ["dt", dtype_name(obj)]
        if t is torch.device:
            return ["dv", str(obj)]
        if isinstance(obj, np.generic) and obj.dtype.kind in _NUMPY_KINDS:
            return ["ns", obj.dtype.str, obj.tobytes().hex()]
        if self.opaque:
            if isinstance(obj, (torch.nn.Module, torch.optim.Optimizer)):  # (holds tensors no place matches)
                raise UnsupportedTypeError(f"cannot store {path or '<root>'}: it is a {t.__qualname__} itself, not a "
                                           "state; offer its state_dict()")
            return ["?"]  # (a target's value nothing is decoded into: never stored, never pickled)
        if self.allow_pickle is True:
            try:
                data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
            except Exception as exc:
                raise UnsupportedTypeError(f"cannot pickle {path or '<root>'} ({t.__name__}): {exc}") from exc
            return ["p", base64.b64encode(data).decode()]
        if self.metadata:
            raise UnsupportedTypeError(
                f"cannot store metadata at {path or '<root>'}: unsupported type {t.__module__}.{t.__qualname__}; "
                f"{PLAIN_KINDS}")
        raise UnsupportedTypeError(
            f"cannot store {path or '<root>'}: unsupported type {t.__module__}.{t.__qualname__} "
            + ("(a numpy.ndarray subclass: store np.asarray(...) of it, and what else it holds (a masked array's "
               "mask), or register it with deltackpt.register_type)"
               if isinstance(obj, np.ndarray) else
               _instead(obj) or ("(register it with deltackpt.register_type; Store.save and Store.load also take "
                                 "allow_pickle=True, a Checkpointer does not)"))
        )


def _instead(obj: Any) -> str | None:
    """What to store in place of a live training object put into a state by mistake (``{"model": model}``
    where ``model.state_dict()`` belongs): the advice to register its type would store the object itself."""
    if isinstance(obj, torch.Generator):
        return "(a generator, not a state: store its get_state())"
    if isinstance(obj, np.random.Generator):
        return "(a generator, not a state: store its bit_generator.state)"
    try:
        stateful = callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))
    except Exception:  # (an attribute that raises: no advice, the type's name still says what it is)
        stateful = False
    if stateful:
        return ("(an object with state_dict(), not a state: store its state_dict(), or give it to a Checkpointer, "
                "which does)")
    return None


def alias_key(obj: torch.Tensor | np.ndarray) -> Hashable:
    """What makes two arrays of a state one leaf: the same object, or the same view of the same memory (address,
    shape, strides, dtype, device) with the same type, ``requires_grad`` and lazy conjugate/negative bits. A tied
    model's ``state_dict()`` detaches each parameter into a new tensor object, so its tied entries are two
    objects with one key; ``torch.save`` likewise stores their storage once and restores them sharing it.
    Partly overlapping views stay separate leaves (each stores its own bytes). Empty arrays, whose address
    means nothing, and tensors without ordinary memory are keyed by identity alone."""
    if isinstance(obj, torch.Tensor):
        plain = type(obj) in (torch.Tensor, torch.nn.Parameter) and obj.layout == torch.strided
        if not plain or obj.numel() == 0 or obj.is_meta or obj.is_quantized or obj.is_nested:
            return id(obj)
        return ("T", type(obj), "cpu" if obj.is_cpu else str(obj.device), obj.data_ptr(), tuple(obj.shape),
                obj.stride(), obj.dtype, obj.requires_grad, obj.is_conj(), obj.is_neg())
    if isinstance(obj, np.ndarray) and obj.size > 0:
        return ("A", obj.__array_interface__["data"][0], obj.shape, obj.strides, obj.dtype.str)
    return id(obj)


#: A leaf's place in a state tree, exact where key paths are not: one step per level, ``("k", key)`` for a dict
#: entry, ``("i", n)`` for a sequence item, ``("x", name)`` for the inside of a registered type. ``{"a.b": x}``
#: and ``{"a": {"b": x}}`` share the key path ``a.b`` but not a place; so do ``{0: x}`` and ``[x]`` (``[0]``).
Place = tuple[tuple[str, Any], ...]


def leaf_refs(skeleton: Any) -> list[tuple[Place, str, int]]:
    """``(place, key path, leaf index)`` for every reference of ``skeleton`` to an array leaf, in document
    order. A leaf met twice appears at both places: the tensor table names only the first. A malformed
    skeleton raises :class:`CorruptManifestError`."""
    return list(_leaf_refs(skeleton, "", ()))


def check_offer(into: Any) -> None:
    """Refuse a module or optimizer offered to load into (``Store.load(into=)``), where its ``state_dict()``
    belongs: no place of a state matches it, and the load would leave it untouched without a word. Raises
    :class:`UnsupportedTypeError` naming its place; looks into dicts, lists and tuples only."""
    kinds = (torch.nn.Module, torch.optim.Optimizer)
    if isinstance(into, kinds):
        raise UnsupportedTypeError(f"cannot load into <root>: it is a {type(into).__qualname__} itself, not a state; "
                                   "offer its state_dict()")
    stack: list[tuple[Any, str]] = [(into, "")] if isinstance(into, (Mapping, list, tuple, deque)) else []
    seen: set[int] = set()
    while stack:
        obj, path = stack.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        items = obj.items() if isinstance(obj, Mapping) else enumerate(obj)
        for key, v in items:  # (a path is made for containers and the refused only: not for every tensor)
            if isinstance(v, torch.Tensor):  # (most of what is offered: checked first, as that check is quick)
                continue
            if isinstance(v, kinds):
                raise UnsupportedTypeError(f"cannot load into {child_path(path, key)}: it is a "
                                           f"{type(v).__qualname__} itself, not a state; offer its state_dict()")
            if isinstance(v, (Mapping, list, tuple, deque)):
                stack.append((v, child_path(path, key)))


def pair_leaves(skeleton: Any, target: Any) -> Iterator[tuple[int, Any]]:
    """``(leaf index, object)`` for every array leaf of ``skeleton`` at whose place ``target`` (a tree of dicts,
    lists and tuples) holds an object, in document order: dict entries matched by key, sequence items by
    position. Places are matched as :data:`Place` names them, so ``{"a.b": x}`` and ``{"a": {"b": x}}``,
    which share a key path, never pair with each other. Nothing of ``target`` is modified (a ``defaultdict``
    gains no keys). A malformed skeleton raises :class:`CorruptManifestError`; ``target`` is only looked at."""
    try:
        tag = skeleton[0]
        if tag in ("T", "A"):
            leaf = int(skeleton[1])
        elif tag in _DICT_TAGS:
            knodes, vals = _dict_parts(skeleton)
            keys = [_plain_build(k) for k in knodes]
        elif tag in ("l", "t", "q"):
            vals = skeleton[1]
    except UnsupportedTypeError:  # a key this torch cannot build (a device or dtype it lacks): not damage
        raise
    except (IndexError, KeyError, TypeError, ValueError) as exc:
        raise CorruptManifestError(f"malformed state skeleton: {exc!r}") from None
    if tag in ("T", "A"):
        yield leaf, target
    elif tag in _DICT_TAGS and isinstance(target, Mapping):
        for key, v in zip(keys, vals):
            try:
                child = target.get(key, _ABSENT)
            except (TypeError, KeyError):  # a mapping that cannot hold or look up such a key
                continue
            if child is not _ABSENT:
                yield from pair_leaves(v, child)
    elif tag in ("l", "t", "q") and isinstance(target, (list, tuple, deque)):
        for v, child in zip(vals, target):
            yield from pair_leaves(v, child)


_ABSENT = object()


def _leaf_refs(n: Any, path: str, place: Place) -> Iterator[tuple[Place, str, int]]:
    for node, at, where in _nodes(n, path, place, ("T", "A")):
        try:
            yield where, at, int(node[1])
        except (IndexError, TypeError, ValueError) as exc:
            raise CorruptManifestError(f"malformed state skeleton at {at or '<root>'}: {exc!r}") from None


def leaf_nodes(skeleton: Any) -> list[tuple[Place, str, Any]]:
    """``(place, key path, node)`` of every leaf of ``skeleton`` in document order: array references (``T``,
    ``A``), plain values, and empty containers (so that one added or removed shows). Dicts, sequences and
    registered types are walked into. A malformed skeleton raises :class:`CorruptManifestError`."""
    return [(where, at, node) for node, at, where in _nodes(skeleton, "", (), _LEAVES)]


def container_nodes(skeleton: Any) -> list[tuple[Place, str, Any]]:
    """``(place, key path, node)`` of every container of ``skeleton`` (dict-likes, lists, tuples, deques and
    registered types, empty ones too), outer first in document order. A malformed skeleton raises
    :class:`CorruptManifestError`."""
    return [(where, at, node) for node, at, where in _nodes(skeleton, "", (), _EVERY_CONTAINER)]


#: ``_nodes`` tags meaning "every leaf": any node that is not a container with children
_LEAVES: tuple[str, ...] = ("<every leaf>",)
#: ``_nodes`` tags meaning "every container", walked into as well
_EVERY_CONTAINER: tuple[str, ...] = ("<every container>",)


def _nodes(n: Any, path: str, place: Place, tags: tuple[str, ...],
           attributes: bool = False) -> Iterator[tuple[Any, str, Place]]:
    """``(node, key path, place)`` of every node of ``n`` whose tag is one of ``tags`` (every leaf for
    :data:`_LEAVES`; every container, whose nodes are walked too, for :data:`_EVERY_CONTAINER`), in document order,
    walking into dicts, sequences and registered types, and with ``attributes`` into an OrderedDict's
    ``_metadata`` too (key path ``<path>._metadata``). A malformed skeleton raises :class:`CorruptManifestError`."""
    try:
        tag = n[0]
        if tags is _EVERY_CONTAINER:
            if tag in _DICT_TAGS or tag in ("l", "t", "q", "x"):
                yield n, path, place
        elif tag in tags or (tags is _LEAVES and _is_leaf(n)):
            yield n, path, place
            return
        if tag in _DICT_TAGS:
            keys, vals = _dict_parts(n)
            for k, v in zip(keys, vals):
                key = _plain_build(k)
                hash(key)  # a place is a dict key of its own
                yield from _nodes(v, child_path(path, key), (*place, ("k", key)), tags, attributes)
            if attributes and tag == "o" and len(n) == 4:
                name = f"{path}._metadata" if path else "_metadata"
                yield from _nodes(n[3], name, (*place, ("a", "_metadata")), tags, attributes)
        elif tag in ("l", "t", "q"):
            for i, v in enumerate(n[1]):
                yield from _nodes(v, child_path(path, i), (*place, ("i", i)), tags, attributes)
        elif tag == "x":
            yield from _nodes(n[2], path, (*place, ("x", str(n[1]))), tags, attributes)
    except UnsupportedTypeError:  # a key this torch cannot build (a device or dtype it lacks): not damage
        raise
    except (IndexError, KeyError, TypeError, ValueError) as exc:
        raise CorruptManifestError(f"malformed state skeleton at {path or '<root>'}: {exc!r}") from None


def _is_leaf(n: list[Any]) -> bool:
    tag = n[0]
    if tag in _DICT_TAGS:
        return not _dict_parts(n)[0]
    if tag in ("l", "t", "q"):
        return not n[1]
    return tag != "x"


def holds_torch_name(node: Any) -> bool:
    """Whether a plain-value skeleton node holds a torch.device or torch.dtype node (anywhere; nothing is
    decoded): what a newer torch or another backend may name and this process not know."""
    if type(node) is not list or not node:
        return False
    return node[0] in ("dv", "dt") or any(holds_torch_name(n) for n in node if type(n) is list)  # (nodes, lists)


def pickled_paths(skeleton: Any) -> list[str]:
    """The key paths of the pickled values in ``skeleton`` (saved with ``allow_pickle=True``), in document order,
    so that a load that may not unpickle refuses before it decodes anything. A malformed skeleton raises
    :class:`CorruptManifestError`."""
    return [path or "<root>" for _, path, _ in _nodes(skeleton, "", (), ("p",), attributes=True)]


#: sub-byte integer dtypes (torch.uint1 ... torch.int7): torch has no copy of a non-contiguous one
_SUB_BYTE = re.compile(r"u?int[1-7]")


#: per torch dtype: (stored name, element size, byte-plane width, whether its tensors are storable at all (not
#: quantized), whether it is a sub-byte integer dtype): what every leaf of that dtype would otherwise work out anew
_DTYPE_FACTS: dict[Any, tuple[str, int, int, bool, bool]] = {}


def _dtype_facts(dt: torch.dtype) -> tuple[str, int, int, bool, bool]:
    facts = _DTYPE_FACTS.get(dt)
    if facts is None:
        name = dtype_name(dt)
        size = dt.itemsize
        facts = _DTYPE_FACTS[dt] = (name, size, _plane_width(size, dt.is_complex), name not in QUANTIZED_NAMES,
                                    _SUB_BYTE.fullmatch(name) is not None)
    return facts


def _torch_leaf(t: torch.Tensor, path: str, saving: bool = True) -> Leaf:
    why = unstorable(t, saving)
    if why is not None:
        raise UnsupportedTypeError(f"cannot store {path or '<root>'}: {why}")
    name, size, width, _, _ = _dtype_facts(t.dtype)
    shape = tuple(t.shape)
    return Leaf(
        path=path,
        obj=t,
        kind="torch",
        dtype=name,
        shape=shape,
        nbytes=t.numel() * size,
        width=width,
        requires_grad=bool(t.requires_grad),
        parameter=isinstance(t, torch.nn.Parameter),
        device="cpu" if t.is_cpu else str(t.device),  # (str of a device object costs more than the test)
    )


def unstorable(t: torch.Tensor, saving: bool = True) -> str | None:
    """Why a save cannot store the tensor ``t`` (what follows "cannot store <key path>: "), or None; ``saving``:
    with what to store instead (not for a load's target, which is refused with the same reasons)."""
    if type(t) not in (torch.Tensor, torch.nn.Parameter) and not t.is_nested:  # (a jagged one is a subclass)
        if isinstance(t, torch.nn.parameter.UninitializedTensorMixin):  # type: ignore[attr-defined]
            return ("it is an uninitialized parameter or buffer of a lazy module (torch.nn.LazyLinear, ...); run a "
                    "forward pass before saving")
        # (loaded wherever a DTensor exists; torch < 2.5 has it in torch.distributed._tensor, and its
        # torch.distributed.tensor, there for tensor parallelism, has no DTensor)
        dtensors = tuple(getattr(sys.modules.get(m), "DTensor", None) for m in ("torch.distributed.tensor",
                                                                              "torch.distributed._tensor"))
        if any(isinstance(d, type) and isinstance(t, d) for d in dtensors):
            return ("it is a DTensor (sharded, by FSDP2 or tensor parallelism, say): save sharded state through "
                    "torch.distributed.checkpoint with deltackpt.distributed.DeltaStorageWriter, or a full "
                    "state dict (StateDictOptions(full_state_dict=True))")
        return f"tensor subclass {type(t).__qualname__} (deltackpt.register_type can give it an encoding)"
    if t.layout != torch.strided or t.is_quantized or t.is_meta or t.is_nested:
        what, instead = (
            ("quantized", "its dequantize(), or its int_repr() with its q_scale() and q_zero_point()")
            if t.is_quantized else
            ("meta", "nothing: a meta tensor holds no values (materialize the module with to_empty() first)")
            if t.is_meta else
            ("nested", "its unbind() (a list of its tensors)") if t.is_nested else
            (str(t.layout), "its to_dense()" + (", or its parts (indices and values)" if t.is_sparse
                                                 or "sparse" in str(t.layout) else ""))
        )
        return f"{what} tensors are not supported" + (f"; store {instead}" if saving else "")
    _, _, _, storable, sub_byte = _dtype_facts(t.dtype)
    if not storable:
        return f"dtype {t.dtype} is not supported"
    if sub_byte and not t.is_contiguous():
        return f"torch cannot copy a non-contiguous {t.dtype} tensor (to read its bytes); store a contiguous one"
    return None


#: what to store instead of a numpy array of a kind deltackpt does not store, by dtype kind
_NUMPY_INSTEAD = {
    "M": "a.view(np.int64), with its unit (np.datetime_data(a.dtype)) as a plain value",
    "m": "a.view(np.int64), with its unit (np.datetime_data(a.dtype)) as a plain value",
    "U": "a.tolist() (a list of str), or its encoded bytes as a uint8 array",
    "S": "a.tolist() (a list of bytes), or a.view(np.uint8)",
    "O": "a.tolist(), if its elements are storable",
    "V": "each field (a[name]) as an array of its own, or a.view(np.uint8)",
}


def _numpy_leaf(a: np.ndarray, path: str, saving: bool = True) -> Leaf:
    if a.dtype.kind not in _NUMPY_KINDS:
        instead = _NUMPY_INSTEAD.get(a.dtype.kind) if saving else None
        raise UnsupportedTypeError(f"cannot store {path or '<root>'}: numpy dtype {a.dtype} is not supported"
                                   + (f"; store {instead}" if instead else ""))
    return Leaf(
        path=path,
        obj=a,
        kind="numpy",
        dtype=a.dtype.str,
        shape=tuple(a.shape),
        nbytes=int(a.nbytes),
        width=_plane_width(a.dtype.itemsize, a.dtype.kind == "c"),
    )


#: Python converts ints of more decimal digits than this (and its own limit, 4300 by default) only in parts
_DIGITS = 4000
_PART = 10**_DIGITS
#: How deeply containers (dicts, lists, tuples, deques) may nest in a state: far beyond any real state, and within
#: what Python's default recursion limit lets the save and the load of such a state do.
MAX_DEPTH = 128


def int_text(x: int) -> str:
    """``str(x)`` for an int of any size: Python refuses to convert ints of more than
    ``sys.get_int_max_str_digits()`` digits in one go, a limit that is global to the process, so longer ones
    are converted in parts of :data:`_DIGITS` digits."""
    if -_PART < x < _PART:
        return str(x)
    parts: list[str] = []
    rest = abs(x)
    while rest >= _PART:
        rest, low = divmod(rest, _PART)
        parts.append(str(low).zfill(_DIGITS))
    parts.append(str(rest))
    return ("-" if x < 0 else "") + "".join(reversed(parts))


_INT_TEXT = re.compile(r"0|-?[1-9][0-9]*")
_HEX_TEXT = re.compile(r"(?:[0-9a-f]{2})*")


def int_value(text: Any) -> int:
    """The int :func:`int_text` wrote (any number of digits): its one canonical form (an optional ``-``, then
    ASCII digits without leading zeros; no ``-0``, ``+``, spaces or ``_``, which Python's ``int`` would accept)."""
    if type(text) is not str or not _INT_TEXT.fullmatch(text):
        raise ValueError(f"int node {text!r:.40}")
    digits = text[1:] if text[:1] == "-" else text
    x = _digits_value(digits)
    return -x if text[:1] == "-" else x


def _digits_value(digits: str) -> int:
    """The value of a string of ASCII digits, halves at a time: the high half times a power of ten, plus the low
    half. Python's own conversion (and one part of :data:`_DIGITS` digits after another) takes time quadratic in
    the length: 19 s for the 2 million digits a damaged or crafted record may hold, against 1.7 s so."""
    n = len(digits)
    if n <= _DIGITS:
        return int(digits)
    low = _DIGITS
    while 2 * low < n:
        low *= 2
    return _digits_value(digits[:-low]) * _power_of_ten(low) + _digits_value(digits[-low:])


@functools.lru_cache(maxsize=32)
def _power_of_ten(n: int) -> int:
    return 10**n


def flatten(state: Any, *, allow_pickle: bool = False, opaque: bool = False) -> tuple[list[Any], list[Leaf]]:
    """Return (skeleton, leaves). Raises UnsupportedTypeError naming the key path; touches nothing. With
    ``opaque`` (a target to load into, never stored) a value of a type it cannot store is an ``["?"]`` node."""
    f = _Flattener(allow_pickle, opaque)
    skeleton = f.node(state, "")
    return skeleton, f.leaves


def format_version(skeleton: Any, *, keys: bool = True) -> int:
    """The manifest format version a skeleton needs: 3 when an ``o`` node carries a module ``state_dict()``'s
    ``_metadata`` or a ``dt`` node names a quantized dtype (which older readers refuse); else 2 when it holds a
    version-2 node (:data:`V2_TAGS`, or a dict key other than str and int); else 1, so that states of older kinds
    stay readable by older readers. ``keys``: dict keys and set elements count too (a quantized dtype as one
    needs version 3); a reader checking a stored manifest passes False, as earlier writers did not count them."""
    version = 1
    stack = [skeleton]
    while stack:
        n = stack.pop()
        if type(n) is not list or not n:
            continue
        tag = n[0]
        if type(tag) is not str:
            continue  # (malformed: for the decoder to refuse)
        if (tag == "o" and len(n) == 4) or (tag == "dt" and len(n) == 2 and n[1] in QUANTIZED_NAMES):
            return 3
        if tag in V2_TAGS:
            version = 2
        if tag in ("d", "o", "C") and len(n) == 3 and type(n[1]) is type(n[2]) is list:
            if any(type(k) is not list or not k or k[0] not in ("s", "i") for k in n[1]):
                version = 2
            if keys:  # (a quantized dtype as a key needs version 3 too)
                stack.extend(n[1])
            stack.extend(n[2])
        elif tag == "D" and len(n) == 4 and type(n[3]) is list:
            if keys and type(n[2]) is list:
                stack.extend(n[2])
            stack.extend(n[3])
        elif tag in ("l", "t", "q") and len(n) >= 2 and type(n[1]) is list:
            stack.extend(n[1])
        elif keys and tag in ("S", "F") and len(n) == 2 and type(n[1]) is list:
            stack.extend(n[1])
        elif tag == "x" and len(n) == 3:
            stack.append(n[2])
    return version


PLAIN_KINDS = ("metadata may hold None, bool, int, float, str, bytes, lists, tuples, and dicts with str or int keys "
               "(and torch dtypes other than quantized ones, devices and sizes, numpy scalars)")


def encode_plain(value: Any) -> list[Any]:
    """Skeleton of a value that holds no arrays (e.g. checkpoint metadata), of version-1 kinds only: it is kept
    in the index too, which every version of the format reads. A value of a type no state may hold is refused
    as metadata's (neither registering its type nor a pickle would let metadata hold it)."""
    f = _Flattener(False, metadata=True)
    skeleton, leaves = f.node(value, ""), f.leaves
    if leaves:
        obj = leaves[0].obj
        one = (obj.numel() if isinstance(obj, torch.Tensor) else obj.size) == 1
        hint = "; pass a one-element one, such as a loss, as .item()" if one else ""
        raise UnsupportedTypeError(f"metadata may not hold tensors or arrays (found one at {leaves[0].path!r}{hint})")
    registered = _first_registered(skeleton, "")
    if registered is not None:
        raise UnsupportedTypeError(
            f"metadata may not hold values of registered types (found {registered[1]!r} at "
            f"{registered[0] or '<root>'}): every process that lists the store would need its decoder")
    if format_version(skeleton) > 1:
        raise UnsupportedTypeError(
            f"cannot store metadata at {_first_newer(skeleton) or '<root>'}: {PLAIN_KINDS}; convert sets, Counters, "
            "deques, defaultdicts, complex numbers, quantized dtypes (to their names) and module state_dict()s "
            "(whose _metadata attribute is not kept there)"
        )
    return skeleton


def _first_newer(n: Any) -> str:
    """The key path of the innermost node of skeleton ``n`` (one :func:`flatten` made, of a version above 1)
    that needs a version above 1 itself: a value of a newer kind, or a dict with a key of one."""
    path = ""
    while True:
        for k, c in node_children(n):
            if format_version(c) > 1:
                n, path = c, child_path(path, k)
                break
        else:
            return path


def _registered(n: Any, path: str) -> Iterator[tuple[str, Any]]:
    """(key path, node) of each ``x`` node in skeleton ``n``, first to last; one inside another's value has that
    value's path."""
    stack = [(n, path)]
    while stack:
        n, path = stack.pop()
        if n[0] == "x":
            yield path, n
            stack.append((n[2], path))
            continue
        stack.extend((c, child_path(path, k)) for k, c in reversed(node_children(n)))
        if n[0] in ("q", "S", "F"):
            stack.extend((c, path) for c in n[1])


def _first_registered(n: Any, path: str) -> tuple[str, str] | None:
    """(key path, type name) of the first ``x`` node in skeleton ``n`` (one :func:`flatten` made), or None."""
    return next(((p, node[1]) for p, node in _registered(n, path)), None)


class _AtNode(UnsupportedTypeError):
    """A value of a registered type :func:`_build` could not build: the message is ``head``, where the value
    lies, ``tail``. :func:`unflatten` finds the key path from ``node`` (the value's skeleton node) only then: the
    build itself keeps no paths."""

    def __init__(self, head: str, tail: str, node: Any) -> None:
        super().__init__(head + tail)
        self.head, self.tail, self.node = head, tail, node


def unflatten(skeleton: Any, leaves: list[Any], *, allow_pickle: bool = False) -> Any:
    """Rebuild a state from its skeleton; ``leaves[i]`` is the loaded object of leaf i."""
    try:
        return _build(skeleton, leaves, allow_pickle)
    except _AtNode as exc:
        try:  # (a skeleton read from a manifest may be malformed past the value: then no path)
            path = next((p for p, node in _registered(skeleton, "") if node is exc.node), None)
        except (IndexError, KeyError, TypeError, ValueError):
            path = None
        at = f" at {path!r}" if path else " at the root" if path == "" else ""
        raise UnsupportedTypeError(f"{exc.head}{at}{exc.tail}") from exc.__cause__
    except (UnsafeLoadError, UnsupportedTypeError, CorruptManifestError):
        raise
    except (IndexError, KeyError, TypeError, ValueError, struct.error, RecursionError) as exc:
        raise CorruptManifestError(f"malformed state skeleton: {exc!r:.200}") from None


def check_skeleton(skeleton: Any, entries: list[Any]) -> Any:
    """Raise :class:`CorruptManifestError` where ``skeleton`` would not rebuild a state from tensor entries of
    the kinds ``entries`` have (``.kind``): what a load would refuse, found without loading (``verify``).
    Pickled values are checked to be base64 and not unpickled; registered types are not decoded (their
    insides are checked); a dtype or device this torch does not know raises :class:`UnsupportedTypeError`.
    Returns the state built with ``entries`` in place of tensors and None in place of each registered or
    pickled value: what a restore checks when a registered decoder cannot take tensor entries."""
    try:
        return _build(skeleton, entries, _CHECK)
    except (UnsupportedTypeError, CorruptManifestError):
        raise
    except (IndexError, KeyError, TypeError, ValueError, struct.error, RecursionError) as exc:
        raise CorruptManifestError(f"malformed state skeleton: {exc!r:.200}") from None


#: ``_build``'s ``allow_pickle`` for :func:`check_skeleton`: build nothing a user or a pickle decides
_CHECK = "check"


def decode_plain(skeleton: Any) -> Any:
    return unflatten(skeleton, [])


_DICT_TAGS = ("d", "o", "C", "D")


def _dict_parts(n: list[Any]) -> tuple[Any, Any]:
    """The key nodes and value nodes of a dict-like node (a defaultdict's come after its factory)."""
    return (n[2], n[3]) if n[0] == "D" else (n[1], n[2])


def is_dict_node(n: Any) -> bool:
    """Whether skeleton node ``n`` is a dict-like container (dict, OrderedDict, Counter, defaultdict)."""
    return type(n) is list and bool(n) and n[0] in _DICT_TAGS


def is_sequence_node(n: Any) -> bool:
    """Whether skeleton node ``n`` is a list or a tuple."""
    return type(n) is list and bool(n) and n[0] in ("l", "t")


def node_children(n: Any) -> list[tuple[Any, Any]]:
    """(key, child node) of a dict-like node (keys decoded) or of a list or tuple (indices); nothing for other
    nodes or a dict whose keys do not decode. Nothing is built but the keys: for walking a skeleton."""
    if is_sequence_node(n):
        return list(enumerate(n[1]))
    if not is_dict_node(n):
        return []
    try:
        knodes, vnodes = _dict_parts(n)
        return list(zip((_plain_build(k) for k in knodes), vnodes))
    except (IndexError, KeyError, TypeError, ValueError, struct.error):
        return []


def _plain_build(n: Any) -> Any:
    """A dict key or set element: a hashable plain value (no arrays, registered types or pickles)."""
    if type(n) is not list or not n or n[0] not in ("N", "b", "i", "f", "s", "y", "c", "ns", "dt", "dv", "t", "F"):
        raise ValueError(f"dict key or set element node {n!r:.40}")
    if n[0] == "t":
        return tuple(_plain_build(v) for v in n[1])
    return _build(n, [], False)


def _hex_bytes(text: Any, size: int, what: str) -> bytes:
    """The ``size`` bytes a node's hex text holds: exactly ``2 * size`` lowercase hex digits, as writers write
    them (``bytes.fromhex`` alone would also take spaces and upper case)."""
    if type(text) is not str or len(text) != 2 * size or not _HEX_TEXT.fullmatch(text):
        raise ValueError(f"{what} node {text!r:.40}")
    return bytes.fromhex(text)


def _float_value(text: Any) -> float:
    return struct.unpack(">d", _hex_bytes(text, 8, "float"))[0]


def _build(n: Any, leaves: list[Any], allow_pickle: bool | str) -> Any:
    tag = n[0]
    if tag == "N":
        return None
    if tag == "b":
        if type(n[1]) is not bool:
            raise ValueError("bool node")
        return n[1]
    if tag == "i":
        return int_value(n[1])
    if tag == "f":
        return _float_value(n[1])
    if tag == "s":
        if type(n[1]) is not str:
            raise ValueError("str node")
        return n[1]
    if tag == "y":
        return base64.b64decode(n[1], validate=True)
    if tag in _DICT_TAGS:
        knodes, vnodes = _dict_parts(n)
        keys = [_plain_build(k) for k in knodes]
        if len(keys) != len(vnodes):
            raise ValueError("dict node")
        vals = [_build(v, leaves, allow_pickle) for v in vnodes]
        if len(dict.fromkeys(keys)) != len(keys):  # (no dict holds a key twice: one value would be dropped)
            raise ValueError("dict node holds a key twice")
        if tag == "d":
            return dict(zip(keys, vals))
        if tag == "o":
            od = OrderedDict(zip(keys, vals))
            if len(n) != 3:  # version 3: a module state_dict()'s _metadata (holds no arrays: no leaves to name)
                if len(n) != 4:
                    raise ValueError("OrderedDict node")
                od._metadata = _build(n[3], [], allow_pickle)  # type: ignore[attr-defined]
            return od
        if tag == "C":
            return Counter(dict(zip(keys, vals)))
        if n[1] is not None and n[1] not in DEFAULT_FACTORIES:
            raise ValueError(f"defaultdict factory {n[1]!r}")
        return defaultdict(None if n[1] is None else DEFAULT_FACTORIES[n[1]], zip(keys, vals))
    if tag == "l":
        return [_build(v, leaves, allow_pickle) for v in n[1]]
    if tag == "t":
        return tuple(_build(v, leaves, allow_pickle) for v in n[1])
    if tag == "q":
        if n[2] is not None and (type(n[2]) is not int or not 0 <= n[2] < 1 << 63 or len(n[1]) > n[2]):
            raise ValueError("deque maxlen")  # (a deque holding more than its maxlen would drop items)
        return deque((_build(v, leaves, allow_pickle) for v in n[1]), maxlen=n[2])
    if tag in ("S", "F"):
        elements = (set if tag == "S" else frozenset)(_plain_build(v) for v in n[1])
        if len(elements) != len(n[1]):
            raise ValueError("set node holds an element twice")
        return elements
    if tag == "c":
        return complex(_float_value(n[1]), _float_value(n[2]))
    if tag in ("T", "A"):
        i = n[1]
        if type(i) is not int or not 0 <= i < len(leaves):
            raise ValueError(f"leaf index {i!r}")
        leaf = leaves[i]
        kind = getattr(leaf, "kind", None) or ("torch" if isinstance(leaf, torch.Tensor) else "numpy")
        if (tag == "T") != (kind == "torch"):
            raise ValueError(f"a {tag!r} node names tensor entry {i}, whose kind is {kind}")
        return leaf
    if tag == "dt":
        return torch_dtype(n[1], value=True)
    if tag == "dv":
        if type(n[1]) is not str:
            raise ValueError(f"device node {n[1]!r:.60}")
        try:
            return torch.device(n[1])
        except (RuntimeError, ValueError):  # a backend this torch lacks ("npu:0"): not damage of the store
            raise UnsupportedTypeError(f"the checkpoint holds torch.device {n[1]!r:.60}, which this torch does "
                                       "not know") from None
    if tag == "sz":
        if type(n[1]) is not list or any(type(x) is not int or not 0 <= x < 1 << 63 for x in n[1]):
            raise ValueError(f"torch.Size node {n[1]!r:.60}")
        return torch.Size(n[1])
    if tag == "ns":
        dt = numpy_dtype(n[1])
        return np.frombuffer(_hex_bytes(n[2], dt.itemsize, "numpy scalar"), dtype=dt)[0]
    if tag == "x" and allow_pickle == _CHECK:
        if type(n[1]) is not str:
            raise ValueError("registered type node")
        _build(n[2], leaves, allow_pickle)
        return None
    if tag == "x":
        hook = _HOOKS_BY_NAME.get(n[1])
        if hook is None:
            raise _AtNode(f"the checkpoint holds a value of registered type {n[1]!r}",
                          "; register its decoder with deltackpt.register_type before loading", n)
        value = _build(n[2], leaves, allow_pickle)
        try:
            return hook.decode(value)
        except Exception as exc:  # the user's decoder failed: no damage of the store (restore must not pass it by)
            raise _AtNode(f"the decoder registered for type {n[1]!r} failed", f": {exc!r}", n) from exc
    if tag == "p" and allow_pickle == _CHECK:
        base64.b64decode(n[1], validate=True)
        return None
    if tag == "p":
        if allow_pickle is not True:
            raise UnsafeLoadError(
                "the checkpoint holds pickled values; load it with allow_pickle=True only if you trust the store"
            )
        return pickle.loads(base64.b64decode(n[1]))  # noqa: S301 - explicit opt-in
    raise ValueError(f"unknown node tag {tag!r}")
