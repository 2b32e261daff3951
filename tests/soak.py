"""Soak: thousands of random collectives, each verified against NumPy; memory and
file descriptors must stay flat.

Run under mpiexec on every rank::

    mpiexec -n 4 python tests/soak.py --seconds 600 [--json out.json]
    PYCOLL_TRANSPORT=tcp mpiexec -n 4 python tests/soak.py --iters 2000

Every rank draws the same sequence of (collective, count, dtype, op, root,
algorithm) from a shared seed and builds every rank's input from it, so each
rank checks its own output locally.  RSS and open descriptors are sampled after
a warm-up and at the end; rank 0 prints (and writes) the summary.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import ml_dtypes
import numpy as np
from mpi4py import MPI

import pycoll
from pycoll import algorithms

DTYPES = [
    np.dtype(t)
    for t in (np.int8, np.uint8, np.int32, np.uint32, np.int64, np.uint64, np.float16,
              ml_dtypes.bfloat16, np.float32, np.float64)
]  # fmt: skip
OPS = ["sum", "prod", "min", "max", "avg"]
COLLS = ["allreduce", "allgather", "broadcast", "reduce_scatter", "reduce", "barrier"]


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def nfds() -> int:
    return len(os.listdir("/proc/self/fd"))


def data(rank: int, i: int, count: int, dt: np.dtype, op: str) -> np.ndarray:
    rng = np.random.default_rng([rank, i])
    if dt.kind in "iu":
        info = np.iinfo(dt)
        lo, hi = (max(info.min, -2), min(info.max, 3)) if op == "prod" else (info.min, info.max)
        return rng.integers(lo, hi, count, dtype=dt, endpoint=True)
    v = rng.uniform(0.8, 1.25, count) if op == "prod" else rng.uniform(-4, 4, count)
    return v.astype(dt)


def reference(xs: list[np.ndarray], op: str) -> np.ndarray:
    dt = xs[0].dtype
    if dt.kind in "iu":  # wraps exactly like the collective
        acc = xs[0].copy()
        for x in xs[1:]:
            with np.errstate(over="ignore"):
                acc = {"sum": np.add, "prod": np.multiply, "min": np.minimum, "max": np.maximum}[
                    op
                ](acc, x)
        return acc
    acc = xs[0].astype(np.float64)
    for x in xs[1:]:
        y = x.astype(np.float64)
        acc = {
            "sum": np.add,
            "avg": np.add,
            "prod": np.multiply,
            "min": np.minimum,
            "max": np.maximum,
        }[op](acc, y)
    return acc / len(xs) if op == "avg" else acc


def close_enough(got: np.ndarray, ref: np.ndarray, n: int) -> bool:
    dt = got.dtype
    if dt.kind in "iu":
        return bool(np.array_equal(got, ref))
    tol = {2: 2e-2 if dt == np.float16 else 6e-2, 4: 1e-5, 8: 1e-12}[dt.itemsize] * n
    return bool(np.allclose(got.astype(np.float64), ref, rtol=tol, atol=4 * tol))


def one(comm: pycoll.Communicator, i: int, rng: np.random.Generator, max_count: int) -> str:
    n, r = comm.size, comm.rank
    coll = COLLS[rng.integers(len(COLLS))]
    dt = DTYPES[rng.integers(len(DTYPES))]
    op = OPS[rng.integers(len(OPS))]
    if op == "avg" and dt.kind in "iu":
        op = "sum"
    count = int(rng.choice([0, 1, 7, 64, 1000, int(rng.integers(1, max_count + 1))]))
    root = int(rng.integers(n))
    # every rank has the same usable set (direct needs all ranks on one host)
    usable = [a for a in algorithms.names(coll) if comm._policy.usable(a)]
    names = ("auto", *usable) if coll != "barrier" else ("auto",)
    algo = names[rng.integers(len(names))]
    if coll == "barrier":
        comm.barrier()
        return coll
    if coll == "reduce_scatter":
        count -= count % n
    xs = [data(q, i, count, dt, op) for q in range(n)]
    mine = xs[r].copy()
    what = f"#{i} {coll}(count={count}, dtype={dt}, op={op}, root={root}, algo={algo})"
    if coll == "allreduce":
        out = comm.allreduce(mine, op=op, algorithm=algo)
        ok = close_enough(out, reference(xs, op), n)
    elif coll == "reduce":
        out = comm.reduce(mine, root=root, op=op, algorithm=algo)
        ok = r != root or close_enough(out, reference(xs, op), n)
    elif coll == "reduce_scatter":
        k = count // n
        out = comm.reduce_scatter(mine, op=op, algorithm=algo)
        ok = close_enough(out, reference(xs, op)[r * k : (r + 1) * k], n)
    elif coll == "allgather":
        out = comm.allgather(mine, algorithm=algo)
        ok = bool(np.array_equal(out.reshape(-1).view(np.uint8), np.concatenate(xs).view(np.uint8)))
    else:
        buf = xs[root].copy() if r == root else np.zeros(count, dt)
        comm.broadcast(buf, root=root, algorithm=algo)
        ok = bool(np.array_equal(buf.view(np.uint8), xs[root].view(np.uint8)))
    if not ok:
        raise AssertionError(f"rank {r}: wrong result for {what}")
    return coll


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iters", type=int, default=0, help="collectives to run (0: use --seconds)")
    ap.add_argument("--seconds", type=float, default=60.0)
    ap.add_argument("--max-count", type=int, default=100_000)
    ap.add_argument("--warmup", type=int, default=200)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--chunk-bytes", type=int, default=0, help="0: the default")
    ap.add_argument("--json", default="")
    a = ap.parse_args()
    world = MPI.COMM_WORLD
    kw = {"timeout": 120.0}
    if a.chunk_bytes:
        kw["chunk_bytes"] = a.chunk_bytes
    comm = pycoll.init(**kw)
    rng = np.random.default_rng(a.seed)  # the same stream on every rank
    counts: dict[str, int] = {}
    base_rss = base_fd = 0
    start = time.monotonic()
    i = 0
    while True:
        if a.iters:
            if i >= a.iters:
                break
        elif i % 50 == 0:  # agree on when to stop
            stop = world.allreduce(time.monotonic() - start >= a.seconds, op=MPI.LOR)
            if stop:
                break
        c = one(comm, i, rng, a.max_count)
        counts[c] = counts.get(c, 0) + 1
        i += 1
        if i == a.warmup:
            base_rss, base_fd = rss_bytes(), nfds()
    dur = time.monotonic() - start
    end_rss, end_fd = rss_bytes(), nfds()
    transports = sorted({comm.transport_of(p) for p in range(comm.size) if p != comm.rank})
    comm.close()
    mine = {
        "rank": comm.rank,
        "rss_growth": end_rss - base_rss if base_rss else None,
        "fd_growth": end_fd - base_fd if base_fd else None,
        "rss_end": end_rss,
    }
    every = world.gather(mine, root=0)
    if comm.rank == 0:
        summary = {
            "ranks": comm.size,
            "transports": transports,
            "collectives": i,
            "by_collective": counts,
            "seconds": round(dur, 1),
            "per_rank": every,
            "max_rss_growth": max((e["rss_growth"] or 0) for e in every),
            "max_fd_growth": max((e["fd_growth"] or 0) for e in every),
        }
        print(json.dumps(summary), flush=True)
        if a.json:
            with open(a.json, "w") as f:
                json.dump(summary, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
