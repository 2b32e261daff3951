"""Loopback bandwidth of the tcp transport between two processes.

Usage: ``python benchmarks/tcp_loopback_bw.py [--nsocks N] [--bufsize B] [--slot B] [--bidir]``.
Each timed iteration is one message (both ways with ``--bidir``) plus a 1-byte
acknowledgement, so the time covers delivery to the receiver's buffer.
"""

import argparse
import multiprocessing as mp
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np

from transports.base import Deadline, TransportOptions, wait_all
from transports.tcp import TcpTransport


def rank_main(r, q_out, q_in, extra, slot, sizes, iters, bidir, res):
    t = TcpTransport(
        TransportOptions(
            rank=r,
            size=2,
            timeout=30,
            secret=b"k",
            slot_bytes=slot,
            extra=extra,
            socket_ifname="lo",
        )
    )
    q_out.put(t.listen())
    peer = q_in.get()
    c = t.connect(1 - r, peer)
    out = []
    for n in sizes:
        x = np.ones(n, np.uint8)
        y = np.empty(n, np.uint8)

        def once(x: np.ndarray = x, y: np.ndarray = y) -> None:
            rs = []
            if r == 0 or bidir:
                rs.append(c.isend(memoryview(x)))
            if r == 1 or bidir:
                rs.append(c.irecv_into(memoryview(y)))
            wait_all(rs, Deadline.after(60))
            # tiny ack so timing covers delivery
            if r == 1:
                c.isend(memoryview(b"a")).wait(30)
            else:
                c.irecv_into(memoryview(bytearray(1))).wait(30)

        once()
        once()
        k = max(2, min(iters, (256 << 20) // n))
        t0 = time.perf_counter()
        for _ in range(k):
            once()
        dt = (time.perf_counter() - t0) / k
        out.append((n, dt))
    if r == 0:
        res.put(out)
    c.close()
    t.close()


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--nsocks", type=int, default=1)
    ap.add_argument("--bufsize", type=int, default=None)
    ap.add_argument("--slot", type=int, default=1 << 20)
    ap.add_argument("--bidir", action="store_true")
    ap.add_argument("--sizes", default="8,65536,1048576,16777216,67108864")
    a = ap.parse_args()
    extra = [("tcp_nsocks", str(a.nsocks))]
    if a.bufsize is not None:
        extra.append(("tcp_bufsize", str(a.bufsize)))
    sizes = [int(s) for s in a.sizes.split(",")]
    ctx = mp.get_context("fork")
    q0, q1, res = ctx.Queue(), ctx.Queue(), ctx.Queue()
    ps = [
        ctx.Process(
            target=rank_main,
            args=(0, q0, q1, tuple(extra), a.slot, sizes, 50, a.bidir, res),
        ),
        ctx.Process(
            target=rank_main,
            args=(1, q1, q0, tuple(extra), a.slot, sizes, 50, a.bidir, res),
        ),
    ]
    [p.start() for p in ps]
    out = res.get(timeout=300)
    [p.join() for p in ps]
    print(f"nsocks={a.nsocks} bufsize={a.bufsize} slot={a.slot} bidir={a.bidir}")
    for n, dt in out:
        print(f"  {n:>10d} B  {dt * 1e6:10.1f} us  {n / dt / 1e9:7.3f} GB/s")
