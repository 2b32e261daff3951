"""An asynchronous allreduce and its wait, against the blocking call and MPI's.

    mpiexec -n 4 python benchmarks/async_wait.py 8 1M

Systems, on the same float32 NumPy arrays (in place, summed):

* ``blocking``: ``comm.allreduce(x)``;
* ``async``: ``comm.allreduce(x, async_op=True).wait()``: the call runs on
  pycoll's worker thread, so its waits are the worker's (they nap almost at
  once) and it pays two thread hops;
* ``mpi``: ``Iallreduce`` and ``Wait`` (mpi4py).

Each system runs ``--blocks`` blocks of ``--calls`` calls in turn (a new order
each block); rank 0 prints, per size and system, the median over blocks of the
per-call time on the slowest rank (us).
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections.abc import Callable

import numpy as np
from common import parse_size
from mpi4py import MPI

import pycoll


def _systems(
    comm: pycoll.Communicator, w: MPI.Comm, x: np.ndarray
) -> dict[str, Callable[[], object]]:
    return {
        "blocking": lambda: comm.allreduce(x),
        "async": lambda: comm.allreduce(x, async_op=True).wait(),
        "mpi": lambda: w.Iallreduce(MPI.IN_PLACE, x).Wait(),
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("sizes", nargs="+", help="bytes per rank (8, 1K, 1M, ...)")
    p.add_argument("--blocks", type=int, default=7)
    p.add_argument("--calls", type=int, default=200)
    args = p.parse_args()
    w = MPI.COMM_WORLD
    comm = pycoll.init()
    rng = random.Random(0)  # the same order on every rank
    try:
        if w.rank == 0:
            print(f"# n = {w.size}; median over {args.blocks} blocks of {args.calls} calls (us)")
            print(f"# {'size':>10} {'blocking':>10} {'async':>10} {'mpi':>10}")
        for size in map(parse_size, args.sizes):
            systems = _systems(comm, w, np.zeros(max(1, size // 4), np.float32))
            times: dict[str, list[float]] = {k: [] for k in systems}
            for call in systems.values():  # warm up, and plan
                for _ in range(20):
                    call()
            for _ in range(args.blocks):
                order = list(systems.items())
                rng.shuffle(order)
                for name, call in order:
                    w.Barrier()
                    t = time.perf_counter()
                    for _ in range(args.calls):
                        call()
                    per = (time.perf_counter() - t) / args.calls
                    times[name].append(w.allreduce(per, op=MPI.MAX))
            if w.rank == 0:
                row = " ".join(f"{statistics.median(times[k]) * 1e6:10.1f}" for k in systems)
                print(f"  {size:>10} {row}", flush=True)
    finally:
        comm.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
