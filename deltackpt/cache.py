"""A bounded, thread-safe cache of raw chunk bytes: the delta bases of the next save.

Where it sits: ``save`` puts the raw bytes of every chunk it writes here (dropping each parent chunk once the
encodes that read it have run), and once it commits keeps only the chunks of the state it saved
(:meth:`ChunkCache.retain`); the next save, encoding chunk i of a tensor as a delta against chunk i of its
parent, finds the base here instead of decoding it (and its whole delta chain) from the packs. Capacity is in
bytes; the least recently used chunks go first. With capacity 0 nothing is kept and every base is decoded
from the store.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

import numpy as np


class ChunkCache:
    def __init__(self, capacity: int) -> None:
        self.capacity = max(0, int(capacity))
        self._data: OrderedDict[bytes, np.ndarray] = OrderedDict()
        self._size = 0
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0
        #: the most bytes held at once (a caller may set it to ``size`` to measure from there)
        self.peak = 0

    def get(self, key: bytes) -> np.ndarray | None:
        with self._lock:
            v = self._data.get(key)
            if v is None:
                self.misses += 1
                return None
            self._data.move_to_end(key)
            self.hits += 1
            return v

    def put(self, key: bytes, raw: memoryview | np.ndarray) -> np.ndarray | None:
        """Keep a private copy of ``raw`` under ``key`` (the copy is made outside the lock) and return it (the
        copy already kept, when there is one), or None when chunks that large are not kept."""
        n = len(raw)
        if n > self.capacity:
            return None
        data = self._data
        if key in data:  # (a plain read outside the lock: the copy below is only saved, never taken wrongly)
            with self._lock:
                kept = data.get(key)
                if kept is not None:
                    data.move_to_end(key)
                    return kept
        copy = np.empty(n, dtype=np.uint8)
        copy.data[:] = raw  # (a copy of the bytes; np.array(raw) of a memoryview took three times as long)
        with self._lock:
            kept = data.get(key)
            if kept is not None:
                return kept
            data[key] = copy
            self._size += n
            self.peak = max(self.peak, min(self._size, self.capacity))
            while self._size > self.capacity:
                _, old = self._data.popitem(last=False)
                self._size -= len(old)
        return copy

    def discard(self, key: bytes) -> None:
        with self._lock:
            old = self._data.pop(key, None)
            if old is not None:
                self._size -= len(old)

    def retain(self, keys: set[bytes]) -> None:
        """Drop every chunk but those of ``keys`` (the chunks of the state just saved: the next save's bases)."""
        with self._lock:
            for k in [k for k in self._data if k not in keys]:
                self._size -= len(self._data.pop(k))

    def clear(self) -> None:
        with self._lock:
            self._data.clear()
            self._size = 0

    @property
    def size(self) -> int:
        return self._size

    def __len__(self) -> int:
        return len(self._data)
