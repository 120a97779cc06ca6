"""The workloads: sequences of training states to checkpoint, all generated locally on the CPU.

A workload yields ``(step, state)`` pairs. As in a real training loop the tensors of a state are mutated in
place between yields; a system must have finished reading them when its ``save`` returns (async systems
take their own copy first). Every call of :meth:`Workload.states` replays the same trajectory, so each
system sees identical bytes.

Training workloads whose steps are expensive (a, b) are run once by :meth:`Workload.prepare`, which records
the states to raw snapshot files; :meth:`Workload.states` then replays them by reading the bytes back into
the same tensors. Cheap workloads (c-f) regenerate their trajectory in every cell from fixed seeds.

(a) ``a1`` / ``a10``  dense AdamW training of a GPT-style transformer, saved every step / every 10 steps
(b) ``b``              LoRA fine-tuning: the same transformer frozen, adapters and their AdamW state train
(c) ``c``              an embedding table of >= 1M rows (sparse gradients, Adagrad) plus a dense tower
(d) ``d``              mixed precision: bf16 weights, fp32 master weights and AdamW moments
(e) ``e``              an unchanged state saved again (the floor: one hashing pass)
(f) ``f256m`` ...      scaling: fp32 states of 0.25 / 1 / 4 GB, a quarter of the tensors changing per save
    ``f1000``          a store with 1,000 checkpoints: open, list, load latest
"""

from __future__ import annotations

import functools
import json
import math
import os
import pickle
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.util import GB, MB, Slot, map_tree, median, walk

FULL, QUICK = "full", "quick"


@dataclass
class Workload:
    name: str
    group: str
    title: str
    saves: int
    load_reps: tuple[int, int] = (3, 3)  # repetitions of the latest / oldest load
    interval_s: float = 0.5  # compute between saves that the async rows simulate (sleep), when not recorded
    kind: str = "trajectory"  # or "many" (f1000)
    prepare_key: str | None = None  # recorded workloads sharing one recording
    params: dict[str, Any] = field(default_factory=dict)

    # -- interface ------------------------------------------------------------------------------------------
    def prepare(self, root: Path) -> dict[str, Any]:
        """Record the trajectory under ``root`` (recorded workloads only); returns facts about it."""
        return {}

    gen_threads: int = 0  # torch threads while generating (training) states; 0: leave as is
    max_interval_s: float = 3.0
    skip: tuple[str, ...] = ()  # systems not run on this workload (time budget of the big states)

    def states(self, root: Path) -> Iterator[tuple[int, Any]]:
        """The trajectory. Generation runs with ``gen_threads`` torch threads (1: on a shared, oversubscribed
        machine two spinning OpenMP threads make training steps 5-10x slower); the saves measured between two
        yields run with the process default."""
        gen = self._states(root)
        while True:
            with self.generating():
                try:
                    item = next(gen)
                except StopIteration:
                    return
            yield item

    @contextmanager
    def generating(self) -> Iterator[None]:
        if not self.gen_threads:
            yield
            return
        import torch

        prev = torch.get_num_threads()
        torch.set_num_threads(self.gen_threads)
        try:
            yield
        finally:
            torch.set_num_threads(prev)

    def _states(self, root: Path) -> Iterator[tuple[int, Any]]:
        raise NotImplementedError

    def describe(self) -> dict[str, Any]:
        return {"name": self.name, "group": self.group, "title": self.title, "saves": self.saves,
                "load_reps": list(self.load_reps), "kind": self.kind, **self.params}

    def async_interval(self, root: Path) -> float:
        """Seconds of simulated compute between two saves in the async rows."""
        return self.interval_s


# -- recorded training trajectories --------------------------------------------------------------------------
def _torch_dtype(name: str) -> Any:
    import torch

    return getattr(torch, name)


def write_snapshot(root: Path, step: int, state: Any) -> None:
    """Write ``state`` as ``<step>.pkl`` (the skeleton, tensors replaced by Slots) and ``<step>.bin``."""
    from bench.util import is_tensor, tensor_bytes

    tensors: list[Any] = []

    def slot(x: Any) -> Any:
        if is_tensor(x):
            tensors.append(x)
            return Slot(len(tensors) - 1, str(x.dtype).removeprefix("torch."), tuple(x.shape))
        return x

    skel = map_tree(state, slot)
    with open(root / f"{step}.pkl", "wb") as f:
        pickle.dump(skel, f, protocol=pickle.HIGHEST_PROTOCOL)
    with open(root / f"{step}.bin", "wb") as f:
        for t in tensors:
            f.write(memoryview(tensor_bytes(t)))
        f.flush()
        os.fsync(f.fileno())  # no write-back of snapshots while the systems are being timed


def _fill(tensors: list[Any], x: Any) -> Any:
    return tensors[x.index] if isinstance(x, Slot) else x


def replay(root: Path, steps: list[int]) -> Iterator[tuple[int, Any]]:
    """Yield the recorded states of ``steps``, reading each snapshot into the same tensors."""
    import torch

    from bench.util import tensor_bytes

    tensors: list[Any] | None = None
    for step in steps:
        with open(root / f"{step}.pkl", "rb") as f:
            skel = pickle.load(f)  # noqa: S301 - our own file, written by write_snapshot
        slots = [x for _, x in walk(skel) if isinstance(x, Slot)]
        if tensors is None:
            tensors = [torch.empty(s.shape, dtype=_torch_dtype(s.dtype)) for s in slots]
        with open(root / f"{step}.bin", "rb", buffering=0) as f:
            for t in tensors:
                view = memoryview(tensor_bytes(t))
                pos = 0
                while pos < len(view):
                    n = f.readinto(view[pos:])
                    if not n:
                        raise EOFError(f"snapshot {root / f'{step}.bin'} is truncated")
                    pos += n
        yield step, map_tree(skel, functools.partial(_fill, tensors))


@dataclass
class GPTTraining(Workload):
    """(a)/(b): real forward/backward/AdamW steps of a small GPT on random token ids, recorded once."""

    keep: list[int] = field(default_factory=list)  # the steps this workload saves
    record_steps: list[int] = field(default_factory=list)  # every step the shared recording keeps
    model_cfg: dict[str, int] = field(default_factory=dict)
    batch: int = 2
    lora_rank: int = 0
    steps_between: int = 1

    def _build(self) -> tuple[Any, Any]:
        import torch

        from bench.models import GPT, GPTConfig, add_lora

        torch.manual_seed(0)
        model = GPT(GPTConfig(**self.model_cfg))
        if self.lora_rank:
            add_lora(model, self.lora_rank)
        trainable = [p for p in model.parameters() if p.requires_grad]
        opt = torch.optim.AdamW(trainable, lr=3e-4 if self.lora_rank else 1e-4, weight_decay=0.1)
        return model, opt

    def prepare(self, root: Path) -> dict[str, Any]:
        with self.generating():
            return self._prepare(root)

    def _prepare(self, root: Path) -> dict[str, Any]:
        import torch

        from bench.models import train_step

        root.mkdir(parents=True, exist_ok=True)
        model, opt = self._build()
        n_params = sum(p.numel() for p in model.parameters())
        n_train = sum(p.numel() for p in model.parameters() if p.requires_grad)
        gen = torch.Generator().manual_seed(1)
        times, losses = [], []
        keep = set(self.record_steps)
        t_rec = time.perf_counter()
        for step in range(1, max(keep) + 1):
            t0 = time.perf_counter()
            losses.append(train_step(model, opt, gen, self.batch))
            times.append(time.perf_counter() - t0)
            if step in keep:
                write_snapshot(root, step, {"model": model.state_dict(), "optimizer": opt.state_dict(),
                                            "step": step})
        info = {"params": n_params, "trainable_params": n_train, "frozen_fraction": 1 - n_train / n_params,
                "train_step_s": median(times[1:] or times), "first_loss": losses[0], "last_loss": losses[-1],
                "record_s": time.perf_counter() - t_rec}
        (root / "info.json").write_text(json.dumps(info))
        return info

    def _states(self, root: Path) -> Iterator[tuple[int, Any]]:
        return replay(root, self.keep)

    def async_interval(self, root: Path) -> float:
        try:
            step_s = json.loads((root / "info.json").read_text())["train_step_s"]
        except (OSError, ValueError, KeyError):
            return self.interval_s
        return min(self.max_interval_s, step_s * self.steps_between)


# -- (c) embedding table with sparse updates -----------------------------------------------------------------
@dataclass
class Embedding(Workload):
    rows: int = 1 << 20
    dim: int = 64
    batch: int = 4096
    steps_per_save: int = 5

    def _states(self, root: Path) -> Iterator[tuple[int, Any]]:
        import numpy as np
        import torch
        import torch.nn.functional as F
        from torch import nn

        torch.manual_seed(0)
        emb = nn.Embedding(self.rows, self.dim, sparse=True)
        nn.init.normal_(emb.weight, std=0.01)
        tower = nn.Sequential(nn.Linear(self.dim, 64), nn.ReLU(), nn.Linear(64, 1))
        opt_sparse = torch.optim.Adagrad(emb.parameters(), lr=0.05)
        opt_dense = torch.optim.Adam(tower.parameters(), lr=1e-3)
        rng = np.random.default_rng(0)
        gen = torch.Generator().manual_seed(1)
        step = 0
        for _ in range(self.saves):
            touched: set[int] = set()
            for _ in range(self.steps_per_save):
                # Zipf-distributed ids, hashed over the table as recommendation models do with raw ids
                z = np.minimum(rng.zipf(1.1, size=self.batch), 1 << 31).astype(np.int64)
                ids = torch.from_numpy((z * 2654435761) % self.rows)
                touched.update(ids.tolist())
                y = torch.randn(self.batch, 1, generator=gen)
                loss = F.mse_loss(tower(emb(ids)), y)
                loss.backward()
                opt_sparse.step()
                opt_dense.step()
                opt_sparse.zero_grad(set_to_none=True)
                opt_dense.zero_grad(set_to_none=True)
                step += 1
            self.params["rows_touched_per_save"] = len(touched)
            yield step, {
                "model": {"embedding": emb.state_dict(), "tower": tower.state_dict()},
                "optimizer": {"sparse": opt_sparse.state_dict(), "dense": opt_dense.state_dict()},
                "step": step,
            }


# -- (d) mixed precision -------------------------------------------------------------------------------------
@dataclass
class MixedPrecision(Workload):
    """bf16 model weights, fp32 master weights and AdamW moments; one real AdamW step per save on
    synthetic (random) gradients, then the bf16 weights are re-cast from the masters."""

    model_cfg: dict[str, int] = field(default_factory=dict)

    def _states(self, root: Path) -> Iterator[tuple[int, Any]]:
        import torch

        from bench.models import GPTConfig, param_shapes

        shapes = param_shapes(GPTConfig(**self.model_cfg))
        self.params["params"] = sum(math.prod(s) for s in shapes.values())
        torch.manual_seed(0)
        master = {k: torch.nn.Parameter(torch.randn(s) * 0.02) for k, s in shapes.items()}
        opt = torch.optim.AdamW(list(master.values()), lr=1e-4, weight_decay=0.1, foreach=True)
        weights = {k: p.detach().to(torch.bfloat16) for k, p in master.items()}
        gen = torch.Generator().manual_seed(1)
        for step in range(1, self.saves + 1):
            for p in master.values():
                p.grad = torch.randn(p.shape, generator=gen).mul_(1e-2)
            opt.step()
            opt.zero_grad(set_to_none=True)
            with torch.no_grad():
                for k, p in master.items():
                    weights[k].copy_(p)
            yield step, {
                "model": weights,
                "master": {k: p.detach() for k, p in master.items()},
                "optimizer": opt.state_dict(),
                "step": step,
            }


# -- (e) unchanged -------------------------------------------------------------------------------------------
def _random_tensors(total_bytes: int, n: int, seed: int = 0) -> list[Any]:
    """``n`` fp32 tensors of about ``total_bytes`` in all: one random block, scaled differently per tensor
    (cheap to make, incompressible mantissas, no two chunks alike)."""
    import torch

    per = max(1, total_bytes // (4 * n))
    base = torch.randn(per, generator=torch.Generator().manual_seed(seed))
    return [base * (1.0 + (i + 1) * 1e-3) for i in range(n)]


@dataclass
class Unchanged(Workload):
    nbytes: int = 512 * 1_000_000
    tensors: int = 16

    def _states(self, root: Path) -> Iterator[tuple[int, Any]]:
        ts = _random_tensors(self.nbytes, self.tensors)
        state = {"model": {f"layer{i}.weight": t for i, t in enumerate(ts)}, "step": 0}
        for step in range(1, self.saves + 1):
            yield step, state


# -- (f) scaling ---------------------------------------------------------------------------------------------
@dataclass
class Scaling(Workload):
    nbytes: int = 1_000_000_000
    tensor_bytes: int = 32 * 1_000_000
    changed_fraction: float = 0.25

    def _states(self, root: Path) -> Iterator[tuple[int, Any]]:
        import torch

        n = max(1, round(self.nbytes / self.tensor_bytes))
        ts = _random_tensors(self.nbytes, n)
        state = {"model": {f"t{i:04d}": t for i, t in enumerate(ts)}, "step": 0}
        per_save = max(1, round(n * self.changed_fraction))
        for k in range(self.saves):
            if k:
                with torch.no_grad():
                    for j in range(per_save):
                        ts[((k - 1) * per_save + j) % n].mul_(1.0 + 1e-6)  # small update: low bits change
            state["step"] = k + 1
            yield k + 1, state


@dataclass
class ManyCheckpoints(Workload):
    """A store holding ``count`` checkpoints of a small state; measures open, list and load of the latest."""

    count: int = 1000
    kind: str = "many"
    tensors: int = 8
    tensor_bytes: int = 256 * 1024

    def _states(self, root: Path) -> Iterator[tuple[int, Any]]:
        import torch

        ts = _random_tensors(self.tensors * self.tensor_bytes, self.tensors)
        state = {"model": {f"t{i}": t for i, t in enumerate(ts)}, "step": 0}
        for k in range(self.count):
            if k:
                with torch.no_grad():
                    ts[k % len(ts)].mul_(1.0 + 1e-6)
            state["step"] = k + 1
            yield k + 1, state


# -- the suite -----------------------------------------------------------------------------------------------
def suite(mode: str) -> list[Workload]:
    """Every workload of ``mode`` (quick: tiny states that check the code paths; full: the measurement)."""
    quick = mode == QUICK
    if quick:
        gpt = {"d_model": 128, "n_layers": 6, "n_heads": 4, "vocab": 2048, "ctx": 32}  # 1.7M parameters
        n1, n10, nb, reps, gap = 3, 3, 3, (1, 1), 0.05
    else:
        gpt = {"d_model": 512, "n_layers": 14, "n_heads": 8, "vocab": 8192, "ctx": 64}  # 52.5M parameters
        n1, n10, nb, reps, gap = 4, 3, 4, (2, 2), 0.5
    a10 = [10 * (i + 1) for i in range(n10)]
    a1 = [a10[-1] + i + 1 for i in range(n1)]  # every step, after the every-10 ones (past the first steps)
    rec = a10 + a1
    lora = [2 + i + 1 for i in range(nb)]
    common: dict[str, Any] = {"load_reps": reps, "interval_s": gap}
    out: list[Workload] = [
        GPTTraining("a1", "a", "dense AdamW training of a GPT, saved every step", saves=n1, prepare_key="gpt",
                    keep=a1, record_steps=rec, model_cfg=gpt, steps_between=1, **common),
        GPTTraining("a10", "a", "dense AdamW training of a GPT, saved every 10 steps", saves=n10,
                    prepare_key="gpt", keep=a10, record_steps=rec, model_cfg=gpt, steps_between=10, **common),
        GPTTraining("b", "b", "LoRA fine-tuning, frozen backbone, saved every step", saves=nb,
                    prepare_key="lora", keep=lora, record_steps=lora, model_cfg=gpt, lora_rank=8,
                    steps_between=1, **common),
        Embedding("c", "c", "embedding table, sparse row updates (Adagrad)", saves=3 if quick else 4,
                  rows=100_000 if quick else 1 << 20, dim=32 if quick else 64, batch=1024 if quick else 4096,
                  steps_per_save=3 if quick else 5, **common),
        MixedPrecision("d", "d", "mixed precision: bf16 weights, fp32 master + AdamW moments",
                       saves=3 if quick else 4, model_cfg=gpt, **common),
        Unchanged("e", "e", "unchanged state saved again", saves=3,
                  nbytes=(32 if quick else 512) * 1_000_000, **common),
    ]
    if quick:
        out.append(Scaling("f64m", "f", "scaling: 64 MB fp32 state, 1/4 of tensors change per save", saves=3,
                           nbytes=64 * 1_000_000, tensor_bytes=4 * 1_000_000, **common))
        out.append(ManyCheckpoints("f50", "f", "a store with 50 checkpoints: open, list, load latest",
                                   saves=50, count=50, load_reps=(2, 1)))
    else:
        big = ("torch.save", "deltackpt-dedup-async")  # the least informative rows, skipped for time
        for label, size, saves, lr, tb, skip in (
            ("f256m", 256 * MB, 4, (3, 2), 16 * MB, ()),
            ("f1g", 1 * GB, 3, (2, 1), 32 * MB, big),
            ("f4g", 4 * GB, 3, (1, 1), 64 * MB, big),
        ):
            out.append(Scaling(label, "f", f"scaling: {label[1:].upper()}B fp32 state, 1/4 of tensors change "
                               "per save", saves=saves, load_reps=lr, interval_s=1.0, nbytes=int(size),
                               tensor_bytes=int(tb), skip=skip))
        out.append(ManyCheckpoints("f1000", "f", "a store with 1,000 checkpoints: open, list, load latest",
                                   saves=1000, count=1000, load_reps=(5, 3)))
    for w in out:
        w.gen_threads = 1  # generation is not measured; one thread keeps it fast on a busy machine
        if quick:
            w.max_interval_s = 0.05
        w.params.update({k: v for k, v in vars(w).items()
                         if k in ("rows", "dim", "batch", "steps_per_save", "nbytes", "tensor_bytes", "count",
                                  "changed_fraction", "lora_rank", "model_cfg", "keep")})
    return out


def select(workloads: list[Workload], only: str | None) -> list[Workload]:
    """Workloads whose name or group is in the comma-separated ``only`` (all when None)."""
    if not only:
        return workloads
    tokens = [t.strip() for t in only.split(",") if t.strip()]
    known = {w.name for w in workloads} | {w.group for w in workloads}
    unknown = [t for t in tokens if t not in known]
    if unknown:
        raise SystemExit(f"unknown workload(s) {unknown}; known: {sorted(known)}")
    return [w for w in workloads if w.name in tokens or w.group in tokens]


def override_saves(workloads: list[Workload], saves: int) -> None:
    """--saves: shorten (or lengthen) every trajectory; recordings follow."""
    for w in workloads:
        if w.kind == "many":
            w.saves = w.count = max(2, saves) if isinstance(w, ManyCheckpoints) else saves
            w.params["count"] = w.saves
            continue
        w.saves = max(1, saves)
        if isinstance(w, GPTTraining):
            w.keep = w.keep[: w.saves] if len(w.keep) >= w.saves else w.keep
            w.saves = len(w.keep)
            w.params["keep"] = w.keep
    # shared recordings keep the union of what their workloads need
    by_key: dict[str, list[GPTTraining]] = {}
    for w in workloads:
        if isinstance(w, GPTTraining) and w.prepare_key:
            by_key.setdefault(w.prepare_key, []).append(w)
    for ws in by_key.values():
        steps = sorted({s for w in ws for s in w.keep})
        for w in ws:
            w.record_steps = steps
