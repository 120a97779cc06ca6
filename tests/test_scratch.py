"""Scratch buffers (:mod:`deltackpt.scratch`): what a load reuses for frames and intermediate chunks."""

from __future__ import annotations

import numpy as np

from deltackpt.scratch import Scratch


def test_buffers_are_reused_once_given_back() -> None:
    s = Scratch(100)
    a = s.take(60)
    assert len(a) == 60 and a.dtype == np.uint8 and a.flags.writeable
    b = s.take(100)
    assert not np.shares_memory(a, b)  # both lent: never the same memory
    s.give(a)
    c = s.take(10)
    assert len(c) == 10 and np.shares_memory(a, c)
    s.give(b)
    s.give(c)


def test_only_lent_buffers_are_kept() -> None:
    s = Scratch(64)
    a = s.take(64)
    s.give(a)
    s.give(a)  # given twice: kept once, so two takes cannot share it
    x, y = s.take(64), s.take(64)
    assert not np.shares_memory(x, y)
    mine = np.empty(64, dtype=np.uint8)
    s.give(mine[:32])  # a caller's own buffer (a load's output, say) is never lent out
    s.give(memoryview(b"x" * 64))
    big = s.take(65)  # larger than the pool's size: a buffer of its own, not kept
    assert len(big) == 65
    s.give(big)
    s.give(x)
    s.give(y)
    lent = [s.take(64) for _ in range(3)]
    assert not any(np.shares_memory(b, mine) or np.shares_memory(b, big) for b in lent)
    assert sum(np.shares_memory(b, z) for b in lent for z in (x, y)) == 2  # x and y again, then a new one
