"""The child side: run a job (recordings and cells) in this process and append one JSON line per task.

    python -m bench.cell JOB.json RESULTS.jsonl

A cell is one (workload, system) pair: replay the workload's trajectory through the system's ``save``, then
load the latest and the oldest step back (page cache dropped first) and check them against digests of the
states that were saved. The driver (:mod:`bench.driver`) runs each cell in a fresh process in full mode, so
peak RSS and allocator state never carry over from one system to the next; within a process each measured
window (a save, a load) resets the RSS high-water mark first (see :class:`bench.util.Rss`).
"""

from __future__ import annotations

import gc
import json
import shutil
import sys
import time
import traceback
import warnings
from pathlib import Path
from typing import Any

from bench import systems as S
from bench import workloads as W
from bench.util import (
    Rss,
    compare,
    disk_usage,
    evict,
    fingerprint,
    fmt_bytes,
    fmt_s,
    is_tensor,
    median,
    state_nbytes,
    tensor_bytes,
    touch,
    trim,
    walk,
)


class VerifyError(AssertionError):
    pass


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def rec_root(tmp: Path, wl: W.Workload) -> Path:
    return tmp / "rec" / (wl.prepare_key or wl.name)


# -- the floor -----------------------------------------------------------------------------------------------
def run_floor(wl: W.Workload, tmp: Path) -> dict[str, Any]:
    """One memcpy (numpy copyto: a single-threaded memcpy into preallocated, already faulted buffers) and one
    hashing pass (the chunk kernel deltackpt uses, its default chunk size and threads) of every state."""
    import numpy as np

    from deltackpt import config, kernel

    cs, threads = config.chunk_size(), config.threads()
    copies: list[float] = []
    hashes: list[float] = []
    dst: list[Any] | None = None
    nbytes = 0
    for _step, state in wl.states(rec_root(tmp, wl)):
        bufs = [tensor_bytes(v) for _, v in walk(state) if is_tensor(v)]
        if dst is None:
            dst = [np.empty_like(b) for b in bufs]
            for d, b in zip(dst, bufs):
                np.copyto(d, b)  # fault the pages in once, untimed
            nbytes = sum(b.nbytes for b in bufs)
        t0 = time.perf_counter()
        for d, b in zip(dst, bufs):
            np.copyto(d, b)
        copies.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        for b in bufs:
            kernel.chunk_digests(b, cs, threads)
        hashes.append(time.perf_counter() - t0)
    return {"state_bytes": nbytes, "memcpy_s": copies, "hash_s": hashes, "memcpy_median_s": median(copies),
            "hash_median_s": median(hashes), "hash_chunk_size": cs, "hash_threads": threads,
            "kernel_backend": kernel.backend}


# -- a trajectory through one system -------------------------------------------------------------------------
def run_trajectory(wl: W.Workload, name: str, tmp: Path, root: Path) -> dict[str, Any]:
    rss = Rss()
    system = S.make(name, root)
    is_async = name in S.ASYNC
    interval = wl.async_interval(rec_root(tmp, wl)) if is_async else 0.0
    saves: list[dict[str, Any]] = []
    fps: dict[int, Any] = {}
    steps: list[int] = []
    like: Any = None
    nbytes = 0
    for i, (step, state) in enumerate(wl.states(rec_root(tmp, wl))):
        if i == 0:
            fps[step] = fingerprint(state)
            nbytes = state_nbytes(state)
        elif i == wl.saves - 1:
            fps[step] = fingerprint(state)
        before = disk_usage(root)
        rss_before = rss.start()
        t0 = time.perf_counter()
        extra = system.save(state, step)
        dt = time.perf_counter() - t0
        if is_async:
            time.sleep(interval)  # the training compute the background save overlaps with
        peak = rss.peak()
        rec = {"step": step, "s": dt, "bytes": disk_usage(root) - before, "rss_peak": peak,
               "rss_extra": max(0, peak - rss_before), **(extra or {})}
        saves.append(rec)
        steps.append(step)
        like = state
        if i == wl.saves - 1:
            break
    rss_before = rss.start()
    t0 = time.perf_counter()
    fin = system.finish()
    finish_s = time.perf_counter() - t0
    peak = rss.peak()
    if is_async:
        # the background work that outlived the last step() counts towards the peak of the saves
        saves[-1]["rss_extra"] = max(saves[-1]["rss_extra"], peak - rss_before)
        written = fin.get("written_bytes") or []
        for rec, w in zip(saves, written):
            rec["written_bytes"] = rec["bytes"] = w  # disk growth during step() says nothing here
    disk_after = disk_usage(root)
    state_fp_latest, state_fp_oldest = fps[steps[-1]], fps[steps[0]]
    loads: dict[str, Any] = {}
    cold = True
    for which, step, reps, fp in (
        ("latest", steps[-1], wl.load_reps[0], state_fp_latest),
        ("oldest", steps[0], wl.load_reps[1], state_fp_oldest),
    ):
        if which == "oldest" and step == steps[-1]:
            continue
        times: list[float] = []
        extras: list[int] = []
        for r in range(max(1, reps)):
            cold = evict(root) and cold
            rss_before = rss.start()
            t0 = time.perf_counter()
            obj = system.load(step, like)
            touch(obj)  # every byte in memory: lazy (mmap) loads pay here
            times.append(time.perf_counter() - t0)
            extras.append(max(0, rss.peak() - rss_before))
            if r == 0:
                err = compare(fp, fingerprint(obj), subset=system.subset_verify)
                if err:
                    raise VerifyError(f"{name}: step {step} loads back different: {err}")
            del obj
            trim()
        loads[which] = {"step": step, "s": times, "median_s": median(times), "rss_extra": max(extras)}
    first, rest = saves[0], saves[1:] or saves[:1]
    return {
        "state_bytes": nbytes,
        "saves": saves,
        "first_save_s": first["s"],
        "save_median_s": median([r["s"] for r in rest]),
        "first_save_bytes": first["bytes"],
        "bytes_per_save_median": median([r["bytes"] for r in rest]),
        "written_bytes_median": median([r["written_bytes"] for r in rest if "written_bytes" in r]),
        "disk_after": disk_after,
        "finish_s": finish_s,
        "async_interval_s": interval if is_async else None,
        "blocked_median_s": median([r["s"] for r in rest]) if is_async else None,
        "close_s": fin.get("close_s"),
        "loads": loads,
        "load_latest_s": loads.get("latest", {}).get("median_s"),
        "load_oldest_s": loads.get("oldest", {}).get("median_s"),
        "rss_save_extra": max(r["rss_extra"] for r in saves),
        "rss_load_extra": max((v["rss_extra"] for v in loads.values()), default=None),
        "rss_resettable": rss.resettable,
        "cold_loads": cold,
        "settings": system.settings,
        "verified": True,
    }


# -- a store of many checkpoints -----------------------------------------------------------------------------
def run_many(wl: W.Workload, name: str, tmp: Path, root: Path) -> dict[str, Any]:
    import torch

    system = S.make(name, root)
    build: list[float] = []
    last_fp: Any = None
    last_step = 0
    for i, (step, state) in enumerate(wl.states(rec_root(tmp, wl))):
        t0 = time.perf_counter()
        system.save(state, step)
        build.append(time.perf_counter() - t0)
        last_step = step
        if i == wl.saves - 1:
            last_fp = fingerprint(state)
            break
    system.finish()
    disk = disk_usage(root)
    open_s: list[float] = []
    list_s: list[float] = []
    load_s: list[float] = []
    n_listed = 0
    if isinstance(system, S.Deltackpt):
        from deltackpt import Store

        for _ in range(wl.load_reps[0]):
            evict(root)
            t0 = time.perf_counter()
            s = Store(system.store_path, max_chain=system.max_chain)
            open_s.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            n_listed = len(s.list())
            list_s.append(time.perf_counter() - t0)
            s.close()
        for r in range(wl.load_reps[1]):
            evict(root)
            t0 = time.perf_counter()
            with Store(system.store_path, max_chain=system.max_chain) as s:
                obj = s.load()
            load_s.append(time.perf_counter() - t0)
            if r == 0:
                err = compare(last_fp, fingerprint(obj))
                if err:
                    raise VerifyError(f"{name}: latest loads back different: {err}")
    else:
        import os

        def listing() -> list[tuple[int, int, float]]:
            out = []
            for e in os.scandir(root):
                if e.name.endswith(".pt"):
                    st = e.stat()
                    out.append((int(e.name[5:17]), st.st_size, st.st_mtime))
            return sorted(out)

        for _ in range(wl.load_reps[0]):
            evict(root)
            t0 = time.perf_counter()
            os.listdir(root)  # "opening" a directory of files
            open_s.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            n_listed = len(listing())
            list_s.append(time.perf_counter() - t0)
        for r in range(wl.load_reps[1]):
            evict(root)
            t0 = time.perf_counter()
            latest = listing()[-1][0]
            obj = torch.load(root / f"step-{latest:012d}.pt", map_location="cpu", weights_only=True)
            load_s.append(time.perf_counter() - t0)
            if r == 0:
                err = compare(last_fp, fingerprint(obj))
                if err:
                    raise VerifyError(f"{name}: latest loads back different: {err}")
    if n_listed != last_step:
        raise VerifyError(f"{name}: lists {n_listed} checkpoints, saved {last_step}")
    return {"count": n_listed, "build_s_median": median(build), "build_s_total": sum(build),
            "disk_after": disk, "open_s": open_s, "open_median_s": median(open_s), "list_s": list_s,
            "list_median_s": median(list_s), "load_latest_s": median(load_s), "load_s": load_s,
            "verified": True}


# -- the job loop --------------------------------------------------------------------------------------------
def find(suite: list[W.Workload], name: str) -> W.Workload:
    for w in suite:
        if w.name == name:
            return w
    raise KeyError(name)


def run_task(task: list[Any], suite: list[W.Workload], tmp: Path) -> dict[str, Any]:
    kind = task[0]
    t0 = time.perf_counter()
    if kind == "prepare":
        key = task[1]
        wl = next(w for w in suite if w.prepare_key == key)
        _log(f"  recording {key!r} (training, not timed) ...")
        info = wl.prepare(rec_root(tmp, wl))
        _log(f"  recorded {key!r} in {time.perf_counter() - t0:.1f} s")
        return {"type": "prepare", "key": key, "info": info}
    _, wname, sname = task
    wl = find(suite, wname)
    root = tmp / "cells" / f"{wname}--{sname}"
    out: dict[str, Any] = {"type": "cell", "workload": wname, "system": sname}
    try:
        if sname == "memcpy":
            res = run_floor(wl, tmp)
        elif wl.kind == "many":
            res = run_many(wl, sname, tmp, root)
        else:
            res = run_trajectory(wl, sname, tmp, root)
        out.update(res)
        out["workload_params"] = wl.params
    finally:
        shutil.rmtree(root, ignore_errors=True)
        trim(collect=True)
    out["cell_s"] = time.perf_counter() - t0
    _log(f"  {wname:6s} {sname:22s} {_summary(out)}  [{out['cell_s']:.1f} s]")
    return out


def _summary(r: dict[str, Any]) -> str:
    if r["system"] == "memcpy":
        return f"memcpy {fmt_s(r.get('memcpy_median_s'))}, hash {fmt_s(r.get('hash_median_s'))}"
    if "count" in r:
        return (f"open {fmt_s(r['open_median_s'])}, list {fmt_s(r['list_median_s'])}, "
                f"load {fmt_s(r['load_latest_s'])}")
    s = f"save {fmt_s(r['save_median_s'])} (first {fmt_s(r['first_save_s'])}), "
    s += f"{fmt_bytes(r['bytes_per_save_median'])}/save, load {fmt_s(r['load_latest_s'])}"
    return s


def main(argv: list[str]) -> int:
    warnings.filterwarnings("ignore", message="deltackpt: native kernel unavailable")
    warnings.filterwarnings("ignore", message="Sparse invariant checks")
    import torch  # noqa: F401 - imported once, then frozen out of every garbage collection

    import deltackpt  # noqa: F401

    gc.freeze()
    job = json.loads(Path(argv[0]).read_text())
    out_path = Path(argv[1])
    tmp = Path(job["tmp"])
    suite = W.suite(job["mode"])
    if job.get("saves"):
        W.override_saves(suite, job["saves"])
    if job.get("reps"):
        for w in suite:
            w.load_reps = (job["reps"], job["reps"])
    failed = 0
    for task in job["tasks"]:
        try:
            res = run_task(task, suite, tmp)
        except Exception as exc:  # noqa: BLE001 - report every failure, keep going
            failed += 1
            tb = traceback.format_exc(limit=-6)
            _log(f"  FAILED {task}: {type(exc).__name__}: {exc}\n{tb}")
            res = {"type": task[0], "task": task, "error": f"{type(exc).__name__}: {exc}", "traceback": tb}
            if task[0] == "cell":
                res.update({"workload": task[1], "system": task[2]})
            else:
                res["key"] = task[1]
        with open(out_path, "a") as f:
            f.write(json.dumps(res, default=str) + "\n")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
