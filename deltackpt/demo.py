"""The README's demo: train a small model on CPU, checkpoint every step, compare with torch.save.

Run ``python -m deltackpt.demo [--steps N] [--store DIR]``. It trains a small MLP with AdamW on generated data,
saves the full training state (model, optimizer, step, RNG) into a deltackpt store after every step, prints a
table of bytes written per save next to the size of the ``torch.save`` file of the same state, then loads an
early step back and checks it bit for bit against a copy kept in memory.
"""

from __future__ import annotations

import argparse
import io
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

import deltackpt
from deltackpt.cli import human, table


def _state(model: torch.nn.Module, opt: torch.optim.Optimizer, step: int) -> dict[str, Any]:
    return {"model": model.state_dict(), "optimizer": opt.state_dict(), "step": step,
            "rng": torch.get_rng_state()}


def _clone(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.detach().clone()
    if isinstance(obj, dict):
        return type(obj)((k, _clone(v)) for k, v in obj.items())
    if isinstance(obj, (list, tuple)):
        return type(obj)(_clone(v) for v in obj)
    return obj


def _equal(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return (isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape
                and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)))
    if isinstance(a, dict):
        return isinstance(b, dict) and list(a) == list(b) and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    return a == b


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--store", default=None, help="store directory (default: a temporary one)")
    args = ap.parse_args(argv)

    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(256, 1024), torch.nn.GELU(), torch.nn.Linear(1024, 1024), torch.nn.GELU(),
        torch.nn.Linear(1024, 256),
    )
    # Freeze the first layer, as in fine-tuning: its chunks dedup across every save.
    model[0].requires_grad_(False)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    tmp = None
    path = Path(args.store) if args.store else Path(tmp := tempfile.mkdtemp(prefix="deltackpt-demo-"))
    print(f"deltackpt {deltackpt.__version__} (kernel backend: {deltackpt.backend}); store: {path}")
    rows = []
    kept: dict[int, Any] = {}
    total_ckpt = total_torch = 0
    try:
        with deltackpt.Store(path) as store:
            for step in range(1, args.steps + 1):
                x = torch.randn(64, 256)
                loss = torch.nn.functional.mse_loss(model(x), x)
                opt.zero_grad()
                loss.backward()
                opt.step()
                state = _state(model, opt, step)
                t0 = time.perf_counter()
                info = store.save(state, step=step, metadata={"loss": round(loss.item(), 5)})
                dt = time.perf_counter() - t0
                buf = io.BytesIO()
                torch.save(state, buf)
                if step == 2:
                    kept[step] = _clone(state)
                total_ckpt += info.written_bytes
                total_torch += buf.tell()
                rows.append((step, f"{loss.item():.4f}", human(info.logical_bytes), human(buf.tell()),
                             human(info.written_bytes), f"{info.written_bytes / buf.tell():.2f}",
                             f"{dt * 1e3:.0f} ms"))
            print(table(rows, ["step", "loss", "state", "torch.save", "deltackpt wrote", "ratio", "save time"],
                        right={0, 2, 3, 4, 5, 6}))
            print(f"\ntotal over {args.steps} saves: torch.save {human(total_torch)}, deltackpt "
                  f"{human(total_ckpt)} ({total_ckpt / total_torch:.2f} of torch.save)")
            back = store.load(step=2)
            ok = _equal(kept[2], back)
            print(f"step 2 loaded back: {'bit-exact' if ok else 'MISMATCH'}")
            report = store.verify()
            print(f"verify: {report.checkpoints} checkpoints, {'OK' if report.ok else report.problems}")
            return 0 if ok and report.ok else 1
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    raise SystemExit(main())
