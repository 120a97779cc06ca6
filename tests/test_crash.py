"""Crash safety with real processes: a child saving (or running gc) is SIGKILLed at random moments.

No mocks: the child is a real process forked from a warm "zygote" (tests/crashworker.py) that imports torch
once, so a kill costs milliseconds and dozens of kills land in every phase of a save (pack appends and
fsyncs, the manifest's temp file / rename / directory fsync, the LMDB commit, the acknowledgement after it).
After every kill this process opens the store as-is and checks that every acknowledged checkpoint is listed,
loads bit-exactly, and verifies.

Timing is random, assertions are not: the seed is printed; rerun a failure with
``DELTACKPT_CRASH_SEED=<seed>``.
``DELTACKPT_CRASH_KILLS`` changes the number of kills during saves (default 60).
"""

from __future__ import annotations

import collections
import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import crashworker as cw  # tests/ is on sys.path, as for conftest
import pytest
import torch
from conftest import preload_shim

import deltackpt
from deltackpt import Store

CS = cw.CHUNK_SIZE
SAVE_KILLS = int(os.environ.get("DELTACKPT_CRASH_KILLS", "60"))
SAVE_STORES = 3  # the kills are spread over a few stores so that re-checking a whole store stays cheap
GC_KILLS = 20
REWRITE_KILLS = 12

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="needs Linux fork, flock and SIGKILL")


@pytest.fixture(scope="module")
def zygote(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    z = cw.Zygote(cw.worker_env(), tmp_path_factory.mktemp("zygote") / "stderr")
    assert z.backend == deltackpt.backend
    try:
        yield z
    finally:
        z.close()


@pytest.fixture
def rng() -> random.Random:
    seed = int(os.environ.get("DELTACKPT_CRASH_SEED") or random.SystemRandom().randrange(1 << 32))
    print(f"crash test seed: DELTACKPT_CRASH_SEED={seed} (backend {deltackpt.backend})")
    return random.Random(seed)


def _disk_state(d: Path, ids: set[str], index_packs: set[str]) -> dict[str, int]:
    """Leftovers of interrupted work: temp files, manifests no checkpoint owns, packs no chunk lives in."""
    return {
        "tmp_files": sum(1 for _ in (d / "tmp").iterdir()) if (d / "tmp").exists() else 0,
        "orphan_manifests": sum(1 for p in (d / "manifests").glob("*.manifest") if p.stem not in ids),
        "orphan_packs": sum(1 for p in (d / "packs").glob("*.pack") if p.stem not in index_packs),
    }


def _index_packs(st: Store) -> set[str]:
    return {loc.pack_id for _, loc in st.index.iter_chunks()}


def _check_clean_after_gc(d: Path, st: Store) -> None:
    ids = {i.id for i in st.list()}
    assert _disk_state(d, ids, _index_packs(st)) == {"tmp_files": 0, "orphan_manifests": 0, "orphan_packs": 0}
    assert {p.stem for p in (d / "manifests").glob("*.manifest")} == ids


def _verify_ok(st: Store, where: str) -> None:
    rep = st.verify()
    assert rep.ok, f"{where}: verify() found {len(rep.problems)} problems: " + "; ".join(
        str(p) for p in rep.problems[:5]
    )


class _SaveStore:
    """What the test knows about one store the save children write to."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.ack = path.parent / f"{path.name}.ack"
        self.next_step = 0
        self.checked: dict[str, int] = {}  # checkpoint id -> step, already loaded and compared once
        self.leftovers: dict[str, int] = {}


def test_sigkill_during_saves(tmp_path: Path, zygote: Any, rng: random.Random) -> None:
    stores = [_SaveStore(tmp_path / f"store{g}") for g in range(SAVE_STORES)]
    stats: collections.Counter[str] = collections.Counter()
    t0 = time.monotonic()
    for n in range(SAVE_KILLS):
        s = stores[n * SAVE_STORES // SAVE_KILLS]
        acked_before = cw.read_acks(s.ack)
        delay = rng.uniform(0.0, 0.3)
        reply = zygote.run(op="save", store=str(s.path), ack=str(s.ack), start=s.next_step, delay=delay,
                           pack_size=64 * 1024)
        where = f"kill {n} ({s.path.name}, {delay:.3f} s after the fork, from step {s.next_step})"
        assert reply["killed"], f"{where}: the child ended by itself: {reply}\n{zygote.errors()}"
        acked = cw.read_acks(s.ack)
        assert acked[: len(acked_before)] == acked_before
        new_acks = acked[len(acked_before) :]
        assert new_acks == list(range(s.next_step, s.next_step + len(new_acks))), f"{where}: acks {new_acks}"
        in_flight = s.next_step + len(new_acks)  # the step the child was saving (or about to) when killed
        stats["saves acknowledged"] += len(new_acks)
        if not new_acks:
            stats["kills before the first acknowledged save of a child"] += 1

        with Store(s.path, chunk_size=CS) as st:  # opens as-is: no repair, no manual step
            infos = st.list()
            ids = {i.id for i in infos}
            leftovers = _disk_state(s.path, ids, _index_packs(st))
            for k, v in leftovers.items():  # new leftovers tell in which phase the kill landed
                stats[f"kills leaving new {k.replace('_', ' ')}"] += v > s.leftovers.get(k, 0)
            s.leftovers = leftovers
            steps = [i.step for i in infos]
            assert len(ids) == len(infos), f"{where}: duplicate ids in list()"
            assert [i.seq for i in infos] == sorted(i.seq for i in infos), f"{where}: list() out of order"
            assert steps == sorted(steps), f"{where}: steps not in commit order: {steps}"
            missing = set(acked) - set(steps)
            assert not missing, f"{where}: acknowledged steps {sorted(missing)} are not listed"
            assert len(set(steps)) == len(steps), f"{where}: a step was committed twice"
            assert all(x <= in_flight for x in steps), f"{where}: list() holds a step never saved: {steps}"
            if in_flight in steps:
                stats["kills after the commit, before the acknowledgement"] += 1
            # every checkpoint new since the last kill (acknowledged or not) loads bit-exactly
            for info in infos:
                if info.id not in s.checked:
                    assert info.metadata == {"step": info.step}, where
                    state = st.load(id=info.id)
                    cw.assert_same(cw.make_state(info.step), state, f"{where}: step {info.step}")
                    s.checked[info.id] = info.step
            # and some older ones still do; so does load() of the latest
            for cid in rng.sample(sorted(s.checked), min(4, len(s.checked))):
                old = s.checked[cid]
                cw.assert_same(cw.make_state(old), st.load(id=cid), f"{where}: step {old}")
            assert set(s.checked) == ids, f"{where}: a checkpoint seen before has vanished"
            if infos:
                cw.assert_same(cw.make_state(infos[-1].step), st.load(), f"{where}: latest")
            _verify_ok(st, where)
            # the next child carries on after the last committed step
            s.next_step = max([*steps, *acked, s.next_step - 1]) + 1

    for s in stores:
        with Store(s.path, chunk_size=CS) as st:
            before = st.list()
            ids = {i.id for i in before}
            leftovers = _disk_state(s.path, ids, _index_packs(st))
            report = st.gc()
            assert report.orphan_manifests == leftovers["orphan_manifests"], (report, leftovers)
            assert report.dead_chunks == 0, report  # nothing was deleted: every indexed chunk is live
            assert st.list() == before
            _check_clean_after_gc(s.path, st)
            for info in before:
                cw.assert_same(cw.make_state(info.step), st.load(id=info.id), f"after gc: step {info.step}")
            assert set(cw.read_acks(s.ack)) <= {i.step for i in before}
            _verify_ok(st, f"{s.path.name} after gc")
        stats["checkpoints committed"] += len(before)
    stats["seconds"] = round(time.monotonic() - t0)
    print(f"{SAVE_KILLS} kills during saves:", dict(stats))


def test_sigkill_during_gc(tmp_path: Path, zygote: Any, rng: random.Random) -> None:
    d = tmp_path / "store"
    ack = tmp_path / "gc.ack"
    retained: dict[int, str] = {}  # step -> checkpoint id
    step = 0
    stats: collections.Counter[str] = collections.Counter()
    window = 0.06
    for n in range(GC_KILLS):
        # make garbage: new checkpoints in small packs, then delete about half of what is retained
        with Store(d, chunk_size=CS, pack_size=16 * 1024) as st:
            for _ in range(6):
                retained[step] = st.save(cw.make_state(step), step).id
                step += 1
            for victim in rng.sample(sorted(retained), len(retained) // 2):
                st.delete(victim)
                del retained[victim]
        runs_before = len(cw.read_acks(ack))
        delay = rng.uniform(0.0, window)
        reply = zygote.run(op="gc", store=str(d), ack=str(ack), delay=delay)
        where = f"gc kill {n} ({delay:.3f} s after the fork)"
        assert reply["killed"], f"{where}: the gc child ended by itself: {reply}\n{zygote.errors()}"
        completed = len(cw.read_acks(ack)) - runs_before
        stats["kills during the first gc of a child" if completed == 0 else "kills during a later gc"] += 1

        with Store(d, chunk_size=CS) as st:
            infos = st.list()
            assert {i.step: i.id for i in infos} == retained, f"{where}: gc changed the set of checkpoints"
            for s, cid in retained.items():
                cw.assert_same(cw.make_state(s), st.load(id=cid), f"{where}: step {s}")
            _verify_ok(st, where)

    with Store(d, chunk_size=CS) as st:
        st.gc()
        _check_clean_after_gc(d, st)
        assert {i.step: i.id for i in st.list()} == retained
        for s, cid in retained.items():
            cw.assert_same(cw.make_state(s), st.load(id=cid), f"after the final gc: step {s}")
        _verify_ok(st, "after the final gc")
        # the store still takes new checkpoints that dedup against what gc kept or moved
        info = st.save(cw.make_state(step), step)
        cw.assert_same(cw.make_state(step), st.load(id=info.id), "a save after the final gc")
        _verify_ok(st, "a save after the final gc")
    print(f"{GC_KILLS} kills during gc:", dict(stats))


def test_sigkill_during_rewrite(tmp_path: Path, zygote: Any, rng: random.Random) -> None:
    """A child rewrites checkpoints (thinning them to weights, which writes their delta and predicted chunks again
    standalone and re-points the index, and back to full states) and is killed at a random moment. Every step
    still has exactly one checkpoint, holding either its full or its thinned state bit-exactly, and verify and
    gc find nothing wrong."""
    d = tmp_path / "store"
    ack = tmp_path / "rewrite.ack"
    steps: list[int] = []
    stats: collections.Counter[str] = collections.Counter()
    for n in range(REWRITE_KILLS):
        with Store(d, chunk_size=CS) as st:  # new checkpoints with deltas and predicted frames: the child's first
            for step in range(len(steps), len(steps) + 3):  # rewrites (newest first) re-encode their chunks
                st.save(cw.make_state(step), step, metadata={"thinned": False})
                steps.append(step)
            stats["chunks at depth > 0 before the kill"] += sum(1 for _, loc in st.index.iter_chunks() if loc.depth)
        done_before = len(cw.read_acks(ack))
        delay = rng.uniform(0.0, 0.15)
        reply = zygote.run(op="rewrite", store=str(d), ack=str(ack), delay=delay)
        where = f"rewrite kill {n} ({delay:.3f} s after the fork)"
        assert reply["killed"], f"{where}: the rewrite child ended by itself: {reply}\n{zygote.errors()}"
        stats["rewrites committed"] += len(cw.read_acks(ack)) - done_before
        with Store(d, chunk_size=CS) as st:
            infos = st.list()
            assert sorted(i.step for i in infos) == steps, f"{where}: a checkpoint was lost or doubled"
            for info in infos:
                stats["thinned" if cw.is_thinned(info) else "full"] += 1
                cw.assert_same(cw.expected_state(info), st.load(id=info.id), f"{where}: step {info.step}")
            _verify_ok(st, where)
    with Store(d, chunk_size=CS) as st:
        st.gc()
        _check_clean_after_gc(d, st)
        for info in st.list():
            cw.assert_same(cw.expected_state(info), st.load(id=info.id), f"after the final gc: step {info.step}")
        _verify_ok(st, "after the final gc")
    print(f"{REWRITE_KILLS} kills during rewrites:", dict(stats))


# -- a writer killed at LMDB's commit point, while another process keeps the store open ----------------------------
# LMDB publishes a commit to the other processes after writing its meta page. A writer killed in between leaves the
# commit durable but unpublished, and a process that kept the environment open reads the snapshot before it until
# some process takes the write lock again. The shim kills a real child at exactly that point.


@pytest.fixture(scope="module")
def die_after_meta(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return preload_shim(tmp_path_factory, "die_after_meta")


def _run_killed_at_commit(shim: Path, code: str) -> None:
    """Run ``code`` in a fresh Python process that is SIGKILLed right after its first LMDB meta page write."""
    import subprocess

    env = dict(cw.worker_env(), LD_PRELOAD=str(shim), DIE_AFTER_META="1")
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == -9, f"the child was not killed at its commit (rc {r.returncode}):\n{r.stderr}"


#: the states of these tests, as code both this process and the child evaluate
_W = "torch.randn(12288, generator=torch.Generator().manual_seed(7))"  # 12 chunks
_B = "torch.arange(3000, dtype=torch.float64)"


def _dead_chunk_store(d: Path) -> tuple[Store, dict[str, Any]]:
    """A store whose only chunks are dead (their checkpoint deleted, no gc yet), kept open by this process."""
    state = {"w": eval(_W, {"torch": torch})}
    st = Store(d, chunk_size=CS)
    st.save(state, step=1)
    st.delete(step=1)
    return st, state


def test_gc_after_a_writer_died_at_its_commit_keeps_its_checkpoint(tmp_path: Path, die_after_meta: Path) -> None:
    """A save killed after its commit reached the disk, and before LMDB published it: a gc in a process that had
    the store open all along must see that checkpoint, not take its manifest, new pack and deduplicated chunks
    (which the stale snapshot calls dead) for garbage."""
    d = tmp_path / "store"
    st, state = _dead_chunk_store(d)
    try:
        _run_killed_at_commit(die_after_meta, (
            "import torch\nfrom deltackpt import Store\n"
            f"Store({str(d)!r}, chunk_size={CS}).save({{'w': {_W}, 'b': {_B}}}, step=2)\n"
        ))
        st.gc()
    finally:
        st.close()
    with Store(d, chunk_size=CS) as st:
        assert [i.step for i in st.list()] == [2], "the killed save's commit is durable: step 2 exists"
        cw.assert_same({"w": state["w"], "b": eval(_B, {"torch": torch})}, st.load(step=2), "step 2 after gc")
        _verify_ok(st, "after gc")


def test_save_after_a_gc_died_at_its_commit_does_not_dedup_against_freed_chunks(
    tmp_path: Path, die_after_meta: Path
) -> None:
    """A gc killed after its commit that dropped dead chunks reached the disk: a save in a process that had the
    store open all along must not reference those chunks (its stale snapshot still lists them), or the new
    checkpoint would name chunks the index no longer has, and the next gc would delete their pack."""
    d = tmp_path / "store"
    st, state = _dead_chunk_store(d)
    try:
        _run_killed_at_commit(die_after_meta, f"from deltackpt import Store\nStore({str(d)!r}, chunk_size={CS}).gc()\n")
        info = st.save(state, step=2)
    finally:
        st.close()
    with Store(d, chunk_size=CS) as st:
        cw.assert_same(state, st.load(id=info.id), "step 2")
        _verify_ok(st, "after the killed gc")
        st.gc()
        cw.assert_same(state, st.load(id=info.id), "step 2 after another gc")
        _verify_ok(st, "after another gc")


def test_restore_after_a_delete_died_at_its_commit(tmp_path: Path, die_after_meta: Path) -> None:
    """A trainer that keeps the store open rolls back with restore() after another process deleted the newest
    checkpoint and was killed at that delete's commit: list() and restore() see the delete (restore() used to pick
    the deleted checkpoint from a stale list and raise CheckpointNotFoundError)."""
    d = tmp_path / "store"
    model = torch.nn.Linear(8, 8)
    ck = deltackpt.Checkpointer(d, model=model, async_save=False, handle_signals=False)
    try:
        weights = {}
        for s in (1, 2, 3):
            with torch.no_grad():
                model.weight += 1
            ck.step(s)
            weights[s] = model.weight.detach().clone()
        _run_killed_at_commit(die_after_meta, f"from deltackpt import Store\nStore({str(d)!r}).delete(3)\n")
        assert [i.step for i in ck.store.list()] == [1, 2]
        assert ck.store.latest().step == 2
        assert len(ck.store) == 2
        assert ck.restore() == 2
        assert torch.equal(model.weight, weights[2])
    finally:
        ck.close()


def test_keep_killed_at_its_commit_has_deleted_all_it_drops(tmp_path: Path, die_after_meta: Path) -> None:
    """`deltackpt keep` deletes every checkpoint it drops in one index commit, then unlinks their manifests.
    Killed right at that commit, it has deleted all ten (not some), the two it keeps load, and gc removes the
    manifests it left behind."""
    d = tmp_path / "store"
    states = {s: {"w": torch.full((CS // 2,), float(s))} for s in range(1, 13)}
    with Store(d, chunk_size=CS) as st:
        for s, state in states.items():
            st.save(state, step=s)
    _run_killed_at_commit(die_after_meta, "import sys\nfrom deltackpt.cli import main\n"
                                          f"sys.exit(main(['keep', {str(d)!r}, '--last', '2']))\n")
    assert len(list((d / "manifests").glob("*.manifest"))) == 12, "the child was killed before its unlinks"
    with Store(d) as st:
        assert [i.step for i in st.list()] == [11, 12]
        for s in (11, 12):
            cw.assert_same(states[s], st.load(s), f"step {s}")
        assert st.gc().orphan_manifests == 10
        assert len(list((d / "manifests").glob("*.manifest"))) == 2
        _verify_ok(st, "after gc")


_KILL_AFTER = """
import os, signal
def kill_after(obj, name):
    real = getattr(obj, name)
    def call(*args, **kwargs):
        out = real(*args, **kwargs)
        os.kill(os.getpid(), signal.SIGKILL)
        return out
    setattr(obj, name, call)
"""


def _killed_after(code: str) -> None:
    """Run ``code`` in a child process that SIGKILLs itself right after the call ``kill_after`` names."""
    r = subprocess.run([sys.executable, "-c", _KILL_AFTER + code], env=cw.worker_env(), capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == -signal.SIGKILL, r.stderr[-3000:]


def test_repair_after_two_kills_does_not_bring_back_an_unacknowledged_save(tmp_path: Path) -> None:
    """A save killed after writing its manifest, before its commit, leaves an orphan manifest; a gc killed right
    after unlinking the packs that save wrote (and dropping their entries) used to leave that manifest behind too,
    naming chunks that are gone. A repair then restored it as the newest checkpoint, damaged: load() of the
    latest failed and verify() reported damage. gc now removes orphan manifests first."""
    d = tmp_path / "store"
    state = {"w": eval(_W, {"torch": torch})}
    with Store(d, chunk_size=CS) as st:
        acked = st.save(state, step=1).id
    _killed_after("import torch, deltackpt.manifest as m\nfrom deltackpt import Store\n"
                  "kill_after(m, 'write')\n"
                  f"Store({str(d)!r}).save({{'w': torch.randn(12288)}}, step=2)\n")
    _killed_after("import deltackpt.maintenance as mt\nfrom deltackpt import Store\n"
                  "kill_after(mt, '_unlink_packs')\n"
                  f"Store({str(d)!r}).gc()\n")
    r = subprocess.run([sys.executable, "-m", "deltackpt", "repair", str(d)], env=cw.worker_env(),
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    with Store(d) as st:
        assert [i.id for i in st.list()] == [acked]
        cw.assert_same(state, st.load(), "the acknowledged checkpoint")
        _verify_ok(st, "after the repair")


def test_gc_removes_the_store_file_a_killed_creation_left(tmp_path: Path) -> None:
    """A store's creation killed after writing STORE's temporary file, before it linked STORE and unlinked the
    temporary: the next open finishes the creation, and gc removes the leftover (it used to stay forever)."""
    d = tmp_path / "store"
    _killed_after("import pathlib\nfrom deltackpt import Store\n"
                  "kill_after(pathlib.Path, 'write_text')\n"
                  f"Store({str(d)!r}, chunk_size={CS})\n")
    assert list(d.glob("STORE.*.tmp")) and not (d / "STORE").exists()
    state = {"w": eval(_W, {"torch": torch})}
    with Store(d, chunk_size=CS) as st:
        info = st.save(state, step=1)
        st.gc()
        assert not list(d.glob("STORE.*.tmp"))
        cw.assert_same(state, st.load(id=info.id), "the first checkpoint")


def test_gc_removes_the_lock_file_a_killed_open_prepared(tmp_path: Path) -> None:
    """An open of a store without ``index/lock.mdb`` (a copied store) killed after preparing the lock file under
    its temporary name, before linking it into place: gc removes that file (it used to stay forever)."""
    d = tmp_path / "store"
    state = {"w": eval(_W, {"torch": torch})}
    with Store(d, chunk_size=CS) as st:
        info = st.save(state, step=1)
    (d / "index" / "lock.mdb").unlink()
    _killed_after("import os\nfrom deltackpt import Store\n"
                  "kill_after(os, 'posix_fallocate')\n"
                  f"Store({str(d)!r})\n")
    assert list((d / "index").glob("lock.mdb.new-*"))
    with Store(d, chunk_size=CS) as st:
        st.gc()
        assert sorted(p.name for p in (d / "index").iterdir()) == ["data.mdb", "lock.mdb"]
        cw.assert_same(state, st.load(id=info.id), "the checkpoint")


def test_repair_after_a_rewrite_died_at_its_commit_keeps_the_replacement(tmp_path: Path, die_after_meta: Path) -> None:
    """A rewrite (retention thinning) killed after its commit, before it unlinked the replaced manifest: a repair
    restores the replacement only, not the full checkpoint it replaced next to it (same step, same creation
    time: which one 'latest' named would depend on the random ids)."""
    from deltackpt.maintenance import open_for_repair

    d = tmp_path / "store"
    with Store(d, chunk_size=CS) as st:
        old = st.save({"w": eval(_W, {"torch": torch})}, step=1)
        st.save({"w": eval(_W, {"torch": torch}) * 2}, step=2)
    _run_killed_at_commit(die_after_meta, (
        "import torch\nfrom deltackpt import Store\n"
        f"Store({str(d)!r}, chunk_size={CS}).rewrite({{'w': torch.zeros(3)}}, id={old.id!r}, metadata={{'thin': 1}})\n"
    ))
    assert (d / "manifests" / f"{old.id}.manifest").exists(), "the rewrite was killed before its unlink"
    st = open_for_repair(d, chunk_size=CS)
    try:
        report = st.repair()
    finally:
        st.close()
    assert report.checkpoints == 2 and not report.incomplete_checkpoints
    with Store(d, chunk_size=CS) as st:
        infos = st.list()
        assert [i.step for i in infos] == [1, 2]
        assert infos[0].id != old.id and infos[0].metadata == {"thin": 1}
        assert torch.equal(st.load(step=1)["w"], torch.zeros(3))
        assert st.info(id=old.id).id == infos[0].id  # the old id still names its replacement
        st.gc()
        assert not (d / "manifests" / f"{old.id}.manifest").exists()
        _verify_ok(st, "after repair and gc")
