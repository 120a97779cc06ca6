"""Muon's weights: what deltackpt's update chunks store, and what an exact predictor would store instead.

``python -m bench.update_frames [--steps 12]`` trains ``bench.optimizers``' model with its ``muon-adamw`` setup
(``torch.optim.Muon`` for the blocks' four 256×1024 matrices, AdamW for the rest), saving every step through a
synchronous ``Checkpointer``. For each of Muon's matrices at each step it reports:
- *stored*: the bytes deltackpt wrote for the matrix, relative to its raw bytes: an update chunk (Muon's
  bfloat16 update ``u``) and a momentum-param frame predicting the weights from it, or at a keyframe turn a
  standalone frame;
- *exact*: the share of elements for which ``p = f32(f32(c0·p') - c1·u)`` (``c0·p'`` rounded to float32 first,
  as torch's ``mul_`` does, then one float64 subtraction rounded once) gives the new weight bit for bit, with
  ``c0 = f32(1 - lr·wd)``, ``c1 = f32(lr·k)`` from the optimizer's group and the matrix's shape. The
  momentum-param predictor does not round ``c0·p'`` first and gets about 70% exactly;
- *exact predictor*: the bytes of the update chunk and the residual under that formula (a predictor deltackpt
  does not have: it would need a new frame version), relative to the matrix's raw bytes.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import numpy as np
import torch

import deltackpt
from bench import optimizers as bo
from deltackpt import codec, predict


def _update_frame(old: np.ndarray, new: np.ndarray, c0: np.float32, alpha: np.float32,
                  enc: codec.Encoder) -> tuple[float, int]:
    """(share of elements predicted exactly, bytes of the frames of u and of the residual) for one matrix."""
    p1 = old * c0  # float32 products, as torch's mul_ by a float32 scalar
    u = predict._update_of(old, new, c0, -alpha)  # (the update the save stores: bfloat16 values as float32)
    with np.errstate(all="ignore"):
        pred = (p1.astype(np.float64) + np.float64(alpha) * u.astype(np.float64)).astype(np.float32)
    exact = float(np.mean(pred.view(np.uint32) == new.view(np.uint32)))
    ub = (u.view(np.uint32) >> 16).astype("<u2").tobytes()  # (its bfloat16 bits)
    u_frame = enc.encode(ub, bytes(16), 2)
    # (a record of the frame's size: the two coefficients; the residual's frame is the predicted one's)
    record = predict.Prediction(predict.MOMENTUM_PARAM, (), (float(c0), float(alpha), 0.0)).pack()
    residual = enc.encode_predicted(new.tobytes(), bytes(16), 4, pred.view(np.uint8), bytes(16), record)
    return exact, len(u_frame) + len(residual)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=12, help="training steps, each saved (default 12)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    model, opts, _ = bo._build("muon-adamw", 0)
    muon = opts[0]
    names = {id(p): f"model.{n}" for n, p in model.named_parameters()}
    enc = codec.Encoder()
    print("| step | matrix | stored / raw | exact | exact predictor / raw |")
    print("|---:|---|---:|---:|---:|")
    totals = [0, 0, 0]  # raw, stored, update frames (steps 2..)
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
                    c0, alpha = np.float32(1 - got[0] * got[1]), np.float32(-got[0] * got[2])
                    exact, frame = _update_frame(before[id(p)], p.detach().numpy(), c0, alpha, enc)
                    key, raw = names[id(p)], p.numel() * 4
                    print(f"| {step} | {key} | {written[key] / raw:.3f} | {exact:.4f} | {frame / raw:.3f} |")
                    if step > 1:
                        totals[0] += raw
                        totals[1] += written[key]
                        totals[2] += frame
    print(f"\nsteps 2-{args.steps}, Muon's matrices: stored {totals[1] / totals[0]:.3f} of their raw bytes, "
          f"with an exact predictor {totals[2] / totals[0]:.3f} (keyframes aside)")


if __name__ == "__main__":
    main()
