"""Back-compat: stores written by earlier versions must stay readable forever.

- ``tests/fixtures/store-v1``, written by ``python tests/test_compat.py write`` with deltackpt 0.1.0: format
  version 1 throughout, delta frames. ``expected_states`` only uses arithmetic on fixed numbers (no RNG), so it
  yields the same values in every future version of torch and numpy.
- ``tests/fixtures/store-predicted``, written by ``python tests/test_compat.py write-predicted`` (2026-12-06):
  what later versions added, in one store: predicted frames of all three predictors (frame versions 2 and 3),
  manifests of version 3 (a module's state dict), a branch. Its states come from real AdamW and SGD steps, so
  its golden digests (``store-predicted.json``: every tensor's dtype, shape and SHA-256 and every plain value, by
  checkpoint, taken from the states as they were saved) are what a load is checked against.
- ``tests/fixtures/store-predicted-bf16``, written by ``python tests/test_compat.py write-predicted-bf16``
  (2026-12-07): predicted frames of the bfloat16 predictors (frame version 4), from real AdamW steps of a model
  trained in bfloat16; golden digests in ``store-predicted-bf16.json`` likewise.
- ``tests/fixtures/store-update-chunks``, written by ``write_update_chunks`` below with deltackpt at 76ed8a5
  (2026-12-07): momentum-param frames of Muon's matrices that reference update chunks no manifest lists, from
  real Muon steps under a decaying learning rate; golden digests in ``store-update-chunks.json`` likewise.
- ``tests/fixtures/store-update-param``, written by ``python tests/test_compat.py write-update-param``
  (2026-12-07): the same training, saved since as update-param frames (frame version 5) over update chunks.
- ``tests/fixtures/dcp-meta3-skeleton``, a sharded (DCP) root written by ``write_dcp_meta3_skeleton`` below with
  deltackpt at commit 77cf6fa (2026-12-04), the first writer of DCP meta format 3: until 6fa874e it wrote the
  metadata document as a plain-value skeleton rather than compact JSON. Its stores' ``index`` directories (LMDB
  files of 57 KB each) are left out: the tests rebuild them with a repair, from manifests and packs.
- ``tests/fixtures/dcp-meta3-pickled``, a sharded root written by ``write_dcp_meta3_pickled`` below with deltackpt
  at a246c38 (2026-12-06), the last writer that kept values holding arrays (NumPy's RNG state, a tensor in a
  tuple) as DCP's pickle (item kind ``pickled``), in meta format 3; ``index`` directories left out likewise.

Never regenerate a fixture for a new version: add a new one beside it instead.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import sys
from collections import OrderedDict
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from conftest import DCP_FLATTENS_VALUE_DICTS, DCP_LOADS_TOP_LEVEL_VALUES

import deltackpt
from deltackpt import codec, maintenance, manifest, predict
from deltackpt.index import chunk_keys

FIXTURE = Path(__file__).parent / "fixtures" / "store-v1"
PREDICTED = Path(__file__).parent / "fixtures" / "store-predicted"
GOLDEN = PREDICTED.with_suffix(".json")
PREDICTED_BF16 = Path(__file__).parent / "fixtures" / "store-predicted-bf16"
GOLDEN_BF16 = PREDICTED_BF16.with_suffix(".json")
UPDATE_CHUNKS = Path(__file__).parent / "fixtures" / "store-update-chunks"
UPDATE_PARAM = Path(__file__).parent / "fixtures" / "store-update-param"
DCP_META3_SKELETON = Path(__file__).parent / "fixtures" / "dcp-meta3-skeleton"
DCP_META3_PICKLED = Path(__file__).parent / "fixtures" / "dcp-meta3-pickled"


def expected_states() -> list[tuple[int, dict]]:
    out = []
    base = torch.arange(4096, dtype=torch.float32) / 7.0
    for step in (10, 20, 30):
        w = base + step * 1e-3  # small changes between steps: the fixture holds delta frames
        out.append(
            (
                step,
                {
                    "model": OrderedDict([("w", w.reshape(64, 64)), ("b", torch.zeros(3000))]),
                    "half": (base[:1000] * step).to(torch.bfloat16),
                    "ints": torch.arange(step, step + 500, dtype=torch.int64),
                    "mask": torch.arange(300) % 3 == 0,
                    "arr": np.arange(100, dtype=">f8") * step,
                    "plain": {"step": step, "lr": 1e-3 / step, "name": "run", "big": 2**100 + step,
                              "t": (1, None, b"\x00\xff"), "dt": torch.float16, "neg0": -0.0},
                },
            )
        )
    return out


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(
            a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))
    if isinstance(a, np.ndarray):
        return isinstance(b, np.ndarray) and a.dtype == b.dtype and a.tobytes() == b.tobytes()
    if isinstance(a, dict):
        return type(a) is type(b) and list(a) == list(b) and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, float):
        return isinstance(b, float) and np.float64(a).tobytes() == np.float64(b).tobytes()
    return type(a) is type(b) and a == b


@pytest.fixture
def v1_store(tmp_path: Path) -> Path:
    dest = tmp_path / "store-v1"
    shutil.copytree(FIXTURE, dest)
    return dest


def test_fixture_is_version_1() -> None:
    assert (FIXTURE / "STORE").read_text().count('"version": 1') == 1


def test_v1_store_loads_bit_exactly(v1_store: Path) -> None:
    with deltackpt.Store(v1_store) as s:
        assert [i.step for i in s.list()] == [10, 20, 30]
        for step, state in expected_states():
            assert _same(state, s.load(step=step)), step
        assert s.verify().ok


def test_v1_store_holds_delta_frames(v1_store: Path) -> None:
    with deltackpt.Store(v1_store) as s:
        depths = {loc.depth for _, loc in s.index.iter_chunks()}
    assert max(depths) >= 1, "the fixture should exercise delta decoding"


def test_v1_store_repairs_and_accepts_new_saves(v1_store: Path) -> None:
    shutil.rmtree(v1_store / "index")
    with maintenance.open_for_repair(v1_store) as s:
        assert s.repair().checkpoints == 3
        for step, state in expected_states():
            assert _same(state, s.load(step=step))
        s.save({"x": torch.ones(10)}, step=40)
        assert [i.step for i in s.list()] == [10, 20, 30, 40]


def write(dest: Path) -> None:  # pragma: no cover - run by hand once per format version
    if dest.exists():
        raise SystemExit(f"{dest} exists: fixtures are never rewritten")
    with deltackpt.Store(dest, chunk_size=4096, max_chain=4) as s:
        for step, state in expected_states():
            s.save(state, step=step, metadata={"fixture": "v1"})
    for junk in (dest / "index" / "lock.mdb",):
        junk.unlink(missing_ok=True)


def digests(obj: Any, path: str = "") -> dict[str, str]:
    """Every leaf of a state by key path: a tensor's or array's dtype, shape and SHA-256, else its repr."""
    if isinstance(obj, torch.Tensor):
        data = obj.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
        return {path: f"{obj.dtype} {tuple(obj.shape)} {hashlib.sha256(data).hexdigest()}"}
    if isinstance(obj, np.ndarray):
        return {path: f"{obj.dtype.str} {obj.shape} {hashlib.sha256(obj.tobytes()).hexdigest()}"}
    if isinstance(obj, dict):
        return {k: v for key, value in obj.items() for k, v in digests(value, f"{path}[{key!r}]").items()}
    if isinstance(obj, (list, tuple)):
        return {k: v for i, value in enumerate(obj) for k, v in digests(value, f"{path}[{i}]").items()}
    return {path: repr(obj)}


@pytest.fixture
def predicted_store(tmp_path: Path) -> Path:
    dest = tmp_path / "store-predicted"
    shutil.copytree(PREDICTED, dest)
    return dest


def test_predicted_store_loads_as_its_golden_digests(predicted_store: Path) -> None:
    golden = json.loads(GOLDEN.read_text())
    with deltackpt.Store(predicted_store) as s:
        infos = s.list()
        assert [[i.id, i.step, i.parent] for i in infos] == golden["lineage"]
        for i in infos:
            assert digests(s.load(id=i.id)) == golden["states"][i.id], i.step
        assert s.verify().ok


def test_bf16_predicted_store_loads_as_its_golden_digests(tmp_path: Path) -> None:
    """The bfloat16 fixture: predicted frames of both bfloat16 predictors (version 4, width 2) decode to the
    states as they were saved, also after a new save, a delete and gc."""
    dest = tmp_path / "s"
    shutil.copytree(PREDICTED_BF16, dest)
    golden = json.loads(GOLDEN_BF16.read_text())
    predictors = set()
    with deltackpt.Store(dest) as s:
        for _, loc in s.index.iter_chunks():
            if loc.codec == codec.PREDICTED:
                frame = bytes(s.reader.read(loc.pack_id, loc.offset, loc.frame_len))
                h = codec.parse_header(frame)
                rec = codec.prediction_record(frame[codec.HEADER_SIZE:], version=h.version)
                predictors.add((rec.predictor, h.version, h.width))
        assert predictors == {(predict.BF16 + predict.SECOND_MOMENT, 4, 2), (predict.BF16 + predict.PARAM, 4, 2)}
        _loads_as_golden_and_takes_changes(s, golden)


def _loads_as_golden_and_takes_changes(s: deltackpt.Store, golden: dict[str, Any]) -> None:
    """A fixture's checkpoints have the lineage and load as the states of its golden digests, verify clean, and
    still load so after a new save, a delete of the first and gc."""
    infos = s.list()
    assert [[i.id, i.step, i.parent] for i in infos] == golden["lineage"]
    for i in infos:
        assert digests(s.load(id=i.id)) == golden["states"][i.id], i.step
    assert s.verify().ok
    s.save(s.load(), step=99)
    s.delete(infos[0].step)
    s.gc()
    for i in infos[1:]:
        assert digests(s.load(id=i.id)) == golden["states"][i.id], i.step


def test_predicted_store_holds_every_kind_of_frame(predicted_store: Path) -> None:
    """What the fixture is for: predicted frames of each predictor (and so both of their frame versions), delta
    and standalone frames, and manifests of version 3."""
    predictors, codecs = set(), set()
    with deltackpt.Store(predicted_store) as s:
        for _, loc in s.index.iter_chunks():
            codecs.add(loc.codec)
            if loc.codec == codec.PREDICTED:
                frame = bytes(s.reader.read(loc.pack_id, loc.offset, loc.frame_len))
                h = codec.parse_header(frame)
                predictors.add((codec.prediction_record(frame[codec.HEADER_SIZE:], version=h.version).predictor,
                                h.version))
    assert predictors == {(predict.SECOND_MOMENT, 2), (predict.PARAM, 2), (predict.MOMENTUM_PARAM, 3)}
    assert {codec.PLANES_ZSTD, codec.DELTA, codec.PREDICTED} <= codecs
    versions = {manifest._HEAD.unpack_from(p.read_bytes())[1] for p in (predicted_store / "manifests").iterdir()}
    assert versions == {3}


def test_predicted_store_takes_new_saves_deletes_and_gc(predicted_store: Path) -> None:
    golden = json.loads(GOLDEN.read_text())
    with deltackpt.Store(predicted_store) as s:
        newest = s.load()
        s.save(newest, step=99)  # (descends from the newest: dedup against its chunks)
        assert s.list()[-1].written_bytes < 2000
        first = s.list()[0]
        s.delete(first.step)
        s.gc()
        for i in s.list()[:-1]:
            assert digests(s.load(id=i.id)) == golden["states"][i.id], i.step
        assert digests(s.load(step=99)) == digests(newest)
        assert s.verify().ok


def _dcp_fixture(fixture: Path, tmp_path: Path) -> Path:
    """A copy of a DCP root fixture (one step, one rank) with its two stores' indexes rebuilt: fixtures hold packs
    and manifests only."""
    root = tmp_path / "root"
    shutil.copytree(fixture, root)
    for store in ("meta", "rank-00000"):
        with maintenance.open_for_repair(root / store) as s:
            assert s.repair().checkpoints == 1
    return root


def dcp_meta3_skeleton_state() -> dict[str, Any]:
    return {"w": torch.arange(12, dtype=torch.float32).reshape(3, 4) / 8, "ints": torch.arange(5, dtype=torch.int64),
            "extra": {"step": 7, "name": "run"}}


def write_dcp_meta3_skeleton(dest: Path) -> None:  # pragma: no cover - was run once, with deltackpt at 77cf6fa
    import torch.distributed.checkpoint as dcp

    from deltackpt.distributed import DeltaStorageWriter
    dcp.save(dcp_meta3_skeleton_state(), storage_writer=DeltaStorageWriter(dest, step=7))
    for store in ("meta", "rank-00000"):
        shutil.rmtree(dest / store / "index")


def test_dcp_meta3_skeleton_document_loads(tmp_path: Path) -> None:
    """The first format-3 writers kept the DCP metadata document as a skeleton: it still loads, not 'malformed'."""
    import torch.distributed.checkpoint as dcp

    from deltackpt import distributed
    root = _dcp_fixture(DCP_META3_SKELETON, tmp_path)
    want = dcp_meta3_skeleton_state()
    got = {"w": torch.zeros(3, 4), "ints": torch.zeros(5, dtype=torch.int64), "extra": {"step": 0, "name": ""}}
    if not DCP_FLATTENS_VALUE_DICTS:  # torch 2.3 asks for "extra", saved as "extra.step" and "extra.name": tensors
        del got["extra"]  # alone (its dcp.load would drop the values anyway: DCP_LOADS_TOP_LEVEL_VALUES)
        want = {k: want[k] for k in got}
    dcp.load(got, storage_reader=distributed.DeltaStorageReader(root, step=7))
    assert _same(want, got)
    want = dcp_meta3_skeleton_state()
    assert [i.step for i in distributed.summary(root)] == [7]
    dcp.save(want, storage_writer=distributed.DeltaStorageWriter(root, step=8))  # a current save on top
    assert distributed.steps(root) == [7, 8]


def write_predicted(dest: Path) -> None:  # pragma: no cover - run by hand once
    """Five every-step saves of a small model trained with AdamW beside one trained with SGD with momentum, then
    a rollback to step 2 and two saves on that branch; the golden digests beside it."""
    if dest.exists() or GOLDEN.exists():
        raise SystemExit(f"{dest} or {GOLDEN} exists: fixtures are never rewritten")
    torch.manual_seed(0)
    adam_model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 16))
    sgd_model = torch.nn.Linear(32, 64)
    adam = torch.optim.AdamW(adam_model.parameters(), lr=1e-3, weight_decay=0.1)
    sgd = torch.optim.SGD(sgd_model.parameters(), lr=1e-2, momentum=0.9)

    def state() -> dict[str, Any]:
        for model, opt in ((adam_model, adam), (sgd_model, sgd)):
            model(torch.randn(16, 32)).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
        return {"model": adam_model.state_dict(), "optimizer": adam.state_dict(),
                "sgd": {"model": sgd_model.state_dict(), "optimizer": sgd.state_dict()},
                "arr": np.arange(10.0), "plain": {"name": "fixture", "big": 2**70}}

    saved: dict[str, dict[str, str]] = {}  # the digests of the states as they were saved
    with deltackpt.Store(dest, chunk_size=4096) as s:
        for step in range(5):
            st = state()
            saved[s.save(st, step=step, metadata={"fixture": "predicted"}).id] = digests(st)
        s.load(step=2)  # (the training state is not restored: the branch's states are new ones)
        for step in (3, 4):
            st = state()
            saved[s.save(st, step=step, metadata={"fixture": "predicted", "branch": True}).id] = digests(st)
        assert all(digests(s.load(id=i)) == d for i, d in saved.items())
        golden = {"lineage": [[i.id, i.step, i.parent] for i in s.list()], "states": saved}
    (dest / "index" / "lock.mdb").unlink(missing_ok=True)
    GOLDEN.write_text(json.dumps(golden, indent=1, sort_keys=True) + "\n")


def write_predicted_bf16(dest: Path) -> None:  # pragma: no cover - run by hand once
    """Six every-step saves of a small model trained in bfloat16 with AdamW (its optimizer state bfloat16 too);
    the golden digests beside it."""
    golden_path = dest.with_suffix(".json")
    if dest.exists() or golden_path.exists():
        raise SystemExit(f"{dest} or {golden_path} exists: fixtures are never rewritten")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 32)).bfloat16()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    saved: dict[str, dict[str, str]] = {}
    with deltackpt.Store(dest, chunk_size=4096) as s:
        for step in range(6):
            model(torch.randn(16, 32, dtype=torch.bfloat16)).float().pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
            st = {"model": model.state_dict(), "optimizer": opt.state_dict()}
            saved[s.save(st, step=step, metadata={"fixture": "predicted-bf16"}).id] = digests(st)
        assert all(digests(s.load(id=i)) == d for i, d in saved.items())
        golden = {"lineage": [[i.id, i.step, i.parent] for i in s.list()], "states": saved}
    (dest / "index" / "lock.mdb").unlink(missing_ok=True)
    golden_path.write_text(json.dumps(golden, indent=1, sort_keys=True) + "\n")


def write_update_chunks(dest: Path, tag: str) -> None:  # pragma: no cover - run by hand once per fixture
    """Six every-step saves of a small model whose matrices torch.optim.Muon trains and whose biases AdamW does,
    under a learning rate that decays at every step; the golden digests beside it. (Run with deltackpt at
    76ed8a5 for ``store-update-chunks``, tag "update-chunks"; since for ``store-update-param``.)"""
    golden_path = dest.with_suffix(".json")
    if dest.exists() or golden_path.exists():
        raise SystemExit(f"{dest} or {golden_path} exists: fixtures are never rewritten")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 32))
    opts = [torch.optim.Muon([p for p in model.parameters() if p.ndim == 2], lr=0.02, weight_decay=0.1),
            torch.optim.AdamW([p for p in model.parameters() if p.ndim < 2], lr=1e-3)]
    scheds = [torch.optim.lr_scheduler.LambdaLR(o, lambda s: 0.9**s) for o in opts]
    saved: dict[str, dict[str, str]] = {}
    with deltackpt.Store(dest, chunk_size=4096) as s:
        for step in range(6):
            model(torch.randn(16, 32)).pow(2).mean().backward()
            for o, sc in zip(opts, scheds):
                o.step()
                sc.step()
            model.zero_grad()
            st = {"model": model.state_dict(), "optimizer": [o.state_dict() for o in opts]}
            saved[s.save(st, step=step, metadata={"fixture": tag}).id] = digests(st)
        assert all(digests(s.load(id=i)) == d for i, d in saved.items())
        golden = {"lineage": [[i.id, i.step, i.parent] for i in s.list()], "states": saved}
    (dest / "index" / "lock.mdb").unlink(missing_ok=True)
    golden_path.write_text(json.dumps(golden, indent=1, sort_keys=True) + "\n")


@pytest.mark.parametrize(("fixture", "predictor"), [(UPDATE_CHUNKS, predict.MOMENTUM_PARAM),
                                                    (UPDATE_PARAM, predict.UPDATE_PARAM)])
def test_update_chunks_store_loads_as_its_golden_digests(tmp_path: Path, fixture: Path, predictor: int) -> None:
    """The Muon fixtures: momentum-param (frames v3) and update-param frames (v5) whose references are update
    chunks that no manifest lists decode to the states as they were saved; a repair from the packs finds those
    chunks again, and a new save, a delete and gc keep the rest loading."""
    dest = tmp_path / "s"
    shutil.copytree(fixture, dest)
    golden = json.loads(fixture.with_suffix(".json").read_text())
    with deltackpt.Store(dest) as s:
        listed = set().union(*(chunk_keys(*s.manifest(id=i.id).stored_chunks()) for i in s.list()))
        updates, predictors = set(), set()
        for k, loc in s.index.iter_chunks():
            if loc.codec != codec.PREDICTED or not (refs := set(s._references(k, loc)[1:]) - listed):
                continue
            updates |= refs
            frame = bytes(s.reader.read(loc.pack_id, loc.offset, loc.frame_len))
            h = codec.parse_header(frame)
            predictors.add(codec.prediction_record(frame[codec.HEADER_SIZE:], version=h.version).predictor)
        assert len(updates) >= 4 and predictors == {predictor}
    shutil.rmtree(dest / "index")
    with maintenance.open_for_repair(dest) as s:
        assert s.repair().checkpoints == 6
    with deltackpt.Store(dest) as s:
        _loads_as_golden_and_takes_changes(s, golden)


if __name__ == "__main__" and sys.argv[1:] == ["write-update-param"]:
    write_update_chunks(UPDATE_PARAM, "update-param")
if __name__ == "__main__" and sys.argv[1:] == ["write-predicted-bf16"]:
    write_predicted_bf16(PREDICTED_BF16)
if __name__ == "__main__" and sys.argv[1:] == ["write"]:
    write(FIXTURE)
if __name__ == "__main__" and sys.argv[1:] == ["write-predicted"]:
    write_predicted(PREDICTED)


def dcp_meta3_pickled_state() -> dict[str, Any]:
    rng = np.random.RandomState(7)  # (the state np.random.seed(7) gives the global generator)
    return {"w": torch.arange(12, dtype=torch.float32).reshape(3, 4) / 8, "np_rng": rng.get_state(),
            "pair": (torch.arange(4, dtype=torch.int16), "two"), "step": 7}


def write_dcp_meta3_pickled(dest: Path) -> None:  # pragma: no cover - was run once, with deltackpt at a246c38
    import torch.distributed.checkpoint as dcp

    from deltackpt.distributed import DeltaStorageWriter
    dcp.save(dcp_meta3_pickled_state(), storage_writer=DeltaStorageWriter(dest, step=7))
    for store in ("meta", "rank-00000"):
        shutil.rmtree(dest / store / "index")


@pytest.mark.skipif(not DCP_LOADS_TOP_LEVEL_VALUES, reason="torch < 2.4: dcp.load does not write the top-level "
                    "non-tensor values this test checks back into the caller's state dict")
@pytest.mark.skipif(int(np.__version__.split(".")[0]) < 2, reason="numpy < 2: the fixture's values were pickled by "
                    "numpy 2 (they reference numpy._core), and pickles of numpy 2 objects need numpy 2 to load")
def test_dcp_values_pickled_by_earlier_writers_load_as_before(tmp_path: Path) -> None:
    """A root whose NumPy RNG state and tensor-in-a-tuple an earlier writer kept pickled loads as it did: refused
    without allow_pickle, exact with it. A current save on top stores them as state trees (meta format 4), which
    load without pickle, and the old step still loads."""
    import warnings

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    from deltackpt import distributed
    root = _dcp_fixture(DCP_META3_PICKLED, tmp_path)
    want = dcp_meta3_pickled_state()

    def load(**kw: Any) -> dict[str, Any]:
        got = {"w": torch.zeros(3, 4), "np_rng": None, "pair": None, "step": 0}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dcp.load(got, storage_reader=distributed.DeltaStorageReader(root, **kw))
        return got

    def same(got: dict[str, Any]) -> bool:
        rng = np.random.RandomState()
        rng.set_state(got["np_rng"])
        return (torch.equal(got["w"], want["w"]) and got["step"] == 7 and got["np_rng"][0] == "MT19937"
                and np.array_equal(got["np_rng"][1], want["np_rng"][1]) and got["np_rng"][2:] == want["np_rng"][2:]
                and np.array_equal(rng.random_sample(5), np.random.RandomState(7).random_sample(5))
                and type(got["pair"]) is tuple and torch.equal(got["pair"][0], want["pair"][0])
                and got["pair"][1] == "two")

    with pytest.raises(CheckpointException, match="saved pickled"):
        load(step=7)
    assert same(load(step=7, allow_pickle=True))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(want, storage_writer=distributed.DeltaStorageWriter(root, step=8))
    assert same(load(step=8)) and same(load(step=7, allow_pickle=True))
    with deltackpt.Store(root / "meta") as meta:
        assert [i.metadata["format"] for i in meta.list()] == [3, 4]
    assert distributed.verify_names(root) == []
