"""The parent side of ``python -m bench``: plan the cells, run them in child processes, write the results.

Each child runs ``python -m bench.cell`` on a job (a list of recordings and cells). ``--isolate cell`` (the
full-mode default) gives every (workload, system) cell its own process, so peak RSS and allocator state never
bleed between systems; ``--isolate workload`` runs one process per workload and ``--isolate run`` a single
process for everything (the quick-mode default: process start-up would eat the minute otherwise). Within a
process each measured window resets the RSS high-water mark, so the peaks stay per save and per load.

Exit status: 0 when every cell ran and every load matched what was saved, 1 otherwise (CI runs --quick).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shlex
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench import report
from bench import systems as S
from bench import workloads as W
from bench.kernel import cpu_name
from bench.util import repo_root


def _mem_bytes() -> int:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _fs_type(path: Path) -> str:
    best, fstype = "", "?"
    try:
        for line in Path("/proc/mounts").read_text().splitlines():
            parts = line.split()
            if len(parts) >= 3 and str(path).startswith(parts[1]) and len(parts[1]) > len(best):
                best, fstype = parts[1], f"{parts[2]} ({parts[0]})"
    except OSError:
        pass
    return fstype


def _git(*args: str) -> str:
    try:
        return subprocess.run(["git", *args], cwd=repo_root(), capture_output=True, text=True,
                              timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def _loadavg() -> str:
    try:
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return "?"


def machine_info(tmp_parent: Path) -> dict[str, Any]:
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        import numpy
        import torch

        import deltackpt
    versions = {}
    for mod in ("safetensors", "zstandard", "xxhash", "lmdb"):
        try:
            versions[mod] = __import__(mod).__version__
        except Exception:  # noqa: BLE001
            versions[mod] = "?"
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:
        cpus = os.cpu_count() or 1
    return {
        "date": time.strftime("%Y-%m-%d"),
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "host": socket.gethostname(),
        "platform": platform.platform(),
        "cpu": cpu_name(),
        "cpus": cpus,
        "mem_bytes": _mem_bytes(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "numpy": numpy.__version__,
        **versions,
        "deltackpt": deltackpt.__version__,
        "kernel_backend": deltackpt.backend,
        "kernel_warnings": [str(w.message) for w in caught if "deltackpt" in str(w.message)],
        "torch_threads": torch.get_num_threads(),
        "git_commit": _git("rev-parse", "HEAD"),
        "git_dirty": bool(_git("status", "--porcelain", "--untracked-files=no")),
        "tmp_dir": str(tmp_parent),
        "tmp_fs": _fs_type(tmp_parent.resolve()),
        "loadavg_start": _loadavg(),
        "env": {k: v for k, v in os.environ.items() if k.startswith("DELTACKPT_")},
    }


def plan(workloads: list[W.Workload], systems: list[str], async_skip: str,
         isolate: str) -> tuple[list[list[list[Any]]], dict[tuple[str, str], str]]:
    """Jobs (each a list of tasks for one child process) and the cells that are skipped, with why."""
    skipped: dict[tuple[str, str], str] = {}
    per_workload: list[list[list[Any]]] = []
    prepared: set[str] = set()
    for w in workloads:
        tasks: list[list[Any]] = []
        if w.prepare_key and w.prepare_key not in prepared:
            prepared.add(w.prepare_key)
            tasks.append(["prepare", w.prepare_key])
        for s in systems:
            if w.kind == "many" and s not in S.MANY:
                continue
            if s in w.skip:
                skipped[(w.name, s)] = "left out at this size to keep the full run within its time budget"
                continue
            if s in S.ASYNC and async_skip:
                skipped[(w.name, s)] = async_skip
                continue
            tasks.append(["cell", w.name, s])
        per_workload.append(tasks)
    if isolate == "run":
        return [[t for ts in per_workload for t in ts]], skipped
    if isolate == "workload":
        return per_workload, skipped
    return [[t] for ts in per_workload for t in ts], skipped


def run_job(tasks: list[list[Any]], job_base: dict[str, Any], tmp: Path, index: int,
            timeout: float) -> list[dict[str, Any]]:
    job_path = tmp / f"job-{index}.json"
    out_path = tmp / f"job-{index}.jsonl"
    job_path.write_text(json.dumps({**job_base, "tasks": tasks}))
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(repo_root()), env.get("PYTHONPATH", "")) if p)
    cmd = [sys.executable, "-m", "bench.cell", str(job_path), str(out_path)]
    error = ""
    try:
        proc = subprocess.run(cmd, cwd=repo_root(), env=env, timeout=timeout, stdout=sys.stderr)
        if proc.returncode not in (0, 1):
            error = f"child process exited with status {proc.returncode}"
            if proc.returncode < 0 or proc.returncode == 137:
                error += " (killed: out of memory?)"
    except subprocess.TimeoutExpired:
        error = f"child process timed out after {timeout:.0f} s"
    results = []
    if out_path.exists():
        results = [json.loads(line) for line in out_path.read_text().splitlines() if line.strip()]
    done = len(results)
    for task in tasks[done:]:
        r = {"type": task[0], "task": task, "error": error or "no result (child crashed?)"}
        if task[0] == "cell":
            r.update({"workload": task[1], "system": task[2]})
        else:
            r["key"] = task[1]
        results.append(r)
    return results


def assemble(workloads: list[W.Workload], systems: list[str], raw: list[dict[str, Any]],
             skipped: dict[tuple[str, str], str]) -> dict[str, Any]:
    recordings: dict[str, Any] = {}
    failures: list[str] = []
    by_w: dict[str, dict[str, Any]] = {w.name: {"info": {**w.describe(), "prepare_key": w.prepare_key},
                                                "cells": {}} for w in workloads}
    for r in raw:
        if r["type"] == "prepare":
            recordings[r["key"]] = r.get("info") or {"error": r.get("error")}
            if "error" in r:
                failures.append(f"recording {r['key']!r}: {r['error']}")
            continue
        cell = {k: v for k, v in r.items() if k not in ("type", "workload", "system", "task")}
        by_w[r["workload"]]["cells"][r["system"]] = cell
        if "error" in r:
            failures.append(f"{r['workload']} / {r['system']}: {r['error']}")
    for (wname, sname), why in skipped.items():
        by_w[wname]["cells"][sname] = {"skipped": why}
    for w in by_w.values():  # keep the systems' order
        w["cells"] = {s: w["cells"][s] for s in systems if s in w["cells"]}
    return {"recordings": recordings, "workloads": by_w, "failures": failures}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m bench",
        description="Checkpoint benchmark: deltackpt vs torch.save, safetensors and torch DCP, side by side",
    )
    ap.add_argument("--quick", action="store_true", help="CI-sized run (tiny states, under a minute)")
    ap.add_argument("--out", type=Path,
                    help="directory for the results (default: bench/results, or bench/out with --quick)")
    ap.add_argument("--only", help="comma-separated workloads or groups, e.g. a,e or a1,f1g")
    ap.add_argument("--systems", help=f"comma-separated systems (default all): {','.join(S.SYSTEMS)}")
    ap.add_argument("--saves", type=int, help="override the number of saves of every workload (shorter runs)")
    ap.add_argument("--reps", type=int, help="override the repetitions of every load")
    ap.add_argument("--isolate", choices=["cell", "workload", "run"],
                    help="one child process per cell (full default), per workload, or one for the run (quick "
                    "default)")
    ap.add_argument("--tmp", type=Path, default=Path(tempfile.gettempdir()),
                    help="where the temporary stores go (deleted afterwards; default %(default)s)")
    ap.add_argument("--timeout", type=float, help="seconds allowed per child process")
    ap.add_argument("--list", action="store_true", help="list the workloads and systems and exit")
    args = ap.parse_args(argv)

    t_start = time.perf_counter()
    mode = W.QUICK if args.quick else W.FULL
    suite = W.suite(mode)
    if args.saves:
        W.override_saves(suite, args.saves)
    if args.reps:
        for w in suite:
            w.load_reps = (args.reps, args.reps)
    workloads = W.select(suite, args.only)
    systems = S.SYSTEMS
    if args.systems:
        wanted = [s.strip() for s in args.systems.split(",") if s.strip()]
        unknown = [s for s in wanted if s not in S.SYSTEMS]
        if unknown:
            ap.error(f"unknown systems {unknown}; known: {S.SYSTEMS}")
        systems = [s for s in S.SYSTEMS if s in wanted]
    if args.list:
        for w in suite:
            print(f"{w.name:6s} {w.title} ({w.saves} saves)")
        print("systems:", ", ".join(systems))
        return 0
    isolate = args.isolate or ("run" if args.quick else "cell")
    timeout = args.timeout or (300.0 if args.quick else 2400.0)

    tmp_parent = args.tmp
    tmp_parent.mkdir(parents=True, exist_ok=True)
    meta = machine_info(tmp_parent)
    async_skip = S.checkpointer_available()
    jobs, skipped = plan(workloads, systems, async_skip, isolate)
    n_cells = sum(1 for j in jobs for t in j if t[0] == "cell")
    print(f"bench: {mode} mode, {len(workloads)} workloads, {n_cells} cells in {len(jobs)} process(es); "
          f"deltackpt {meta['kernel_backend']} kernel; load average {meta['loadavg_start']}", file=sys.stderr)
    if async_skip:
        print(f"bench: async rows skipped: {async_skip}", file=sys.stderr)

    tmp = Path(tempfile.mkdtemp(prefix="deltackpt-bench-", dir=tmp_parent))
    job_base = {"mode": mode, "tmp": str(tmp), "saves": args.saves, "reps": args.reps}
    raw: list[dict[str, Any]] = []
    try:
        for i, tasks in enumerate(jobs):
            raw += run_job(tasks, job_base, tmp, i, timeout)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

    results: dict[str, Any] = {"meta": meta, "config": {
        "mode": mode,
        "command": "python -m bench" + (" " + shlex.join(argv if argv is not None else sys.argv[1:])
                                        if (argv if argv is not None else sys.argv[1:]) else ""),
        "isolate": isolate,
        "systems": systems,
        "async_skipped": async_skip or None,
        "workloads": [w.describe() for w in workloads],
    }}
    results.update(assemble(workloads, systems, raw, skipped))
    results["ratios"] = report.compute_ratios(results)
    meta["loadavg_end"] = _loadavg()
    results["runtime_s"] = time.perf_counter() - t_start

    out_dir = args.out or (repo_root() / "bench" / ("out" if args.quick else "results"))
    out_dir.mkdir(parents=True, exist_ok=True)
    host = re.sub(r"[^A-Za-z0-9_.-]", "_", meta["host"])
    stem = f"{meta['date']}-{host}" + ("-quick" if args.quick else "")
    md = report.markdown(results)
    (out_dir / f"{stem}.json").write_text(json.dumps(results, indent=1, default=str) + "\n")
    (out_dir / f"{stem}.md").write_text(md + "\n")
    print(md)
    print(f"bench: wrote {out_dir / stem}.json and .md in {results['runtime_s']:.0f} s", file=sys.stderr)
    if results["failures"]:
        print(f"bench: {len(results['failures'])} FAILURE(S):", file=sys.stderr)
        for f in results["failures"]:
            print(f"  {f}", file=sys.stderr)
        return 1
    return 0
