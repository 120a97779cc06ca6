"""Components: the stateful objects a :class:`~deltackpt.Checkpointer` saves and puts back.

Where it sits: between the training loop and the Checkpointer's captured state. A component (``model=``,
``optimizer=``, ``scheduler=``, ``scaler=``, ``data=``) is one object with ``state_dict()`` and
``load_state_dict()``, or a list or dict of them (a *group*, :func:`as_group`). A save captures each group's
state dicts (:func:`group_state`) and the pairing of optimizer states with parameters that predicted frames use
(:func:`param_pairs`). A restore first runs the checks of :mod:`deltackpt.fitcheck` on the checkpoint's
skeleton, then loads each group (:func:`load_group`) and writes the plain ``extra`` values back into the objects
the training loop holds (:func:`put_back`).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from deltackpt import _lazy
from deltackpt.staging import unfillable
from deltackpt.tree import child_path

if TYPE_CHECKING:
    import torch
else:
    torch = _lazy.module("torch", globals())


def stateful(obj: Any) -> bool:
    """Whether ``obj`` is one component (it has ``state_dict()`` and ``load_state_dict()``), not a group."""
    return callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))


class Stateful(Protocol):
    """What a :class:`Checkpointer` saves and restores: a model, optimizer, LR scheduler, ``GradScaler``, data
    loader, or any object with these two methods."""

    def state_dict(self) -> Any: ...

    def load_state_dict(self, state_dict: Any, /) -> Any: ...


#: one stateful object, or several in a list, tuple or dict (``model=[encoder, decoder]``)
Members = Stateful | Sequence[Stateful] | Mapping[Any, Stateful]


def as_group(obj: Any, what: str = "object") -> Any:
    """One stateful object, or a list/tuple/dict of them (each member checked: TypeError naming it)."""
    if obj is None:
        return None
    if stateful(obj):
        return obj
    if isinstance(obj, Mapping):
        group: Any = {str(k): v for k, v in obj.items()}
    elif isinstance(obj, Sequence) and not isinstance(obj, (str, bytes)):
        group = list(obj)
    else:
        raise TypeError(f"{what}: {type(obj).__name__} has no state_dict()/load_state_dict()")
    for path, member in group_members(group, what):
        if not stateful(member):
            raise TypeError(f"{path}: {type(member).__name__} has no state_dict()/load_state_dict()")
    return group


def tensors_of(obj: Any) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) of a module's parameters and buffers; nothing for other stateful objects."""
    if isinstance(obj, torch.nn.Module):
        yield from obj.named_parameters()
        yield from ((k, v) for k, v in obj.named_buffers() if v is not None)


def group_state(g: Any) -> Any:
    """The state dicts of group ``g``, grouped as it is (a dict, a list or one), for a save to capture."""
    if g is None:
        return None
    if isinstance(g, dict):
        return {k: v.state_dict() for k, v in g.items()}
    if isinstance(g, list):
        return [v.state_dict() for v in g]
    return g.state_dict()


def group_members(g: Any, path: str) -> Iterator[tuple[str, Any]]:
    """(key path of its state dict, object) of each member of a group (see :func:`as_group`)."""
    if isinstance(g, dict):
        for k, v in g.items():
            yield child_path(path, k), v
    elif isinstance(g, list):
        for i, v in enumerate(g):
            yield child_path(path, i), v
    elif g is not None:
        yield path, g


def param_pairs(model: Any, optimizer: Any) -> dict[str, str]:
    """Which parameter each optimizer state belongs to, as key paths of :meth:`Checkpointer.capture`'s state:
    ``optimizer.state[3]`` -> ``model.blocks.0.attn.weight``. The store pairs them for predicted frames
    (:func:`deltackpt.predict.plan`), exactly, where guessing from shapes and order fails: frozen parameters,
    an EMA copy of the weights, parameter groups in another order than the model's."""
    names: dict[int, str] = {}
    for mpath, module in group_members(model, "model"):
        named = getattr(module, "named_parameters", None)
        if callable(named):
            for name, param in named():
                names.setdefault(id(param), child_path(mpath, name))
    pairs: dict[str, str] = {}
    for opath, opt in group_members(optimizer, "optimizer"):
        groups = getattr(opt, "param_groups", None)
        if not isinstance(groups, list):
            continue
        # torch numbers the states of an optimizer's state_dict by position over all its groups' params
        params = [p for group in groups for p in group.get("params", ())]
        for i, param in enumerate(params):
            name = names.get(id(param))
            if name is not None:
                pairs[child_path(child_path(opath, "state"), i)] = name
    return pairs


def present_members(g: Any, state: Any, what: str) -> tuple[Any, list[str]]:
    """The members of group ``g`` that the saved ``state`` holds a state for (a group like ``g``, or None), and
    the names of those it lacks: a whole component, or members of a dict of them."""
    if g is None:
        return None, []
    if state is None:
        return None, [what]
    if isinstance(g, dict) and isinstance(state, Mapping):
        return {k: v for k, v in g.items() if k in state}, [f"{what}[{k!r}]" for k in g if k not in state]
    return g, []


def with_states(g: Any, state: Any) -> list[tuple[str, Any, Any]]:
    """(name, member, its saved state) of each member of a group (after :func:`group_check`)."""
    if isinstance(g, dict):
        return [(f"[{k!r}]", v, state[k]) for k, v in g.items()]
    if isinstance(g, list):
        return [(f"[{i}]", v, s) for i, (v, s) in enumerate(zip(g, state))]
    return [("", g, state)]


def load_group(g: Any, state: Any) -> None:
    """``load_state_dict`` of each member of group ``g`` with its saved state (after the fit checks passed)."""
    if g is None:
        return
    for _, member, saved in with_states(g, state):
        if isinstance(member, torch.nn.Module) and type(saved) is OrderedDict and not hasattr(saved, "_metadata"):
            # A checkpoint of a version before stores kept a state_dict()'s module versions. Without them
            # load_state_dict takes every module's state for a legacy one and migrates it; the job saved it
            # from modules of the versions this code has, the best guess there is.
            saved._metadata = getattr(member.state_dict(), "_metadata", None)  # type: ignore[attr-defined]
        member.load_state_dict(saved)
        if isinstance(member, torch.optim.Optimizer):
            param_layouts(member)


def param_layouts(opt: torch.optim.Optimizer) -> None:
    """Give each tensor of ``opt``'s loaded state that has its parameter's shape the parameter's memory layout, as
    the optimizer made it (``zeros_like(p)``): the store restores tensors contiguous, and for a parameter in
    another layout (a channels_last CNN's) torch's fused kernels would pair the elements of parameter and state
    wrongly, and the others round otherwise than the run that saved."""
    for p, st in opt.state.items():
        if not isinstance(p, torch.Tensor) or not isinstance(st, dict) or torch.nn.parameter.is_lazy(p):
            continue  # (a lazy parameter has no shape yet)
        for k, v in st.items():
            if isinstance(v, torch.Tensor) and v.shape == p.shape and v.dim() > 1 and v.stride() != p.stride():
                laid = torch.empty_like(p, dtype=v.dtype, device=v.device)  # (preserve_format: p's strides)
                if laid.stride() != v.stride():
                    st[k] = laid.copy_(v)


def plain_extras(extra: Mapping[str, Any]) -> dict[str, Any]:
    """The ``extra`` entries without ``state_dict()``: their tensors are offered to the restore's load."""
    return {k: v for k, v in extra.items() if not stateful(v)}


def put_back(live: Any, saved: Any) -> Any:
    """What a plain ``extra`` entry (or a value in one) is after a restore: ``saved``, written into ``live``'s own
    objects where they can hold it, so that the training loop's references see the restored values. A tensor
    (or numpy array) of the same shape is copied into (converting the dtype, as ``load_state_dict`` does; the
    restore's load decoded those of the same dtype in place already); a dict is refilled (its keys that the
    checkpoint lacks stay), a list too; a tuple keeps its tensors. Anything else is replaced by ``saved``, and so
    is a tensor whose elements share memory (an ``expand``ed view), which no copy can fill."""
    if (isinstance(live, torch.Tensor) and isinstance(saved, torch.Tensor) and live.shape == saved.shape
            and (live.is_inference() or unfillable(live) is None)):  # (inference tensors: written below)
        if saved is not live:
            # (a tensor made in inference mode, an EMA's say, can be written only in inference mode)
            with torch.inference_mode() if live.is_inference() else torch.no_grad():
                live.copy_(saved)
        return live
    if type(live) is np.ndarray and type(saved) is np.ndarray and live.shape == saved.shape and live.flags.writeable:
        if saved is not live:
            live[...] = saved
        return live
    if isinstance(live, dict) and isinstance(saved, Mapping):
        values = [(k, put_back(live[k], v) if k in live else v) for k, v in saved.items()]
        kept = [(k, v) for k, v in live.items() if k not in saved]
        live.clear()  # (item by item: a Counter's update() would add, an OrderedDict's order is the checkpoint's)
        for k, v in values + kept:
            live[k] = v
        return live
    if type(live) is list and type(saved) is list:
        live[:] = [put_back(live[i], v) if i < len(live) else v for i, v in enumerate(saved)]
        return live
    if type(live) is tuple and type(saved) is tuple and len(live) == len(saved):
        items = tuple(put_back(a, b) for a, b in zip(live, saved))
        return live if all(a is b for a, b in zip(items, live)) else items
    return saved
