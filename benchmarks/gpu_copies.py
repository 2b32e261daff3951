"""Pinned host<->device copy latency when several processes share one GPU.

    mpiexec -n 4 python benchmarks/gpu_copies.py [-b 8 -e 256K -f 4] [--iters 200]

Every rank copies at the same time (a barrier before each timed loop); a copy is
``cudaMemcpyAsync`` on a non-blocking stream followed by ``cudaStreamSynchronize``.
For host-to-device copies it also times three other ways to move the same bytes
(to see which of them the GPU's time-slicing between processes spares):

* ``padded``: a copy of ``--pad`` bytes into a device scratch buffer, then a
  device-to-device copy of the bytes wanted;
* ``kernel``: a kernel that reads the pinned buffer through its device mapping;
* ``default``: ``cudaMemcpyAsync`` with ``cudaMemcpyDefault``.

Prints one line per size: the slowest rank's mean time per copy, in us.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable
from typing import Any

import cupy as cp
import numpy as np
from mpi4py import MPI

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from pycoll.config import parse_bytes

W = MPI.COMM_WORLD
_H2D, _D2H, _D2D, _DEFAULT = 1, 2, 3, 4

_COPY = r"""
extern "C" __global__ void copy_bytes(unsigned char* d, const unsigned char* h, long long n) {
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x)
        d[i] = h[i];
}
"""


def timed(f: Callable[[], None], iters: int) -> float:
    """The slowest rank's mean time of ``f`` in us (all ranks at once)."""
    for _ in range(max(1, iters // 10)):
        f()
    W.Barrier()
    t0 = time.perf_counter()
    for _ in range(iters):
        f()
    return float(W.allreduce((time.perf_counter() - t0) / iters * 1e6, op=MPI.MAX))


def one_size(
    n: int, host: Any, sink: Any, scratch: Any, pad: int, kernel: Any, iters: int
) -> list[float]:
    """The five times for copies of ``n`` bytes (see the module docstring): from
    the device into ``sink``, from ``host`` (all 7s) to the device."""
    rt = cp.cuda.runtime
    s = cp.cuda.Stream(non_blocking=True)
    dev = cp.zeros(n, cp.uint8)
    d, h, sp = dev.data.ptr, host.ptr, scratch.data.ptr

    def copy(dst: int, src: int, kind: int) -> Callable[[], None]:
        def f() -> None:
            rt.memcpyAsync(dst, src, n, kind, s.ptr)
            rt.streamSynchronize(s.ptr)

        return f

    def padded() -> None:
        rt.memcpyAsync(sp, h, max(pad, n), _H2D, s.ptr)
        rt.memcpyAsync(d, sp, n, _D2D, s.ptr)
        rt.streamSynchronize(s.ptr)

    def by_kernel() -> None:
        with s:
            kernel((max(1, min(64, (n + 255) // 256)),), (256,), (dev, h, np.int64(n)))
        rt.streamSynchronize(s.ptr)

    t = [
        timed(copy(sink.ptr, d, _D2H), iters),
        timed(copy(d, h, _H2D), iters),
        timed(padded, iters),
        timed(by_kernel, iters),
        timed(copy(d, h, _DEFAULT), iters),
    ]
    if not bool((dev == 7).all()):
        raise SystemExit(f"rank {W.Get_rank()}: the copies of {n} bytes went wrong")
    return t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("-b", "--minbytes", default="8")
    ap.add_argument("-e", "--maxbytes", default="256K")
    ap.add_argument("-f", "--stepfactor", type=int, default=4)
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--pad", default="32K", help="scratch copy size for 'padded'")
    a = ap.parse_args()
    cp.cuda.Device(W.Get_rank() % cp.cuda.runtime.getDeviceCount()).use()
    pad, hi = parse_bytes(a.pad), parse_bytes(a.maxbytes)
    host = cp.cuda.alloc_pinned_memory(max(hi, pad))
    np.frombuffer(host, np.uint8)[:] = 7
    sink = cp.cuda.alloc_pinned_memory(hi)
    scratch = cp.empty(max(hi, pad), cp.uint8)
    kernel = cp.RawKernel(_COPY, "copy_bytes")
    if W.Get_rank() == 0:
        print(f"# {W.Get_size()} process(es) copying at once; us per copy, slowest rank")
        print(f"{'bytes':>9} {'d2h':>8} {'h2d':>8} {'padded':>8} {'kernel':>8} {'default':>8}")
    nb = parse_bytes(a.minbytes)
    while nb <= hi:
        t = one_size(nb, host, sink, scratch, pad, kernel, a.iters)
        if W.Get_rank() == 0:
            print(f"{nb:>9} " + " ".join(f"{v:8.1f}" for v in t), flush=True)
        nb *= a.stepfactor


if __name__ == "__main__":
    main()
