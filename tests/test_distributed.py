"""deltackpt.distributed: DCP sharded saves of many ranks, resharding loads, incremental steps, commit point.

Multi-rank tests run real gloo process groups on the CPU (tests/dcp_worker.py, one process per rank).
"""

from __future__ import annotations

import fractions
import importlib
import inspect
import os
import re
import shutil
import subprocess
import sys
import threading
import time
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

import deltackpt
from deltackpt import distributed
from deltackpt.distributed import DeltaStorageReader, DeltaStorageWriter
from deltackpt.errors import FormatVersionError

WORKER = Path(__file__).resolve().parent / "dcp_worker.py"
sys.path.insert(0, str(WORKER.parent))
from conftest import DCP_LOADS_TOP_LEVEL_VALUES, DCP_NO_DIST, optimizers_take_names  # noqa: E402
from dcp_worker import COLS, ROWS, expected  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")

#: tests of dcp.async_save in a process without a process group, which torch 2.3's cannot run
async_without_group = pytest.mark.skipif(not DCP_NO_DIST, reason="torch < 2.4: dcp.async_save needs an initialized "
                                         "process group")
#: tests that read back top-level non-tensor values through dcp.load, which torch 2.3's drops (conftest)
loads_values = pytest.mark.skipif(not DCP_LOADS_TOP_LEVEL_VALUES, reason="torch < 2.4: dcp.load does not write "
                                  "top-level non-tensor values back into the caller's state dict")


def _has(module: str, name: str) -> bool:
    """Whether this torch's ``module`` has ``name``."""
    try:
        return hasattr(importlib.import_module(module), name)
    except ImportError:
        return False


def ranks(mode: str, root: Path, tmp_path: Path, world: int = 2, *extra: Any,
          timeout: float = 120) -> list[subprocess.CompletedProcess[str]]:
    """Run ``world`` ranks of tests/dcp_worker.py in one gloo group; return their results."""
    init = tmp_path / f"pg-{mode}-{len(list(tmp_path.glob('pg-*')))}"
    procs = [subprocess.Popen([sys.executable, str(WORKER), mode, str(r), str(world), str(root), str(init),
                               *map(str, extra)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for r in range(world)]
    out = []
    for p in procs:
        try:
            so, se = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            p.kill()
            so, se = p.communicate()
        out.append(subprocess.CompletedProcess(p.args, p.returncode, so, se))
    return out


def load_full(root: Path, step: int | None = None) -> dict[str, Any]:
    """The checkpoint loaded by one process without a process group, into unsharded tensors."""
    state = {"w": torch.zeros(ROWS, COLS), "b": torch.zeros(COLS, dtype=torch.float64), "step": 0, "tag": "",
             "sched": {"lr": [0.0, 0.0], "warmup": False}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(state, storage_reader=DeltaStorageReader(root, step))
    return state


def assert_state(got: dict[str, Any], want: dict[str, Any]) -> None:
    assert torch.equal(got["w"], want["w"]) and torch.equal(got["b"], want["b"])
    if DCP_LOADS_TOP_LEVEL_VALUES:  # (torch 2.3's dcp.load drops them: the tensors alone say which step loaded)
        assert {k: got[k] for k in ("step", "tag", "sched")} == {k: want[k] for k in ("step", "tag", "sched")}


@loads_values  # (each loading rank checks the step it loaded)
@pytest.mark.plumbing
def test_two_ranks_save_shards_and_load_resharded(tmp_path: Path) -> None:
    """Two ranks save a row-sharded matrix at steps 1 and 2; one process loads the full matrix of either step,
    and two ranks load it sharded by columns. Each rank's shards went into its own store."""
    root = tmp_path / "ckpt"
    for step in (1, 2):
        for r in ranks("save", root, tmp_path, 2, step):
            assert r.returncode == 0, r.stderr[-3000:]
    assert sorted(p.name for p in root.iterdir()) == ["meta", "rank-00000", "rank-00001"]
    assert_state(load_full(root), expected(2))
    assert_state(load_full(root, step=1), expected(1))
    for r in ranks("load", root, tmp_path, 2):
        assert r.returncode == 0 and "ok" in r.stdout, r.stdout + r.stderr[-3000:]
    for rank in (0, 1):
        with deltackpt.Store(root / f"rank-{rank:05d}") as s:
            assert [c.step for c in s.list()] == [1, 2]
            assert s.verify().problems == []


@loads_values
@pytest.mark.plumbing
def test_two_ranks_that_load_an_older_step_save_a_branch_from_it(tmp_path: Path) -> None:
    """Each rank's store, and the meta store, descend from the loaded step's checkpoints at the next save, and
    from that save at the one after it."""
    root = tmp_path / "ckpt"
    results = ranks("branch", root, tmp_path)
    assert all(r.returncode == 0 for r in results), [r.stderr[-2000:] for r in results]
    assert distributed.steps(root) == [0, 1, 2, 3, 2, 3]
    assert_state(load_full(root), expected(3))
    for store in ("meta", "rank-00000", "rank-00001"):
        with deltackpt.Store(root / store) as s:
            ids = [i.id for i in s.list()]
            assert [i.step for i in s.list()] == [0, 1, 2, 3, 2, 3]
            assert [i.parent for i in s.list()] == [None, *ids[:3], ids[1], ids[4]], store


@pytest.mark.plumbing
def test_a_crash_at_the_commit_leaves_the_previous_step_newest(tmp_path: Path) -> None:
    """The coordinator is killed (SIGKILL) where it would commit step 2: every rank's shards of step 2 are in
    their stores, yet the newest DCP checkpoint is step 1, intact, and step 2 can be saved again."""
    root = tmp_path / "ckpt"
    for r in ranks("save", root, tmp_path, 2, 1):
        assert r.returncode == 0, r.stderr[-3000:]
    died = ranks("die", root, tmp_path, 2, 2, timeout=60)
    assert died[0].returncode == -9, died[0].stderr[-3000:]
    assert_state(load_full(root), expected(1))
    with pytest.raises(CheckpointException, match="no checkpoint at step 2"):  # DCP wraps the reader's errors
        load_full(root, step=2)
    from deltackpt import distributed

    assert distributed.prune(root) == 0  # the dead save's shards are each rank's newest: maybe in progress
    for r in ranks("save", root, tmp_path, 2, 2):
        assert r.returncode == 0, r.stderr[-3000:]
    assert_state(load_full(root), expected(2))
    assert distributed.prune(root) == 2  # now committed over: one per rank
    for rank in (0, 1):
        with deltackpt.Store(root / f"rank-{rank:05d}") as s:
            assert [c.step for c in s.list()] == [1, 2]
    assert_state(load_full(root, step=1), expected(1))
    assert_state(load_full(root), expected(2))


@loads_values
@pytest.mark.plumbing
def test_ranks_that_load_the_newest_while_a_step_commits_do_not_mix_steps(tmp_path: Path) -> None:
    """Two ranks load the newest DCP checkpoint; step 2 commits after rank 0 read step 1's metadata and before
    rank 1 reads. Before, each rank loaded its own newest and dcp.load returned a state mixed of steps 1 and 2;
    now the load fails on every rank, naming the cause, and loads again fine."""
    root = tmp_path / "ckpt"
    for r in ranks("save", root, tmp_path, 2, 1):
        assert r.returncode == 0, r.stderr[-3000:]
    init = tmp_path / "pg-race"
    procs = [subprocess.Popen([sys.executable, str(WORKER), "load-race", str(r), "2", str(root), str(init)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in range(2)]
    try:
        deadline = time.monotonic() + 120
        while not Path(f"{root}.read").exists():
            assert time.monotonic() < deadline and all(p.poll() is None for p in procs), "rank 0 never read"
            time.sleep(0.02)
        for r in ranks("save", root, tmp_path, 2, 2):
            assert r.returncode == 0, r.stderr[-3000:]
        Path(f"{root}.go").touch()
        outs = [p.communicate(timeout=120) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for p, (out, err) in zip(procs, outs):
        assert p.returncode != 0 and "loaded step" not in out, out + err[-3000:]
        assert "different DCP checkpoints" in err, err[-3000:]
    for r in ranks("load", root, tmp_path, 2):
        assert r.returncode == 0 and "loaded step 2: ok" in r.stdout, r.stdout + r.stderr[-3000:]


@pytest.mark.plumbing
@pytest.mark.skipif(not DCP_NO_DIST, reason="torch < 2.4: dcp.save has no no_dist, for a rank of a process group "
                    "to save alone")
def test_ranks_that_save_alone_into_one_root_are_warned(tmp_path: Path) -> None:
    """dcp.save(no_dist=True) on every rank of a job: each process saves as rank 0, into the same rank store, and
    commits the step with its own shards, replacing the others'. It cannot be told from a process group of
    the process's own (legitimate with a root of its own), so it is a warning, on the ranks other than 0."""
    out = ranks("no-dist", tmp_path / "root", tmp_path)
    assert all(r.returncode == 0 for r in out), [r.stderr[-2000:] for r in out]
    assert [r.stdout.split()[-1] for r in out] == ["quiet", "warned"]


@pytest.mark.skipif(not hasattr(dcp.utils._DistWrapper(None, False, 0), "global_coordinator_rank"),
                    reason="torch 2.3's DCP takes the coordinator's rank in the group for a global rank: a save "
                    "with a process group without global rank 0 cannot run")
def test_ranks_that_save_with_a_subgroup_of_the_job_are_not_warned(tmp_path: Path) -> None:
    """Ranks 1 and 2 of 3 saving with a process group of those two: the subgroup's rank 0 (the job's rank 1) was
    warned that it saved alone, as rank 0 of its own, replacing other processes' shards. It saves with rank 2,
    whose shards are in the step beside its own."""
    root = tmp_path / "root"
    out = ranks("subgroup", root, tmp_path, 3)
    assert all(r.returncode == 0 for r in out), [r.stderr[-2000:] for r in out]
    assert [r.stdout.split()[-1] if r.stdout else "" for r in out] == ["", "quiet", "quiet"]
    assert [i.ranks for i in distributed.summary(root)] == [2]


def test_ranks_that_disagree_on_the_root_or_the_step_commit_nothing(tmp_path: Path) -> None:
    """Ranks saving into different roots (a relative root and other working directories, node-local disks) each
    returned from dcp.save, and the coordinator committed a step naming a rank checkpoint its root lacks: the
    newest step could not load. Ranks saving different steps were committed as the coordinator's step. Both
    are refused now, and the coordinator's root holds no step."""
    root = tmp_path / "ckpt"
    for kind, words in (("roots", "is not committed: rank 1's shards"),
                        # (a DeltackptError, as the README says, inside DCP's CheckpointException; was ValueError)
                        ("steps", "DeltackptError: rank 1 saves step 2, but the coordinator commits step 1")):
        results = ranks("misuse", root, tmp_path, 2, kind)
        for r in results:
            assert r.returncode == 0, r.stderr[-3000:]
        assert any(words in r.stdout for r in results), [r.stdout for r in results]
        assert all(r.stdout.startswith("refused:") for r in results), [r.stdout for r in results]
        coordinator = root.parent / f"{root.name}-r0" if kind == "roots" else root
        assert not (coordinator / "meta" / "STORE").exists() or distributed.steps(coordinator) == []


def test_loading_ranks_that_ask_for_different_steps_are_told_so(tmp_path: Path) -> None:
    """The message said a save had committed while the ranks read the newest, and named neither step."""
    results = ranks("misuse", tmp_path / "ckpt", tmp_path, 2, "loads")
    for r in results:
        assert r.returncode == 0, r.stderr[-3000:]
    assert any("asked for different DCP checkpoints" in r.stdout and "rank 0 step=1, rank 1 step=2" in r.stdout
               for r in results), [r.stdout for r in results]


def test_a_plain_store_given_as_a_root_is_named_so(tmp_path: Path) -> None:
    """distributed.steps(), summary() and DeltaStorageReader said "no deltackpt store at X/meta" of a plain
    store or a rank's store; they say what it is, as the writer and the dcp command do."""
    with deltackpt.Store(tmp_path / "plain") as s:
        s.save({"x": torch.ones(3)}, step=1)
    for call in (lambda: distributed.steps(tmp_path / "plain"), lambda: distributed.summary(tmp_path / "plain"),
                 lambda: DeltaStorageReader(tmp_path / "plain").read_metadata()):
        with pytest.raises(deltackpt.CheckpointNotFoundError,
                           match="plain is a deltackpt store, not a sharded \\(DCP\\) checkpoint root"):
            call()
    with pytest.raises(deltackpt.CheckpointNotFoundError, match="no deltackpt store at .*nothing/meta"):
        distributed.steps(tmp_path / "nothing")
    # stores() raised a bare FileNotFoundError / NotADirectoryError
    (tmp_path / "file").write_bytes(b"x")
    for path, why in ((tmp_path / "nothing", "it does not exist"), (tmp_path / "file", "it is not a directory")):
        with pytest.raises(deltackpt.CheckpointNotFoundError, match=f"not a sharded \\(DCP\\) checkpoint root: {why}"):
            distributed.stores(path)


@loads_values
def test_large_bytes_values_are_chunked_and_plain_values_stay_out_of_the_index(tmp_path: Path) -> None:
    """A 1 MiB ``bytes`` value that does not change between steps is written once (before, plain values were
    kept whole in each rank checkpoint's metadata, in its index record and its manifest, and counted as 0 bytes
    written); plain values are in the checkpoint's state, not its metadata; both load back exactly."""
    from deltackpt import distributed

    root = tmp_path / "ckpt"
    blob = os.urandom(1 << 20)
    w = DeltaStorageWriter(root)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for step in (1, 2):
            w.step = step
            dcp.save({"x": torch.full((1000,), float(step)), "blob": blob, "small": b"abc",
                      "cfg": {"lr": 0.1 * step, "name": "run", "betas": (0.9, 0.95)}}, storage_writer=w)
    w.close()
    first, second = distributed.summary(root)
    assert first.written_bytes > len(blob) and second.written_bytes < len(blob) / 20, (first, second)
    with deltackpt.Store(root / "rank-00000") as s:
        assert all(i.metadata is None for i in s.list())
    target: dict[str, Any] = {"x": torch.zeros(1000), "blob": b"", "small": b"", "cfg": {"lr": 0.0, "name": "",
                                                                                          "betas": (0.0, 0.0)}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(target, storage_reader=DeltaStorageReader(root, step=1))
    assert target["blob"] == blob and target["small"] == b"abc" and torch.equal(target["x"], torch.ones(1000))
    assert target["cfg"] == {"lr": 0.1, "name": "run", "betas": (0.9, 0.95)}


@loads_values
@pytest.mark.parametrize("fmt", [1, 2])
def test_a_root_of_an_older_meta_format_still_loads(tmp_path: Path, fmt: int) -> None:
    """Format 2 kept the whole DCP metadata document in the meta checkpoint's metadata; format 1 also kept the
    plain values of a rank checkpoint in its metadata. A root laid out so (rewritten into that shape here,
    through the public API) still loads and lists, and deleting its step deletes the rank checkpoint; a format
    newer than the reader's is refused."""
    from deltackpt import distributed

    root = tmp_path / "ckpt"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"x": torch.arange(10.0), "step": 7, "tag": "v1"}, storage_writer=DeltaStorageWriter(root, step=7))
    if fmt == 1:
        with deltackpt.Store(root / "rank-00000") as s:
            for info in s.list():
                state = s.load(id=info.id)
                objects = state.pop(distributed._OBJECTS)
                state.pop(distributed._BLOBS)
                s.rewrite(state, id=info.id, metadata={distributed._OBJECTS: objects})
    with deltackpt.Store(root / "meta") as meta:
        info = meta.latest()
        assert info is not None and info.metadata["format"] == 3 == distributed.META_FORMAT - 1  # (no trees)
        doc = distributed._full_doc(meta, info.id, "test")
        meta.rewrite({}, id=info.id, metadata=dict(doc, format=fmt))
    assert distributed.steps(root) == [7] and [s.ranks for s in distributed.summary(root)] == [1]
    assert distributed.verify_names(root) == []
    target = {"x": torch.zeros(10), "step": 0, "tag": ""}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(target, storage_reader=DeltaStorageReader(root))
    assert torch.equal(target["x"], torch.arange(10.0)) and target["step"] == 7 and target["tag"] == "v1"
    with deltackpt.Store(root / "meta") as meta:
        info = meta.latest()
        meta.rewrite({}, id=info.id, metadata=dict(info.metadata, format=distributed.META_FORMAT + 1))
    with pytest.raises(CheckpointException, match="newer than this reader"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(target, storage_reader=DeltaStorageReader(root))
    with pytest.raises(FormatVersionError, match="newer than this reader"):
        distributed.summary(root)
    with deltackpt.Store(root / "meta") as meta:
        meta.rewrite({}, id=meta.latest().id, metadata=dict(doc, format=fmt))
    distributed.delete(root, 7)
    with deltackpt.Store(root / "rank-00000") as s:
        assert s.list() == []


@pytest.mark.skipif(not DCP_LOADS_TOP_LEVEL_VALUES, reason="torch < 2.4: DCP saves non-tensor values from the "
                    "coordinator rank only, so rank 1's RNG states are never written")
@pytest.mark.plumbing
def test_two_ranks_save_and_load_their_rng_states_without_pickle(tmp_path: Path) -> None:
    """Each rank's NumPy RNG state and a tuple holding a tensor, beside sharded tensors: each lies in its rank's
    store as a state tree, and loads back on each rank without allow_pickle (its draws repeat). So do all of a
    rank's RNG states as the README's recipe saves them (``rng_state()`` under a key of the rank's own)."""
    root = tmp_path / "ckpt"
    for r in ranks("rng", root, tmp_path, 2, 4):
        assert r.returncode == 0 and "ok" in r.stdout, r.stdout + r.stderr[-3000:]
    kinds = item_kinds(root)
    assert {k: kinds[k] for k in kinds if k.startswith(("np_rng", "pair"))} == dict.fromkeys(
        ["np_rng_0", "np_rng_1", "pair_0", "pair_1"], "tree")
    for rank in (0, 1):
        with deltackpt.Store(root / f"rank-{rank:05d}") as s:
            assert f"np_rng_{rank}@" in s.load()[distributed._TREES]


@pytest.mark.skipif("dedup_save_to_lowest_rank" not in inspect.signature(dcp.DefaultSavePlanner).parameters,
                    reason="this torch's DefaultSavePlanner has no dedup_save_to_lowest_rank (torch 2.4+)")
@pytest.mark.plumbing
def test_ranks_with_nothing_to_save_commit_no_checkpoint(tmp_path: Path) -> None:
    """Plain tensors and values, saved by two ranks: DCP plans every item for the coordinator, so rank 1 has
    nothing to write and commits nothing (before, it committed an empty checkpoint per step that no step named,
    which deleting the steps never removed). Deleting every step then leaves no checkpoint in any store."""
    from deltackpt import distributed

    root = tmp_path / "ckpt"
    for step in (1, 2, 3):
        for r in ranks("replicated", root, tmp_path, 2, step):
            assert r.returncode == 0, r.stderr[-3000:]
    assert not (root / "rank-00001").exists()
    assert [i.ranks for i in distributed.summary(root)] == [1, 1, 1]
    target = {"x": torch.zeros(1000), "step": 0}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(target, storage_reader=DeltaStorageReader(root, step=2))
    assert torch.equal(target["x"], torch.full((1000,), 2.0)) and target["step"] == 2
    for step in (1, 2, 3):
        distributed.delete(root, step)
    for store in root.glob("rank-*"):
        with deltackpt.Store(store) as s:
            assert s.list() == [], store


def test_prune_keeps_the_newest_checkpoint_of_a_rank_that_no_step_names(tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """A rank store none of whose checkpoints a DCP checkpoint names (every step deleted by retention, or a rank
    a restart with fewer ranks left): prune deletes all but its newest, which may be a save in progress. Once it
    deleted all but the newest with names read before the listing, so that with a step committing meanwhile it
    deleted the shards of that committed step; then it kept every one (a restart with fewer ranks leaked the old
    ranks' shards for good). The names are now read again after the listing."""
    from deltackpt import distributed

    root = tmp_path / "ckpt"

    class Unfinished(DeltaStorageWriter):  # the rank's shards commit; the step's commit never comes
        def finish(self, metadata: Any, results: Any) -> None:
            raise RuntimeError("stopped before the commit")

    def save(step: int, writer: type[DeltaStorageWriter] = DeltaStorageWriter) -> None:
        w = writer(root, step=step)
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                dcp.save({"x": torch.full((1000,), float(step))}, storage_writer=w)
        except CheckpointException:
            assert writer is Unfinished
        finally:
            w.close()

    save(0)
    save(1)
    distributed.delete(root, 0)
    distributed.delete(root, 1)
    save(2, Unfinished)
    save(3, Unfinished)
    assert distributed.prune(root) == 1
    with deltackpt.Store(root / "rank-00000") as s:
        assert [c.step for c in s.list()] == [3]
    # a step commits, and the next one's shards, between prune's read of the steps and its look at the rank store
    real = distributed._existing
    done: list[bool] = []

    def late(path: Path, what: str, **kwargs: Any) -> deltackpt.Store:
        if path.name == "rank-00000" and not done:
            done.append(True)
            save(5)
            save(6, Unfinished)
        return real(path, what, **kwargs)

    with deltackpt.Store(root / "rank-00000") as s:
        s.delete(3)
    monkeypatch.setattr(distributed, "_existing", late)
    assert distributed.prune(root) == 0
    monkeypatch.setattr(distributed, "_existing", real)
    assert distributed.steps(root) == [5]
    target = {"x": torch.zeros(1000)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(target, storage_reader=DeltaStorageReader(root, step=5))
    assert torch.equal(target["x"], torch.full((1000,), 5.0))
    assert distributed.prune(root) == 0  # step 6's shards are the newest: maybe in progress


def test_incremental_steps_write_only_what_changed(tmp_path: Path) -> None:
    """One reused writer: a step that changes a few elements writes a small fraction of the first step."""
    root = tmp_path / "ckpt"
    g = torch.Generator().manual_seed(1)
    state = {"big": torch.randn(1 << 20, generator=g), "other": torch.randn(1000, 300, generator=g)}
    w = DeltaStorageWriter(root, step=0)
    written = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for step in range(3):
            w.step = step
            state["big"][step * 1000:(step + 1) * 1000] += 1.0
            dcp.save(state, storage_writer=w)
            with deltackpt.Store(root / "rank-00000") as s:
                written.append(s.info(step).written_bytes)
    w.close()
    assert written[1] < written[0] / 10 and written[2] < written[0] / 10, written
    target = {"big": torch.zeros(1 << 20), "other": torch.zeros(1000, 300)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(target, storage_reader=DeltaStorageReader(root))
    assert torch.equal(target["big"], state["big"]) and torch.equal(target["other"], state["other"])


@loads_values
def test_values_that_need_pickle_load_only_when_allowed(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"x": torch.ones(3), "frac": fractions.Fraction(1, 3), "n": 5},
                 storage_writer=DeltaStorageWriter(root, step=0))
        target: dict[str, Any] = {"x": torch.zeros(3), "frac": None, "n": 0}
        with pytest.raises(CheckpointException) as caught:
            dcp.load(target, storage_reader=DeltaStorageReader(root))
        exc = caught.value.failures[0][0]
        assert isinstance(exc, deltackpt.UnsafeLoadError) and "'frac'" in str(exc)
        dcp.load(target, storage_reader=DeltaStorageReader(root, allow_pickle=True))
    assert target["frac"] == fractions.Fraction(1, 3) and target["n"] == 5 and torch.equal(target["x"], torch.ones(3))


class Opaque:
    """A class instance: no state tree holds it, so DCP's pickle of it is kept (and needs allow_pickle)."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __eq__(self, other: object) -> bool:
        return type(other) is Opaque and other.n == self.n


@loads_values
def test_values_that_need_pickle_load_only_when_allowed_even_beside_arrays(tmp_path: Path) -> None:
    """A class instance stays pickled, alone or in a tuple beside an array (the tuple cannot be stored without
    it): the load needs allow_pickle, and with it loads both as they were."""
    root = tmp_path / "ckpt"
    state = {"x": torch.ones(3), "obj": Opaque(4), "mixed": (np.arange(3), Opaque(5)), "rng": np.random.get_state()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(state, storage_writer=DeltaStorageWriter(root, step=0))
        assert item_kinds(root) == {"x": "tensor", "obj": "pickled", "mixed": "pickled", "rng": "tree"}
        target: dict[str, Any] = {"x": torch.zeros(3), "obj": None, "mixed": None, "rng": None}
        with pytest.raises(CheckpointException) as caught:
            dcp.load(target, storage_reader=DeltaStorageReader(root))
        exc = caught.value.failures[0][0]
        assert isinstance(exc, deltackpt.UnsafeLoadError) and re.search("'obj'|'mixed'", str(exc))
        dcp.load(target, storage_reader=DeltaStorageReader(root, allow_pickle=True))
    assert target["obj"] == Opaque(4) and target["mixed"][1] == Opaque(5)
    assert np.array_equal(target["mixed"][0], np.arange(3))


def item_kinds(root: Path, step: int | None = None) -> dict[str, str]:
    """fqn -> the kind its item is stored as, in the DCP checkpoint of ``step`` (the newest) under ``root``."""
    with deltackpt.Store(root / "meta") as meta:
        doc = distributed._full_doc(meta, meta.info(step).id if step is not None else meta.latest().id, "test")
    return {it[0]: it[6] for it in doc["items"]}


def same_value(a: Any, b: Any, where: str = "") -> None:
    """``a`` and ``b`` are alike: the same types all the way down, arrays of the same dtype (byte order
    included), shape and values, tensors of the same dtype, shape, requires_grad and values."""
    assert type(a) is type(b), (where, type(a), type(b))
    if isinstance(a, np.ndarray):
        assert (a.dtype.str, a.shape) == (b.dtype.str, b.shape) and np.array_equal(a, b), where
    elif isinstance(a, torch.Tensor):
        assert (a.dtype, a.shape, a.requires_grad) == (b.dtype, b.shape, b.requires_grad), where
        assert torch.equal(a.detach(), b.detach()), where
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            same_value(x, y, f"{where}[{i}]")
    elif isinstance(a, dict):
        assert list(a) == list(b), where
        for k in a:
            same_value(a[k], b[k], f"{where}.{k}")
    else:
        assert a == b, where


def values_state(step: int) -> dict[str, Any]:
    """A state of values that DCP pickles and a state tree holds: RNG states, arrays and tensors in tuples,
    dicts inside lists, a 0-d array, a set."""
    np.random.seed(step)
    np.random.random(3)
    g = torch.Generator().manual_seed(step)
    p = torch.nn.Parameter(torch.randn(2, 3, generator=g))
    return {"x": torch.full((4,), float(step)),
            "np_rng": np.random.get_state(),
            "torch_rng": (g.get_state(), step),
            "nested": ({"half": np.arange(6, dtype=np.float16).reshape(2, 3) * step,
                        "big_endian": (np.arange(3) + step).astype(">u4")},
                       [p, p, torch.ones(2, dtype=torch.bfloat16, requires_grad=True)]),
            "listed": [{"a": np.ones(2) * step}, (np.int64(step), torch.tensor(step))],
            "scalar": np.array(2.5 * step),
            "ids": {1, 2, step}}


@loads_values
def test_values_holding_arrays_load_without_pickle_as_dcp_gives_them(tmp_path: Path) -> None:
    """NumPy's RNG state, tensors and arrays inside tuples and lists: DCP pickles them, and the writer kept the
    pickle, so a resume needed allow_pickle=True. They are stored as state trees now (meta format 4), and load
    without pickle as DCP's own FileSystemWriter gives them back (types, dtypes, shapes, requires_grad; a tensor
    met twice is one object); the draws after np.random.set_state repeat. The root's tools handle them."""
    from deltackpt.cli import main

    root = tmp_path / "ckpt"
    w = DeltaStorageWriter(root)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for step in (1, 2):
            w.step = step
            dcp.save(values_state(step), storage_writer=w)
        w.step = 3
        dcp.save({"x": torch.zeros(4), "n": 3}, storage_writer=w)  # no trees: readable by format-3 readers
        w.close()
        dcp.save(values_state(1), checkpoint_id=tmp_path / "fs")
        want = values_state(0)
        dcp.load(want, checkpoint_id=tmp_path / "fs")
        got = values_state(0)
        dcp.load(got, storage_reader=DeltaStorageReader(root, step=1))  # (no allow_pickle)
    kinds = item_kinds(root, 1)
    assert "pickled" not in kinds.values() and kinds["np_rng"] == kinds["nested"] == "tree", kinds
    same_value(got, want)
    pair = got["nested"][1]
    assert pair[0] is pair[1] and type(pair[0]) is torch.nn.Parameter
    np.random.seed(1)
    np.random.random(3)
    draws = np.random.random(10)
    np.random.set_state(got["np_rng"])
    assert np.array_equal(np.random.random(10), draws)
    with deltackpt.Store(root / "meta") as meta:
        assert [i.metadata["format"] for i in meta.list()] == [4, 4, 3]
    with deltackpt.Store(root / "rank-00000") as s:
        trees = s.load(step=1)[distributed._TREES]
        assert trees["nested@"][0]["big_endian"].dtype.str == ">u4"  # (torch.load makes it native, as DCP's own)
        assert not any(t.key.startswith("pickled") for t in s.manifest(step=1).tensors)
    assert distributed.verify_names(root) == [] and [i.ranks for i in distributed.summary(root)] == [1, 1, 1]
    assert main(["dcp", str(root), "--verify"]) == 0
    distributed.delete(root, 1)
    assert distributed.prune(root) == 0 and distributed.steps(root) == [2, 3]
    got = values_state(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(got, storage_reader=DeltaStorageReader(root, step=2))
    dcp.save(values_state(2), checkpoint_id=tmp_path / "fs2")
    want = values_state(0)
    dcp.load(want, checkpoint_id=tmp_path / "fs2")
    same_value(got, want)


@loads_values
def test_a_reader_refuses_an_item_kind_it_does_not_know(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An item of a kind the reader does not know (a newer writer's, damage) is refused naming the item, by the
    load and by verify; it was read as a pickle (a KeyError). A reader of meta format 3 refuses a step with
    trees as newer, typed, and still loads a step without."""
    import json

    root = tmp_path / "ckpt"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"x": torch.ones(3), "n": 5, "rng": np.random.get_state()},
                 storage_writer=DeltaStorageWriter(root, step=1))
        dcp.save({"x": torch.ones(3), "n": 6}, storage_writer=DeltaStorageWriter(root, step=2))
    monkeypatch.setattr(distributed, "META_FORMAT", 3)
    with pytest.raises(CheckpointException, match="DCP metadata format 4 is newer than this reader's"):
        dcp.load({"x": torch.zeros(3), "n": 0, "rng": None}, storage_reader=DeltaStorageReader(root, step=1))
    target: dict[str, Any] = {"x": torch.zeros(3), "n": 0}
    dcp.load(target, storage_reader=DeltaStorageReader(root, step=2))
    assert target["n"] == 6
    monkeypatch.undo()
    with deltackpt.Store(root / "meta") as meta:
        info = meta.info(1)
        doc = json.loads(meta.load(id=info.id)[distributed._DOC].tobytes())
        doc["items"] = [[*it[:5], "frob" if it[0] == "n" else it[5], it[6]] for it in doc["items"]]
        meta.rewrite({distributed._DOC: np.frombuffer(json.dumps(doc).encode(), np.uint8)}, id=info.id,
                     metadata=info.metadata)
    unknown = "DCP checkpoint of step 1 in .*: DCP item 'n' has unknown kind 'frob'"
    with pytest.raises(deltackpt.CorruptManifestError, match=unknown):
        DeltaStorageReader(root, step=1).read_metadata()
    with pytest.raises(CheckpointException, match=unknown), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load({"x": torch.zeros(3), "n": 0, "rng": None}, storage_reader=DeltaStorageReader(root, step=1))
    assert any("DCP item 'n' has unknown kind 'frob'" in p for p in distributed.verify_names(root))


def test_missing_checkpoints_are_named(tmp_path: Path) -> None:
    with pytest.raises(deltackpt.CheckpointNotFoundError, match="no deltackpt store"):
        DeltaStorageReader(tmp_path / "nothing").read_metadata()
    root = tmp_path / "ckpt"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"x": torch.ones(3)}, storage_writer=DeltaStorageWriter(root, step=4))
    with pytest.raises(deltackpt.CheckpointNotFoundError, match="step 5"):
        DeltaStorageReader(root, step=5).read_metadata()
    with pytest.raises(ValueError, match="step"):
        DeltaStorageWriter(root).set_up_storage_writer(True)
    for bad, error in ((-1, ValueError), ("3", TypeError), (1.5, TypeError), (True, TypeError), (2**64, ValueError)):
        with pytest.raises(error, match="step"):  # refused when the save is set up, before any rank writes
            DeltaStorageWriter(root, step=bad).set_up_storage_writer(True)  # type: ignore[arg-type]
    (tmp_path / "file").write_bytes(b"")
    with pytest.raises(NotADirectoryError, match="file"):
        DeltaStorageWriter(tmp_path / "file", step=1).set_up_storage_writer(True)
    assert DeltaStorageReader.validate_checkpoint_id(root) and not DeltaStorageReader.validate_checkpoint_id(tmp_path)
    assert os.path.isdir(root / "rank-00000")


@pytest.mark.parametrize("how", ["delete", "retain"])
def test_deleting_steps_with_a_rank_store_that_cannot_be_read_deletes_nothing(tmp_path: Path, how: str) -> None:
    """A step's delete (``deltackpt dcp ROOT --rm``, ``keep ROOT``) whose rank store lost its index is refused
    before anything is deleted. Before, the meta checkpoints went first, then the rank store raised: the
    command failed, and the steps were gone."""
    from conftest import dir_snapshot

    from deltackpt import distributed

    root = tmp_path / "ckpt"
    _save_steps(root, (1, 2, 3))
    (root / "rank-00000" / "index" / "data.mdb").unlink()
    before = dir_snapshot(root)
    with pytest.raises(deltackpt.CorruptIndexError, match="rank-00000"):
        if how == "delete":
            distributed.delete(root, 1)
        else:
            distributed.retain(root, deltackpt.Retention(keep_last=1))
    assert dir_snapshot(root) == before and distributed.steps(root) == [1, 2, 3]


def test_steps_and_delete(tmp_path: Path) -> None:
    from deltackpt import distributed

    root = tmp_path / "ckpt"
    w = DeltaStorageWriter(root)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for step in (3, 4, 5):
            w.step = step
            dcp.save({"x": torch.full((100,), float(step))}, storage_writer=w)
        w.step = 4  # the same step again: both go
        dcp.save({"x": torch.full((100,), 4.5)}, storage_writer=w)
    w.close()
    assert distributed.steps(root) == [3, 4, 5, 4]
    distributed.delete(root, 4)
    assert distributed.steps(root) == [3, 5]
    with deltackpt.Store(root / "rank-00000") as s:
        assert [c.step for c in s.list()] == [3, 5]
    assert distributed.prune(root) == 0
    target = {"x": torch.zeros(100)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(target, storage_reader=DeltaStorageReader(root, step=3))
    assert torch.equal(target["x"], torch.full((100,), 3.0))
    with pytest.raises(deltackpt.CheckpointNotFoundError):
        distributed.delete(root, 4)
    with pytest.raises(CheckpointException, match="not a sharded checkpoint root"), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # an ordinary store is no DCP root: refused, nothing created in it
        dcp.save({"x": torch.ones(3)}, storage_writer=DeltaStorageWriter(root / "rank-00000", step=9))
    assert not (root / "rank-00000" / "meta").exists()
    shutil.rmtree(root / "rank-00000")  # a rank's store removed by hand: deleting a step still succeeds
    distributed.delete(root, 5)
    assert distributed.steps(root) == [3]


def test_retention_of_a_reused_writer_reads_each_step_manifest_once(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """A writer's retention goes by each kept step's metadata as its manifest holds it, and read every kept
    step's manifest at every save: a save's cost grew with the steps kept (2.4 s a save with 3,000 kept, 36 ms
    without retention). A reused writer now reads each step's manifest once; what keep_tagged keeps still
    holds."""
    from deltackpt import manifest

    root = tmp_path / "ckpt"
    w = DeltaStorageWriter(root, retention=deltackpt.Retention(keep_last=3))
    reads: list[str] = []
    real = manifest.read
    monkeypatch.setattr(manifest, "read", lambda d, cid, **kw: reads.append(cid) or real(d, cid, **kw))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for step in range(12):
            w.step = step
            w.metadata = {"tag": "best"} if step == 1 else None
            dcp.save({"x": torch.full((100,), float(step))}, storage_writer=w)
        w.close()
    assert distributed.steps(root) == [1, 9, 10, 11]
    tagged = distributed.summary(root)[0]
    assert tagged.step == 1 and tagged.metadata == {"tag": "best"}
    # step 1's meta manifest: read by retention once, not again at each of the 10 saves after it (12 reads before)
    assert reads.count(tagged.id) <= 3, reads.count(tagged.id)


def test_retention_of_a_reused_writer_decodes_the_step_records_once(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """A reused writer's retention lists the steps through the meta store handle it commits with, whose
    listing decodes only the records it has not seen: before, each save opened a handle of its own and decoded
    every kept step's record again (534 decodes over 20 saves with every step kept, growing with the square of
    the steps; 154 now)."""
    from deltackpt import index, store

    decodes: list[bytes] = []
    real = index.record_at
    for module in (index, store):
        monkeypatch.setattr(module, "record_at", lambda *a: decodes.append(a[0]) or real(*a))
    root = tmp_path / "ckpt"
    w = DeltaStorageWriter(root, retention=deltackpt.Retention(keep_last=100), gc=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for step in range(20):
            w.step = step
            dcp.save({"x": torch.full((100,), float(step))}, storage_writer=w)
        w.close()
    assert distributed.steps(root) == list(range(20))
    assert len(decodes) <= 10 * 20, len(decodes)


def test_retention_on_a_rank_that_does_not_commit_decodes_the_step_records_once(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A rank other than the coordinator has no meta store handle of its own to list the steps through: it
    opened a read-only one at each save, whose listing decoded every kept step's record again (250 decodes over
    20 saves, 900 over 40: the square of the steps). Its reused writer now keeps that handle open from save to
    save (3 decodes a save), and closes it with the writer."""
    from deltackpt import index, store

    root = tmp_path / "ckpt"
    coordinator = DeltaStorageWriter(root, retention=deltackpt.Retention(keep_last=100), gc=False)
    rank1 = DeltaStorageWriter(root, retention=deltackpt.Retention(keep_last=100), gc=False)
    shards = deltackpt.Store(distributed._rank_path(root, 1))
    decodes: list[bytes] = []
    real = index.record_at
    for module in (index, store):
        monkeypatch.setattr(module, "record_at", lambda *a: decodes.append(a[0]) or real(*a))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for step in range(20):
            coordinator.step = step
            dcp.save({"x": torch.full((100,), float(step))}, storage_writer=coordinator)
            shards.save({"y": torch.zeros(4)}, step=step)
            before = len(decodes)
            rank1._drop_unnamed(shards, 1)  # (what rank 1's write_data runs after its save)
            assert len(decodes) - before <= 5, (step, len(decodes) - before)
        reader = rank1._kept.reader
        assert reader is not None
        rank1.close()
        coordinator.close()
    shards.close()
    assert rank1._kept.reader is None
    with pytest.raises(deltackpt.DeltackptError, match="closed"):
        reader.list()


@async_without_group
def test_async_save(tmp_path: Path) -> None:
    """dcp.async_save through one reused writer: each step waited for before the next changes ``step``; its
    retention runs in the background save too."""
    from deltackpt import distributed

    root = tmp_path / "ckpt"
    w = DeltaStorageWriter(root, retention=deltackpt.Retention(keep_last=2))
    x = torch.randn(10_000, generator=torch.Generator().manual_seed(2))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for step in range(4):
            w.step = step
            x[step] += 1.0
            dcp.async_save({"x": x, "step": step}, storage_writer=w).result()
        w.close()
        target: dict[str, Any] = {"x": torch.zeros(10_000), "step": -1}
        dcp.load(target, storage_reader=DeltaStorageReader(root))
    assert target["step"] == 3 and torch.equal(target["x"], x)
    assert distributed.steps(root) == [2, 3]
    with deltackpt.Store(root / "rank-00000") as s:
        assert [c.step for c in s.list()] == [1, 2, 3]


@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="lists open files through /proc")
def test_a_writer_per_save_releases_its_stores_once_collected(tmp_path: Path) -> None:
    """DCP's usual pattern, and the module docstring's, makes a writer per save and never closes it: each one left
    its stores' files open (a pack held locked, which gc then skips, and the index), about 2.5 descriptors a save
    (a run of 400 saves hit a limit of 1024). A writer that is collected now releases the stores it opened."""
    root = tmp_path / "ckpt"
    x = torch.randn(10_000, generator=torch.Generator().manual_seed(0))

    def open_packs() -> int:
        links = []
        for fd in Path("/proc/self/fd").iterdir():
            try:
                links.append(os.readlink(fd))
            except OSError:
                continue
        return sum(1 for link in links if link.startswith(os.path.realpath(root)) and link.endswith(".pack"))

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for step in range(6):
            x[step] += 1.0
            dcp.save({"x": x}, storage_writer=DeltaStorageWriter(root, step=step), **DCP_NO_DIST)
        for t in threading.enumerate():  # (a collected writer's stores are closed on a thread of its own)
            if t.name == "deltackpt-release":
                t.join(30)
        assert open_packs() == 0
        x[6] += 1.0
        kept = DeltaStorageWriter(root, step=6)  # (a writer still held keeps its stores open, as before)
        dcp.save({"x": x}, storage_writer=kept, **DCP_NO_DIST)
        assert open_packs() > 0
        kept.close()
        assert open_packs() == 0
        target = {"x": torch.zeros(10_000)}
        dcp.load(target, storage_reader=DeltaStorageReader(root))
    assert distributed.steps(root) == list(range(7)) and torch.equal(target["x"], x)


_PROCESS_ASYNC = """
import os, sys, warnings
import torch, torch.distributed as dist, torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType
from deltackpt.distributed import DeltaStorageReader, DeltaStorageWriter
warnings.simplefilter("ignore")
root, init = sys.argv[1], sys.argv[2]
dist.init_process_group("gloo", init_method=f"file://{init}", rank=0, world_size=1)
group = dist.new_group(backend="gloo")
w = DeltaStorageWriter(root, step=0)
x = torch.randn(64, 4096, generator=torch.Generator().manual_seed(0))
dcp.save({"x": x}, storage_writer=w)  # in this process first: the writer then holds open stores
for step in range(1, 7):
    x[step] += 1.0
    w.step = step
    if step == 4:  # in this process again, between the background process's saves
        dcp.save({"x": x}, storage_writer=w)
        continue
    f = dcp.async_save({"x": x}, storage_writer=w, process_group=group,
                       async_checkpointer_type=AsyncCheckpointerType.PROCESS)
    getattr(f, "upload_completion", f).result()
x = torch.zeros_like(x)  # a rollback to step 3: the next save, in the background process, branches from it
dcp.load({"x": x}, storage_reader=DeltaStorageReader(root, step=3))
x[0] += 1.0
w.step = 4
f = dcp.async_save({"x": x}, storage_writer=w, process_group=group,
                   async_checkpointer_type=AsyncCheckpointerType.PROCESS)
getattr(f, "upload_completion", f).result()
w.close()
x[1] += 1.0  # again, saved by a writer that gets its root from dcp's checkpoint_id (in the background process)
dcp.load({"x": x}, storage_reader=DeltaStorageReader(root, step=2))
f = dcp.async_save({"x": x}, storage_writer=DeltaStorageWriter(step=5), checkpoint_id=root, process_group=group,
                   async_checkpointer_type=AsyncCheckpointerType.PROCESS)
getattr(f, "upload_completion", f).result()
from deltackpt import distributed
assert not distributed._LOADED, distributed._LOADED  # (handed over: a later save here descends from the newest)
torch.save(x, os.path.join(root, "..", "x.pt"))
dist.destroy_process_group()
os._exit(0)
"""


@pytest.mark.skipif(not _has("torch.distributed.checkpoint.state_dict_saver", "AsyncCheckpointerType"),
                    reason="this torch's dcp.async_save has no process-based saves (AsyncCheckpointerType)")
@pytest.mark.plumbing
def test_process_based_async_saves_share_the_stores_of_their_process(tmp_path: Path) -> None:
    """DCP's process-based async_save pickles the writer with every save (after an in-process save too, when it
    holds open stores) for a background process that lives for the run: the copies there share one store per
    rank, in one pack, rather than each save opening a store (and starting a pack) that nothing closes. Saves
    made in either process descend from the step saved before, whichever process saved it, and after a rollback
    loaded in the training process, from the step loaded."""
    root = tmp_path / "ckpt"
    done = subprocess.run([sys.executable, "-c", _PROCESS_ASYNC, str(root), str(tmp_path / "pg")],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    x = torch.load(tmp_path / "x.pt")
    assert distributed.steps(root) == [*range(7), 4, 5]
    assert torch.equal(load_full_x(root), x)
    for store in ("rank-00000", "meta"):
        with deltackpt.Store(root / store) as s:
            infos = s.list()
            assert [c.step for c in infos] == [*range(7), 4, 5]
            assert [c.parent for c in infos] == [None] + [c.id for c in infos[:-3]] + [infos[3].id, infos[2].id], \
                store
    # this process's, the daemon's, and the second writer's in the daemon
    assert len(list((root / "rank-00000" / "packs").glob("*.pack"))) <= 3


_FSDP2_IN_A_CHECKPOINTER = """
import sys, warnings
import torch, torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
import deltackpt
warnings.simplefilter("ignore")
dist.init_process_group("gloo", init_method=f"file://{sys.argv[2]}", rank=0, world_size=1)
model = fully_shard(torch.nn.Sequential(torch.nn.Linear(4, 4)), mesh=init_device_mesh("cpu", (1,)))
with deltackpt.Checkpointer(sys.argv[1], model=model, handle_signals=False) as ckpt:
    try:
        ckpt.save(1)
    except deltackpt.UnsupportedTypeError as exc:
        print(exc)
dist.destroy_process_group()
"""


@pytest.mark.skipif(not _has("torch.distributed.fsdp", "fully_shard"),
                    reason="this torch has no public FSDP2 (torch.distributed.fsdp.fully_shard, torch 2.6+)")
@pytest.mark.plumbing
def test_a_checkpointer_given_fsdp2_shards_points_to_dcp(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, "-c", _FSDP2_IN_A_CHECKPOINTER, str(tmp_path / "s"), str(tmp_path / "pg")],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert re.match(r"cannot store model\.0\.weight: it is a DTensor .*deltackpt\.distributed\.DeltaStorageWriter",
                    done.stdout), done.stdout


def load_full_x(root: Path) -> torch.Tensor:
    target = {"x": torch.zeros(64, 4096)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(target, storage_reader=DeltaStorageReader(root))
    return target["x"]


def test_backend_that_cannot_run_is_refused_by_the_constructors(tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """A DELTACKPT_BACKEND that cannot run raises its ImportError from DeltaStorageWriter() and
    DeltaStorageReader(), as the stores they open would, not wrapped in the CheckpointException of dcp.save or
    dcp.load (which ``except Exception`` does not catch), and before anything is created."""
    from deltackpt import kernel

    monkeypatch.setattr(kernel, "_impl", kernel._Unusable(ImportError("DELTACKPT_BACKEND must be 'native', ...")))
    with pytest.raises(ImportError, match="DELTACKPT_BACKEND"):
        DeltaStorageWriter(tmp_path / "ckpt", step=1)
    with pytest.raises(ImportError, match="DELTACKPT_BACKEND"):
        DeltaStorageReader(tmp_path / "ckpt")
    assert not (tmp_path / "ckpt").exists()


def test_ranks_of_one_host_share_its_cpus(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Under torchrun (LOCAL_WORLD_SIZE) a rank's store takes its share of the host's CPUs, not all of them;
    DELTACKPT_THREADS and an explicit threads= win. An empty DELTACKPT_THREADS (a launcher's unset template
    variable) is unset, as Store() reads it: it gave every rank all of the host's CPUs."""
    from deltackpt import config

    monkeypatch.delenv("DELTACKPT_THREADS", raising=False)
    monkeypatch.setattr(config, "cpu_count", lambda: 16)
    monkeypatch.setattr(os, "cpu_count", lambda: 16)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")

    def threads(name: str, **options: Any) -> int:
        w = DeltaStorageWriter(tmp_path / name, **options)
        try:
            return w._store(tmp_path / name / "rank-00000").threads
        finally:
            w.close()

    assert threads("a") == 4
    monkeypatch.setenv("DELTACKPT_THREADS", "")  # (empty is unset, as for a Store: not all 16 for each rank)
    assert threads("a2") == 4
    monkeypatch.delenv("DELTACKPT_THREADS")
    monkeypatch.setattr(config, "cpu_count", lambda: 2)  # pinned to 2 of the 16: those are this rank's
    assert threads("b") == 2
    monkeypatch.setenv("DELTACKPT_THREADS", "3")
    assert threads("c") == 3
    assert threads("d", threads=5) == 5


def test_the_cli_points_from_a_dcp_root_to_its_stores(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from conftest import dir_snapshot

    from deltackpt.cli import main

    root = tmp_path / "ckpt"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"x": torch.ones(3)}, storage_writer=DeltaStorageWriter(root, step=7))
    assert main(["ls", str(root)]) == 1
    assert "sharded (DCP) checkpoint root" in capsys.readouterr().err
    assert main(["ls", str(root / "meta")]) == 0
    assert "7" in capsys.readouterr().out
    assert not (root / "STORE").exists()
    # repair of the root names its stores (it said "not a deltackpt store (no readable STORE file)"), and dcp of
    # a plain store says it is one (it said "no deltackpt store at STORE/meta")
    before = dir_snapshot(root)
    assert main(["repair", str(root)]) == 1
    assert f"repair its stores one by one, 'deltackpt repair {root / 'meta'}'" in capsys.readouterr().err
    assert main(["dcp", str(root / "meta")]) == 1
    assert "is a deltackpt store, not a sharded (DCP) checkpoint root" in capsys.readouterr().err
    assert dir_snapshot(root) == before


def test_the_dcp_command_lists_deletes_prunes_and_collects(tmp_path: Path,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    from deltackpt import distributed
    from deltackpt.cli import main

    root = tmp_path / "ckpt"
    w = DeltaStorageWriter(root)
    x = torch.randn(300_000, generator=torch.Generator().manual_seed(3))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for step in (10, 20, 30):
            w.step = step
            x[:1000] += 1.0
            dcp.save({"x": x}, storage_writer=w)
    w.close()
    capsys.readouterr()
    assert main(["dcp", str(root)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [ln.split()[0] for ln in lines[-3:]] == ["10", "20", "30"]
    info = distributed.summary(root)
    assert [i.ranks for i in info] == [1, 1, 1] and info[0].logical_bytes == x.numel() * 4
    assert info[1].written_bytes < info[0].written_bytes / 5
    assert main(["dcp", str(root), "--rm", "10", "99"]) == 1  # refused whole: step 10 is not deleted either
    assert "no DCP checkpoint of step 99" in capsys.readouterr().err
    assert distributed.steps(root) == [10, 20, 30]
    assert main(["dcp", str(root), "--rm", "10", "20", "--prune", "--gc"]) == 0
    out = capsys.readouterr().out
    assert "deleted DCP checkpoint of step 10" in out and "pruned 0" in out and "gc rank-00000" in out
    assert distributed.steps(root) == [30]
    assert main(["dcp", str(root), "--verify"]) == 0
    assert "verify rank-00000: 1 checkpoint(s), OK" in capsys.readouterr().out
    pack = next((root / "rank-00000" / "packs").glob("*.pack"))
    data = bytearray(pack.read_bytes())
    data[len(data) // 2] ^= 0xFF  # damage a frame of the remaining step's shards
    pack.write_bytes(bytes(data))
    assert main(["dcp", str(root), "--verify"]) == 1
    assert "rank-00000: " in capsys.readouterr().out
    data[len(data) // 2] ^= 0xFF
    pack.write_bytes(bytes(data))
    target = {"x": torch.zeros(300_000)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(target, storage_reader=DeltaStorageReader(root))
    assert torch.equal(target["x"], x)


def test_the_dcp_command_with_a_left_over_rank_a_copied_store_and_a_missing_one(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A rank store no step names (left by a restart with fewer ranks): prune keeps only its newest. A copy of a
    rank store beside them (rank-00000.bak) is not one of the root's stores. With a rank's store gone, the
    listing and --rm still work (its sizes count nothing) and --verify names the steps that cannot load; before,
    every dcp command failed, --rm after deleting the step."""
    from deltackpt import distributed
    from deltackpt.cli import main

    root = tmp_path / "ckpt"
    _save_steps(root, (1, 2))
    with deltackpt.Store(root / "rank-00001") as s:  # what a second rank of an earlier run left
        for step in (7, 8, 9):
            s.save({"x": torch.full((10,), float(step))}, step=step)
    shutil.copytree(root / "rank-00000", root / "rank-00000.bak")
    shutil.copytree(root / "rank-00001", root / "rank-000001")  # (rank 1's name, zero-padded otherwise: not it)
    assert [p.name for p in distributed.stores(root)] == ["meta", "rank-00000", "rank-00001"]
    shutil.rmtree(root / "rank-000001")
    capsys.readouterr()
    assert main(["dcp", str(root), "--prune", "--gc", "--verify"]) == 0
    out = capsys.readouterr().out
    assert "pruned 2 rank checkpoint(s)" in out and "rank-00000.bak" not in out
    with deltackpt.Store(root / "rank-00001") as s:
        assert [c.step for c in s.list()] == [9]
    (root / "rank-00000").rename(tmp_path / "gone")
    assert main(["dcp", str(root)]) == 0
    out = capsys.readouterr().out
    assert [ln.split()[0] for ln in out.splitlines()[-3:-1]] == ["1", "2"]
    assert out.splitlines()[-1].startswith("rank 0's store is gone")
    assert main(["dcp", str(root), "--verify"]) == 1
    assert "but its store is gone: the step cannot load" in capsys.readouterr().out
    assert main(["dcp", str(root), "--rm", "1"]) == 0
    assert distributed.steps(root) == [2]
    capsys.readouterr()
    for where, what in ((tmp_path / "typo", "it does not exist"),
                        (root / "rank-00001" / "STORE", "it is not a directory")):
        assert main(["dcp", str(where)]) == 1  # a one-line error naming the path, not a bare [Errno 2]
        assert capsys.readouterr().err == f"deltackpt: error: {where} is not a sharded (DCP) checkpoint root: {what}\n"
    assert not (tmp_path / "typo").exists()


def test_model_and_optimizer_through_dcp_state_dict_helpers(tmp_path: Path) -> None:
    """The usual DCP round trip: get_state_dict of a model and its AdamW, save, load into fresh ones with
    set_state_dict; the optimizer's param_groups (non-tensor values) come back without pickle."""
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    def make() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
        return model, torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.05)

    torch.manual_seed(0)
    model, opt = make()
    for _ in range(3):
        model(torch.randn(8, 16)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    root = tmp_path / "ckpt"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        msd, osd = get_state_dict(model, opt)
        dcp.save({"model": msd, "optim": osd}, storage_writer=DeltaStorageWriter(root, step=3))
        model2, opt2 = make()
        model2(torch.randn(8, 16)).pow(2).mean().backward()
        opt2.step()  # optimizer state exists, so it can be loaded into
        msd2, osd2 = get_state_dict(model2, opt2)
        state = {"model": msd2, "optim": osd2}
        dcp.load(state, storage_reader=DeltaStorageReader(root))
        set_state_dict(model2, opt2, model_state_dict=state["model"], optim_state_dict=state["optim"])
    for a, b in zip(model.state_dict().values(), model2.state_dict().values()):
        assert torch.equal(a, b)
    s1, s2 = opt.state_dict(), opt2.state_dict()
    assert s1["param_groups"] == s2["param_groups"]
    for i in s1["state"]:
        for k in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(s1["state"][i][k], s2["state"][i][k]), (i, k)
    with deltackpt.Store(root / "rank-00000") as s:
        assert not any("pickled" in t.key for t in s.manifest().tensors)  # every non-tensor value was plain


@pytest.mark.parametrize("form", ["get_state_dict", "named_parameters", "numbered", "optimizer_only",
                                  "sgd_get_state_dict", "sgd_named_parameters", "bf16_get_state_dict"])
def test_every_step_dcp_saves_of_adamw_state_are_predicted_and_load_exactly(tmp_path: Path, form: str) -> None:
    """A rank's shards are flat (``fqn@offsets``), but DCP's flat state names the optimizer's moments, betas and
    parameters: weights and second moments are stored as predicted frames, as in an ordinary save (before, DCP
    saves of every-step AdamW state wrote about 1.8x the bytes), and every step loads back bit for bit. The
    optimizer state is keyed by parameter name (``get_state_dict``) or by number, with the names in the groups'
    ``param_names`` (an optimizer built from ``named_parameters()``). Without names (``numbered``), or with the
    optimizer saved alone at the top of the state, only second moments are predicted. SGD with momentum
    (``sgd_*``): the weights are predicted from the momentum buffers. ``bf16_*``: a model trained in bfloat16,
    its AdamW state bfloat16 too (the bfloat16 predictors)."""
    sgd = form.startswith("sgd_")
    dtype = torch.bfloat16 if form.startswith("bf16_") else torch.float32
    form = form.removeprefix("sgd_").removeprefix("bf16_")
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from deltackpt import codec
    from deltackpt.index import chunk_keys

    if form != "numbered" and not optimizers_take_names():
        pytest.skip("this torch's optimizers take no named_parameters() (param_names: torch 2.6+)")

    def make() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.GELU(), torch.nn.Linear(128, 64)).to(dtype)
        params = model.parameters() if form == "numbered" else model.named_parameters()
        if sgd:
            return model, torch.optim.SGD(params, lr=1e-3, momentum=0.9)
        # (bfloat16 at lr 1e-4: most weights move by less than half an ULP, and their XOR deltas win)
        lr = 1e-3 if dtype == torch.bfloat16 else 1e-4
        return model, torch.optim.AdamW(params, lr=lr, weight_decay=0.1, betas=(0.85, 0.995))

    def state_of(model: torch.nn.Module, opt: torch.optim.Optimizer) -> Any:
        if form == "get_state_dict":
            msd, osd = get_state_dict(model, opt)
            return {"model": msd, "optim": osd}
        if form == "optimizer_only":
            return opt.state_dict()
        return {"model": model.state_dict(), "optim": opt.state_dict()}

    torch.manual_seed(0)
    model, opt = make()
    saved: dict[int, dict[str, torch.Tensor]] = {}
    written: dict[bool, int] = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        writers = {p: DeltaStorageWriter(tmp_path / f"predict-{p}", step=0, chunk_size=4096, predict=p)
                   for p in (True, False)}
        for step in range(5):
            model(torch.randn(16, 64, dtype=dtype)).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
            state = state_of(model, opt)
            for w in writers.values():
                w.step = step
                dcp.save(state, storage_writer=w, **DCP_NO_DIST)
            saved[step] = {k: v.clone() for k, v in dcp_flat(state).items()}
        for w in writers.values():
            w.close()
        for p in (True, False):
            with deltackpt.Store(tmp_path / f"predict-{p}" / "rank-00000") as s:
                written[p] = sum(i.written_bytes for i in s.list()[2:])
                if p:
                    m = s.manifest(step=4)
                    locs = s.index.lookup_chunks(chunk_keys(*m.stored_chunks()))
                    predicted = {t.key for t in m.tensors if any(
                        (loc := locs.get(dg + ln.to_bytes(4, "big"))) is not None and loc.codec == codec.PREDICTED
                        for _, dg, ln in m.chunk_keys(t))}
        assert any("exp_avg_sq@" in k for k in predicted) != sgd, predicted
        named = form in ("get_state_dict", "named_parameters")
        assert any(".model." in k for k in predicted) == named, predicted
        # (SGD: Store.save of the same state writes 0.80 of the unpredicted bytes, the momentum buffers being most)
        assert written[True] < (0.9 if sgd else 0.8 if named else 1.0) * written[False], written
        for step, want in saved.items():
            model2, opt2 = make()
            model2(torch.randn(16, 64, dtype=dtype)).pow(2).mean().backward()
            opt2.step()
            state2 = state_of(model2, opt2)
            dcp.load(state2, storage_reader=DeltaStorageReader(tmp_path / "predict-True", step=step))
            got = dcp_flat(state2)
            assert sorted(got) == sorted(want)
            for k in want:
                assert got[k].dtype == want[k].dtype and torch.equal(
                    got[k].reshape(-1).view(torch.uint8), want[k].reshape(-1).view(torch.uint8)), (step, k)


def test_dcp_saves_follow_a_schedule_that_changes_the_betas(tmp_path: Path) -> None:
    """OneCycleLR cycles AdamW's beta1, and by the time of a save has set the next step's: the update the save
    holds used the betas of the save before. A rank checkpoint's skeleton holds no param_groups to read them
    from (a Store.save's does), so the writer keeps each rank's from its last save: DCP saves wrote 0.80 of
    their logical bytes against Store.save's 0.54 of the same get_state_dict output, now the same."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 64))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.01, total_steps=100)
    writer = DeltaStorageWriter(tmp_path / "dcp", chunk_size=4096)
    saved = {}
    with warnings.catch_warnings(), deltackpt.Store(tmp_path / "plain", chunk_size=4096) as plain:
        warnings.simplefilter("ignore")
        for step in range(6):
            model(torch.randn(16, 64)).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
            sched.step()
            msd, osd = get_state_dict(model, opt)
            writer.step = step
            dcp.save({"model": msd, "optim": osd}, storage_writer=writer, **DCP_NO_DIST)
            plain.save({"model": msd, "optim": osd}, step=step)
            saved[step] = {k: v.clone() for k, v in dcp_flat({"model": msd, "optim": osd}).items()}
        writer.close()
        want = sum(i.written_bytes for i in plain.list()[2:])
    with deltackpt.Store(tmp_path / "dcp" / "rank-00000") as s:
        got = sum(i.written_bytes for i in s.list()[2:])
    assert got < 1.05 * want, (got, want)
    for step, values in saved.items():
        state = {"model": {k: torch.zeros_like(v) for k, v in msd.items()}, "optim": osd}
        dcp.load(state, storage_reader=DeltaStorageReader(tmp_path / "dcp", step=step))
        got_values = dcp_flat(state)
        assert all(torch.equal(got_values[k], v) for k, v in values.items()), step


def dcp_flat(state: Any) -> dict[str, torch.Tensor]:
    """The tensors of a nested state by dotted path."""
    out: dict[str, torch.Tensor] = {}

    def walk(obj: Any, path: str) -> None:
        if isinstance(obj, torch.Tensor):
            out[path] = obj
        elif isinstance(obj, dict):
            for k, v in obj.items():
                walk(v, f"{path}.{k}")
        elif isinstance(obj, (list, tuple)):
            for i, v in enumerate(obj):
                walk(v, f"{path}.{i}")

    walk(state, "")
    return out


def test_a_rank_that_needs_some_rows_of_a_shard_decodes_only_their_chunks(tmp_path: Path) -> None:
    """A resharded load asks for slices of stored shards; the reader decodes only the chunks a slice reaches.
    Shown with a damaged chunk: a read of rows before it succeeds, a read of rows that reach it fails."""
    from torch.distributed.checkpoint.metadata import MetadataIndex
    from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, ReadItem

    from deltackpt.index import chunk_key

    root = tmp_path / "ckpt"
    big = torch.randn(256, 64, generator=torch.Generator().manual_seed(3))  # 64 KiB: 16 chunks of 4 KiB
    dcp.save({"big": big}, storage_writer=DeltaStorageWriter(root, step=1, chunk_size=4096))
    with deltackpt.Store(root / "rank-00000") as s:
        m = s.manifest()
        t = next(t for t in m.tensors if t.shape == [256, 64])
        _, digest, n = m.chunk_keys(t)[12]  # bytes 48 KiB .. 52 KiB: rows 192 .. 207
        loc = s.index.lookup_chunks([chunk_key(digest, n)])[chunk_key(digest, n)]
    with open(root / "rank-00000" / "packs" / f"{loc.pack_id}.pack", "r+b") as f:
        f.seek(loc.offset + loc.frame_len - 8)
        byte = f.read(1)
        f.seek(loc.offset + loc.frame_len - 8)
        f.write(bytes([byte[0] ^ 0xFF]))

    class Planner:
        def __init__(self, rows: int) -> None:
            self.out = torch.zeros(rows, 64)

        def resolve_tensor(self, req: ReadItem) -> torch.Tensor:
            return self.out

        def commit_tensor(self, req: ReadItem, tensor: torch.Tensor) -> None:
            pass

    def read_rows(first: int, rows: int) -> torch.Tensor:
        reader = DeltaStorageReader(root)
        reader.set_up_storage_reader(reader.read_metadata(), True)
        where = MetadataIndex("big", torch.Size([0, 0]))
        item = ReadItem(LoadItemType.TENSOR, MetadataIndex("big", torch.Size([first, 0])), torch.Size([0, 0]),
                        where, torch.Size([first, 0]), torch.Size([rows, 64]))
        planner = Planner(rows)
        reader.read_data(LoadPlan([item]), planner).wait()  # type: ignore[arg-type]
        return planner.out

    assert torch.equal(read_rows(0, 64), big[:64])  # chunks 0-3
    assert torch.equal(read_rows(100, 92), big[100:192])  # chunks 6-11: up to the damaged one
    with pytest.raises(deltackpt.CorruptChunkError, match="checksum"):
        read_rows(180, 20)  # reaches chunk 12


@pytest.mark.plumbing
def test_a_damaged_rank_store_is_named_with_the_step_by_the_load(tmp_path: Path) -> None:
    """A damaged frame of one rank's store fails the load with the store's own error (its type and attributes),
    naming the rank, its store and the step: the message named a pack and a rank checkpoint id only, which do not
    say which of the root's stores holds them. The same for the meta store's DCP metadata."""
    from deltackpt.index import chunk_key

    root = tmp_path / "ckpt"
    for r in ranks("save", root, tmp_path, 2, 1):
        assert r.returncode == 0, r.stderr[-3000:]

    def flip(store: Path) -> None:
        with deltackpt.Store(store) as s:
            m = s.manifest()
            t = max(m.tensors, key=lambda t: t.nbytes)
            _, digest, n = m.chunk_keys(t)[0]
            loc = s.index.lookup_chunks([chunk_key(digest, n)])[chunk_key(digest, n)]
        with open(store / "packs" / f"{loc.pack_id}.pack", "r+b") as f:
            f.seek(loc.offset + loc.frame_len - 8)
            byte = f.read(1)
            f.seek(loc.offset + loc.frame_len - 8)
            f.write(bytes([byte[0] ^ 0xFF]))

    flip(root / "rank-00001")
    with pytest.raises(CheckpointException) as caught:
        load_full(root)
    exc = caught.value.failures[0][0]
    assert isinstance(exc, deltackpt.CorruptChunkError) and exc.checkpoint is not None, exc
    assert str(exc).startswith(f"rank 1's shards of DCP step 1 ({root / 'rank-00001'}): frame checksum"), exc
    flip(root / "meta")
    with pytest.raises(CheckpointException, match=r"the metadata of DCP step 1 \(.*meta\): frame checksum"):
        load_full(root)


def _save_steps(root: Path, steps: Any) -> None:
    """Single-process DCP saves of dcp_worker's expected state, one per step."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        w = DeltaStorageWriter(root)
        for step in steps:
            w.step = step
            dcp.save(expected(step), storage_writer=w)
        w.close()


def test_the_dcp_listing_names_a_step_whose_rank_checkpoint_was_removed(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A rank checkpoint removed by hand (deltackpt rm --force on the rank store): the listing showed its step as
    any other, with 0 B, and only --verify said it cannot load. It now names it below the table and in --json
    ("unheld"), as --verify does."""
    import json

    from deltackpt.cli import main

    root = tmp_path / "ckpt"
    _save_steps(root, (1, 2))
    with deltackpt.Store(root / "rank-00000") as s:
        gone = next(i for i in s.list() if i.step == 2)
        s.delete(id=gone.id)
    capsys.readouterr()
    assert main(["dcp", str(root)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[-1] == (f"step 2 (DCP checkpoint {distributed.summary(root)[1].id}) names rank 0's checkpoint "
                         f"{gone.id}, but its store does not hold it: the step cannot load")
    assert main(["dcp", str(root), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["unheld"] == [lines[-1]]
    assert main(["dcp", str(root), "--verify"]) == 1
    assert capsys.readouterr().out.count("but its store does not hold it") == 1  # (once: --verify's line)


def test_prune_keeps_a_rank_checkpoint_a_rewrite_replaced(tmp_path: Path) -> None:
    """A rewritten rank checkpoint has a new id; the step still names the old one, which finds it. Prune counted
    only current ids as named and deleted it, so the step could no longer load."""
    from deltackpt import distributed

    root = tmp_path / "ckpt"
    _save_steps(root, [1])
    with deltackpt.Store(root / "rank-00000") as s:
        old = s.info(1)
        assert s.rewrite(s.load(id=old.id), id=old.id).id != old.id
    _save_steps(root, [2])
    assert distributed.prune(root) == 0
    for step in (1, 2):
        assert_state(load_full(root, step), expected(step))
    assert distributed.verify_names(root) == []


def test_the_root_tools_go_over_each_ranks_names_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """summary (the `deltackpt dcp ROOT` listing), verify_names and prune went over every step's rank
    checkpoints for each rank: ranks x steps x ranks pairs (1.3 million, then 2.6 million in verify_names, at 256
    ranks and 20 steps). Each pair is now gone over a few times. A root of 12 ranks is built as the writer
    writes one (format 3): each step's meta checkpoint names one checkpoint of each rank; rank 11's of the last
    step is removed, which verify_names reports."""
    from deltackpt import distributed

    ranks, steps = 12, 3
    root = tmp_path / "ckpt"
    ids = [[deltackpt.Store(distributed._rank_path(root, r)).save({"x": torch.full((4,), float(s))}, step=s).id
            for s in range(steps)] for r in range(ranks)]
    doc = np.frombuffer(b'{"version":"1","state_dict_metadata":{},"planner_data":{"paths":{}},"items":[]}', np.uint8)
    with deltackpt.Store(root / "meta") as meta:
        for s in range(steps):
            meta.save({"dcp_metadata": doc}, step=s, metadata={
                "format": 3, "checkpoints": [[r, ids[r][s]] for r in range(ranks)], "storage_meta": None,
                "metadata": None})
    with deltackpt.Store(distributed._rank_path(root, ranks - 1)) as s:
        s.delete(id=ids[ranks - 1][-1])

    visited = [0]

    class Counted(set):  # (a step's rank checkpoints, counting the pairs gone over)
        def __iter__(self) -> Any:
            for pair in set.__iter__(self):
                visited[0] += 1
                yield pair

    real_named, real_mine = distributed._named, distributed._mine
    monkeypatch.setattr(distributed, "_named", lambda meta, ckpt: Counted(real_named(meta, ckpt)))
    scanned = [0]
    monkeypatch.setattr(distributed, "_mine", lambda store, rank, named: scanned.__setitem__(
        0, scanned[0] + len(named)) or real_mine(store, rank, named))
    infos = distributed.summary(root)
    assert [i.ranks for i in infos] == [ranks] * steps
    assert visited[0] <= 5 * ranks * steps, visited  # (540 before)
    visited[0] = 0
    problems = distributed.verify_names(root)
    assert len(problems) == 1 and f"rank {ranks - 1}'s checkpoint {ids[ranks - 1][-1]}" in problems[0], problems
    assert visited[0] <= 2 * ranks * steps, visited  # (900 before)
    assert distributed.prune(root) == 0
    assert scanned[0] <= ranks * steps, scanned  # (the pairs of every rank for each rank: 432 before)


def test_dcp_verify_reports_a_step_whose_rank_checkpoint_is_gone(tmp_path: Path,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    """A step naming a rank checkpoint that its store no longer holds (removed by hand on the rank store) cannot
    load: `deltackpt dcp --verify` says so and exits 1 (each store on its own was fine, so it said OK)."""
    from deltackpt import cli, distributed

    root = tmp_path / "ckpt"
    _save_steps(root, [1, 2])
    assert cli.main(["rm", str(root / "rank-00000"), "2", "--force"]) == 0
    problems = distributed.verify_names(root)
    assert len(problems) == 1 and "step 2" in problems[0] and "cannot load" in problems[0]
    capsys.readouterr()
    assert cli.main(["dcp", str(root), "--verify"]) == 1
    assert "step 2 (DCP checkpoint" in capsys.readouterr().out
    assert_state(load_full(root, 1), expected(1))


def test_rm_on_a_rank_store_refuses_checkpoints_that_steps_name(tmp_path: Path,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    """`deltackpt rm` on a rank's store deleted a rank checkpoint that a step names, without a word, and the step
    then no longer loaded. It now refuses (naming the step, deleting nothing of the call), also for a checkpoint
    a rewrite replaced (the step names its old id), and when a step's metadata cannot be read; it deletes
    checkpoints no step names (a crashed save's), and everything with --force. A directory named rank-000001 is
    no store of the root (its writer names rank 1's rank-00001): rm treats it as any store."""
    import shutil

    from deltackpt import cli, distributed

    root = tmp_path / "ckpt"
    _save_steps(root, [1, 2])
    rank0 = root / "rank-00000"
    with deltackpt.Store(rank0) as s:
        orphan = s.save({"x": torch.zeros(3)}, step=9).id  # (a save whose step never committed)
        old = s.info(1)
        new = s.rewrite(s.load(id=old.id), id=old.id).id
    capsys.readouterr()
    for which in (["2"], [orphan, "2"], [new]):
        assert cli.main(["rm", str(rank0), *which]) == 1
        err = capsys.readouterr().err
        step = "1" if which == [new] else "2"
        assert f"by step {step}" in err and "nothing was deleted" in err and "--force" in err, err
    with deltackpt.Store(rank0, readonly=True) as s:
        assert sorted(i.step for i in s.list()) == [1, 2, 9]
    for step in (1, 2):
        assert_state(load_full(root, step), expected(step))
    assert cli.main(["rm", str(rank0), orphan]) == 0  # no step names it
    assert distributed.verify_names(root) == []
    assert cli.main(["rm", str(rank0), "2", "--force"]) == 0
    assert "step 2" in distributed.verify_names(root)[0]

    shutil.copytree(rank0, root / "rank-000001")  # (not the root's: its steps do not constrain it)
    assert cli.main(["rm", str(root / "rank-000001"), "1"]) == 0
    assert distributed.stores(root) == [root / "meta", rank0]

    with deltackpt.Store(root / "meta") as meta:  # a step whose metadata cannot be read may name anything
        meta.save({"x": np.zeros(2, np.uint8)}, step=3, metadata={"format": "?"})
    capsys.readouterr()
    assert cli.main(["rm", str(rank0), "1"]) == 1
    err = capsys.readouterr().err
    assert "step 3" in err and "cannot be read" in err and "nothing was deleted" in err, err
    assert cli.main(["rm", str(rank0), "1", "--force"]) == 0


def test_rm_and_keep_know_a_rank_store_the_root_links_to_elsewhere(tmp_path: Path,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    """A root whose rank-00000 is a symbolic link to a store on another disk: its writer and loads go through the
    link, but rm and keep looked for the root beside the real path only, so `deltackpt rm ROOT/rank-00000 STEP`
    deleted a checkpoint a step names without a word (and keep thinned the rank's store alone). Both refuse, as
    for a rank's store inside the root."""
    import shutil

    from deltackpt import cli

    root = tmp_path / "ckpt"
    _save_steps(root, [1, 2])
    rank0 = root / "rank-00000"
    shutil.move(rank0, tmp_path / "disk2")
    rank0.symlink_to(tmp_path / "disk2")
    assert_state(load_full(root, 2), expected(2))  # (the root loads through the link)
    capsys.readouterr()
    assert cli.main(["rm", str(rank0), "2"]) == 1
    err = capsys.readouterr().err
    assert "by step 2" in err and "nothing was deleted" in err, err
    assert cli.main(["keep", str(rank0), "--last", "1"]) == 1
    assert "is a store of the sharded (DCP) root" in capsys.readouterr().err
    for step in (1, 2):
        assert_state(load_full(root, step), expected(step))
    assert cli.main(["rm", str(rank0), "2", "--force"]) == 0


def test_dcp_metadata_is_read_from_the_checksummed_manifest(tmp_path: Path) -> None:
    """The index record's copy of a step's DCP metadata has no checksum: loads, prune and delete go by the
    manifest's, so a damaged copy changes nothing they do (it made a load report a wrong shape)."""
    import dataclasses
    import struct

    from deltackpt import distributed, tree

    root = tmp_path / "ckpt"
    _save_steps(root, [1])
    with deltackpt.Store(root / "meta") as meta:
        rec = meta.index.get(step=1)
        doc = tree.decode_plain(rec.metadata)
        doc["checkpoints"] = []  # names no rank checkpoint: prune would take every shard for stale
        with meta.index.env.begin(write=True) as txn:
            txn.put(struct.pack(">Q", rec.seq), dataclasses.replace(rec, metadata=tree.encode_plain(doc)).dumps(),
                    db=meta.index.db_ckpts)
        assert meta.info(1).metadata["checkpoints"] == []
    _save_steps(root, [2])
    assert distributed.prune(root) == 0
    assert_state(load_full(root, 1), expected(1))


def test_dcp_gc_fails_as_gc_does_on_a_damaged_live_frame(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """'dcp --gc' reports what each rank store's gc left alone, with the exit status of 'deltackpt gc': a live
    frame found damaged while repacking exited 0 without a word."""
    from deltackpt import maintenance
    from deltackpt.cli import main

    root = tmp_path / "ckpt"
    w = DeltaStorageWriter(root, step=1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"x": torch.ones(1000)}, storage_writer=w)
    w.close()
    damaged = maintenance.GcReport(damaged_packs=["chunk 00ab-4000 in pack p1 at offset 16"])
    monkeypatch.setattr(deltackpt.Store, "gc", lambda self, **kw: damaged)  # what gc reports on such a store
    capsys.readouterr()
    assert main(["dcp", str(root), "--gc"]) == 1
    err = capsys.readouterr().err
    assert "rank-00000: not repacked, a live frame is damaged: chunk 00ab-4000" in err
    assert f"deltackpt dcp {root} --verify" in err


def test_malformed_items_in_dcp_metadata_are_manifest_damage(monkeypatch: pytest.MonkeyPatch) -> None:
    """An ``items`` entry of a meta checkpoint's DCP metadata that is a dict (a buggy writer) is
    CorruptManifestError naming the checkpoint, like any other malformed entry; it was an uncaught KeyError, and
    ``deltackpt dcp ROOT`` printed a traceback."""
    from deltackpt import distributed

    class _Meta:
        path = Path("ROOT/meta")

    ok = "0123456789abcdef"
    # (a rank of more digits than a file name holds, or a rank checkpoint id like ../x, too: the first made the
    # listing of the whole root fail with OSError "File name too long", the second with "invalid checkpoint id")
    heads: list[Any] = [{"format": 2, "items": items} for items in (
        [{"rank": 0}], [[0, 0, 0, "x", 0, "id"]], 5, [[0, 0, 0, 10**300, 0, ok]], [[0, 0, 0, 0, 0, "../x"]])]
    heads += [{"format": 3, "checkpoints": c} for c in ([[0]], [["0", "id"]], [[-1, "id"]], [[0, 5]], None,
                                                        [[10**300, ok]], [[1 << 63, ok]], [[0, "../../x"]])]
    heads.append({"format": 3})
    for head in heads:
        monkeypatch.setattr(distributed, "_doc", lambda store, ckpt, head=head: head)
        with pytest.raises(deltackpt.CorruptManifestError, match="DCP checkpoint abc in ROOT/meta: malformed DCP"):
            distributed._named(_Meta(), "abc")  # type: ignore[arg-type]
    for head in ({"items": []}, None, [3], {"format": "3"}):
        monkeypatch.setattr(distributed, "_doc", lambda store, ckpt, head=head: head)
        with pytest.raises(deltackpt.CorruptManifestError, match="DCP checkpoint abc in ROOT/meta: not DCP metadata"):
            distributed._named(_Meta(), "abc")  # type: ignore[arg-type]
    for head in ({"format": 3, "checkpoints": [[(1 << 63) - 1, ok]]}, {"format": 2, "items": [[0, 0, 0, 7, 0, ok]]}):
        monkeypatch.setattr(distributed, "_doc", lambda store, ckpt, head=head: head)
        assert distributed._named(_Meta(), "abc") in ({((1 << 63) - 1, ok)}, {(7, ok)})  # type: ignore[arg-type]


def test_a_requires_grad_that_is_no_bool_in_dcp_metadata_is_manifest_damage() -> None:
    """A tensor's ``requires_grad`` in DCP metadata (format 3's compact entry, or formats 1 and 2's dict) that is
    not a bool is CorruptManifestError naming the fqn, as other malformed fields are; ``bool()`` took "yes" (and
    "false") as True."""
    from deltackpt import distributed

    for value in ("yes", "false", 1, None, [True]):
        for d in (distributed._expand_md("w", ["float32", value, [4], [[[0], [4]]]]),
                  {"kind": "tensor", "dtype": torch.float32, "requires_grad": value, "size": [4],
                   "chunks": [[[0], [4]]]}):
            with pytest.raises(deltackpt.CorruptManifestError, match=r"WHERE: DCP metadata of 'w' is malformed "
                                                                     r"\(requires_grad"):
                distributed._decode_md("w", d, "WHERE")
    for value in (True, False):
        md = distributed._decode_md("w", distributed._expand_md("w", ["float32", value, [4], [[[0], [4]]]]), "W")
        assert md.properties.requires_grad is value


def test_torch_dcp_planner_refuses_sub_byte_and_bits_dtypes_before_the_writer_writes(tmp_path: Path) -> None:
    """What the README's DCP section says: torch's own planner raises TypeError for the sub-byte and bits dtypes
    (its ``_element_size`` takes ``torch.iinfo`` of them) before the writer writes, and nothing is committed. If a
    torch saves them, the README sentence is out of date."""
    for name in ("uint4", "int3", "bits8", "bits16", "bits4x2"):
        if not hasattr(torch, name):  # (torch < 2.5 has no uint4 or int3)
            continue
        dtype = getattr(torch, name)
        w = DeltaStorageWriter(tmp_path / name, step=0)
        with warnings.catch_warnings(), pytest.raises(CheckpointException) as ei:
            warnings.simplefilter("ignore")
            dcp.save({"x": torch.zeros(4 * dtype.itemsize, dtype=torch.uint8).view(dtype)}, storage_writer=w)
        w.close()
        assert "TypeError: torch.iinfo() requires an integer input type" in str(ei.value), name
        assert not list((tmp_path / name).rglob("*.manifest")), name


def test_dcp_metadata_is_deduplicated_and_kept_out_of_the_index(tmp_path: Path) -> None:
    """Meta format 3: DCP's metadata document (a few hundred bytes per tensor) is chunked in the meta
    checkpoint's state, so a step whose plan did not change writes almost none of it again, and the meta
    checkpoint's metadata (copied into its index record, read by every listing) names only the rank
    checkpoints, whatever the number of tensors. A document that is not one is manifest damage naming the step."""
    from deltackpt import distributed

    root = tmp_path / "ckpt"
    state = {f"layer{i}.weight": torch.full((8,), float(i)) for i in range(400)}
    w = DeltaStorageWriter(root, step=0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for step in range(3):
            for t in state.values():
                t.add_(1)
            w.step = step
            dcp.save(state, storage_writer=w)
    w.close()
    with deltackpt.Store(root / "meta") as meta, deltackpt.Store(root / "rank-00000") as rank:
        infos = meta.list()
        assert [i.metadata["checkpoints"] for i in infos] == [[[0, r.id]] for r in rank.list()]
        assert all(len(repr(i.metadata)) < 300 for i in infos)
        doc = meta.load(id=infos[0].id)[distributed._DOC]
        assert doc.nbytes > 400 * 100  # the document does hold every tensor's metadata ...
        assert infos[0].written_bytes > 0 and all(i.written_bytes == 0 for i in infos[1:])  # ... once
    target = {k: torch.zeros(8) for k in state}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(target, storage_reader=DeltaStorageReader(root, step=1))
    assert all(torch.equal(target[k], v - 1) for k, v in state.items())
    with deltackpt.Store(root / "meta") as meta:
        info = meta.latest()
        meta.rewrite({distributed._DOC: np.frombuffer(b'["d",[[', np.uint8)}, id=info.id, metadata=info.metadata)
    with pytest.raises(CheckpointException, match="step 2 .*malformed DCP metadata document"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dcp.load(target, storage_reader=DeltaStorageReader(root))


def _pack_bytes(store_dir: Path) -> int:
    return sum(p.stat().st_size for p in (store_dir / "packs").rglob("*") if p.is_file())


def test_dcp_retention_drops_steps_and_their_shards(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``DeltaStorageWriter(retention=)``: after each commit the coordinator deletes the steps the policy drops
    (keep_last=3 and keep_every=4 over 10 steps keep 0, 4, 7, 8, 9); each rank deletes its checkpoints of
    dropped steps at its next save (the last dropped step's until then, or until a prune), and gc returns
    their space: with gc the rank's packs end smaller than without. Every kept step loads bit for bit."""
    from deltackpt import distributed

    monkeypatch.setenv("DELTACKPT_GC_MIN_BYTES", "0")  # collect as soon as a quarter of the kept bytes
    g = torch.Generator().manual_seed(5)
    states = [{"w": torch.randn(64 << 10, generator=g), "step": s} for s in range(10)]  # 256 KiB, all new
    for gc in (True, False):
        root = tmp_path / f"gc-{gc}"
        w = DeltaStorageWriter(root, step=0, retention=deltackpt.Retention(keep_last=3, keep_every=4), gc=gc)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for s, state in enumerate(states):
                w.step = s
                dcp.save(state, storage_writer=w, **DCP_NO_DIST)
        w.close()
        assert distributed.steps(root) == [0, 4, 7, 8, 9]
        with deltackpt.Store(root / "rank-00000") as st:
            assert [c.step for c in st.list()] == [0, 4, 6, 7, 8, 9]  # 6: dropped at step 9's commit
    assert _pack_bytes(tmp_path / "gc-True" / "rank-00000") < 0.8 * _pack_bytes(tmp_path / "gc-False" / "rank-00000")
    root = tmp_path / "gc-True"
    assert distributed.prune(root) == 1
    with deltackpt.Store(root / "rank-00000") as st:
        assert [c.step for c in st.list()] == [0, 4, 7, 8, 9] and st.verify().ok
    for s in distributed.steps(root):
        target = {"w": torch.zeros(64 << 10), "step": -1}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dcp.load(target, storage_reader=DeltaStorageReader(root, step=s), **DCP_NO_DIST)
        assert torch.equal(target["w"], states[s]["w"]) and (target["step"] == s or not DCP_LOADS_TOP_LEVEL_VALUES)


@pytest.mark.parametrize("interval", [1, 4])
def test_dcp_steps_kept_for_good_are_saved_as_keyframes(tmp_path: Path, interval: int) -> None:
    """With keep_every=4 and a save every step, steps 4, 8 and 12 hold standalone frames only, step 12 saved by
    a new writer (a restarted job: the previous step is the store's latest); the steps between stay deltas.
    Saving every 4 steps keeps every save for good, and none is forced to be a keyframe. Every step loads bit
    for bit."""
    from deltackpt import codec
    from deltackpt.index import chunk_keys

    g = torch.Generator().manual_seed(3)
    w0 = torch.randn(64 << 10, generator=g)
    states = {s: {"w": w0 + 1e-3 * s * torch.sign(w0)} for s in range(0, 13, interval)}
    policy = deltackpt.Retention(keep_last=100, keep_every=4)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for steps in ([s for s in states if s < 12], [12]):  # two writers: a restart before step 12
            w = DeltaStorageWriter(tmp_path, retention=policy, chunk_size=16 << 10)
            for s in steps:
                w.step = s
                dcp.save(states[s], storage_writer=w, **DCP_NO_DIST)
            w.close()
    with deltackpt.Store(tmp_path / "rank-00000") as st:
        assert [c.step for c in st.list()] == list(states)
        for info in st.list():
            m = st.manifest(id=info.id)
            locs = st.index.lookup_chunks(chunk_keys(*m.stored_chunks()))
            based = sum(loc.codec in codec.BASED for loc in locs.values())
            if info.step == 0 or (info.step % 4 == 0 and interval < 4):
                assert based == 0, f"step {info.step} holds {based} delta frames"
            else:
                assert based >= 4, f"step {info.step}: {based} of {len(locs)} chunks are deltas"
    for s, state in states.items():
        target = {"w": torch.zeros(64 << 10)}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dcp.load(target, storage_reader=DeltaStorageReader(tmp_path, step=s), **DCP_NO_DIST)
        assert torch.equal(target["w"], state["w"]), f"step {s}"


def test_dcp_retention_takes_only_rules_that_fit_dcp_steps(tmp_path: Path) -> None:
    with pytest.raises(TypeError, match="retention must be a deltackpt.Retention"):
        DeltaStorageWriter(tmp_path, step=1, retention={"keep_last": 3})  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="cannot thin steps to model weights"):
        DeltaStorageWriter(tmp_path, step=1, retention=deltackpt.Retention(keep_last=3, full_last=1))


def test_dcp_steps_keep_their_metadata_and_retention_keeps_the_best(tmp_path: Path,
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    """``writer.metadata`` set per step is kept with the step: summary() and ``deltackpt dcp ROOT`` show it, and
    keep_best / keep_tagged go by it. Metadata that is not a mapping of plain values is refused before anything
    is written."""
    from deltackpt import distributed
    from deltackpt.cli import main

    root = tmp_path / "ckpt"
    losses = [3.0, 1.5, 2.0, 2.5, 2.8]
    w = DeltaStorageWriter(root, retention=deltackpt.Retention(keep_last=1, keep_best=("loss", "min")))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for step, loss in enumerate(losses):
            w.step, w.metadata = step, {"loss": loss, **({"tag": "warm"} if step == 0 else {})}
            dcp.save({"x": torch.full((100,), float(step))}, storage_writer=w, **DCP_NO_DIST)
        assert [(i.step, i.metadata) for i in distributed.summary(root)] == [
            (0, {"loss": 3.0, "tag": "warm"}), (1, {"loss": 1.5}), (4, {"loss": 2.8})]
        capsys.readouterr()
        assert main(["dcp", str(root)]) == 0
        out = capsys.readouterr().out
        assert "metadata" in out.splitlines()[0] and "loss=1.5" in out and "tag=warm" in out
        for bad, exc in (([("loss", 1.0)], TypeError), ({"loss": torch.ones(2)}, deltackpt.UnsupportedTypeError)):
            w.step, w.metadata = 9, bad
            with pytest.raises(CheckpointException, match=exc.__name__):
                dcp.save({"x": torch.zeros(100)}, storage_writer=w, **DCP_NO_DIST)
        w.close()
    assert distributed.steps(root) == [0, 1, 4]
    with deltackpt.Store(root / "rank-00000") as st:
        assert 9 not in [c.step for c in st.list()]


@pytest.mark.plumbing
def test_killed_ranks_saving_with_retention_lose_no_kept_step(tmp_path: Path) -> None:
    """Two ranks save step after step with keep_last=2 and gc after every retention, and both are SIGKILLed at
    random points (mid-save, mid-commit, mid-retention, mid-gc), then restarted after the newest step, three
    times, before a last run completes. Every step the root lists loads bit for bit, every store verifies, no
    step names a missing rank checkpoint, and a prune leaves each rank store holding only named checkpoints."""
    import random

    from deltackpt import distributed

    rng = random.Random(11)
    root = tmp_path / "ckpt"
    kills = 0
    for round_ in range(4):
        first = max(distributed.steps(root), default=-1) + 1 if (root / "meta").exists() else 0
        init = tmp_path / f"pg-retain-{round_}"
        procs = [subprocess.Popen([sys.executable, str(WORKER), "retain", str(r), "2", str(root), str(init),
                                   str(first), "8"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                 for r in range(2)]
        try:
            if round_ < 3:
                target = rng.randint(0, 3)
                assert procs[0].stdout is not None
                for line in procs[0].stdout:
                    if line.startswith("saved ") and int(line.split()[1]) >= first + target:
                        break
                time.sleep(rng.uniform(0, 0.4))
                for p in procs:
                    p.kill()
                kills += 1
            for p in procs:
                _, err = p.communicate(timeout=120)
                assert p.returncode == (0 if round_ == 3 else p.returncode), err[-3000:]
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.communicate()
    steps = distributed.steps(root)
    assert len(steps) == 2 and steps[1] == steps[0] + 1, steps  # keep_last=2 after the last, complete run
    for s in steps:
        assert_state(load_full(root, step=s), expected(s))
    assert distributed.verify_names(root) == []
    distributed.prune(root)
    with deltackpt.Store(root / "meta") as meta:
        named = set().union(*(distributed._named(meta, i.id) for i in meta.list()))
        assert meta.verify().ok
    for rank in (0, 1):
        with deltackpt.Store(root / f"rank-{rank:05d}") as st:
            assert st.verify().ok
            assert {(rank, c.id) for c in st.list()} <= named
    assert kills == 3


def test_keep_on_a_dcp_root_deletes_steps_and_their_shards(tmp_path: Path,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    """``deltackpt keep ROOT`` on a DCP root applies the policy to its steps by their metadata: --dry-run only
    lists them; the real run deletes their meta and rank checkpoints, and --gc collects every store."""
    from conftest import dir_snapshot

    from deltackpt import distributed
    from deltackpt.cli import main

    root = tmp_path / "ckpt"
    g = torch.Generator().manual_seed(8)
    states = {s: {"x": torch.randn(4096, generator=g)} for s in range(6)}
    w = DeltaStorageWriter(root)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for s, st in states.items():
            w.step, w.metadata = s, {"loss": 0.1 if s == 1 else 10.0 - s}
            dcp.save(st, storage_writer=w, **DCP_NO_DIST)
    w.close()
    before = dir_snapshot(root)
    capsys.readouterr()
    assert main(["keep", str(root), "--last", "2", "--best", "lost:min"]) == 1  # a metric no step records
    assert "no checkpoint records 'lost' as a number (numbers they record: 'loss')" in capsys.readouterr().err
    assert dir_snapshot(root) == before
    assert main(["keep", str(root), "--last", "2", "--best", "loss:min", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert re.findall(r"would delete step (\d+)", out) == ["0", "2", "3"] and "3 of 6 step(s)" in out
    assert dir_snapshot(root) == before
    assert main(["keep", str(root), "--last", "2", "--best", "loss:min"]) == 0
    out = capsys.readouterr().out
    assert re.findall(r"deleted step (\d+)", out) == ["0", "2", "3"]
    assert f"run 'deltackpt dcp {root} --gc' (or this command with --gc)" in out  # (plain gc refuses a root)
    assert main(["keep", str(root), "--last", "2", "--best", "loss:min", "--gc"]) == 0
    out = capsys.readouterr().out
    assert "deleted 0 of 3 step(s)" in out and "gc rank-00000: freed" in out
    assert distributed.steps(root) == [1, 4, 5]
    with deltackpt.Store(root / "rank-00000") as st:
        assert [c.step for c in st.list()] == [1, 4, 5]
    for s in (1, 4, 5):
        target = {"x": torch.zeros(4096)}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dcp.load(target, storage_reader=DeltaStorageReader(root, step=s), **DCP_NO_DIST)
        assert torch.equal(target["x"], states[s]["x"])


def test_dcp_metadata_reads_back_as_dcp_wrote_it(tmp_path: Path) -> None:
    """The metadata a DeltaStorageReader returns equals what DCP handed the writer: every tensor's dtype,
    requires_grad, size and chunks, byte items, the planner's data (its tuples as tuples), the version, and
    where each item lies; a planner whose data is not DefaultSavePlanner's kind is kept as plain values."""
    from dataclasses import replace

    from torch.distributed.checkpoint.metadata import Metadata

    from deltackpt import distributed

    got: list[Metadata] = []

    class Keeping(DeltaStorageWriter):
        def finish(self, metadata: Metadata, results: Any) -> None:
            got.append(metadata)
            super().finish(metadata, results)

    class OddPlanner(dcp.DefaultSavePlanner):
        def create_global_plan(self, all_plans: Any) -> Any:
            plans, md = super().create_global_plan(all_plans)
            return plans, replace(md, planner_data={"note": [1, (2, "x")], 3: None})

    state = {"w": torch.randn(6, 4, dtype=torch.bfloat16), "g": torch.ones(3, requires_grad=True), "n": 7,
             "nested": {"list": [torch.arange(5), "s"], "b": b"x" * 5000}}
    for planner in (None, OddPlanner()):
        root = tmp_path / f"ckpt-{planner is None}"
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dcp.save(state, storage_writer=Keeping(root, step=1), planner=planner, **DCP_NO_DIST)
            read = DeltaStorageReader(root).read_metadata()
        wrote = got[-1]
        assert getattr(read, "version", None) == getattr(wrote, "version", None)  # (torch 2.4+ has a version)
        assert read.planner_data == wrote.planner_data
        assert type(read.planner_data) is type(wrote.planner_data)
        if planner is None:
            assert all(type(v) is tuple for v in read.planner_data.values())
        assert read.state_dict_metadata.keys() == wrote.state_dict_metadata.keys()
        for fqn, md in wrote.state_dict_metadata.items():
            r = read.state_dict_metadata[fqn]
            assert type(r) is type(md)
            if hasattr(md, "properties"):
                assert (r.properties.dtype, r.properties.requires_grad, r.size) == (
                    md.properties.dtype, md.properties.requires_grad, md.size)
                assert [(c.offsets, c.sizes) for c in r.chunks] == [(c.offsets, c.sizes) for c in md.chunks]
        assert {i.fqn for i in read.storage_data} == set(wrote.state_dict_metadata)
        assert all(st.key == distributed._item_key(i) for i, st in read.storage_data.items())


def test_keep_refuses_a_store_inside_a_dcp_root(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Thinning a rank store (or the meta store) alone would break the steps that name its checkpoints, and the
    meta store's own metadata is the head, not the steps' metadata: ``keep`` refuses both, changing nothing."""
    from conftest import dir_snapshot

    from deltackpt.cli import main

    root = tmp_path / "ckpt"
    _save_steps(root, [1, 2, 3])
    before = dir_snapshot(root)
    for sub in ("rank-00000", "meta"):
        capsys.readouterr()
        assert main(["keep", str(root / sub), "--last", "1"]) == 1
        err = capsys.readouterr().err
        assert f"is a store of the sharded (DCP) root {root.resolve()}" in err and "deltackpt keep" in err, err
    assert dir_snapshot(root) == before


def test_a_step_saved_twice_loads_by_id_and_retention_reads_checksummed_metadata(tmp_path: Path) -> None:
    """After a rollback a step can be saved again: ``DeltaStorageReader(step=)`` loads the newer copy and
    ``id=`` (from ``summary()``) either. Retention ranks and keeps by the metadata in the meta checkpoints'
    manifests: a damaged index copy (here the tag removed) does not make it delete a tagged step."""
    import dataclasses
    import struct

    from deltackpt import distributed, tree

    root = tmp_path / "ckpt"
    w = DeltaStorageWriter(root)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for step, value, meta in ((1, 1.0, {"tag": "first"}), (2, 2.0, None), (3, 3.0, None), (2, 20.0, None)):
            w.step, w.metadata = step, meta
            dcp.save({"x": torch.full((10,), value)}, storage_writer=w, **DCP_NO_DIST)
        w.close()
        infos = distributed.summary(root)
        assert [i.step for i in infos] == [1, 2, 3, 2] and len({i.id for i in infos}) == 4
        for reader, want in ((DeltaStorageReader(root, step=2), 20.0), (DeltaStorageReader(root, id=infos[1].id), 2.0)):
            target = {"x": torch.zeros(10)}
            dcp.load(target, storage_reader=reader, **DCP_NO_DIST)
            assert torch.equal(target["x"], torch.full((10,), want))
    with pytest.raises(ValueError, match="a step or an id"):
        DeltaStorageReader(root, step=2, id=infos[1].id)
    with deltackpt.Store(root / "meta") as meta:
        rec = meta.index.get(step=1)
        head = tree.decode_plain(rec.metadata)
        head["metadata"] = None
        with meta.index.env.begin(write=True) as txn:
            txn.put(struct.pack(">Q", rec.seq), dataclasses.replace(rec, metadata=tree.encode_plain(head)).dumps(),
                    db=meta.index.db_ckpts)
    dropped = distributed.retain(root, deltackpt.Retention(keep_last=1))
    assert [(i.step, i.id) for i in dropped] == [(2, infos[1].id), (3, infos[2].id)]
    assert [(i.step, i.metadata) for i in distributed.summary(root)] == [(1, None), (2, None)]
    assert [i.id for i in distributed.summary(root)] == [infos[0].id, infos[3].id]


@pytest.mark.parametrize("sizes", [[-5], [1 << 40], [11], [2, 5]])
def test_a_shard_outside_its_tensor_in_the_metadata_is_refused(tmp_path: Path, sizes: list[int]) -> None:
    """A DCP metadata document (well-formed, checksums intact) whose shard lies outside its tensor is damage:
    the load fails naming it, before anything is allocated. A negative size made dcp.load return with the
    tensor left as it was; a size of 2**40 elements made the reader allocate 4 TiB (a raw RuntimeError)."""
    import json

    from deltackpt import tree

    root = tmp_path / "ckpt"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"w": torch.randn(10)}, storage_writer=DeltaStorageWriter(root, step=1), **DCP_NO_DIST)
    with deltackpt.Store(root / "meta") as s:
        info = s.latest()
        assert info is not None
        state, meta = s.load(), tree.decode_plain(s.manifest(id=info.id).metadata)
        doc = json.loads(bytes(state["dcp_metadata"]).decode())
        doc["state_dict_metadata"]["w"][3][0][1] = sizes  # the one shard's sizes
        state["dcp_metadata"] = np.frombuffer(json.dumps(doc).encode(), np.uint8).copy()
        s.save(state, step=2, metadata=meta)
    target = {"w": torch.full((10,), 7.0)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(CheckpointException) as caught:
            dcp.load(target, storage_reader=DeltaStorageReader(root), **DCP_NO_DIST)
    assert "DCP metadata of 'w' is malformed" in str(caught.value) and "step 2" in str(caught.value)
    assert torch.equal(target["w"], torch.full((10,), 7.0))


@async_without_group
def test_a_load_of_the_newest_step_leaves_saves_descending_from_the_newest(tmp_path: Path) -> None:
    """Only a load of an older step makes the next save a branch. An evaluation that loads the newest step while
    an async save is in flight (here held in write_data until the load is done) leaves the save after that one
    descending from it, not from the step before it."""
    import threading

    class Held(DeltaStorageWriter):
        gate = threading.Event()

        def write_data(self, plan: Any, planner: Any) -> Any:
            assert self.gate.wait(60)
            return super().write_data(plan, planner)

    root = tmp_path / "ckpt"
    x = torch.zeros(1000)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        w = Held(root)
        Held.gate.set()
        for step in range(4):
            x[step] = 1.0
            w.step = step
            dcp.save({"x": x}, storage_writer=w)
        Held.gate.clear()
        w.step = 4
        f = dcp.async_save({"x": x}, storage_writer=w)
        dcp.load({"x": torch.zeros(1000)}, storage_reader=DeltaStorageReader(root), **DCP_NO_DIST)  # step 3
        Held.gate.set()
        f.result()
        w.step = 5
        dcp.save({"x": x}, storage_writer=w)
        w.close()
    for store in ("meta", "rank-00000"):
        with deltackpt.Store(root / store) as s:
            assert [(c.step, c.parent) for c in s.list()][4:] == [(4, s.list()[3].id), (5, s.list()[4].id)], store


def test_a_save_after_loading_an_older_step_branches_from_it(tmp_path: Path) -> None:
    """A job that loads an older step and trains on saves a branch, as after Store.load(step=): each store's next
    checkpoint (meta and rank) descends from the checkpoint of the step loaded, so the rank's deltas and
    predictions are against the state they continue (not against the newest, two steps apart), and `deltackpt log`
    shows the lineage. The save after that descends from the branch; every step loads bit for bit."""
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    def make() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.GELU(), torch.nn.Linear(128, 64))
        return model, torch.optim.AdamW(model.parameters(), lr=1e-3)

    def train(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
        model(torch.randn(16, 64)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        msd, osd = get_state_dict(model, opt)
        return {"model": msd, "optim": osd}

    root = tmp_path / "ckpt"
    saved = []

    def run(model: torch.nn.Module, opt: torch.optim.Optimizer, steps: range) -> None:
        w = DeltaStorageWriter(root, chunk_size=4096)
        for step in steps:
            state = train(model, opt)
            w.step = step
            dcp.save(state, storage_writer=w, **DCP_NO_DIST)
            saved.append({k: v.clone() for k, v in dcp_flat(state).items()})
        w.close()

    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        run(*make(), range(5))
        first = distributed.summary(root)
        model, opt = make()  # a restarted job, rolled back to step 2
        state = train(model, opt)
        dcp.load(state, storage_reader=DeltaStorageReader(root, step=2), **DCP_NO_DIST)
        set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
        run(model, opt, range(3, 5))
        infos = distributed.summary(root)
        assert [i.step for i in infos] == [0, 1, 2, 3, 4, 3, 4]
        for i, want in zip(infos, saved):
            state = train(*make())
            dcp.load(state, storage_reader=DeltaStorageReader(root, id=i.id), **DCP_NO_DIST)
            got = dcp_flat(state)
            assert sorted(got) == sorted(want), i.step
            for k in want:
                assert torch.equal(got[k].reshape(-1).view(torch.uint8), want[k].reshape(-1).view(torch.uint8)), k
    with deltackpt.Store(root / "meta") as s:
        assert [c.parent for c in s.list()][5:] == [first[2].id, infos[5].id]
    with deltackpt.Store(root / "rank-00000") as s:
        ckpts = s.list()
        assert [c.parent for c in ckpts][5:] == [ckpts[2].id, ckpts[5].id]
        # (as the run's other saves: 107 KB against 189 KB for the first; descending from step 4, the branch's
        # saves wrote 178 and 171 KB)
        assert max(c.written_bytes for c in ckpts[5:]) < 0.7 * ckpts[0].written_bytes, [c.written_bytes for c in ckpts]


def test_a_branch_save_that_failed_at_the_commit_branches_again(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """The first save after a rollback fails after the rank store committed its checkpoint, at the coordinator's
    commit (here its check that every rank checkpoint is in place raises once): tried again, every store still
    descends from the step loaded, not from the rank checkpoint the failed step left (which prune deletes)."""
    root = tmp_path / "ckpt"
    _save_steps(root, range(4))
    state = load_full(root, 1)  # (a rollback: the next save into root branches from step 1)
    state["w"][5, 5] += 1.0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        real = distributed._check_saved_here

        def fails_once(*args: Any) -> None:
            monkeypatch.setattr(distributed, "_check_saved_here", real)
            raise OSError(28, "No space left on device")

        monkeypatch.setattr(distributed, "_check_saved_here", fails_once)
        w = DeltaStorageWriter(root, step=2)
        with pytest.raises(CheckpointException):
            dcp.save(state, storage_writer=w, **DCP_NO_DIST)
        dcp.save(state, storage_writer=w, **DCP_NO_DIST)
        state["w"][6, 6] += 1.0
        w.step = 3
        dcp.save(state, storage_writer=w, **DCP_NO_DIST)
        w.close()
    assert distributed.prune(root) == 1  # the failed step's rank checkpoint
    assert [i.step for i in distributed.summary(root)] == [0, 1, 2, 3, 2, 3]
    for store in ("meta", "rank-00000"):
        with deltackpt.Store(root / store) as s:
            infos = s.list()
            assert [(i.step, i.parent) for i in infos[4:]] == [(2, infos[1].id), (3, infos[4].id)], store


def _steps_with_a_damaged_meta_manifest(root: Path) -> tuple[list[str], Path, bytes]:
    """Steps 1, 2 and 3 saved under ``root``, then one byte of step 2's meta manifest flipped: the meta
    checkpoint ids, that manifest's path and its intact bytes."""
    from deltackpt import distributed

    _save_steps(root, [1, 2, 3])
    ids = [i.id for i in distributed.summary(root)]
    path = root / "meta" / "manifests" / f"{ids[1]}.manifest"
    intact = path.read_bytes()
    data = bytearray(intact)
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    return ids, path, intact


def test_the_dcp_command_lists_the_steps_beside_one_whose_meta_manifest_is_damaged(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """One step's damaged meta manifest (or one of a newer meta format) stopped 'deltackpt dcp ROOT' with one
    line naming the manifest, and no step listed: it lists every readable step, names the damaged one's step and
    id, and exits 1 (with --verify, verify_names names it too)."""
    from deltackpt import cli, distributed

    root = tmp_path / "ckpt"
    ids, path, intact = _steps_with_a_damaged_meta_manifest(root)
    capsys.readouterr()
    for args in ([], ["--verify"]):
        assert cli.main(["dcp", str(root), *args]) == 1
        out, err = capsys.readouterr()
        assert err == ""
        assert [ln.split()[0] for ln in out.splitlines()[-3:-1]] == ["1", "3"]
        assert out.splitlines()[-1] == (f"step 2 (DCP checkpoint {ids[1]}): its DCP metadata cannot be read "
                                        f"(manifest {ids[1]} fails its checksum): the step cannot load")
    assert distributed.verify_names(root) == [out.splitlines()[-1]]
    assert distributed.missing_stores(root) == []
    with pytest.raises(deltackpt.CorruptManifestError, match="fails its checksum"):
        distributed.summary(root)  # (as before: summary() raises for an unreadable step)
    path.write_bytes(intact)
    with deltackpt.Store(root / "meta") as meta:  # a step of a newer meta format: listed apart too
        meta.rewrite({}, id=ids[2], metadata=dict(meta.info(id=ids[2]).metadata, format=distributed.META_FORMAT + 1))
    assert cli.main(["dcp", str(root)]) == 1
    out = capsys.readouterr().out
    assert [ln.split()[0] for ln in out.splitlines()[-3:-1]] == ["1", "2"]
    assert out.splitlines()[-1].startswith("step 3 (DCP checkpoint ") and "newer than this reader" in out
    assert_state(load_full(root, 1), expected(1))


def test_dcp_verify_with_a_rank_store_gone_does_not_advise_verify(tmp_path: Path,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    """With a rank's store gone, the listing's last line said '(--verify lists them)' under --verify too, which
    had just listed them: it points to the lines above."""
    from deltackpt.cli import main

    root = tmp_path / "ckpt"
    _save_steps(root, (1, 2))
    shutil.rmtree(root / "rank-00000")
    capsys.readouterr()
    assert main(["dcp", str(root), "--verify"]) == 1
    lines = capsys.readouterr().out.splitlines()
    assert sum("but its store is gone: the step cannot load" in ln for ln in lines) == 2
    assert lines[-1] == "rank 0's store is gone: the steps that name its checkpoints cannot load (listed above)"
    assert main(["dcp", str(root)]) == 0
    assert capsys.readouterr().out.splitlines()[-1].endswith("cannot load (--verify lists them)")


def test_a_step_whose_meta_manifest_is_damaged_can_be_deleted_and_prune_names_it(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """'deltackpt dcp ROOT --rm STEP' of a step whose meta manifest is damaged failed with one line naming the
    manifest (the names of its rank checkpoints cannot be read): the step is deleted, and prune then deletes
    its rank checkpoint. Before that, prune refuses (it cannot tell what the step names) naming the step."""
    from deltackpt import cli, distributed

    root = tmp_path / "ckpt"
    ids, path, intact = _steps_with_a_damaged_meta_manifest(root)
    capsys.readouterr()
    assert cli.main(["dcp", str(root), "--prune"]) == 1
    err = capsys.readouterr().err
    assert f"step 2 (DCP checkpoint {ids[1]}): its DCP metadata cannot be read" in err
    assert f"prune cannot tell which rank checkpoints the step names, so it deletes nothing ('deltackpt rm " \
           f"{root / 'meta'} {ids[1]}' deletes the step)" in err
    with deltackpt.Store(root / "rank-00000") as s:
        assert len(s.list()) == 3
    assert cli.main(["dcp", str(root), "--rm", "2", "--prune"]) == 0
    out = capsys.readouterr().out
    assert "deleted DCP checkpoint of step 2" in out and "pruned 1 rank checkpoint(s)" in out
    assert distributed.steps(root) == [1, 3] and distributed.verify_names(root) == []
    with deltackpt.Store(root / "rank-00000") as s:
        assert [c.step for c in s.list()] == [1, 3]
    for step in (1, 3):
        assert_state(load_full(root, step), expected(step))


def test_retention_names_a_step_whose_meta_manifest_is_damaged(tmp_path: Path,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    """Retention reads every step's metadata from its meta manifest: with one damaged, 'deltackpt keep ROOT' and a
    writer's retention said only 'manifest ID fails its checksum'. They name the step and how to delete it (and
    delete nothing: the step's metadata may be what keeps it)."""
    from deltackpt import cli, distributed

    root = tmp_path / "ckpt"
    ids, path, intact = _steps_with_a_damaged_meta_manifest(root)
    hint = f"retention deletes nothing ('deltackpt rm {root / 'meta'} {ids[1]}' deletes the step)"
    capsys.readouterr()
    assert cli.main(["keep", str(root), "--last", "1"]) == 1
    err = capsys.readouterr().err
    assert f"step 2 (DCP checkpoint {ids[1]}): its DCP metadata cannot be read" in err and hint in err
    assert distributed.steps(root) == [1, 2, 3]


def test_a_writers_retention_goes_on_beside_a_step_whose_meta_manifest_is_damaged(tmp_path: Path) -> None:
    """A writer's retention with one step's meta manifest damaged thinned nothing for the rest of the run, with
    a warning at every save: it thins the readable steps (meta checkpoints at the save, each rank's checkpoints
    of dropped steps at its next save), keeps the damaged step and its shards (it cannot read what keeps it, nor
    what it names), and says so once."""
    root = tmp_path / "ckpt"
    ids, path, intact = _steps_with_a_damaged_meta_manifest(root)
    w = DeltaStorageWriter(root, step=4, retention=deltackpt.Retention(keep_last=1))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in (4, 5):
            w.step = step
            dcp.save(expected(step), storage_writer=w)
    w.close()
    said = [str(c.message) for c in caught if "retention" in str(c.message)]
    assert len(said) == 1, said
    assert said[0].startswith(f"deltackpt: DCP retention keeps step 2 (DCP checkpoint {ids[1]}): its DCP metadata "
                              "cannot be read")
    assert "goes on thinning the other steps" in said[0]
    assert f"'deltackpt rm {root / 'meta'} {ids[1]}' deletes the step" in said[0]
    with deltackpt.Store(root / "meta") as meta, deltackpt.Store(root / "rank-00000") as rank:
        assert [i.step for i in meta.list()] == [2, 5] and meta.list()[0].id == ids[1]
        assert [c.step for c in rank.list()] == [2, 4, 5]  # (step 4's goes at the next save)
    assert_state(load_full(root, 5), expected(5))
    path.write_bytes(intact)  # the damaged step, repaired, loads: nothing it names was deleted
    assert_state(load_full(root, 2), expected(2))


def test_dcp_verify_names_a_step_whose_meta_document_is_damaged(tmp_path: Path,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    """A damaged meta pack (the DCP metadata document a format 3 step holds as its state) makes every step
    unloadable: 'deltackpt dcp ROOT --verify' printed the meta store's damage but then 'verify steps: OK'.
    verify_names names each such step, and the summary line counts them."""
    from deltackpt import cli

    root = tmp_path / "ckpt"
    _save_steps(root, (1, 2))
    ids = [i.id for i in distributed.summary(root)]
    assert distributed.verify_names(root) == []
    for pack in (root / "meta" / "packs").glob("*.pack"):
        data = bytearray(pack.read_bytes())
        for at in range(64, len(data), 97):
            data[at] ^= 0xFF
        pack.write_bytes(bytes(data))
    problems = distributed.verify_names(root)
    assert [p.split(":")[0] for p in problems] == [f"step {s} (DCP checkpoint {c})" for s, c in zip((1, 2), ids)]
    assert all(p.endswith("the step cannot load") for p in problems)
    capsys.readouterr()
    assert cli.main(["dcp", str(root), "--verify"]) == 1
    out = capsys.readouterr().out
    assert "verify steps: 2 problem(s)" in out and "verify steps: OK" not in out
    assert all("frame checksum mismatch" in p for p in problems)
