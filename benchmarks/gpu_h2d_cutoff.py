"""Where small pinned host-to-device copies stop waiting for other processes.

    mpiexec -n 4 python benchmarks/gpu_h2d_cutoff.py [--sizes 16K,24K,28K,32K]

Every rank copies the same number of bytes from pinned host memory to its own
device buffer on the one GPU they share, synchronising after each copy, 100
times; the line is the slowest rank's mean per copy.  On the H200 a copy below
some size waits about one time slice per other process on the GPU, and
``pycoll.config.SLICED_COPY_BYTES`` is the smallest size measured not to.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import cupy as cp
import numpy as np
from mpi4py import MPI

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from pycoll.config import parse_bytes

_H2D = 1  # cudaMemcpyHostToDevice


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="16K,20K,24K,28K,30K,32760,32K,36K")
    ap.add_argument("--iters", type=int, default=100)
    a = ap.parse_args()
    w = MPI.COMM_WORLD
    s = cp.cuda.Stream(non_blocking=True)
    rt = cp.cuda.runtime
    out = []
    for nb in (parse_bytes(x) for x in a.sizes.split(",")):
        host = cp.cuda.alloc_pinned_memory(nb)
        src = np.frombuffer(host, np.uint8, nb).ctypes.data
        dst = rt.malloc(nb)
        for _ in range(5):
            rt.memcpyAsync(dst, src, nb, _H2D, s.ptr)
            s.synchronize()
        w.Barrier()
        t = time.perf_counter()
        for _ in range(a.iters):
            rt.memcpyAsync(dst, src, nb, _H2D, s.ptr)
            s.synchronize()
        out.append((nb, w.allreduce((time.perf_counter() - t) / a.iters, op=MPI.MAX)))
        rt.free(dst)
    if w.rank == 0:
        print(f"n={w.size}", " ".join(f"{b}:{t * 1e6:.1f}" for b, t in out), flush=True)


if __name__ == "__main__":
    main()
