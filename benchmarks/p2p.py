"""Point-to-point latency and bandwidth of each transport, below the collectives.

Two ranks under mpiexec; the endpoint blobs are exchanged through mpi4py and
the transports are driven directly (no communicator, no algorithm), so a slow
collective can be traced to its transport::

    mpiexec -n 2 python benchmarks/p2p.py                       # shm, tcp, rdma (soft)
    mpiexec -n 2 python benchmarks/p2p.py -t shm,tcp -b 8 -e 64M -f 4 --json p2p.json

For each size, every transport runs in turn before the next size (noise hits
them alike):

* ``lat(us)``: ping-pong, rank 0 sends ``size`` bytes and rank 1 sends them
  back; half the round-trip time, averaged over ``-n`` round trips (OSU's
  osu_latency).
* ``bw(GB/s)``: streaming, rank 0 posts ``--window`` sends of ``size`` bytes and
  rank 1 the matching receives, then rank 1 acknowledges with one byte;
  bytes / time over the iterations (OSU's osu_bw).

The RDMA transport runs on the software provider unless ``--rdma-provider``
says otherwise; ``--chunk-bytes`` sets the transports' slot size as pycoll's
``chunk_bytes`` does.
"""

from __future__ import annotations

import argparse
import json
import secrets
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import host_meta, parse_size, size_list


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description="transport ping-pong latency and bandwidth")
    ap.add_argument("-t", "--transports", default="shm,tcp,rdma")
    ap.add_argument("-b", "--minbytes", default="8")
    ap.add_argument("-e", "--maxbytes", default="64M")
    ap.add_argument("-f", "--stepfactor", type=float, default=4.0)
    ap.add_argument("-n", "--iters", type=int, default=100, help="iterations at small sizes")
    ap.add_argument("-w", "--warmup_iters", type=int, default=10)
    ap.add_argument("--window", type=int, default=8, help="sends in flight for bw")
    ap.add_argument(
        "--max-bytes-per-test",
        default="512M",
        help="fewer iterations at large sizes: at most this many bytes per measurement",
    )
    ap.add_argument("--chunk-bytes", default="1M", help="transport slot size")
    ap.add_argument("--nslots", type=int, default=4)
    ap.add_argument("--rdma-provider", default="soft", help="soft, pyverbs or auto")
    ap.add_argument("--socket-ifname", default=None, help="interface for tcp and soft rdma")
    ap.add_argument("--timeout", type=float, default=120.0)
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    a.minbytes, a.maxbytes = parse_size(a.minbytes), parse_size(a.maxbytes)
    a.max_bytes_per_test = parse_size(a.max_bytes_per_test)
    a.chunk_bytes = parse_size(a.chunk_bytes)
    a.transports = [t.strip() for t in a.transports.split(",") if t.strip()]
    return a


def connect_all(a: argparse.Namespace, w: Any) -> tuple[dict[str, Any], list[Any]]:
    """Connections to the peer per transport name; refusals are printed by rank 0."""
    from transports.base import TransportOptions
    from transports.registry import transport_class

    rank = w.Get_rank()
    secret = w.bcast(secrets.token_bytes(16) if rank == 0 else None, root=0)
    opts = TransportOptions(
        rank=rank,
        size=2,
        timeout=a.timeout,
        secret=secret,
        socket_ifname=a.socket_ifname,
        slot_bytes=a.chunk_bytes,
        nslots=a.nslots,
        extra=(("rdma_provider", a.rdma_provider), ("rdma_memory", "host")),
    )
    conns: dict[str, Any] = {}
    owned: list[Any] = []
    for name in a.transports:
        err, blob, t = "", None, None
        try:
            t = transport_class(name)(opts)
            blob = t.listen()
        except Exception as exc:
            err = f"{type(exc).__name__}: {exc}"
        blobs = w.allgather(blob)
        errs = w.allgather(err)
        if not err and not any(errs):
            ok, why = t.can_connect(blob, blobs[1 - rank])
            oks = w.allgather((ok, why))
            if not all(o for o, _ in oks):
                err = "; ".join(y for o, y in oks if not o)
        else:
            err = next(e for e in errs if e)
            w.allgather(None)
        if not err:
            try:
                conns[name] = t.connect(1 - rank, blobs[1 - rank])
            except Exception as exc:
                err = f"{type(exc).__name__}: {exc}"
            errs = w.allgather(err)
            err = next((e for e in errs if e), "")
        if t is not None:
            owned.append(t)
        if err:
            conns.pop(name, None)
            if rank == 0:
                print(f"# {name}: skipped: {err.splitlines()[0][:160]}", flush=True)
    w.Barrier()
    return conns, owned


def pingpong(c: Any, rank: int, x: np.ndarray, y: np.ndarray, iters: int, to: float) -> float:
    from transports.base import Deadline, wait_all

    sx, ry = memoryview(x), memoryview(y)
    t0 = time.perf_counter()
    for _ in range(iters):
        if rank == 0:
            wait_all([c.isend(sx)], Deadline.after(to))
            wait_all([c.irecv_into(ry)], Deadline.after(to))
        else:
            wait_all([c.irecv_into(ry)], Deadline.after(to))
            wait_all([c.isend(sx)], Deadline.after(to))
    return (time.perf_counter() - t0) / (2 * iters)


def stream(
    c: Any, rank: int, x: np.ndarray, y: np.ndarray, window: int, iters: int, to: float
) -> float:
    from transports.base import Deadline, wait_all

    sx, ry = memoryview(x), memoryview(y)
    ack = np.zeros(1, np.uint8)
    mack = memoryview(ack)
    t0 = time.perf_counter()
    for _ in range(iters):
        if rank == 0:
            wait_all([c.isend(sx) for _ in range(window)], Deadline.after(to))
            wait_all([c.irecv_into(mack)], Deadline.after(to))
        else:
            wait_all([c.irecv_into(ry) for _ in range(window)], Deadline.after(to))
            wait_all([c.isend(mack)], Deadline.after(to))
    return x.nbytes * window * iters / (time.perf_counter() - t0)


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    from mpi4py import MPI

    w = MPI.COMM_WORLD
    if w.Get_size() != 2:
        if w.Get_rank() == 0:
            print("p2p.py needs exactly 2 ranks: mpiexec -n 2 python benchmarks/p2p.py")
        return 2
    rank = w.Get_rank()
    conns, owned = connect_all(a, w)
    names = [t for t in a.transports if t in conns]
    meta = host_meta()
    records: list[dict[str, Any]] = []
    if rank == 0:
        print(
            f"# p2p: host(s) {sorted(set(w.allgather(meta['host'])))}  chunk_bytes {a.chunk_bytes}"
            f"  window {a.window}  iters {a.iters}  warmup {a.warmup_iters}"
        )
        print("# lat: half round trip (us); bw: one-way streaming (GB/s)")
        h = f"#{'size':>11s}"
        for t in names:
            kind = conns[t].transport
            h += f" {kind + ' lat':>14s} {kind + ' bw':>12s}"
        print(h, flush=True)
    else:
        w.allgather(meta["host"])
    for s in size_list(a.minbytes, a.maxbytes, a.stepfactor):
        x = np.full(s, 7, np.uint8)
        y = np.empty(s, np.uint8)
        lat_iters = max(2, min(a.iters, a.max_bytes_per_test // max(1, 2 * s)))
        bw_iters = max(2, min(a.iters, a.max_bytes_per_test // max(1, s * a.window)))
        line = f" {s:>11d}"
        for t in names:
            c = conns[t]
            pingpong(c, rank, x, y, max(1, min(a.warmup_iters, lat_iters)), a.timeout)
            w.Barrier()
            lat = pingpong(c, rank, x, y, lat_iters, a.timeout)
            if rank == 1 and not (y == 7).all():
                print(f"# {t}: WRONG bytes received at size {s}", flush=True)
            stream(c, rank, x, y, a.window, 1, a.timeout)
            w.Barrier()
            bw = stream(c, rank, x, y, a.window, bw_iters, a.timeout)
            lat = w.allreduce(lat, op=MPI.MAX)
            bw = w.bcast(bw, root=0)
            line += f" {lat * 1e6:14.2f} {bw / 1e9:12.3f}"
            records.append(
                {
                    "system": "p2p",
                    "transport": c.transport,
                    "size": s,
                    "lat_us": lat * 1e6,
                    "bw_GBps": bw / 1e9,
                    "lat_iters": lat_iters,
                    "bw_iters": bw_iters,
                    "window": a.window,
                    "chunk_bytes": a.chunk_bytes,
                    "host": meta["host"],
                    "date": meta["date"],
                }
            )
        if rank == 0:
            print(line, flush=True)
    for c in conns.values():
        c.close()
    for t in reversed(owned):
        t.close()
    if rank == 0 and a.json:
        Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        Path(a.json).write_text(json.dumps({"meta": meta, "records": records}, indent=1))
        print(f"# wrote {len(records)} records to {a.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
