"""Throughput of the chunk kernel, native vs the Python reference, next to one memcpy of the same buffer.

    python bench/kernel.py            # 1 GiB buffer, 5 repetitions per line
    python bench/kernel.py --quick    # 64 MiB buffer, 3 repetitions

Prints a markdown table (GB/s = 1e9 bytes per second of input, median of the repetitions, after one warm-up
run) and checks the targets: native digests at 1 MiB chunks with 2 threads no slower than one memcpy,
native digests at 64 KiB chunks >= 1.5x a Python loop over the xxhash package, plane split >= 3 GB/s. Rows for
the four float32 predictors (predicted frames; at most 64 MiB of output) compare the kernel's AVX-512, AVX2 and
portable loops (where the CPU lacks AVX-512, the first two rows run the same AVX2 loops).
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import xxhash

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from deltackpt import _pykernel as ref  # noqa: E402

try:
    from deltackpt import _kernel as native  # noqa: E402
except ImportError:
    native = None

KIB, MIB, GIB = 1 << 10, 1 << 20, 1 << 30
CHUNK_SIZES = [64 * KIB, 256 * KIB, 1 * MIB, 4 * MIB]


def measure(fn: Callable[[], object], nbytes: int, reps: int) -> float:
    """Median throughput in GB/s of fn over nbytes, after one warm-up call."""
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return nbytes / statistics.median(times) / 1e9


def xxhash_loop(buf: np.ndarray, chunk_size: int) -> list[bytes]:
    mv = memoryview(buf)
    return [xxhash.xxh3_128_digest(mv[i : i + chunk_size]) for i in range(0, len(buf), chunk_size)]


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="64 MiB buffer, 3 repetitions")
    ap.add_argument("--size-mib", type=int, default=None, help="buffer size in MiB (default 1024, quick 64)")
    ap.add_argument("--reps", type=int, default=None, help="repetitions per line (default 5, quick 3)")
    args = ap.parse_args()
    size = (args.size_mib or (64 if args.quick else 1024)) * MIB
    reps = args.reps or (3 if args.quick else 5)

    rng = np.random.default_rng(0)
    src = rng.integers(0, 2**63, size // 8, dtype=np.uint64).view(np.uint8)
    base = src.copy()
    base[::7] ^= 0x5A  # a base close to src, as a previous checkpoint would be
    dst = np.empty_like(src)

    rows: list[tuple[str, str, str, str, float]] = []

    def row(op: str, backend: str, threads: object, param: str, fn: Callable[[], object], nbytes: int = size) -> float:
        gbs = measure(fn, nbytes, reps)
        rows.append((op, backend, str(threads), param, gbs))
        print(f"  {op:<20} {backend:<16} t={threads!s:<2} {param:<8} {gbs:7.2f} GB/s", file=sys.stderr)
        return gbs

    memcpy = row("memcpy (np.copyto)", "numpy", 1, "", lambda: np.copyto(dst, src))
    results: dict[tuple[str, str, int, int], float] = {}
    for cs in CHUNK_SIZES:
        label = f"{cs // KIB} KiB" if cs < MIB else f"{cs // MIB} MiB"
        if native is not None:
            for t in (1, 2):
                results["digests", "native", t, cs] = row(
                    "chunk_digests", "native", t, label, lambda cs=cs, t=t: native.chunk_digests(src, cs, t)
                )
        results["digests", "python", 1, cs] = row(
            "chunk_digests", "python", 1, label, lambda cs=cs: ref.chunk_digests(src, cs)
        )
    loop = row("xxhash loop", "python+xxhash", 1, "64 KiB", lambda: xxhash_loop(src, 64 * KIB))

    plane_ops: list[tuple[str, Callable[..., object]]] = [
        ("split_planes w=4", lambda m, t: m.split_planes(src, 4, dst, threads=t)),
        ("xor_split_planes w=4", lambda m, t: m.xor_split_planes(src, base, 4, dst, threads=t)),
        ("merge_planes w=4", lambda m, t: m.merge_planes(src, 4, dst, threads=t)),
        ("merge_planes_xor w=4", lambda m, t: m.merge_planes_xor(src, base, 4, dst, threads=t)),
    ]
    for op, fn in plane_ops:
        if native is not None:
            for t in (1, 2):
                results[op, "native", t, 0] = row(op, "native", t, "", lambda fn=fn, t=t: fn(native, t))
        row(op, "python", 1, "", lambda fn=fn: fn(ref, 1))

    # Predictions (predicted frames), one call per 1 MiB chunk and single-threaded, as loads run them; GB/s of
    # float32 output. The native kernel runs its widest vector loops (AVX-512 where the CPU has it), its AVX2
    # ones and its portable ones.
    n_pred = min(size, 64 * MIB) // 4
    m = (rng.standard_normal(n_pred) * 1e-3).astype(np.float32)
    m1 = (0.9 * m + rng.standard_normal(n_pred).astype(np.float32) * 1e-4).astype(np.float32)
    v = (m.astype(np.float64) ** 2 + 1e-10).astype(np.float32)
    p = rng.standard_normal(n_pred).astype(np.float32)
    out = np.empty_like(p)
    predictors = [
        ("predict adam-v", 1, [0.9, 10.0, 0.999, 0.001], v, [m, m1]),
        ("predict adam-param", 2, [0.9, 10.0, 0.999, 0.001, 0.99999, 1e-4, 1e-8], p, [m, m1, v]),
        ("predict momentum-param", 3, [0.99999, 1e-3, 9e-4], p, [m, m1]),
        # (Muon's: float32 coefficients and an update of bfloat16 values, as saves write them)
        ("predict update-param", 6, [float(np.float32(0.998)), float(np.float32(0.0785))], p,
         [(m.view(np.uint32) & np.uint32(0xFFFF0000)).view(np.float32)]),
    ]

    def predict_chunks(mod: object, predictor: int, coefs: list[float], b: np.ndarray, refs: list[np.ndarray]) -> None:
        step = MIB // 4
        for at in range(0, n_pred, step):
            cut = slice(at, at + step)
            mod.predict(predictor, coefs, b[cut], [r[cut] for r in refs], out[cut])  # type: ignore[attr-defined]

    for op, *args in predictors:
        if native is not None:
            for name, level in (("native", native.SIMD_ALL), ("native, AVX2 at most", native.SIMD_AVX2),
                                ("native, portable", native.SIMD_NONE)):
                was = native.use_simd(level)
                try:
                    results[op, name, 1, 0] = row(op, name, 1, "1 MiB", lambda a=args: predict_chunks(native, *a),
                                                  4 * n_pred)
                finally:
                    native.use_simd(was)
        row(op, "python", 1, "1 MiB", lambda a=args: predict_chunks(ref, *a), 4 * n_pred)

    print(f"\nBuffer {size // MIB} MiB, median of {reps} after one warm-up; {cpu_name()}, {os.cpu_count()} CPUs;")
    print(f"Python {platform.python_version()}, numpy {np.__version__}, xxhash {xxhash.VERSION}.\n")
    print("| operation | backend | threads | chunk | GB/s | x memcpy |")
    print("|---|---|---:|---:|---:|---:|")
    for op, backend, threads, param, gbs in rows:
        print(f"| {op} | {backend} | {threads} | {param} | {gbs:.2f} | {gbs / memcpy:.2f} |")

    if native is None:
        print("\nnative extension not built: targets not checked")
        return 0
    checks = [
        (
            "native digests, 1 MiB chunks, 2 threads >= one memcpy",
            results["digests", "native", 2, MIB],
            memcpy,
        ),
        (
            "native digests, 64 KiB chunks, 1 thread >= 1.5x the python xxhash loop",
            results["digests", "native", 1, 64 * KIB],
            1.5 * loop,
        ),
        (
            "native digests, 64 KiB chunks, 2 threads >= 1.5x the python xxhash loop",
            results["digests", "native", 2, 64 * KIB],
            1.5 * loop,
        ),
        ("split_planes w=4, 1 thread >= 3 GB/s", results["split_planes w=4", "native", 1, 0], 3.0),
    ]
    print("\n| target | measured GB/s | needed GB/s | met |")
    print("|---|---:|---:|---|")
    for name, got, need in checks:
        print(f"| {name} | {got:.2f} | {need:.2f} | {'yes' if got >= need else 'NO'} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
