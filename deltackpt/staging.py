"""Staging: where a tensor's bytes are on the host while a save reads them or a load writes them.

Where it sits: between :mod:`deltackpt.tree` (which finds the tensors of a state) and the chunk pipeline of
:class:`deltackpt.Store`, which works on flat uint8 arrays of host memory. A save reads each tensor through
:func:`host_bytes` (a view of a contiguous CPU tensor, else a copy: into a reusable :class:`Pinned` buffer for an
accelerator's). A load decodes into :func:`new_output` (pinned for CUDA) or, filling given tensors in place, into
:func:`decode_target` (the tensor's own memory when its layout allows, else a staging buffer that
:func:`copy_back` copies into the tensor's layout or device); :func:`unfillable` and :func:`overlapping` refuse
targets that cannot be written or that share memory. ``map_location`` and stored devices are resolved here,
before anything is decoded.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from deltackpt import _lazy, tree
from deltackpt.errors import CorruptManifestError, UnsupportedTypeError

if TYPE_CHECKING:
    import torch

    from deltackpt.index import Record
    from deltackpt.manifest import TensorEntry
else:
    torch = _lazy.module("torch", globals())


def host_bytes(obj: torch.Tensor | np.ndarray, staging: Pinned | None = None) -> np.ndarray:
    """The leaf's bytes as a flat uint8 array on the host (a view when already contiguous on the CPU).

    A tensor on an accelerator is copied into ``staging`` (a reusable pinned host buffer) when given, so the
    device-to-host copy runs at full speed and allocates nothing; the caller must not reuse ``staging`` while
    views of the previous tensor are still being read.
    """
    if isinstance(obj, torch.Tensor):
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
        return obj.reshape(-1).view(np.uint8), None
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


def _output(t: TensorEntry, map_location: Any) -> tuple[torch.Tensor | np.ndarray, torch.device | None]:
    """A new tensor (pinned for CUDA) or array to decode the stored tensor ``t`` into, and for a tensor the device
    it goes to. Its storage holds exactly ``t.nbytes`` bytes (checked: a dtype whose elements are not whole bytes
    would have the kernel write past it)."""
    if t.kind != "torch":
        return np.empty(t.shape, dtype=tree.numpy_dtype(t.dtype)), None
    dt = tree.torch_dtype(t.dtype)
    dev = _resolve_device(t.device, map_location)
    out = torch.empty(t.shape, dtype=dt, device="cpu", pin_memory=dev.type == "cuda")
    if out.untyped_storage().nbytes() != t.nbytes:
        raise CorruptManifestError(f"{t.nbytes} bytes for a {t.dtype} tensor of shape {t.shape}, which holds "
                                   f"{out.untyped_storage().nbytes()}")
    return out, dev


def new_output(rec: Record, t: TensorEntry,
                map_location: Any) -> tuple[torch.Tensor | np.ndarray, torch.device | None, np.ndarray]:
    """:func:`_output` for a load of checkpoint ``rec``, with its bytes as a uint8 array; an error names the
    checkpoint and the tensor."""
    try:
        out, dev = _output(t, map_location)
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
        where = "map_location" if stored is None else f"map_location[{stored!r:.60}]"
        if not isinstance(target, (str, torch.device)):
            raise TypeError(f"{where} must be a device or a device string, got {type(target).__name__} {target!r:.40}")
        try:
            torch.device(target)
        except (RuntimeError, ValueError, TypeError):
            raise ValueError(f"{where} {'= ' if stored is not None else ''}{target!r:.60} is not a device torch "
                             "knows") from None


def _resolve_device(stored: str, map_location: Any) -> torch.device:
    """The device a tensor stored on ``stored`` loads onto, for a ``map_location`` that
    :func:`check_map_location` passed; UnsupportedTypeError for a device this process cannot use, saying
    whether it came from the checkpoint or from ``map_location``."""
    if map_location is None or isinstance(map_location, Mapping):
        target = stored if map_location is None else map_location.get(stored, stored)
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
