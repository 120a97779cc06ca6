"""DCP saves of a state with many tensors: deltackpt's writer against DCP's FileSystemWriter.

``python -m bench.dcp_tensors [--tensors 10000] [--numel 64] [--steps 10] [--dir DIR]`` saves, in one process
without a process group, a state of N small fp32 tensors that all change at every step, ``--steps`` times
through ``DeltaStorageWriter`` (one writer reused, as a job does) and through ``FileSystemWriter`` (a directory
per step), and prints each save's seconds, the bytes on disk, how long listing the steps takes
(``distributed.steps`` and ``distributed.summary``, what ``deltackpt dcp ROOT`` shows) and loading the newest
step. What it measures is the per-tensor cost of the metadata (DCP's and deltackpt's), not bulk bytes: with
small tensors that is nearly all there is.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time
import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter

from deltackpt import distributed
from deltackpt.distributed import DeltaStorageReader, DeltaStorageWriter


def _du(path: Path) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


def _state(n: int, numel: int) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    return {f"layers.{i // 10}.block.sub{i % 10}.weight": torch.randn(numel) for i in range(n)}


def run(n: int, numel: int, steps: int, where: Path) -> None:
    rows = []
    for system in ("deltackpt", "FileSystemWriter"):
        root = where / system
        state = _state(n, numel)
        writer = DeltaStorageWriter(root, step=0)
        times = []
        for step in range(steps):
            for t in state.values():
                t.add_(0.01)
            t0 = time.perf_counter()
            if system == "deltackpt":
                writer.step = step
                dcp.save(state, storage_writer=writer, no_dist=True)
            else:
                dcp.save(state, storage_writer=FileSystemWriter(root / str(step)), no_dist=True)
            times.append(time.perf_counter() - t0)
        writer.close()
        listing = ""
        if system == "deltackpt":
            t0 = time.perf_counter()
            distributed.steps(root)
            distributed.summary(root)
            listing = f"{time.perf_counter() - t0:.3f}"
        target = {k: torch.empty(numel) for k in state}
        t0 = time.perf_counter()
        reader = DeltaStorageReader(root) if system == "deltackpt" else FileSystemReader(root / str(steps - 1))
        dcp.load(target, storage_reader=reader, no_dist=True)
        load = time.perf_counter() - t0
        if not all(torch.equal(target[k], v) for k, v in state.items()):
            raise SystemExit(f"{system}: the newest step did not load bit-exactly")
        rows.append((system, times, _du(root), listing, load))
    print(f"{n} tensors of {numel} fp32 values, {steps} every-step saves, one process\n")
    print("| system | first save s | later saves s (min-max, median) | on disk MB | list steps s | load newest s |")
    print("|---|---:|---:|---:|---:|---:|")
    for system, times, size, listing, load in rows:
        later = sorted(times[1:]) or times
        print(f"| {system} | {times[0]:.2f} | {later[0]:.2f}-{later[-1]:.2f}, {later[len(later) // 2]:.2f} | "
              f"{size / 1e6:.1f} | {listing or '-'} | {load:.2f} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tensors", type=int, default=10_000)
    ap.add_argument("--numel", type=int, default=64)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--dir", type=Path, default=None, help="where to put the checkpoints (default: a temp dir)")
    args = ap.parse_args()
    where = Path(tempfile.mkdtemp(prefix="dcp-tensors-", dir=args.dir))
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # DCP warns that it saves without a process group
            run(args.tensors, args.numel, args.steps, where)
    finally:
        shutil.rmtree(where, ignore_errors=True)


if __name__ == "__main__":
    main()
