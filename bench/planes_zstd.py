"""zstd's match finder on byte planes: level 1's own against ``codec.PLANES_PARAMS``, on real AdamW frames.

``python -m bench.planes_zstd [--saves 9] [--every-chunk 13] [--small]`` trains the suite's GPT (52.6M fp32
parameters; ``--small``: 1.3M) with AdamW for ``--saves`` steps, saving the full training state after every
step into a store (deltas and predictions on, as by default). It then takes every n-th chunk of the newest
checkpoint, decodes its frame's byte planes (standalone frames: the planes of the raw bytes; predicted frames:
the planes of the residual) and compresses them again both ways, on one core: size relative to raw, zstd
decoding and encoding speed in GB/s of raw bytes. Only the writer's parameters differ; either frame decodes
with any zstd decoder.

``--restore N`` also saves the same states into a second store whose encoders use level 1's own match finder
for planes too (``codec.PLANES_TUNED_LEVELS`` emptied around its saves) and the last state with
``torch.save``, then times N interleaved rounds of warm restores of the newest checkpoint of each store and of
``torch.load``, each in a fresh process (``bench.delta``'s loader): medians of wall-clock and CPU time.
"""

from __future__ import annotations

import argparse
import collections
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import zstandard

import deltackpt
from bench.delta import _load_in_child, train_step
from bench.models import GPT, GPTConfig
from deltackpt import codec
from deltackpt.index import chunk_key


def _train_and_save(root: Path, saves: int, small: bool, baseline: bool) -> None:
    """Save every step into ``root/store`` (and, with ``baseline``, into ``root/level1`` with level 1's own
    match finder for planes, and the last state into ``root/state.pt``)."""
    cfg = GPTConfig(d_model=128, n_layers=4, vocab=2048) if small else GPTConfig()
    torch.manual_seed(0)
    model = GPT(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1)
    tuned = codec.PLANES_TUNED_LEVELS
    stores = {"store": tuned, **({"level1": ()} if baseline else {})}
    handles = {name: deltackpt.Store(root / name) for name in stores}
    try:
        for n in range(saves):
            train_step(model, opt, cfg)
            state = {"model": model.state_dict(), "optimizer": opt.state_dict()}
            for name, levels in stores.items():
                codec.PLANES_TUNED_LEVELS = levels  # read when a worker thread makes its encoder
                handles[name].save(state, step=n)
        if baseline:
            torch.save(state, root / "state.pt")
    finally:
        codec.PLANES_TUNED_LEVELS = tuned
        for h in handles.values():
            h.close()


def _planes_of_frames(store: deltackpt.Store, every: int) -> list[tuple[str, bytes]]:
    """(frame kind, the byte planes its zstd payload holds) for every ``every``-th chunk of the newest checkpoint."""
    m = store.manifest()
    dctx = zstandard.ZstdDecompressor()
    out = []
    for t in m.tensors:
        for i in range(0, t.count, every):
            k = chunk_key(m.digests[t.first + i].tobytes(), t.chunk_len(i, m.chunk_size))
            loc = store.index.lookup_chunks([k]).get(k)
            if loc is None or loc.codec not in (codec.PLANES_ZSTD, codec.PREDICTED):
                continue
            payload = bytes(store.reader.read(loc.pack_id, loc.offset, loc.frame_len))[codec.HEADER_SIZE:]
            if loc.codec == codec.PREDICTED:
                payload = payload[4 + int.from_bytes(payload[:4], "little"):]  # skip the prediction record
            kind = "predicted (residual planes)" if loc.codec == codec.PREDICTED else "standalone (planes + zstd)"
            out.append((kind, dctx.decompress(payload)))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--saves", type=int, default=9)
    ap.add_argument("--every-chunk", type=int, default=13)
    ap.add_argument("--small", action="store_true")
    ap.add_argument("--restore", type=int, default=0, metavar="N", help="also time N rounds of warm restores")
    args = ap.parse_args(argv)
    settings = {
        "level 1": zstandard.ZstdCompressionParameters(compression_level=1),
        "PLANES_PARAMS": zstandard.ZstdCompressionParameters(compression_level=1, **codec.PLANES_PARAMS),
    }
    times: dict[str, list[tuple[float, float]]] = {}
    with tempfile.TemporaryDirectory() as d:
        root = Path(d)
        print(f"training and saving {args.saves} steps ...", flush=True)
        _train_and_save(root, args.saves, args.small, baseline=args.restore > 0)
        with deltackpt.Store(root / "store") as store:
            frames = _planes_of_frames(store, args.every_chunk)
        loads = {"PLANES_PARAMS": root / "store", "level 1": root / "level1", "torch.load": root / "state.pt"}
        for _ in range(args.restore):
            for name, path in loads.items():
                times.setdefault(name, []).append(_load_in_child(path, None))
    dctx = zstandard.ZstdDecompressor()
    raw: collections.Counter[str] = collections.Counter()
    size: collections.Counter[tuple[str, str]] = collections.Counter()
    enc: collections.Counter[tuple[str, str]] = collections.Counter()
    dec: collections.Counter[tuple[str, str]] = collections.Counter()
    for kind, planes in frames:
        raw[kind] += len(planes)
        for name, params in settings.items():
            cctx = zstandard.ZstdCompressor(compression_params=params)
            t0 = time.perf_counter()
            c = cctx.compress(planes)
            t1 = time.perf_counter()
            for _ in range(3):
                dctx.decompress(c)
            t2 = time.perf_counter()
            size[kind, name] += len(c)
            enc[kind, name] += t1 - t0
            dec[kind, name] += (t2 - t1) / 3
    print(f"{len(frames)} frames; one core\n")
    print("| frames | settings | size / raw | decode GB/s | encode GB/s |\n|---|---|---:|---:|---:|")
    for kind in sorted(raw, reverse=True):
        for name in settings:
            print(f"| {kind} | {name} | {size[kind, name] / raw[kind]:.3f} | {raw[kind] / dec[kind, name] / 1e9:.2f} "
                  f"| {raw[kind] / enc[kind, name] / 1e9:.2f} |")
    if times:
        print(f"\nwarm restore of the newest checkpoint, fresh processes, medians of {args.restore} rounds:")
        for name, ts in times.items():
            print(f"  {name:14s} {statistics.median(t[0] for t in ts):.3f} s, CPU "
                  f"{statistics.median(t[1] for t in ts):.3f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
