"""Muon's weights: what deltackpt's update chunks store, and what the predictor before update-param stored.

``python -m bench.update_frames [--steps 12]`` trains ``bench.optimizers``' model with its ``muon-adamw`` setup
(``torch.optim.Muon`` for the blocks' four 256×1024 matrices, AdamW for the rest), saving every step through a
synchronous ``Checkpointer``. For each of Muon's matrices at each step it reports:
- *stored*: the bytes deltackpt wrote for the matrix, relative to its raw bytes: an update chunk (Muon's
  bfloat16 update ``u``) and an update-param frame predicting the weights from it, or at a keyframe turn a
  standalone frame;
- *exact*: the share of elements that the update-param predictor, ``p = f32(c0·p') - c1·u`` rounded once (as
  torch's ``mul_`` and fused ``add_`` compute it), gives back bit for bit, with ``c0 = f32(1 - lr·wd)``,
  ``c1 = f32(lr·k)`` from the optimizer's group and the matrix's shape;
- *momentum-param*: the bytes of the update chunk and the residual under the momentum-param predictor, which
  deltackpt wrote before frames of version 5 (``c0·p' - c1·u`` in float64, rounded once: about 70% exact),
  relative to the matrix's raw bytes.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import numpy as np
import torch

import deltackpt
from bench import optimizers as bo
from deltackpt import codec, kernel, predict


def _update_frame(old: np.ndarray, new: np.ndarray, c0: np.float32, c1: np.float32,
                  enc: codec.Encoder) -> tuple[float, int, int]:
    """(share of elements update-param predicts exactly, bytes of the frames of u and of its residual under
    update-param, and under momentum-param) for one matrix."""
    u = predict._update_of(old, new, c0, c1)  # (the update the save stores: bfloat16 values as float32)
    exact = np.empty_like(new)
    kernel.predict(predict.UPDATE_PARAM, (float(c0), float(c1)), old, [u], exact.view(np.uint8))
    share = float(np.mean(exact.view(np.uint32) == new.view(np.uint32)))
    before = np.empty_like(new)
    record = predict.Prediction(predict.MOMENTUM_PARAM, (bytes(16),) * 2, (float(c0), float(c1), 0.0))
    predict.predict(record, old, [u, u], before.view(np.uint8))
    u_frame = len(enc.encode(u.view(np.uint8), bytes(16), 4))
    frames = []
    for rec, guess in ((predict.Prediction(predict.UPDATE_PARAM, (bytes(16),), (float(c0), float(c1))), exact),
                       (record, before)):
        frames.append(u_frame + len(enc.encode_predicted(new.tobytes(), bytes(16), 4, guess.view(np.uint8),
                                                         bytes(16), rec.pack())))
    return share, frames[0], frames[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=12, help="training steps, each saved (default 12)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    model, opts, _ = bo._build("muon-adamw", 0)
    muon = opts[0]
    names = {id(p): f"model.{n}" for n, p in model.named_parameters()}
    enc = codec.Encoder()
    print("| step | matrix | stored / raw | exact | momentum-param / raw |")
    print("|---:|---|---:|---:|---:|")
    totals = [0, 0, 0, 0]  # raw, stored, the pair under update-param, under momentum-param (steps 2..)
    with tempfile.TemporaryDirectory(prefix="deltackpt-bench-update-") as tmp, \
            deltackpt.Checkpointer(Path(tmp) / "s", model=model, optimizer=opts, async_save=False,
                                   handle_signals=False) as ck:
        for step in range(1, args.steps + 1):
            before = {id(p): p.detach().numpy().copy() for g in muon.param_groups for p in g["params"]}
            bo._train_step(model, opts, None, step)
            ck.step(step)
            written = {t.key: t.written for t in ck.store.manifest(step=step).tensors}
            for g in muon.param_groups:
                for p in g["params"]:
                    got = predict._muon_update(g, tuple(p.shape))  # (lr, weight decay, the shape's lr factor)
                    assert got is not None
                    c0, c1 = np.float32(1 - got[0] * got[1]), np.float32(got[0] * got[2])
                    exact, pair, old = _update_frame(before[id(p)], p.detach().numpy(), c0, c1, enc)
                    key, raw = names[id(p)], p.numel() * 4
                    print(f"| {step} | {key} | {written[key] / raw:.3f} | {exact:.4f} | {old / raw:.3f} |")
                    if step > 1:
                        totals[0] += raw
                        totals[1] += written[key]
                        totals[2] += pair
                        totals[3] += old
    print(f"\nsteps 2-{args.steps}, Muon's matrices: stored {totals[1] / totals[0]:.3f} of their raw bytes "
          f"(keyframe turns included); an update chunk and its predicted frame: {totals[2] / totals[0]:.3f} "
          f"(update-param), {totals[3] / totals[0]:.3f} (momentum-param)")


if __name__ == "__main__":
    main()
