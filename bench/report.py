"""Ratios and markdown tables from a results dict (the JSON the driver writes).

    python -m bench.report bench/results/2025-01-01-host.json     # print the tables of a saved run again

The headline is ratios to ``torch.save + fsync`` measured in the same run (lower is better for time and
bytes), next to the physical floor: one memcpy of the state.
"""

from __future__ import annotations

import json
import sys
from typing import Any

from bench.systems import ASYNC, BASELINE, LABELS, SYSTEMS
from bench.util import GB, fmt_bytes, fmt_s

DURABLE = ["torch.save+fsync", "safetensors+fsync", "dcp", "deltackpt", "deltackpt-dedup"]


def _ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or b <= 0:
        return None
    return a / b


def _fr(r: float | None) -> str:
    if r is None:
        return "–"
    if r == 0:
        return "0×"
    if r < 0.01:
        return f"{r:.4f}×"
    if r < 0.1:
        return f"{r:.3f}×"
    return f"{r:.2f}×"


def compute_ratios(results: dict[str, Any]) -> dict[str, dict[str, dict[str, float | None]]]:
    """Per workload and system: save time, bytes per save, bytes on disk and load times over the same
    figure of torch.save + fsync, plus save time over one memcpy of the state."""
    out: dict[str, dict[str, dict[str, float | None]]] = {}
    for wname, w in results["workloads"].items():
        cells = w["cells"]
        base = cells.get(BASELINE, {})
        floor = cells.get("memcpy", {}).get("memcpy_median_s")
        rows: dict[str, dict[str, float | None]] = {}
        for sname, c in cells.items():
            if "error" in c or "skipped" in c or sname == "memcpy" or "count" in c:
                continue
            save = c.get("save_median_s")
            rows[sname] = {
                "save": _ratio(save, base.get("save_median_s")),
                "first_save": _ratio(c.get("first_save_s"), base.get("first_save_s")),
                "bytes_per_save": _ratio(c.get("bytes_per_save_median"), base.get("bytes_per_save_median")),
                "disk_after": _ratio(c.get("disk_after"), base.get("disk_after")),
                "load_latest": _ratio(c.get("load_latest_s"), base.get("load_latest_s")),
                "load_oldest": _ratio(c.get("load_oldest_s"), base.get("load_oldest_s")),
                "save_over_memcpy": _ratio(save, floor),
            }
        if "count" in base:
            keys = {"open": "open_median_s", "list": "list_median_s", "load_latest": "load_latest_s"}
            for sname, c in cells.items():
                if "count" in c:
                    rows[sname] = {k: _ratio(c.get(f), base.get(f)) for k, f in keys.items()}
        out[wname] = rows
    return out


def _state_line(w: dict[str, Any], results: dict[str, Any]) -> str:
    info, cells = w["info"], w["cells"]
    state = next((c.get("state_bytes") for c in cells.values() if c.get("state_bytes")), None)
    parts = []
    rec = results.get("recordings", {}).get(info.get("prepare_key") or "", {})
    if rec.get("params"):
        parts.append(f"{rec['params'] / 1e6:.1f}M parameters ({100 * rec['frozen_fraction']:.1f}% frozen)"
                     if rec.get("frozen_fraction", 0) > 0.01 else f"{rec['params'] / 1e6:.1f}M parameters")
    params = next((c.get("workload_params") for c in cells.values() if c.get("workload_params")), {}) or {}
    if params.get("params") and not rec.get("params"):
        parts.append(f"{params['params'] / 1e6:.1f}M parameters")
    if params.get("rows"):
        parts.append(f"{params['rows']:,} rows × {params['dim']}")
        if params.get("rows_touched_per_save"):
            parts.append(f"{params['rows_touched_per_save']:,} rows touched per save")
    if state:
        parts.append(f"state {fmt_bytes(state)}")
    parts.append(f"{info['saves']} saves" if info.get("kind") != "many" else f"{info['saves']} checkpoints")
    floor = cells.get("memcpy", {})
    if floor.get("memcpy_median_s"):
        gbps = floor["state_bytes"] / floor["memcpy_median_s"] / GB
        parts.append(f"memcpy floor {fmt_s(floor['memcpy_median_s'])} ({gbps:.1f} GB/s)")
        parts.append(f"one hashing pass {fmt_s(floor['hash_median_s'])}")
    return "; ".join(parts) + "."


def workload_table(wname: str, w: dict[str, Any], ratios: dict[str, dict[str, float | None]],
                   results: dict[str, Any]) -> list[str]:
    info, cells = w["info"], w["cells"]
    lines = [f"### {wname}: {info['title']}", "", _state_line(w, results), ""]
    if info.get("kind") == "many":
        lines += ["| system | build, per save | open | × | list | × | load latest | × | on disk |",
                  "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for sname in SYSTEMS:
            c = cells.get(sname)
            if c is None:
                continue
            if "error" in c:
                lines.append(f"| {LABELS[sname]} | FAILED: {c['error'][:120]} |||||||| ")
                continue
            r = ratios.get(sname, {})
            lines.append(
                f"| {LABELS[sname]} | {fmt_s(c['build_s_median'])} | {fmt_s(c['open_median_s'])} | "
                f"{_fr(r.get('open'))} | {fmt_s(c['list_median_s'])} | {_fr(r.get('list'))} | "
                f"{fmt_s(c['load_latest_s'])} | {_fr(r.get('load_latest'))} | {fmt_bytes(c['disk_after'])} |")
        return lines + [""]
    n = info["saves"]
    lines += [
        f"| system | save, median | × torch.save+fsync | first save | written/save | × | on disk after {n} "
        "| load latest | × | load oldest | peak RSS above state: save / load |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    notes = []
    for sname in SYSTEMS:
        c = cells.get(sname)
        if c is None:
            continue
        label = LABELS[sname]
        if "skipped" in c:
            notes.append(f"{label}: not run ({c['skipped']}).")
            continue
        if "error" in c:
            lines.append(f"| {label} | FAILED: {c['error'][:120]} ||||||||||")
            continue
        if sname == "memcpy":
            lines.append(f"| {label} | {fmt_s(c['memcpy_median_s'])} | "
                         f"{_fr(_memcpy_ratio(cells))} |"
                         " – | – | – | – | – | – | – | – |")
            continue
        r = ratios.get(sname, {})
        save = fmt_s(c["save_median_s"])
        if sname in ASYNC:
            save += " blocked"
            notes.append(f"{label}: {fmt_s(c['async_interval_s'])} of simulated compute between saves; "
                         f"close() waited {fmt_s(c.get('close_s'))} for the last save; written/save counts "
                         "pack bytes only.")
        lines.append(
            f"| {label} | {save} | {_fr(r.get('save'))} | {fmt_s(c['first_save_s'])} | "
            f"{fmt_bytes(c['bytes_per_save_median'])} | {_fr(r.get('bytes_per_save'))} | "
            f"{fmt_bytes(c['disk_after'])} | {fmt_s(c['load_latest_s'])} | {_fr(r.get('load_latest'))} | "
            f"{fmt_s(c['load_oldest_s'])} | "
            f"{fmt_bytes(c['rss_save_extra'])} / {fmt_bytes(c['rss_load_extra'])} |")
    lines.append("")
    lines += [f"- {x}" for x in notes]
    return lines + ([""] if notes else [])


def _memcpy_ratio(cells: dict[str, Any]) -> float | None:
    floor = cells.get("memcpy", {}).get("memcpy_median_s")
    return _ratio(floor, cells.get(BASELINE, {}).get("save_median_s"))


def summary_table(results: dict[str, Any], ratios: dict[str, Any]) -> list[str]:
    lines = [
        "| workload | state | torch.save+fsync save | deltackpt save | × | dedup-only save | × | "
        "async: blocked | × | deltackpt written/save | × | deltackpt load latest | × | memcpy floor |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for wname, w in results["workloads"].items():
        cells = w["cells"]
        if w["info"].get("kind") == "many":
            continue
        b, d, dd = cells.get(BASELINE, {}), cells.get("deltackpt", {}), cells.get("deltackpt-dedup", {})
        r, rd = ratios.get(wname, {}).get("deltackpt", {}), ratios.get(wname, {}).get("deltackpt-dedup", {})
        da, ra = cells.get("deltackpt-async", {}), ratios.get(wname, {}).get("deltackpt-async", {})
        state = next((c.get("state_bytes") for c in cells.values() if c.get("state_bytes")), None)
        lines.append(
            f"| {wname} | {fmt_bytes(state)} | {fmt_s(b.get('save_median_s'))} | "
            f"{fmt_s(d.get('save_median_s'))} | "
            f"{_fr(r.get('save'))} | {fmt_s(dd.get('save_median_s'))} | {_fr(rd.get('save'))} | "
            f"{fmt_s(da.get('blocked_median_s'))} | {_fr(ra.get('save'))} | "
            f"{fmt_bytes(d.get('bytes_per_save_median'))} | {_fr(r.get('bytes_per_save'))} | "
            f"{fmt_s(d.get('load_latest_s'))} | {_fr(r.get('load_latest'))} | "
            f"{fmt_s(cells.get('memcpy', {}).get('memcpy_median_s'))} |")
    return lines + [""]


def losses(results: dict[str, Any]) -> list[str]:
    """Plain statements of where deltackpt (sync, best of delta and dedup-only) does not win."""
    out = []
    for wname, w in results["workloads"].items():
        cells = w["cells"]
        if w["info"].get("kind") == "many":
            d, b = cells.get("deltackpt", {}), cells.get(BASELINE, {})
            for k, what in (("open_median_s", "opens"), ("list_median_s", "lists"),
                            ("load_latest_s", "loads")):
                if d.get(k) and b.get(k) and d[k] > b[k]:
                    out.append(f"{wname}: deltackpt {what} slower than a directory of torch.save files "
                               f"({fmt_s(d[k])} vs {fmt_s(b[k])}).")
            continue
        mine = {s: cells[s] for s in ("deltackpt", "deltackpt-dedup") if "save_median_s" in cells.get(s, {})}
        others = {s: cells[s] for s in DURABLE if s not in mine and "save_median_s" in cells.get(s, {})}
        if not mine or not others:
            continue
        best_mine = min(mine, key=lambda s: mine[s]["save_median_s"])
        best_other = min(others, key=lambda s: others[s]["save_median_s"])
        m, o = mine[best_mine]["save_median_s"], others[best_other]["save_median_s"]
        if m > o:
            out.append(f"{wname}: saves slower than {LABELS[best_other]} ({fmt_s(m)} with "
                       f"{LABELS[best_mine]} vs {fmt_s(o)}, {m / o:.2f}×).")
        lo = {s: c["load_latest_s"] for s, c in others.items() if c.get("load_latest_s")}
        lm = {s: c["load_latest_s"] for s, c in mine.items() if c.get("load_latest_s")}
        if lo and lm and min(lm.values()) > min(lo.values()):
            so = min(lo, key=lo.__getitem__)
            out.append(f"{wname}: loads the latest step slower than {LABELS[so]} "
                       f"({fmt_s(min(lm.values()))} vs {fmt_s(lo[so])}).")
        bm = min((c["bytes_per_save_median"] for c in mine.values() if c.get("bytes_per_save_median")),
                 default=None)
        bo = min((c["bytes_per_save_median"] for c in others.values() if c.get("bytes_per_save_median")),
                 default=None)
        if bm is not None and bo is not None and bm > bo:
            out.append(f"{wname}: writes more per save than the best other system ({fmt_bytes(bm)} vs "
                       f"{fmt_bytes(bo)}).")
    return out


def markdown(results: dict[str, Any]) -> str:
    ratios = results.get("ratios") or compute_ratios(results)
    meta = results["meta"]
    lines = [
        f"## Checkpoint benchmark: {meta['date']} on {meta['host']} ({results['config']['mode']} mode)",
        "",
        f"`{results['config']['command']}` — {meta['cpu']}, {meta['cpus']} CPUs, "
        f"{fmt_bytes(meta['mem_bytes'])} RAM, {meta['tmp_fs']} temp dir; torch {meta['torch']}, "
        f"deltackpt {meta['deltackpt']} "
        f"({meta['kernel_backend']} kernel); load average {meta['loadavg_start']} at start, "
        f"{meta.get('loadavg_end', '?')} at end; {results.get('runtime_s', 0):.0f} s in all.",
        "",
        "Times are medians over the saves after the first (every save but the first is incremental) and over "
        "repeated loads with the page cache dropped first; × is the ratio to torch.save + fsync in the same "
        "run (lower is better). \"written/save\" is the growth of the bytes allocated on disk per save; "
        "\"peak RSS above state\" is the peak resident memory of the save (or load) over the process before "
        "it.",
        "",
        "### Summary",
        "",
    ]
    lines += summary_table(results, ratios)
    lost = losses(results)
    if lost:
        lines += ["Where deltackpt does not win in this run:", ""] + [f"- {x}" for x in lost] + [""]
    if meta["kernel_backend"] != "native":
        lines += ["**Warning: the pure-Python chunk kernel ran; deltackpt figures are not representative.**",
                  ""]
    for wname, w in results["workloads"].items():
        lines += workload_table(wname, w, ratios.get(wname, {}), results)
    if results.get("failures"):
        lines += ["### Failures", ""] + [f"- {f}" for f in results["failures"]] + [""]
    return "\n".join(lines)


if __name__ == "__main__":
    with open(sys.argv[1]) as f:
        print(markdown(json.load(f)))
