"""CUDA paths: saving device tensors through the pinned staging buffer, map_location on load.

These run only where CUDA is available; elsewhere they skip. The CPU-only parts (map_location arguments, a
CUDA checkpoint refused without CUDA) run everywhere.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import deltackpt
from deltackpt import manifest

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _fake_cuda_checkpoint(path: Path) -> None:
    """A checkpoint whose tensor records device cuda:0, made on the CPU by editing the manifest entry."""
    with deltackpt.Store(path, chunk_size=4096) as s:
        info = s.save({"w": torch.arange(10.0)}, step=1)
        rec = s.index.get(id=info.id)
        m = s.manifest(id=info.id)
        m.tensors[0].device = "cuda:0"
        data = m.to_bytes()
        (path / "manifests" / f"{info.id}.manifest").write_bytes(data)
        rec.manifest_checksum = manifest.checksum_of(data)
        s.index.commit_checkpoint(rec, {}, replace=rec)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA error")
def test_cuda_checkpoint_without_cuda_needs_map_location(tmp_path: Path) -> None:
    _fake_cuda_checkpoint(tmp_path / "s")
    with deltackpt.Store(tmp_path / "s") as s:
        # typed, and saying which side named the device (it was a plain RuntimeError)
        with pytest.raises(deltackpt.UnsupportedTypeError,
                           match="holds a tensor on device 'cuda:0', and CUDA is not available: pass map_location"):
            s.load()
        assert torch.equal(s.load(map_location="cpu")["w"], torch.arange(10.0))
        assert torch.equal(s.load(map_location={"cuda:0": "cpu"})["w"], torch.arange(10.0))
        with pytest.raises(TypeError):
            s.load(map_location=3.5)


@cuda
def test_cuda_tensors_round_trip_and_map_location(tmp_path: Path) -> None:
    g = torch.Generator(device="cuda").manual_seed(0)
    state = {"w": torch.randn(3000, 700, device="cuda", generator=g), "b": torch.arange(5, device="cuda"),
             "cpu": torch.ones(3)}
    with deltackpt.Store(tmp_path / "s", chunk_size=1 << 16) as s:
        s.save(state, step=1)
        state["w"][0] += 1  # a second save: deltas against the cached bases, from device memory
        s.save(state, step=2)
        out = s.load()
        assert out["w"].device.type == "cuda" and out["cpu"].device.type == "cpu"
        assert torch.equal(out["w"], state["w"]) and torch.equal(out["b"], state["b"])
        cpu = s.load(step=1, map_location="cpu")
        assert cpu["w"].device.type == "cpu"
        target = {"w": torch.empty_like(state["w"]), "b": torch.empty_like(state["b"]), "cpu": torch.empty(3)}
        s.load_into(target, step=2)
        assert torch.equal(target["w"], state["w"])


@cuda
def test_dcp_shards_on_the_gpu_save_and_load_into_gpu_targets(tmp_path: Path) -> None:
    """deltackpt.distributed with CUDA tensors: the writer stages them through the host, the reader copies the
    decoded shards into CUDA targets."""
    import warnings

    import torch.distributed.checkpoint as dcp

    from deltackpt.distributed import DeltaStorageReader, DeltaStorageWriter

    g = torch.Generator().manual_seed(0)
    state = {"w": torch.randn(300, 200, generator=g).cuda(), "b": torch.randn(200, generator=g).cuda(), "n": 3}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(state, storage_writer=DeltaStorageWriter(tmp_path / "ckpt", step=1))
        target = {"w": torch.zeros(300, 200, device="cuda"), "b": torch.zeros(200, device="cuda"), "n": 0}
        dcp.load(target, storage_reader=DeltaStorageReader(tmp_path / "ckpt"))
    assert target["w"].is_cuda and torch.equal(target["w"], state["w"]) and torch.equal(target["b"], state["b"])
    assert target["n"] == 3


@cuda
def test_load_decodes_into_offered_cuda_tensors(tmp_path: Path) -> None:
    """A CUDA model offered to load(into=...) is filled through a pinned host buffer; the state holds its tensors."""
    torch.manual_seed(0)
    src = torch.nn.Linear(300, 200)
    with deltackpt.Store(tmp_path / "s", chunk_size=1 << 14) as s:
        s.save({"model": src.state_dict()}, step=1)
        dst = torch.nn.Linear(300, 200).cuda()
        mine = dst.state_dict()
        state = s.load(into={"model": mine}, map_location="cpu")
        for k, v in mine.items():
            assert state["model"][k] is v and v.device.type == "cuda"
            assert torch.equal(v.cpu(), src.state_dict()[k]), k


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_a_state_spread_over_two_gpus_saves_async_and_loads_back_exactly(tmp_path: Path) -> None:
    """A model split over cuda:0 and cuda:1 in one process (the current device is cuda:0): the async snapshot's
    device-to-host copies from cuda:1, and the copies into offered cuda:1 tensors on load, are waited for on
    their own device (a bare ``torch.cuda.synchronize()`` waits for the current device only)."""
    g = torch.Generator().manual_seed(0)
    torch.cuda.set_device(0)
    state = {"a": torch.randn(4096, 1024, generator=g).to("cuda:0"),
             "b": torch.randn(4096, 1024, generator=g).to("cuda:1")}
    want = {k: v.cpu() for k, v in state.items()}
    with deltackpt.Store(tmp_path / "s", chunk_size=1 << 20) as s:
        ckpt = deltackpt.Checkpointer(s, model=torch.nn.ParameterDict(
            {k: torch.nn.Parameter(v, requires_grad=False) for k, v in state.items()}), async_save=True,
            handle_signals=False)
        with ckpt:
            assert ckpt.step(1)
        offered = {k: torch.empty_like(v) for k, v in state.items()}
        out = s.load(into={"model": offered})
        for k in state:
            assert out["model"][k] is offered[k] and offered[k].device == state[k].device
            assert torch.equal(offered[k].cpu(), want[k]), k


@cuda
def test_an_async_save_records_the_device_its_tensors_were_on(tmp_path: Path) -> None:
    """An async save stores the pinned host copies of CUDA tensors; the checkpoint records the device they were
    copied from, as a synchronous save does (it recorded "cpu", and loads put them on the CPU)."""
    model = torch.nn.Linear(16, 8).cuda()
    for async_save, path in ((False, tmp_path / "sync"), (True, tmp_path / "async")):
        with deltackpt.Checkpointer(path, model=model, async_save=async_save, handle_signals=False) as ckpt:
            ckpt.save(1, wait=True)
        with deltackpt.Store(path) as s:
            m = s.manifest(1)
            assert {t.device for t in m.tensors if t.key.startswith("model")} == {"cuda:0"}, async_save
            loaded = s.load(1)["model"]
            assert all(v.device.type == "cuda" for v in loaded.values())
            assert all(torch.equal(v, model.state_dict()[k]) for k, v in loaded.items())


@cuda
def test_restore_with_map_location_on_the_gpu_puts_the_rng_states_back(tmp_path: Path) -> None:
    """Checkpointer(map_location="cuda") loads the whole checkpoint there, the RNG states too, which torch sets
    only from CPU tensors: restore() raised TypeError after the model and optimizer were restored."""
    model = torch.nn.Linear(4, 2).cuda()
    torch.manual_seed(5)
    torch.cuda.manual_seed(6)
    with deltackpt.Checkpointer(tmp_path / "s", model=model, async_save=False, handle_signals=False) as ckpt:
        ckpt.save(1)
        expected = torch.rand(3), torch.rand(3, device="cuda")
    torch.manual_seed(50)
    torch.cuda.manual_seed(60)
    with deltackpt.Checkpointer(tmp_path / "s", model=model, handle_signals=False, map_location="cuda") as ckpt:
        assert ckpt.restore() == 1
        got = torch.rand(3), torch.rand(3, device="cuda")
    assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])


@cuda
def test_close_frees_the_pinned_staging_buffer(tmp_path: Path) -> None:
    """A save of GPU tensors copies them through a pinned host buffer of the largest one's size, which the
    handle kept after close() for as long as anything referred to the handle (``ckpt.store`` of a closed
    Checkpointer): page-locked memory the system cannot page out. close() drops it, as the other caches."""
    import gc
    import weakref

    s = deltackpt.Store(tmp_path / "s")
    s.save({"w": torch.randn(1 << 20, device="cuda")}, step=1)
    buf = s._pinned._buf
    assert buf is not None and buf.is_pinned()
    ref = weakref.ref(buf)
    del buf
    s.close()
    gc.collect()
    assert ref() is None
    with deltackpt.Store(tmp_path / "s") as s2:
        assert s2.load(map_location="cpu")["w"].shape == (1 << 20,)


@cuda
def test_an_async_snapshot_of_odd_cuda_tensors_holds_what_they_held_at_step(tmp_path: Path) -> None:
    """Non-contiguous, bfloat16, 0-dim and empty CUDA tensors: an async save records what they held when step()
    returned, though the loop changes them at once (the snapshot's copies to the host completed first)."""
    g = torch.Generator(device="cuda").manual_seed(0)
    odd = {"t": torch.randn(64, 48, device="cuda", generator=g).t(),
           "bf": torch.randn(1000, device="cuda", generator=g).bfloat16()[::3],
           "s": torch.tensor(3.5, device="cuda"), "e": torch.empty(0, 4, device="cuda")}
    want = {k: v.cpu().clone() for k, v in odd.items()}
    with deltackpt.Checkpointer(tmp_path / "s", extra={"odd": odd}, async_save=True, handle_signals=False) as ck:
        ck.step(1)
        for v in odd.values():
            v.add_(1)
        ck.wait()
    with deltackpt.Store(tmp_path / "s") as s:
        got = s.load(map_location="cpu")["extra"]["odd"]
    for k, v in want.items():
        assert got[k].dtype == v.dtype and got[k].shape == v.shape and torch.equal(got[k], v), k
