"""What a restarted process pays for its first restore, with and without ``gc.freeze()`` after its imports.

``python -m bench.restart [--saves 9] [--rounds 8] [--small]`` trains the suite's GPT with AdamW, saving every
step (as ``bench.planes_zstd`` does, plus ``torch.save`` of the last state), then restores the newest
checkpoint and loads the ``.pt`` with ``torch.load`` in fresh processes, each with and without ``gc.freeze()``
right after the imports, in interleaved rounds (warm page cache; medians of wall-clock and CPU time).

Why: a process that has just imported torch holds a few hundred thousand objects the cyclic GC tracks and is
due a full collection, which the first code that allocates enough objects pays (0.1 s here). ``torch.load``
pays it inside the load; deltackpt's loads hold the collector off while they decode and pay it when they
return. ``gc.freeze()`` moves what exists into a permanent generation that collections skip, so that pass
never happens.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

from bench.delta import _load_in_child
from bench.planes_zstd import _train_and_save


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--saves", type=int, default=9)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--small", action="store_true")
    args = ap.parse_args(argv)
    times: dict[tuple[str, bool], list[tuple[float, float]]] = {}
    with tempfile.TemporaryDirectory() as d:
        root = Path(d)
        print(f"training and saving {args.saves} steps ...", flush=True)
        _train_and_save(root, args.saves, args.small, baseline=True)
        loads = {"deltackpt newest": root / "store", "torch.load": root / "state.pt"}
        for _ in range(args.rounds):
            for name, path in loads.items():
                for freeze in (False, True):
                    times.setdefault((name, freeze), []).append(_load_in_child(path, None, gc_freeze=freeze))
    print(f"\nfresh processes, warm page cache, medians of {args.rounds} interleaved rounds:\n")
    print("| load | gc.freeze() after imports | wall | CPU |\n|---|---|---:|---:|")
    for (name, freeze), ts in times.items():
        print(f"| {name} | {'yes' if freeze else 'no'} | {statistics.median(t[0] for t in ts):.3f} s "
              f"| {statistics.median(t[1] for t in ts):.3f} s |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
