"""Retention policies: properties of ``Retention.plan`` over random histories, and the policy applied by a
real Checkpointer (deletes, thinning to weights only, what a thinned checkpoint can and cannot do).

``plan`` is a pure function of the checkpoint list, so the property tests build ``CheckpointInfo`` lists
directly (increasing steps with gaps, random metadata with a metric, tags and thinned flags, random creation
times) and check each rule on its own against an independent oracle.
"""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import DCP_NO_DIST, ROOT
from hypothesis import given
from hypothesis import strategies as st

import deltackpt
from deltackpt import Checkpointer, CheckpointInfo, DeltackptError, Retention, Store
from deltackpt.retention import TAG_KEY, THINNED_KEY

NOW = 1_700_000_000.0
METRIC = "loss"


# -- strategies ----------------------------------------------------------------------------------------------

metric_values = st.one_of(
    st.integers(-5, 5),
    st.floats(-10, 10, allow_nan=False),
    st.sampled_from([math.nan, math.inf, -math.inf, 0.5, 1.5]),  # ties are likely
    st.just("not a number"),
    st.none(),
)
metadata = st.one_of(
    st.none(),
    st.fixed_dictionaries(
        {},
        optional={
            METRIC: metric_values,
            TAG_KEY: st.one_of(st.none(), st.just(""), st.sampled_from(["best", "x", 0, 0.0]), st.booleans()),
            THINNED_KEY: st.booleans(),
            "other": st.integers(0, 3),
        },
    ),
)


@st.composite
def histories(draw: st.DrawFn) -> list[CheckpointInfo]:
    n = draw(st.integers(1, 24))
    step = draw(st.integers(0, 12))
    seq = draw(st.integers(1, 5))
    ids = draw(st.lists(st.text("0123456789abcdef", min_size=16, max_size=16), min_size=n, max_size=n,
                        unique=True))
    infos: list[CheckpointInfo] = []
    for i in range(n):
        if i:
            step += draw(st.integers(1, 7))
            seq += draw(st.integers(1, 3))
        age = draw(st.one_of(st.floats(-50, 5000, allow_nan=False), st.sampled_from([0.0, 100.0, 1000.0])))
        infos.append(CheckpointInfo(
            id=ids[i], step=step, created=NOW - age, parent=ids[i - 1] if i else None, logical_bytes=0,
            written_bytes=0, metadata=draw(metadata), seq=seq,
        ))
    return infos


def _policy(keep_best: tuple[str, str] | None, best_k: int, **kw: Any) -> Retention:
    return Retention(keep_best=keep_best, best_k=best_k if keep_best is not None else 1, **kw)


policies = st.builds(
    _policy,
    keep_last=st.one_of(st.none(), st.integers(1, 6)),
    keep_every=st.one_of(st.none(), st.integers(1, 10)),
    keep_tagged=st.booleans(),
    keep_best=st.one_of(st.none(), st.tuples(st.just(METRIC), st.sampled_from(["min", "max"]))),
    best_k=st.integers(1, 3),
    keep_within=st.one_of(st.none(), st.floats(0, 3000, allow_nan=False), st.just(100.0)),
    full_last=st.one_of(st.none(), st.integers(1, 5)),
)


# -- the oracle ----------------------------------------------------------------------------------------------

def _meta(info: CheckpointInfo) -> dict[str, Any]:
    return info.metadata if isinstance(info.metadata, dict) else {}


def rule_selections(policy: Retention, infos: list[CheckpointInfo]) -> dict[str, set[str]]:
    """For each rule the ids it certainly keeps, computed independently of ``Retention.plan``."""
    ids = [i.id for i in infos]
    out: dict[str, set[str]] = {"newest": {ids[-1]}}
    if policy.keep_last is not None:
        out["keep_last"] = set(ids[len(ids) - policy.keep_last:] if policy.keep_last < len(ids) else ids)
    if policy.keep_every is not None:
        out["keep_every"] = {i.id for i in infos if i.step % policy.keep_every == 0}
    if policy.keep_tagged:
        # any tag but None and False: a tag of 0 or "" (an epoch number, say) tags its checkpoint
        out["keep_tagged"] = {i.id for i in infos if (t := _meta(i).get(TAG_KEY)) is not None and t is not False}
    if policy.keep_within is not None:
        out["keep_within"] = {i.id for i in infos if NOW - i.created <= policy.keep_within}
    if policy.keep_best is not None:
        out["keep_best"] = best_sets(policy, infos)[0]
    return out


def scored(infos: list[CheckpointInfo]) -> list[tuple[float, str]]:
    out = []
    for i in infos:
        v = _meta(i).get(METRIC)
        if isinstance(v, (int, float)) and not isinstance(v, bool) and not math.isnan(v):
            out.append((float(v), i.id))
    return out


def best_sets(policy: Retention, infos: list[CheckpointInfo]) -> tuple[set[str], set[str], int]:
    """(ids certainly among the best_k, ids possibly among them (ties), how many the rule keeps)."""
    assert policy.keep_best is not None
    sign = 1.0 if policy.keep_best[1] == "min" else -1.0
    items = [(sign * v, cid) for v, cid in scored(infos)]  # smaller is better
    if not items:
        return set(), set(), 0
    k = min(policy.best_k, len(items))
    threshold = sorted(v for v, _ in items)[k - 1]
    return {c for v, c in items if v < threshold}, {c for v, c in items if v <= threshold}, k


def plan_of(policy: Retention, infos: list[CheckpointInfo]) -> Any:
    return policy.plan(infos, now=NOW)


# -- properties ----------------------------------------------------------------------------------------------

@given(infos=histories(), policy=policies)
def test_plan_partitions_the_ids(infos: list[CheckpointInfo], policy: Retention) -> None:
    plan = plan_of(policy, infos)
    ids = [i.id for i in infos]
    for name in ("keep", "thin", "delete"):
        lst = getattr(plan, name)
        assert len(lst) == len(set(lst)), f"{name} lists an id twice: {lst}"
    keep, thin, delete = set(plan.keep), set(plan.thin), set(plan.delete)
    assert not keep & thin and not keep & delete and not thin & delete, plan
    assert keep | thin | delete == set(ids), plan


@given(infos=histories(), policy=policies)
def test_newest_is_always_kept_in_full(infos: list[CheckpointInfo], policy: Retention) -> None:
    plan = plan_of(policy, infos)
    assert infos[-1].id in plan.keep, plan


@given(infos=histories(), policy=policies)
def test_every_rule_protects_what_it_selects(infos: list[CheckpointInfo], policy: Retention) -> None:
    plan = plan_of(policy, infos)
    deleted = set(plan.delete)
    by_id = {i.id: i for i in infos}
    for rule, selected in rule_selections(policy, infos).items():
        lost = selected & deleted
        assert not lost, f"{rule} selects steps {sorted(by_id[c].step for c in lost)}; the plan deletes them"
    if policy.keep_best is not None:
        _, possible, k = best_sets(policy, infos)
        survivors = possible - deleted
        assert len(survivors) >= k, f"keep_best keeps {len(survivors)} of the best, wants {k}"


@given(infos=histories(), policy=policies)
def test_nothing_survives_without_a_rule(infos: list[CheckpointInfo], policy: Retention) -> None:
    """A checkpoint survives only if some rule (or being the newest) keeps it."""
    plan = plan_of(policy, infos)
    if not policy.deletes_anything:
        return
    possible: set[str] = set().union(*rule_selections(policy, infos).values())
    if policy.keep_best is not None:
        possible |= best_sets(policy, infos)[1]
    kept = set(plan.keep) | set(plan.thin)
    by_id = {i.id: i for i in infos}
    extra = kept - possible
    assert not extra, f"steps {sorted(by_id[c].step for c in extra)} kept though no rule selects them"


@given(infos=histories(), policy=policies)
def test_no_deleting_rule_deletes_nothing(infos: list[CheckpointInfo], policy: Retention) -> None:
    policy = Retention(keep_tagged=policy.keep_tagged, full_last=policy.full_last)
    assert not policy.deletes_anything
    plan = plan_of(policy, infos)
    assert plan.delete == []
    assert set(plan.keep) | set(plan.thin) == {i.id for i in infos}


@given(infos=histories(), n=st.integers(1, 8))
def test_keep_last_keeps_the_n_newest(infos: list[CheckpointInfo], n: int) -> None:
    plan = plan_of(Retention(keep_last=n, keep_tagged=False), infos)
    newest = [i.id for i in infos][-n:]
    assert plan.keep == newest, f"keep_last={n} alone keeps {plan.keep}, expected {newest}"
    assert plan.delete == [i.id for i in infos][: max(0, len(infos) - n)]


@given(infos=histories(), policy=policies)
def test_thinning(infos: list[CheckpointInfo], policy: Retention) -> None:
    plan = plan_of(policy, infos)
    if policy.full_last is None:
        assert plan.thin == []
        return
    by_id = {i.id: i for i in infos}
    survivors = [i.id for i in infos if i.id not in set(plan.delete)]
    full = set(survivors[-policy.full_last:])  # (the newest of those kept: deleted ones take no place)
    thin = set(plan.thin)
    assert not thin & full, "a checkpoint among the full_last newest kept is thinned"
    assert not thin & set(plan.delete)
    for cid in thin:
        assert not _meta(by_id[cid]).get(THINNED_KEY), f"step {by_id[cid].step} is thinned a second time"
    # every surviving checkpoint outside the full_last newest kept ends up weights-only
    for cid in plan.keep:
        if cid not in full:
            assert _meta(by_id[cid]).get(THINNED_KEY), f"step {by_id[cid].step} stays full"


def test_examples() -> None:
    infos = [CheckpointInfo(f"{s:016x}", s, NOW, None, 0, 0, None, s) for s in range(1, 13)]
    plan = Retention(keep_last=2, keep_every=5).plan(infos, now=NOW)
    assert sorted(int(c, 16) for c in plan.keep) == [5, 10, 11, 12]
    assert sorted(int(c, 16) for c in plan.delete) == [1, 2, 3, 4, 6, 7, 8, 9]
    metas = [{"loss": v} for v in (3.0, 1.0, 2.0, 1.0, 5.0)]
    infos = [CheckpointInfo(f"{s:016x}", s, NOW, None, 0, 0, m, s) for s, m in enumerate(metas, 1)]
    plan = Retention(keep_best=("loss", "min"), best_k=2, keep_last=1).plan(infos, now=NOW)
    assert sorted(int(c, 16) for c in plan.keep) == [2, 4, 5]
    plan = Retention(keep_best=("loss", "max"), keep_last=1, full_last=1).plan(infos, now=NOW)
    assert sorted(int(c, 16) for c in plan.keep) == [5] and plan.thin == [] and len(plan.delete) == 4


def test_full_last_counts_the_checkpoints_that_survive() -> None:
    """full_last=N keeps the N newest of the checkpoints the rules keep full. It counted the N newest before the
    deletes, so newer checkpoints deleted by the same plan took places: keep_best with full_last=2 left the best
    checkpoint thinned beside one full one, and keep_every thinned each kept multiple at the next save."""
    metas = [{"loss": 0.1}, {"loss": 0.5}, {"loss": 0.9}]
    infos = [CheckpointInfo(f"{s:016x}", s, NOW, None, 0, 0, m, s) for s, m in enumerate(metas, 1)]
    plan = Retention(keep_best=("loss", "min"), full_last=2).plan(infos, now=NOW)
    assert sorted(int(c, 16) for c in plan.keep) == [1, 3] and plan.thin == [] and len(plan.delete) == 1
    infos = [CheckpointInfo(f"{s:016x}", s, NOW, None, 0, 0, None, s) for s in range(1, 26)]
    plan = Retention(keep_every=10, keep_last=1, full_last=2).plan(infos, now=NOW)
    assert sorted(int(c, 16) for c in plan.keep) == [20, 25] and [int(c, 16) for c in plan.thin] == [10]


def test_keep_best_ranks_numpy_scalars() -> None:
    """A metric saved as a numpy scalar (``np.mean`` of a float32 array is one) ranks like a float; before, such
    checkpoints were left out of ``keep_best`` and the best one was deleted. Bools, NaN and strings are not
    ranked."""
    import numpy as np

    metas = [{"loss": np.float32(0.1)}, {"loss": np.float64(0.9)}, {"loss": np.int64(5)}, {"loss": True},
             {"loss": float("nan")}, {"loss": "0.0"}, {"loss": 0.7}]
    infos = [CheckpointInfo(f"{s:016x}", s, NOW, None, 0, 0, m, s) for s, m in enumerate(metas, 1)]
    plan = Retention(keep_best=("loss", "min"), best_k=2, keep_last=1).plan(infos, now=NOW)
    assert sorted(int(c, 16) for c in plan.keep) == [1, 7]
    plan = Retention(keep_best=("loss", "max"), keep_last=1).plan(infos, now=NOW)
    assert sorted(int(c, 16) for c in plan.keep) == [3, 7]


# -- with a real Checkpointer --------------------------------------------------------------------------------

def _train(model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    model(torch.randn(4, 8)).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()


def _weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _assert_weights(expected: dict[str, torch.Tensor], actual: Any, where: str) -> None:
    assert list(actual) == list(expected), where
    for k, v in expected.items():
        got = actual[k].reshape(-1).view(torch.uint8)
        assert torch.equal(got, v.reshape(-1).view(torch.uint8)), f"{where}: {k}"


def _setup(seed: int = 0) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def test_checkpointer_keep_last_and_every(store_path: Path) -> None:
    model, opt = _setup()
    weights = {}
    policy = Retention(keep_last=2, keep_every=5)
    ckpt = Checkpointer(store_path, model=model, optimizer=opt, retention=policy, handle_signals=False)
    for step in range(1, 13):
        _train(model, opt)
        weights[step] = _weights(model)
        assert ckpt.step(step)
    ckpt.close()
    with Store(store_path) as store:
        infos = store.list()
        assert sorted(i.step for i in infos) == [5, 10, 11, 12]
        assert [i.step for i in infos] == [5, 10, 11, 12], "commit order"
        for i in infos:
            _assert_weights(weights[i.step], store.load(id=i.id)["model"], f"step {i.step}")
            assert store.load(id=i.id)["optimizer"]["state"], "not thinned: the optimizer state is there"
        assert store.latest().step == 12


@pytest.mark.parametrize("keep_every", [5, 1])
def test_steps_kept_for_good_are_saved_as_keyframes(store_path: Path, keep_every: int) -> None:
    """A step retention keeps for good while it deletes the saves around it (a multiple of keep_every above the
    save interval) is saved as a keyframe: every chunk a standalone frame, so that it keeps no delta bases or
    prediction inputs of deleted checkpoints alive. The other saves stay deltas and predictions, and with
    keep_every at the interval (every save kept for good) nothing is forced. Every step loads bit-exactly."""
    from deltackpt import codec
    from deltackpt.index import chunk_keys

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 64))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    weights = {}
    ckpt = Checkpointer(Store(store_path, chunk_size=4096), model=model, optimizer=opt, async_save=False,
                        retention=Retention(keep_last=100, keep_every=keep_every), handle_signals=False)
    for step in range(1, 13):
        model(torch.randn(16, 64)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        weights[step] = _weights(model)
        assert ckpt.step(step)
    ckpt.close()
    with Store(store_path) as store:
        assert [i.step for i in store.list()] == list(range(1, 13))
        for info in store.list():
            m = store.manifest(id=info.id)
            locs = store.index.lookup_chunks(chunk_keys(*m.stored_chunks()))
            based = sum(loc.codec in codec.BASED for loc in locs.values())
            if info.step % keep_every == 0 and keep_every > 1 or info.step == 1:
                assert based == 0, f"step {info.step} holds {based} delta or predicted frames"
            else:
                assert based > len(locs) // 4, f"step {info.step}: {based} of {len(locs)} chunks based"
            _assert_weights(weights[info.step], store.load(id=info.id)["model"], f"step {info.step}")



def test_a_step_kept_for_good_holds_no_frames_of_the_steps_deleted_before_it(store_path: Path,
                                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """Chunks that stopped changing stay stored as the deltas of the saves that changed them last, and a save
    deduplicates onto those frames. The step that keep_every keeps for good is self-contained all the same:
    those chunks are written again standalone (their entries re-pointed), so once retention has deleted the
    steps before it and gc has run, every frame it reads is standalone and the packs hold about one state
    (before: 48 of its 67 chunks still decoded from the deleted steps' frames)."""
    from deltackpt import codec
    from deltackpt.index import chunk_keys

    monkeypatch.setenv("DELTACKPT_GC_MIN_BYTES", "0")
    torch.manual_seed(0)
    model = torch.nn.Linear(256, 256)
    ckpt = Checkpointer(Store(store_path, chunk_size=4096), model=model, async_save=False, handle_signals=False,
                        retention=Retention(keep_last=1, keep_every=5))
    for step in range(1, 6):
        if step <= 3:  # a small change in every chunk, then none
            with torch.no_grad():
                model.weight.view(-1)[::97] += 1e-3
        assert ckpt.step(step)
    expected = _weights(model)
    ckpt.close()
    with Store(store_path) as store:
        assert [i.step for i in store.list()] == [5]
        store.gc()
        m = store.manifest(5)
        locs = store.index.lookup_chunks(chunk_keys(*m.stored_chunks()))
        assert locs and all(loc.codec not in codec.BASED and loc.depth == 0 for loc in locs.values())
        packs = sum(p.stat().st_size for p in (store_path / "packs").rglob("*.pack"))
        assert packs < 1.2 * m.logical_bytes, (packs, m.logical_bytes)
        _assert_weights(expected, store.load(5)["model"], "step 5")
        assert store.verify().ok


_KILLED_WHILE_THINNING = """
import os, signal, sys, torch
from deltackpt import Checkpointer, Retention, Store
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
ckpt = Checkpointer(sys.argv[1], model=model, optimizer=opt, async_save=False, handle_signals=False,
                    retention=Retention(keep_last=3, full_last=1))
for step in range(1, 5):
    model(torch.randn(4, 8)).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()
    if step == 4:  # the round that deletes step 1 and thins step 3: killed at its first rewrite
        Store.rewrite = lambda *a, **k: os.kill(os.getpid(), signal.SIGKILL)
    ckpt.step(step)
"""


def test_a_process_killed_while_retention_thins_has_done_the_deletes(store_path: Path) -> None:
    """Retention deletes first, then thins (a load and a rewrite per checkpoint): a process killed while it
    thins (SIGKILL at the rewrite of step 3) has already deleted what the round deletes (step 1), so repeated
    kills cannot pile up checkpoints. Before, it thinned first and the kill skipped the deletes."""
    run = subprocess.run([sys.executable, "-c", _KILLED_WHILE_THINNING, str(store_path)], capture_output=True,
                         text=True, timeout=120)
    assert run.returncode == -9, run.stderr
    with Store(store_path) as store:
        infos = store.list()
        assert [i.step for i in infos] == [2, 3, 4]
        assert [bool((i.metadata or {}).get(THINNED_KEY)) for i in infos] == [True, False, False]
        assert store.load(4)["optimizer"]["state"] and store.load(3)["optimizer"]["state"]
        assert store.verify().ok


def test_thinned_checkpoints_hold_weights_only(store_path: Path) -> None:
    model, opt = _setup()
    weights = {}
    ckpt = Checkpointer(store_path, model=model, optimizer=opt, retention=Retention(keep_last=2, full_last=1),
                        handle_signals=False)
    for step in range(1, 13):
        _train(model, opt)
        weights[step] = _weights(model)
        ckpt.step(step)
    ckpt.close()
    with Store(store_path) as store:
        infos = {i.step: i for i in store.list()}
        assert sorted(infos) == [11, 12]
        thin = store.load(step=11)
        assert thin["thinned"] is True
        assert set(thin) == {"step", "model", "thinned"}, "a thinned checkpoint holds model weights only"
        assert thin["step"] == 11
        assert infos[11].metadata and infos[11].metadata.get(THINNED_KEY) is True
        _assert_weights(weights[11], thin["model"], "thinned step 11")
        full = store.load(step=12)
        assert not full.get("thinned") and full["optimizer"]["state"]
        assert not (infos[12].metadata or {}).get(THINNED_KEY)
        _assert_weights(weights[12], full["model"], "step 12")

    model2, opt2 = _setup(seed=1)
    ckpt = Checkpointer(store_path, model=model2, optimizer=opt2, handle_signals=False)
    try:
        with pytest.raises(DeltackptError, match="thinned"):
            ckpt.restore(step=11)
    finally:
        ckpt.close()


def test_resume_after_thinning_uses_the_newest_full_checkpoint(store_path: Path) -> None:
    """After thinning, ``restore()`` (latest) still resumes from the newest step, in full."""
    model, opt = _setup()
    ckpt = Checkpointer(store_path, model=model, optimizer=opt, retention=Retention(keep_last=2, full_last=1),
                        handle_signals=False)
    for step in range(1, 13):
        _train(model, opt)
        ckpt.step(step)
    ckpt.close()
    expected = _weights(model)
    model2, opt2 = _setup(seed=1)
    ckpt = Checkpointer(store_path, model=model2, optimizer=opt2, handle_signals=False)
    try:
        assert ckpt.store.latest().step == 12, "the latest checkpoint is not the newest step"
        assert ckpt.restore() == 12
    finally:
        ckpt.close()
    _assert_weights(expected, model2.state_dict(), "resumed model")


def test_keep_last_with_thinning_keeps_the_newest_steps(store_path: Path) -> None:
    """Retention(keep_last=2, full_last=1) after every committed step: the two newest steps survive,
    the older one thinned, the newest in full."""
    model, opt = _setup()
    ckpt = Checkpointer(store_path, model=model, optimizer=opt, retention=Retention(keep_last=2, full_last=1),
                        handle_signals=False)
    try:
        history = []
        for step in range(1, 9):
            _train(model, opt)
            ckpt.step(step)
            ckpt.wait()
            infos = ckpt.store.list()
            history.append((step, [(i.step, bool((i.metadata or {}).get(THINNED_KEY))) for i in infos]))
        for step, got in history:
            want = sorted([(step - 1, True), (step, False)] if step > 1 else [(1, False)])
            assert sorted(got) == want, f"after step {step}: retained {got}, want {want}; history {history}"
    finally:
        ckpt.close()


def test_tagged_and_best_survive_in_a_real_store(store_path: Path) -> None:
    model, opt = _setup()
    policy = Retention(keep_last=1, keep_best=("val", "min"), best_k=1)
    ckpt = Checkpointer(store_path, model=model, optimizer=opt, retention=policy, handle_signals=False)
    vals = [5.0, 3.0, 4.0, 1.0, 2.0, 6.0]
    for step, v in enumerate(vals, 1):
        _train(model, opt)
        ckpt.save(step, metadata={"val": v, **({"tag": "milestone"} if step == 2 else {})})
    ckpt.close()
    with Store(store_path) as store:
        assert sorted(i.step for i in store.list()) == [2, 4, 6]


def test_what_a_caller_does_to_listed_metadata_is_not_what_retention_reads(store_path: Path) -> None:
    """Each listing's metadata is its own. Before, list() handed out the objects it kept to list faster next
    time: popping the tag from a listed checkpoint's metadata made the next listing of the handle lack it, and
    retention deleted the tagged checkpoint its stored record still tagged."""
    with Store(store_path) as store:
        for step in range(1, 5):
            store.save({"w": torch.full((100,), float(step))}, step=step,
                       metadata={"tag": "release", "eval": {"acc": 0.5}} if step == 1 else {"loss": 1.0})
        first = store.list()[0]
        first.metadata.pop("tag")
        first.metadata["eval"]["acc"] = 0.0
        assert store.list()[0].metadata == {"tag": "release", "eval": {"acc": 0.5}}
        assert [i.step for i in store.retain(Retention(keep_last=1))] == [2, 3]
        assert [i.step for i in store.list()] == [1, 4]


def test_retention_validation() -> None:
    """Out-of-range values are ValueErrors, values of the wrong type TypeErrors, both at construction."""
    for kw in ({"keep_last": 0}, {"keep_every": -1}, {"full_last": 0}, {"best_k": 0}, {"keep_within": -1.0},
               {"keep_best": ("loss", "median")}, {"keep_within": float("nan")}, {"keep_within": float("inf")},
               {"keep_best": ("", "min")}, {"best_k": 3}):
        with pytest.raises(ValueError):
            Retention(**kw)
    for kw in ({"keep_within": "60"}, {"keep_last": True}, {"best_k": 1.5}, {"best_k": True}, {"best_k": None},
               {"keep_every": 2.0}, {"keep_tagged": "yes"}, {"keep_best": "loss"}, {"keep_last": "3"},
               {"keep_tagged": 1}, {"keep_best": (None, "min")}):
        with pytest.raises(TypeError):
            Retention(**kw)
    assert deltackpt.Retention().plan([]).keep == []
    # numpy integers (what np.arange or a config array gives) are ints; a list pair is a (hashable) tuple
    import numpy as np

    policy = Retention(keep_last=np.int64(3), best_k=np.int32(2), keep_best=["loss", "min"], keep_within=np.float32(5))
    assert policy.keep_last == 3 and type(policy.keep_last) is int and policy.best_k == 2
    assert policy.keep_best == ("loss", "min") and hash(policy) is not None
    assert type(policy.keep_within) is float


def test_rewritten_checkpoint_keeps_its_place_in_the_lineage(tmp_path: Path) -> None:
    """A rewrite (thinning) gives the checkpoint a new id but its old place: later checkpoints name it as their
    parent, its old id still finds it, log does not call it deleted, and a repair keeps the commit order (it
    keeps its creation time), also after a second rewrite."""
    import shutil
    import subprocess
    import sys

    from deltackpt import maintenance

    path = tmp_path / "s"
    with Store(path) as s:
        ids = [s.save({"w": torch.full((8,), float(step))}, step=step).id for step in (1, 2, 3)]
        created = s.info(1).created
        first = s.rewrite({"w": torch.zeros(8)}, id=ids[0])
        second = s.rewrite({"w": torch.ones(8)}, id=first.id)
        # the root stays a root: a rewrite takes no parent (it once took the handle's head, the newest)
        assert first.parent is None and second.parent is None and s.info(1).parent is None
        assert [i.id for i in s.list()] == [second.id, ids[1], ids[2]]
        assert s.list()[1].parent == second.id and s.info(2).parent == second.id
        for old in (ids[0], first.id):
            assert s.info(id=old).id == second.id
            assert torch.equal(s.load(id=old)["w"], torch.ones(8))
        assert s.info(1).created == created
        assert s.save({"w": torch.ones(8)}, step=4, parent=ids[0]).parent == second.id  # a branch off it
        s.delete(4)
    log = subprocess.run([sys.executable, "-m", "deltackpt", "log", str(path)], capture_output=True, text=True,
                         check=True).stdout
    assert "deleted" not in log and f"1 ({second.id})" in log
    shutil.rmtree(path / "index")
    with maintenance.open_for_repair(path) as s:
        s.repair()
        assert [(i.id, i.step) for i in s.list()] == [(second.id, 1), (ids[1], 2), (ids[2], 3)]
        assert s.list()[1].parent == second.id and s.latest().id == ids[2]
        assert s.info(id=ids[0]).id == second.id


def test_thinning_the_first_checkpoint_keeps_the_lineage_a_tree(store_path: Path) -> None:
    """Retention thins the run's first checkpoint (loaded just before, so the handle's head): it stays a root,
    no checkpoint becomes its own ancestor, and log marks no branch."""
    model, opt = _setup()
    ckpt = Checkpointer(store_path, model=model, optimizer=opt, retention=Retention(keep_last=3, full_last=1),
                        handle_signals=False)
    for step in (1, 2, 3):
        _train(model, opt)
        ckpt.step(step)
    ckpt.close()
    with Store(store_path) as s:
        infos = s.list()
        assert [i.step for i in infos] == [1, 2, 3] and infos[0].parent is None
        parent = {i.id: i.parent for i in infos}
        for i in infos:  # walking parents reaches the root without meeting a checkpoint twice
            seen, at = set(), i.id
            while at is not None:
                assert at not in seen, f"step {i.step}'s ancestry loops"
                seen.add(at)
                at = parent.get(at)
    log = subprocess.run([sys.executable, "-m", "deltackpt", "log", str(store_path)], capture_output=True, text=True,
                         check=True).stdout
    assert "branch" not in log, log


#: Another process that deletes checkpoints by id as it is told, one per line on stdin (what ``deltackpt rm``
#: does; one process for the whole test rather than one, importing torch, per delete)
_DELETER = """
import sys, deltackpt
for line in sys.stdin:
    with deltackpt.Store(sys.argv[1]) as s:
        s.delete(id=line.strip())
    print("deleted", flush=True)
"""


class _OperatorMeanwhile(Retention):
    """A policy whose plan is made from the listing retention read, after which another process (another job's
    retention, an operator's ``deltackpt rm``) deletes the checkpoints the plan would delete or thin."""

    other: subprocess.Popen[str]

    def plan(self, infos: Any, now: float | None = None) -> Any:
        plan = super().plan(infos, now)
        assert self.other.stdin is not None and self.other.stdout is not None
        for cid in (*plan.delete, *plan.thin):
            self.other.stdin.write(cid + "\n")
            self.other.stdin.flush()
            assert self.other.stdout.readline() == "deleted\n", f"the other process failed to delete {cid}"
        return plan


@pytest.mark.parametrize("full_last", [None, 1])
def test_retention_passes_over_checkpoints_another_process_deleted(store_path: Path, full_last: int | None) -> None:
    """Between retention's listing and its deletes (and thinning), another process deletes checkpoints the plan
    names: the training step goes on (before, delete and the thinning load raised CheckpointNotFoundError at
    the next step()), and the policy's outcome holds."""
    model, opt = _setup()
    policy = _OperatorMeanwhile(keep_last=2, full_last=full_last)
    policy.other = subprocess.Popen([sys.executable, "-c", _DELETER, str(store_path)], cwd=ROOT, text=True,
                                    stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        with Checkpointer(store_path, model=model, optimizer=opt, retention=policy, handle_signals=False) as ckpt:
            for step in range(1, 7):
                _train(model, opt)
                ckpt.step(step)
            weights = _weights(model)
    finally:  # (after the close: the last save's retention runs in the background until then)
        policy.other.communicate(timeout=60)
    with Store(store_path) as store:
        assert [i.step for i in store.list()] == ([5, 6] if full_last is None else [6])
        _assert_weights(weights, store.load(step=6)["model"], "step 6")
        assert store.verify().ok


def test_a_rewrite_keeps_the_metadata_unless_given(store_path: Path) -> None:
    """``rewrite`` replaces a checkpoint "in place": its metadata (a tag, the metric keep_best ranks by) stays
    unless the call gives other metadata. Before, a rewrite without ``metadata=`` dropped it, and retention's
    keep_tagged and keep_best stopped protecting the checkpoint."""
    with Store(store_path) as s:
        cid = s.save({"w": torch.ones(4)}, step=1, metadata={"tag": "release", "loss": 0.5}).id
        kept = s.rewrite({"w": torch.zeros(4)}, id=cid)
        assert kept.metadata == {"tag": "release", "loss": 0.5} == s.info(1).metadata
        assert s.manifest(1).metadata is not None
        assert s.rewrite({"w": torch.zeros(4)}, id=kept.id, metadata={"loss": 0.4}).metadata == {"loss": 0.4}
        assert s.rewrite({"w": torch.zeros(4)}, id=s.info(1).id, metadata={}).metadata == {}
        assert s.verify().ok


def test_store_retain_applies_a_policy_now(tmp_path: Path) -> None:
    """``Store.retain``: a dry run returns what the policy drops and changes nothing; the real run deletes exactly
    those and returns them, oldest first; every kept checkpoint loads. ``full_last`` (thinning) is refused, and a
    read-only handle may only dry-run."""
    states = {i: {"w": torch.full((100,), float(i))} for i in range(8)}
    with Store(tmp_path / "s") as s:
        for i, state in states.items():
            s.save(state, step=i, metadata={"loss": 8.0 - i if i != 2 else 0.1})
        policy = Retention(keep_last=2, keep_best=("loss", "min"))
        assert [i.step for i in s.retain(policy, dry_run=True)] == [0, 1, 3, 4, 5]
        assert len(s.list()) == 8
        with pytest.raises(ValueError, match="does not thin"):
            s.retain(Retention(keep_last=2, full_last=1))
        with pytest.raises(TypeError, match="must be a deltackpt.Retention"):
            s.retain({"keep_last": 2})  # type: ignore[arg-type]
        for switch in ("no", "False", 0):  # (before, the strings dry-ran and 0 deleted)
            with pytest.raises(TypeError, match="dry_run must be True or False"):
                s.retain(policy, dry_run=switch)  # type: ignore[arg-type]
        assert len(s.list()) == 8
    with Store(tmp_path / "s", readonly=True) as ro:
        assert [i.step for i in ro.retain(policy, dry_run=True)] == [0, 1, 3, 4, 5]
        with pytest.raises(deltackpt.ReadOnlyStoreError):
            ro.retain(policy)
    with Store(tmp_path / "s") as s:
        assert [i.step for i in s.retain(policy)] == [0, 1, 3, 4, 5]
        assert [i.step for i in s.list()] == [2, 6, 7]
        for i in s.list():
            assert torch.equal(s.load(id=i.id)["w"], states[i.step]["w"])
        assert s.retain(policy) == []


def test_store_and_dcp_retain_refuse_a_metric_no_checkpoint_records(tmp_path: Path) -> None:
    """``Store.retain`` and ``distributed.retain`` with a ``keep_best`` metric no checkpoint records (a misspelt
    one) deleted every checkpoint the other rules do not keep, the best included, as ``deltackpt keep --best``
    refuses to. They now refuse too, dry runs included, and delete nothing; a metric recorded by some works."""
    import warnings

    import torch.distributed.checkpoint as dcp

    from deltackpt import distributed
    from deltackpt.distributed import DeltaStorageWriter

    with Store(tmp_path / "s") as s:
        for i in range(5):
            s.save({"w": torch.full((10,), float(i))}, step=i, metadata={"loss": 0.1 if i == 1 else 9.0 - i})
        for dry_run in (True, False):
            with pytest.raises(ValueError, match=r"ranks by 'lost', .*numbers they record: 'loss'.*nothing deleted"):
                s.retain(Retention(keep_last=1, keep_best=("lost", "min")), dry_run=dry_run)
        assert [i.step for i in s.list()] == [0, 1, 2, 3, 4]
        assert [i.step for i in s.retain(Retention(keep_last=1, keep_best=("loss", "min")))] == [0, 2, 3]
    root = tmp_path / "dcp"
    w = DeltaStorageWriter(root)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for step in (1, 2, 3):
            w.step, w.metadata = step, {"loss": 0.1 if step == 1 else 9.0 - step}
            dcp.save({"x": torch.full((10,), float(step))}, storage_writer=w, **DCP_NO_DIST)
    w.close()
    with pytest.raises(ValueError, match="ranks by 'lost'.*nothing deleted"):
        distributed.retain(root, Retention(keep_last=1, keep_best=("lost", "min")))
    assert distributed.steps(root) == [1, 2, 3]
    assert [i.step for i in distributed.retain(root, Retention(keep_last=1, keep_best=("loss", "min")))] == [2]


def _infos(steps: list[int], metas: list[Any] | None = None) -> list[CheckpointInfo]:
    metas = metas or [None] * len(steps)
    return [CheckpointInfo(f"{i:016x}", s, NOW, None, 0, 0, m, i + 1) for i, (s, m) in enumerate(zip(steps, metas))]


def test_retention_deletes_in_one_index_commit(store_path: Path) -> None:
    """Store.retain and a Checkpointer's retention delete all they drop in one index commit (LMDB's transaction
    id counts the commits): one commit per checkpoint cost 8.7 ms each, 86 s to apply a policy to 10,000. (The
    DCP writer's and `deltackpt rm`'s deletes go through the same Store._delete.)"""
    with Store(store_path) as store:
        for s in range(1, 31):
            store.save({"w": torch.full((64,), float(s))}, step=s)
        before = store.index.env.info()["last_txnid"]
        dropped = store.retain(Retention(keep_last=3))
        assert store.index.env.info()["last_txnid"] == before + 1
        assert [i.step for i in dropped] == list(range(1, 28))
        assert [i.step for i in store.list()] == [28, 29, 30]
        assert sorted(p.stem for p in (store_path / "manifests").glob("*.manifest")) == sorted(
            i.id for i in store.list())
        assert store.retain(Retention(keep_last=3)) == []
        assert store.index.env.info()["last_txnid"] == before + 1, "nothing to delete, nothing committed"
        assert float(store.load(28)["w"][0]) == 28.0
    # a Checkpointer given a policy over a long history: its save commits, then its retention, once
    model = torch.nn.Linear(4, 4)
    with Checkpointer(store_path, model=model, async_save=False, handle_signals=False) as ck:
        for s in range(31, 41):
            ck.save(s)
    with Checkpointer(store_path, model=model, async_save=False, handle_signals=False, gc=False,
                      retention=Retention(keep_last=2)) as ck:
        before = ck.store.index.env.info()["last_txnid"]
        ck.save(41)
        assert ck.store.index.env.info()["last_txnid"] == before + 2
        assert [i.step for i in ck.store.list()] == [40, 41]


def test_keep_every_keeps_step_zero() -> None:
    """0 is a multiple of every keep_every: the initial (step 0) checkpoint is kept for good. (The property test's
    histories start at step 0 only sometimes, and with 30 examples a rule that drops step 0 went unnoticed.)"""
    infos = _infos([0, 1, 2, 3, 4, 5, 6])
    plan = Retention(keep_every=5).plan(infos, now=NOW)
    kept = sorted(i.step for i in infos if i.id in plan.keep)
    assert kept == [0, 5, 6], kept


def test_keep_best_prefers_the_newer_of_tied_checkpoints() -> None:
    """README: keep_best keeps the best_k best, 'the newer one first on a tie'."""
    infos = _infos([1, 2, 3, 4], [{"loss": 1.0}, {"loss": 1.0}, {"loss": 2.0}, {"loss": 3.0}])
    plan = Retention(keep_best=("loss", "min"), best_k=1, keep_last=1).plan(infos, now=NOW)
    kept = sorted(i.step for i in infos if i.id in plan.keep)
    assert kept == [2, 4], kept
    plan = Retention(keep_best=("loss", "max"), best_k=1, keep_last=1).plan(
        _infos([1, 2, 3], [{"loss": 5.0}, {"loss": 5.0}, {"loss": 0.0}]), now=NOW)
    assert sorted(int(c, 16) for c in plan.keep) == [1, 2], plan  # ids 0x1 (step 2) and 0x2 (step 3)


def test_keep_within_beyond_float_range_is_a_value_error() -> None:
    """An int (or Fraction) keep_within too large for a float is out of range: a ValueError, as documented, not
    the OverflowError of converting it."""
    import fractions

    for value in (10**400, -(10**400), fractions.Fraction(10**400, 3)):
        with pytest.raises(ValueError, match="keep_within must be a finite number"):
            Retention(keep_last=3, keep_within=value)


def test_keep_within_is_inclusive() -> None:
    """keep_within=N keeps a checkpoint exactly N seconds old (the rule's boundary, which the property test's
    oracle also draws: it found a `<` there only after 223 s of search)."""
    infos = [CheckpointInfo(f"{i:016x}", i, NOW - age, None, 0, 0, None, i + 1)
             for i, age in enumerate([100.0, 50.0, 0.0])]
    plan = Retention(keep_within=100.0).plan(infos, now=NOW)
    assert plan.delete == [], plan


def test_lookups_after_retention_decode_each_record_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """After retention most kept checkpoints' parents are gone, and naming a parent asks whether a rewrite
    replaced it: that went through every record, decoded, for each checkpoint looked up (1.8 s a lookup at
    10,000 kept). Lookups now read the records through the listing's memo, decoding each once per handle; a
    rewrite's replacement is still found by its old id and named as the parent."""
    from deltackpt import index as index_module
    from deltackpt import store as store_module

    with Store(tmp_path / "s") as s:
        for step in range(40):
            s.save({"w": torch.full((8,), float(step))}, step=step)
        s.retain(Retention(keep_last=2, keep_every=4))
        kept = [i.step for i in s.list()]
        assert len(kept) >= 10 and kept[-2:] == [38, 39]
        old = s.info(38)
        s.rewrite({"w": torch.zeros(8)}, id=old.id)
        decoded = []
        real = index_module.record_at
        for module in (index_module, store_module):
            monkeypatch.setattr(module, "record_at", lambda *a: decoded.append(a[0]) or real(*a))
        for _ in range(3):
            infos = [s.info(step) for step in kept]
        # each lookup decodes its record and its parent's (when kept); every record once more at most
        assert len(decoded) <= 2 * 3 * len(kept) + len(kept) + 1
        new = s.info(38)
        assert new.id != old.id and s.info(id=old.id) == new
        assert infos[-1].parent == new.id == s.info(39).parent  # (the rewritten parent, by its new id)


def test_lookups_after_retention_read_the_records_once_between_commits(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """Looking up a kept checkpoint whose parent retention deleted asks whether a rewrite replaced the parent,
    and that read every record of the index at each lookup: one lookup per kept checkpoint (a DCP root's
    listing, a tool walking the history) was quadratic, 2,500 lookups 12.8 s on a store thinned to 2,500 of
    5,000. The answer is kept until the index commits again, and a rewrite's replacement is still found."""
    from deltackpt.index import Index

    with Store(tmp_path / "s") as s:
        for step in range(60):
            s.save({"w": torch.full((8,), float(step))}, step=step)
        s.retain(Retention(keep_every=2))
        kept = s.list()
        assert len(kept) == 31  # (every other step, and the newest)
        reads = []
        real = Index.raw_records
        monkeypatch.setattr(Index, "raw_records", lambda self: reads.append(1) or real(self))
        assert [s.info(id=i.id) for i in kept] == kept
        assert len(reads) <= 1  # (one per lookup, before)
        old = kept[-2]  # (the parent of the newest)
        new = s.rewrite({"w": torch.zeros(8)}, id=old.id)
        assert s.info(id=old.id) == new and s.info(kept[-1].step).parent == new.id
