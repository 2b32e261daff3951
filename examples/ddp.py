"""DistributedDataParallel over the ``pycoll`` backend, under either launcher::

    mpiexec -n 2 python examples/ddp.py
    torchrun --standalone --nproc-per-node 2 examples/ddp.py

Under mpiexec the backend takes rank and size from MPI (no RANK or
MASTER_ADDR needed); under torchrun it bootstraps over the store torch hands
it.  Each rank trains the same small MLP on its shard of a fixed dataset; at
the end every rank's parameters must be bitwise the same (checked over the
group), and rank 0 prints the loss per step.  ``--json FILE`` writes each
rank's losses and a hash of its parameters.
"""

from __future__ import annotations

import argparse
import hashlib
import json

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import pycoll.torch_backend


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--batch", type=int, default=64, help="per rank")
    p.add_argument("--json", default=None)
    a = p.parse_args()

    pycoll.torch_backend.register()
    dist.init_process_group("pycoll")
    rank, size = dist.get_rank(), dist.get_world_size()

    torch.manual_seed(0)  # the same initial weights on every rank
    model = DDP(nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 1)))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(size * a.batch * a.steps, 32, generator=g)
    y = x.sum(dim=1, keepdim=True).sin()
    losses = []
    for step in range(a.steps):
        lo = (step * size + rank) * a.batch  # this rank's shard of the step's batch
        loss = nn.functional.mse_loss(model(x[lo : lo + a.batch]), y[lo : lo + a.batch])
        opt.zero_grad()
        loss.backward()  # DDP averages the gradients over pycoll
        opt.step()
        losses.append(loss.item())
        if rank == 0:
            print(f"step {step} loss {loss.item():.6f}", flush=True)

    flat = torch.cat([q.detach().reshape(-1) for q in model.parameters()])
    digest = hashlib.sha256(flat.numpy().tobytes()).hexdigest()
    digests: list[str | None] = [None] * size
    dist.all_gather_object(digests, digest)
    if len(set(digests)) != 1:
        raise SystemExit(f"rank {rank}: the replicas differ: {digests}")
    if a.json:
        with open(f"{a.json}.{rank}", "w") as f:
            json.dump({"rank": rank, "losses": losses, "params": digest}, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
