"""The bitwise ops and the newer dtypes through torch.distributed (run under mpiexec).

Every rank builds every rank's tensor from a seed and checks the result of
``all_reduce`` against torch's own elementwise ops.  (The ops that do not apply
to a dtype are refused by pycoll itself, see tests/test_api_hypothesis.py.)
Prints ``ok`` on success.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from mpi4py import MPI

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import pycoll.torch_backend

COUNT = 37  # prime: no size lines up with a word

BITWISE = {
    dist.ReduceOp.BAND: torch.bitwise_and,
    dist.ReduceOp.BOR: torch.bitwise_or,
    dist.ReduceOp.BXOR: torch.bitwise_xor,
}


def tensor_of(rank: int, dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * rank + 17)
    if dtype is torch.bool:
        return torch.randint(0, 2, (COUNT,), generator=g).bool()
    if dtype.is_complex:
        return torch.randn(COUNT, generator=g, dtype=dtype)
    # every bit pattern of the narrower types (the conversion wraps)
    return torch.randint(-(2**62), 2**62, (COUNT,), generator=g, dtype=torch.int64).to(dtype)


def check(op: dist.ReduceOp, dtype: torch.dtype, fn, size: int, rank: int) -> None:
    t = tensor_of(rank, dtype)
    dist.all_reduce(t, op=op)
    want = tensor_of(0, dtype)
    for r in range(1, size):
        want = fn(want, tensor_of(r, dtype))
    assert t.dtype == dtype and torch.equal(t, want), (op, dtype, t, want)


def main() -> None:
    world = MPI.COMM_WORLD
    rank, size = world.Get_rank(), world.Get_size()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    torch.set_num_threads(1)
    pycoll.torch_backend.register()
    dist.init_process_group("pycoll", rank=rank, world_size=size)

    for dtype in (torch.bool, torch.int8, torch.int16, torch.uint16, torch.int32, torch.uint64):
        for op, fn in BITWISE.items():
            check(op, dtype, fn, size, rank)
    # bools: max is any, min is all
    check(dist.ReduceOp.MAX, torch.bool, torch.logical_or, size, rank)
    check(dist.ReduceOp.MIN, torch.bool, torch.logical_and, size, rank)
    check(dist.ReduceOp.SUM, torch.int16, torch.add, size, rank)  # wraps, as torch does
    # torch has no maximum of uint16 on CPU: the reference goes through int32
    umax = lambda a, b: torch.maximum(a.int(), b.int()).to(torch.uint16)
    check(dist.ReduceOp.MAX, torch.uint16, umax, size, rank)

    z = tensor_of(rank, torch.complex64)
    dist.all_reduce(z)
    want = sum(tensor_of(r, torch.complex64) for r in range(size))
    assert torch.allclose(z, want, rtol=1e-5, atol=1e-5), (z, want)
    z = tensor_of(rank, torch.complex128)
    dist.all_reduce(z, op=dist.ReduceOp.AVG)
    want = sum(tensor_of(r, torch.complex128) for r in range(size)) / size
    assert torch.allclose(z, want, rtol=1e-12, atol=1e-12), (z, want)

    dist.barrier()
    dist.destroy_process_group()
    print("ok", flush=True)


if __name__ == "__main__":
    main()
