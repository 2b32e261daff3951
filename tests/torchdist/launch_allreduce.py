"""``init_process_group("pycoll")`` with nothing else, then one allreduce and one
subgroup allreduce; each rank prints a JSON line.  Run under torchrun or mpiexec."""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist

import pycoll.torch_backend

pycoll.torch_backend.register(timeout=30)
dist.init_process_group("pycoll")
rank, size = dist.get_rank(), dist.get_world_size()
t = torch.arange(4, dtype=torch.float32) + rank
dist.all_reduce(t)
sub = dist.new_group([0, 1], backend="pycoll")
u = torch.ones(3)
if rank < 2:
    dist.all_reduce(u, group=sub)
dist.barrier()
out = {
    "rank": rank,
    "size": size,
    "sum": t.tolist(),
    "sub": u.tolist(),
    "mpi4py": "mpi4py" in sys.modules,
    "env": {k: os.environ.get(k) for k in ("RANK", "MASTER_ADDR")},
}
print(json.dumps(out), flush=True)
dist.destroy_process_group()
