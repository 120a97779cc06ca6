"""Tuning knobs in one place, each overridable by an environment variable.

Where it sits: read by :class:`deltackpt.Store` when it is opened (the chunk size only when one is created), and
``DELTACKPT_GC_MIN_BYTES`` when a :class:`~deltackpt.Checkpointer` or DCP writer is made; arguments win over the
environment, which wins over these defaults.

================================  ==========================  ==========================================
knob                              variable                    default
================================  ==========================  ==========================================
chunk size of a new store         ``DELTACKPT_CHUNK_SIZE``    1 MiB (see README, "Choosing the chunk size")
zstd level                        ``DELTACKPT_ZSTD_LEVEL``    1
worker threads                    ``DELTACKPT_THREADS``       the CPUs this process may run on
read threads (loads, verify)      ``DELTACKPT_READ_THREADS``  4 x worker threads, 8 to 4096
pack file roll-over size          ``DELTACKPT_PACK_SIZE``     1 GiB
longest delta chain (0: no delta) ``DELTACKPT_MAX_CHAIN``     3
delta base cache                  ``DELTACKPT_DELTA_CACHE``   1 GiB
predicted frames (AdamW state)    ``DELTACKPT_PREDICT``       1 (on; 0 turns them off)
least garbage for gc after saves  ``DELTACKPT_GC_MIN_BYTES``  64 MiB (see README, "Retention")
allow the index on network FS     ``DELTACKPT_ALLOW_NETWORK_FS``  0
================================  ==========================  ==========================================
"""

from __future__ import annotations

import numbers
import os
from collections.abc import Callable
from typing import Any

DEFAULT_CHUNK_SIZE = 1 << 20
DEFAULT_ZSTD_LEVEL = 1
DEFAULT_PACK_SIZE = 1 << 30
DEFAULT_MAX_CHAIN = 3
#: the largest max_chain a store accepts; readers decode chains of up to MAX_MAX_CHAIN + 1 frames
MAX_MAX_CHAIN = 64
DEFAULT_DELTA_CACHE = 1 << 30
#: gc after retention runs once the checkpoints it deleted or thinned wrote at least this much (and a quarter of
#: what the kept ones wrote): sooner, each gc's pass over the live chunks would cost more than the space it frees
DEFAULT_GC_MIN_BYTES = 64 << 20
MIN_CHUNK_SIZE = 4096
MAX_CHUNK_SIZE = 1 << 30
#: zstd's own range of levels (ZSTD_minCLevel() .. ZSTD_maxCLevel())
MIN_ZSTD_LEVEL = -(1 << 17)
MAX_ZSTD_LEVEL = 22


def _env_int(name: str, default: int) -> int:
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        return default
    try:
        return int(raw, 0)  # (0x1000 and 1_048_576 too)
    except ValueError:
        pass
    try:
        return int(raw, 10)  # a decimal with leading zeros ("08"), which base 0 refuses
    except ValueError:
        raise ValueError(f"{name} must be an integer, got {raw!r}") from None


def cpu_count() -> int:
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not on Linux
        return max(1, os.cpu_count() or 1)


def chunk_size() -> int:
    return _env_int("DELTACKPT_CHUNK_SIZE", DEFAULT_CHUNK_SIZE)


def zstd_level() -> int:
    return _env_int("DELTACKPT_ZSTD_LEVEL", DEFAULT_ZSTD_LEVEL)


#: the most worker (and read) threads a store takes
MAX_THREADS = 4096


def threads() -> int:
    return _env_int("DELTACKPT_THREADS", cpu_count())


def read_threads(threads: int) -> int:
    """The most read workers: a load starts one per worker thread (decoding from the page cache is CPU-bound)
    and adds one whenever a frame read would wait on the disk, up to this; cold reads on a 2-core VM ran 1.7x
    faster with 8 than with 2. Verify uses this many."""
    return _env_int("DELTACKPT_READ_THREADS", min(MAX_THREADS, max(8, 4 * threads)))


def pack_size() -> int:
    return _env_int("DELTACKPT_PACK_SIZE", DEFAULT_PACK_SIZE)


def max_chain() -> int:
    return _env_int("DELTACKPT_MAX_CHAIN", DEFAULT_MAX_CHAIN)


def delta_cache_bytes() -> int:
    return _env_int("DELTACKPT_DELTA_CACHE", DEFAULT_DELTA_CACHE)


def _env_flag(name: str, default: bool) -> bool:
    """An on/off variable: ``1`` or ``0`` (empty: the default). Anything else is refused, naming the variable: a
    ``2``, ``yes`` or ``off`` read as on before, which ``off`` certainly did not mean."""
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        return default
    if raw.strip() not in ("0", "1"):
        raise ValueError(f"{name} must be 1 (on) or 0 (off), got {raw!r}")
    return raw.strip() == "1"


def predict() -> bool:
    return _env_flag("DELTACKPT_PREDICT", True)


def gc_min_bytes() -> int:
    value = _env_int("DELTACKPT_GC_MIN_BYTES", DEFAULT_GC_MIN_BYTES)
    if value < 0:
        raise ValueError(f"DELTACKPT_GC_MIN_BYTES must be >= 0, got {value}")
    return value


def allow_network_fs() -> bool:
    return _env_flag("DELTACKPT_ALLOW_NETWORK_FS", False)


def check_chunk_size(value: int, what: str = "chunk_size") -> int:
    if not isinstance(value, numbers.Integral) or isinstance(value, bool):  # (numpy ints too, as other settings)
        raise TypeError(f"{what} must be an int, got {type(value).__name__}")
    value = int(value)
    if value < MIN_CHUNK_SIZE or value > MAX_CHUNK_SIZE or value & (value - 1):
        raise ValueError(
            f"{what} must be a power of two between {MIN_CHUNK_SIZE} and {MAX_CHUNK_SIZE}, got {value}"
        )
    return value


def setting(name: str, given: Any, from_env: Callable[[], int], var: str, lo: int, hi: int) -> int:
    """The int value of :class:`~deltackpt.Store`'s argument ``name``: ``given`` when not None, else what
    ``from_env()`` reads (the variable ``var``, or the default). Raises TypeError (not an int) or ValueError
    (outside ``lo..hi``) naming the argument or the variable, so a bad setting is refused when the store opens,
    before anything is created, not at the first save."""
    value, what = (from_env(), var) if given is None else (given, name)
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{what} must be an int, got {type(value).__name__}")
    value = int(value)
    if not lo <= value <= hi:
        raise ValueError(f"{what} must be between {lo} and {hi}, got {value}")
    return value


def boolean(name: str, given: Any) -> bool:
    """``given``, which must be a bool (or numpy's): TypeError naming ``name`` otherwise. Switches are checked
    rather than read for truth: ``allow_pickle="no"`` must not turn unpickling on."""
    if type(given) is bool:
        return given
    if type(given).__name__ in ("bool", "bool_") and type(given).__module__ == "numpy":  # (numpy 2, numpy 1)
        return bool(given)
    raise TypeError(f"{name} must be True or False, got {type(given).__name__} {given!r:.40}")


def flag(name: str, given: Any, from_env: Callable[[], bool]) -> bool:
    """The bool value of :class:`~deltackpt.Store`'s argument ``name`` (``given`` when not None, else
    ``from_env()``); TypeError for anything but a bool (``predict="no"`` would otherwise mean True)."""
    if given is None:
        return from_env()
    return boolean(name, given)
