"""GPU sweep under mpiexec: pycoll on device buffers vs MPI-staged and torch Gloo.

    mpiexec -n 4 python benchmarks/gpu_sweep.py --out results.json [-b 8 -e 256M -f 8]

Columns follow nccl-tests: size (bytes), count, time (us), algbw and busbw (GB/s;
busbw factors from nccl-tests' PERFORMANCE.md: allreduce 2(n-1)/n, allgather and
reduce_scatter (n-1)/n, broadcast 1).  ``size`` is the whole buffer (allgather:
the output, reduce_scatter: the input).  Implementations, all timed in one run
on the same float32 CuPy buffers:

* ``pycoll``: device collectives, ``algorithm="auto"`` (one-sided ``direct``
  reads and writes of the peers' buffers when every pair has CUDA IPC);
* ``pycoll-ring``: the chunked ring through the cuda_ipc slots, for comparison;
* ``pycoll-staged``: pycoll with ``device_transports=()`` (pinned staging over shm,
  through each connection's shared send buffer: no CPU copy);
* ``pycoll-staged-tcp``: the same over tcp (a kernel copy on each side);
* ``mpi-staged``: copy to pinned host memory, the MPI collective, copy back;
* ``gloo``: torch.distributed's Gloo backend on CUDA tensors.

Rank 0 also measures ceilings: device-to-device copy bandwidth and pinned
host<->device copy bandwidth.  Each point: a barrier, warm-up, then a timed
loop; the time is the slowest rank's mean.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import cupy as cp
import numpy as np
from mpi4py import MPI

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from common import loopback_port

import pycoll
from pycoll.config import parse_bytes as parse_size

W = MPI.COMM_WORLD
RANK, N = W.Get_rank(), W.Get_size()
BUS = {"allreduce": 2 * (N - 1) / N, "allgather": (N - 1) / N, "reduce_scatter": (N - 1) / N}
BUS["broadcast"] = 1.0


def ceilings(nbytes: int) -> dict[str, float]:
    a = cp.empty(nbytes // 4, cp.float32)
    b = cp.empty_like(a)
    h = cp.cuda.alloc_pinned_memory(nbytes)
    hv = np.frombuffer(h, np.float32, nbytes // 4)
    s = cp.cuda.Stream(non_blocking=True)
    res = {}
    for name, fn in (
        ("d2d_copy", lambda: cp.cuda.runtime.memcpyAsync(b.data.ptr, a.data.ptr, nbytes, 3, s.ptr)),
        (
            "h2d_pinned",
            lambda: cp.cuda.runtime.memcpyAsync(a.data.ptr, hv.ctypes.data, nbytes, 1, s.ptr),
        ),
        (
            "d2h_pinned",
            lambda: cp.cuda.runtime.memcpyAsync(hv.ctypes.data, a.data.ptr, nbytes, 2, s.ptr),
        ),
    ):
        fn()
        s.synchronize()
        e0, e1 = cp.cuda.Event(), cp.cuda.Event()
        e0.record(s)
        for _ in range(10):
            fn()
        e1.record(s)
        e1.synchronize()
        ms = cp.cuda.get_elapsed_time(e0, e1) / 10
        res[name] = nbytes / (ms * 1e-3) / 1e9  # GB/s, bytes moved one way
    return res


def staging_legs(c, nbytes: int) -> list[dict[str, float]]:
    """Per rank, the copy rate of each staging leg (D2H, H2D) in a staged allreduce."""
    from pycoll.gpu.staging import LegStats

    pool = c._gpu.pool()
    x = cp.ones(nbytes // 4, cp.float32)
    c.allreduce(x, algorithm="ring")
    pool.legs = legs = LegStats()
    for _ in range(3):
        c.allreduce(x, algorithm="ring")
    cp.cuda.Device().synchronize()
    pool.legs = None
    rates = W.gather(legs.rates())
    if RANK == 0:
        print(
            f"staging legs over {c.transport_of((RANK + 1) % N)} at {nbytes} B "
            f"(GB/s of copy time, per rank): {rates}",
            flush=True,
        )
    return rates


def gloo_group():
    import torch.distributed as dist

    port = loopback_port(W)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=RANK, world_size=N)
    return dist


def make_ops(impl: str, coll: str, nbytes: int, comms: dict, dist) -> tuple | None:
    """(callable, sync) for one point, or None when the implementation lacks it."""
    count = (
        max(N, nbytes // 4 // N * N)
        if coll in ("allgather", "reduce_scatter")
        else max(1, nbytes // 4)
    )
    k = count // N
    x = cp.ones(count if coll != "allgather" else k, cp.float32)
    out = cp.empty(k if coll == "reduce_scatter" else count, cp.float32)
    if impl.startswith("pycoll"):
        c = comms["pycoll" if impl == "pycoll-ring" else impl]
        algo = "ring" if impl == "pycoll-ring" else "auto"
        f = {
            "allreduce": lambda: c.allreduce(x, algorithm=algo),
            "allgather": lambda: c.allgather(x, out, algorithm=algo),
            "broadcast": lambda: c.broadcast(x, root=0, algorithm=algo),
            "reduce_scatter": lambda: c.reduce_scatter(x, out, algorithm=algo),
        }[coll]
        return f, count
    if impl == "mpi-staged":
        hx = np.frombuffer(cp.cuda.alloc_pinned_memory(x.nbytes), np.float32, x.size)
        ho = np.frombuffer(cp.cuda.alloc_pinned_memory(out.nbytes), np.float32, out.size)

        def f():
            x.get(out=hx)
            if coll == "allreduce":
                W.Allreduce(MPI.IN_PLACE, hx, op=MPI.SUM)
                x.set(hx)
            elif coll == "allgather":
                W.Allgather(hx, ho)
                out.set(ho)
            elif coll == "broadcast":
                W.Bcast(hx, root=0)
                x.set(hx)
            else:
                W.Reduce_scatter_block(hx, ho, op=MPI.SUM)
                out.set(ho)

        return f, count
    if impl == "gloo":
        import torch

        tx = torch.as_tensor(x, device="cuda")
        to = torch.as_tensor(out, device="cuda")
        if coll == "allreduce":
            return (lambda: dist.all_reduce(tx)), count
        if coll == "broadcast":
            return (lambda: dist.broadcast(tx, 0)), count
        if coll == "allgather":
            parts = list(to.view(N, -1).unbind(0))
            return (lambda: dist.all_gather(parts, tx)), count
        return None  # Gloo has no reduce_scatter
    raise ValueError(impl)


def timeit(f, budget: float) -> float:
    W.Barrier()
    t0 = time.perf_counter()
    f()
    cp.cuda.Device().synchronize()
    warm = W.allreduce(time.perf_counter() - t0, op=MPI.MAX)
    iters = int(min(50, max(2, budget / max(warm, 1e-6))))
    f()
    cp.cuda.Device().synchronize()
    W.Barrier()
    t0 = time.perf_counter()
    for _ in range(iters):
        f()
    cp.cuda.Device().synchronize()
    dt = (time.perf_counter() - t0) / iters
    return float(W.allreduce(dt, op=MPI.MAX))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("-b", "--minbytes", default="8")
    ap.add_argument("-e", "--maxbytes", default="256M")
    ap.add_argument("-f", "--stepfactor", type=int, default=8)
    ap.add_argument("--colls", default="allreduce,allgather,broadcast,reduce_scatter")
    ap.add_argument(
        "--impls", default="pycoll,pycoll-ring,pycoll-staged,pycoll-staged-tcp,mpi-staged,gloo"
    )
    ap.add_argument("--staged-colls", default="allreduce,allgather")
    ap.add_argument("--budget", type=float, default=0.25, help="seconds per point")
    ap.add_argument("--deadline", type=float, default=420.0, help="stop after this many s")
    ap.add_argument("--out", default="gpu_sweep.json")
    a = ap.parse_args()
    cp.cuda.Device(RANK % cp.cuda.runtime.getDeviceCount()).use()
    start = time.perf_counter()
    lo, hi = parse_size(a.minbytes), parse_size(a.maxbytes)
    sizes = []
    s = lo
    while s < hi:
        sizes.append(s)
        s *= a.stepfactor
    sizes.append(hi)
    impls = a.impls.split(",")
    comms = {"pycoll": pycoll.init(timeout=300)}
    if "pycoll-staged" in impls:
        comms["pycoll-staged"] = pycoll.init(timeout=300, device_transports=())
    if "pycoll-staged-tcp" in impls:
        comms["pycoll-staged-tcp"] = pycoll.init(
            timeout=300, transports=("tcp",), device_transports=()
        )
    dist = None
    if "gloo" in impls:
        try:
            dist = gloo_group()
        except Exception as exc:
            if RANK == 0:
                print(f"gloo unavailable: {exc}", flush=True)
            impls.remove("gloo")
    meta = {
        "n": N,
        "device": cp.cuda.runtime.getDeviceProperties(cp.cuda.Device().id)["name"].decode(),
        "routes": [comms["pycoll"].transport_of(p, device=True) for p in range(N)],
        "device_chunk_bytes": comms["pycoll"].config.device_chunk_bytes,
    }
    if RANK == 0:
        meta["ceilings_GBps"] = ceilings(min(hi, 256 << 20))
        print(json.dumps(meta), flush=True)
        print(f"{'coll':>15} {'impl':>14} {'size':>11} {'time_us':>11} {'algbw':>8} {'busbw':>8}")
    rows = []
    stopped = False
    for coll in a.colls.split(","):
        for nbytes in sizes:
            for impl in impls:
                if impl.startswith("pycoll-staged") and coll not in a.staged_colls.split(","):
                    continue
                if W.bcast(time.perf_counter() - start > a.deadline, root=0):
                    stopped = True
                    break
                made = make_ops(impl, coll, nbytes, comms, dist)
                if made is None:
                    continue
                f, count = made
                t = timeit(f, a.budget)
                real = count * 4
                algbw = real / t / 1e9
                row = dict(
                    coll=coll,
                    impl=impl,
                    n=N,
                    bytes=real,
                    count=count,
                    time_us=t * 1e6,
                    algbw=algbw,
                    busbw=algbw * BUS[coll],
                )
                rows.append(row)
                if RANK == 0:
                    print(
                        f"{coll:>15} {impl:>14} {real:>11} {t * 1e6:>11.1f} {algbw:>8.2f} "
                        f"{algbw * BUS[coll]:>8.2f}",
                        flush=True,
                    )
            if stopped:
                break
        if stopped:
            break
    for impl, key in (
        ("pycoll-staged", "staging_legs_GBps"),
        ("pycoll-staged-tcp", "tcp_legs_GBps"),
    ):
        if impl in impls:
            meta[key] = staging_legs(comms[impl], min(hi, 256 << 20))
    if RANK == 0:
        meta["stopped_early"] = stopped
        with open(a.out, "w") as fh:
            json.dump({"meta": meta, "rows": rows}, fh, indent=1)
    for c in comms.values():
        c.close()
    if dist is not None:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
