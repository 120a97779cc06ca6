"""Where the bytes of dense AdamW (or SGD) training go: dedup, byte planes and deltas, saved every step and every 10.

``python -m bench.delta [--saves 20] [--small] [--every 1,10] [--max-chain K] [--cores 1,2,4] [--optimizer sgd]
[--dtype bfloat16]`` trains the suite's GPT (52.6M fp32 parameters; ``--small``: 1.3M; ``--dtype bfloat16``: the
model, and so its optimizer state, in bfloat16) with AdamW (lr 1e-4, weight decay 0.1; or
``--optimizer sgd``: SGD with momentum 0.9, lr 1e-2, weight decay 1e-4; or ``--optimizer muon``: torch.optim.Muon,
lr 0.02, weight decay 0.1, ``match_rms_adamw``, on the blocks' matrices and AdamW on the rest) on random token
ids and saves the full
training state into three stores after every step (``Store(max_chain=0)``: dedup + byte planes + zstd;
``Store(max_chain=K, predict=False)``: XOR deltas too; ``Store(max_chain=K)``, by default the store's default:
predicted frames too), then does the same saving every 10 steps. For each save it reports bytes relative to
``torch.save`` of the same state for

- dedup: the raw bytes of chunks no earlier checkpoint holds (what an uncompressed dedup store writes),
- planes: what ``Store(max_chain=0)`` writes (dedup, then byte planes + zstd),
- xor: what ``Store(predict=False)`` writes (XOR against the parent's chunk when smaller),
- predicted: what ``Store()`` writes (AdamW second moments and weights, or SGD weights, as residuals of a
  prediction),

split by where the bytes go (weights, exp_avg, exp_avg_sq; with SGD weights and momentum_buffer), and the restore
time of the newest and the oldest checkpoint against ``torch.load`` of a ``.pt`` file, each load in a fresh process
as a restarted job does it (like a restarted job, without ``gc.freeze()``: each loader pays the collection the
imports left due, ``torch.load`` during the load and deltackpt when its load returns; ``bench.restart`` measures
it), with the page cache dropped before the load (a restart on another machine; on a VM the disk's speed swings from
run to run) and with the files in the page cache (a restart in place: the CPU cost of decoding against
torch.load's), and the CPU time of the warm restores (user + system over all threads: the work that more cores would
share). ``--cores`` repeats the warm restores of ``torch.load`` and the newest checkpoint pinned to the first n CPUs
for each n given: how restores scale with cores on the machine at hand.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

import deltackpt
from bench.models import GPT, GPTConfig
from bench.util import evict
from deltackpt import config


def _category(key: str, muon: set[str] | frozenset[str] = frozenset()) -> str:
    if key.startswith("optimizer") and ".state" in key:
        return key.rsplit(".", 1)[-1]  # exp_avg, exp_avg_sq, step, momentum_buffer
    if key in muon:
        return "weights (Muon)"
    return "weights" if key.startswith("model") else "other"


def train_step(model: GPT, opt: torch.optim.Optimizer | list[torch.optim.Optimizer], cfg: GPTConfig) -> None:
    """One real optimizer step of this benchmark's training: a batch of 2 random token sequences, reproduced."""
    x = torch.randint(0, cfg.vocab, (2, cfg.ctx))
    loss = torch.nn.functional.cross_entropy(model(x).reshape(-1, cfg.vocab), x.reshape(-1))
    model.zero_grad()
    loss.backward()
    for o in opt if isinstance(opt, list) else [opt]:
        o.step()


def _optimizer(name: str, model: GPT) -> list[torch.optim.Optimizer]:
    if name == "sgd":
        return [torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9, weight_decay=1e-4)]
    if name == "muon":  # the blocks' matrices; the embeddings, head, norms and biases by AdamW
        mats = [p for n, p in model.named_parameters() if p.ndim == 2 and n.startswith("blocks.")]
        rest = [p for n, p in model.named_parameters() if not (p.ndim == 2 and n.startswith("blocks."))]
        return [torch.optim.Muon(mats, lr=0.02, weight_decay=0.1, adjust_lr_fn="match_rms_adamw"),
                torch.optim.AdamW(rest, lr=1e-4, weight_decay=0.1)]
    return [torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1)]


def _run(cfg: GPTConfig, saves: int, every: int, root: Path, max_chain: int | None,
         cores: list[int], optimizer: str = "adamw", dtype: torch.dtype = torch.float32) -> dict:
    torch.manual_seed(0)
    model = GPT(cfg).to(dtype)
    opts = _optimizer(optimizer, model)
    names = {id(p): f"model.{n}" for n, p in model.named_parameters()}
    muon = {names[id(p)] for o in opts if isinstance(o, torch.optim.Muon) for g in o.param_groups for p in g["params"]}
    planes = deltackpt.Store(root / "planes", max_chain=0)
    xor = deltackpt.Store(root / "xor", max_chain=max_chain, predict=False)
    delta = deltackpt.Store(root / "delta", max_chain=max_chain, predict=True)
    seen: set[bytes] = set()
    rows = []
    torch_sizes = []
    for n in range(saves):
        for _ in range(every):
            train_step(model, opts, cfg)
        state = {"model": model.state_dict(),
                 "optimizer": opts[0].state_dict() if len(opts) == 1 else [o.state_dict() for o in opts]}
        pt = root / "state.pt"
        torch.save(state, pt)
        torch_bytes = pt.stat().st_size
        torch_sizes.append(torch_bytes)
        ip = planes.save(state, step=n)
        ix = xor.save(state, step=n)
        t0 = time.perf_counter()
        idl = delta.save(state, step=n)
        save_s = time.perf_counter() - t0
        mp, mx, md = planes.manifest(id=ip.id), xor.manifest(id=ix.id), delta.manifest(id=idl.id)
        by = {}
        for tp, tx, td in zip(mp.tensors, mx.tensors, md.tensors):
            cat = _category(tp.key, muon)
            b = by.setdefault(cat, [0, 0, 0, 0, 0])
            b[0] += tp.nbytes
            for _, dg, ln in mp.chunk_keys(tp):
                k = dg + ln.to_bytes(4, "big")
                if k not in seen:
                    b[1] += ln
                    seen.add(k)
            b[2] += tp.written
            b[3] += tx.written
            b[4] += td.written
        rows.append({"save": n, "torch": torch_bytes, "dedup": sum(v[1] for v in by.values()),
                     "planes": ip.written_bytes, "xor": ix.written_bytes, "predicted": idl.written_bytes, "by": by})
        print(f"  save {n:2d}: torch.save {torch_bytes / 1e6:.1f} MB; dedup {rows[-1]['dedup'] / torch_bytes:.3f}, "
              f"planes {ip.written_bytes / torch_bytes:.3f}, xor {ix.written_bytes / torch_bytes:.3f}, "
              f"predicted {idl.written_bytes / torch_bytes:.3f} (saved in {save_s:.2f} s)", flush=True)
    infos = delta.list()
    xor_infos = xor.list()
    for s in (planes, xor, delta):
        s.close()
    loaders = {
        "torch.load": (root / "state.pt", None),
        "predicted newest": (root / "delta", infos[-1].id),
        "predicted oldest": (root / "delta", infos[0].id),
        "xor newest": (root / "xor", xor_infos[-1].id),
        "planes newest": (root / "planes", None),
    }
    # Rounds over all loaders (each cold, then warm), medians per loader: interleaving keeps this VM's swings in
    # disk and CPU speed out of the ratios.
    times: dict[tuple[str, bool], list[float]] = {(name, drop): [] for name in loaders for drop in (True, False)}
    cpu: dict[str, list[float]] = {name: [] for name in loaders}
    for _ in range(3):
        for name, (path, cid) in loaders.items():
            for drop in (True, False):
                if drop:
                    evict(root)
                wall, used = _load_in_child(path, cid)
                times[name, drop].append(wall)
                if not drop:
                    cpu[name].append(used)
    loads = {name: statistics.median(times[name, True]) for name in loaders}
    warm = {name: statistics.median(times[name, False]) for name in loaders}
    warm_cpu = {name: statistics.median(v) for name, v in cpu.items()}
    # The same warm restores on the first n CPUs this process may use: how decoding scales with cores
    # (torch.load runs on one). Interleaved rounds again, medians; five, as these loads are cheap and the
    # ratios between them are what counts.
    allowed = sorted(os.sched_getaffinity(0))
    if cores:  # the last cold round above evicted these files: one untimed load each puts them back in the cache
        for name in ("torch.load", "predicted newest"):
            _load_in_child(*loaders[name])
    pinned: dict[int, dict[str, list[float]]] = {n: {"torch.load": [], "predicted newest": []} for n in cores}
    for _ in range(5):
        for n, by_name in pinned.items():
            for name, walls in by_name.items():
                walls.append(_load_in_child(*loaders[name], allowed[:n])[0])
    scaling = {n: {name: statistics.median(walls) for name, walls in by_name.items()} for n, by_name in pinned.items()}
    return {"rows": rows, "loads": loads, "warm": warm, "warm_cpu": warm_cpu, "scaling": scaling}


# A restore as a restarted job does it: in a fresh process (imports not timed). Timed in one process after other
# loads, torch.load can reuse the memory a previous load freed and skip its page faults (0.14 s instead of
# 0.5-0.6 s here), which measures the allocator's state rather than the format.
_CHILD = """
import os, sys
if sys.argv[3]:
    os.sched_setaffinity(0, [int(c) for c in sys.argv[3].split(",")])  # before torch reads the CPU count
import gc, time, torch, deltackpt
if sys.argv[4]:
    gc.freeze()  # what the imports allocated is never scanned again (bench.restart)
path, cid = sys.argv[1], sys.argv[2] or None
t0, c0 = time.perf_counter(), os.times()
if path.endswith(".pt"):
    torch.load(path, weights_only=True)
else:
    with deltackpt.Store(path) as s:
        s.load(id=cid)
c1 = os.times()
print(time.perf_counter() - t0, c1.user - c0.user + c1.system - c0.system)
"""


def _load_in_child(path: Path, cid: str | None, cpus: list[int] | None = None, *,
                   gc_freeze: bool = False) -> tuple[float, float]:
    """Seconds a fresh process takes to load ``path`` (a ``.pt`` file, or checkpoint ``cid`` of a store, the
    latest when None), imports excluded: wall-clock time and CPU time (user + system, all threads). With
    ``cpus`` the process runs on those CPUs only (deltackpt sizes its thread pools by them); with
    ``gc_freeze`` it calls ``gc.freeze()`` after its imports."""
    pin = ",".join(map(str, cpus)) if cpus else ""
    return timed_child(_CHILD, str(path), cid or "", pin, "1" if gc_freeze else "")


def timed_child(code: str, *args: str, cwd: Path | None = None) -> tuple[float, float]:
    """Run ``code`` in a fresh interpreter with ``args``; return the two numbers its last output line ends with
    (the child's wall-clock and CPU seconds of what it timed)."""
    done = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, check=True, cwd=cwd)
    wall, used = done.stdout.split()[-2:]
    return float(wall), float(used)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--saves", type=int, default=20)
    ap.add_argument("--small", action="store_true")
    ap.add_argument("--every", default="1,10", help="save intervals to run, comma-separated (default 1,10)")
    ap.add_argument("--max-chain", type=int, default=None, help="the delta store's max_chain (default: the store's)")
    ap.add_argument("--optimizer", choices=("adamw", "sgd", "muon"), default="adamw")
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                    help="the model's dtype, and so its optimizer state's (default float32)")
    ap.add_argument("--cores", default="", help="also time warm restores pinned to this many CPUs, comma-separated "
                    "(e.g. 1,2,4; at most the CPUs this process may use)")
    args = ap.parse_args(argv)
    cores = [int(c) for c in args.cores.split(",") if c.strip()]
    available = len(os.sched_getaffinity(0))
    if any(not 1 <= n <= available for n in cores):
        ap.error(f"--cores: each count must be between 1 and {available} (the CPUs this process may use)")
    cfg = GPTConfig(d_model=128, n_layers=4, vocab=2048) if args.small else GPTConfig()
    chain = config.DEFAULT_MAX_CHAIN if args.max_chain is None else args.max_chain
    how = {"sgd": "SGD momentum 0.9 lr 1e-2", "adamw": "AdamW lr 1e-4",
           "muon": "Muon lr 0.02 on the blocks' matrices, AdamW lr 1e-4 on the rest"}[args.optimizer]
    print(f"GPT {cfg.n_params() / 1e6:.1f}M {args.dtype} parameters, {how}; deltackpt backend "
          f"{deltackpt.backend}; delta store max_chain={chain}")
    for every in (int(e) for e in args.every.split(",")):
        root = Path(tempfile.mkdtemp(prefix="deltackpt-delta-"))
        try:
            print(f"\nsaving every {every} step(s), {args.saves} saves")
            res = _run(cfg, args.saves, every, root, chain, cores, args.optimizer, getattr(torch, args.dtype))
        finally:
            shutil.rmtree(root, ignore_errors=True)
        steady = res["rows"][1:]  # the first save has no parent
        tb = sum(r["torch"] for r in steady)
        print(f"\n| every {every} | dedup | byte planes | xor delta | predicted |\n|---|---:|---:|---:|---:|")
        print(f"| all state, saves 2-{args.saves} | " + " | ".join(
            f"{sum(r[k] for r in steady) / tb:.3f}" for k in ("dedup", "planes", "xor", "predicted")) + " |")
        for cat in ("weights", "weights (Muon)", "exp_avg", "exp_avg_sq", "momentum_buffer"):  # of its raw bytes
            logical = sum(r["by"][cat][0] for r in steady if cat in r["by"])
            if logical:
                print(f"| {cat} (of its raw bytes) | " + " | ".join(
                    f"{sum(r['by'][cat][i] for r in steady) / logical:.3f}" for i in (1, 2, 3, 4)) + " |")
        print("\nrestore in a fresh process (page cache dropped, median of 3 interleaved rounds): " + ", ".join(
            f"{k} {v:.2f} s" for k, v in res["loads"].items()))
        print("restore in a fresh process (page cache warm, median of 3 interleaved rounds): " + ", ".join(
            f"{k} {v:.2f} s" for k, v in res["warm"].items()))
        print("CPU time of those warm restores (user + system, all threads; what more cores share): " + ", ".join(
            f"{k} {v:.2f} s" for k, v in res["warm_cpu"].items()))
        for n, t in res["scaling"].items():
            print(f"restore pinned to {n} CPU(s) (page cache warm, median of 5 interleaved rounds): torch.load "
                  f"{t['torch.load']:.2f} s, predicted newest {t['predicted newest']:.2f} s "
                  f"({t['predicted newest'] / t['torch.load']:.2f}x)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
