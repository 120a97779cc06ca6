"""One rank of a small DistributedDataParallel run checkpointed as the README's "Data-parallel jobs" says (a plain
script, not a test module; used by tests/test_checkpointer.py)::

    python tests/ddp_worker.py RANK WORLD INIT_FILE STORE STEPS OUT [MODE [STOP_AT]]

Every rank makes a Checkpointer on STORE, saving every 2 steps, and restores from it. The data comes through a
``ResumableSampler`` sharded over the ranks. MODE ``ranks`` (the default) is the README's pattern: every rank
passes ``rank=`` and calls ``step()``; each seeded its generators differently at start, and draws its dropout and
a NumPy noise term from them; MODE ``unranked`` does the same without ``rank=`` (a mistake: every rank saves), and
MODE ``subgroups`` too, each rank's DDP over a process group of its own, saving into ``STORE-RANK``; MODE ``skip``
is ``ranks`` with ``when_busy="skip"``.
MODE ``seeded`` is the older one: ``rng`` on rank 0 only, rank 0 alone calls
``step()``, and each rank seeds its generator from (step, rank) at every step. With STOP_AT, every rank sends
itself SIGTERM after that step (a job-wide stop). After STEPS steps the model's state goes to ``OUT.RANK`` with
``torch.save``.
"""

import os
import signal
import sys
import warnings

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

import deltackpt
from deltackpt.data import ResumableLoader, ResumableSampler

warnings.simplefilter("ignore")
warnings.filterwarnings("always", message="deltackpt: rank")  # (a rank that finds no RNG states of its own)
rank, world, init, store, steps, out = (int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4],
                                        int(sys.argv[5]), sys.argv[6])
mode = sys.argv[7] if len(sys.argv) > 7 else "ranks"
stop_at = int(sys.argv[8]) if len(sys.argv) > 8 else None
torch.set_num_threads(1)
dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
torch.manual_seed(0)
# MODE subgroups: each rank its own data-parallel group of one (a pipeline stage's replicas) and store
groups = [dist.new_group([r]) for r in range(world)] if mode == "subgroups" else None
if groups is not None:
    store = f"{store}-{rank}"
model = DistributedDataParallel(torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Dropout(0.1),
                                                    torch.nn.Linear(16, 1)),
                                process_group=groups[rank] if groups else None)
opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
g = torch.Generator().manual_seed(1)
data = torch.utils.data.TensorDataset(torch.randn(96, 8, generator=g), torch.randn(96, 1, generator=g))
loader = ResumableLoader(torch.utils.data.DataLoader(
    data, batch_size=4, sampler=ResumableSampler(data, shuffle=True, seed=0, num_replicas=world, rank=rank)))
torch.manual_seed(100 + rank)  # (each rank its own streams; a restore puts back the saved ones)
np.random.seed(100 + rank)
kw = ({"rank": rank} if mode == "ranks" else {"rank": rank, "when_busy": "skip"} if mode == "skip"
      else {} if mode in ("unranked", "subgroups") else {"rng": rank == 0})
with deltackpt.Checkpointer(store, model=model, optimizer=opt, data=loader, every_n_steps=2, **kw) as ckpt:
    step = ckpt.restore()
    while step < steps:
        for x, y in loader:
            if mode == "seeded":
                torch.manual_seed(1000 * step + rank)
            else:
                x = x + float(np.random.randn()) * 1e-2
            loss = torch.nn.functional.mse_loss(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            step += 1
            if mode != "seeded" or rank == 0:
                ckpt.step(step)
            if step == stop_at:
                os.kill(os.getpid(), signal.SIGTERM)
            if step == steps:
                break
torch.save({k: v.clone() for k, v in model.state_dict().items()}, f"{out}.{rank}")
dist.barrier()  # (no rank tears gloo down while another still has work in flight: see dcp_worker.py)
dist.destroy_process_group()
