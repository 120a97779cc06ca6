"""The CPU a restore of a delta-coded checkpoint costs, and how much of it is Python and frame reads.

``python -m bench.restore_cpu [--model mlp|small] [--rounds 8] [--against PATH] [--store DIR]`` trains a model
with AdamW (lr 1e-4) for 9 steps, saving every step through a :class:`deltackpt.Checkpointer` (``mlp``: 8
``Linear(1024, 1024)`` layers, 1 MiB chunks, most of them predicted; ``small``: 400 ``Linear(64, 64)`` layers,
2400 tensors of one chunk or less), then measures the restore of the newest checkpoint:

1. fresh processes (warm page cache) each timing ``deltackpt.Store(dir).load()`` in CPU time of all threads
   (``time.process_time``: loads decode on read workers); medians over ``--rounds``;
2. one process decoding on its own thread (the read pool bypassed), in that thread's CPU time, median of 5:
   the load as it is, and the load with the kernel's ``decode_frames`` replaced by a stub, decoding into the
   state loaded before (``into=``: no page faults of fresh output memory): what is left is the load's Python
   and its frame reads (``preadv`` from the page cache).

``--against PATH``: the same measurements of another checkout (its root, put first on ``PYTHONPATH``) in turns
with this one's: old and new code taking turns, as docs/performance.md reports them. ``--store DIR`` keeps the
store there (made when it does not exist yet) instead of a temporary directory.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from bench.util import repo_root

_TRAIN = """
import sys, torch, deltackpt
path, small = sys.argv[1], sys.argv[2] == "small"
torch.manual_seed(0)
width, depth, batch = (64, 400, 16) if small else (1024, 8, 64)
model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(depth)])
x = torch.randn(batch, width)
opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
with deltackpt.Checkpointer(path, model=model, optimizer=opt, async_save=False, handle_signals=False) as ck:
    for step in range(1, 10):
        model(x).tanh().pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        ck.save(step)
"""

_LOAD = """
import sys, time
import torch, deltackpt
c0 = time.process_time()
with deltackpt.Store(sys.argv[1]) as s:
    s.load()
print(time.process_time() - c0)
"""

_ONE_THREAD = """
import statistics, sys, time
import torch, deltackpt
from deltackpt import codec, store


class _Inline:
    def submit(self, *args, **kwargs):
        raise RuntimeError("decode on the calling thread")  # (what _read_each does once the pool refuses work)


store.Store._read_pool = property(lambda self: _Inline())
s = deltackpt.Store(sys.argv[1], threads=1)
state = s.load()


def timed(n):
    ts = []
    for _ in range(n):
        t0 = time.thread_time()
        s.load(into=state)
        ts.append(time.thread_time() - t0)
    return statistics.median(ts)


whole = timed(5)
codec.kernel.decode_frames = lambda *args: (0, 0)
print(whole, timed(5))
"""


def _run(code: str, args: list[str], path: Path | None) -> list[float]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(str(p) for p in (path or repo_root(),)))
    out = subprocess.run([sys.executable, "-P", "-c", code, *args], env=env, check=True, capture_output=True,
                         text=True).stdout
    return [float(x) for x in out.split()]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", choices=("mlp", "small"), default="mlp")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--against", type=Path, help="the root of another checkout to measure in turns with this one")
    ap.add_argument("--store", type=Path, help="keep the store here (made when it does not exist)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="deltackpt-restore-cpu-") as tmp:
        store = args.store or Path(tmp) / "store"
        if not store.exists():
            print(f"training {args.model} (9 every-step AdamW saves) into {store}", file=sys.stderr)
            _run(_TRAIN, [str(store), args.model], None)
        codes: dict[str, Path | None] = {"this checkout": None}
        if args.against is not None:
            codes = {"against": args.against.resolve(), **codes}
        cpu: dict[str, list[float]] = {name: [] for name in codes}
        for _ in range(args.rounds):
            for name, path in codes.items():
                cpu[name] += _run(_LOAD, [str(store)], path)
        one = {name: _run(_ONE_THREAD, [str(store)], path) for name, path in codes.items()}
        print(f"| code ({args.model}) | restore CPU, fresh processes (median of {args.rounds}) | one thread: load | "
              "one thread: without the kernel's decoding |")
        print("|---|---:|---:|---:|")
        for name in codes:
            print(f"| {name} | {statistics.median(cpu[name]):.3f} s | {one[name][0] * 1e3:.1f} ms | "
                  f"{one[name][1] * 1e3:.1f} ms |")


if __name__ == "__main__":
    main()
