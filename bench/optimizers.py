"""Every-step checkpoints of one model under many optimizers: what each writes, and whether it resumes exactly.

``python -m bench.optimizers [--steps 12] [--only adamw,nadam]`` trains a 3.0M-parameter model (an embedding of
4000×256, two pre-norm MLP blocks 256↔1024, a 256→4000 head; float32) for ``--steps`` real steps on random token
ids under each optimizer setup below, saving model, optimizer and LR scheduler through a synchronous
``Checkpointer`` at every step, and ``torch.save`` of the same state beside it for its size. Per setup it prints
the bytes deltackpt wrote per save over saves 3.. relative to the ``.pt`` file, and per part (weights, each kind
of optimizer state) relative to that part's raw bytes. Then it restores the newest checkpoint into objects built
afresh from another seed, trains both copies two more steps and checks that the two runs are equal bit for bit
("exact").

Which parts predicted frames cover is the point: AdamW-family moments and weights, SGD and RMSprop momentum
weights (README, "Predicted frames"); the other optimizers' state is left to XOR deltas and standalone frames.
"""

from __future__ import annotations

import argparse
import math
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

import deltackpt

_V, _D, _H = 4000, 256, 1024


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(_D)
        self.fc1 = nn.Linear(_D, _H)
        self.fc2 = nn.Linear(_H, _D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(nn.functional.gelu(self.fc1(self.ln(x))))


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(_V, _D)
        self.blocks = nn.ModuleList([_Block(), _Block()])
        self.lnf = nn.LayerNorm(_D)
        self.head = nn.Linear(_D, _V)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.emb(x)
        for b in self.blocks:
            h = b(h)
        return self.head(self.lnf(h))


_O = torch.optim


def _no_decay_groups(model: nn.Module) -> list[dict[str, Any]]:
    """Weight decay on matrices only, as most LLM recipes do."""
    return [{"params": [p for p in model.parameters() if p.ndim >= 2], "weight_decay": 0.1},
            {"params": [p for p in model.parameters() if p.ndim < 2], "weight_decay": 0.0}]


def _muon_and_adamw(model: nn.Module) -> list[torch.optim.Optimizer]:
    """Muon for the blocks' matrices (it takes 2-D parameters only), AdamW for the embedding, the head, the norms
    and the biases: the split Muon's authors recommend. ``match_rms_adamw`` scales Muon's step to AdamW's."""
    hidden = [p for n, p in model.named_parameters() if p.ndim == 2 and n.startswith("blocks.")]
    rest = [p for n, p in model.named_parameters() if not (p.ndim == 2 and n.startswith("blocks."))]
    return [_O.Muon(hidden, lr=0.02, weight_decay=0.1, adjust_lr_fn="match_rms_adamw"),
            _O.AdamW(rest, lr=1e-3, weight_decay=0.1)]


def _warmup_cosine(opt: torch.optim.Optimizer) -> Any:
    return torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / 4) * 0.5 * (1 + math.cos(math.pi * s / 20)))


#: setup name -> (optimizer or a list of them, scheduler or None) for a model
SETUPS: dict[str, Callable[[nn.Module], tuple[Any, Any]]] = {
    "adamw": lambda m: (_O.AdamW(m.parameters(), lr=1e-3, weight_decay=0.1), None),
    "adamw-fused": lambda m: (_O.AdamW(m.parameters(), lr=1e-3, weight_decay=0.1, fused=True), None),
    "adamw-groups-cosine": lambda m: (lambda o: (o, _warmup_cosine(o)))(_O.AdamW(_no_decay_groups(m), lr=1e-3)),
    "adam-l2": lambda m: (_O.Adam(m.parameters(), lr=1e-3, weight_decay=0.01), None),
    "adam-amsgrad": lambda m: (_O.Adam(m.parameters(), lr=1e-3, amsgrad=True), None),
    "nadam": lambda m: (_O.NAdam(m.parameters(), lr=1e-3), None),
    "radam": lambda m: (_O.RAdam(m.parameters(), lr=1e-3), None),
    "adamax": lambda m: (_O.Adamax(m.parameters(), lr=1e-3), None),
    "adafactor": lambda m: (_O.Adafactor(m.parameters(), lr=1e-2), None),
    "adagrad": lambda m: (_O.Adagrad(m.parameters(), lr=1e-2), None),
    "rmsprop": lambda m: (_O.RMSprop(m.parameters(), lr=1e-3), None),
    "rmsprop-momentum": lambda m: (_O.RMSprop(m.parameters(), lr=1e-3, momentum=0.9), None),
    "sgd-momentum": lambda m: (_O.SGD(m.parameters(), lr=1e-2, momentum=0.9, weight_decay=1e-4), None),
    "sgd-nesterov": lambda m: (_O.SGD(m.parameters(), lr=1e-2, momentum=0.9, nesterov=True), None),
    "sgd": lambda m: (_O.SGD(m.parameters(), lr=1e-2), None),
    "muon-adamw": lambda m: (_muon_and_adamw(m), None),
}


def _build(name: str, seed: int) -> tuple[nn.Module, Any, Any]:
    torch.manual_seed(seed)
    model = _Net()
    opt, sched = SETUPS[name](model)
    return model, opt, sched


def _optimizers(opt: Any) -> list[torch.optim.Optimizer]:
    return opt if isinstance(opt, list) else [opt]


def _train_step(model: nn.Module, opt: Any, sched: Any, step: int) -> None:
    x = torch.randint(0, _V, (8, 32), generator=torch.Generator().manual_seed(1000 + step))
    loss = nn.functional.cross_entropy(model(x).reshape(-1, _V), x.reshape(-1))
    model.zero_grad()
    loss.backward()
    for o in _optimizers(opt):
        o.step()
    if sched is not None:
        sched.step()


def _part(key: str, owners: dict[str, str]) -> str:
    """``weights`` (with more than one optimizer, ``weights (Muon)``: the optimizer's that steps them), the
    optimizer state's name (``exp_avg``, ``momentum_buffer``), or ``other``."""
    if key.startswith("model."):
        return f"weights ({owners[key]})" if key in owners else "weights"
    if key.startswith("optimizer") and ".state" in key:
        return key.rsplit(".", 1)[-1]
    return "other"


def _owners(model: nn.Module, opt: Any) -> dict[str, str]:
    """With several optimizers: each weight's key path (``model.`` + its name) -> its optimizer's class name."""
    opts = _optimizers(opt)
    if len(opts) < 2:
        return {}
    names = {id(p): n for n, p in model.named_parameters()}
    return {f"model.{names[id(p)]}": type(o).__name__ for o in opts for g in o.param_groups for p in g["params"]}


def _equal(a: Any, b: Any) -> bool:
    """Bit for bit: tensors by their bytes (a NaN equals itself), other values by ==."""
    if isinstance(a, torch.Tensor):
        return (isinstance(b, torch.Tensor) and (a.dtype, a.shape) == (b.dtype, b.shape)
                and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)))
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(map(_equal, a, b))
    return callable(a) or a == b


def _state(model: nn.Module, opt: Any, sched: Any) -> dict[str, Any]:
    return {"model": model.state_dict(), "optimizer": [o.state_dict() for o in _optimizers(opt)],
            "scheduler": sched.state_dict() if sched is not None else None}


def run(name: str, root: Path, steps: int) -> dict[str, Any]:
    model, opt, sched = _build(name, 0)
    owners = _owners(model, opt)
    pt_bytes: dict[int, int] = {}
    with deltackpt.Checkpointer(root / name, model=model, optimizer=opt, scheduler=sched, async_save=False,
                                handle_signals=False) as ck:
        for step in range(1, steps + 1):
            _train_step(model, opt, sched, step)
            ck.step(step)
            torch.save(ck.capture(step), root / "state.pt")
            pt_bytes[step] = (root / "state.pt").stat().st_size
        written = pt = 0
        parts: dict[str, list[int]] = {}
        for info in ck.store.list():
            if info.step < 3:  # (the first saves write keyframes)
                continue
            written, pt = written + info.written_bytes, pt + pt_bytes[info.step]
            for t in ck.store.manifest(id=info.id).tensors:
                part = parts.setdefault(_part(t.key, owners), [0, 0])
                part[0], part[1] = part[0] + t.nbytes, part[1] + t.written
    model2, opt2, sched2 = _build(name, 123)
    with deltackpt.Checkpointer(root / name, model=model2, optimizer=opt2, scheduler=sched2, async_save=False,
                                handle_signals=False) as ck2:
        restored = ck2.restore()
    exact = restored == steps and _equal(_state(model, opt, sched), _state(model2, opt2, sched2))
    for step in (steps + 1, steps + 2):
        _train_step(model, opt, sched, step)
        _train_step(model2, opt2, sched2, step)
    exact = exact and _equal(_state(model, opt, sched), _state(model2, opt2, sched2))
    total = sum(n for n, _ in parts.values())
    return {"setup": name, "ratio": written / pt, "exact": exact,  # (parts of 1% of the raw bytes and more)
            "parts": {p: w / n for p, (n, w) in sorted(parts.items()) if n and n >= total / 100}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=12, help="training steps, each saved (default 12)")
    ap.add_argument("--only", default="", help="comma-separated setups (default: all): " + ", ".join(SETUPS))
    args = ap.parse_args()
    names = [n for n in args.only.split(",") if n] or list(SETUPS)
    unknown = [n for n in names if n not in SETUPS]
    if unknown or args.steps < 3:
        ap.error(f"unknown setup(s) {', '.join(unknown)}" if unknown else "--steps must be at least 3")
    torch.set_num_threads(1)
    print("| setup | bytes per save / torch.save | exact resume | per part: written / raw |")
    print("|---|---:|---|---|")
    ok = True
    with tempfile.TemporaryDirectory(prefix="deltackpt-bench-optimizers-") as tmp:
        for name in names:
            r = run(name, Path(tmp), args.steps)
            ok = ok and r["exact"]
            parts = ", ".join(f"{p} {v:.3f}" for p, v in r["parts"].items())
            print(f"| {name} | {r['ratio']:.3f} | {'yes' if r['exact'] else 'NO'} | {parts} |", flush=True)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
