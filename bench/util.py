"""Measurement helpers shared by the driver and the cells: RSS, disk usage, page-cache eviction, state trees.

Nothing here imports torch at module level, so the driver can use the pure helpers cheaply.
"""

from __future__ import annotations

import ctypes
import gc
import json
import os
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

KB, MB, GB = 1e3, 1e6, 1e9
KIB, MIB, GIB = 1 << 10, 1 << 20, 1 << 30


def median(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


# -- memory --------------------------------------------------------------------------------------------------
def _status_kb(field: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


class Rss:
    """Peak resident set size over a window of this process.

    On Linux writing ``5`` to ``/proc/self/clear_refs`` resets the high-water mark (VmHWM) to the current
    RSS, so the peak of each window (one save, one load) is measured on its own and nothing bleeds from
    earlier phases of the same process. Where that is not possible the process-lifetime maximum from
    getrusage is reported instead and ``resettable`` is False.
    """

    def __init__(self) -> None:
        self.resettable = self._reset()

    @staticmethod
    def _reset() -> bool:
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            return _status_kb("VmHWM") is not None
        except OSError:
            return False

    def start(self) -> int:
        """Begin a window; returns the RSS at its start (bytes)."""
        trim()
        if self.resettable:
            self._reset()
        return self.current()

    @staticmethod
    def current() -> int:
        v = _status_kb("VmRSS")
        if v is not None:
            return v
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024

    def peak(self) -> int:
        """The highest RSS since :meth:`start` (or the process-lifetime peak when not resettable)."""
        v = _status_kb("VmHWM") if self.resettable else None
        if v is not None:
            return v
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


_libc: Any = None


def trim(collect: bool = False) -> None:
    """Hand freed heap memory back to the OS, so the next window starts clean. States hold no reference
    cycles, so refcounting frees them; a full ``gc.collect`` (``collect``) costs ~0.2 s with torch loaded."""
    global _libc
    if collect:
        gc.collect()
    try:
        if _libc is None:
            _libc = ctypes.CDLL("libc.so.6")
        _libc.malloc_trim(0)
    except (OSError, AttributeError):
        pass


# -- disk ----------------------------------------------------------------------------------------------------
def disk_usage(path: str | os.PathLike[str]) -> int:
    """Bytes allocated on disk (st_blocks) by the files below ``path``: sparse and preallocated files count
    for what they really occupy."""
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(root, name)).st_blocks * 512
            except FileNotFoundError:
                pass
    return total


def fsync_path(path: str | os.PathLike[str]) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(path: str | os.PathLike[str]) -> None:
    """fsync every file below ``path`` and the directories holding them."""
    for root, _, files in os.walk(path):
        for name in files:
            fsync_path(os.path.join(root, name))
        fsync_path(root)


def evict(path: str | os.PathLike[str]) -> bool:
    """Drop the page cache of every file below ``path`` (flushing it first) so the next load reads the disk.

    Uses posix_fadvise(DONTNEED), which needs no privileges; pages mapped by a live process (an open LMDB
    environment) may stay. Returns False where fadvise is missing.
    """
    if not hasattr(os, "posix_fadvise"):
        return False
    for root, _, files in os.walk(path):
        for name in files:
            try:
                fd = os.open(os.path.join(root, name), os.O_RDONLY)
            except OSError:
                continue
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
    return True


# -- state trees ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Slot:
    """Stands for tensor ``index`` in a pickled state skeleton (recorded trajectories). Not a tuple, so the
    tree walkers treat it as a leaf."""

    index: int
    dtype: str  # torch dtype name without the "torch." prefix
    shape: tuple[int, ...]


def walk(state: Any, prefix: str = "") -> Iterator[tuple[str, Any]]:
    """(path, leaf) for every leaf of a nested dict/list/tuple state; tensors and plain values alike."""
    if isinstance(state, dict):
        for k, v in state.items():
            yield from walk(v, f"{prefix}.{k}" if prefix else str(k))
    elif isinstance(state, (list, tuple)):
        for i, v in enumerate(state):
            yield from walk(v, f"{prefix}.{i}" if prefix else str(i))
    else:
        yield prefix, state


def map_tree(state: Any, fn: Callable[[Any], Any]) -> Any:
    """The same nested structure with every leaf replaced by ``fn(leaf)``."""
    if isinstance(state, dict):
        return type(state)((k, map_tree(v, fn)) for k, v in state.items())
    if isinstance(state, list):
        return [map_tree(v, fn) for v in state]
    if isinstance(state, tuple):
        return tuple(map_tree(v, fn) for v in state)
    return fn(state)


def is_tensor(x: Any) -> bool:
    import torch

    return isinstance(x, torch.Tensor)


def tensor_bytes(t: Any) -> Any:
    """The bytes of a CPU tensor as a flat uint8 numpy array (a view when contiguous)."""
    t = t.detach()
    if not t.is_contiguous():
        t = t.contiguous()
    import torch

    return t.reshape(-1).view(torch.uint8).numpy()


def touch(state: Any) -> int:
    """Read one byte of every page of every tensor, so lazily mapped loads (safetensors maps the file) pay for
    their reads inside the timed window like the eager ones. Returns a checksum to keep the reads live."""
    acc = 0
    for _, v in walk(state):
        if is_tensor(v) and v.numel():
            acc += int(tensor_bytes(v)[::4096].max())
    return acc


def state_nbytes(state: Any) -> int:
    return sum(v.numel() * v.element_size() for _, v in walk(state) if is_tensor(v))


def plain_json(v: Any) -> str:
    return json.dumps(v, sort_keys=True, default=str)


def fingerprint(state: Any) -> dict[str, Any]:
    """What verification compares: a digest of every tensor (by path) and the plain values as JSON."""
    import xxhash

    tensors: dict[str, str] = {}
    plain: dict[str, str] = {}
    for path, v in walk(state):
        if is_tensor(v):
            h = xxhash.xxh3_128(f"{v.dtype}{tuple(v.shape)}".encode())
            h.update(memoryview(tensor_bytes(v)))
            tensors[path] = h.hexdigest()
        else:
            plain[path] = plain_json(v)
    return {"tensors": tensors, "plain": plain}


def compare(expected: dict[str, Any], got: dict[str, Any], *, subset: bool = False,
            plain: bool = True) -> str:
    """'' when ``got`` matches ``expected``, else a short description of the first difference.

    ``subset``: every expected tensor digest must appear somewhere in ``got`` (paths may differ: a wrapper
    such as the Checkpointer may nest the state or add entries).
    """
    et, gt = expected["tensors"], got["tensors"]
    if subset:
        missing = sorted(set(et.values()) - set(gt.values()))
        return f"{len(missing)} of {len(et)} tensors missing or different" if missing else ""
    if et.keys() != gt.keys():
        diff = sorted(set(et) ^ set(gt))[:3]
        return f"tensor paths differ: {diff}"
    bad = [k for k in et if et[k] != gt[k]]
    if bad:
        return f"{len(bad)} of {len(et)} tensors differ, e.g. {bad[0]!r}"
    if plain:
        ep, gp = expected["plain"], got["plain"]
        bad = [k for k in ep if gp.get(k) != ep[k]]
        if bad:
            return f"plain value {bad[0]!r} differs: {ep[bad[0]]} != {gp.get(bad[0])}"
    return ""


def fmt_bytes(n: float | None) -> str:
    if n is None:
        return "–"
    for unit, size in (("GB", GB), ("MB", MB), ("kB", KB)):
        if abs(n) >= size:
            return f"{n / size:.3g} {unit}" if abs(n) / size < 100 else f"{n / size:.0f} {unit}"
    return f"{n:.0f} B"


def fmt_s(t: float | None) -> str:
    if t is None:
        return "–"
    if t < 0.001:
        return f"{t * 1e6:.0f} µs"
    if t < 1:
        return f"{t * 1e3:.3g} ms"
    return f"{t:.3g} s"


def repo_root() -> Path:
    return Path(__file__).resolve().parent.parent
