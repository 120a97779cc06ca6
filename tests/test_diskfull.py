"""A full disk: saves that fail give their space back and change nothing; gc frees space without needing any.

Most tests put the store on a real, small tmpfs filled up with a filler file, so every write fails as it would
on a full disk (the pack appends, the fsyncs, the manifest, LMDB's commit). Mounting needs root; elsewhere
those tests skip, and the pack writer's rollback and a process over its file size limit (real failed writes,
no root needed) still run. Other I/O errors (an EIO, a quota) come from tests/fail_io.c, an LD_PRELOAD shim
that makes one chosen system call of a child process fail, which then goes on saving.
"""

from __future__ import annotations

import errno
import itertools
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import lmdb
import pytest
import torch
from conftest import DCP_NO_DIST, assert_same_state, preload_shim

import deltackpt
from deltackpt.cli import main
from deltackpt.index import LOCK_FILE_BYTES
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
                if not isinstance(exc, deltackpt.IndexWriteError):  # it names the file it failed to write
                    assert exc.filename is not None and str(path) in str(exc.filename), repr(exc)
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
        print("failed", exc.errno, exc.filename)
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
    failed, code, named, saved = r.stdout.split()
    assert (failed, code, saved) == ("failed", str(errno.EFBIG), "saved")
    assert Path(named).parent == path / "packs" and named.endswith(".pack")  # (it said a bare [Errno 27])
    with deltackpt.Store(path) as s:
        assert [c.step for c in s.list()] == [1, 3]
        assert_same_state(st, s.load(step=1))
        assert s.verify().problems == []
    assert stored_bytes(path) < before + 64 * 1024  # step 3's few bytes, none of the failed save's 800 KB


_FULL_DISK_OPENS = r"""
import errno, faulthandler, json, os, shutil, sys
from pathlib import Path
import torch
import deltackpt
from deltackpt import maintenance

faulthandler.dump_traceback_later(100, exit=True)  # a hang shows where it waits
fs = Path(sys.argv[1])
filler = fs / "filler"

def fill(leave):
    st = os.statvfs(fs)
    with open(filler, "wb") as f:
        try:
            f.write(bytes(max(0, st.f_bavail * st.f_frsize - leave)))
        except OSError:
            pass

def outcome(call):
    try:
        call()
        return "ok"
    except OSError as exc:
        return f"{type(exc).__name__} {errno.errorcode.get(exc.errno, exc.errno)}"

state = {"w": torch.arange(40_000, dtype=torch.float32)}
out = {"create": [], "repair_lost": None, "repair_intact": None}
# 1. a new store on a disk with 0, 4, ... 60 KiB free: the creation fails with an OSError or succeeds; once
# space is back the same path opens as a store, saves and loads
for leave in range(0, 64 * 1024, 4096):
    path = fs / "new"
    fill(leave)
    first = outcome(lambda: deltackpt.Store(path).close())
    filler.unlink()
    with deltackpt.Store(path) as s:
        s.save(state, step=1)
        assert torch.equal(s.load()["w"], state["w"])
    out["create"].append(first)
    shutil.rmtree(path)
# 2. a store whose index was lost, repaired on a full disk (it starts a new index), then with space back
path = fs / "lost"
with deltackpt.Store(path) as s:
    s.save(state, step=1)
shutil.rmtree(path / "index")
fill(0)
out["repair_lost"] = outcome(lambda: maintenance.open_for_repair(path).repair())
filler.unlink()
maintenance.open_for_repair(path).repair()  # (the README's one-liner: the handle is never closed)
with deltackpt.Store(path) as s:
    assert torch.equal(s.load(step=1)["w"], state["w"]) and s.verify().ok
# 3. a repair of an intact store that fails on a full disk lets go of the store: a load in the same process
# (the failed repair's handle never closed) does not wait for it
path = fs / "intact"
with deltackpt.Store(path, chunk_size=4096) as s:  # (a thousand chunks: the rebuild needs new index pages)
    for step in range(1, 4):
        s.save({"w": torch.arange(1 << 20, dtype=torch.float32) + step}, step=step)
fill(0)
out["repair_intact"] = outcome(lambda: maintenance.open_for_repair(path).repair())
filler.unlink()
with deltackpt.Store(path) as s:
    assert torch.equal(s.load(step=1)["w"], torch.arange(1 << 20, dtype=torch.float32) + 1) and s.verify().ok
print(json.dumps(out))
"""


def test_creating_or_repairing_on_a_full_disk_fails_cleanly(small_fs: Path) -> None:
    """On a full disk, making a store, or a repair that starts a new index, fails with an OSError, not SIGBUS
    (LMDB wrote its new lock file through a map, which a full disk turns into SIGBUS) and not as damage (a
    CorruptIndexError). What a failed creation leaves is made into a store once space is back (it was a
    half-written index no open or repair could use), and a failed repair lets go of the store's locks (a load
    in the same process waited for them for ever). In a child process: SIGBUS would kill it."""
    done = subprocess.run([sys.executable, "-c", _FULL_DISK_OPENS, str(small_fs)], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.splitlines()[-1])
    assert out["create"][0] != "ok" and out["create"][-1] == "ok", out
    # (an IndexWriteError from LMDB, or the OSError of writing STORE; anything else fails the child)
    assert all(o == "ok" or o.endswith((" ENOSPC", " EIO")) for o in out["create"]), out
    assert out["repair_lost"].startswith("IndexWriteError ENOSPC"), out
    assert out["repair_intact"].startswith("IndexWriteError"), out


def test_the_lock_file_made_ahead_is_the_one_lmdb_makes(tmp_path: Path) -> None:
    """``index.LOCK_FILE_BYTES`` is the size LMDB itself gives a new lock file (py-lmdb's 126 reader slots): a
    smaller one LMDB would grow sparse again, a larger one would change the reader table's size. The store's
    is made with its blocks allocated, and no temporary file stays behind."""
    lmdb.open(str(tmp_path / "plain"), max_dbs=8, subdir=True).close()
    assert (tmp_path / "plain" / "lock.mdb").stat().st_size == LOCK_FILE_BYTES
    with deltackpt.Store(tmp_path / "s") as s:
        s.save({"w": torch.ones(8)}, step=1)
    st = (tmp_path / "s" / "index" / "lock.mdb").stat()
    assert st.st_size == LOCK_FILE_BYTES and st.st_blocks * 512 >= LOCK_FILE_BYTES
    assert sorted(os.listdir(tmp_path / "s" / "index")) == ["data.mdb", "lock.mdb"]


def test_a_dcp_branch_save_that_failed_on_a_full_disk_still_branches_when_tried_again(small_fs: Path) -> None:
    """After a rollback (a DCP load of an older step), the first save descends from the step loaded. When it fails
    (here the disk is full) and is tried again once there is space, the retry still descends from it, not from
    the abandoned newest step."""
    import warnings

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    from deltackpt import distributed
    from deltackpt.distributed import DeltaStorageReader, DeltaStorageWriter

    root = small_fs / "ckpt"
    x = torch.randn(100_000, generator=torch.Generator().manual_seed(0))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        w = DeltaStorageWriter(root, chunk_size=CS)
        for step in range(4):
            x[step] += 1.0
            w.step = step
            dcp.save({"x": x}, storage_writer=w, **DCP_NO_DIST)
        w.close()
        loaded = {"x": torch.zeros_like(x)}
        dcp.load(loaded, storage_reader=DeltaStorageReader(root, step=1), **DCP_NO_DIST)
        loaded["x"][7] += 1.0
        w = DeltaStorageWriter(root, step=2, chunk_size=CS)
        filler = fill(small_fs, 0)
        with pytest.raises(CheckpointException):
            dcp.save(loaded, storage_writer=w, **DCP_NO_DIST)
        filler.unlink()
        dcp.save(loaded, storage_writer=w, **DCP_NO_DIST)
        w.close()
        infos = distributed.summary(root)
        assert [i.step for i in infos] == [0, 1, 2, 3, 2]
        got = {"x": torch.zeros_like(x)}
        dcp.load(got, storage_reader=DeltaStorageReader(root), **DCP_NO_DIST)
    assert torch.equal(got["x"], loaded["x"])
    with deltackpt.Store(root / "meta") as s:
        assert s.list()[-1].parent == infos[1].id
    with deltackpt.Store(root / "rank-00000") as s:
        ckpts = s.list()
        assert ckpts[-1].step == 2 and ckpts[-1].parent == ckpts[1].id, [(c.step, c.parent) for c in ckpts]


@pytest.mark.parametrize("error, code", [
    (lmdb.Error("mdb_txn_commit: File too large"), errno.EFBIG),  # (RLIMIT_FSIZE: the C extension's form)
    (lmdb.Error("mdb_txn_commit", errno.EDQUOT), errno.EDQUOT),  # (the cffi variant's form)
    (lmdb.DiskError("mdb_txn_commit: No space left on device"), errno.ENOSPC),
    (lmdb.MapFullError("mdb_put: MDB_MAP_FULL: Environment mapsize limit reached"), errno.ENOSPC),
    (lmdb.Error("mdb_txn_commit: Input/output error"), errno.EIO),
    (lmdb.CorruptedError("mdb_put: MDB_CORRUPTED: Located page was wrong type"), errno.EIO),
])
def test_an_index_write_error_carries_the_errno_lmdb_reported(tmp_path: Path, error: lmdb.Error,
                                                             code: int) -> None:
    """A commit past RLIMIT_FSIZE (LMDB: 'File too large') raised IndexWriteError with errno EIO: it carries the
    system error LMDB reported (ENOSPC for a full disk or map, as before; EIO for LMDB's own errors)."""
    import contextlib
    from unittest import mock

    from deltackpt import index

    class Failing:
        def begin(self, write: bool) -> None:
            raise error

    with deltackpt.Store(tmp_path / "s") as s:
        s.save({"w": torch.zeros(10)}, 1)
        with mock.patch.object(index.Index, "_writing", lambda self: contextlib.nullcontext(Failing())), \
                pytest.raises(deltackpt.IndexWriteError) as info:
            s.save({"w": torch.ones(10)}, 2)
        assert info.value.errno == code
        assert "the operation did not commit" in str(info.value)
        assert [c.step for c in s.list()] == [1]


# I/O errors the process survives: tests/fail_io.c, preloaded into a child, makes one chosen system call fail with
# an errno (a disk's EIO, a quota's EDQUOT) and lets the process go on; this process then checks the store.


@pytest.fixture(scope="module")
def fail_io(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return preload_shim(tmp_path_factory, "fail_io")


def run_failing(shim: Path, code: str, *args: str) -> dict[str, object]:
    """Run ``code`` in a child with the shim preloaded (``fail_io`` is its handle on it); return the JSON of its
    last line of output."""
    prelude = "import ctypes, errno, json, sys, torch, deltackpt\nfail_io = ctypes.CDLL(None)\n"
    done = subprocess.run([sys.executable, "-c", prelude + code, *args], env={**os.environ, "LD_PRELOAD": str(shim)},
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.splitlines()[-1])


_META_FAILS = """
s = deltackpt.Store(sys.argv[1], chunk_size=4096)
s.save({"w": torch.full((4096,), 1.0)}, step=1)
fail_io.fail_io_arm(b"meta", 1, int(sys.argv[2]))
try:
    s.save({"w": torch.full((4096,), 2.0)}, step=2)
    failed = None
except deltackpt.errors.IndexWriteError as exc:
    failed = exc.errno
after = []
for step in (3, 4):
    try:
        after.append(s.save({"w": torch.full((4096,), float(step))}, step=step).step)
    except Exception as exc:
        after.append(f"{type(exc).__name__}: {exc}")
print(json.dumps({"fired": fail_io.fail_io_fired(), "failed": failed, "after": after,
                  "listed": [c.step for c in s.list()]}))
"""


@pytest.mark.parametrize("err", [errno.EIO, errno.ENOSPC])
def test_a_save_whose_index_commit_failed_at_its_meta_page_lets_the_next_saves_commit(
    tmp_path: Path, fail_io: Path, err: int
) -> None:
    """A failed write of LMDB's meta page (the commit's last write) leaves the index intact at the commit before,
    but LMDB refuses every later transaction of that environment (MDB_PANIC). The save raises IndexWriteError,
    and the same process's next saves commit (the store opens its environment afresh): they raised
    CorruptIndexError naming a repair, for an index a fresh process found intact."""
    out = run_failing(fail_io, _META_FAILS, str(tmp_path / "s"), str(err))
    assert out == {"fired": 1, "failed": err, "after": [3, 4], "listed": [1, 3, 4]}, out
    with deltackpt.Store(tmp_path / "s") as s:
        assert [c.step for c in s.list()] == [1, 3, 4]
        for step in (1, 3, 4):
            assert torch.equal(s.load(step=step)["w"], torch.full((4096,), float(step)))
        assert s.verify().ok


_REPAIR_FSYNC_FAILS = """
from deltackpt import maintenance
fail_io.fail_io_arm(sys.argv[2].encode(), 1, errno.EIO)
try:
    with maintenance.open_for_repair(sys.argv[1]) as s:
        outcome = repr(s.repair())
except OSError as exc:
    outcome = f"OSError {errno.errorcode[exc.errno]}: {exc.strerror}"
print(json.dumps({"fired": fail_io.fail_io_fired(), "outcome": outcome}))
"""


@pytest.mark.parametrize("where", ["/manifests/", "/packs/"])
def test_a_repair_whose_fsync_fails_changes_nothing_and_loses_nothing(tmp_path: Path, fail_io: Path,
                                                                      where: str) -> None:
    """A repair fsyncs each pack and manifest before it indexes them. One whose fsync fails (EIO) is no damage: the
    repair raises OSError before it changes anything, and the next one restores every checkpoint. Taken for damage,
    a manifest was reported lost and left out of the index (and the next gc deleted it and its chunks as an
    orphan's), a pack's frames all left out."""
    d = tmp_path / "s"
    kept = states(3)
    with deltackpt.Store(d, chunk_size=4096) as s:
        for i, state in enumerate(kept):
            s.save(state, step=i)
    shutil.rmtree(d / "index")
    out = run_failing(fail_io, _REPAIR_FSYNC_FAILS, str(d), "fsync:" + where)
    assert out["fired"] == 1 and str(out["outcome"]).startswith("OSError EIO: repair of"), out
    assert "could not be made durable" in str(out["outcome"]), out
    with deltackpt.maintenance.open_for_repair(d) as s:
        report = s.repair()
    assert (report.checkpoints, report.lost_checkpoints, report.incomplete_checkpoints) == (3, [], []), report
    with deltackpt.Store(d) as s:
        s.gc()
        for i, state in enumerate(kept):
            assert_same_state(s.load(step=i), state)
        assert s.verify().ok


_DELETE_FSYNC_FAILS = """
s = deltackpt.Store(sys.argv[1], chunk_size=4096)
for step in range(3):
    s.save({"w": torch.full((4096,), float(step))}, step=step)
fail_io.fail_io_arm(b"fsync:/manifests", 1, errno.EIO)
try:
    outcome = s.delete(step=1).step
except Exception as exc:
    outcome = f"{type(exc).__name__}: {exc}"
print(json.dumps({"fired": fail_io.fail_io_fired(), "outcome": outcome, "listed": [c.step for c in s.list()]}))
"""


def test_a_delete_whose_directory_fsync_fails_reports_the_delete_it_committed(tmp_path: Path, fail_io: Path) -> None:
    """A delete commits, then unlinks the manifest and fsyncs ``manifests/``. An I/O error of that fsync comes
    after the commit: the delete returns what it deleted (it raised a bare OSError, for a checkpoint gone already:
    tried again, CheckpointNotFoundError). A manifest a crash would bring back is an orphan, which gc deletes."""
    out = run_failing(fail_io, _DELETE_FSYNC_FAILS, str(tmp_path / "s"))
    assert out == {"fired": 1, "outcome": 1, "listed": [0, 2]}, out
    with deltackpt.Store(tmp_path / "s") as s:
        assert [c.step for c in s.list()] == [0, 2] and s.verify().ok
        assert sorted(p.stem for p in (tmp_path / "s" / "manifests").iterdir()) == sorted(c.id for c in s.list())


_META_FAILS_UNDER_READERS = """
import threading
from deltackpt import index
index._CALLS_BATCH = 2  # (scans read 2 entries at a time: the scan below reads again after the failure)
s = deltackpt.Store(sys.argv[1], chunk_size=4096)
s.save({"w": torch.arange(4 * 4096.0)}, step=1)
stored = sorted(k for k, _ in s.index.iter_chunks())
scan = s.index.iter_chunks()
next(scan)
outcomes, stop = [], threading.Event()
def read_on():  # another thread's loads, before, during and after the failed commit
    while not stop.is_set():
        try:
            outcomes.append(torch.equal(s.load(step=1)["w"], torch.arange(4 * 4096.0)))
        except deltackpt.DeltackptError as exc:
            outcomes.append(type(exc).__name__)
reader = threading.Thread(target=read_on)
reader.start()
with s.index.chunk_reader() as chunks:  # a save's lookups, begun before the environment is opened afresh
    before = chunks.has(stored)
    fail_io.fail_io_arm(b"meta", 1, errno.EIO)
    try:
        s.save({"w": -torch.arange(4 * 4096.0)}, step=2)
    except deltackpt.errors.IndexWriteError:
        pass
    after = chunks.has(stored)
try:
    scanned = f"went on: {len(list(scan))} more"
except Exception as exc:
    scanned = f"{type(exc).__module__}.{type(exc).__name__}: {exc}"
stop.set()
reader.join()
print(json.dumps({"fired": fail_io.fail_io_fired(), "before": len(before), "after": len(after),
                  "stored": len(stored), "scan": scanned, "reads": sorted(set(map(str, outcomes))),
                  "saved": s.save({"w": torch.arange(4 * 4096.0) + 3}, step=3).step}))
"""


def test_reads_in_progress_when_a_failed_commit_reopens_the_index_go_on_or_raise_typed(tmp_path: Path,
                                                                                       fail_io: Path) -> None:
    """The environment a failed meta page write left refusing every transaction is closed and opened afresh
    (above). Transactions other code held across that close ended with it, and their next call raised py-lmdb's
    own ``lmdb.Error`` ("Attempt to operate on closed/deleted/dropped object"), which is no DeltackptError: an
    async save's lookups failed that way. A save's lookups now go on in a transaction of the new environment, a
    scan begun before raises a DeltackptError saying what happened, and another thread's loads meanwhile either
    load the checkpoint or raise a DeltackptError."""
    out = run_failing(fail_io, _META_FAILS_UNDER_READERS, str(tmp_path / "s"))
    assert out["fired"] == 1 and out["before"] == out["after"] == out["stored"] > 0, out
    assert str(out["scan"]).startswith("deltackpt.errors.DeltackptError: the index of ") \
        and "was opened afresh while this operation read it" in str(out["scan"]), out
    assert "True" in out["reads"] and set(out["reads"]) <= {"True", "DeltackptError", "CorruptIndexError"}, out
    assert out["saved"] == 3, out
    with deltackpt.Store(tmp_path / "s") as s:
        assert [c.step for c in s.list()] == [1, 3] and s.verify().ok


_META_FAILS_BEFORE_THE_REOPEN = """
import threading
from deltackpt import index
s = deltackpt.Store(sys.argv[1], chunk_size=4096)
s.save({"w": torch.arange(4 * 4096.0)}, step=1)
reopen = index.Index._reopen_if_failed
seen = []
stored = sorted(k for k, _ in s.index.iter_chunks())
def load_and_look_up():
    for what in ("load", "lookups"):
        try:
            if what == "load":
                seen.append(torch.equal(s.load(step=1)["w"], torch.arange(4 * 4096.0)))
            else:
                with s.index.chunk_reader() as chunks:  # (a save's)
                    seen.append(len(chunks.has(stored)))
        except Exception as exc:
            seen.append(f"{type(exc).__name__}: {exc}")
def between(self, env):  # another thread's load and lookups after the failed commit, before its thread reopens
    index.Index._reopen_if_failed = reopen
    other = threading.Thread(target=load_and_look_up, daemon=True)
    other.start()
    other.join(60)
    return reopen(self, env)
index.Index._reopen_if_failed = between
fail_io.fail_io_arm(b"meta", 1, errno.EIO)
try:
    s.save({"w": -torch.arange(4 * 4096.0)}, step=2)
except deltackpt.errors.IndexWriteError:
    pass
print(json.dumps({"fired": fail_io.fail_io_fired(), "seen": seen, "stored": len(stored),
                  "saved": s.save({"w": torch.arange(4 * 4096.0) + 3}, step=3).step}))
"""


def test_reads_begun_before_a_failed_commit_reopens_the_index_go_on_in_the_new_environment(tmp_path: Path,
                                                                                          fail_io: Path) -> None:
    """Between a failed meta page write and the reopen of the environment (on the thread whose commit failed),
    LMDB refuses every transaction of it (MDB_PANIC). Another thread's load then raised CorruptIndexError, which
    calls the index damaged and names a repair, for an index intact at the commit before; a save's lookups did
    too. Now they open the environment afresh themselves and go on."""
    out = run_failing(fail_io, _META_FAILS_BEFORE_THE_REOPEN, str(tmp_path / "s"))
    assert out["stored"] > 0 and out == {"fired": 1, "seen": [True, out["stored"]], "stored": out["stored"],
                                         "saved": 3}, out
    with deltackpt.Store(tmp_path / "s") as s:
        assert [c.step for c in s.list()] == [1, 3] and s.verify().ok


def test_a_new_packs_header_that_fails_to_write_names_the_pack(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A save that rolls over to a new pack on a full disk fails at the new pack's header: that error names the pack
    as every other pack write's does (it was a bare ``[Errno 28] No space left on device``), and nothing is left."""
    from deltackpt import packs

    real = os.pwrite

    def pwrite(fd: int, data: bytes | memoryview, offset: int) -> int:
        if offset == 0 and len(data) == packs.PACK_HEADER.size:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(fd, data, offset)

    a, _, _ = states(0)
    with deltackpt.Store(tmp_path / "s", chunk_size=CS, threads=2) as s:
        monkeypatch.setattr(os, "pwrite", pwrite)
        with pytest.raises(OSError) as info:
            s.save(a, step=1)
        assert info.value.errno == errno.ENOSPC
        assert info.value.filename is not None and str(info.value.filename).endswith(".pack"), repr(info.value)
        assert list((tmp_path / "s" / "packs").iterdir()) == []
        monkeypatch.setattr(os, "pwrite", real)
        s.save(a, step=1)
        assert_same_state(a, s.load(step=1))
