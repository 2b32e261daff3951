"""An allgather whose input ends on the huge page its output begins on.

Two NumPy arrays allocated one after the other from the heap sit 16 bytes
apart: that is where ``np.empty`` puts them once glibc's mmap threshold has
risen (it does when a block of 16 MiB or so is freed, as MPICH's allreduce
does).  This times ``direct`` and ``ring`` allgathers of ``--block`` bytes a
rank with the input ``x`` and the output ``out`` carved out of one mapping
on huge pages, ``out`` starting ``gap`` bytes after ``x`` ends, for each
``--gaps``.  Run under mpiexec; rank 0 prints the slowest rank's mean time
of a call, per turn (the algorithms in a new order each turn)::

    mpiexec -n 2 python benchmarks/allgather_layout.py --gaps 16,2M+16
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
from mpi4py import MPI

sys.path.insert(0, str(Path(__file__).resolve().parent))

import hostmem
from common import parse_size, said  # (puts the repository on sys.path)
from versus import alternate

import pycoll


def gap_bytes(text: str) -> int:
    """``2M+16`` -> 2 MiB and 16 bytes."""
    return sum(parse_size(part) for part in text.split("+"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--block", default="8M", help="bytes of x (one rank's block)")
    ap.add_argument("--gaps", default="16,2M+16", help="comma list: bytes between x and out")
    ap.add_argument("--algorithms", default="direct,ring")
    ap.add_argument("--calls", type=int, default=30)
    ap.add_argument("--turns", type=int, default=3)
    args = ap.parse_args()
    world = MPI.COMM_WORLD
    comm = pycoll.init()
    n, rank = comm.size, comm.rank
    block = parse_size(args.block) // 4 * 4
    rng = np.random.default_rng(rank)
    if rank == 0:
        print(f"# n = {n}: allgather of {block} B a rank, float32; mean us a call, slowest rank")
    for text in args.gaps.split(","):
        gap = gap_bytes(text) // 4 * 4
        raw = hostmem.empty(block + gap + n * block, np.uint8, "on")
        x = raw[:block].view(np.float32)
        out = raw[block + gap : block + gap + n * block].view(np.float32).reshape(n, -1)
        x[:] = rng.random(x.size, dtype=np.float32)
        out[...] = 0
        calls = {
            a: (lambda a=a, x=x, out=out: comm.allgather(x, out, algorithm=a), args.calls)
            for a in args.algorithms.split(",")
        }
        times, _ = alternate(world, calls, args.turns, 3, f"allgather_layout {gap}")
        want = np.concatenate(world.allgather(x))
        wrong = world.allreduce(int(not np.array_equal(out.reshape(-1), want)))
        if rank == 0:
            print(f"gap {text:>8} ({gap} B): {said(times)}  wrong {wrong}", flush=True)
    comm.close()


if __name__ == "__main__":
    main()
