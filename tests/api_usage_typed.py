"""The public API as the README uses it, for ``mypy --strict`` (``make lint``): each result is checked against
the type a user would write down (``assert_type``: exactly that type), so an annotation that turns into ``Any``,
a union or a wrong type fails the lint.

Never run: only type-checked (pytest does not collect it; nothing here is called).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, assert_type

import torch
import torch.distributed.checkpoint as dcp

import deltackpt
from deltackpt import distributed
from deltackpt.data import ResumableLoader, ResumableSampler, SeededDataset
from deltackpt.distributed import DeltaStorageReader, DeltaStorageWriter, StepInfo
from deltackpt.errors import CheckpointNotFoundError, CorruptChunkError
from deltackpt.maintenance import GcReport, RepairReport, VerifyReport, open_for_repair


def store_usage(model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    backend: str = deltackpt.backend
    store = deltackpt.Store("ckpts", chunk_size=1 << 20, zstd_level=1, threads=2)
    state = {"model": model.state_dict(), "optimizer": opt.state_dict(), "step": 1200}
    info: deltackpt.CheckpointInfo = store.save(state, step=1200, metadata={"loss": 2.31})
    cid: str = info.id
    step: int = info.step
    written: int = info.written_bytes
    loaded = store.load(step=1200, map_location="cpu")
    store.load(into={"model": model.state_dict()})
    missing = store.load_into({"model": model.state_dict()}, step=1200, strict=False)
    assert_type(missing, list[str])
    infos = assert_type(store.list(), list[deltackpt.CheckpointInfo])
    one = assert_type(store.info(1200), deltackpt.CheckpointInfo)
    latest = assert_type(store.latest(), deltackpt.CheckpointInfo | None)
    report = assert_type(store.verify(progress=lambda done, total: None), VerifyReport)
    ok: bool = report.ok
    store.delete(1200)
    gc = assert_type(store.gc(repack_below=0.3, timeout=5.0), GcReport)
    freed: int = gc.freed_bytes
    kept = assert_type(store.retain(deltackpt.Retention(keep_last=5), dry_run=True), list[deltackpt.CheckpointInfo])
    for kept_info in store.retain(deltackpt.Retention(keep_last=5, keep_every=1000)):
        print(kept_info.step)
    with deltackpt.Store("ckpts2") as other:
        other.list()
    with open_for_repair("ckpts") as damaged:
        repaired = assert_type(damaged.repair(), RepairReport)
        print(repaired)
    try:
        store.load(step=5)
    except CheckpointNotFoundError as exc:
        print(exc)
    except CorruptChunkError as exc:
        print(exc)
    deltackpt.unregister_type(Path)
    print(backend, cid, step, written, loaded, infos, one, latest, ok, freed, kept)


def train(model: torch.nn.Module, opt: torch.optim.Optimizer, sched: torch.optim.lr_scheduler.LRScheduler,
          dataset: torch.utils.data.TensorDataset) -> None:
    sampler = ResumableSampler(dataset, shuffle=True, seed=0)
    loader = ResumableLoader(torch.utils.data.DataLoader(dataset, batch_size=32, sampler=sampler))
    seeded = SeededDataset(dataset, seed=0)
    assert_type(seeded.sample_seed(0, 3), int)
    ResumableLoader(torch.utils.data.DataLoader(seeded, batch_size=32, sampler=ResumableSampler(seeded)))
    ckpt = deltackpt.Checkpointer("ckpts", model=model, optimizer=opt, scheduler=sched, data=loader,
                                  extra={"cfg": {"lr": 3e-4}}, every_n_steps=10, async_save=True,
                                  retention=deltackpt.Retention(keep_last=5, keep_every=1000))
    start = assert_type(ckpt.restore(), int)
    step = start
    for _batch in loader:
        step += 1
        saved = assert_type(ckpt.step(step), bool)
        print(saved)
    ckpt.save(step, wait=True)
    committed = assert_type(ckpt.wait(), deltackpt.CheckpointInfo | None)
    staged = assert_type(ckpt.staging_bytes, int)
    captured = assert_type(ckpt.capture(step), dict[str, Any])
    assert_type(ckpt.apply(captured), int)
    infos = assert_type(ckpt.store, deltackpt.Store).list()
    print(committed, staged)
    ckpt.close()
    with deltackpt.Checkpointer("ckpts", model={"encoder": model, "head": model}, scaler=[]) as again:
        again.restore(strict=False)
    with deltackpt.Checkpointer("ckpts", model=model, optimizer=opt, rank=1) as follower:  # (a DDP rank)
        kept: bool = follower.step(1)
        print(kept, follower.rank)
    deltackpt.Checkpointer("ckpts", model=model, rank="1")  # type: ignore[arg-type]
    # what is not stateful is refused by the type checker too (an unused ignore fails under --strict)
    deltackpt.Checkpointer("ckpts", model=42)  # type: ignore[arg-type]
    deltackpt.Checkpointer("ckpts", optimizer=[opt, "lr"])  # type: ignore[list-item]
    deltackpt.Retention(keep_best=("loss", "min"), best_k=3)
    deltackpt.Retention(keep_best=("loss", "lowest"))  # type: ignore[arg-type]
    print(infos)


def sharded(model: torch.nn.Module) -> None:
    start = 0
    if (Path("ckpts") / "meta").exists() and distributed.steps("ckpts"):
        dcp.load({"model": model.state_dict()}, storage_reader=DeltaStorageReader("ckpts"))
        start = distributed.steps("ckpts")[-1] + 1
    dcp.save({"model": model.state_dict()}, storage_writer=DeltaStorageWriter("ckpts", step=start))
    steps = assert_type(distributed.summary("ckpts"), list[StepInfo])
    distributed.retain("ckpts", deltackpt.Retention(keep_last=2))
    distributed.delete("ckpts", 3)
    dropped = assert_type(distributed.prune("ckpts"), int)
    assert_type(distributed.stores("ckpts"), list[Path])
    assert_type(distributed.missing_stores("ckpts"), list[int])
    print(steps, dropped, deltackpt.__version__)
