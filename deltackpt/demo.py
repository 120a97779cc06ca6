"""The README's demo: a CPU training run is killed mid-way, resumed, and ends exactly where an uninterrupted one does.

Run ``python -m deltackpt.demo [--steps N] [--keep DIR]``. It

1. trains a small model (dropout, AdamW, LR schedule, shuffled DataLoader with 2 workers) for N steps without
   interruption, checkpointing every step into a deltackpt store (the reference run);
2. starts the same training command in a fresh store, SIGKILLs it mid-way, and runs the command again, which
   resumes from the last committed checkpoint and finishes;
3. prints whether the resumed run's final weights, optimizer state and per-step losses equal the reference's,
   bit for bit, and how many bytes the checkpoints took against ``torch.save`` of every step.

``python -m deltackpt.demo train STORE OUT --steps N`` is the training command itself.
"""

from __future__ import annotations

import argparse
import io
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

import deltackpt
from deltackpt import manifest
from deltackpt.cli import human, table
from deltackpt.data import ResumableLoader, ResumableSampler


def _model() -> torch.nn.Sequential:
    return torch.nn.Sequential(
        torch.nn.Embedding(1024, 128),  # frozen below, as in fine-tuning: its chunks dedup across saves
        torch.nn.Flatten(),
        torch.nn.Linear(128 * 8, 512), torch.nn.GELU(), torch.nn.Dropout(0.1),
        torch.nn.Linear(512, 512), torch.nn.GELU(), torch.nn.Dropout(0.1),
        torch.nn.Linear(512, 10),
    )


def train(store: str, out: str, steps: int) -> int:
    """The training command: resumes from ``store`` if it holds a checkpoint, logs losses, saves every step."""
    torch.set_num_threads(1)
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1234)
    xs = torch.randint(0, 1024, (512, 8), generator=g)
    ys = torch.randint(0, 10, (512,), generator=g)
    dataset = torch.utils.data.TensorDataset(xs, ys)
    loader = ResumableLoader(torch.utils.data.DataLoader(
        dataset, batch_size=32, num_workers=2, sampler=ResumableSampler(dataset, shuffle=True, seed=7)))
    model = _model()
    model[0].requires_grad_(False)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=steps)
    ckpt = deltackpt.Checkpointer(store, model=model, optimizer=opt, scheduler=sched, data=loader,
                                  every_n_steps=1, async_save=True)
    step = ckpt.restore()
    if step:
        print(f"resumed from step {step}", flush=True)
    log = open(Path(out) / "losses.txt", "a")
    batches = loader.batches()
    while step < steps:
        x, y = next(batches)
        loss = torch.nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        step += 1
        log.write(f"{step} {float(loss.item()).hex()}\n")
        log.flush()
        ckpt.step(step)
        print(f"step {step} loss {loss.item():.4f}", flush=True)
    ckpt.close()
    log.close()
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, Path(out) / "final.pt")
    return 0


def _run(store: Path, out: Path, steps: int, kill_at: int | None = None) -> bool:
    """Run the training command; with ``kill_at``, SIGKILL it once it reports that step. True if it finished."""
    out.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "deltackpt.demo", "train", str(store), str(out), "--steps", str(steps)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=os.environ.copy())
    assert proc.stdout is not None
    for line in proc.stdout:
        if line.startswith("resumed"):
            print(f"   {line.strip()}")
        if kill_at is not None and line.startswith(f"step {kill_at} "):
            time.sleep(0.05)
            proc.send_signal(signal.SIGKILL)
            proc.wait()
            print(f"   killed with SIGKILL after step {kill_at}")
            return False
    if proc.wait() != 0:
        raise SystemExit(f"training command failed with status {proc.returncode}")
    return True


def _losses(out: Path) -> dict[int, str]:
    last: dict[int, str] = {}
    for line in (out / "losses.txt").read_text().splitlines():
        step, value = line.split()
        last[int(step)] = value  # a resumed run repeats the steps after its last checkpoint: keep the last
    return last


def _same(a: object, b: object) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(
            a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


def demo(steps: int, keep: str | None) -> int:
    root = Path(keep) if keep else Path(tempfile.mkdtemp(prefix="deltackpt-demo-"))
    root.mkdir(parents=True, exist_ok=True)
    print(f"deltackpt {deltackpt.__version__} (kernel backend: {deltackpt.backend}); working in {root}\n")
    try:
        print(f"1. reference run: {steps} steps, a checkpoint after every step")
        _run(root / "ref-store", root / "ref", steps)
        kill_at = max(1, steps * 2 // 5)
        print("2. the same command in a fresh store, killed mid-way, then run again")
        _run(root / "store", root / "run", steps, kill_at=kill_at)
        _run(root / "store", root / "run", steps)

        ref = torch.load(root / "ref" / "final.pt", weights_only=True)  # the demo's own files, not the store
        got = torch.load(root / "run" / "final.pt", weights_only=True)
        weights_ok = _same(ref["model"], got["model"])
        opt_ok = _same(ref["optimizer"], got["optimizer"])
        losses_ok = _losses(root / "ref") == _losses(root / "run")
        print(f"\n   resumed weights equal the uninterrupted run's:  {'yes, bit for bit' if weights_ok else 'NO'}")
        print(f"   optimizer state equal:                          {'yes' if opt_ok else 'NO'}")
        print(f"   per-step losses equal:                          {'yes, all ' + str(steps) if losses_ok else 'NO'}")

        print("\n3. bytes written per checkpoint (reference store) against torch.save of the same state")
        rows = []
        total_ckpt = total_torch = 0
        with deltackpt.Store(root / "ref-store") as store:
            infos = store.list()
            for info in infos:
                buf = io.BytesIO()
                torch.save(store.load(id=info.id), buf)
                # the frames the save added to packs (written_bytes) and its manifest, which each save writes whole
                wrote = info.written_bytes + manifest.path_for(root / "ref-store" / "manifests", info.id).stat().st_size
                total_ckpt += wrote
                total_torch += buf.tell()
                if info.step <= 3 or info.step % 5 == 0 or info is infos[-1]:
                    rows.append((info.step, human(info.logical_bytes), human(buf.tell()), human(wrote),
                                 f"{wrote / buf.tell():.2f}"))
        print(table(rows, ["step", "state", "torch.save", "deltackpt wrote (frames + manifest)", "ratio"],
                    right={0, 1, 2, 3, 4}))
        print(f"\n   all {len(infos)} checkpoints: torch.save {human(total_torch)}, deltackpt {human(total_ckpt)} "
              f"({total_ckpt / total_torch:.2f} of torch.save)")
        ok = weights_ok and opt_ok and losses_ok
        print("\nOK" if ok else "\nFAILED")
        return 0 if ok else 1
    finally:
        if keep is None:
            shutil.rmtree(root, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m deltackpt.demo", description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd")
    tr = sub.add_parser("train", help="the training command (resumes from STORE)")
    tr.add_argument("store")
    tr.add_argument("out")
    tr.add_argument("--steps", type=int, default=30)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--keep", default=None, help="work in this directory and keep it")
    args = ap.parse_args(argv)
    if args.cmd == "train":
        return train(args.store, args.out, args.steps)
    return demo(args.steps, args.keep)


if __name__ == "__main__":
    raise SystemExit(main())
