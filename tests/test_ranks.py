"""RNG states of data-parallel ranks other than 0 (deltackpt.ranks, Checkpointer(rank=)): the file format, the
files a rank keeps and prunes, and what its restore puts back or warns of. Real multi-process runs are in
tests/test_checkpointer.py (tests/ddp_worker.py)."""

from __future__ import annotations

import json
import os
import random
import re
import signal
import threading
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

import deltackpt
from deltackpt import ranks
from deltackpt.rng import rng_state, set_rng_state


def draws() -> tuple[Any, ...]:
    """The next draws of each generator a state holds (Python's Gaussian too, which caches its second value)."""
    return (random.random(), random.gauss(0, 1), np.random.rand(2).tolist(), np.random.randn(),
            torch.rand(3).tolist())


def hold_saves(ckpt: deltackpt.Checkpointer, gates: threading.Event | dict[int, threading.Event]) -> None:
    """Hold ``ckpt``'s saves in its store (the store's own save, late): every save until the event ``gates`` is set,
    or the save of each step in the dict ``gates`` until that step's event is set."""
    store_save = ckpt.store._save  # (what a Checkpointer's save calls)

    def held_save(*args: Any, **kwargs: Any) -> Any:
        gate = gates if isinstance(gates, threading.Event) else gates.get(kwargs.get("step", -1))
        if gate is not None:
            assert gate.wait(60)
        return store_save(*args, **kwargs)

    ckpt.store._save = held_save  # type: ignore[method-assign]


def restores_its_draws(ckpt: deltackpt.Checkpointer, step: int, seen: tuple[Any, ...]) -> None:
    """``ckpt`` restores ``step`` without a warning (its RNG states of the step are there), and the generators draw
    ``seen`` next, as they did after that step."""
    torch.manual_seed(7)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert ckpt.restore(step=step) == step
    assert draws() == seen


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), python_gauss=st.booleans(), numpy_gauss=st.booleans(),
       rank=st.integers(1, 1 << 19), step=st.integers(0, 2**63 - 1))
def test_a_state_file_puts_back_what_the_generators_draw_next(seed: int, python_gauss: bool, numpy_gauss: bool,
                                                               rank: int, step: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
    if python_gauss:
        random.gauss(0, 1)  # (one of a pair drawn: the other is cached in the state)
    if numpy_gauss:
        np.random.randn()
    data = ranks.encode(rng_state(), rank=rank, step=step, run="abc-3")
    want = draws()
    set_rng_state(ranks.decode(data, rank=rank, step=step, run="abc-3"))
    assert draws() == want


def _crafted(body: dict[str, Any]) -> bytes:
    data = json.dumps(body).encode()
    return data + xxhash.xxh3_128_digest(data)


def test_a_file_that_is_damaged_or_not_the_one_asked_for_is_refused() -> None:
    data = ranks.encode(rng_state(), rank=2, step=7, run="new-0")
    for i in (0, len(data) // 2, len(data) - 1):
        bad = bytearray(data)
        bad[i] ^= 1
        with pytest.raises(ranks.RankStateError, match="checksum"):
            ranks.decode(bytes(bad), rank=2, step=7, run="new-0")
    with pytest.raises(ranks.RankStateError, match="checksum"):
        ranks.decode(data[:-1], rank=2, step=7, run="new-0")
    for rank, step, run in ((1, 7, "new-0"), (2, 8, "new-0"), (2, 7, "new-1")):
        with pytest.raises(ranks.RankStateError, match="rank 2's state at step 7 of run 'new-0'"):
            ranks.decode(data, rank=rank, step=step, run=run)
    body = json.loads(data[:-16])
    with pytest.raises(ranks.RankStateError, match="format version 2"):
        ranks.decode(_crafted({**body, "version": 2}), rank=2, step=7, run="new-0")
    with pytest.raises(ranks.RankStateError, match="not a rank RNG state file"):
        ranks.decode(_crafted({"format": "other"}), rank=2, step=7, run="new-0")
    for broken in ({**body, "torch": "not base64!"}, {k: v for k, v in body.items() if k != "numpy"},
                   {**body, "python": {**body["python"], "gauss": "1.0"}}):
        with pytest.raises(ranks.RankStateError):
            ranks.decode(_crafted(broken), rank=2, step=7, run="new-0")
    with pytest.raises(ranks.RankStateError, match="not a well-formed"):
        ranks.decode(b"[1, 2" + xxhash.xxh3_128_digest(b"[1, 2"), rank=2, step=7, run="new-0")


def _pair(path: Path, **kw: Any) -> tuple[deltackpt.Checkpointer, deltackpt.Checkpointer]:
    """Rank 0's and rank 1's checkpointers of one model, in this process (whose RNGs both see)."""
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    common = {"model": model, "optimizer": opt, "handle_signals": False, **kw}
    return (deltackpt.Checkpointer(path, async_save=False, **common),
            deltackpt.Checkpointer(path, rank=1, **common))


def test_a_rank_other_than_0_keeps_rng_states_and_saves_nothing(tmp_path: Path) -> None:
    c0, c1 = _pair(tmp_path / "s", every_n_steps=3)
    with c1:
        assert [c1.step(s) for s in range(1, 7)] == [False, False, True, False, False, True]  # (rank 0's schedule)
        c1.save(7)
        assert len(c1.store) == 0
        names = sorted(os.listdir(tmp_path / "s" / "rng" / "rank-00001"))
        assert names == [f"{s}-new-0.rng" for s in range(1, 8)]
    c0.close()
    for bad, err in ((True, TypeError), ("1", TypeError), (1.0, TypeError), (-1, ValueError), (1 << 20, ValueError)):
        with pytest.raises(err, match="rank must be"):
            deltackpt.Checkpointer(tmp_path / "s", rank=bad, handle_signals=False)


def test_a_rank_restores_its_own_states_of_the_step_and_run(tmp_path: Path) -> None:
    """Rank 1 puts back what it kept at the restored step, on the line of runs that saved it: after a rollback to
    step 2 both lines' steps 3 and 4 keep their own states."""
    c0, c1 = _pair(tmp_path / "s")
    seen: dict[tuple[str, int], Any] = {}

    def train(steps: range) -> None:
        for s in steps:
            torch.rand(5)
            c0.step(s)
            draws()  # (in one process both see the same generators: rank 1's states differ from rank 0's so)
            c1.step(s)
            seen[(c0.last_info.id, s)] = draws()  # type: ignore[union-attr]

    train(range(1, 5))
    first = {s: c0.store.info(s).id for s in (2, 3, 4)}
    assert c0.restore(step=2) == c1.restore(step=2) == 2
    train(range(3, 5))
    second = {s: c0.store.info(s).id for s in (3, 4)}
    assert second[4] != first[4]
    for ids in (first, second):
        for s in (3, 4):
            torch.manual_seed(99)
            random.seed(99)
            c1.restore(id=ids[s])
            assert draws() == seen[(ids[s], s)]
    c0.close()
    c1.close()


def test_a_rank_without_states_to_restore_warns_and_leaves_its_generators(tmp_path: Path) -> None:
    c0, c1 = _pair(tmp_path / "s")
    for s in (1, 2, 3):
        c0.step(s)
        c1.step(s)
    files = {int(p.name.split("-")[0]): p for p in (tmp_path / "s" / "rng" / "rank-00001").iterdir()}
    files[1].unlink()
    data = bytearray(files[2].read_bytes())
    data[10] ^= 1
    files[2].write_bytes(bytes(data))
    for step, why in ((1, "does not exist"), (2, "checksum does not match")):
        torch.manual_seed(5)
        want = torch.rand(4)
        torch.manual_seed(5)
        with pytest.warns(RuntimeWarning, match=f"rank 1 has no RNG states of step {step} to restore: .*{why}"):
            assert c1.restore(step=step) == step
        assert torch.equal(torch.rand(4), want)  # (the generators as they were)
    # a checkpoint rank 0 saved without naming its run (before deltackpt kept the ranks' states)
    state = c0.capture(4)
    del state["rng"][ranks.RUN_KEY]
    c0.store.save(state, step=4)
    with pytest.warns(RuntimeWarning, match="names no run"):
        assert c1.restore() == 4
    c0.close()
    c1.close()


def test_a_rank_prunes_the_states_of_steps_no_checkpoint_holds(tmp_path: Path) -> None:
    """With retention deleting rank 0's older saves, rank 1's directory stays small: the states of retained steps
    and of the last two intervals, whatever the number of steps."""
    c0, c1 = _pair(tmp_path / "s", every_n_steps=4, retention=deltackpt.Retention(keep_last=2))
    d = tmp_path / "s" / "rng" / "rank-00001"
    (d.parent).mkdir(parents=True)
    d.mkdir()
    (d / "notes.txt").write_text("not deltackpt's")  # (left alone)
    old_tmp = d / ".9-new-0.rng.1.tmp"  # (what a rank killed while it wrote left)
    old_tmp.write_bytes(b"x")
    os.utime(old_tmp, (1, 1))
    for s in range(1, 201):
        c0.step(s)
        c1.step(s)
    kept = sorted(int(p.name.split("-")[0]) for p in d.glob("*.rng"))
    assert {196, 200} <= set(kept) and len(kept) <= 32 + 8, kept
    assert not old_tmp.exists() and (d / "notes.txt").exists()
    assert [i.step for i in c0.store.list()] == [196, 200]
    c0.close()
    c1.close()


def test_every_run_of_a_rank_prunes_however_short(tmp_path: Path) -> None:
    """Runs of a few steps each (a job preempted often): each run's first step prunes what the runs before left
    of steps the store has no checkpoint of."""
    d = tmp_path / "s" / "rng" / "rank-00001"
    for _ in range(6):
        c0, c1 = _pair(tmp_path / "s", every_n_steps=4, retention=deltackpt.Retention(keep_last=1))
        start = c0.restore()
        assert c1.restore() == start
        for s in range(start + 1, start + 7):  # (6 steps: a save at one multiple of 4, 2 unsaved after it)
            c0.step(s)
            c1.step(s)
        c0.close()
        c1.close()
    kept = sorted(int(p.name.split("-")[0]) for p in d.iterdir())
    # this run's 6 steps; the run before's past its save, which this one's first prune keeps as its save may
    # still be under way (the step before; the schedule's steps of two intervals: 16 and 20)
    assert kept == [start - 4, start, start + 1, start + 1, start + 2, start + 2, *range(start + 3, start + 7)], kept


def test_a_rank_holds_a_stop_signal_until_close(tmp_path: Path) -> None:
    """SIGTERM at a rank other than 0: its next step() keeps its states durably and returns True, and the
    signal goes on at close() (rank 0 saves; this rank ends when the job's next collective fails)."""
    got: list[int] = []
    before = signal.signal(signal.SIGTERM, lambda signum, frame: got.append(signum))
    try:
        torch.manual_seed(0)
        model = torch.nn.Linear(3, 2)
        c1 = deltackpt.Checkpointer(tmp_path / "s", model=model, rank=1, every_n_steps=10)
        assert c1.step(1) is False
        os.kill(os.getpid(), signal.SIGTERM)
        assert c1.stop_requested
        assert c1.step(2) is True and c1.step(3) is True
        assert got == [] and (tmp_path / "s" / "rng" / "rank-00001" / "3-new-0.rng").exists()
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            c1.close()
        assert got == [signal.SIGTERM]
    finally:
        signal.signal(signal.SIGTERM, before)


def test_resume_info_says_which_ranks_keep_states_of_the_step(tmp_path: Path,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    from deltackpt.cli import main

    c0, c1 = _pair(tmp_path / "s")
    c2 = deltackpt.Checkpointer(tmp_path / "s", model=c0.model, rank=2, handle_signals=False)
    for s in (1, 2):
        c0.step(s)
        c1.step(s)
        c2.step(s)
    (tmp_path / "s" / "rng" / "rank-00002" / f"2-{c0._run}.rng").unlink()
    capsys.readouterr()
    assert main(["resume-info", str(tmp_path / "s")]) == 0
    out = capsys.readouterr().out
    assert "ranks' own RNG states (rng/): rank 1 keeps this step's" in out
    assert f"rank 2: {tmp_path / 's'}/rng/rank-00002/2-{c0._run}.rng does not exist: its restore warns" in out
    assert main(["resume-info", str(tmp_path / "s"), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert [(d["rank"], d["problem"] is None) for d in doc["rank_rng"]] == [(1, True), (2, False)]
    for c in (c0, c1, c2):
        c.close()


def test_a_prune_that_fails_warns_and_the_rank_trains_on(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A prune that cannot list the store (its index damaged, say: a fault put in the listing here) warns; step()
    goes on keeping states, and the next prune, 32 steps later, tries again."""
    c0, c1 = _pair(tmp_path / "s")
    d = tmp_path / "s" / "rng" / "rank-00001"

    def unlistable() -> list[Any]:
        raise deltackpt.CorruptIndexError("index page damaged (a fault of this test)")

    monkeypatch.setattr(c1.store, "_listing", unlistable)
    with pytest.warns(RuntimeWarning, match="rank 1 could not remove its RNG states .*CorruptIndexError"):
        c1.step(1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for s in range(2, 33):
            c1.step(s)
    assert not caught and len(list(d.iterdir())) == 32
    monkeypatch.undo()
    c1.step(33)
    assert sorted(int(p.name.split("-")[0]) for p in d.iterdir()) == [31, 32, 33]
    c0.close()
    c1.close()


def test_du_counts_the_states_ranks_keep(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from deltackpt.cli import human, main

    c0, c1 = _pair(tmp_path / "s")
    capsys.readouterr()
    assert main(["du", str(tmp_path / "s"), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert (doc["rank_rng_files"], doc["rank_rng_bytes"]) == (0, 0)
    assert main(["du", str(tmp_path / "s")]) == 0
    assert "rng/" not in capsys.readouterr().out
    for s in (1, 2, 3):
        c0.step(s)
        c1.step(s)
    files = list((tmp_path / "s" / "rng" / "rank-00001").iterdir())
    assert main(["du", str(tmp_path / "s"), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    size = sum(p.stat().st_size for p in files)
    assert (doc["rank_rng_files"], doc["rank_rng_bytes"]) == (3, size)
    assert main(["du", str(tmp_path / "s")]) == 0
    line = f"^RNG states ranks keep beside the store \\(rng/\\) +3 files, {re.escape(human(size))}$"
    assert re.search(line, capsys.readouterr().out, re.M)
    c0.close()
    c1.close()


def test_a_rollback_names_the_run_alike_whenever_rank_0_commits_the_step_before_it(tmp_path: Path) -> None:
    """Ranks roll back mid-run at the same step, but rank 0's save of that step (synchronous or async) may commit
    before or after another rank's restore reads the store: the run they go on in must be named alike either way,
    or the states rank 1 keeps from there are under a run no checkpoint names."""
    c0, c1 = _pair(tmp_path / "s")
    for s in (1, 2, 3):
        c0.step(s)
        c1.step(s)
    c1.step(4)
    assert c1.restore(step=2) == 2  # (before rank 0's save of step 4 is committed)
    c0.step(4)
    assert c0.restore(step=2) == 2
    for s in (3, 4):
        c0.step(s)
        c1.step(s)
        seen = draws()
    torch.manual_seed(7)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert c1.restore() == 4
    assert draws() == seen
    c0.close()
    c1.close()


def test_a_file_whose_states_the_generators_refuse_is_warned_of_not_a_failed_restore(tmp_path: Path) -> None:
    """A file with a good checksum whose states Python's, NumPy's or torch's generator refuses (another writer's,
    a crafted one) is refused as a damaged one is: the restore warns and goes on, no generator set."""
    c0, c1 = _pair(tmp_path / "s")
    for s in (1, 2):
        c0.step(s)
        c1.step(s)
    path = next((tmp_path / "s" / "rng" / "rank-00001").glob("2-*.rng"))
    body = json.loads(path.read_bytes()[:-16])
    for bad in ({**body, "numpy": {**body["numpy"], "kind": "PCG64"}},
                {**body, "python": {**body["python"], "version": 9}},
                {**body, "numpy": {**body["numpy"], "pos": 10**30}},
                {**body, "torch": "AAAA"}):
        path.write_bytes(_crafted(bad))
        with pytest.raises(ranks.RankStateError, match="refuse"):
            ranks.read(tmp_path / "s", 1, 2, body["run"])
        torch.manual_seed(5)
        random.seed(5)
        np.random.seed(5)
        want = draws()
        torch.manual_seed(5)
        random.seed(5)
        np.random.seed(5)
        with pytest.warns(RuntimeWarning, match="rank 1 has no RNG states of step 2 to restore: .*refuse"):
            assert c1.restore(step=2) == 2
        assert draws() == want
    c0.close()
    c1.close()


def test_a_directory_named_like_a_state_file_does_not_stop_pruning_or_training(tmp_path: Path) -> None:
    """An entry of a rank's directory named as its files are but not a file (a directory someone made there) is
    not the rank's: pruning leaves it, instead of raising IsADirectoryError from step() every 32 steps."""
    c0, c1 = _pair(tmp_path / "s", every_n_steps=4)
    d = tmp_path / "s" / "rng" / "rank-00001"
    d.mkdir(parents=True)
    (d / "5-abc-1.rng").mkdir()
    for s in range(1, 70):
        c0.step(s)
        c1.step(s)
    assert (d / "5-abc-1.rng").is_dir()
    assert not (d / f"1-{c1._run}.rng").exists()  # (pruned all the same)
    c0.close()
    c1.close()


def test_a_rank_keeps_the_states_of_an_explicit_save_while_rank_0_may_still_be_saving_it(tmp_path: Path) -> None:
    """save() off the schedule on every rank, async on rank 0: that save may still be under way many steps later
    (until rank 0's next save waits for it), and rank 1's pruning must not delete its states meanwhile."""
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    c0 = deltackpt.Checkpointer(tmp_path / "s", model=model, async_save=True, handle_signals=False,
                                every_n_steps=100)
    c1 = deltackpt.Checkpointer(tmp_path / "s", model=model, rank=1, handle_signals=False, every_n_steps=100)
    go = threading.Event()
    hold_saves(c0, go)
    for s in range(1, 5):
        c0.step(s)
        c1.step(s)
    c0.save(5)
    c1.save(5)
    seen = draws()
    for s in range(6, 40):  # (past rank 1's 32nd file, where it prunes)
        c1.step(s)
        c0.step(s)
    assert [i.step for i in c1.store.list()] == []  # (rank 0's save of step 5 still under way)
    go.set()
    c0.wait()
    restores_its_draws(c1, 5, seen)
    c0.close()
    c1.close()


def test_a_rank_keeps_the_states_of_every_step_rank_0_may_still_be_saving_when_it_skips(tmp_path: Path) -> None:
    """when_busy="skip": rank 0 does not wait for a save at the next step of the schedule, so one save may run for
    many intervals. Rank 1 keeps the states of every step of the schedule after the newest rank 0 committed in this
    run, and prunes those of the steps rank 0 skipped once a later save of the run committed."""
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    common: dict[str, Any] = {"model": model, "handle_signals": False, "when_busy": "skip"}
    c0 = deltackpt.Checkpointer(tmp_path / "s", **common)
    c1 = deltackpt.Checkpointer(tmp_path / "s", rank=1, **common)
    d = tmp_path / "s" / "rng" / "rank-00001"
    go = threading.Event()
    hold_saves(c0, go)
    c1.step(1)
    seen = draws()
    assert c0.step(1)  # (held: in flight until go)
    for s in range(2, 40):  # (past rank 1's 32nd file, where it prunes)
        c1.step(s)
        assert not c0.step(s)
    assert (d / f"1-{c1._run}.rng").exists()
    go.set()
    c0.wait()
    for s in range(40, 80):  # rank 0 saves again; rank 1 prunes the skipped steps' states
        c1.step(s)
        c0.step(s)
    c0.wait()
    saved = {i.step for i in c0.store.list()}
    kept = {int(p.name.split("-")[0]) for p in d.glob("*.rng")}
    assert {1, 40} <= saved and not {2, 39} & saved
    assert 1 in kept and not set(range(2, 40)) & kept, sorted(kept)
    restores_its_draws(c1, 1, seen)
    c0.close()
    c1.close()


def test_a_rank_keeps_the_states_of_an_explicit_save_rank_0_may_still_be_running_when_it_skips(
        tmp_path: Path) -> None:
    """when_busy="skip", every_n_steps=4: rank 0's async save() of a step off the schedule may run for many
    intervals, as the steps of the schedule after it skip instead of waiting for it. Rank 1 keeps that step's states
    until a later save of the run commits, not for two intervals only."""
    torch.manual_seed(0)
    common: dict[str, Any] = {"model": torch.nn.Linear(3, 2), "handle_signals": False, "when_busy": "skip",
                              "every_n_steps": 4}
    c0 = deltackpt.Checkpointer(tmp_path / "s", **common)
    c1 = deltackpt.Checkpointer(tmp_path / "s", rank=1, **common)
    go = threading.Event()
    hold_saves(c0, {5: go})
    for s in range(1, 5):
        c1.step(s)
        c0.step(s)
    c0.wait()
    c1.save(5)  # (an explicit save is called on every rank)
    seen = draws()
    c0.save(5)  # (held: in flight until go)
    for s in range(6, 60):  # (past rank 1's 32nd file, where it prunes)
        c1.step(s)
        c0.step(s)
    assert c0.skipped
    go.set()
    c0.wait()
    assert 5 in {i.step for i in c0.store.list()}
    restores_its_draws(c1, 5, seen)
    c0.close()
    c1.close()


def test_a_rank_rolled_back_before_rank_0s_last_save_committed_keeps_the_states_of_the_new_run(
        tmp_path: Path) -> None:
    """when_busy="skip", a rollback mid-run: rank 1 restores before rank 0's save in flight, of the run rolled back
    from, commits (rank 0's restore waits for it). That checkpoint is not one of the new run's: once rank 1 has
    stepped past its step, it must not take it for the newest commit of its run and remove the states of the new
    run's steps below it, which rank 0 may still be saving."""
    torch.manual_seed(0)
    common: dict[str, Any] = {"model": torch.nn.Linear(3, 2), "handle_signals": False, "when_busy": "skip"}
    c0 = deltackpt.Checkpointer(tmp_path / "s", **common)
    c1 = deltackpt.Checkpointer(tmp_path / "s", rank=1, **common)
    gates = {60: threading.Event(), 50: threading.Event()}
    hold_saves(c0, gates)
    c1.step(1)
    assert c0.step(1)
    c0.wait()
    for s in range(2, 61):
        c1.step(s)
    assert c0.step(60)  # (held; rank 0's steps between skipped, as they would be while its save of 1 ran)
    c1.restore(step=1)  # before rank 0's save of 60 commits
    gates[60].set()
    c0.restore(step=1)  # (waits for it)
    for s in range(2, 50):
        c1.step(s)
        assert c0.step(s)
        c0.wait()
    c1.step(50)
    seen = draws()
    assert c0.step(50)  # (held)
    for s in range(51, 100):  # (past the step of 60, and past rank 1's 32nd file since, where it prunes)
        c1.step(s)
        assert not c0.step(s)
    gates[50].set()
    c0.wait()
    torch.manual_seed(7)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert c0.restore(step=50) == 50
        assert c1.restore(step=50) == 50
    assert draws() == seen
    c0.close()
    c1.close()


def test_a_ranks_step_returns_what_rank_0s_returns_at_the_restored_step(tmp_path: Path) -> None:
    """A loop that steps at the top (``step(step)`` before training it, the restored step first): rank 0 saves
    nothing at the step it restored, and returns False; so must every other rank, or a loop that runs a collective
    where step() says True (an evaluation, a barrier) hangs with rank 0 not in it."""
    c0, c1 = _pair(tmp_path / "s", every_n_steps=2)
    for s in (1, 2):
        assert c0.step(s) == c1.step(s)
    assert c0.restore() == c1.restore() == 2
    for s in (2, 2, 3, 4, 4):
        assert c0.step(s) == c1.step(s), s
    assert (tmp_path / "s" / "rng" / "rank-00001" / f"4-{c1._run}.rng").exists()
    c0.close()
    c1.close()


def test_a_rank_closed_at_a_stop_signal_makes_its_last_states_durable(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """A job-wide SIGTERM that reaches rank 1 after its step() of step 3 and rank 0 before its own: rank 0 saves
    step 3 and exits, and rank 1 never steps again (its next all-reduce fails), ending in close(). The states it
    kept at step 3, written without fsync (off the schedule, no signal yet), are the ones a restore of that
    checkpoint reads: close() makes them durable."""
    synced: list[str] = []
    fsync = os.fsync

    def recording(fd: int) -> None:
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        fsync(fd)

    got: list[int] = []
    before = signal.signal(signal.SIGTERM, lambda signum, frame: got.append(signum))
    try:
        torch.manual_seed(0)
        c1 = deltackpt.Checkpointer(tmp_path / "s", model=torch.nn.Linear(3, 2), rank=1, every_n_steps=10)
        for s in (1, 2, 3):
            c1.step(s)
        monkeypatch.setattr(os, "fsync", recording)
        os.kill(os.getpid(), signal.SIGTERM)
        c1.close()
        assert got == [signal.SIGTERM]
        path = tmp_path / "s" / "rng" / "rank-00001" / f"3-{c1._run}.rng"
        assert str(path.resolve()) in synced and str(path.parent.resolve()) in synced, synced
    finally:
        signal.signal(signal.SIGTERM, before)
