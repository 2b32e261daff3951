"""When does a blocking device collective give the host back, and what does the
torch backend keep of pycoll's device bandwidth?  Under mpiexec on a GPU machine:

    mpiexec -n 2 python benchmarks/gpu_return.py [--sizes 1M,16M,256M] [--reps 10]

Part 1, per path and size: a float32 allreduce on a fresh CuPy stream, called
right after a barrier.  ``return`` is the host time of the call; ``gpu`` the
time between CUDA events recorded on the stream before and after it (the
collective's device work, waits for the peers included); ``early`` the share of
calls after which the end event was not yet complete, i.e. the call returned
before its GPU work was done.  ``return`` is the slowest rank's median; each
rank's follows the routes (on a shared GPU rank 0 leads: it opens the others'
windows and launches the work).  Paths: ``direct`` (auto between CUDA IPC
peers), ``ring`` (cuda_ipc slots), ``host`` (pinned host memory and the host
algorithm, sizes up to 4 MiB), ``staged-shm`` (no device connection).
docs/gpu.md ("Streams and the host") says what each path waits for.

Part 2: a 256 MiB allreduce through ``torch.distributed`` on a ``"pycoll"``
process group (CUDA tensors, the group's stream) against pycoll's own call on
CuPy arrays of the same size, interleaved; busbw = 2(n-1)/n * bytes / time,
time from a host synchronize of the device after each call, slowest rank.
Two more rows take the backend's parts one at a time: pycoll's own call on the
torch tensor (``pycoll-tensor``) and on the CuPy array on a stream other than
the default (``pycoll-side``).

Rank 0 prints a table per part and writes ``--json``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Any

import cupy as cp
from mpi4py import MPI

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from common import loopback_port

import pycoll
from pycoll.config import parse_bytes

W = MPI.COMM_WORLD
RANK, N = W.Get_rank(), W.Get_size()
PATHS = {  # name: (init keywords, algorithm, largest size in bytes)
    "direct": ({}, "auto", None),
    "ring": ({}, "ring", None),
    "host": ({"device_host_bytes": 4 << 20}, "auto", 4 << 20),
    "staged-shm": ({"device_transports": ()}, "ring", 64 << 20),
}


def returns(comm: Any, nbytes: int, algo: str, reps: int, warmup: int) -> dict[str, float]:
    s = cp.cuda.Stream(non_blocking=True)
    with s:
        x = cp.ones(nbytes // 4, cp.float32)
    for _ in range(warmup):  # kernels loaded, windows mapped, clocks up
        W.Barrier()
        comm.allreduce(x, algorithm=algo, stream=s)
        s.synchronize()
    back, gpu, early = [], [], 0
    for _ in range(reps):
        W.Barrier()
        start, end = cp.cuda.Event(), cp.cuda.Event()
        start.record(s)
        t0 = time.perf_counter()
        comm.allreduce(x, algorithm=algo, stream=s)
        dt = time.perf_counter() - t0
        end.record(s)
        early += not end.done
        s.synchronize()
        back.append(dt * 1e6)
        gpu.append(cp.cuda.get_elapsed_time(start, end) * 1e3)
    per_rank = W.allgather(statistics.median(back))
    return {
        "return_us": max(per_rank),
        "ranks_us": per_rank,
        "gpu_us": statistics.median(gpu),
        "early": early / reps,
    }


def part1(sizes: list[int], reps: int, warmup: int) -> list[dict[str, Any]]:
    rows = []
    for name, (kw, algo, most) in PATHS.items():
        comm = pycoll.init(timeout=120, **kw)
        try:
            routes = sorted({comm.transport_of(p, device=True) for p in range(N) if p != RANK})
            for nb in sizes:
                if most is None or nb <= most:
                    r = returns(comm, nb, algo, reps, warmup)
                    rows.append({"path": name, "bytes": nb, "routes": routes, **r})
        finally:
            comm.close()
    return rows


def part2(nbytes: int, reps: int, warmup: int) -> dict[str, float]:
    import torch
    import torch.distributed as dist

    import pycoll.torch_backend

    pycoll.torch_backend.register()
    dev = torch.device("cuda", cp.cuda.Device().id)
    torch.cuda.set_device(dev)
    url = f"tcp://127.0.0.1:{loopback_port(W)}"
    dist.init_process_group("pycoll", init_method=url, rank=RANK, world_size=N)
    comm = pycoll.init(timeout=120)
    t = torch.ones(nbytes // 4, dtype=torch.float32, device=dev)
    x = cp.ones(nbytes // 4, cp.float32)
    side = cp.cuda.Stream(non_blocking=True)
    # what the backend adds, piece by piece: its worker and group stream
    # ("torch-pycoll"), a torch tensor on torch's stream ("pycoll-tensor"), a
    # stream other than the default ("pycoll-side")
    times: dict[str, list[float]] = {
        "torch-pycoll": [],
        "pycoll": [],
        "pycoll-tensor": [],
        "pycoll-side": [],
    }

    def one(which: str) -> float:
        W.Barrier()
        t0 = time.perf_counter()
        if which == "torch-pycoll":
            dist.all_reduce(t)
        elif which == "pycoll-tensor":
            comm.allreduce(t)
        elif which == "pycoll-side":
            comm.allreduce(x, stream=side)
        else:
            comm.allreduce(x)
        torch.cuda.synchronize(dev)
        cp.cuda.Device().synchronize()
        return W.allreduce(time.perf_counter() - t0, op=MPI.MAX)

    for _ in range(warmup):
        for which in times:
            one(which)
    for _ in range(reps):
        for which, ts in times.items():
            ts.append(one(which))
    comm.close()
    dist.destroy_process_group()
    factor = 2 * (N - 1) / N if N > 1 else 1.0
    out = {}
    for which, ts in times.items():
        med = statistics.median(ts)
        out[which + "_us"] = med * 1e6
        out[which + "_busbw"] = factor * nbytes / med / 1e9
    out["ratio"] = out["torch-pycoll_busbw"] / out["pycoll_busbw"]
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="1M,4M,16M,256M")
    p.add_argument("--reps", type=int, default=10)
    p.add_argument(
        "--warmup",
        type=int,
        default=20,
        help="untimed calls (part 2: rounds of every variant) before the timed ones",
    )
    p.add_argument("--torch-bytes", default="256M")
    p.add_argument("--skip-torch", action="store_true")
    p.add_argument("--json")
    args = p.parse_args()
    cp.cuda.Device(RANK % cp.cuda.runtime.getDeviceCount()).use()
    sizes = [parse_bytes(s) for s in args.sizes.split(",")]
    rows = part1(sizes, args.reps, args.warmup)
    tor = None if args.skip_torch else part2(parse_bytes(args.torch_bytes), args.reps, args.warmup)
    if RANK:
        return
    print(f"# n = {N}: host return time and GPU time of a blocking float32 allreduce")
    print(
        f"{'path':>11} {'bytes':>10} {'return us':>10} {'gpu us':>10} {'early':>6}"
        "  routes; each rank's return (us)"
    )
    for r in rows:
        print(
            f"{r['path']:>11} {r['bytes']:>10} "
            f"{r['return_us']:>10.1f} {r['gpu_us']:>10.1f} {r['early']:>6.2f}  {r['routes']}; "
            + " ".join(f"{t:.1f}" for t in r["ranks_us"])
        )
    if tor is not None:
        print(f"# n = {N}: {args.torch_bytes} allreduce, busbw GB/s (time us)")
        print(
            "  ".join(
                f"{w} {tor[w + '_busbw']:.1f} ({tor[w + '_us']:.0f})"
                for w in ("torch-pycoll", "pycoll", "pycoll-tensor", "pycoll-side")
            )
            + f"  ratio {tor['ratio']:.3f}"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"n": N, "returns": rows, "torch": tor}, f, indent=1)


if __name__ == "__main__":
    main()
