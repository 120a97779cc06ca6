"""What a training loop that checkpoints every step pays when a save outlasts a step: waiting for the save before
it (``Checkpointer(when_busy="wait")``, the default) or skipping steps while a save runs (``when_busy="skip"``).

``python -m bench.busy [--steps 30] [--small] [--batch 8] [--threads N] [--idle S]`` trains the suite's GPT
(52.6M fp32 parameters; ``--small``: 1.3M) with AdamW from the same seed, once per way of checkpointing, each
into a fresh store in a temporary directory on disk:

- none: no checkpointing (the loop's own pace);
- sync: ``Checkpointer(async_save=False)``, a save at every step;
- async wait: ``Checkpointer(async_save=True)``, a save at every step (``step()`` waits for the save before it);
- async skip: ``Checkpointer(async_save=True, when_busy="skip")``.

A GPU training step leaves the CPU cores mostly free for a background save; on a CPU-only machine training and
saves share the cores. ``--idle S`` makes each step also wait S seconds with the CPU free after ``ckpt.step``
(a sleep, standing for the accelerator's share of the next step, beside which a background save runs),
``--threads N`` gives training N torch threads.

Per way: the loop's wall-clock time for the steps after the first (whose save writes the whole state) until the
last save has committed, and its ratio to none's; the median time of one step (training and ``ckpt.step``); the
mean time the loop spent in ``ckpt.step`` (its stall: a snapshot, a save, or a wait for the save before); the
saves made and skipped; the mean steps between saves; and the bytes each save after the first wrote
(``written_bytes``) relative to ``torch.save`` of the same state. Times vary from run to run on a shared machine:
compare the ratios within one run.
"""

from __future__ import annotations

import argparse
import io
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

import deltackpt
from bench.models import GPT, GPTConfig, train_step

WAYS = ("none", "sync", "async wait", "async skip")


def _run(way: str, root: Path, cfg: GPTConfig, steps: int, batch: int, idle: float) -> dict[str, Any]:
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(1)
    model = GPT(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1)
    ckpt = None
    if way != "none":
        ckpt = deltackpt.Checkpointer(root / way.replace(" ", "-"), model=model, optimizer=opt,
                                      async_save=way != "sync", when_busy="skip" if way == "async skip" else "wait",
                                      handle_signals=False)
    step_times: list[float] = []
    in_step: list[float] = []  # (seconds the loop spent in ckpt.step: the stall)
    start = 0.0
    for step in range(1, steps + 1):
        t = time.perf_counter()
        train_step(model, opt, gen, batch)
        if ckpt is not None:
            c = time.perf_counter()
            ckpt.step(step)
            if step == 1:
                ckpt.wait()  # (the first save writes the whole state: not what this measures)
            else:
                in_step.append(time.perf_counter() - c)
        if idle:  # (after step(): on a GPU the next step's compute is where a background save runs)
            time.sleep(idle)
        now = time.perf_counter()
        if step == 1:
            start = now
        else:
            step_times.append(now - t)
    if ckpt is not None:
        ckpt.wait()
    out: dict[str, Any] = {"way": way, "step": statistics.median(step_times), "loop": time.perf_counter() - start,
                           "in_step": statistics.mean(in_step) if in_step else None}
    if ckpt is not None:
        infos = ckpt.store.list()
        buf = io.BytesIO()
        torch.save(ckpt.capture(steps), buf)
        later = infos[1:]
        out.update(saves=len(infos), skipped=ckpt.skipped,
                   gap=(later[-1].step - infos[0].step) / len(later) if later else None,
                   written=statistics.mean(i.written_bytes for i in later) / buf.tell() if later else None)
        ckpt.close()
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--small", action="store_true")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--threads", type=int, help="torch threads for training (default: torch's)")
    ap.add_argument("--idle", type=float, default=0.0,
                    help="seconds each step also waits with the CPU free, as a loop waiting on its GPU does")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.steps < 3:
        ap.error("--steps must be at least 3")
    cfg = GPTConfig(d_model=128, n_layers=4, vocab=2048) if args.small else GPTConfig()
    print(f"GPT of {cfg.n_params() / 1e6:.1f}M parameters, AdamW, batch {args.batch}, {args.steps} steps, "
          f"a save at every step; {torch.get_num_threads()} torch threads"
          + (f"; each step waits {args.idle} s more with the CPU free" if args.idle else ""))
    with tempfile.TemporaryDirectory(prefix="deltackpt-busy-", dir=".") as tmp:
        rows = [_run(way, Path(tmp), cfg, args.steps, args.batch, args.idle) for way in WAYS]
    base = rows[0]["loop"]
    print("| checkpointing | loop (steps 2-N) | × none | step, median | in ckpt.step, mean | saves | skipped "
          "| steps between saves | written per save / torch.save |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        def cell(key: str, fmt: str, r: dict[str, Any] = r) -> str:
            return "" if r.get(key) is None else format(r[key], fmt)
        in_step = "" if r["in_step"] is None else f"{r['in_step'] * 1e3:.1f} ms"
        print(f"| {r['way']} | {r['loop']:.2f} s | {r['loop'] / base:.2f}× | {r['step'] * 1e3:.0f} ms | {in_step} "
              f"| {cell('saves', 'd')} | {cell('skipped', 'd')} | {cell('gap', '.2f')} | {cell('written', '.3f')} |")


if __name__ == "__main__":
    main()
