"""The pack writer on its own: the locations it reports, frames held back and written together, roll-over to a
new pack, and rollback to a mark, against a model of which frames must read back."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from deltackpt import codec, kernel, packs
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


def test_a_rollback_interrupted_anywhere_leaves_appends_where_they_say(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """A second Ctrl-C lands while a failed save rolls its frames back (a KeyboardInterrupt at any line of
    rollback, as a signal handler raises it after a call returns). The frames appended after it still read back
    at the offsets their appends returned. Before, one landing between the seek to the mark and the offset's
    update made later frames land at the mark while their index entries named the old end."""
    import sys

    monkeypatch.setattr(packs, "WRITE_BUFFER", 1024)  # (frames of 1 KiB and more are written as they come)
    lines = sorted({line for _, _, line in PackWriter.rollback.__code__.co_lines() if line is not None})
    for at in lines:
        root = tmp_path / str(at)
        root.mkdir()
        w = PackWriter(root)
        live = [(*w.append(b"a" * 100), b"a" * 100)]
        mark = w.mark()
        w.append(b"b" * 5000)  # (the failed save's frames: this one written, the next held)
        w.append(b"c" * 10)

        def interrupt(frame, event, arg, at=at):  # type: ignore[no-untyped-def]
            if event == "line" and frame.f_code is PackWriter.rollback.__code__ and frame.f_lineno == at:
                raise KeyboardInterrupt
            return interrupt

        def tracer(frame, event, arg):  # type: ignore[no-untyped-def]
            return interrupt if frame.f_code is PackWriter.rollback.__code__ else None

        sys.settrace(tracer)
        try:
            w.rollback(mark)
        except KeyboardInterrupt:
            pass
        finally:
            sys.settrace(None)
        for n in range(3):  # the next save's frames
            frame = bytes([n + 1]) * (3000 if n == 1 else 50)
            live.append((*w.append(frame), frame))
        w.sync()
        w.close()
        _check(root, live)


@pytest.mark.parametrize(("where", "line", "size"), [
    ("_write", "self._end += len(data)", 1),  # (written, not counted: pwrite writes at _end again)
    ("append", "self._offset += len(frame)", 1),  # written and counted as written, not as appended
    ("append", "self._held_len += len(frame)", 0),  # held, not counted
])
def test_a_mark_after_an_interrupted_append_puts_frames_where_it_says(tmp_path: Path, where: str, line: str,
                                                                      size: int) -> None:
    """An append interrupted between two of its updates (a Ctrl-C's KeyboardInterrupt as a call returns), whose
    rollback did not run either (a second Ctrl-C as the failed save asked the index whether it committed): the
    next save's mark and appends still put frames where they say. (The frames after it were written past the
    offsets their appends returned: their checkpoint's chunks read back as damage.)"""
    import sys

    w = PackWriter(tmp_path)
    first = b"b" * (packs.WRITE_BUFFER if size else 60)  # (a large frame is written at once, a small one held)
    live = [(*w.append(b"a" * 100), b"a" * 100)]
    w.sync()
    code = getattr(PackWriter, where).__code__
    src = [text.strip() for text in open(code.co_filename).read().splitlines()]
    at = next(n for n in range(code.co_firstlineno, code.co_firstlineno + 40) if src[n - 1] == line)

    def interrupt(frame, event, arg):  # type: ignore[no-untyped-def]
        if event == "line" and frame.f_code is code and frame.f_lineno == at:
            raise KeyboardInterrupt
        return interrupt

    def tracer(frame, event, arg):  # type: ignore[no-untyped-def]
        return interrupt if frame.f_code is code else None

    sys.settrace(tracer)
    try:
        with pytest.raises(KeyboardInterrupt):
            w.append(first)
    finally:
        sys.settrace(None)
    w.mark()  # the next save
    for n in range(3):
        frame = bytes([n + 1]) * (packs.WRITE_BUFFER if n == 1 else 50)
        live.append((*w.append(frame), frame))
    w.sync()
    w.close()
    _check(tmp_path, live)


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


# -- the reader's bounded set of open pack files ------------------------------------------------------------


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _many_packs(root: Path, n: int) -> list[tuple[str, int, bytes]]:
    """``n`` packs of one frame-sized record each: (pack id, offset, bytes)."""
    w = PackWriter(root, max_size=1)  # every append rolls over to a new pack
    out = []
    for i in range(n):
        data = os.urandom(50 + i)
        pack_id, offset = w.append(data)
        out.append((pack_id, offset, data))
    w.sync()
    w.close()
    return out


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="counts open files through /proc")
@settings(max_examples=50)
@given(order=st.lists(st.integers(0, 39), min_size=1, max_size=200), max_open=st.integers(1, 6),
       forget=st.lists(st.integers(0, 39), max_size=10))
def test_reader_keeps_at_most_max_open_files(order: list[int], max_open: int, forget: list[int]) -> None:
    """Reads from 40 packs in any order, with some packs forgotten on the way, through a reader that may keep
    only a few open: every read returns its bytes, no more than ``max_open`` files are open at any time, and
    closing the reader closes them all."""
    with tempfile.TemporaryDirectory() as d:
        frames = _many_packs(Path(d), 40)
        base = _open_fds()
        r = PackReader(Path(d), max_open=max_open)
        for n, i in enumerate(order):
            pack_id, offset, data = frames[i]
            assert bytes(r.read(pack_id, offset, len(data))) == data
            assert _open_fds() - base <= max_open
            if n < len(forget):
                r.forget(frames[forget[n]][0])
        r.close()
        assert _open_fds() == base


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="counts open files through /proc")
def test_reader_closes_what_a_transient_pass_opened() -> None:
    """Packs first opened inside ``transient()`` are closed at its end, those open before stay open, and one a
    read is still using closes when that read ends."""
    with tempfile.TemporaryDirectory() as d:
        frames = _many_packs(Path(d), 12)
        base = _open_fds()
        r = PackReader(Path(d), max_open=100)
        for pack_id, offset, data in frames[:2]:
            r.read(pack_id, offset, len(data))
        with r.transient():
            for pack_id, offset, data in frames:
                assert bytes(r.read(pack_id, offset, len(data))) == data
            assert _open_fds() == base + 12
            held = r._fd(frames[5][0])
            held.__enter__()  # a read still running as the pass ends
        assert _open_fds() == base + 3
        held.__exit__(None, None, None)
        assert _open_fds() == base + 2
        assert sorted(r._open) == sorted(f[0] for f in frames[:2])
        pack_id, offset, data = frames[7]
        assert bytes(r.read(pack_id, offset, len(data))) == data  # reopened as needed
        r.close()
        assert _open_fds() == base


def test_reader_threads_share_and_shed_files() -> None:
    """Eight threads read 60 packs through a reader that keeps 3 open: files another thread is reading from are
    closed only after that read ends (a closed or reused descriptor would read wrong bytes or fail)."""
    import threading

    with tempfile.TemporaryDirectory() as d:
        frames = _many_packs(Path(d), 60)
        r = PackReader(Path(d), max_open=3)
        errors: list[BaseException] = []

        def work(seed: int) -> None:
            import random

            rng = random.Random(seed)
            try:
                for _ in range(400):
                    pack_id, offset, data = frames[rng.randrange(len(frames))]
                    buf = np.empty(len(data), dtype=np.uint8)
                    got = r.read(pack_id, offset, len(data), into=buf, before_blocking=lambda: None)
                    assert got.tobytes() == data
            except BaseException as exc:
                errors.append(exc)

        threads = [threading.Thread(target=work, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        r.close()
        assert not errors, errors[0]


def test_a_store_with_more_packs_than_open_files_allowed(tmp_path: Path) -> None:
    """A checkpoint spread over more packs than the process may open files loads and verifies (in a child
    process whose open-file limit is 64)."""
    import subprocess
    import sys

    import torch

    import deltackpt

    with deltackpt.Store(tmp_path / "s", chunk_size=4096, pack_size=4096) as s:
        s.save({"w": torch.randn(300_000, generator=torch.Generator().manual_seed(0))}, step=0)
    assert len(list((tmp_path / "s" / "packs").glob("*.pack"))) > 100
    code = (
        "import resource, sys, torch, deltackpt\n"
        "resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))\n"
        "s = deltackpt.Store(sys.argv[1])\n"
        "w = s.load()['w']\n"
        "assert torch.equal(w, torch.randn(300_000, generator=torch.Generator().manual_seed(0)))\n"
        "assert s.verify().ok\n"
    )
    done = subprocess.run([sys.executable, "-c", code, str(tmp_path / "s")], capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(Path(deltackpt.__file__).parent.parent)})
    assert done.returncode == 0, done.stderr[-2000:]


def _frame(seed: int, n: int = 3000) -> bytes:
    raw = np.random.default_rng(seed).standard_normal(n // 4).astype(np.float32).tobytes()
    return codec.Encoder(1).encode(raw, kernel.digest(raw), 4)


def _pack(tmp_path: Path, *frames: bytes, tail: bytes = b"") -> tuple[Path, list[int]]:
    """A pack holding ``frames`` then ``tail``; also the offset of each frame and of the tail."""
    data = bytearray(packs.PACK_HEADER.pack(packs.PACK_MAGIC, packs.PACK_VERSION, 0))
    offsets = []
    for f in frames:
        offsets.append(len(data))
        data += f
    offsets.append(len(data))
    path = tmp_path / f"{'ab' * 16}.pack"
    path.write_bytes(bytes(data) + tail)
    return path, offsets


def _scan(path: Path) -> tuple[list[int], list[int]]:
    damaged: list[int] = []
    return [off for off, _ in packs.scan(path, damaged)], damaged


def test_scan_reports_a_damaged_last_frame_that_ends_at_the_end_of_the_pack(tmp_path: Path) -> None:
    """A complete last frame that fails its checksum is damage (a crash tears a frame short, it does not flip
    a byte of one that is all there): repair reports the pack as damaged."""
    f1, f2 = _frame(1), _frame(2)
    path, offs = _pack(tmp_path, f1, f2)
    assert _scan(path) == (offs[:2], [])
    data = bytearray(path.read_bytes())
    data[offs[1] + codec.HEADER_SIZE + 20] ^= 0x10
    path.write_bytes(bytes(data))
    assert _scan(path) == ([offs[0]], [offs[1]])


def test_scan_does_not_report_a_torn_last_frame(tmp_path: Path) -> None:
    f1, f2 = _frame(1), _frame(2)
    for cut in (1, codec.HEADER_SIZE - 1, codec.HEADER_SIZE + 1, len(f2) - 1):
        path, offs = _pack(tmp_path, f1, f2[:cut])
        assert _scan(path) == ([offs[0]], []), cut


@pytest.mark.parametrize("size", [codec.HEADER_SIZE, codec.HEADER_SIZE + 7])
def test_scan_reports_a_tail_of_garbage_as_long_as_a_header(tmp_path: Path, size: int) -> None:
    """Bytes that do not parse as a header yet are at least a header long were no torn append: damage."""
    path, offs = _pack(tmp_path, _frame(1), tail=b"\xee" * size)
    assert _scan(path) == ([offs[0]], [offs[1]])


def test_scan_finds_a_frame_of_an_empty_chunk_at_the_end(tmp_path: Path) -> None:
    """A frame is at least its 64-byte header: one of exactly that size at the end of a pack is read too."""
    empty = codec.Encoder(1).encode(b"", kernel.digest(b""), 1)
    assert len(empty) == codec.HEADER_SIZE
    path, offs = _pack(tmp_path, _frame(1), empty)
    assert _scan(path) == (offs[:2], [])


def test_a_pack_that_reached_max_size_takes_no_more_frames(tmp_path: Path) -> None:
    """A pack whose size reached ``max_size`` exactly is full: the next frame starts a new pack (packs stay within
    max_size plus at most one frame)."""
    w = packs.PackWriter(tmp_path, max_size=packs.PACK_HEADER.size + 100)
    try:
        p1, off1 = w.append(b"a" * 100)
        p2, off2 = w.append(b"b" * 100)
        w.sync()
    finally:
        w.close()
    assert (off1, off2) == (packs.PACK_HEADER.size, packs.PACK_HEADER.size) and p1 != p2
    assert (tmp_path / f"{p1}.pack").stat().st_size == packs.PACK_HEADER.size + 100
