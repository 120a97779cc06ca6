"""Scratch buffers that one load (or verify) reuses for frames and intermediate chunks.

Where it sits: between the pack reader and the codec on the load path. Restoring a delta-coded checkpoint reads
more bytes than it returns: every chunk's frame, plus the frames and decoded bytes of the older chunks that its
deltas and predictions are computed from. Allocating a fresh buffer for each of those costs a page fault per
4 KiB the first time it is written (the allocator hands large blocks back to the kernel when freed), which in a
fresh process doubled a restore's system time. :meth:`Scratch.take` hands out buffers from a free list instead,
and :meth:`Scratch.give` puts them back once their frame is applied or their decoded chunk is no longer read.

One ``Scratch`` lives for one load; dropping it frees its buffers. It holds at most as many buffers as were in
use at once (a few per read thread), all of one size, large enough for any frame or chunk of the load; larger
requests get a buffer of their own that is not kept.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable

import numpy as np

from deltackpt import codec


class Scratch:
    def __init__(self, size: int) -> None:
        self.size = int(size)
        self._free: list[np.ndarray] = []
        # Buffers handed out and not yet given back, by id(). Holding them keeps their ids from being reused by
        # another object while lent, so give() can never take in memory that is not the pool's.
        self._lent: dict[int, np.ndarray] = {}
        self._lock = threading.Lock()

    @classmethod
    def for_frames(cls, chunk_size: int, frame_lens: Iterable[int]) -> Scratch:
        """A pool whose buffers hold any chunk of ``chunk_size`` bytes with a frame header, and any of the frames
        whose lengths are given (the ones a load knows it will read)."""
        return cls(max([chunk_size + codec.HEADER_SIZE, *frame_lens]))

    def take(self, n: int) -> np.ndarray:
        """A writable uint8 buffer of ``n`` bytes (uninitialised)."""
        if n > self.size:
            return np.empty(n, dtype=np.uint8)
        with self._lock:
            buf = self._free.pop() if self._free else None
            if buf is None:
                buf = np.empty(self.size, dtype=np.uint8)
            self._lent[id(buf)] = buf
        return buf[:n]

    def give(self, view: np.ndarray | memoryview | bytes) -> None:
        """Return a buffer that :meth:`take` handed out; anything else (a caller's output, say) is ignored."""
        buf = view.base if isinstance(view, np.ndarray) else None
        if buf is None:
            return
        with self._lock:
            if self._lent.get(id(buf)) is buf:
                self._free.append(self._lent.pop(id(buf)))
