"""What a cross-process hand-off costs where ranks share one GPU.  Two ranks
under mpiexec on one GPU:

    mpiexec -n 2 python benchmarks/gpu_handoffs.py [--reps 30]

Rank 1 (the follower) signals "ready" into a word of shared host memory that
both ranks map for their device; rank 0 (the leader) makes its stream wait for
that word, runs a 1 MiB kernel and writes "done", which rank 1's stream waits
for.  That is the shape of pycoll's ``direct`` collectives on a shared GPU
(``pycoll/gpu/windows.py``).  The variants:

* ``one stream``: every step on the caller's stream;
* ``event hops``: the steps on a second stream, which waits for the caller's
  stream through an event, and the caller's stream for it through another;
* ``word hops``: the same two hops through words (``cuStreamWriteValue32`` and
  ``cuStreamWaitValue32``);
* ``+host``: the follower's host stores "ready" instead of its stream.

Each row: per rank, the host time of the steps and the GPU time between events
recorded around them on the caller's stream (median after 5 warm-up rounds).
"""

from __future__ import annotations

import argparse
import ctypes
import mmap
import os
import statistics
import sys
import time
from collections.abc import Callable

import cupy as cp
from mpi4py import MPI

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from transports.cuda_driver import host_map, host_unmap, stream_wait, stream_write

W = MPI.COMM_WORLD
R = W.Get_rank()
READY, DONE, HOPS = 0, 128, 1024  # byte offsets of the words


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--reps", type=int, default=30)
    args = p.parse_args()
    if W.Get_size() != 2:
        sys.exit("run with mpiexec -n 2")
    rt = cp.cuda.runtime
    s = cp.cuda.Stream(non_blocking=True)  # the caller's
    side = cp.cuda.Stream(non_blocking=True)  # the library's
    with s:
        x = cp.ones(1 << 18, cp.float32)
        y = x * 2
    s.synchronize()
    path = f"/dev/shm/pycoll-handoffs-{os.getppid()}"
    if R == 0:
        with open(path, "wb") as f:
            f.write(b"\0" * 4096)
    W.Barrier()
    fd = os.open(path, os.O_RDWR)
    mm = mmap.mmap(fd, 4096)
    os.close(fd)
    W.Barrier()
    if R == 0:
        os.unlink(path)
    view = (ctypes.c_uint32 * 1024).from_buffer(mm)
    host = ctypes.addressof(view)
    dev = host_map(host, 4096)
    seq = 0

    def once(hops: str, by_host: bool) -> None:
        nonlocal seq
        seq += 1
        q = s if hops == "none" else side
        mine = dev + HOPS + 256 * R
        if hops == "words":
            stream_write(s.ptr, mine, seq)
            stream_wait(q.ptr, mine, seq)
        elif hops == "events":
            q.wait_event(s.record())
        if R == 0:
            stream_wait(q.ptr, dev + READY, seq)
            with q:
                cp.add(x, y, out=y)
            stream_write(q.ptr, dev + DONE, seq)
        else:
            if by_host:
                view[READY // 4] = seq
            else:
                stream_write(q.ptr, dev + READY, seq)
            stream_wait(q.ptr, dev + DONE, seq)
        if hops == "words":
            stream_write(q.ptr, mine + 128, seq)
            stream_wait(s.ptr, mine + 128, seq)
        elif hops == "events":
            s.wait_event(q.record())

    def timed(fn: Callable[[], None]) -> tuple[float, float]:
        W.Barrier()
        a, b = cp.cuda.Event(), cp.cuda.Event()
        a.record(s)
        t0 = time.perf_counter()
        fn()
        t1 = time.perf_counter()
        b.record(s)
        s.synchronize()
        return (t1 - t0) * 1e6, cp.cuda.get_elapsed_time(a, b) * 1e3

    variants = [
        ("one stream", "none", False),
        ("one stream +host", "none", True),
        ("event hops", "events", False),
        ("event hops +host", "events", True),
        ("word hops", "words", False),
        ("word hops +host", "words", True),
    ]
    for rnd in range(2):
        for name, hops, by_host in variants:
            res = [timed(lambda h=hops, b=by_host: once(h, b)) for _ in range(args.reps)]
            res = res[5:]
            mine = (statistics.median(r[0] for r in res), statistics.median(r[1] for r in res))
            both = W.gather(mine, root=0)
            if R == 0:
                cells = "  ".join(
                    f"rank {i}: host {h:6.1f} gpu {g:7.1f} us" for i, (h, g) in enumerate(both)
                )
                print(f"round {rnd} {name:18s} {cells}", flush=True)
    rt.deviceSynchronize()
    host_unmap(host)  # the mapping itself goes with the process


if __name__ == "__main__":
    main()
