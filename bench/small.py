"""Many small tensors: what a save and a load cost per tensor, against ``torch.save`` + fsync and ``torch.load``.

``python -m bench.small [--tensors 15000] [--saves 6] [--dir DIR]`` builds a state of N float32 tensors of
4 KiB each (a model of many small layers) plus an optimizer state for a tenth of them (a step count and a
moment each), changes a seventh of the weights before every save, and saves it into a store and with
``torch.save`` + fsync, taking turns. It prints the median save time over saves 2..S (the first writes
everything), the first save's, the latest checkpoint's load against ``torch.load`` (median of 3, warm page
cache, same process), and how many collections of the oldest generation Python's cyclic garbage collector
ran during the saves. Bytes are not the point here: every tensor is one chunk, so the per-tensor work is.
"""

from __future__ import annotations

import argparse
import gc
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

import deltackpt
from bench.util import fsync_path


def _state(n: int) -> dict[str, Any]:
    torch.manual_seed(0)
    return {
        "model": {f"layer{i}.weight": torch.randn(64, 16) for i in range(n)},
        "optimizer": {"state": {i: {"step": torch.tensor(float(i)), "exp_avg": torch.randn(64, 16)}
                                for i in range(n // 10)}},
    }


def _torch_save(state: Any, path: Path) -> None:
    torch.save(state, path)
    fsync_path(path)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tensors", type=int, default=15_000)
    ap.add_argument("--saves", type=int, default=6)
    ap.add_argument("--dir", default=None, help="where to write (default: a temporary directory)")
    args = ap.parse_args(argv)
    root = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="deltackpt-small-"))
    full: list[int] = []
    gc.callbacks.append(lambda phase, info: full.append(1) if phase == "stop" and info["generation"] == 2 else None)
    state = _state(args.tensors)
    weights = state["model"]
    names = list(weights)
    times: dict[str, list[float]] = {"deltackpt": [], "torch.save + fsync": []}
    gen2_in_saves = 0
    try:
        store = deltackpt.Store(root / "store")
        for step in range(args.saves):
            for name in names[step % 7 :: 7]:
                weights[name].add_(1e-3)
            full.clear()
            t0 = time.perf_counter()
            store.save(state, step=step)
            times["deltackpt"].append(time.perf_counter() - t0)
            gen2_in_saves += len(full)
            t0 = time.perf_counter()
            _torch_save(state, root / "state.pt")
            times["torch.save + fsync"].append(time.perf_counter() - t0)
        loads: dict[str, list[float]] = {"deltackpt": [], "torch.load": []}
        for _ in range(3):
            t0 = time.perf_counter()
            store.load()
            loads["deltackpt"].append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            torch.load(root / "state.pt")
            loads["torch.load"].append(time.perf_counter() - t0)
        store.close()
    finally:
        if not args.dir:
            shutil.rmtree(root, ignore_errors=True)
    n = args.tensors + 2 * (args.tensors // 10)
    print(f"{n} tensors ({args.tensors} weights of 4 KiB, optimizer state for {args.tensors // 10}); deltackpt "
          f"backend {deltackpt.backend}; {args.saves} saves, a seventh of the weights changing before each\n")
    print("| | first save | save (median of saves 2-) | per tensor | load latest (median of 3) |")
    print("|---|---:|---:|---:|---:|")
    for (name, ts), ls in zip(times.items(), loads.values()):
        later = statistics.median(ts[1:]) if len(ts) > 1 else ts[0]
        print(f"| {name if name == 'deltackpt' else 'torch.save + fsync, torch.load'} | {ts[0]:.3f} s | "
              f"{later:.3f} s | {later / n * 1e6:.0f} µs | {statistics.median(ls):.3f} s |")
    print(f"\nfull collections of the cyclic garbage collector during deltackpt's saves: {gen2_in_saves}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
