"""The pack writer on its own: the locations it reports, frames held back and written together, roll-over to a
new pack, and rollback to a mark, against a model of which frames must read back."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from deltackpt import packs
from deltackpt.packs import PackReader, PackWriter

OPS = st.lists(
    st.one_of(
        st.tuples(st.just("append"), st.integers(1, 300)),
        st.tuples(st.just("mark"), st.just(0)),
        st.tuples(st.just("rollback"), st.just(0)),
        st.tuples(st.just("sync"), st.just(0)),
    ),
    max_size=60,
)


@pytest.mark.parametrize("buffer", [1, 64, 1 << 20])
@settings(max_examples=200)  # cheap: no torch, a few small files per example
@given(ops=OPS, max_size=st.sampled_from([100, 500, 1 << 20]))
def test_frames_read_back_where_append_said(buffer: int, ops: list[tuple[str, int]], max_size: int) -> None:
    """Whatever mixes of small and large frames, syncs, marks and rollbacks: after a sync every frame appended
    and not rolled back reads back at the (pack, offset) its append returned, and the frames rolled back are
    gone from the files (each pack ends where its last live frame does)."""
    old = packs.WRITE_BUFFER
    packs.WRITE_BUFFER = buffer
    try:
        with tempfile.TemporaryDirectory() as d:
            root = Path(d)
            w = PackWriter(root, max_size=max_size)
            live: list[tuple[str, int, bytes]] = []
            mark: tuple[tuple[str | None, int], int] | None = None  # (writer's mark, len(live) then)
            n = 0
            for op, size in ops:
                if op == "append":
                    n += 1
                    frame = bytes([n % 251]) * size
                    pack_id, offset = w.append(frame)
                    live.append((pack_id, offset, frame))
                elif op == "mark":
                    mark = (w.mark(), len(live))
                elif op == "rollback" and mark is not None:
                    w.rollback(mark[0])
                    del live[mark[1]:]
                    mark = None
                elif op == "sync":
                    w.sync()
                    _check(root, live)
            w.sync()
            w.close()
            _check(root, live)
            ends: dict[str, int] = {}
            for pack_id, offset, frame in live:
                ends[pack_id] = max(ends.get(pack_id, 0), offset + len(frame))
            for pack_id, end in ends.items():
                assert os.path.getsize(root / f"{pack_id}.pack") == end
    finally:
        packs.WRITE_BUFFER = old


def _check(root: Path, live: list[tuple[str, int, bytes]]) -> None:
    r = PackReader(root)
    try:
        for pack_id, offset, frame in live:
            assert bytes(r.read(pack_id, offset, len(frame))) == frame
    finally:
        r.close()


def test_small_frames_wait_for_the_sync(tmp_path: Path) -> None:
    """A small frame is in the file after sync, not necessarily before; a large one is written at once."""
    w = PackWriter(tmp_path)
    pack_id, offset = w.append(b"a" * 100)
    path = tmp_path / f"{pack_id}.pack"
    assert path.stat().st_size == offset  # held back
    w.sync()
    assert path.stat().st_size == offset + 100
    _, big = w.append(b"b" * packs.WRITE_BUFFER)
    assert path.stat().st_size == big + packs.WRITE_BUFFER
    w.close()
