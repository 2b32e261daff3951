"""DDP over the pycoll backend vs DDP over Gloo, in one job (run under mpiexec).

The default process group uses backend ``pycoll``; a second group over the
same ranks uses ``gloo``.  The same model (same seed) is trained with DDP on
each, on the same data shards; rank 0 writes the largest weight difference and
whether the weights are bitwise identical to ``--out`` (JSON).  Before that it
checks the collectives the backend offers against plain NumPy results.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from mpi4py import MPI
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import pycoll.torch_backend


def check_collectives(rank: int, size: int) -> None:
    """Every collective of the backend once, against values every rank can compute."""
    t = torch.arange(6, dtype=torch.float32) + rank
    dist.all_reduce(t)
    want = sum(torch.arange(6, dtype=torch.float32) + r for r in range(size))
    assert torch.equal(t, want), (t, want)
    for op, fn in (
        (dist.ReduceOp.MAX, torch.maximum),
        (dist.ReduceOp.MIN, torch.minimum),
        (dist.ReduceOp.PRODUCT, torch.mul),
    ):
        t = torch.tensor([1.0 + rank, 5.0 - rank, 2.0], dtype=torch.float64)
        dist.all_reduce(t, op=op)
        want = torch.tensor([1.0, 5.0, 2.0], dtype=torch.float64)
        for r in range(1, size):
            want = fn(want, torch.tensor([1.0 + r, 5.0 - r, 2.0], dtype=torch.float64))
        assert torch.equal(t, want), (op, t, want)
    t = torch.full((4,), float(rank + 1))
    dist.all_reduce(t, op=dist.ReduceOp.AVG)
    assert torch.allclose(t, torch.full((4,), (size + 1) / 2)), t
    b = torch.full((3, 2), 1.0, dtype=torch.bfloat16) * (rank + 1)
    dist.all_reduce(b)
    assert torch.equal(b, torch.full((3, 2), size * (size + 1) / 2, dtype=torch.bfloat16)), b
    # non-contiguous
    nc = (torch.arange(12, dtype=torch.float32).reshape(3, 4) * (rank + 1)).t()
    dist.all_reduce(nc)
    assert torch.equal(
        nc, torch.arange(12, dtype=torch.float32).reshape(3, 4).t() * (size * (size + 1) / 2)
    )

    t = (
        torch.tensor([rank, 7, 7], dtype=torch.int64)
        if rank == size - 1
        else torch.zeros(3, dtype=torch.int64)
    )
    dist.broadcast(t, src=size - 1)
    assert t.tolist() == [size - 1, 7, 7], t
    flags = torch.tensor([True, rank == 0])
    dist.broadcast(flags, src=0)
    assert flags.tolist() == [True, True]

    outs = [torch.empty(2, dtype=torch.int32) for _ in range(size)]
    dist.all_gather(outs, torch.tensor([rank, -rank], dtype=torch.int32))
    assert [o.tolist() for o in outs] == [[r, -r] for r in range(size)], outs
    big = torch.empty(size * 3)
    gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather_single(big, torch.full((3,), float(rank)))
    assert torch.equal(big, torch.arange(size).float().repeat_interleave(3)), big

    out = torch.empty(2)
    dist.reduce_scatter(out, [torch.full((2,), float(r + rank)) for r in range(size)])
    assert torch.equal(out, torch.full((2,), float(size * rank + size * (size - 1) / 2))), out
    out = torch.empty(2)
    scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    scatter_single(out, torch.arange(2 * size, dtype=torch.float32))
    assert torch.equal(out, torch.arange(2 * rank, 2 * rank + 2, dtype=torch.float32) * size), out

    t = torch.full((2,), float(rank + 1))
    dist.reduce(t, dst=0)
    if rank == 0:
        assert torch.equal(t, torch.full((2,), size * (size + 1) / 2)), t
    # outs[r][i]: rank r's input i (torch's layout)
    outs = [[torch.empty(2), torch.empty(3)] for _ in range(size)]
    dist.all_gather_coalesced(outs, [torch.tensor([rank, 5.0]), torch.full((3,), rank + 0.5)])
    assert [o[0].tolist() for o in outs] == [[r, 5] for r in range(size)], outs
    assert [o[1].tolist() for o in outs] == [[r + 0.5] * 3 for r in range(size)], outs
    # point-to-point: a ring shift, one receive posted before the send
    right, left = (rank + 1) % size, (rank - 1) % size
    got = torch.empty(2)
    recv = dist.irecv(got, left)
    dist.send(torch.tensor([rank, 7.0]), right)
    recv.wait()
    assert got.tolist() == [left, 7.0], got
    work = dist.all_reduce(torch.ones(3), async_op=True)
    work.wait()
    assert work.is_completed() and work.is_success() and work.exception() is None
    assert torch.equal(work.result()[0], torch.full((3,), float(size)))
    assert torch.equal(work.get_future().wait()[0], torch.full((3,), float(size)))
    dist.barrier()
    pycoll.torch_backend.monitored_barrier(wait_all_ranks=True)


def train(pg, args, rank: int, size: int) -> nn.Module:
    torch.manual_seed(args.seed)
    model = nn.Sequential(
        nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 4)
    )
    # different initial weights on other ranks: DDP's broadcast from rank 0 must fix them
    if rank:
        with torch.no_grad():
            for p in model.parameters():
                p.add_(rank)
    ddp = DDP(model, process_group=pg, bucket_cap_mb=args.bucket_mb)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    rng = np.random.default_rng(args.seed)
    x = torch.from_numpy(rng.standard_normal((args.steps, args.batch * size, 32), dtype=np.float32))
    y = torch.from_numpy(rng.integers(0, 4, (args.steps, args.batch * size)))
    mine = slice(rank * args.batch, (rank + 1) * args.batch)
    for step in range(args.steps):
        opt.zero_grad()
        nn.functional.cross_entropy(ddp(x[step, mine]), y[step, mine]).backward()
        opt.step()
    return model


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--bucket-mb", type=float, default=0.01)
    p.add_argument("--out", required=True)
    args = p.parse_args()

    world = MPI.COMM_WORLD
    rank, size = world.Get_rank(), world.Get_size()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    torch.set_num_threads(1)
    pycoll.torch_backend.register()
    dist.init_process_group("pycoll", rank=rank, world_size=size)
    assert dist.get_backend() == "pycoll", dist.get_backend()
    gloo = dist.new_group(backend="gloo")

    check_collectives(rank, size)
    a = train(None, args, rank, size)
    b = train(gloo, args, rank, size)
    diff = max(float((p - q).detach().abs().max()) for p, q in zip(a.parameters(), b.parameters()))
    same = all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    flat = torch.cat([p.detach().reshape(-1) for p in a.parameters()]).numpy()
    every = world.allgather(flat.tobytes())
    replicas = all(e == every[0] for e in every)
    if rank == 0:
        with open(args.out, "w") as f:
            json.dump({"max_abs_diff": diff, "identical": same, "replicas_identical": replicas}, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
