"""What a restarted process pays for its first restore: ``gc.freeze()`` after the imports, and restoring into a
live model.

``python -m bench.restart [--saves 9] [--rounds 8] [--small] [--profile]`` trains the suite's GPT with AdamW,
saving every step (as ``bench.planes_zstd`` does, plus ``torch.save`` of the last state), then, in fresh
processes and interleaved rounds (warm page cache; medians of wall-clock and CPU time):

1. restores the newest checkpoint (``Store.load``) and loads the ``.pt`` (``torch.load``), each with and without
   ``gc.freeze()`` right after the imports;
2. restores as a restarted job does, into a model and optimizer it has just built (not timed): ``torch.load`` +
   ``load_state_dict``; ``Store.load`` + ``load_state_dict``; ``Store.load(into={"model": ...})`` +
   ``load_state_dict``, which is what ``Checkpointer.restore`` does (all with ``gc.freeze()``).

Why: a process that has just imported torch holds a few hundred thousand objects the cyclic GC tracks and is
due a full collection, which the first code that allocates enough objects pays (0.1 s here). ``torch.load``
pays it inside the load; deltackpt's loads hold the collector off while they decode and pay it when they
return. ``gc.freeze()`` moves what exists into a permanent generation that collections skip, so that pass
never happens. And a job restores into a model that already exists: decoding into its tensors spares a second
copy of the weights (its allocation, page faults and the ``load_state_dict`` copy).

``--profile`` then splits one more load of the newest checkpoint (a fresh process, one read thread, so the
stages add up to its wall-clock time) by what the kernel did: chunk decodes of each frame kind (count, raw
bytes, seconds; a predicted frame's decode computes its prediction too, in the same kernel call), each
including the page faults of its first writes to the output's fresh memory; the rest is Python and frame
reads.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from bench.delta import _load_in_child, timed_child
from bench.planes_zstd import _train_and_save
from bench.util import repo_root

_RESTART_CHILD = """
import gc, os, sys, time
import torch, deltackpt
from bench.models import GPT, GPTConfig
path, how, small = sys.argv[1], sys.argv[2], sys.argv[3] == "1"
cfg = GPTConfig(d_model=128, n_layers=4, vocab=2048) if small else GPTConfig()
model = GPT(cfg)
opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1)
gc.freeze()
t0, c0 = time.perf_counter(), os.times()
if how == "torch":
    state = torch.load(path, weights_only=True)
else:
    with deltackpt.Store(path) as s:
        state = s.load(into={"model": model.state_dict()} if how == "into" else None)
model.load_state_dict(state["model"])
opt.load_state_dict(state["optimizer"])
c1 = os.times()
print(time.perf_counter() - t0, c1.user - c0.user + c1.system - c0.system)
"""


_PROFILE_CHILD = """
import collections, gc, sys, time
import torch, deltackpt
from deltackpt import codec, kernel, predict
gc.freeze()
secs, raw, count = collections.Counter(), collections.Counter(), collections.Counter()
decode_frames = kernel.decode_frames

def timed_decode(frames, codecs, widths, out, digest, prediction=None):
    t = time.perf_counter()
    try:
        return decode_frames(frames, codecs, widths, out, digest, prediction)
    finally:
        kind = codec.CODEC_NAMES[codecs[0]] + (" + deltas" if len(codecs) > 1 else "")
        kind += " (with its prediction)" if prediction is not None else ""
        secs[kind] += time.perf_counter() - t
        raw[kind] += len(out)
        count[kind] += 1

codec.kernel.decode_frames = timed_decode
t0 = time.perf_counter()
with deltackpt.Store(sys.argv[1], threads=1, read_threads=1) as s:
    state = s.load()
    outputs = sum(t.count for t in s.manifest().tensors)
wall = time.perf_counter() - t0
print(f"one read thread: {wall:.3f} s for {outputs} output chunks")
print("| stage | calls | raw MiB | seconds | GB/s |")
print("|---|---:|---:|---:|---:|")
for kind in sorted(secs, key=secs.get, reverse=True):
    rate = raw[kind] / secs[kind] / 1e9 if secs[kind] else 0.0
    print(f"| {kind} | {count[kind]} | {raw[kind] / 2**20:.0f} | {secs[kind]:.3f} | {rate:.2f} |")
print(f"| the rest (Python, frame reads) | | | {wall - sum(secs.values()):.3f} | |")
"""


def _restart_in_child(path: Path, how: str, small: bool) -> tuple[float, float]:
    """Seconds (wall, CPU) a fresh process takes to restore ``path`` into a GPT and AdamW it built first."""
    return timed_child(_RESTART_CHILD, str(path), how, "1" if small else "0", cwd=repo_root())


def _table(title: str, head: str, times: dict[str, list[tuple[float, float]]]) -> None:
    print(f"\n{title}\n\n| {head} | wall | CPU |\n" + "|---" * (head.count("|") + 1) + "|---:|---:|")
    for name, ts in times.items():
        print(f"| {name} | {statistics.median(t[0] for t in ts):.3f} s | {statistics.median(t[1] for t in ts):.3f} s |")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--saves", type=int, default=9)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--small", action="store_true")
    ap.add_argument("--profile", action="store_true", help="then split one single-threaded load by kernel stage")
    args = ap.parse_args(argv)
    loads: dict[str, list[tuple[float, float]]] = {}
    restarts: dict[str, list[tuple[float, float]]] = {}
    with tempfile.TemporaryDirectory() as d:
        root = Path(d)
        print(f"training and saving {args.saves} steps ...", flush=True)
        _train_and_save(root, args.saves, args.small, baseline=True)
        paths = {"deltackpt newest": root / "store", "torch.load": root / "state.pt"}
        ways = {
            "torch.load + load_state_dict": (root / "state.pt", "torch"),
            "Store.load + load_state_dict": (root / "store", "load"),
            "Store.load(into=model) + load_state_dict (Checkpointer.restore)": (root / "store", "into"),
        }
        for _ in range(args.rounds):
            for name, path in paths.items():
                for freeze in (False, True):
                    key = f"{name} | {'yes' if freeze else 'no'}"
                    loads.setdefault(key, []).append(_load_in_child(path, None, gc_freeze=freeze))
            for name, (path, how) in ways.items():
                restarts.setdefault(name, []).append(_restart_in_child(path, how, args.small))
        rounds = f"fresh processes, warm page cache, medians of {args.rounds} interleaved rounds"
        _table(f"load alone ({rounds}):", "load | gc.freeze() after imports", loads)
        _table(f"restore into a model and optimizer just built ({rounds}, gc.freeze() after building them):",
               "restore", restarts)
        if args.profile:
            print("\nthe newest checkpoint's load by kernel stage (fresh process, gc.freeze()):\n", flush=True)
            done = subprocess.run([sys.executable, "-c", _PROFILE_CHILD, str(root / "store")], capture_output=True,
                                  text=True, check=True, cwd=repo_root())
            print(done.stdout, end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
