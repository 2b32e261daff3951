"""FSDP2, FSDP1, DeviceMesh/DTensor and DCP on CPU over one backend (run under mpiexec -n 2).

``--backend pycoll`` or ``--backend gloo``; rank 0 writes, per part, the
losses of a few training steps (or what it raised) to ``--out`` (JSON), so that
tests/test_torch_backend.py can compare the two backends' runs.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
from mpi4py import MPI
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import pycoll.torch_backend


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4)
    )


def batches(rank: int, steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(100 + rank)
    return [
        (torch.randn(8, 16, generator=g), torch.randint(0, 4, (8,), generator=g))
        for _ in range(steps)
    ]


def train(m: nn.Module, rank: int, steps: int) -> list[float]:
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    losses = []
    for x, y in batches(rank, steps):
        opt.zero_grad()
        loss = nn.functional.cross_entropy(m(x), y)
        loss.backward()
        opt.step()
        t = loss.detach().clone()
        dist.all_reduce(t)  # the mean loss over ranks
        losses.append(float(t) / dist.get_world_size())
    return losses


def fsdp2(rank: int, size: int, steps: int) -> list[float]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (size,))
    m = model()
    for layer in m:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(m, mesh=mesh)
    return train(m, rank, steps)


def fsdp1(rank: int, size: int, steps: int) -> list[float]:
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    m = FSDP(model(), device_id=torch.device("cpu"), use_orig_params=True)
    return train(m, rank, steps)


def mesh(rank: int, size: int, steps: int) -> list[float]:
    """A DeviceMesh, a DTensor sharded over it (from each rank's shard, and from
    rank 0's whole tensor, scattered), redistributed and summed."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

    dm = init_device_mesh("cpu", (size,), mesh_dim_names=("dp",))
    torch.manual_seed(1)
    full = torch.randn(4 * size, 3)
    d = DTensor.from_local(full[4 * rank : 4 * rank + 4], dm, [Shard(0)])
    r = d.redistribute(dm, [Replicate()])
    assert torch.equal(r.to_local(), full)
    mine = full if rank == 0 else torch.zeros_like(full)  # only the source's counts
    whole = distribute_tensor(mine, dm, [Shard(0)])
    assert torch.equal(whole.to_local(), full[4 * rank : 4 * rank + 4])
    return [
        float(full.sum()),
        float(d.full_tensor().sum()),
        float((d * 2).sum().full_tensor()),
        float(whole.full_tensor().sum()),
    ]


def dcp(rank: int, size: int, steps: int) -> list[float]:
    """Save an FSDP2 model's state with DCP, change it, load it back."""
    import torch.distributed.checkpoint as dcp_
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    where = os.environ["SHARDED_CKPT"]
    dm = init_device_mesh("cpu", (size,))
    m = model()
    fully_shard(m, mesh=dm)
    before = train(m, rank, steps)
    dcp_.save(m.state_dict(), checkpoint_id=where)
    state = m.state_dict()
    with torch.no_grad():
        for p in m.parameters():
            p.zero_()
    dcp_.load(state, checkpoint_id=where)
    m.load_state_dict(state)
    return before + train(m, rank, 1)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--backend", required=True)
    p.add_argument("--parts", default="mesh,fsdp2,fsdp1,dcp")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    rank, size = MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size()
    torch.set_num_threads(1)
    pycoll.torch_backend.register()
    dist.init_process_group(args.backend, rank=rank, world_size=size)
    res: dict[str, object] = {}
    for part in args.parts.split(","):
        try:
            res[part] = {"losses": globals()[part](rank, size, args.steps)}
        except Exception as exc:
            traceback.print_exc()
            res[part] = {"error": type(exc).__name__, "message": str(exc)[:2000]}
            if args.backend == "pycoll":
                break  # the group may be unusable now
    if rank == 0:
        Path(args.out).write_text(json.dumps(res))
    MPI.COMM_WORLD.Barrier()
    if all("losses" in v for v in res.values()):
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
