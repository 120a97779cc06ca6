"""One rank of a small DistributedDataParallel run checkpointed as the README's "Data-parallel jobs" says (a plain
script, not a test module; used by tests/test_checkpointer.py)::

    python tests/ddp_worker.py RANK WORLD INIT_FILE STORE STEPS OUT

Every rank makes a Checkpointer on STORE (``rng`` on rank 0 only) and restores from it; rank 0 alone calls
``step()``, every 2 steps. The data comes through a ``ResumableSampler`` sharded over the ranks; each rank seeds
its generator from (step, rank) at every step, for its dropout. After STEPS steps the model's state goes to
``OUT.RANK`` with ``torch.save``.
"""

import sys
import warnings

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

import deltackpt
from deltackpt.data import ResumableLoader, ResumableSampler

warnings.simplefilter("ignore")
rank, world, init, store, steps, out = (int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4],
                                        int(sys.argv[5]), sys.argv[6])
torch.set_num_threads(1)
dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
torch.manual_seed(0)
model = DistributedDataParallel(torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Dropout(0.1),
                                                    torch.nn.Linear(16, 1)))
opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
g = torch.Generator().manual_seed(1)
data = torch.utils.data.TensorDataset(torch.randn(96, 8, generator=g), torch.randn(96, 1, generator=g))
loader = ResumableLoader(torch.utils.data.DataLoader(
    data, batch_size=4, sampler=ResumableSampler(data, shuffle=True, seed=0, num_replicas=world, rank=rank)))
with deltackpt.Checkpointer(store, model=model, optimizer=opt, data=loader, rng=rank == 0, every_n_steps=2) as ckpt:
    step = ckpt.restore()
    while step < steps:
        for x, y in loader:
            torch.manual_seed(1000 * step + rank)
            loss = torch.nn.functional.mse_loss(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            step += 1
            if rank == 0:
                ckpt.step(step)
            if step == steps:
                break
torch.save({k: v.clone() for k, v in model.state_dict().items()}, f"{out}.{rank}")
dist.barrier()  # (no rank tears gloo down while another still has work in flight: see dcp_worker.py)
dist.destroy_process_group()
