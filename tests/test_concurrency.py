"""Several processes on one store at once: writers, readers, gc, and a Store opened after fork.

Every worker is a fresh interpreter (subprocess running tests/crashworker.py), so no LMDB environment is ever
inherited across fork except in the fork test, which is about exactly that. Workers wait on a barrier file so
their work overlaps; states are pure functions of the step (crashworker.make_state), so any process can check
any checkpoint bit for bit.
"""

from __future__ import annotations

import collections
import contextlib
import fcntl
import json
import os
import random
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import crashworker as cw  # tests/ is on sys.path, as for conftest
import numpy as np
import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as hst

import deltackpt.checkpointer
import deltackpt.layout
import deltackpt.store
from deltackpt import StateChangedError, Store

HERE = Path(__file__).resolve().parent

CS = cw.CHUNK_SIZE
TIMEOUT = 60

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="needs fork and flock semantics of Linux")


class Workers:
    """Starts worker processes and makes sure none outlives the test."""

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen[str]] = []
        self.env = cw.worker_env()

    def start(self, mode: str, **args: Any) -> subprocess.Popen[str]:
        p = subprocess.Popen(
            [sys.executable, str(HERE / "crashworker.py"), mode, json.dumps(args, default=str)],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=self.env,
        )
        self.procs.append(p)
        return p

    def wait_files(self, paths: list[Path], timeout: float = TIMEOUT) -> None:
        deadline = time.monotonic() + timeout
        while not all(p.exists() for p in paths):
            for proc in self.procs:
                if proc.poll() is not None:  # died before getting ready
                    _, err = proc.communicate()
                    raise AssertionError(f"worker {proc.args[2]} exited with {proc.returncode}:\n{err}")
            assert time.monotonic() < deadline, f"workers not ready after {timeout} s"
            time.sleep(0.01)

    @staticmethod
    def finish(proc: subprocess.Popen[str], timeout: float = TIMEOUT) -> dict[str, Any]:
        out, err = proc.communicate(timeout=timeout)
        assert proc.returncode == 0, f"worker {proc.args[2]} exited with {proc.returncode}:\n{err}"
        lines = [ln for ln in out.splitlines() if ln.startswith("RESULT ")]
        assert lines, f"worker {proc.args[2]} printed no result:\n{out}\n{err}"
        return json.loads(lines[-1][len("RESULT ") :])

    def close(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
                p.communicate()


@pytest.fixture
def workers() -> Iterator[Workers]:
    w = Workers()
    try:
        yield w
    finally:
        w.close()


def _check_store(d: Path, expected_steps: set[int]) -> list[Any]:
    """Every checkpoint is the expected one, loads bit-exactly, and verify() is clean."""
    with Store(d, chunk_size=CS) as st:
        infos = st.list()
        steps = [i.step for i in infos]
        assert sorted(steps) == sorted(expected_steps), f"listed {steps}, expected {sorted(expected_steps)}"
        assert len({i.id for i in infos}) == len(infos)
        assert [i.seq for i in infos] == sorted({i.seq for i in infos})
        for info in infos:
            assert info.metadata is not None and info.metadata["step"] == info.step
            cw.assert_same(cw.make_state(info.step), st.load(id=info.id), f"step {info.step}")
            cw.assert_same(cw.make_state(info.step), st.load(info.step), f"step {info.step}")
        rep = st.verify()
        assert rep.ok, "; ".join(str(p) for p in rep.problems[:5])
        assert rep.checkpoints == len(expected_steps)
        return infos


def _check_clean(d: Path) -> None:
    """After a lone gc: no temp files, no orphan manifests, no pack without a live chunk."""
    with Store(d, chunk_size=CS) as st:
        ids = {i.id for i in st.list()}
        live_packs = {loc.pack_id for _, loc in st.index.iter_chunks()}
    assert list((d / "tmp").iterdir()) == []
    assert {p.stem for p in (d / "manifests").glob("*.manifest")} == ids
    assert {p.stem for p in (d / "packs").glob("*.pack")} <= live_packs


@pytest.mark.parametrize("create", ["before", "racing"], ids=["existing-store", "both-create-the-store"])
def test_two_processes_save_at_once(tmp_path: Path, workers: Workers, create: str) -> None:
    d = tmp_path / "store"
    if create == "before":
        Store(d, chunk_size=CS).close()
    go = tmp_path / "go"
    ranges = [list(range(0, 10)), list(range(100, 110))]
    procs = [
        workers.start("saver", store=d, steps=steps, ready=tmp_path / f"ready{k}", barrier=go,
                      check_load=True, open_after_barrier=create == "racing",
                      rendezvous=[tmp_path / f"first{k}", tmp_path / f"first{1 - k}"])
        for k, steps in enumerate(ranges)
    ]
    workers.wait_files([tmp_path / "ready0", tmp_path / "ready1"])
    go.touch()
    results = [workers.finish(p) for p in procs]
    for r, steps in zip(results, ranges):
        assert r["saved"] == steps and r["deleted"] == []
    (a0, a1), (b0, b1) = results[0]["window"], results[1]["window"]
    assert a0 < b1 and b0 < a1, f"the two writers did not overlap: {results}"
    infos = _check_store(d, set(ranges[0]) | set(ranges[1]))
    assert len({i.metadata["by"] for i in infos}) == 2
    # both wrote the chunks every step shares; whichever committed first is the one the index keeps
    with Store(d, chunk_size=CS) as st:
        st.gc()
    _check_clean(d)
    _check_store(d, set(ranges[0]) | set(ranges[1]))


_CREATE_AND_SAVE = """
import sys
import numpy as np
from deltackpt import Store
with Store(sys.argv[1], chunk_size=int(sys.argv[2])) as st:
    st.save({"w": np.arange(5000, dtype=np.float32)}, step=7)
"""


# (each patched where its caller looks it up: a Store's open calls check_new_store_dir by the name store.py
# imported, and layout.lost_store calls holds_checkpoints)
@pytest.mark.parametrize(("module", "window"), [(deltackpt.store, "check_new_store_dir"),
                                                (deltackpt.layout, "holds_checkpoints")],
                         ids=["before-the-empty-directory-check", "before-the-look-for-a-lost-STORE"])
def test_a_store_another_process_creates_meanwhile_is_opened(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                              module: ModuleType, window: str) -> None:
    """Processes that open a store that does not exist yet all at once (every rank of a job making its
    Checkpointer): another process creates it, and saves into it, between this one's look for STORE and its
    check that the directory holds nothing foreign, or its look for a store that lost STORE. This one opens
    that store. Before, it raised "not a deltackpt store and not empty (it holds 'STORE')" (4 of 800 creations
    by 4 processes at once, and a DCP test that failed now and then), or took the store for one whose STORE
    was lost. The other process runs, as a real process, at that point of this one's open."""
    path = tmp_path / "store"
    look = getattr(module, window)
    raced: list[bool] = []

    def another_process_first(p: Path) -> Any:
        if not raced:
            raced.append(True)
            subprocess.run([sys.executable, "-c", _CREATE_AND_SAVE, str(path), str(CS)], check=True,
                           capture_output=True, env=cw.worker_env())
        return look(p)

    monkeypatch.setattr(module, window, another_process_first)
    with Store(path, chunk_size=CS) as st:
        monkeypatch.undo()
        assert raced
        assert [i.step for i in st.list()] == [7]
        assert np.array_equal(st.load()["w"], np.arange(5000, dtype=np.float32))
        st.save({"w": np.zeros(10, dtype=np.float32)}, step=8)
        assert st.verify().ok


@pytest.mark.parametrize("keep", [None, 4], ids=["saves", "saves-and-deletes"])
def test_reader_while_writer_saves(tmp_path: Path, workers: Workers, keep: int | None) -> None:
    d = tmp_path / "store"
    Store(d, chunk_size=CS).close()
    go, stop = tmp_path / "go", tmp_path / "stop"
    steps = list(range(30))
    reader = workers.start("reader", store=d, ready=tmp_path / "ready-r", stop=stop, barrier=go,
                           deletes=keep is not None)
    writer = workers.start("saver", store=d, steps=steps, ready=tmp_path / "ready-w", barrier=go, keep=keep)
    workers.wait_files([tmp_path / "ready-r", tmp_path / "ready-w"])
    go.touch()
    w = workers.finish(writer)
    stop.touch()
    r = workers.finish(reader)
    assert w["saved"] == steps
    expected = set(steps) if keep is None else set(steps[-keep:])
    _check_store(d, expected)
    print("reader:", {k: v for k, v in r.items() if k != "seen"}, "latest steps seen:", len(r["seen"]))
    assert r["seen"][-1] == steps[-1]  # its last pass began after the writer was done
    assert len(r["seen"]) >= 2, f"the reader never saw the store change while the writer ran: {r}"
    # a checkpoint deleted under a reader is CheckpointNotFoundError, never a corruption error
    assert r["errors"] == [], f"{len(r['errors'])} loads failed: {r['errors'][:3]}"


def test_gc_while_other_processes_save_and_delete(tmp_path: Path, workers: Workers) -> None:
    d = tmp_path / "store"
    Store(d, chunk_size=CS).close()
    go, stop = tmp_path / "go", tmp_path / "stop"
    ranges = [list(range(0, 20)), list(range(1000, 1020))]
    keep = 3
    savers = [
        workers.start("saver", store=d, steps=steps, ready=tmp_path / f"ready{k}", barrier=go,
                      check_load=True, keep=keep, pack_size=16 * 1024)
        for k, steps in enumerate(ranges)
    ]
    gc = workers.start("gcloop", store=d, ready=tmp_path / "ready-gc", stop=stop, sleep=0.005)
    workers.wait_files([tmp_path / "ready0", tmp_path / "ready1", tmp_path / "ready-gc"])
    go.touch()
    results = [workers.finish(p) for p in savers]
    stop.touch()
    g = workers.finish(gc)
    assert g["runs"] + len(g["errors"]) >= 1
    expected: set[int] = set()
    for r, steps in zip(results, ranges):
        assert r["saved"] == steps
        assert r["deleted"] == steps[:-keep]
        expected |= set(steps[-keep:])
    _check_store(d, expected)
    with Store(d, chunk_size=CS) as st:
        rep = st.gc()
    _check_clean(d)
    _check_store(d, expected)
    print("gc loop:", {k: v for k, v in g.items() if k != "errors"}, "final gc:", rep)
    # gc must also not fail while others work: a checkpoint deleted meanwhile is not a damaged manifest
    n_err = len(g["errors"])
    assert n_err == 0, f"{n_err} of {n_err + g['runs']} gc runs failed: {g['errors'][:3]}"


def test_gc_and_readers_while_another_process_deletes(tmp_path: Path, workers: Workers) -> None:
    """delete() runs while gc (or a load) is between reading the index and reading a manifest.

    A checkpoint deleted meanwhile is simply gone: gc must not fail on it (it has nothing to free of it yet)
    and a load must raise CheckpointNotFoundError, not a corruption error.
    """
    d = tmp_path / "store"
    steps = list(range(60))
    with Store(d, chunk_size=CS, pack_size=32 * 1024) as st:
        for s in steps:
            st.save(cw.make_state(s), s, metadata={"step": s, "by": 0})
    victims = random.Random(12345).sample(steps, 45)  # any order: gc reads manifests oldest first
    kept = set(steps) - set(victims)
    go, stop = tmp_path / "go", tmp_path / "stop"
    deleter = workers.start("deleter", store=d, steps=victims, ready=tmp_path / "ready-d", barrier=go,
                            pause=0.002)
    gc = workers.start("gcloop", store=d, ready=tmp_path / "ready-gc", stop=stop, sleep=0.002)
    reader = workers.start("reader", store=d, ready=tmp_path / "ready-r", stop=stop, barrier=go, deletes=True)
    workers.wait_files([tmp_path / "ready-d", tmp_path / "ready-gc", tmp_path / "ready-r"])
    go.touch()
    workers.finish(deleter)
    stop.touch()
    g = workers.finish(gc)
    r = workers.finish(reader)
    _check_store(d, kept)
    with Store(d, chunk_size=CS) as st:
        st.gc()
    _check_clean(d)
    _check_store(d, kept)
    print("gc loop:", {k: v for k, v in g.items() if k != "errors"}, "gc errors:", len(g["errors"]))
    print("reader:", {k: v for k, v in r.items() if k not in ("seen", "errors")}, "errors:", len(r["errors"]))
    failures = []
    if g["errors"]:
        n = len(g["errors"])
        failures.append(f"{n} of {n + g['runs']} gc runs failed, e.g. {g['errors'][0]}")
    if r["errors"]:
        n = len(r["errors"])
        failures.append(f"{n} of {n + r['loads']} loads failed, e.g. {r['errors'][0]}")
    assert not failures, "\n".join(failures)


def test_store_opened_after_fork(tmp_path: Path, workers: Workers) -> None:
    d = tmp_path / "store"
    r = workers.finish(workers.start("fork", store=d))
    assert r == {"ok": True}
    with Store(d, chunk_size=CS) as st:
        assert [i.step for i in st.list()] == [0, 1, 2]
        for s in (0, 1, 2):
            cw.assert_same(cw.make_state(s), st.load(s), f"step {s}")
        rep = st.verify()
        assert rep.ok, "; ".join(str(p) for p in rep.problems[:5])


def _gc_elsewhere(path: Path) -> str:
    """gc of ``path`` in another process, giving up after 3 s of waiting for the store: its outcome's name."""
    code = ("import sys, deltackpt\nfrom deltackpt.errors import StoreLockedError\n"
            "with deltackpt.Store(sys.argv[1]) as s:\n"
            "    try:\n        r = s.gc(timeout=3)\n        print('ok', r.skipped_active_packs)\n"
            "    except StoreLockedError:\n        print('locked')\n")
    return subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True,
                          check=True, timeout=120).stdout.strip()


def test_child_forked_during_a_save_holds_nothing_of_the_store(tmp_path: Path) -> None:
    """A process forked while a save holds the store's locks (a DataLoader starting its workers while an async
    save runs) shares those open files, but the locks are the save's: once it returns (and once its pack is
    closed), gc in another process neither waits for the child nor takes the pack for one still being written."""
    d = tmp_path / "store"
    st = Store(d, chunk_size=CS)
    st.save(cw.make_state(0), step=0)
    r, w = os.pipe()
    with st._gc_lock():  # what a save or load holds while it runs
        pid = os.fork()
        if pid == 0:  # the child only waits, holding everything it inherited
            os.close(w)
            os.read(r, 1)
            os._exit(0)
    os.close(r)
    try:
        assert _gc_elsewhere(d) == "ok 1"  # the parent's open pack counts as active, nothing else waits
        st.close()
        assert _gc_elsewhere(d) == "ok 0"  # closed by its writer: no longer active, though the child has it
    finally:
        os.write(w, b"x")
        os.waitpid(pid, 0)
        os.close(w)


_FORK_THEN_DIE = """
import os, signal, sys, torch, deltackpt
st = deltackpt.Store(sys.argv[1], chunk_size=int(sys.argv[2]))
st.save({"w": torch.randn(4 * int(sys.argv[2]))}, step=0)  # its pack stays open: the writer may append to it
with st._gc_lock():  # what a save or load holds while it runs
    pid = os.fork()
    if pid == 0:  # a worker that never touches the store, and outlives its parent
        os.read(0, 1)
        os._exit(0)
    print(pid, flush=True)
    os.kill(os.getpid(), signal.SIGKILL)  # the training process dies mid-save (the OOM killer, kill -9)
"""


def test_a_child_forked_mid_save_holds_no_lock_once_its_parent_is_killed(tmp_path: Path) -> None:
    """The locks of a process SIGKILLed mid-save go with it, even when it forked a child that lives on (a Pool's
    worker): the child shared the lock files and the writer's pack, and as flock() locks belong to the open
    file, gc and repair (which take the same lock exclusively) waited for the child's whole life, and gc took
    the dead writer's pack for one still being appended to. The child now closes them at the fork."""
    d = tmp_path / "store"
    parent = subprocess.Popen([sys.executable, "-c", _FORK_THEN_DIE, str(d), str(CS)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    child = int(parent.stdout.readline())  # type: ignore[union-attr]
    assert parent.wait(timeout=60) == -9
    try:
        assert os.path.exists(f"/proc/{child}")
        assert _gc_elsewhere(d) == "ok 0"  # no wait for the child, and the dead writer's pack is no active one
    finally:
        parent.stdin.close()  # type: ignore[union-attr]  (the child's stdin: it reads EOF and exits)
        for _ in range(200):
            if not os.path.exists(f"/proc/{child}"):
                break
            time.sleep(0.05)


@contextlib.contextmanager
def _thinned_when_read(a: Store, b: Store, cid: str, *, after_read: bool) -> Iterator[list[str]]:
    """While it lasts, handle ``b`` rewrites (thins) checkpoint ``cid`` at ``a``'s first record read, just
    before it or (``after_read``) just after; yields the list that then holds the rewrite's id."""
    from unittest import mock

    real = a._record
    raced: list[str] = []

    def thin() -> None:
        if not raced:
            raced.append(b.rewrite({"w": torch.zeros(4)}, id=cid, metadata={"thinned": True}).id)

    def read(*args: Any, **kwargs: Any) -> Any:
        if not after_read:
            thin()
        rec = real(*args, **kwargs)
        if after_read:
            thin()
        return rec

    with mock.patch.object(a, "_record", side_effect=read):
        yield raced


def test_delete_racing_a_rewrite_deletes_the_rewritten_checkpoint(tmp_path: Path) -> None:
    """A delete that read a checkpoint's record just before another handle rewrote it (retention thinning it in
    another process) must not remove by the stale record: the rewrite took the old one's seq, so that would
    delete the new record and leave its id dangling. The delete reads again and deletes what took its place."""
    d = tmp_path / "store"
    with Store(d, chunk_size=CS) as a, Store(d, chunk_size=CS) as b:
        ids = [a.save({"w": torch.full((CS,), float(s))}, step=s).id for s in (1, 2, 3)]
        # between the delete's read and its commit, the other handle thins checkpoint 2
        with _thinned_when_read(a, b, ids[1], after_read=True) as raced:
            a.delete(id=ids[1])
        assert [i.id for i in a.list()] == [ids[0], ids[2]]
        with a.index.env.begin() as txn:  # no id is left naming a record that is gone
            assert sorted(bytes(k).decode() for k, _ in txn.cursor(db=a.index.db_ids)) == sorted([ids[0], ids[2]])
        assert not (d / "manifests" / f"{raced[0]}.manifest").exists()
        a.gc()
        assert a.verify().ok and float(a.load(3)["w"][0]) == 3.0


def test_retain_racing_a_rewrite_returns_what_it_deleted(tmp_path: Path) -> None:
    """Retention that follows a checkpoint to its rewrite (another handle thinned it between the listing and the
    commit) deletes the rewrite and returns its info, not the listing's: the old id no longer names anything."""
    from deltackpt import Retention

    d = tmp_path / "store"
    with Store(d, chunk_size=CS) as a, Store(d, chunk_size=CS) as b:
        ids = [a.save({"w": torch.full((CS,), float(s))}, step=s).id for s in (1, 2, 3)]
        # before the delete's first read, the other handle thins checkpoint 2
        with _thinned_when_read(a, b, ids[1], after_read=False) as raced:
            gone = a.retain(Retention(keep_last=1))
        assert raced[0] != ids[1]
        assert [(i.id, i.step) for i in gone] == [(ids[0], 1), (raced[0], 2)]
        assert gone[1].metadata == {"thinned": True}
        assert [i.id for i in a.list()] == [ids[2]]


def _deleted_packs_open(store: Path) -> list[str]:
    """Pack files of ``store`` this process holds open although they were deleted (Linux /proc)."""
    out = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:  # (the descriptor listdir itself used)
            continue
        if target.endswith(".pack (deleted)") and target.startswith(str(store / "packs")):
            out.append(target)
    return out


def test_long_running_writer_gives_space_back_to_a_gc_elsewhere(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """A training process that saves and deletes (retention) while `deltackpt gc` runs from another process:
    the writer moves on from a pack once it holds a state's worth, so gc can delete what retention freed; and
    packs gc deleted are closed by the writer's next read or save, so their space really returns. The delta
    base cache keeps only the last state's chunks, and close() lets it go."""
    import numpy as np
    import torch

    import deltackpt.store as store_mod

    monkeypatch.setattr(store_mod, "_SEAL_BYTES", 256 << 10)  # (64 MiB by default; small states here)
    d = tmp_path / "store"
    rng = np.random.default_rng(0)
    state_bytes = 192 << 10
    with Store(d, chunk_size=CS) as st:
        for step in range(1, 41):
            st.save({"w": torch.from_numpy(rng.standard_normal(state_bytes // 4).astype(np.float32))}, step=step)
            st.load(step)  # the writer reads its packs too (restores, thinning)
            for old in st.list()[:-2]:
                st.delete(id=old.id)
            assert st._base_cache.size <= state_bytes
            if step % 10 == 0:
                assert _gc_elsewhere(d).startswith("ok ")
                st.load(step)  # ... and closes what that gc deleted
                assert _deleted_packs_open(d) == []
        on_disk = sum(p.stat().st_size for p in (d / "packs").glob("*.pack"))
        assert on_disk < 6 * state_bytes, on_disk  # two live states and the pack being written, not 40 saves
    assert st._base_cache.size == 0


def test_rewrite_unlinks_the_replaced_manifest_under_the_gc_lock(tmp_path: Path) -> None:
    """A repair (gc.lock exclusive) restores every manifest it finds: one running between a rewrite's commit and
    its unlink of the replaced manifest would restore the replaced checkpoint, whose manifest the rewrite then
    unlinks, leaving the index naming a missing manifest. The unlink happens while the rewrite holds the lock:
    an exclusive lock is not to be had then."""
    import fcntl

    import torch

    d = tmp_path / "store"
    with Store(d, chunk_size=CS) as st:
        old = st.save({"w": torch.ones(CS)}, step=1).id
        real = st._unlink_manifests
        exclusive_was_free: list[bool] = []

        def unlink_manifests(checkpoint_ids: Any) -> None:
            fd = os.open(d / "gc.lock", os.O_RDONLY)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                exclusive_was_free.append(True)
            except BlockingIOError:
                exclusive_was_free.append(False)
            finally:
                os.close(fd)
            real(checkpoint_ids)

        st._unlink_manifests = unlink_manifests  # type: ignore[method-assign]
        st.rewrite({"w": torch.zeros(4)}, id=old)
        assert exclusive_was_free == [False]
        assert not (d / "manifests" / f"{old}.manifest").exists()


@pytest.mark.parametrize("delta_cache_bytes", [1 << 30, 0])  # new chunks checked as copied, or once encoded
def test_a_tensor_changed_during_a_save_raises_and_stores_nothing_wrong(tmp_path: Path,
                                                                       delta_cache_bytes: int) -> None:
    """Another thread writing to a tensor while a save encodes it (a sync save racing the training loop): the
    save raises StateChangedError naming the tensor and commits nothing. Before, it committed a frame that did
    not decode to the chunk id it was stored under, and later saves of those bytes deduplicated onto it."""
    store = Store(tmp_path / "store", chunk_size=CS, delta_cache_bytes=delta_cache_bytes)
    w = torch.randn(64 * CS // 4)
    a, b = w.clone(), torch.randn(64 * CS // 4)
    stop = threading.Event()

    def hammer() -> None:
        while not stop.is_set():  # A, B, A, ...: a check of the live bytes after encoding can meet A again
            w.copy_(b)  # torch releases the GIL while it writes
            w.copy_(a)

    t = threading.Thread(target=hammer, daemon=True)
    t.start()
    raised: list[str] = []
    saves = 0
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)  # the writer thread gets the GIL back often, whatever the save is doing
    deadline = time.monotonic() + 30
    try:  # until two saves met a change (nearly every save does; a loaded machine may run the thread less)
        while len(raised) < 2 and time.monotonic() < deadline:
            saves += 1
            try:
                store.save({"opt": {"w": w}, "b": torch.ones(8)}, step=saves)
            except StateChangedError as exc:
                raised.append(str(exc))
    finally:
        stop.set()
        t.join()
        sys.setswitchinterval(interval)
    assert raised and all(msg.startswith("'opt.w': a tensor changed") for msg in raised), raised
    assert len(store.list()) == saves - len(raised)
    assert not store.verify().problems  # what did commit decodes to its ids
    still = w.clone()
    store.save({"opt": {"w": still}, "b": torch.ones(8)}, step=99)
    assert torch.equal(store.load(99)["opt"]["w"], still)
    store.close()


def test_rewrite_racing_a_repair_elsewhere_commits(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Retention thins a checkpoint (a rewrite) while a repair in another process renumbers the checkpoints
    (an earlier one was deleted, so the seqs close up): the rewrite takes the checkpoint's current place. Before,
    its commit raised CorruptIndexError ("to replace is not in the index") on a healthy store, and a Checkpointer
    with full_last= died with it. The repair runs, as a real process, right after the rewrite read the record."""
    path = tmp_path / "store"
    store = Store(path, chunk_size=CS)
    ids = [store.save({"model": {"w": torch.full((100,), float(k))}, "opt": torch.randn(100)}, step=k).id
           for k in range(1, 5)]
    store.delete(id=ids[0])
    record = Store._record
    raced: list[bool] = []

    def record_then_repair(self: Store, step: int | None = None, id: str | None = None) -> Any:
        rec = record(self, step, id)
        if id == ids[2] and not raced:
            raced.append(True)
            subprocess.run([sys.executable, "-m", "deltackpt", "repair", str(path)], check=True, capture_output=True,
                           env=cw.worker_env())
        return rec

    monkeypatch.setattr(Store, "_record", record_then_repair)
    before = [i.seq for i in store.list()]
    info = store.rewrite({"model": {"w": torch.full((100,), 3.0)}, "thinned": True}, id=ids[2])
    monkeypatch.undo()
    assert raced and before == [2, 3, 4]
    assert [(i.step, i.seq) for i in store.list()] == [(2, 1), (3, 2), (4, 3)]
    thinned = store.load(3)
    assert set(thinned) == {"model", "thinned"} and torch.equal(thinned["model"]["w"], torch.full((100,), 3.0))
    assert store.info(step=3).id == info.id and store.verify().ok
    store.close()


def _repaired_while_running(tmp_path: Path, script: str, damage: Callable[[Path, int], None]) -> str:
    """A store of 5 checkpoints; ``script`` runs in another process on it for 10 seconds while it is damaged
    (``damage(path, n)``) and repaired by `deltackpt repair`, three times. Returns the script's output."""
    path = tmp_path / "store"
    with Store(path, chunk_size=CS) as s:
        for i in range(5):
            s.save({"x": torch.randn(1000)}, step=i)
    other = subprocess.Popen([sys.executable, "-c", script, str(path), "10"], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, env=cw.worker_env())
    try:
        # the script says when it has the store open (importing torch alone can take seconds on a loaded machine)
        assert other.stdout is not None and other.stdout.readline() == "ready\n", other.stderr
        time.sleep(0.5)
        for n in range(3):
            damage(path, n)
            r = subprocess.run([sys.executable, "-m", "deltackpt", "repair", str(path)], capture_output=True,
                               text=True, env=cw.worker_env())
            assert r.returncode == 0, r.stderr
            time.sleep(0.5)
        out, err = other.communicate(timeout=TIMEOUT)
    finally:
        if other.poll() is None:
            other.kill()
    assert other.returncode == 0, err
    return out


def test_saves_elsewhere_wait_for_a_repair_of_a_damaged_index(tmp_path: Path) -> None:
    """`deltackpt repair` of a damaged index, three times, while another process saves every few milliseconds:
    the saves wait for each rebuilt index rather than fail on the empty one (before, the repair let go of the
    gc lock between moving the damaged index aside and rebuilding it, and saves in between failed with
    CorruptIndexError "lost or emptied"), and every acknowledged save is in the store afterwards."""
    import lmdb

    def damage(path: Path, n: int) -> None:
        env = lmdb.open(str(path / "index"), max_dbs=8)
        ckpts = env.open_db(b"ckpts")  # (before the write transaction: opening one takes the write lock)
        # a record that does not parse: the index is damaged. Its key is below every seq (they start at 1), so
        # the saver's reads of the newest record do not meet it before the repair starts (they would fail,
        # rightly, with CorruptIndexError); the repair's scan of all records does
        with env.begin(write=True) as txn:
            txn.put(struct.pack(">Q", 0), b"{garbage%d" % n, db=ckpts)
        env.close()

    acked = json.loads(_repaired_while_running(tmp_path, _SAVER, damage))
    assert len(acked) > 20
    with Store(tmp_path / "store") as s:
        listed = {i.id for i in s.list()}
        assert set(acked) <= listed and s.verify().ok


def test_listings_elsewhere_wait_for_a_repair_of_a_lost_index(tmp_path: Path) -> None:
    """`deltackpt repair` of a store whose index file was lost, three times, while another process lists the
    store in a loop (list, latest, info, len: calls that take no lock): each call made while the repair
    rebuilds the index waits for it (before, it raised CorruptIndexError "lost or emptied"), and none ever
    sees part of the checkpoints."""

    def damage(path: Path, n: int) -> None:
        (path / "index" / "data.mdb").unlink()  # (the lister keeps reading the file it has open)

    calls, fewest = json.loads(_repaired_while_running(tmp_path, _LISTER, damage))
    assert calls > 20 and fewest == 5


_LISTER = """
import json, sys, time, deltackpt
s = deltackpt.Store(sys.argv[1]); calls = 0; fewest = None; end = time.time() + float(sys.argv[2])
print("ready", flush=True)
while time.time() < end:
    n = len(s.list())
    got = (s.latest().step, s.info(2).step, len(s))
    assert got == (4, 2, n), (got, n)
    fewest = n if fewest is None else min(fewest, n)
    calls += 1
print(json.dumps([calls, fewest]))
"""


_SAVER = """
import json, sys, time, torch, deltackpt
s = deltackpt.Store(sys.argv[1]); acked = []; end = time.time() + float(sys.argv[2])
print("ready", flush=True)
while time.time() < end:
    acked.append(s.save({"x": torch.randn(1000)}, step=len(acked) + 10).id)
    time.sleep(0.002)
print(json.dumps(acked))
"""


def _sparse_packs(path: Path, steps: int = 10) -> dict[int, dict[str, torch.Tensor]]:
    """A store whose packs each hold the frames of two or three checkpoints (of ``steps``), with every other step
    deleted: gc has several sparse packs to repack. Returns the retained states by step."""
    gen = torch.Generator().manual_seed(0)
    states = {step: {"w": torch.randn(3 * CS // 4, generator=gen)} for step in range(steps)}
    with Store(path, chunk_size=CS, pack_size=6 * CS) as s:
        for step, state in states.items():
            s.save(state, step=step)
        for step in range(0, steps, 2):
            s.delete(step)
    return {step: state for step, state in states.items() if step % 2}


def test_saves_and_loads_run_between_the_packs_gc_repacks(tmp_path: Path) -> None:
    """gc holds the store alone while it finds the garbage and while it copies each sparse pack, not across the
    whole repack: a training job saving every step waits for one pack at a time. Before, a save (or load) that
    started during the repack waited until gc returned."""
    path = tmp_path / "s"
    kept = _sparse_packs(path)
    done: list[str] = []
    with Store(path) as s, Store(path) as other:

        def between_packs(n: int, total: int) -> None:
            if n == 1:
                t = threading.Thread(target=lambda: done.append(other.save({"w": torch.ones(9)}, step=100).id))
                t.start()
                t.join(20)
                assert done, "the save waited for the whole gc"
                assert torch.equal(other.load(1)["w"], kept[1]["w"])

        report = s.gc(repack_below=0.75, progress=between_packs)
        assert report.repacked_packs >= 2 and done and report.repack_stopped is None
        for step, state in kept.items():
            assert torch.equal(s.load(step)["w"], state["w"])
        assert torch.equal(s.load(100)["w"], torch.ones(9))
        assert s.verify().ok


@pytest.mark.parametrize("second", ["repair", "gc"])
def test_one_gc_or_repair_runs_at_a_time(tmp_path: Path, second: str) -> None:
    """Between two of its packs a gc lets saves in, but not a repair (which indexes the frames of every pack,
    also the dead ones of a pack gc is about to unlink, that a save could then deduplicate onto) nor another gc
    (whose plan would overlap): they wait for ``maint.lock`` until the gc returns."""
    path = tmp_path / "s"
    kept = _sparse_packs(path)
    finished: list[str] = []
    threads: list[threading.Thread] = []
    with Store(path) as s:

        def between_packs(n: int, total: int) -> None:
            if n == 1:
                def run() -> None:
                    with Store(path) as other:
                        getattr(other, second)()
                    finished.append(second)
                threads.append(threading.Thread(target=run))
                threads[0].start()
                threads[0].join(1.0)
                assert not finished, f"a {second} ran between two packs of a gc"

        report = s.gc(repack_below=0.75, progress=between_packs)
        assert report.repacked_packs >= 2
        threads[0].join(TIMEOUT)
        assert finished == [second]
        for step, state in kept.items():
            assert torch.equal(s.load(step)["w"], state["w"])
        assert s.verify().ok


def test_a_pack_gc_repacks_later_keeps_what_the_index_points_into_it_then(tmp_path: Path) -> None:
    """Between two packs of a gc the index may come to point a live chunk at another frame of it, in a pack gc
    is still to repack (a repair of an older deltackpt, which does not wait for maint.lock, indexes a killed
    save's duplicate frames). Each pack's turn copies what the index points into the pack then; before, only
    the entries gc had found in it, so the pack was unlinked under the re-pointed chunk: a checkpoint lost."""
    from deltackpt import codec, packs
    from deltackpt.index import ChunkLoc

    path = tmp_path / "s"
    kept = _sparse_packs(path)
    moved: list[bytes] = []
    with Store(path) as s:

        def between_packs(n: int, total: int) -> None:
            if n != 1:
                return
            live = collections.Counter()  # live bytes per pack
            for _, loc in s.index.iter_chunks():
                live[loc.pack_id] += loc.frame_len
            pending = [p.stem for p in (path / "packs").glob("*.pack")  # sparse, not gc's own: still to repack
                       if not packs.is_active(p) and 0 < live[p.stem] < 0.75 * p.stat().st_size]
            assert pending
            target = pending[0]
            k, loc = next((k, loc) for k, loc in s.index.iter_chunks() if loc.pack_id != target)
            frame = s.reader.read(loc.pack_id, loc.offset, loc.frame_len)
            codec.check_frame(frame)
            pack = path / "packs" / f"{target}.pack"
            offset = pack.stat().st_size
            with open(pack, "ab") as f:  # a duplicate frame of chunk k, as a killed save leaves one
                f.write(frame)
            with s.index._write() as txn:
                txn.put(k, ChunkLoc(target, offset, loc.frame_len, loc.codec, loc.depth, loc.base).pack(),
                        db=s.index.db_chunks)
            moved.append(k)

        report = s.gc(repack_below=0.75, progress=between_packs)
        assert moved and report.repacked_packs >= 2
        for step, state in kept.items():
            assert torch.equal(s.load(step)["w"], state["w"])
        assert s.verify().ok


def test_a_repack_of_many_packs_reads_the_chunks_table_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A repack lists what lies in each pack from one scan of the chunks table for all the packs it copies,
    taken again only after a commit that is not its own. Before, each pack's turn scanned the whole table: P
    sparse packs read it P times (a gc of 689 packs of a 5,000-checkpoint store read 2.8 million entries for
    5,568 chunks, 9.2 s against 6.0 s)."""
    from deltackpt.index import Index

    path = tmp_path / "s"
    states = _sparse_packs(path, 24)
    scans: collections.Counter[str] = collections.Counter()

    def counting(name: str, real: Callable[..., Any]) -> Callable[..., Any]:
        def counted(self: Index, *args: Any) -> Any:
            scans[name] += 1
            return real(self, *args)
        return counted

    for name in ("iter_chunks", "chunks_in_pack", "chunks_in_packs"):  # every full scan of the chunks table
        if hasattr(Index, name):
            monkeypatch.setattr(Index, name, counting(name, getattr(Index, name)))
    with Store(path) as s:
        report = s.gc(repack_below=0.75)
        assert report.repacked_packs >= 5
        assert sum(scans.values()) == 2, scans  # gc's search for garbage, and the repack's lists
        for step in range(1, 24, 2):
            assert torch.equal(s.load(step)["w"], states[step]["w"])
        assert s.verify().ok


def test_gc_at_one_repacks_only_packs_with_dead_frames(tmp_path: Path) -> None:
    """``repack_below=1.0`` repacks every pack that holds a dead frame, and no other: a pack whose frames are
    all live counts as 1.0 (its 16-byte header made it 0.99..., so every gc copied the whole store again)."""
    path = tmp_path / "s"
    _sparse_packs(path)
    with Store(path) as s:
        first = s.gc(repack_below=1.0)
        assert first.repacked_packs > 0
        again = s.gc(repack_below=1.0)
        assert again.repacked_packs == 0 and again.moved_chunks == 0 and again.dead_chunks == 0


def test_gc_refuses_a_handle_open_for_repair_until_it_repaired(tmp_path: Path) -> None:
    """A lost index is replaced by an empty one that only the repair fills: gc on that handle before repair()
    took every pack and manifest for garbage and deleted them, and the repair then found nothing to restore."""
    import shutil

    from deltackpt import DeltackptError, maintenance

    path = tmp_path / "s"
    kept = _sparse_packs(path)
    shutil.rmtree(path / "index")
    with maintenance.open_for_repair(path) as s:
        with pytest.raises(DeltackptError, match="run repair"):
            s.gc()
        assert s.repair().checkpoints == len(kept)
        s.gc()
        for step, state in kept.items():
            assert torch.equal(s.load(step)["w"], state["w"])


def test_a_batched_delete_passes_over_one_another_process_deleted_meanwhile(tmp_path: Path) -> None:
    """`deltackpt rm A B` deletes both in one commit. When another process deletes B between the read and that
    commit, the commit removes A and leaves B (its id no longer names the seq read); B is then gone, which is what
    was asked. It raised CheckpointNotFoundError for B after A's commit, leaving A's manifest behind."""
    from unittest import mock

    d = tmp_path / "store"
    with Store(d, chunk_size=CS) as a, Store(d, chunk_size=CS) as b:
        ids = [a.save({"w": torch.full((CS // 4,), float(s))}, step=s).id for s in (1, 2, 3)]
        real = a.index.remove_checkpoints
        commits: list[int] = []

        def racing(records: Any) -> Any:
            if not commits:
                b.delete(id=ids[1])
            commits.append(len(records))
            return real(records)

        with mock.patch.object(a.index, "remove_checkpoints", side_effect=racing):
            deleted = a._delete([(None, ids[0]), (None, ids[1])])
        assert {p: i.id for p, i in deleted.items()} == {0: ids[0]}
        assert [i.id for i in a.list()] == [ids[2]]
        assert sorted(p.stem for p in (d / "manifests").glob("*.manifest")) == [ids[2]]
        assert a.verify().ok and float(a.load(3)["w"][0]) == 3.0


def test_retention_that_deletes_nothing_does_not_wait_for_a_gc(tmp_path: Path) -> None:
    """A Checkpointer applies its retention after every save; when it drops nothing it takes no lock, so a save
    does not wait out another process's gc (which holds gc.lock exclusively)."""
    import fcntl

    from deltackpt import Retention

    d = tmp_path / "store"
    with Store(d, chunk_size=CS) as st:
        for s in (1, 2):
            st.save({"w": torch.full((CS // 4,), float(s))}, step=s)
        fd = os.open(d / "gc.lock", os.O_RDWR)  # (another open file description: flock conflicts in-process too)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            out: list[Any] = []
            t = threading.Thread(target=lambda: out.append(st.retain(Retention(keep_last=5))), daemon=True)
            t.start()
            t.join(10)
            assert not t.is_alive() and out == [[]], "retention that deletes nothing waited for the gc lock"
        finally:
            os.close(fd)


# -- concurrent writers and the chain bound ---------------------------------------------------------------------

def _decode_depths(s: Store) -> dict[bytes, tuple[int, int, int]]:
    """Every chunk entry's (recorded depth, depth its decode actually reaches, codec), found by walking the frames
    the decode path reads: a delta's base, a predicted frame's base and the chunks its record names."""
    from deltackpt import codec

    entries = dict(s.index.iter_chunks())
    actual: dict[bytes, int] = {}

    def depth(k: bytes, nesting: int = 0) -> int:
        if k not in actual:
            assert nesting <= codec.MAX_CHAIN_FRAMES, "a cycle of bases or prediction inputs"
            refs = s._references(k, entries[k])
            assert all(r in entries for r in refs), "a base or prediction input is not in the index"
            actual[k] = 1 + max(depth(r, nesting + 1) for r in refs) if refs else 0
        return actual[k]

    return {k: (loc.depth, depth(k), loc.codec) for k, loc in entries.items()}


def _sparse_adamw(steps: int, seed: int) -> list[dict[str, Any]]:
    """AdamW on an embedding table of which only a few rows ever get a gradient: the first moments change in few
    bytes per chunk, so XOR deltas win for them, and the second moments and weights are predicted."""
    import copy

    torch.manual_seed(seed)
    model = torch.nn.Embedding(1024, 16)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0)
    rows = torch.arange(0, 1024, 37)
    states = []
    for _ in range(steps):
        loss = model(rows[torch.randint(len(rows), (8,))]).pow(2).sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
        states.append(copy.deepcopy({"model": model.state_dict(), "optimizer": opt.state_dict()}))
    return states


def _first_moments(state: dict[str, Any]) -> dict[str, Any]:
    return {"optimizer": {"state": {i: {"exp_avg": v["exp_avg"]} for i, v in state["optimizer"]["state"].items()}}}


def _race_first_moments(d: Path, a_settings: dict[str, Any], b_settings: dict[str, Any], steps: int,
                        seed: int, *, a_commits_first: bool = True) -> tuple[Store, Store, list[dict[str, Any]]]:
    """Handle ``b`` saves whole AdamW states and handle ``a`` (other settings) only their first moments, under the
    same key paths; at each step one writes its frames, the other saves meanwhile and commits first
    (``a_commits_first``: ``a``). Both wrote frames of the same first-moment chunks: ``a``'s XOR deltas against
    its own previous save, ``b``'s standalone, and ``b``'s predicted frames reference them."""
    from unittest import mock

    a = Store(d, chunk_size=1 << 14, **a_settings)
    b = Store(d, chunk_size=1 << 14, **b_settings)
    states = _sparse_adamw(steps, seed)
    for step, state in enumerate(states, 1):
        moments = _first_moments(state)
        saves = [(a, moments), (b, state)] if a_commits_first else [(b, state), (a, moments)]
        (first, first_state), (later, later_state) = saves
        real = later.index.commit_checkpoint

        def first_meanwhile(*args: Any, first: Store = first, first_state: Any = first_state, step: int = step,
                            real: Any = real, **kwargs: Any) -> Any:
            first.save(first_state, step=step)
            return real(*args, **kwargs)

        with mock.patch.object(later.index, "commit_checkpoint", side_effect=first_meanwhile):
            later.save(later_state, step=step)
    return a, b, states


def _check_race(b: Store, states: list[dict[str, Any]], max_chain: int) -> None:
    """Every chunk decodes within its recorded depth, predicted ones (b's) within ``max_chain`` (b's), and every
    checkpoint of both writers loads bit-exactly."""
    from conftest import assert_same_state

    from deltackpt import codec

    depths = _decode_depths(b)
    assert [(r, x) for r, x, _ in depths.values() if x > r] == [], "recorded depth below the decode's"
    assert max((x for r, x, c in depths.values() if c == codec.PREDICTED), default=0) <= max_chain
    for info in b.list():
        want, got = states[info.step - 1], b.load(id=info.id)
        if "model" not in got:  # (a's checkpoint: the first moments)
            want = _first_moments(want)
        assert_same_state(want, got)
    assert b.verify().ok


@pytest.mark.parametrize("a_settings", [{}, {"predict": False}, {"max_chain": 8}],
                         ids=["same", "no-predict", "chain-8"])
def test_a_frame_another_writer_committed_first_leaves_no_chain_deeper_than_recorded(
        tmp_path: Path, a_settings: dict[str, Any]) -> None:
    """Two writers commit the same chunk as different frames: the index keeps one. The chunks the other writer
    computed from its own frame (predicted frames referencing its first moment) must not decode deeper than their
    recorded depth, nor past that writer's max_chain: the commit keeps the shallower frame. Loads stay exact."""
    from deltackpt import codec

    a, b, states = _race_first_moments(tmp_path / "store", a_settings, {"max_chain": 3}, 12, 0)
    try:
        assert any(loc.codec == codec.PREDICTED for _, loc in b.index.iter_chunks())
        # a wrote frames of the chunks b wrote too (its deltas lost to b's standalone frames at b's commit)
        assert all(i.written_bytes > 0 for i in b.list() if i.parent is not None)
        _check_race(b, states, 3)
    finally:
        a.close()
        b.close()


@settings(max_examples=10, deadline=None)
@example(a_predict=False, a_chain=1, b_chain=2, steps=4, seed=0, a_commits_first=True)
@given(a_predict=hst.booleans(), a_chain=hst.sampled_from([1, 3, 8]), b_chain=hst.sampled_from([1, 2, 3]),
       steps=hst.integers(4, 12), seed=hst.integers(0, 2**16), a_commits_first=hst.booleans())
def test_racing_writers_with_any_settings_keep_chains_within_recorded_depths(
        tmp_path_factory: pytest.TempPathFactory, a_predict: bool, a_chain: int, b_chain: int, steps: int,
        seed: int, a_commits_first: bool) -> None:
    """The race above with either writer committing first, any mix of settings: recorded depths stay upper
    bounds, b's predicted frames within b's max_chain, and every checkpoint of both loads bit-exactly."""
    a, b, states = _race_first_moments(tmp_path_factory.mktemp("race"), {"predict": a_predict, "max_chain": a_chain},
                                       {"max_chain": b_chain}, steps, seed, a_commits_first=a_commits_first)
    try:
        _check_race(b, states, b_chain)
    finally:
        a.close()
        b.close()


def test_close_on_another_thread_waits_for_a_running_verify(tmp_path: Path) -> None:
    """close() while another thread's verify (or load, gc, listing) runs on the handle waits for it to end, and
    what starts after it raises DeltackptError naming the store as closed. Before, close() shut the read workers
    and the index under the verify: it raised concurrent.futures' 'cannot schedule new futures after shutdown' or
    lmdb's 'Attempt to operate on closed/deleted/dropped object', or crashed the process (a segfault in LMDB)."""
    path = tmp_path / "s"
    states = {step: {"w": torch.randn(4 * CS // 4), "m": torch.randn(3 * CS // 4)} for step in (1, 2, 3)}
    with Store(path, chunk_size=CS) as s:
        for step, state in states.items():
            s.save(state, step=step)
    s = Store(path, chunk_size=CS)
    closer = threading.Thread(target=s.close)

    def close_meanwhile(n: int, total: int) -> None:
        if n == total and not closer.is_alive():
            closer.start()
            time.sleep(0.3)  # (close() took the workers and the index away here)

    report = s.verify(progress=close_meanwhile)
    closer.join(TIMEOUT)
    assert not closer.is_alive() and report.ok and report.checkpoints == 3
    with pytest.raises(deltackpt.DeltackptError, match="is closed"):
        s.load(1)
    with pytest.raises(deltackpt.DeltackptError, match="is closed"):
        s.list()


@pytest.mark.parametrize("op", ["verify", "gc", "repair"])
def test_close_from_inside_an_operation_of_the_same_thread_is_refused(tmp_path: Path, op: str) -> None:
    """close() from a progress callback (an operation of the calling thread on the same handle) raises
    DeltackptError saying so and closes nothing: the operation ends as without it, and the handle stays usable
    until closed afterwards. Before, close() shut the read workers, the pack writer and the index under the
    running operation: gc went on to fail with 'the index ... is closed' halfway through its repack."""
    path = tmp_path / "s"
    with Store(path, chunk_size=CS, pack_size=4 * CS) as s:
        for step in range(1, 7):
            s.save({"w": torch.randn(4 * CS // 4), "m": torch.randn(3 * CS // 4)}, step=step)
        s.delete(step=2)
        s.delete(step=4)
    s = Store(path, chunk_size=CS)
    refused: list[BaseException] = []

    def close_inside(n: int, total: int) -> None:
        if not refused:
            with pytest.raises(deltackpt.DeltackptError, match="close\\(\\) called from inside an operation") as e:
                s.close()
            refused.append(e.value)

    report: Any = (s.verify(progress=close_inside) if op == "verify" else s.gc(progress=close_inside,
                   repack_below=1.0) if op == "gc" else s.repair(progress=close_inside))
    assert refused and str(path) in str(refused[0])
    assert not getattr(report, "repack_stopped", None) and not getattr(report, "damaged_packs", None)
    assert [i.step for i in s.list()] == [1, 3, 5, 6] and s.verify().ok
    s.close()
    with pytest.raises(deltackpt.DeltackptError, match="is closed"):
        s.list()


@pytest.mark.parametrize("op", ["load", "list", "verify", "gc", "save"])
def test_close_racing_operations_of_other_threads(tmp_path: Path, op: str) -> None:
    """Threads running ``op`` on one handle while the main thread closes it: each either completes (what it
    returns is right) or raises DeltackptError saying the store is closed; nothing else, no crash, no hang."""
    path = tmp_path / "s"
    state = {"w": torch.randn(8 * CS // 4)}
    with Store(path, chunk_size=CS) as s:
        s.save(state, step=1)
    rng = random.Random(op)
    outcomes: collections.Counter[str] = collections.Counter()
    for r in range(12):
        s = Store(path, chunk_size=CS)
        errors: list[BaseException] = []

        def run(i: int, s: Store = s, r: int = r, errors: list[BaseException] = errors) -> None:
            time.sleep(rng.random() * 0.01)
            try:
                if op == "load":
                    assert torch.equal(s.load(1)["w"], state["w"])
                elif op == "list":
                    assert [info.step for info in s.list()][0] == 1
                elif op == "verify":
                    assert s.verify().ok
                elif op == "gc":
                    s.gc()
                else:
                    s.save({"w": state["w"] + (r * 4 + i)}, step=100 + r * 4 + i)
                outcomes["done"] += 1
            except deltackpt.DeltackptError as exc:
                assert "is closed" in str(exc), exc
                outcomes["closed"] += 1
            except BaseException as exc:
                errors.append(exc)

        threads = [threading.Thread(target=run, args=(i,)) for i in range(3)]
        for t in threads:
            t.start()
        time.sleep(rng.random() * 0.01)
        s.close()
        for t in threads:
            t.join(TIMEOUT)
            assert not t.is_alive()
        assert not errors, errors
    assert outcomes["done"]
    with Store(path) as s:
        for info in s.list():
            w = s.load(info.step)["w"]
            assert torch.equal(w, state["w"] + (info.step - 100 if info.step != 1 else 0))
        assert s.verify().ok


@pytest.mark.parametrize("async_save", [True, False])
def test_checkpointer_closed_by_another_thread_during_a_step(tmp_path: Path, async_save: bool) -> None:
    """close() on another thread (a watchdog's) while the loop's step() was taking its snapshot: the step raised
    concurrent.futures' 'RuntimeError: cannot schedule new futures after shutdown' (async), or saved into the
    store close() was closing (sync). It raises DeltackptError 'the checkpointer is closed'; what was saved
    before loads bit for bit."""
    model = torch.nn.Linear(64, 64)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ck = deltackpt.Checkpointer(tmp_path / "s", model=model, optimizer=opt, async_save=async_save,
                                handle_signals=False, rng=False)
    saved = {}
    for step in (1, 2):
        model(torch.randn(4, 64)).sum().backward()
        opt.step()
        ck.step(step)
        saved[step] = {k: v.clone() for k, v in model.state_dict().items()}
    capture = ck.capture

    def capture_then_closed(step: int) -> dict[str, Any]:
        state = capture(step)
        closer = threading.Thread(target=ck.close)
        closer.start()
        closer.join(TIMEOUT)
        return state

    ck.capture = capture_then_closed  # type: ignore[method-assign]
    with pytest.raises(deltackpt.DeltackptError, match="the checkpointer is closed"):
        ck.step(3)
    ck.close()
    with Store(tmp_path / "s") as s:
        assert [i.step for i in s.list()] == [1, 2]
        for step, state in saved.items():
            got = s.load(step)["model"]
            assert all(torch.equal(got[k], v) for k, v in state.items())
        assert s.verify().ok


@pytest.mark.parametrize("async_save", [True, False])
def test_an_evaluation_thread_loading_through_the_checkpointers_store_does_not_reparent_the_run(
        tmp_path: Path, async_save: bool) -> None:
    """A thread loading an older step through ``ckpt.store`` (an evaluation running beside training) moved the
    handle's head: the run's next save recorded that old step as its parent, a rollback that never happened
    (and deltas against the old state). A Checkpointer descends from what it last saved or restored."""
    model = torch.nn.Linear(64, 64)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ck = deltackpt.Checkpointer(tmp_path / "s", model=model, optimizer=opt, async_save=async_save,
                                handle_signals=False, rng=False)
    saved = {}
    for step in range(1, 6):
        model(torch.randn(4, 64)).sum().backward()
        opt.step()
        ck.step(step)
        saved[step] = {k: v.clone() for k, v in model.state_dict().items()}
        if step == 3:
            ck.wait()
            evaluation = threading.Thread(target=ck.store.load, args=(1,))
            evaluation.start()
            evaluation.join(TIMEOUT)
    ck.close()
    with Store(tmp_path / "s") as s:
        steps = {i.id: i.step for i in s.list()}
        assert [(i.step, steps.get(i.parent)) for i in s.list()] == [(1, None), (2, 1), (3, 2), (4, 3), (5, 4)]
        for step, state in saved.items():
            got = s.load(step)["model"]
            assert all(torch.equal(got[k], v) for k, v in state.items())
    ck = deltackpt.Checkpointer(tmp_path / "s", model=model, optimizer=opt, handle_signals=False, rng=False)
    assert ck.restore(step=2) == 2
    evaluation = threading.Thread(target=ck.store.load, args=(5,))
    evaluation.start()
    evaluation.join(TIMEOUT)
    ck.step(6)  # (a rollback's saves still descend from the restored checkpoint)
    ck.close()
    with Store(tmp_path / "s") as s:
        assert s.info(step=6).parent == s.info(step=2).id


def test_save_by_another_thread_during_a_rewrite_stays_the_parent(tmp_path: Path) -> None:
    """Several threads may share one Store: a save that another thread commits while a rewrite (thinning) of an
    older checkpoint runs on the same handle is what the next save descends from. The rewrite used to read the
    handle's last-saved checkpoint before it took the save lock and put it back afterwards, so the next save's
    parent (lineage and delta base) was the checkpoint before the other thread's save."""
    from unittest import mock

    s = Store(tmp_path / "s")
    a = s.save({"w": torch.zeros(8)}, 1)
    s.save({"w": torch.ones(8)}, 2)
    real = deltackpt.store.tree.flatten
    raced: list[Any] = []

    def flatten(*args: Any, **kwargs: Any) -> Any:
        out = real(*args, **kwargs)
        if not raced:  # the rewrite's flatten, before it takes the save lock: another thread saves now
            raced.append(None)
            t = threading.Thread(target=lambda: raced.append(s.save({"w": torch.full((8,), 3.0)}, 3)))
            t.start()
            t.join(TIMEOUT)
        return out

    with mock.patch.object(deltackpt.store.tree, "flatten", side_effect=flatten):
        thinned = s.rewrite({"w": torch.zeros(8)}, id=a.id)
    assert s.save({"w": torch.full((8,), 4.0)}, 4).parent == raced[1].id
    # a rewrite of the checkpoint last saved makes the next save descend from the rewrite
    last = s.rewrite({"w": torch.zeros(8)}, id=s.latest().id)
    assert s.save({"w": torch.full((8,), 5.0)}, 5).parent == last.id
    assert thinned.step == 1
    s.close()


def test_save_by_another_thread_during_checkpointer_thinning_stays_the_parent(tmp_path: Path) -> None:
    """The same for a Checkpointer's retention: it thins an older checkpoint (a load, then a rewrite) while
    another thread saves through ``ckpt.store``; that save is what the handle's next save descends from.
    Retention used to note the handle's last-saved checkpoint, thin (each load moved it) and put the noted one
    back, undoing the other thread's save (the next save's lineage and delta base the checkpoint before it)."""
    from unittest import mock

    from deltackpt import Retention

    model = torch.nn.Linear(4, 4)
    ck = deltackpt.Checkpointer(tmp_path / "s", model=model, async_save=False, handle_signals=False, gc=False,
                                rng=False, retention=Retention(full_last=1))
    s = ck.store
    ck.step(1)
    real = deltackpt.checkpointer.flatten
    raced: list[Any] = []

    def flatten(*args: Any, **kwargs: Any) -> Any:  # (retention's, between the thinning load and its rewrite)
        if not raced:
            raced.append(None)
            t = threading.Thread(target=lambda: raced.append(s.save({"x": torch.ones(2)}, 100)))
            t.start()
            t.join(TIMEOUT)
        return real(*args, **kwargs)

    with mock.patch.object(deltackpt.checkpointer, "flatten", side_effect=flatten):
        ck.step(2)
    assert len(raced) == 2, "retention thinned nothing"
    assert s.info(step=1).metadata.get("thinned")
    assert s.save({"x": torch.zeros(2)}, 101).parent == raced[1].id
    ck.step(3)  # the run's own saves still descend from its own last checkpoint
    assert s.info(step=3).parent == s.info(step=2).id
    ck.close()


_FORK_DURING_READ = r"""
import os, subprocess, sys
import deltackpt, torch
path = sys.argv[1]
st = deltackpt.Store(path, chunk_size=4096)
for step in range(3):
    st.save({f"w{j}": torch.full((1024,), float(step * 1000 + j)) for j in range(200)}, step=step)
txn = st.index.env.begin(db=st.index.db_chunks)  # a read in progress (a save's lookups, a load) at the fork
before = [(bytes(k), bytes(v)) for k, v in txn.cursor()]
pid = os.fork()
if pid == 0:  # a Pool's worker, say, that opens the store to evaluate a checkpoint
    child = deltackpt.Store(path, readonly=True)
    code = 0 if [i.step for i in child.list()] == [0, 1, 2] else 1
    child.close()
    os._exit(code)
_, status = os.waitpid(pid, 0)
assert status == 0, status
# another process commits meanwhile: new checkpoints, the old ones deleted and collected
subprocess.run([sys.executable, "-c", '''
import sys, deltackpt, torch
st = deltackpt.Store(sys.argv[1], chunk_size=4096)
for step in range(10, 25):
    st.save({f"w{j}": torch.full((1024,), float(step * 1000 + j)) for j in range(200)}, step=step)
    for c in st.list()[:-1]:
        st.delete(id=c.id)
    st.gc()
''', path], check=True)
after = [(bytes(k), bytes(v)) for k, v in txn.cursor()]
print(after == before)
"""


def test_a_child_that_opens_the_store_leaves_the_parents_reads_their_snapshot(tmp_path: Path) -> None:
    """A forked child that opens the store (as the README says: a Store of its own) closes the LMDB environment
    it inherited first. That close aborted the transactions of the parent's threads the child inherited, and
    the abort freed their slots in LMDB's reader table, which the child shares with the parent: a read of the
    parent in progress at the fork (the lookups of an async save, a load) lost its snapshot, and another
    writer's commits reused the pages it was reading (it saw 27 entries of that writer's instead of its 600)."""
    out = subprocess.run([sys.executable, "-c", _FORK_DURING_READ, str(tmp_path / "store")], capture_output=True,
                         text=True, timeout=TIMEOUT, env=cw.worker_env())
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "True", "the parent's read transaction lost its snapshot"


_FORK_DURING_LMDB_CALLS = r"""
import os, sys, threading, time, torch, deltackpt, deltackpt.index as index
from tests.crashworker import child_outcome
path, mode = sys.argv[1], sys.argv[2]
st = deltackpt.Store(path, chunk_size=4096)
st.save({f"w{j}": torch.full((1024,), float(j)) for j in range(50)}, step=0)
stop, inside = threading.Event(), threading.Event()
if mode == "reads":  # an async save's lookups (one LMDB call per key, the GIL released in each) at every fork
    keys = [os.urandom(32) for _ in range(5000)]
    def work():
        while not stop.is_set():
            st.index.lookup_chunks(keys)
            inside.set()
    forks, want = 10, [0]
elif mode == "registry":  # a thread opening another store's index holds the lock of the process's environments
    def work():
        with index._REGISTRY_LOCK:
            inside.set()
            time.sleep(1.0)
    forks, want = 1, [0]
else:  # a thread inside the index's write transaction of a save (commit) or inside a read that does not end
    slow = index.record_at if mode == "stuck" else index.Record.dumps
    def held(*args):
        inside.set()
        time.sleep(1.0 if mode == "commit" else 3.0)
        return slow(*args)
    if mode == "stuck":
        index.FORK_WAIT_S = 0.2
        index.record_at = held
        work = lambda: st.index.get(step=0)
    else:
        index.Record.dumps = held
        work = lambda: st.save({"w0": torch.ones(4)}, step=1)
    forks, want = 1, [0, 1] if mode == "commit" else [0]
worker = threading.Thread(target=work)
worker.start()
inside.wait()
out = []
for _ in range(forks):
    time.sleep(0.01)
    pid = os.fork()
    if pid == 0:  # a Pool's worker, say, that opens the store to evaluate a checkpoint
        try:
            child = deltackpt.Store(path, readonly=True)
            code = 0 if [i.step for i in child.list()] == want else 1
            child.close()
        except deltackpt.DeltackptError as exc:
            code = 3 if "did not end within 0.2 s" in str(exc) else 2
        os._exit(code)
    out.append(str(child_outcome(pid)))
    if out[-1] != "0":
        break
stop.set()
worker.join()
print(" ".join(out))
"""


@pytest.mark.parametrize("mode", ["reads", "commit", "registry", "stuck"])
def test_a_child_forked_during_lmdb_calls_of_another_thread_opens_the_store(tmp_path: Path, mode: str) -> None:
    """A child that opens the store closes the LMDB environment it inherited, and py-lmdb's close waits until
    no call on it is in progress. A call of another parent thread in progress at the fork (a lookup of an async
    save, a load, the GIL released inside it) never ends in the child: its open hung forever (every fork of 10
    while a thread looked chunks up), and one forked during a commit raised DeltackptError. The fork now waits
    for the calls of the other threads to end; one that does not end within ``FORK_WAIT_S`` ("stuck") makes the
    child's open raise DeltackptError instead of hanging. It waits too for the lock of the process's LMDB
    environments, which a thread opening one holds: the child inherited it held and waited for it forever."""
    out = subprocess.run([sys.executable, "-c", _FORK_DURING_LMDB_CALLS, str(tmp_path / "store"), mode],
                         capture_output=True, text=True, timeout=TIMEOUT, env=cw.worker_env())
    assert out.returncode == 0, out.stderr
    want = "3" if mode == "stuck" else " ".join(["0"] * (10 if mode == "reads" else 1))
    assert out.stdout.strip() == want, out.stdout + out.stderr


_FORK_WAIT_INTERRUPTED = r"""
import os, signal, sys, threading, time, torch, deltackpt, deltackpt.index as index
st = deltackpt.Store(sys.argv[1])
st.save({"w": torch.zeros(8)}, step=0)
pid = os.fork()  # an earlier fork (a DataLoader's worker): it took the registry lock and gave it back
if pid == 0:
    os._exit(0)
os.waitpid(pid, 0)
slow, inside = index.record_at, threading.Event()
def held(*args):  # a read of another thread that the fork waits for
    inside.set()
    time.sleep(2.0)
    return slow(*args)
index.record_at = held
worker = threading.Thread(target=st.index.get, kwargs={"step": 0})
worker.start()
inside.wait()
threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGINT)).start()  # Ctrl-C while the fork waits
pid = os.fork()
if pid == 0:
    try:
        deltackpt.Store(sys.argv[1], readonly=True).list()
        code = 0
    except deltackpt.DeltackptError:
        code = 3  # (refused: the read of the parent's thread had not ended)
    os._exit(code)
child = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
worker.join(10)
index.record_at = slow
done = []
t = threading.Thread(target=lambda: done.append([i.step for i in st.list()]), daemon=True)
t.start()
t.join(10)
print(child, "hung" if worker.is_alive() or t.is_alive() else done[0])
sys.stdout.flush()
os._exit(0)
"""


def test_a_fork_whose_wait_is_interrupted_leaves_the_store_usable(tmp_path: Path) -> None:
    """A KeyboardInterrupt (Ctrl-C) that ends a fork's wait for another thread's LMDB call (Python reports and
    drops an exception of a fork hook, and forks) left the hook after the fork releasing what it had not taken:
    the registry lock, which an earlier fork had taken ("release unlocked lock"), so it never gave the fork's
    gate back, and every LMDB call of every thread of the process waited for it forever. The child refuses to
    open the store (the call had not ended) rather than hang."""
    out = subprocess.run([sys.executable, "-c", _FORK_WAIT_INTERRUPTED, str(tmp_path / "store")],
                         capture_output=True, text=True, timeout=TIMEOUT, env=cw.worker_env())
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "3 [0]", out.stdout + out.stderr


_FORK_DURING_MANY_LOOKUPS = r"""
import os, sys, threading, time, torch, deltackpt, deltackpt.index as index
st = deltackpt.Store(sys.argv[1])
st.save({"w": torch.zeros(8)}, step=0)
pack = os.urandom(16).hex()
entries = {os.urandom(16) + (4096).to_bytes(4, "big"): index.ChunkLoc(pack, 16 + 100 * i, 100, 0, 0, bytes(16))
           for i in range(10 * 4096)}
st.index.apply_chunk_changes((), entries)
keys = list(entries)
slow_keys, unpack, inside = set(keys[::4096]), index.ChunkLoc.unpack, threading.Event()
def slow(cls, raw, key=None):  # a lookup of a big store's every chunk (verify's), taking its time
    if key in slow_keys:
        inside.set()
        time.sleep(0.5)
    return unpack(raw, key)
index.ChunkLoc.unpack = classmethod(slow)
found = []
if sys.argv[2] == "lookups":
    worker = threading.Thread(target=lambda: found.append(len(st.index.lookup_chunks(keys))))
else:  # gc's repack, reading the whole chunk table for the entries of the packs it rewrites
    worker = threading.Thread(target=lambda: found.append(len(st.index.chunks_in_packs([pack])[1][pack])))
worker.start()
inside.wait()
start = time.monotonic()
pid = os.fork()
if pid == 0:
    os._exit(0)
waited = time.monotonic() - start
os.waitpid(pid, 0)
worker.join()
print(waited < 2.5 or f"the fork waited {waited:.1f} s", found)  # (one batch: 0.5 s; all ten: 5 s)
"""


@pytest.mark.parametrize("reads", ["lookups", "repack scan"])
def test_a_fork_waits_for_one_batch_of_a_threads_many_lookups(tmp_path: Path, reads: str) -> None:
    """A lookup of many chunks (verify's of every chunk of the store, a load's of a big checkpoint) was one count
    of LMDB calls: a fork in another thread (a DataLoader's workers) waited for all of it, 3 s for a million
    chunks, and held every other thread's LMDB calls meanwhile. It now counts one batch of lookups at a time, and
    gc's repack scan of the chunk table one batch of entries."""
    out = subprocess.run([sys.executable, "-c", _FORK_DURING_MANY_LOOKUPS, str(tmp_path / "store"), reads],
                         capture_output=True, text=True, timeout=TIMEOUT, env=cw.worker_env())
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "True [40960]", out.stdout + out.stderr


def test_threads_opening_and_closing_handles_of_one_store(tmp_path: Path) -> None:
    """The last handle of a store closed its LMDB environment after taking it out of the process's registry,
    outside the registry's lock: another thread's open meanwhile found no environment and opened one, which
    py-lmdb refused (the files still open), so that open raised DeltackptError ("this process holds it open
    through an LMDB handle of its own"; 8 of 400 opens of two threads). A fork in between left the child the
    same refusal."""
    with Store(tmp_path / "s") as st:
        st.save({"w": torch.zeros(8)}, step=0)
    errors: list[str] = []

    def work() -> None:
        for _ in range(300):
            try:
                with Store(tmp_path / "s") as st:
                    st.list()
            except deltackpt.DeltackptError as exc:
                errors.append(str(exc))

    threads = [threading.Thread(target=work) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []


_FORK_DURING_AN_OPEN = r"""
import os, sys, threading, time, torch, deltackpt, deltackpt.store
from tests.crashworker import child_outcome
path = sys.argv[1]
with deltackpt.Store(path) as st:
    st.save({"w": torch.zeros(8)}, step=0)
inside, release = threading.Event(), threading.Event()
def opening():  # a thread inside Store() as the fork comes: it holds the lock of the damaged-chunk sets
    with deltackpt.store._DAMAGED_LOCK:
        inside.set()
        release.wait()
threading.Thread(target=opening).start()
inside.wait()
pid = os.fork()
if pid == 0:  # a DataLoader's worker that opens the store
    with deltackpt.Store(path, readonly=True) as st:
        os._exit(0 if [i.step for i in st.list()] == [0] else 1)
release.set()
print(child_outcome(pid))
"""


def test_a_child_forked_while_a_thread_opens_a_store_opens_it(tmp_path: Path) -> None:
    """Store() takes a lock of the process's sets of damaged chunks; a child forked while another thread held
    it (opening a store, 3 of 60 forks against two threads opening stores) inherited it held for good, and its
    own Store() of any store waited forever. The child takes that lock afresh."""
    out = subprocess.run([sys.executable, "-c", _FORK_DURING_AN_OPEN, str(tmp_path / "store")],
                         capture_output=True, text=True, timeout=TIMEOUT, env=cw.worker_env())
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "0", out.stdout + out.stderr


_FORK_DURING_SAVE = r"""
import os, sys, threading, time, torch, deltackpt
from tests.crashworker import child_outcome
path, use = sys.argv[1], sys.argv[2]
st = deltackpt.Store(path)
st.save({"w": torch.zeros(8)}, step=0)
inside, release = threading.Event(), threading.Event()
drop_unlinked = st.reader.drop_unlinked
def held():  # the save's first call under its lock: it stays there until the child has been waited for
    inside.set()
    release.wait()
    drop_unlinked()
st.reader.drop_unlinked = held
saver = threading.Thread(target=st.save, args=({"w": torch.ones(8)},), kwargs={"step": 1})
saver.start()
inside.wait()
pid = os.fork()
if pid == 0:  # a DataLoader's worker or a Pool's, forked while the parent's (async) save runs
    st.reader.drop_unlinked = drop_unlinked
    if use == "save":  # the handle used in the child (the README says: open one of its own; still no hang)
        st.save({"w": torch.full((8,), 2.0)}, step=2)
    st.close()  # as a with block of the parent's that the child leaves (sys.exit) closes it
    os._exit(0)
print(child_outcome(pid))
release.set()
saver.join()
print(sorted(i.step for i in st.list()), st.verify().ok)
st.close()
"""


@pytest.mark.parametrize("use", ["close", "save"])
def test_a_child_forked_during_a_save_closes_or_uses_the_inherited_handle_without_hanging(
        tmp_path: Path, use: str) -> None:
    """A child forked while another thread of the parent was inside a save inherited the handle's save lock held,
    by a thread the child does not have: its close() of the handle (a ``with`` block it leaves by ``sys.exit``)
    and its saves through it waited for that lock forever."""
    out = subprocess.run([sys.executable, "-c", _FORK_DURING_SAVE, str(tmp_path / "store"), use],
                         capture_output=True, text=True, timeout=TIMEOUT, env=cw.worker_env())
    assert out.returncode == 0, out.stderr
    child, listed = out.stdout.splitlines()
    assert child == "0", "the child hung in close()" if child == "hung" else out.stderr
    assert listed == ("[0, 1, 2] True" if use == "save" else "[0, 1] True")


@pytest.mark.parametrize(("op", "nth"), [("load", 1), ("save", 1), ("gc", 1), ("gc", 2)])
def test_an_interrupt_as_an_operation_lets_go_of_its_lock_releases_it(tmp_path: Path, op: str, nth: int) -> None:
    """A KeyboardInterrupt raised as an operation lets go of the store's gc lock or maintenance lock (a Ctrl-C's
    handler runs as a Python function starts: here ``close_lock``'s, the ``nth`` call) still releases the lock.
    (It stayed held by a descriptor nothing closed: every later gc and repair, of any process, waited for it.)"""
    from deltackpt import packs

    s = Store(tmp_path / "s")
    s.save({"a": torch.zeros(4)}, step=1)
    calls = 0

    def tracer(frame: Any, event: str, arg: Any) -> None:
        nonlocal calls
        if event == "call" and frame.f_code is packs.close_lock.__code__:
            calls += 1
            if calls == nth:
                sys.settrace(None)
                raise KeyboardInterrupt

    run = {"load": lambda: s.load(step=1), "save": lambda: s.save({"a": torch.ones(4)}, step=2),
           "gc": lambda: s.gc()}[op]
    sys.settrace(tracer)
    try:
        with pytest.raises(KeyboardInterrupt):
            run()
    finally:
        sys.settrace(None)
    assert calls == nth
    s.gc(timeout=2)  # raised StoreLockedError
    with Store(tmp_path / "s") as other:
        other.gc(timeout=2)
    s.close()


@pytest.mark.parametrize("rewrite", [False, True])
def test_an_interrupt_as_a_save_commits_leaves_the_next_save_its_child(tmp_path: Path, rewrite: bool) -> None:
    """A KeyboardInterrupt raised as the index's commit returns (a Ctrl-C's handler runs as a call returns) leaves
    the checkpoint committed, and the save raises it. The handle's next save descends from that checkpoint, as
    after a save that returned (it descended from the checkpoint before: a branch beside the one just made), and a
    rewrite interrupted so still replaces the old one for the handle."""
    from deltackpt import index

    s = Store(tmp_path / "s")
    first = s.save({"a": torch.zeros(4)}, step=1)

    def tracer(frame: Any, event: str, arg: Any) -> Any:
        if frame.f_code is index.Index.commit_checkpoint.__code__:
            if event == "return":
                sys.settrace(None)
                raise KeyboardInterrupt
            return tracer
        return None

    sys.settrace(tracer)
    try:
        with pytest.raises(KeyboardInterrupt):
            if rewrite:
                s.rewrite({"a": torch.full((4,), 3.0)}, id=first.id)
            else:
                s.save({"a": torch.ones(4)}, step=2)
    finally:
        sys.settrace(None)
    made = s.info()
    assert made.step == (1 if rewrite else 2) and made.id != first.id
    third = s.save({"a": torch.full((4,), 2.0)}, step=3)
    assert third.parent == made.id
    assert [c.step for c in s.list()] == ([1, 3] if rewrite else [1, 2, 3])
    assert torch.equal(s.load(step=3)["a"], torch.full((4,), 2.0)) and s.verify().ok
    s.close()


def test_an_interrupt_as_an_operation_starts_leaves_it_uncounted(tmp_path: Path) -> None:
    """A KeyboardInterrupt raised as an operation has counted itself in (a Ctrl-C's handler runs as the with
    block's ``__exit__`` returns) does not leave it counted: close() closes the handle. (It raised "close() called
    from inside an operation on this store" at every call, and close() on another thread waited forever.)"""
    s = Store(tmp_path / "s")
    s.save({"a": torch.zeros(4)}, step=1)

    class Interrupting:  # (the lock the count is taken under, and its condition's)
        armed = True

        def __init__(self) -> None:
            self.lock = threading.Lock()
            self.acquire, self.release = self.lock.acquire, self.lock.release

        def __enter__(self) -> None:
            self.lock.acquire()

        def __exit__(self, *exc: Any) -> None:
            self.lock.release()
            if self.armed:
                self.armed = False
                raise KeyboardInterrupt

    s._users_lock = Interrupting()  # type: ignore[assignment]
    s._users_changed = threading.Condition(s._users_lock)  # type: ignore[arg-type]
    with pytest.raises(KeyboardInterrupt):
        s.load(step=1)
    assert not s._users
    s.close()
    assert s._closed


@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="lists open files through /proc")
def test_a_store_dropped_unclosed_releases_its_files_once_collected(tmp_path: Path) -> None:
    """A handle dropped without close() (a notebook's ``Store(path)`` made again and again) kept its index and
    the pack it wrote open until the process ended: four descriptors a handle, and the pack locked, so a gc
    skipped it. Once collected (by reference counting, or in a cycle by the collector) its files are released,
    and another handle of the store in the same process saves, gc's and loads as usual."""
    import gc

    def open_files() -> list[str]:
        links = []
        for fd in Path("/proc/self/fd").iterdir():
            with contextlib.suppress(OSError):
                links.append(os.readlink(fd))
        return [link for link in links if link.startswith(os.path.realpath(tmp_path))]

    for i in range(4):
        s = Store(tmp_path / "s", threads=2)
        s.save({"w": torch.full((1000,), float(i))}, step=i)
        if i % 2:
            s._cycle = s  # type: ignore[attr-defined]  # (freed by the cyclic collector, not at del)
        del s
    gc.collect()
    for t in threading.enumerate():  # (the files are released on a thread of its own)
        if t.name == "deltackpt-release":
            t.join(30)
    assert open_files() == []
    with Store(tmp_path / "s") as s:
        s.delete(step=0)
        report = s.gc(repack_below=1.0)
        assert report.skipped_active_packs == 0, report
        assert [float(s.load(step)["w"][0]) for step in (1, 2, 3)] == [1.0, 2.0, 3.0]
    assert open_files() == []


def test_a_repair_handle_dropped_unclosed_releases_its_locks_once_collected(tmp_path: Path) -> None:
    """A repair's handle (``open_for_repair``) dropped unrepaired and unclosed (an exception between the open and the
    repair) kept the gc and maintenance locks for as long as the process lived, though its finalizer released the
    rest: every later gc or repair of the store in the process, another process's too, waited for them forever."""
    import fcntl
    import gc

    from deltackpt import maintenance

    with Store(tmp_path / "s") as s:
        s.save({"w": torch.ones(10)}, step=1)
    r = maintenance.open_for_repair(tmp_path / "s")
    del r
    gc.collect()
    for t in threading.enumerate():  # (the files are released on a thread of its own)
        if t.name == "deltackpt-release":
            t.join(30)
    for name in ("gc.lock", "maint.lock"):
        fd = os.open(tmp_path / "s" / name, os.O_RDWR)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # (BlockingIOError while the dropped handle held it)
        finally:
            os.close(fd)
    with Store(tmp_path / "s") as s:
        assert s.gc().dead_chunks == 0


def test_a_store_close_interrupted_can_be_called_again(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A close() that an exception interrupts (a Ctrl-C while it waits for another thread's load or verify, or as it
    shuts the workers down) leaves the handle closed to new operations, and close() again finishes the release.
    (close() again returned at once: the index, the pack lock and the read workers stayed held for good.)"""
    s = Store(tmp_path / "s")
    s.save({"a": torch.zeros(4)}, step=1)

    def interrupted() -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(s.reader, "close", interrupted)
    with pytest.raises(KeyboardInterrupt):
        s.close()
    monkeypatch.undo()
    with pytest.raises(deltackpt.DeltackptError, match="closed"):
        s.load(step=1)
    s.close()
    assert s.index._closed
    s.close()


@pytest.mark.parametrize("lock", ["gc", "maintenance"])
def test_a_child_leaving_a_lock_block_it_was_forked_in_unlocks_no_file_of_its_own(tmp_path: Path, lock: str) -> None:
    """A child forked inside a block that holds the gc or the maintenance lock (a progress callback that forks,
    say), which then leaves the block, does not unlock the descriptor number the lock had: the child closed that
    descriptor at the fork, and the number is another file's once the child opens one (here one it flocks)."""
    from deltackpt import maintenance, packs

    st = Store(tmp_path / "s", chunk_size=CS)
    other = tmp_path / "other"
    other.touch()
    block = st._gc_lock() if lock == "gc" else maintenance._maintenance_lock(st)
    before = set(packs._lock_fds)
    with block:
        (fd,) = set(packs._lock_fds) - before
        pid = os.fork()
        if pid == 0:
            try:
                mine = os.open(other, os.O_RDONLY)
                os.dup2(mine, fd)  # (the number the child's next open gets, as a rule)
                fcntl.flock(fd, fcntl.LOCK_EX)
            except BaseException:
                os._exit(3)
    if pid == 0:
        probe = os.open(other, os.O_RDONLY)
        try:
            fcntl.flock(probe, fcntl.LOCK_EX | fcntl.LOCK_NB)
            os._exit(1)  # the child's own lock was released as it left the block
        except BlockingIOError:
            os._exit(0)
    try:
        assert os.waitpid(pid, 0)[1] == 0
    finally:
        st.close()


def test_a_repair_handle_close_interrupted_between_its_locks_closes_no_descriptor_twice(tmp_path: Path) -> None:
    """close() of an open_for_repair handle, interrupted as it lets go of its second lock (a Ctrl-C's
    KeyboardInterrupt as close_lock starts), then called again (as close() now may be) does not close the first
    lock's descriptor again: its number is another file's by then."""
    from deltackpt import maintenance, packs

    with Store(tmp_path / "s") as s:
        s.save({"a": torch.zeros(4)}, step=1)
    s = maintenance.open_for_repair(tmp_path / "s")
    calls = []
    real = packs.close_lock

    def close_lock(fd: int, pid: int, **kw: Any) -> None:
        calls.append(fd)
        if len(calls) == 2:  # (the maintenance lock's, after the gc lock's)
            raise KeyboardInterrupt
        real(fd, pid, **kw)

    deltackpt.store.close_lock = close_lock  # type: ignore[assignment]
    try:
        with pytest.raises(KeyboardInterrupt):
            s.close()
    finally:
        deltackpt.store.close_lock = real
    other = os.open(tmp_path / "s" / "STORE", os.O_RDONLY)  # takes the number the gc lock's descriptor had
    try:
        assert other == calls[0]
        s.close()
        os.fstat(other)  # (EBADF: the second close() closed it as the gc lock's)
    finally:
        with contextlib.suppress(OSError):
            os.close(other)
        with contextlib.suppress(OSError):
            real(calls[1], os.getpid())


def test_an_interrupt_as_an_operation_ends_leaves_it_uncounted(tmp_path: Path) -> None:
    """A Ctrl-C's KeyboardInterrupt at any Python call of a Store operation's count once it is counted (a signal
    handler runs as a Python function starts: Condition.__enter__ as the finished operation let go of its count)
    leaves it uncounted, as one as it starts does: close() then closes the handle. (It raised "called from inside
    an operation" for good on that thread, and on another waited forever.)"""
    in_use = Store._in_use.__wrapped__.__code__  # type: ignore[attr-defined]
    n = 0
    while True:
        s = Store(tmp_path / str(n))
        calls = 0

        def tracer(frame: Any, event: str, arg: Any, n: int = n) -> Any:
            nonlocal calls
            caller = frame.f_back
            if event == "call" and caller is not None and caller.f_code is in_use and caller.f_locals.get("counted"):
                calls += 1
                if calls == n + 1:
                    raise KeyboardInterrupt
            return None

        def op(s: Store = s, tracer: Any = tracer) -> None:
            sys.settrace(tracer)
            try:
                s.list()
            except KeyboardInterrupt:
                pass
            finally:
                sys.settrace(None)

        t = threading.Thread(target=op, daemon=True)
        t.start()
        t.join(30)
        assert not t.is_alive(), n  # (it waited for the count's lock, which its own start had left held)
        assert not s._users and not s._users_changed._lock.locked(), n  # (held: every later call waited forever)
        s.close()
        if calls <= n:  # (no call left to interrupt)
            break
        n += 1
