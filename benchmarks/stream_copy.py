"""A large host copy, NumPy's against pycoll's streaming one, every rank at once.

Run as one process or under mpiexec (every rank copies its own arrays at the
same time, as the ranks of an allgather copy their own blocks); rank 0 prints::

    python benchmarks/stream_copy.py
    mpiexec -n 2 python benchmarks/stream_copy.py --sizes 16M,32M,64M

``numpy`` is ``np.copyto(dst, src)`` (glibc's memcpy); ``stream`` is
``pycoll._step.stream_copy``, which stores past the caches, as
:func:`pycoll.buffers.copy_into` does from ``STREAM_COPY_BYTES``.  Per size:
GB/s of each (the best of ``--rounds`` rounds, each timed on the slowest rank)
and ``stream``'s speed-up.  Where the two cross on a machine is where
``STREAM_COPY_BYTES`` belongs there.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import parse_size  # (puts the repository on sys.path)

from pycoll._step import stream_copy
from pycoll.buffers import data_ptr


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", default="8M,16M,24M,32M,48M,64M,128M")
    ap.add_argument("--rounds", type=int, default=4)
    args = ap.parse_args()
    try:
        from mpi4py import MPI

        comm: Any = MPI.COMM_WORLD
        slowest = lambda t: comm.allreduce(t, MPI.MAX)
        barrier = comm.Barrier
    except ImportError:  # one process
        comm, slowest, barrier = None, (lambda t: t), (lambda: None)
    rank = 0 if comm is None else comm.rank
    n = 1 if comm is None else comm.size
    if rank == 0:
        print(f"# {n} process(es) copying at once; GB/s of one process, best of {args.rounds}")
        print(f"# {'bytes':>10} {'numpy':>8} {'stream':>8} {'speed-up':>9}")
    rng = np.random.default_rng(rank)
    for size in map(parse_size, args.sizes.split(",")):
        src = rng.integers(0, 256, size, dtype=np.uint8)
        dst = np.ones(size, np.uint8)
        reps = max(3, (256 << 20) // size)
        best: dict[str, float] = {}
        for _ in range(args.rounds):
            for name in ("numpy", "stream"):
                barrier()
                t = time.perf_counter()
                for _ in range(reps):
                    if name == "numpy":
                        np.copyto(dst, src)
                    else:
                        stream_copy(data_ptr(dst), data_ptr(src), size)
                dt = slowest((time.perf_counter() - t) / reps)
                best[name] = min(best.get(name, dt), dt)
        if not np.array_equal(dst, src):
            raise SystemExit(f"rank {rank}: the copy of {size} bytes differs")
        if rank == 0:
            a, b = best["numpy"], best["stream"]
            print(f"  {size:>10} {size / a / 1e9:8.1f} {size / b / 1e9:8.1f} {a / b:8.2f}x")


if __name__ == "__main__":
    main()
