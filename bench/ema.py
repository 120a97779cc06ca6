"""An EMA copy of the weights saved every step: what it costs with and without its prediction.

``python -m bench.ema [--saves 12] [--decay 0.99]`` trains a 5.3M-parameter GPT (d_model 256, 4 layers, vocab
4096) with AdamW on random tokens and keeps ``torch.optim.swa_utils.AveragedModel`` of it (an exponential moving
average), saving model, optimizer and the average through a ``Checkpointer`` at every step: once as deltackpt
does now (the average predicted from this save's parameters, ``a = d·a' + (1-d)·p``) and once with the average
under a key path that does not name the parameters (``extra.ema_flat``: a list), which leaves it to XOR deltas
as before the prediction existed. It prints, per store, the bytes each part wrote relative to its raw size over
saves 4.. (the first saves write keyframes), and checks that every step of both stores loads bit for bit.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

import deltackpt
from bench.models import GPT, GPTConfig, train_step


class _Flat:
    """The average's weights as a list (key paths ``extra.ema_flat[i]``), which names no parameter."""

    def __init__(self, ema: AveragedModel) -> None:
        self.ema = ema

    def state_dict(self) -> list[torch.Tensor]:
        return [t for t in self.ema.module.state_dict().values()]

    def load_state_dict(self, state: list[torch.Tensor]) -> None:
        for t, v in zip(self.ema.module.state_dict().values(), state):
            t.copy_(v)


def _role(key: str) -> str:
    if key.startswith("extra."):
        return "EMA copy"
    if key.startswith("model."):
        return "weights"
    return "exp_avg_sq" if key.endswith("exp_avg_sq") else "exp_avg" if key.endswith("exp_avg") else "other"


def _run(root: Path, saves: int, decay: float, named: bool) -> dict[str, float]:
    torch.manual_seed(0)
    cfg = GPTConfig(d_model=256, n_layers=4, vocab=4096)
    model = GPT(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1)
    ema = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(decay))
    gen = torch.Generator().manual_seed(1)
    extra = {"ema": ema} if named else {"ema_flat": _Flat(ema)}
    history = {}
    with deltackpt.Checkpointer(root, model=model, optimizer=opt, extra=extra, async_save=False,
                                handle_signals=False) as ck:
        for step in range(1, saves + 1):
            train_step(model, opt, gen, 4)
            ema.update_parameters(model)
            ck.step(step)
            history[step] = [t.clone() for t in ema.module.state_dict().values()]
        s = ck.store
        written: dict[str, list[int]] = {}
        for info in s.list()[3:]:
            for t in s.manifest(id=info.id).tensors:
                got = written.setdefault(_role(t.key), [0, 0])
                got[0] += t.written
                got[1] += t.nbytes
        for step, want in history.items():
            loaded = s.load(step)["extra"]
            got = [v for k, v in loaded["ema"].items() if k.startswith("module.")] if named else loaded["ema_flat"]
            if len(got) != len(want) or not all(torch.equal(a.view(torch.uint8), b.view(torch.uint8))
                                                for a, b in zip(got, want)):
                raise AssertionError(f"step {step} of the {'named' if named else 'flat'} store differs")
    return {role: w / n for role, (w, n) in written.items() if n}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--saves", type=int, default=12)
    ap.add_argument("--decay", type=float, default=0.99)
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as d:
        runs = {name: _run(Path(d) / name, args.saves, args.decay, named)
                for name, named in (("predicted (extra.ema)", True), ("deltas (extra.ema_flat)", False))}
    roles = ["weights", "exp_avg", "exp_avg_sq", "EMA copy"]
    print(f"bytes written / raw bytes, saves 4-{args.saves}, every step, AveragedModel decay {args.decay}; every "
          "step of both stores loaded bit for bit\n")
    print("| store | " + " | ".join(roles) + " |\n|---" + "|---:" * len(roles) + "|")
    for name, got in runs.items():
        print(f"| {name} | " + " | ".join(f"{got.get(r, 0):.3f}" for r in roles) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
