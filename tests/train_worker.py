"""A small, deterministic training run checkpointed by a Checkpointer (a plain script, not a test module).

Used by tests/test_checkpointer.py, both as a subprocess (exact resume after SIGKILL, SIGTERM handling) and
as a module (:func:`build` and :func:`train` for the in-process resume test). Run as::

    python tests/train_worker.py --store DIR --log FILE [--out FILE] [--steps N] [--every K] [--sleep S]
                                 [--workers W] [--chain-marker FILE] [--finally-out FILE]

The run: ``torch.manual_seed`` at start, one CPU thread, a Linear-ReLU-Dropout-Linear model, AdamW and a
cosine LR schedule, trained on a TensorDataset of random data (from a fixed seed) through
``ResumableLoader(DataLoader(ds, batch_size=8, num_workers=W, sampler=ResumableSampler(ds, shuffle=True,
seed=1)))`` - 100 samples, so 13 batches an epoch, the last one partial. ``start = ckpt.restore()`` resumes
from the store's latest checkpoint; after each step the line ``"<step> <loss.hex()>"`` is appended to the log
(one ``write`` call per line, so a SIGKILL never leaves half a line) and ``ckpt.step(step)`` runs. At the end
the final model/optimizer/scheduler/RNG/data state goes to ``--out`` with ``torch.save`` and ``DONE`` is
printed. A ``finally`` block always prints ``FINALLY <last completed step>`` (and with ``--finally-out``
saves the model's state there), so a test can see that a signal-triggered exit ran it.

``--chain-marker FILE`` installs a Python SIGTERM handler *before* the Checkpointer: when called it writes
``"<signum> <step of the store's latest checkpoint>"`` to FILE and exits with status 0.

``python tests/train_worker.py --zygote`` imports torch (and ``torch._dynamo``, which building a torch
optimizer imports: about half of a cold start) without running a single tensor op, answers ``{"ready": true}``
and then reads one JSON command per line on stdin: ``{"op": "run", "argv": [...], "output": FILE}`` forks a
child (its own process group, stdout and stderr to FILE) that runs ``main(argv)``, and answers
``{"pid": PID}``; ``{"op": "wait", "pid": PID}`` reaps it and answers ``{"code": EXITCODE}`` (negative: the
signal that killed it). A run forked from the warm zygote starts in milliseconds instead of seconds.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
import traceback
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import deltackpt
from deltackpt.data import ResumableLoader, ResumableSampler

DATASET_LEN = 100
BATCH_SIZE = 8
DATA_SEED = 1234


def build(total_steps: int, num_workers: int = 2, seed: int = 0) -> dict[str, Any]:
    """Model, optimizer, scheduler and loader of the run; ``seed`` seeds the global RNG (model init)."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Dropout(0.3), nn.Linear(32, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=total_steps, eta_min=1e-4)
    g = torch.Generator().manual_seed(DATA_SEED)  # the data never depends on ``seed``
    ds = TensorDataset(torch.randn(DATASET_LEN, 16, generator=g), torch.randn(DATASET_LEN, 4, generator=g))
    loader = ResumableLoader(
        DataLoader(ds, batch_size=BATCH_SIZE, num_workers=num_workers,
                   sampler=ResumableSampler(ds, shuffle=True, seed=1))
    )
    return {"model": model, "optimizer": opt, "scheduler": sched, "data": loader}


def train_step(parts: dict[str, Any], batch: Any) -> float:
    model, opt, sched = parts["model"], parts["optimizer"], parts["scheduler"]
    x, y = batch
    model.train()
    loss = nn.functional.mse_loss(model(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
    sched.step()
    return float(loss.item())


def final_state(parts: dict[str, Any]) -> dict[str, Any]:
    return {
        "model": parts["model"].state_dict(),
        "optimizer": parts["optimizer"].state_dict(),
        "scheduler": parts["scheduler"].state_dict(),
        "rng": torch.get_rng_state(),
        "data": parts["data"].state_dict(),
    }


def _log(fd: int, line: str) -> None:
    os.write(fd, (line + "\n").encode())


def _forever(loader: DataLoader) -> Any:
    """The loader's batches, epoch after epoch (each epoch starts its workers afresh)."""
    while True:
        yield from loader


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--store", required=True)
    ap.add_argument("--log", required=True)
    ap.add_argument("--out")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--every", type=int, default=1)
    ap.add_argument("--sleep", type=float, default=0.0)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--chain-marker")
    ap.add_argument("--finally-out")
    ap.add_argument("--eval-workers", type=int, default=0)
    ap.add_argument("--when-busy", default="wait")
    args = ap.parse_args(argv)

    torch.set_num_threads(1)
    parts = build(args.steps, args.workers)
    ckpt: deltackpt.Checkpointer | None = None

    if args.chain_marker:
        def previous_handler(signum: int, frame: Any) -> None:
            assert ckpt is not None
            latest = ckpt.store.latest()
            with open(args.chain_marker, "w") as f:
                f.write(f"{signum} {latest.step if latest is not None else -1}\n")
            sys.exit(0)

        signal.signal(signal.SIGTERM, previous_handler)

    ckpt = deltackpt.Checkpointer(
        args.store, model=parts["model"], optimizer=parts["optimizer"], scheduler=parts["scheduler"],
        data=parts["data"], every_n_steps=args.every, async_save=True, when_busy=args.when_busy,
    )
    evals = None
    if args.eval_workers:  # an evaluation loader the checkpointer was not given: one batch drawn per step
        eval_loader = DataLoader(parts["data"].loader.dataset, batch_size=BATCH_SIZE, num_workers=args.eval_workers)
        ckpt.protect_workers(eval_loader)
        evals = _forever(eval_loader)
    fd = os.open(args.log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    done = 0
    try:
        start = ckpt.restore()
        done = start
        _log(fd, f"START {start}")
        batches = parts["data"].batches()
        for step in range(start + 1, args.steps + 1):
            loss = train_step(parts, next(batches))
            if evals is not None:
                next(evals)
            _log(fd, f"{step} {loss.hex()}")
            if args.sleep:
                time.sleep(args.sleep)
            done = step
            ckpt.step(step)
        ckpt.close()
        if args.out:
            torch.save(final_state(parts), args.out)
        print("DONE", flush=True)
    finally:
        print(f"FINALLY {done}", flush=True)
        if args.finally_out:
            torch.save(parts["model"].state_dict(), args.finally_out)
        os.close(fd)
        ckpt.close()
    return 0


def _reply(obj: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def _child(argv: list[str], output: str) -> None:
    """In a forked child: run ``main(argv)`` with stdout/stderr to ``output``; never returns."""
    code = 1
    try:
        os.setpgid(0, 0)
        fd = os.open(output, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.close(null)
        code = main(argv)
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException:
        traceback.print_exc()
        code = 1
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def zygote() -> int:
    import torch._dynamo  # noqa: F401  (imported by the first optimizer otherwise)
    import torch.optim.lr_scheduler  # noqa: F401

    _reply({"ready": True})
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["op"] == "run":
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                _child(cmd["argv"], cmd["output"])
            try:
                os.setpgid(pid, pid)
            except OSError:  # the child did it first (or is gone already)
                pass
            _reply({"pid": pid})
        elif cmd["op"] == "wait":
            _, status = os.waitpid(cmd["pid"], 0)
            _reply({"code": os.waitstatus_to_exitcode(status)})
        else:
            _reply({"error": f"unknown op {cmd['op']!r}"})
    return 0


if __name__ == "__main__":
    sys.exit(zygote() if sys.argv[1:] == ["--zygote"] else main())
