"""Many small tensors: what a save and a load cost per tensor, against ``torch.save`` + fsync and ``torch.load``.

``python -m bench.small [--tensors 15000] [--saves 6] [--dir DIR]`` builds a state of N float32 tensors of
4 KiB each (a model of many small layers) plus an optimizer state for a tenth of them (a step count and a
moment each), changes a seventh of the weights before every save, and saves it into a store and with
``torch.save`` + fsync, taking turns. It prints the median save time over saves 2..S (the first writes
everything), the first save's, the latest checkpoint's load against ``torch.load`` (median of 3, warm page
cache, same process), and how many collections of the oldest generation Python's cyclic garbage collector
ran during the saves. Bytes are not the point here: every tensor is one chunk, so the per-tensor work is.

``--elements E`` (default 1024): weights of E float32 elements in place of 4 KiB (64 x 16) ones; ``--all-change``:
every weight changes before every save (every chunk is encoded, as a delta), not a seventh of them, and the state
holds the weights only (the brief reproducer of docs/performance.md, "Every tensor changing").

``--mixed``: N tensors of 16..4096 elements each (uniform, fixed seed), float32 for half of them and bfloat16,
float16, int64 for a sixth each, in place of the 4 KiB weights and optimizer state. ``--via sync|async``: the
saves go through a :class:`deltackpt.Checkpointer` (``extra={"state": state}``, no RNG state) in sync or async
mode in place of ``Store.save``; an async "save" is the time ``step()`` blocks plus the wait for the background
save (so the whole save is timed, not overlapped). Every figure is given in wall time and in the process's CPU
time (all threads: ``time.process_time``), and per tensor in microseconds.
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


def _state(n: int, elements: int = 1024, optimizer: bool = True) -> dict[str, Any]:
    torch.manual_seed(0)
    shape = (64, 16) if elements == 1024 else (elements,)
    state: dict[str, Any] = {"model": {f"layer{i}.weight": torch.randn(shape) for i in range(n)}}
    if optimizer:
        state["optimizer"] = {"state": {i: {"step": torch.tensor(float(i)), "exp_avg": torch.randn(shape)}
                                        for i in range(n // 10)}}
    return state


def _mixed(n: int) -> dict[str, Any]:
    torch.manual_seed(0)
    sizes = torch.randint(16, 4097, (n,)).tolist()
    dtypes = [torch.float32, torch.float32, torch.float32, torch.bfloat16, torch.float16, torch.int64]
    out: dict[str, Any] = {}
    for i, size in enumerate(sizes):
        dt = dtypes[i % len(dtypes)]
        out[f"layer{i // 4}.p{i % 4}"] = (torch.randint(0, 1 << 20, (size,)) if dt is torch.int64
                                          else torch.randn(size).to(dt))
    return {"model": out}


def _torch_save(state: Any, path: Path) -> None:
    torch.save(state, path)
    fsync_path(path)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tensors", type=int, default=15_000)
    ap.add_argument("--saves", type=int, default=6)
    ap.add_argument("--dir", default=None, help="where to write (default: a temporary directory)")
    ap.add_argument("--mixed", action="store_true", help="tensors of 16..4096 elements of mixed dtypes")
    ap.add_argument("--elements", type=int, default=1024, help="float32 elements per weight (default 1024: 4 KiB)")
    ap.add_argument("--all-change", action="store_true",
                    help="every weight changes before every save (and no optimizer state)")
    ap.add_argument("--via", choices=("store", "sync", "async"), default="store",
                    help="Store.save, or a Checkpointer's step() in sync or async mode")
    args = ap.parse_args(argv)
    root = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="deltackpt-small-"))
    full: list[int] = []
    gc.callbacks.append(lambda phase, info: full.append(1) if phase == "stop" and info["generation"] == 2 else None)
    state = _mixed(args.tensors) if args.mixed else _state(args.tensors, args.elements, not args.all_change)
    weights = state["model"]
    names = list(weights)
    # (wall, cpu) per save and per load
    times: dict[str, list[tuple[float, float]]] = {"deltackpt": [], "torch.save + fsync": []}
    gen2_in_saves = 0

    def timed(fn: Any, *a: Any, **kw: Any) -> tuple[float, float]:
        t0, c0 = time.perf_counter(), time.process_time()
        fn(*a, **kw)
        return time.perf_counter() - t0, time.process_time() - c0

    try:
        store = deltackpt.Store(root / "store")
        ckpt = None
        if args.via != "store":
            ckpt = deltackpt.Checkpointer(store, extra={"state": state}, async_save=args.via == "async",
                                          handle_signals=False, rng=False)

        def save(step: int) -> None:
            if ckpt is None:
                store.save(state, step=step)
            else:
                ckpt.step(step + 1)
                ckpt.wait()

        for step in range(args.saves):
            for name in names if args.all_change else names[step % 7 :: 7]:
                w = weights[name]
                if not w.is_floating_point():
                    w.add_(1)
                else:
                    w.add_(torch.randn_like(w) * 1e-3 if args.all_change else 1e-3)
            full.clear()
            times["deltackpt"].append(timed(save, step))
            gen2_in_saves += len(full)
            times["torch.save + fsync"].append(timed(_torch_save, state, root / "state.pt"))
        if ckpt is not None:
            ckpt.close()
        loads: dict[str, list[tuple[float, float]]] = {"deltackpt": [], "torch.load": []}
        for _ in range(5):
            loads["deltackpt"].append(timed(store.load))
            loads["torch.load"].append(timed(torch.load, root / "state.pt"))
        n = len(store.manifest().tensors)
        store.close()
    finally:
        if not args.dir:
            shutil.rmtree(root, ignore_errors=True)
    size = "4 KiB" if args.elements == 1024 else f"{args.elements} float32 elements"
    what = (f"{args.tensors} tensors of 16..4096 elements, mixed dtypes" if args.mixed else
            f"{args.tensors} weights of {size}, every one changing before each save" if args.all_change else
            f"{args.tensors} weights of {size}, optimizer state for {args.tensors // 10}")
    print(f"{n} tensors ({what}); deltackpt backend {deltackpt.backend}; saves through "
          f"{'Store.save' if args.via == 'store' else 'a Checkpointer, ' + args.via}; {args.saves} saves, "
          f"{'every weight' if args.all_change else 'a seventh of the weights'} changing before each; wall (CPU) "
          "time\n")
    print("| | first save | save (median of saves 2-) | load latest (median of 5) "
          "| per tensor: first, later, load (wall; CPU) |")
    print("|---|---:|---:|---:|---:|")

    def med(ts: list[tuple[float, float]]) -> tuple[float, float]:
        return statistics.median(t[0] for t in ts), statistics.median(t[1] for t in ts)

    for (name, ts), ls in zip(times.items(), loads.values()):
        first, later, load = ts[0], med(ts[1:] if len(ts) > 1 else ts), med(ls)
        us = "; ".join(", ".join(f"{x[j] / n * 1e6:.0f}" for x in (first, later, load)) for j in (0, 1))
        print(f"| {name if name == 'deltackpt' else 'torch.save + fsync, torch.load'} | {first[0]:.3f} "
              f"({first[1]:.3f}) s | {later[0]:.3f} ({later[1]:.3f}) s | {load[0]:.3f} ({load[1]:.3f}) s | {us} µs |")
    print(f"\nfull collections of the cyclic garbage collector during deltackpt's saves: {gen2_in_saves}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
