"""Run under mpiexec across simulated hosts: the tcp transport alone, over mpi4py.

Every rank connects to every other rank with :class:`transports.tcp.TcpTransport`
(blobs exchanged with mpi4py's allgather), then each pair swaps 1 byte, 7
bytes and 3 MiB both ways at once.  Prints one ``OK`` line per rank.
"""

from __future__ import annotations

import socket
import sys

import numpy as np
from mpi4py import MPI

from transports.base import Deadline, TransportOptions, wait_all
from transports.tcp import TcpTransport, decode_blob


def main() -> int:
    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    secret = comm.bcast(np.random.bytes(32) if rank == 0 else None, root=0)
    opts = TransportOptions(rank=rank, size=size, timeout=30.0, secret=secret, slot_bytes=1 << 16)
    with TcpTransport(opts) as t:
        blobs = comm.allgather(t.listen())
        addrs = [a.host for a in decode_blob(blobs[rank]).addrs]
        conns = {}
        for p in range(size):
            if p != rank:
                ok, why = t.can_connect(blobs[rank], blobs[p])
                assert ok, why
                print(f"rank {rank} ({socket.gethostname()}) -> {p}: {why}", flush=True)
                conns[p] = t.connect(p, blobs[p])
        for n in (1, 7, 3 << 20):
            reqs, outs = [], {}
            for p, c in conns.items():
                x = np.full(n, (rank * 31 + p) % 251, np.uint8)
                outs[p] = np.empty(n, np.uint8)
                reqs += [c.isend(memoryview(x)), c.irecv_into(memoryview(outs[p]))]
                outs[p, "keep"] = x  # keep the send buffer alive until done
            wait_all(reqs, Deadline.after(60))
            for p in conns:
                assert (outs[p] == (p * 31 + rank) % 251).all(), (rank, p, n)
        comm.Barrier()
        for c in conns.values():
            c.close()
    print(f"OK rank {rank} host {socket.gethostname()} addrs {addrs}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
