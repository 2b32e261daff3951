"""Broadcasts whose root's and readers' buffers start at chosen page offsets.

The kernel's cross-memory copy (REP MOVSB on CPUs with fast string moves)
runs several times slower where the destination starts a short distance
after the source modulo the page.  This times pycoll's broadcast and MPI's
``Bcast`` of ``--bytes`` with the root's buffer at one page offset and every
reader's at another, each carved out of a huge-page mapping.  Run under
mpiexec; rank 0 prints the slowest rank's mean time of a call per turn (the
two in a new order each turn)::

    mpiexec -n 2 python benchmarks/broadcast_offsets.py --offsets 0:0,0:16,16:0
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
from mpi4py import MPI

sys.path.insert(0, str(Path(__file__).resolve().parent))

import hostmem
from common import parse_size, said  # (puts the repository on sys.path)
from versus import alternate

import pycoll


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bytes", default="1M")
    ap.add_argument("--offsets", default="0:0,0:16,16:0", help="comma list of ROOT:READERS")
    ap.add_argument("--calls", type=int, default=400)
    ap.add_argument("--turns", type=int, default=2)
    args = ap.parse_args()
    world = MPI.COMM_WORLD
    comm = pycoll.init()
    rank, nbytes = comm.rank, parse_size(args.bytes)
    if rank == 0:
        print(f"# n = {comm.size}: broadcast of {nbytes} B from rank 0; mean us a call")
    for pair in args.offsets.split(","):
        root_off, reader_off = (parse_size(v) for v in pair.split(":"))
        off = root_off if rank == 0 else reader_off
        raw = hostmem.empty(nbytes + off, np.uint8, "on")
        buf = raw[off : off + nbytes]
        want = np.random.default_rng(len(pair)).integers(0, 256, nbytes, dtype=np.uint8)
        buf[:] = want if rank == 0 else 0
        calls = {
            "pycoll": (lambda b=buf: comm.broadcast(b, root=0), args.calls),
            "mpi": (lambda b=buf: world.Bcast(b, root=0), args.calls),
        }
        times, _ = alternate(world, calls, args.turns, 10, f"broadcast_offsets {pair}")
        wrong = world.allreduce(int(not np.array_equal(buf, want)))
        if rank == 0:
            print(
                f"root {root_off:>5} readers {reader_off:>5}: {said(times, 1)}  wrong {wrong}",
                flush=True,
            )
    comm.close()


if __name__ == "__main__":
    main()
