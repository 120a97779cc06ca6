"""One rank of a torch.distributed job (gloo, CPU) saving or loading DTensor shards through deltackpt.distributed.

``python tests/dcp_worker.py MODE RANK WORLD ROOT INIT_FILE [STEP]``; :func:`expected` is the full state of a
step, which tests/test_distributed.py checks loads against.

- ``save``: the state of STEP, its matrix sharded by rows over the ranks (``Shard(0)``), saved as STEP;
- ``load``: the newest checkpoint loaded into the matrix sharded by columns (``Shard(1)``): resharding;
  each rank checks its shard and the plain values and exits 0 only if they match;
- ``die``: saves STEP but is killed (SIGKILL, by itself) at the coordinator's commit;
- ``replicated``: saves STEP of a state of plain (not sharded) tensors and values, which DCP's planner, told to
  save replicated items on the lowest rank, plans for the coordinator alone: the other ranks write nothing;
- ``no-dist``: every rank saves a tensor of its own with ``no_dist=True``, and prints whether it was warned;
- ``subgroup``: ranks 1 and 2 of 3 save a tensor each with a process group of those two, printing whether each
  was warned (rank 0 saves nothing);
- ``load-race``: ``load``, with rank 0 creating ROOT.read once it has read the newest step's metadata and rank 1
  waiting for ROOT.go before reading it (a test commits a step in between);
- ``misuse``: ``misuse RANK WORLD ROOT INIT KIND``, a save or load whose ranks disagree, printing what it raised:
  KIND ``roots`` (each rank saves step 1 into ROOT-rRANK), ``steps`` (rank r saves step 1 + r into ROOT),
  ``loads`` (steps 1 and 2 saved, then rank r loads step 1 + r);
- ``branch``: saves the states of steps 0 to 3 through one writer, loads step 1 (a rollback) and saves steps 2
  and 3 again through a new writer: a branch from step 1 on every rank;
- ``rng``: saves STEP's sharded state with each rank's NumPy RNG state, a tuple holding a tensor (values DCP
  pickles) and all its RNG states (``deltackpt.rng.rng_state()``, the README's recipe) under keys of the rank's
  own, loads it back into a fresh state without ``allow_pickle`` and prints ``ok`` when the values match and
  the RNG draws after ``np.random.set_state`` and ``set_rng_state`` repeat;
- ``retain``: saves the states of steps STEP to STEP + COUNT - 1 (``retain RANK WORLD ROOT INIT STEP COUNT``)
  through one writer with ``Retention(keep_last=2)``, gc after every retention that deleted anything (the
  threshold lowered to 0), printing ``saved N`` after each step (a test kills the ranks at some point).
"""

from __future__ import annotations

import contextlib
import datetime
import os
import signal
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

ROWS, COLS = 12, 10


def expected(step: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(0)
    w = torch.randn(ROWS, COLS, generator=g)
    w[0, : step + 1] += 0.5 * step  # a few elements change each step
    return {"w": w, "b": torch.arange(COLS, dtype=torch.float64) * step, "step": step, "tag": f"step-{step}",
            "sched": {"lr": [1e-3, 5e-4], "warmup": step < 3}}


def main() -> int:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    try:
        from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    except ImportError:  # torch < 2.5: DTensor's API is torch.distributed._tensor's
        from torch.distributed._tensor import Replicate, Shard, distribute_tensor  # type: ignore[no-redef]

    from deltackpt.distributed import DeltaStorageReader, DeltaStorageWriter

    warnings.filterwarnings("ignore")
    mode, rank, world, root, init = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5]
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world,
                            # (load-race: rank 0 waits in a collective while the test saves another step)
                            timeout=datetime.timedelta(seconds=180 if mode == "load-race" else 30))
    mesh = init_device_mesh("cpu", (world,))

    def sharded(step: int) -> dict[str, Any]:
        full = expected(step)
        return dict(full, w=distribute_tensor(full["w"], mesh, [Shard(0)]),
                    b=distribute_tensor(full["b"], mesh, [Replicate()]))

    try:
        if mode in ("save", "die"):
            step = int(sys.argv[6])
            full = expected(step)
            state = dict(full, w=distribute_tensor(full["w"], mesh, [Shard(0)]),
                         b=distribute_tensor(full["b"], mesh, [Replicate()]))

            class Dying(DeltaStorageWriter):
                def finish(self, metadata: Any, results: Any) -> None:
                    os.kill(os.getpid(), signal.SIGKILL)

            writer = (Dying if mode == "die" else DeltaStorageWriter)(root, step=step)
            dcp.save(state, storage_writer=writer)
            writer.close()
            return 0
        if mode == "rng":
            import random

            import numpy as np

            from deltackpt.rng import rng_state, set_rng_state

            step = int(sys.argv[6])
            np.random.seed(100 * step + rank)
            np.random.random(rank + 1)
            random.seed(step + rank)
            random.gauss(0, 1)  # (the second of the pair is cached in Python's state)
            torch.manual_seed(step + rank)
            mine = {f"np_rng_{rank}": np.random.get_state(),
                    f"pair_{rank}": (torch.arange(5, dtype=torch.int16) * rank, [np.float32(rank), rank]),
                    f"all_rng_{rank}": rng_state()}  # (the README's recipe for each rank's RNG states)
            writer = DeltaStorageWriter(root, step=step)
            dcp.save({**sharded(step), **mine}, storage_writer=writer)
            writer.close()
            # what the saved states draw next, drawn before the template below: a load that left the template's
            # states in place would then put back states past these draws, and the test would tell
            draws = np.random.random(8)
            others = (torch.rand(4).tolist(), random.gauss(0, 1), random.random())
            state = {**sharded(0), f"np_rng_{rank}": None, f"pair_{rank}": None, f"all_rng_{rank}": rng_state()}
            dcp.load(state, storage_reader=DeltaStorageReader(root))  # (no allow_pickle)
            np.random.set_state(state[f"np_rng_{rank}"])
            same_np = np.array_equal(np.random.random(8), draws)
            set_rng_state(state[f"all_rng_{rank}"])
            same_all = (np.array_equal(np.random.random(8), draws)
                        and (torch.rand(4).tolist(), random.gauss(0, 1), random.random()) == others)
            pair = state[f"pair_{rank}"]
            ok = (same_np and same_all and type(state[f"np_rng_{rank}"]) is tuple
                  and type(pair) is tuple and pair[0].dtype == torch.int16
                  and torch.equal(pair[0], mine[f"pair_{rank}"][0]) and pair[1] == mine[f"pair_{rank}"][1]
                  and type(pair[1][0]) is np.float32 and state["step"] == step
                  and torch.equal(state["w"].full_tensor(), expected(step)["w"]))
            print(f"rank {rank}: {'ok' if ok else 'MISMATCH'}", flush=True)
            return 0 if ok else 1
        if mode == "retain":
            import deltackpt
            os.environ["DELTACKPT_GC_MIN_BYTES"] = "0"  # collect as soon as retention deleted a quarter
            first, count = int(sys.argv[6]), int(sys.argv[7])
            writer = DeltaStorageWriter(root, step=first, retention=deltackpt.Retention(keep_last=2))
            for step in range(first, first + count):
                writer.step = step
                dcp.save(sharded(step), storage_writer=writer)
                print(f"saved {step}", flush=True)
            writer.close()
            return 0
        if mode == "branch":
            writer = DeltaStorageWriter(root)
            for step in range(4):
                writer.step = step
                dcp.save(sharded(step), storage_writer=writer)
            writer.close()
            state = sharded(0)
            dcp.load(state, storage_reader=DeltaStorageReader(root, step=1))
            assert state["step"] == 1 and torch.equal(state["w"].full_tensor(), expected(1)["w"])
            writer = DeltaStorageWriter(root)
            for step in (2, 3):
                writer.step = step
                dcp.save(sharded(step), storage_writer=writer)
            writer.close()
            return 0
        if mode == "misuse":
            kind = sys.argv[6]
            if kind == "loads":
                for step in (1, 2):
                    w = DeltaStorageWriter(root, step=step)
                    dcp.save({"x": torch.full((8,), float(step))}, storage_writer=w)
                    w.close()
            try:
                if kind == "loads":
                    dcp.load({"x": torch.zeros(8)}, storage_reader=DeltaStorageReader(root, 1 + rank))
                else:
                    w = DeltaStorageWriter(f"{root}-r{rank}" if kind == "roots" else root,
                                           step=1 + rank if kind == "steps" else 1)
                    dcp.save({"x": torch.full((8,), float(rank)), f"mine{rank}": torch.ones(4)}, storage_writer=w)
                    w.close()
            except BaseException as exc:  # (DCP wraps the ranks' failures in a CheckpointException)
                print(f"refused: {exc}", flush=True)
            else:
                print("done", flush=True)
            # (no destroy_process_group: after a failed collective gloo's teardown can abort the process)
            os._exit(0)
        if mode == "subgroup":  # ranks 1 and 2 of 3 save with a process group of their own two
            group = dist.new_group([1, 2])
            if rank in (1, 2):
                writer = DeltaStorageWriter(root, step=1)
                with warnings.catch_warnings(record=True) as caught:
                    warnings.simplefilter("always")
                    dcp.save({f"r{rank}": torch.full((4,), float(rank))}, storage_writer=writer, process_group=group)
                writer.close()
                warned = any(issubclass(w.category, RuntimeWarning) and "saves as rank 0" in str(w.message)
                             for w in caught)
                print("warned" if warned else "quiet", flush=True)
            return 0
        if mode == "replicated":
            step = int(sys.argv[6])
            writer = DeltaStorageWriter(root, step=step)
            dcp.save({"x": torch.full((1000,), float(step)), "y": torch.ones(10), "step": step}, storage_writer=writer,
                     planner=dcp.DefaultSavePlanner(dedup_save_to_lowest_rank=True))
            writer.close()
            return 0
        if mode == "no-dist":  # every rank saves on its own (dcp.save's no_dist=True), as rank 0
            writer = DeltaStorageWriter(root, step=1)
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                dcp.save({f"r{rank}": torch.full((4,), float(rank))}, storage_writer=writer, no_dist=True)
            writer.close()
            warned = any(issubclass(w.category, RuntimeWarning) and "saves as rank 0" in str(w.message) for w in caught)
            print("warned" if warned else "quiet", flush=True)
            return 0
        if mode in ("load", "load-race"):
            reader = DeltaStorageReader(root)
            if mode == "load-race":

                class Racing(DeltaStorageReader):
                    def read_metadata(self) -> Any:
                        if rank == 1:
                            while not os.path.exists(root + ".go"):
                                time.sleep(0.02)
                        md = super().read_metadata()
                        if rank == 0:
                            Path(root + ".read").touch()
                        return md

                reader = Racing(root)
            state = {"w": distribute_tensor(torch.zeros(ROWS, COLS), mesh, [Shard(1)]),
                     "b": distribute_tensor(torch.zeros(COLS, dtype=torch.float64), mesh, [Replicate()]),
                     "step": 0, "tag": "", "sched": {"lr": [0.0, 0.0], "warmup": False}}
            dcp.load(state, storage_reader=reader)
            want = expected(state["step"])
            cols = COLS // world
            ok = (torch.equal(state["w"].to_local(), want["w"][:, rank * cols:(rank + 1) * cols])
                  and torch.equal(state["b"].to_local(), want["b"])
                  and {k: state[k] for k in ("step", "tag", "sched")} == {k: want[k] for k in ("step", "tag", "sched")})
            print(f"rank {rank} loaded step {state['step']}: {'ok' if ok else 'MISMATCH'}", flush=True)
            return 0 if ok else 1
        raise SystemExit(f"unknown mode {mode}")
    finally:
        if dist.is_initialized():
            # Every rank reaches the teardown before any tears down: a rank destroying its group while the other
            # still had gloo work in flight aborted once ("terminate called without an active exception", on a
            # loaded 2-core machine). Bounded: after a failure the other rank may never come.
            with contextlib.suppress(Exception):
                dist.monitored_barrier(timeout=datetime.timedelta(seconds=20))
            dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
