"""A full disk: saves that fail give their space back and change nothing; gc frees space without needing any.

Most tests put the store on a real, small tmpfs filled up with a filler file, so every write fails as it would
on a full disk (the pack appends, the fsyncs, the manifest, LMDB's commit). Mounting needs root; elsewhere
those tests skip, and the pack writer's rollback and a process over its file size limit (real failed writes,
no root needed) still run.
"""

from __future__ import annotations

import errno
import itertools
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from conftest import assert_same_state

import deltackpt
from deltackpt.cli import main
from deltackpt.packs import PackReader, PackWriter

CS = 16 * 1024


@pytest.fixture
def small_fs(tmp_path: Path) -> Iterator[Path]:
    """A 16 MiB tmpfs mounted for this test."""
    mnt = tmp_path / "fs"
    mnt.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root")
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16m", "tmpfs", str(mnt)], capture_output=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.decode().strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def fill(fs: Path, leave: int) -> Path:
    """Fill ``fs`` with a file until about ``leave`` bytes are free; return the file."""
    st = os.statvfs(fs)
    filler = fs / "filler"
    with open(filler, "wb") as f:
        try:
            f.write(bytes(max(0, st.f_bavail * st.f_frsize - leave)))
        except OSError:
            pass
    return filler


def stored_bytes(path: Path) -> int:
    """Bytes in the store's packs, manifests and temporary files (not the index, which LMDB grows)."""
    return sum(p.stat().st_size for d in ("packs", "manifests", "tmp") for p in (path / d).iterdir())


def states(seed: int, n: int = 3) -> list[dict[str, object]]:
    g = torch.Generator().manual_seed(seed)
    return [{"w": torch.randn(30_000, generator=g), "b": torch.randn(20_000, generator=g), "step": i}
            for i in range(n)]


def test_a_save_that_fails_on_a_full_disk_changes_nothing(small_fs: Path) -> None:
    """Free space is stepped up 4 KiB at a time, so the second save fails at every write it makes, until it fits.
    Each failure is an OSError, the first checkpoint stays loadable and verifiable, the failed save leaves no
    bytes behind, and once space is back the same save succeeds."""
    a, b, _ = states(0)
    kinds: set[type[BaseException]] = set()
    for leave in itertools.count(0, 4096):
        path = small_fs / "store"
        shutil.rmtree(path, ignore_errors=True)
        with deltackpt.Store(path, chunk_size=CS, threads=2) as s:
            s.save(a, step=1)
            before = stored_bytes(path)
            filler = fill(small_fs, leave)
            try:
                s.save(b, step=2)
            except OSError as exc:
                assert exc.errno in (errno.ENOSPC, errno.EIO), exc
                kinds.add(type(exc))
            else:
                filler.unlink()
                break
            assert [c.step for c in s.list()] == [1]
            assert stored_bytes(path) == before, f"the failed save left bytes behind (free space {leave})"
            filler.unlink()
            assert_same_state(a, s.load(step=1))
            assert s.verify().problems == []
            s.save(b, step=2)
            assert_same_state(b, s.load(step=2))
        assert leave < 4 << 20, "the save never fitted"
    # the scan reached both the pack writes and the index commit (a typed error, which is an OSError too)
    assert OSError in kinds and deltackpt.IndexWriteError in kinds, kinds


def test_gc_on_a_full_disk_frees_packs_without_writing(small_fs: Path) -> None:
    """Packs only deleted checkpoints used are freed on a full disk; a save that did not fit then does."""
    path = small_fs / "store"
    with deltackpt.Store(path, chunk_size=CS, threads=2, pack_size=64 * 1024, max_chain=0) as s:
        old = states(1, 6)
        for i, st in enumerate(old):
            s.save(st, step=i)
        new = states(2, 1)[0]
        filler = fill(small_fs, 64 * 1024)
        with pytest.raises(OSError):
            s.save(new, step=10)
        for i in range(5):
            s.delete(step=i)
        r = s.gc()
        assert r.deleted_packs > 0 and r.freed_bytes > 300_000, r
        assert r.repack_stopped is None
        s.save(new, step=10)
        filler.unlink()
        assert_same_state(old[5], s.load(step=5))
        assert_same_state(new, s.load(step=10))
        assert s.verify().problems == []


def test_gc_repacks_what_fits_and_says_what_it_left(small_fs: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """With one pack and no room to copy its live frames, gc drops the dead entries, stops repacking with a
    report (the CLI exits 1 and says why), leaves no partial copy, and repacks once space is back."""
    path = small_fs / "store"
    sts = states(3)
    with deltackpt.Store(path, chunk_size=CS, threads=2, max_chain=0) as s:
        for i, st in enumerate(sts):
            s.save(st, step=i)
        s.delete(step=0)
        s.delete(step=1)
    filler = fill(small_fs, 96 * 1024)  # room for the index, not for the live third of the pack
    before = stored_bytes(path)
    with deltackpt.Store(path) as s:
        r = s.gc()
    assert r.dead_chunks > 0 and r.repacked_packs == 0
    assert r.repack_stopped is not None and "1 pack(s) left" in r.repack_stopped, r
    assert stored_bytes(path) == before
    capsys.readouterr()
    assert main(["gc", str(path)]) == 1
    assert "repacking stopped" in capsys.readouterr().err
    filler.unlink()
    assert main(["gc", str(path)]) == 0
    assert stored_bytes(path) < before / 2
    with deltackpt.Store(path) as s:
        assert_same_state(sts[2], s.load(step=2))
        assert s.verify().problems == []


def test_pack_rollback_cuts_back_across_a_rollover(tmp_path: Path) -> None:
    """Packs opened since the mark are deleted, the pack open at the mark is cut back, and the next append
    lands at the offset it reports (the file position follows the cut)."""
    w = PackWriter(tmp_path, max_size=100)
    pid, off = w.append(b"A" * 80)
    mark = w.mark()
    w.append(b"B" * 80)  # past max_size: the next append opens a new pack
    w.append(b"C" * 80)
    assert len(list(tmp_path.glob("*.pack"))) == 2
    w.rollback(mark)
    assert [p.stem for p in tmp_path.glob("*.pack")] == [pid]
    assert (tmp_path / f"{pid}.pack").stat().st_size == mark[1]
    w2 = PackWriter(tmp_path, max_size=1 << 20)
    m2 = w2.mark()
    p2, o2 = w2.append(b"D" * 50)
    w2.rollback(m2)  # the pack opened since the mark is gone; the writer opens another
    assert not (tmp_path / f"{p2}.pack").exists()
    p3, o3 = w2.append(b"E" * 50)
    w2.sync()
    w2.close()
    w.close()
    r = PackReader(tmp_path)
    assert bytes(r.read(pid, off, 80)) == b"A" * 80
    assert bytes(r.read(p3, o3, 50)) == b"E" * 50


def test_pack_rollback_with_the_pack_still_open(tmp_path: Path) -> None:
    w = PackWriter(tmp_path)
    pid, _ = w.append(b"A" * 10)
    mark = w.mark()
    w.append(b"B" * 10)
    w.rollback(mark)
    p, o = w.append(b"C" * 10)
    w.sync()
    assert (p, o) == (pid, mark[1])
    assert (tmp_path / f"{pid}.pack").read_bytes()[-20:] == b"A" * 10 + b"C" * 10
    w.close()


CHILD = """
import resource, signal, sys, torch, deltackpt
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG instead
resource.setrlimit(resource.RLIMIT_FSIZE, (int(sys.argv[2]), int(sys.argv[2])))
g = torch.Generator().manual_seed(7)
with deltackpt.Store(sys.argv[1]) as s:
    try:
        s.save({"w": torch.randn(200_000, generator=g)}, step=2)
    except OSError as exc:
        print("failed", exc.errno)
    s.save({"w": torch.zeros(10)}, step=3)  # still fits: the failed save's frames were cut back
    print("saved")
"""


def test_a_save_past_the_file_size_limit_gives_its_bytes_back(tmp_path: Path) -> None:
    """Without root: RLIMIT_FSIZE makes the pack writes of a real process fail (EFBIG)."""
    path = tmp_path / "store"
    st = states(4, 1)[0]
    with deltackpt.Store(path, chunk_size=CS) as s:
        s.save(st, step=1)
    before = stored_bytes(path)
    limit = max(p.stat().st_size for p in path.rglob("*") if p.is_file()) + 256 * 1024
    r = subprocess.run([sys.executable, "-c", CHILD, str(path), str(limit)], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["failed", str(errno.EFBIG), "saved"]
    with deltackpt.Store(path) as s:
        assert [c.step for c in s.list()] == [1, 3]
        assert_same_state(st, s.load(step=1))
        assert s.verify().problems == []
    assert stored_bytes(path) < before + 64 * 1024  # step 3's few bytes, none of the failed save's 800 KB
