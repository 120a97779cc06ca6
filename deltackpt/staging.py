"""Staging: where a tensor's bytes are on the host while a save reads them or a load writes them.

Where it sits: between :mod:`deltackpt.tree` (which finds the tensors of a state) and the chunk pipeline of
:class:`deltackpt.Store`, which works on flat uint8 arrays of host memory. A save reads each tensor through
:func:`host_bytes` (a view of a contiguous CPU tensor, else a copy: into a reusable :class:`Pinned` buffer for an
accelerator's). A load decodes into :func:`new_output` (pinned for CUDA) or, filling given tensors in place, into
:func:`decode_target` (the tensor's own memory when its layout allows, else a staging buffer that
:func:`copy_back` copies into the tensor's layout or device); :func:`unfillable` and :func:`overlapping` refuse
targets that cannot be written or that share memory. ``map_location`` and stored devices are resolved here,
before anything is decoded.

An async save of a :class:`~deltackpt.Checkpointer` first copies the state into :class:`StagingBuffers` (host
buffers reused from save to save), so that training goes on while the background save reads the copy.
"""

from __future__ import annotations

import functools
from collections import Counter, OrderedDict, defaultdict, deque
from collections.abc import Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from deltackpt import _lazy, tree
from deltackpt.errors import CorruptManifestError, UnsupportedTypeError
from deltackpt.tree import Encoded, alias_key, child_path, encode_registered, flatten, registered_types, unstorable

if TYPE_CHECKING:
    import torch

    from deltackpt.index import Record
    from deltackpt.manifest import TensorEntry
else:
    torch = _lazy.module("torch", globals())


def copy_refused(exc: BaseException, where: str) -> UnsupportedTypeError | None:
    """The error a save raises for the leaf at key path ``where`` when ``exc`` is torch's refusal to copy a tensor
    of its dtype (a sub-byte one): NotImplementedError, or before torch 2.4 or so a RuntimeError saying the same
    (``"copy_kernel" not implemented for 'UInt4'``); None for any other exception (an out-of-memory, say)."""
    if isinstance(exc, NotImplementedError) or (isinstance(exc, RuntimeError) and "not implemented for" in str(exc)):
        return UnsupportedTypeError(f"cannot store {where}: torch cannot read its bytes: {exc}")
    return None


def host_bytes(obj: torch.Tensor | np.ndarray, staging: Pinned | None = None) -> np.ndarray:
    """The leaf's bytes as a flat uint8 array on the host (a view when already contiguous on the CPU).

    A tensor on an accelerator is copied into ``staging`` (a reusable pinned host buffer) when given, so the
    device-to-host copy runs at full speed and allocates nothing; the caller must not reuse ``staging`` while
    views of the previous tensor are still being read.
    """
    if isinstance(obj, torch.Tensor):
        if obj.is_cpu and obj.is_contiguous() and not obj.is_conj() and not obj.is_neg():
            # the usual case, taken first: a view of the tensor's own memory (what byte_view makes of it); numpy
            # views a dtype it has in fewer torch calls (half the cost, for a save of many small tensors); not an
            # empty tensor, whose dimensions numpy may refuse (4611686018427387903 x 4 x 0: "array is too big")
            if obj.dtype in _numpy_viewable() and obj.numel():
                a = obj.detach().numpy().reshape(-1)
                if a.flags.c_contiguous:
                    return a.view(np.uint8)
            whole = obj.detach().reshape(-1)
            if whole.stride(0) == 1:
                return whole.view(torch.uint8).numpy()
        t = obj.detach().resolve_conj().resolve_neg()
        flat = byte_view(t)
        if flat is None:
            flat = byte_view(torch.empty(t.shape, dtype=t.dtype, device=t.device).copy_(t))
            assert flat is not None
        if flat.device.type != "cpu":
            if staging is None:
                flat = flat.to("cpu")
            else:
                host = staging.take(flat.numel())
                host.copy_(flat, non_blocking=flat.device.type == "cuda")
                if flat.device.type == "cuda":
                    torch.cuda.current_stream(flat.device).synchronize()
                flat = host
        return flat.numpy()
    a = np.ascontiguousarray(obj)
    return a.reshape(-1).view(np.uint8)


@functools.cache
def _numpy_viewable() -> frozenset[Any]:
    """The torch dtypes whose CPU tensors ``Tensor.numpy()`` views (a function: torch is imported at first use)."""
    return frozenset((torch.float32, torch.float64, torch.float16, torch.int64, torch.int32, torch.int16, torch.int8,
                      torch.uint8, torch.bool))


def byte_view(t: torch.Tensor) -> torch.Tensor | None:
    """A flat uint8 view sharing ``t``'s memory, or None when its layout has none (non-contiguous, or a
    one-element tensor whose stride is not 1, which torch calls contiguous but cannot view as bytes) or its
    memory does not hold its values (a lazily conjugated or negated view)."""
    if not t.is_contiguous() or t.is_conj() or t.is_neg():
        return None
    flat = t.reshape(-1)
    if flat.stride(0) != 1:
        return None
    return flat.view(torch.uint8)


def unfillable(obj: torch.Tensor | np.ndarray) -> str | None:
    """Why ``obj`` cannot be filled in place with a stored array's values, or None when it can: a read-only
    numpy array, a view in which elements may share memory (an ``expand``ed or ``broadcast_to`` view), or an
    inference tensor outside inference mode (torch refuses to write one there, as ``load_state_dict`` would)."""
    if (obj.size if isinstance(obj, np.ndarray) else obj.numel()) == 0:
        return None
    if isinstance(obj, torch.Tensor) and obj.is_inference() and not torch.is_inference_mode_enabled():
        return "it is an inference tensor (made under torch.inference_mode), which torch lets no one write outside it"
    if isinstance(obj, np.ndarray):
        if not obj.flags.writeable:
            return "it is a read-only array"
        strides, item = [abs(st) for st in obj.strides], obj.itemsize
    else:
        strides, item = [abs(st) for st in obj.stride()], 1
    extent = item  # dims from the smallest stride up: each must step past everything the inner ones reach
    for st, n in sorted((st, n) for st, n in zip(strides, obj.shape) if n > 1):
        if st < extent:
            return "elements of it share memory (an expanded or broadcast view)"
        extent += (n - 1) * st
    return None


def memory_span(obj: torch.Tensor | np.ndarray) -> tuple[str, int, int] | None:
    """(device, first byte, one past the last byte) of the memory ``obj``'s elements lie in; None when empty."""
    if isinstance(obj, np.ndarray):
        if obj.size == 0:
            return None
        device, base, item = "cpu", obj.__array_interface__["data"][0], obj.itemsize
        strides = obj.strides  # (in bytes)
    else:
        n = obj.numel()
        if n == 0:
            return None
        device, base, item = str(obj.device), obj.data_ptr(), obj.element_size()
        if obj.is_contiguous():
            return device, base, base + n * item
        strides = tuple(st * item for st in obj.stride())
    lo = hi = 0
    for n, st in zip(obj.shape, strides):
        if st >= 0:
            hi += (n - 1) * st
        else:
            lo += (n - 1) * st
    return device, base + lo, base + hi + item


def _share_memory(a: torch.Tensor | np.ndarray, b: torch.Tensor | np.ndarray) -> bool:
    """Whether two arrays whose spans overlap share an element's bytes (interleaved views do not): exact for
    what numpy can view, else assumed."""
    try:
        x, y = (o if isinstance(o, np.ndarray) else _int_view(o.detach()).numpy() for o in (a, b))
    except (TypeError, RuntimeError):  # not on the CPU (or a layout numpy cannot view)
        return True
    try:
        return bool(np.shares_memory(x, y, max_work=1 << 20))  # type: ignore[arg-type]  # (stubs: -1 or 0 only)
    except getattr(np, "exceptions", np).TooHardError:  # (numpy < 1.25 has it at the top level)
        return True


def strides(obj: torch.Tensor | np.ndarray) -> tuple[int, ...]:
    """Strides in bytes."""
    if isinstance(obj, np.ndarray):
        return tuple(obj.strides)
    return tuple(st * obj.element_size() for st in obj.stride())


def _int_view(t: torch.Tensor) -> torch.Tensor:
    """``t`` viewed as integers of its element size (numpy has no bfloat16 or float8), same layout."""
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}.get(t.element_size(), t.dtype))


def overlapping(objs: Sequence[torch.Tensor | np.ndarray]) -> list[tuple[int, int]]:
    """Every pair (i, j), i < j, of ``objs`` whose memory overlaps. A sweep by address compares each array with
    every earlier-starting one whose span it starts inside: with strided arrays the one reaching furthest need
    not be the one it shares memory with (``buf[0::2]``, ``buf[1::2]`` and ``buf[10:11]``)."""
    spans = sorted((span, n) for n, o in enumerate(objs) if (span := memory_span(o)) is not None)
    out: list[tuple[int, int]] = []
    active: list[tuple[int, int]] = []  # (end, index) of the spans of this device that may reach the next one
    device = None
    for (dev, lo, hi), n in spans:
        if dev != device:
            device, active = dev, []
        active = [(end, k) for end, k in active if end > lo]
        out += [(min(k, n), max(k, n)) for _, k in active if _share_memory(objs[k], objs[n])]
        active.append((hi, n))
    return sorted(out)


def decode_target(obj: torch.Tensor | np.ndarray) -> tuple[np.ndarray, Any]:
    """Where a stored array meant for ``obj`` (a tensor or array to fill in place) is decoded: ``(bytes, None)``,
    ``obj``'s own memory, when it is a contiguous writable CPU array; else ``(bytes, staging)``, a contiguous
    host buffer (pinned for CUDA) that :func:`copy_back` then copies into ``obj``'s layout or device."""
    if isinstance(obj, torch.Tensor):
        view = byte_view(obj.detach()) if obj.device.type == "cpu" else None
        if view is not None:
            return view.numpy(), None
        staging: Any = torch.empty(obj.shape, dtype=obj.dtype, device="cpu", pin_memory=obj.device.type == "cuda")
        return byte_view(staging).numpy(), staging  # type: ignore[union-attr]
    if obj.flags.c_contiguous and obj.flags.writeable:
        return np.asarray(obj).reshape(-1).view(np.uint8), None  # (an np.memmap's memory, as a plain array)
    staging = np.empty(obj.shape, dtype=obj.dtype)
    return staging.reshape(-1).view(np.uint8), staging


def copy_back(copies: Sequence[tuple[Any, Any]]) -> None:
    """Copy each decoded staging buffer into its target (see :func:`decode_target`); returns once CUDA targets
    hold their values."""
    devices: set[torch.device] = set()
    with torch.no_grad():
        for obj, staging in copies:
            if isinstance(obj, torch.Tensor):
                # (asynchronous only to CUDA, from pinned memory, and waited for below: another accelerator's
                # non-blocking copy from pageable memory may read it after it is freed, pytorch#139550)
                obj.copy_(staging, non_blocking=obj.device.type == "cuda")
                devices.add(obj.device)
            else:
                obj[...] = staging
    synchronize_cuda(devices)


def synchronize_cuda(devices: Iterable[torch.device]) -> None:
    """Wait for the work queued on each CUDA device of ``devices`` (the asynchronous copies to or from pinned host
    memory). ``torch.cuda.synchronize()`` without a device waits for the current device only: the copies of a
    model spread over several GPUs in one process would still be running."""
    for d in {d for d in devices if d.type == "cuda"}:
        torch.cuda.synchronize(d)


class Pinned:
    """A growable pinned (page-locked) host buffer for device-to-host copies of accelerator tensors."""

    def __init__(self) -> None:
        self._buf: torch.Tensor | None = None

    def take(self, n: int) -> torch.Tensor:
        if self._buf is None or self._buf.numel() < n:
            self._buf = None
            self._buf = torch.empty(max(n, 1), dtype=torch.uint8, device="cpu", pin_memory=torch.cuda.is_available())
        return self._buf[:n]


def _output(t: TensorEntry, map_location: Any,
            devices: dict[str, torch.device] | None = None) -> tuple[torch.Tensor | np.ndarray, torch.device | None]:
    """A new tensor (pinned for CUDA) or array to decode the stored tensor ``t`` into, and for a tensor the device
    it goes to. Its storage holds exactly ``t.nbytes`` bytes (checked: a dtype whose elements are not whole bytes
    would have the kernel write past it). ``devices``: the devices resolved so far for this ``map_location``, by
    stored device (a load's, tensor after tensor), used and added to."""
    if t.kind != "torch":
        return np.empty(t.shape, dtype=tree.numpy_dtype(t.dtype)), None
    dt = tree.torch_dtype(t.dtype)
    dev = devices.get(t.device) if devices is not None else None
    if dev is None:
        dev = _resolve_device(t.device, map_location)
        if devices is not None:
            devices[t.device] = dev
    out = torch.empty(t.shape, dtype=dt, device="cpu", pin_memory=dev.type == "cuda")
    if out.untyped_storage().nbytes() != t.nbytes:
        raise CorruptManifestError(f"{t.nbytes} bytes for a {t.dtype} tensor of shape {t.shape}, which holds "
                                   f"{out.untyped_storage().nbytes()}")
    return out, dev


def new_output(rec: Record, t: TensorEntry, map_location: Any, devices: dict[str, torch.device] | None = None
               ) -> tuple[torch.Tensor | np.ndarray, torch.device | None, np.ndarray]:
    """:func:`_output` for a load of checkpoint ``rec``, with its bytes as a uint8 array; an error names the
    checkpoint and the tensor."""
    try:
        out, dev = _output(t, map_location, devices)
    except (CorruptManifestError, UnsupportedTypeError) as exc:  # (a dtype, a device)
        raise type(exc)(f"checkpoint {rec.id} (step {rec.step}), tensor {t.key!r}: {exc}") from None
    except (RuntimeError, MemoryError) as exc:
        if isinstance(exc, RuntimeError) and "alloc" not in str(exc):
            raise
        raise MemoryError(f"checkpoint {rec.id} (step {rec.step}), tensor {t.key!r}: cannot allocate its "
                          f"{t.nbytes} bytes") from exc
    byte_view = out.reshape(-1).view(np.uint8) if isinstance(out, np.ndarray) \
        else out.reshape(-1).view(torch.uint8).numpy()  # (a numpy array's load does not import torch)
    return out, dev, byte_view


def check_map_location(map_location: Any) -> None:
    """TypeError/ValueError for a ``map_location`` that is not one or names no device torch knows, raised by every
    load, whether or not the checkpoint holds a tensor it applies to (its keys, the stored devices, are not
    checked: a dict may cover devices a checkpoint does not use)."""
    if map_location is None:
        return
    if not isinstance(map_location, (Mapping, str, torch.device)):
        raise TypeError("map_location must be None, a device, a device string or a dict {stored: target}, got "
                        f"{type(map_location).__name__}")
    for stored, target in map_location.items() if isinstance(map_location, Mapping) else [(None, map_location)]:
        if isinstance(map_location, Mapping) and not isinstance(stored, (str, torch.device)):
            raise TypeError("map_location's keys must be stored devices (a device or a device string, 'cuda:0'), got "
                            f"{type(stored).__name__} {stored!r:.40}")
        where = "map_location" if stored is None else f"map_location[{stored!r:.60}]"
        if not isinstance(target, (str, torch.device)):
            raise TypeError(f"{where} must be a device or a device string, got {type(target).__name__} {target!r:.40}")
        try:
            torch.device(target)
        except (RuntimeError, ValueError, TypeError):
            raise ValueError(f"{where} {'= ' if stored is not None else ''}{target!r:.60} is not a device torch "
                             "knows") from None


def _mapped_from(map_location: Mapping[Any, Any], stored: str) -> Any:
    """What a ``map_location`` dict maps the stored device ``stored`` (a device string) to, keyed by that string or
    by a device (``{torch.device("cuda:0"): "cpu"}``); ``stored`` itself where it names none."""
    if stored in map_location:
        return map_location[stored]
    for key, target in map_location.items():
        if isinstance(key, torch.device) and str(key) == stored:
            return target
    return stored


def _resolve_device(stored: str, map_location: Any) -> torch.device:
    """The device a tensor stored on ``stored`` loads onto, for a ``map_location`` that
    :func:`check_map_location` passed; UnsupportedTypeError for a device this process cannot use, saying
    whether it came from the checkpoint or from ``map_location``."""
    if map_location is None or isinstance(map_location, Mapping):
        target = stored if map_location is None else _mapped_from(map_location, stored)
        mapped = target is not stored
    else:
        target, mapped = map_location, True
    try:
        dev = torch.device(target)
    except (RuntimeError, ValueError, TypeError):  # (only a stored device: a backend this torch lacks, "npu:0")
        raise UnsupportedTypeError(f"the checkpoint holds a tensor on device {target!r:.60}, which this torch "
                                   "does not know: pass map_location='cpu' (or a dict {stored: target})") from None
    if not _usable(str(dev)):
        why = "CUDA is not available" if dev.type == "cuda" and not torch.cuda.is_available() else \
            f"this process cannot put tensors on {str(dev)!r:.60}"
        if mapped:
            raise UnsupportedTypeError(f"map_location sends tensors stored on {stored!r:.60} to {str(dev)!r:.60}, "
                                       f"but {why}")
        raise UnsupportedTypeError(f"the checkpoint holds a tensor on device {stored!r:.60}, and {why}: pass "
                                   "map_location='cpu' (or a dict {stored: target})")
    return dev


@functools.lru_cache(maxsize=64)
def _usable(device: str) -> bool:
    """Whether this process can hold tensors on ``device``, which torch knows by name (``mps`` on a machine
    without Metal, ``xpu:0`` in a build without it): asked before a load decodes anything, which then could not
    put its tensors there. ``meta`` holds no data: a load there would drop every value."""
    dev = torch.device(device)
    if dev.type == "cpu":
        return True
    if dev.type == "meta":
        return False
    if dev.type == "cuda":
        return torch.cuda.is_available() and (dev.index or 0) < torch.cuda.device_count()
    try:
        torch.empty(0, device=dev)
    except Exception:  # (RuntimeError, NotImplementedError, AssertionError, ModuleNotFoundError: backend-dependent)
        return False
    return True


@dataclass
class _Pass:
    """What one :meth:`StagingBuffers.snapshot` carries down the state. A method that recurses with it, not a nested
    function calling itself: that is a reference cycle (the function and its closure cell), which kept every
    staging buffer and the state's own tensors alive after ``close()`` until the cyclic collector next ran."""

    registered: Any  #: registered_types() at the start of the copy
    #: by tree.alias_key: tied tensors get one buffer and stay one leaf ...
    seen: dict[Hashable, Any] = field(default_factory=dict)
    #: ... and the sources those keys name, alive until the copy ends: an alias key holds a memory address, and a
    #: registered type's encoder may return a new array that is freed once copied, whose address the next one's
    #: could then take (and be taken for the same tensor)
    sources: list[Any] = field(default_factory=list)
    devices: set[torch.device] = field(default_factory=set)  #: the devices copies were queued from


#: CPU tensors up to this many bytes are copied by torch (on one thread: below its grain size), larger ones by numpy
_SMALL_COPY = 32768


def _copy_cpu(buf: torch.Tensor, src: torch.Tensor) -> bool:
    """Copy the CPU tensor ``src``'s bytes into ``buf`` (a contiguous tensor of its dtype and shape) as uint8, which
    copies bits whatever they mean. A small tensor takes torch's ``copy_`` (3x faster than numpy views of both for
    a 1 KiB tensor), a large one numpy's single-threaded memcpy (torch's multi-threaded ``copy_`` would compete with
    the training loop's threads). False (nothing copied) where ``src``'s layout has no byte view: non-contiguous,
    a size-1 dimension with an odd stride, lazily conjugated or negated. (:func:`byte_view`'s conditions,
    without its flattening ``reshape``: through it, the snapshot of 48,000 small tensors took 0.95 s, not 0.8.)"""
    if src.dim() == 0:  # (a step count: a 0-dim tensor has no view of another dtype)
        src, buf = src.reshape(1), buf.reshape(1)
    if not src.is_contiguous() or src.is_conj() or src.is_neg() or src.stride(-1) != 1:
        return False
    if src.numel() * src.element_size() <= _SMALL_COPY:
        buf.view(torch.uint8).copy_(src.view(torch.uint8))
    else:
        np.copyto(buf.view(torch.uint8).numpy().reshape(-1), src.view(torch.uint8).numpy().reshape(-1))
    return True


class StagingBuffers:
    """Reusable host buffers holding a consistent copy of the state while a background save reads it.

    One buffer per key path, reused from save to save while dtype and shape stay the same (pinned host memory
    for CUDA sources, so the device-to-host copy is asynchronous and fast). Memory is one copy of the
    state's tensors, however many saves run.
    """

    def __init__(self) -> None:
        self._buffers: dict[tuple[Any, ...], torch.Tensor | np.ndarray] = {}
        self._used: set[tuple[Any, ...]] = set()
        #: the device each staged tensor of the last snapshot was copied from, where not the CPU (by ``id`` of the
        #: staged tensor, which the snapshot holds): the save records it, as a save of the tensor itself does
        self.devices: dict[int, str] = {}

    @property
    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() if isinstance(b, torch.Tensor) else b.nbytes
                   for b in self._buffers.values())

    def _buffer_for(self, path: tuple[Any, ...], src: torch.Tensor) -> torch.Tensor:
        buf = self._buffers.get(path)
        pin = src.device.type == "cuda"
        if not (isinstance(buf, torch.Tensor) and buf.dtype == src.dtype and buf.shape == src.shape
                and (not pin or buf.is_pinned())):  # (a CPU tensor's buffer, for a tensor moved to the GPU since)
            buf = torch.empty(src.shape, dtype=src.dtype, device="cpu", pin_memory=pin)
            self._buffers[path] = buf
        return buf

    def snapshot(self, state: Any) -> Any:
        """Copy ``state`` (containers rebuilt, tensors and arrays copied into staging) and return the copy."""
        self._used = set()
        self.devices = {}
        run = _Pass(registered_types())
        try:
            snap = self._copy(state, (), run)
        except Exception:
            # a state a save refuses (a reference cycle, nesting past any limit, a meta or nested tensor): the
            # UnsupportedTypeError naming the key path that a synchronous save raises, not the copy's own error
            flatten(state)
            raise
        synchronize_cuda(run.devices)  # (every device: a model spread over several GPUs)
        for path in set(self._buffers) - self._used:  # tensors that left the state: free their buffers
            del self._buffers[path]
        return snap

    def _copy(self, obj: Any, path: tuple[Any, ...], run: _Pass) -> Any:
        """The copy of ``obj`` at ``path`` (the keys down to it: no string collisions) for :meth:`snapshot`."""
        # (before tensors: a registered tensor subclass is encoded now, its tensors copied like any other)
        if type(obj) in run.registered and (encoded := encode_registered(obj)) is not None:
            return Encoded(encoded.name, self._copy(encoded.value, path, run))
        if isinstance(obj, torch.Tensor):
            # (refused at the step, as a sync save refuses it, not by the background save; the rest of what
            # unstorable() checks fails the copy below, and costs ~10 us a tensor to ask first. Not a quantized
            # tensor: torch's byte view of one crashed the process (SIGSEGV) in the copy)
            why = (unstorable(obj, True) if type(obj) not in (torch.Tensor, torch.nn.Parameter)
                   or obj.layout != torch.strided or obj.is_quantized else None)
            if why is not None:
                where = functools.reduce(child_path, path, "") or "<root>"
                raise UnsupportedTypeError(f"cannot store {where}: {why}")
            key = alias_key(obj)
            if key in run.seen:
                return run.seen[key]
            src = obj.detach()
            try:
                buf = self._buffer_for(path, src)
                if src.device.type != "cpu" or not _copy_cpu(buf, src):
                    with torch.no_grad():
                        buf.copy_(src, non_blocking=src.device.type == "cuda")
            except (NotImplementedError, RuntimeError) as exc:  # (a sub-byte dtype torch cannot copy; not an OOM)
                refused = copy_refused(exc, functools.reduce(child_path, path, "") or "<root>")
                if refused is None:
                    raise
                raise refused from exc
            run.devices.add(src.device)
            self._used.add(path)
            out: Any = buf
            if isinstance(obj, torch.nn.Parameter):
                out = torch.nn.Parameter(buf, obj.requires_grad)
            elif obj.requires_grad:  # saved and restored with the flag, as a synchronous save keeps it
                out = buf.detach().requires_grad_()
            if src.device.type != "cpu":
                self.devices[id(out)] = str(src.device)
            run.seen[key] = out
            run.sources.append(obj)
            return out
        if isinstance(obj, np.ndarray):
            key = alias_key(obj)
            if key in run.seen:
                return run.seen[key]
            nbuf = self._buffers.get(path)
            if not (isinstance(nbuf, np.ndarray) and nbuf.dtype == obj.dtype and nbuf.shape == obj.shape):
                nbuf = np.empty_like(obj, order="C")
                self._buffers[path] = nbuf
            np.copyto(nbuf, obj)
            self._used.add(path)
            run.seen[key] = nbuf
            run.sources.append(obj)
            return nbuf
        t = type(obj)
        if t is dict or t is OrderedDict or t is Counter or t is defaultdict:
            out = obj.copy()  # same type, order and default factory; values replaced below
            for k, v in obj.items():
                out[k] = self._copy(v, (*path, k), run)
            if t is OrderedDict and hasattr(obj, "_metadata"):  # (a state_dict()'s module versions)
                out._metadata = self._copy(obj._metadata, (*path, _METADATA), run)
            return out
        if t is list or t is tuple or t is deque:
            items = [self._copy(v, (*path, i), run) for i, v in enumerate(obj)]
            return items if t is list else tuple(items) if t is tuple else deque(items, maxlen=obj.maxlen)
        if t is set:
            return set(obj)  # elements are plain values; a copy keeps the save from seeing later changes
        return obj


#: the path step under which a snapshot copies an OrderedDict's ``_metadata`` (no dict key can equal it)
_METADATA = object()
