"""What a long run's history costs on disk when retention thins it: every-step saves, ``keep_last`` and
``keep_every``, with gc after retention.

``python -m bench.retention [--steps 120] [--keep-every 10] [--keep-last 3] [--full]`` trains the suite's small
GPT (``--full``: the 52.6M-parameter one) with AdamW through a :class:`deltackpt.Checkpointer` that saves every
step (synchronously) with ``Retention(keep_last=..., keep_every=...)``, and gc after retention as soon as
anything is dropped (``DELTACKPT_GC_MIN_BYTES=1``). It reports the bytes written per save and, at the end, the
pack files' size per retained checkpoint, in units of one raw state (the bytes ``torch.save`` writes are about
one).

Why: a checkpoint retention keeps for good used to be a delta like any other, and kept the delta bases and
prediction inputs of the deleted checkpoints before it alive for as long as it was kept. The Checkpointer now
saves those steps as keyframes; this measures what that costs per save and what it saves on disk.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

import torch

import deltackpt
from bench.delta import train_step
from bench.models import GPT, GPTConfig


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=120)
    ap.add_argument("--keep-every", type=int, default=10)
    ap.add_argument("--keep-last", type=int, default=3)
    ap.add_argument("--full", action="store_true", help="the 52.6M-parameter GPT instead of the small one")
    args = ap.parse_args(argv)
    os.environ["DELTACKPT_GC_MIN_BYTES"] = "1"  # read when the Checkpointer is made
    cfg = GPTConfig() if args.full else GPTConfig(d_model=128, n_layers=4, vocab=2048)
    torch.manual_seed(0)
    model = GPT(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1)
    policy = deltackpt.Retention(keep_last=args.keep_last, keep_every=args.keep_every)
    with tempfile.TemporaryDirectory() as d:
        root = Path(d) / "store"
        written = 0
        with deltackpt.Checkpointer(root, model=model, optimizer=opt, every_n_steps=1, async_save=False,
                                    retention=policy, handle_signals=False) as ckpt:
            for step in range(1, args.steps + 1):
                train_step(model, opt, cfg)
                ckpt.step(step)
                written += ckpt.last_info.written_bytes
        with deltackpt.Store(root) as store:
            store.gc()
            infos = store.list()
        state = infos[-1].logical_bytes
        packs = sum(p.stat().st_size for p in (root / "packs").glob("*.pack"))
    print(f"{args.steps} every-step saves of a {state / 1e6:.1f} MB state, keep_last={args.keep_last}, "
          f"keep_every={args.keep_every}:")
    print(f"- written per save: {written / args.steps / state:.3f} of a raw state")
    print(f"- retained: {len(infos)} checkpoints (steps {', '.join(str(i.step) for i in infos)})")
    print(f"- pack files: {packs / 1e6:.1f} MB, {packs / state / len(infos):.3f} of a raw state per retained "
          "checkpoint")
    return 0


if __name__ == "__main__":
    sys.exit(main())
