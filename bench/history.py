"""How a store with a long history behaves: open, list, save, load latest and load oldest with N checkpoints.

``python -m bench.history [--n 10000] [--dir DIR]`` builds a store of N small checkpoints (a 1 MiB model that
changes a little every step, as a long run saving often does) and times, at a few history lengths, opening the
store, ``list()`` (the first one of a handle, which decodes every record, and one after a save, which decodes
only the new record: what a Checkpointer's retention does after each save), one more ``save``, and loading
the latest and the oldest checkpoint. Each figure is the median of 5 repetitions. At the end it applies a
retention policy that keeps the 10 newest (one pass, timed once) and runs gc. Only gc and verify scan the
whole history, and a first ``list()`` reads every record, so everything else here should stay flat.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch

import deltackpt


def _median(fn, reps: int = 5) -> float:
    """The median seconds of ``fn()``, or of what it returns when that is a number (a time it measured itself)."""
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        got = fn()
        times.append(got if isinstance(got, float) else time.perf_counter() - t0)
    return statistics.median(times)


def _first_list(path: Path) -> float:
    """Seconds the first ``list()`` of a fresh handle takes (opening not counted)."""
    with deltackpt.Store(path) as s:
        t0 = time.perf_counter()
        s.list()
        return time.perf_counter() - t0


def _changed_save(store: deltackpt.Store, state: dict, step: int) -> float:
    """Seconds a save takes after one row changed, as in the loop that builds the history."""
    state["w"][step % 256] += 1e-3
    t0 = time.perf_counter()
    store.save(state, step=step)
    return time.perf_counter() - t0


def _list_after_save(store: deltackpt.Store, state: dict, step: int) -> float:
    """Seconds a ``list()`` takes right after a save through the same handle (the save not counted)."""
    store.save(state, step=step)
    t0 = time.perf_counter()
    store.list()
    return time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=10_000)
    ap.add_argument("--dir", default=None, help="where to build the store (default: a temporary directory)")
    args = ap.parse_args(argv)
    root = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="deltackpt-history-"))
    path = root / "store"
    marks = sorted({m for m in (10, 100, 1000, 10_000, args.n) if m <= args.n})
    torch.manual_seed(0)
    state = {"w": torch.randn(256, 1024), "step": 0}
    rows = []
    try:
        store = deltackpt.Store(path, chunk_size=64 << 10)
        for step in range(1, args.n + 1):
            state["w"][step % 256] += 1e-3  # one 4 KiB row changes per step
            state["step"] = step
            store.save(state, step=step)
            if step in marks:
                store.close()
                t_open = _median(lambda: deltackpt.Store(path).close())
                store = deltackpt.Store(path, chunk_size=64 << 10)
                t_list = _median(lambda: _first_list(path))
                t_relist = _median(lambda s=step, st=store: _list_after_save(st, state, s))
                t_save = _median(lambda s=step, st=store: _changed_save(st, state, s))
                t_latest = _median(lambda st=store: st.load())
                oldest = store.list()[0].id
                t_oldest = _median(lambda o=oldest, st=store: st.load(id=o))
                rows.append((step, t_open, t_list, t_relist, t_save, t_latest, t_oldest))
                print(f"{step:>6} checkpoints: open {t_open * 1e3:.1f} ms, list {t_list * 1e3:.1f} ms, "
                      f"list after a save {t_relist * 1e3:.1f} ms, "
                      f"save {t_save * 1e3:.1f} ms, load latest {t_latest * 1e3:.1f} ms, "
                      f"load oldest {t_oldest * 1e3:.1f} ms", flush=True)
        # a first policy applied to the whole history, as `deltackpt keep STORE --last 10` does, then its gc
        kept = len(store)
        t0 = time.perf_counter()
        dropped = store.retain(deltackpt.Retention(keep_last=10))
        t_retain = time.perf_counter() - t0
        t0 = time.perf_counter()
        store.gc()
        t_gc = time.perf_counter() - t0
        store.close()
    finally:
        if args.dir is None:
            shutil.rmtree(root, ignore_errors=True)
    print("\n| checkpoints | open | first list | list after a save | save | load latest | load oldest |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for step, *ts in rows:
        print(f"| {step} | " + " | ".join(f"{t * 1e3:.1f} ms" for t in ts) + " |")
    print(f"\nretain(keep_last=10) of {kept} checkpoints: {len(dropped)} deleted in {t_retain:.3f} s; "
          f"then gc {t_gc:.3f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
