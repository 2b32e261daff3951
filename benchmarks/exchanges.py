"""alltoall, gather, scatter and sendrecv in the benchmarks: who holds which
buffer, the inputs, the NumPy reference, and each system's call.

Geometry (``common.geometry``; k = size / n elements, at least one):

==========  ==================  ==================  ===========================
collective  send buffer         receive buffer      call
==========  ==================  ==================  ===========================
alltoall    n k on every rank   n k on every rank   block j to rank j
gather      k on every rank     n k on the root     rank j's into block j
scatter     n k on the root     k on every rank     block j to rank j
sendrecv    size on every rank  size on every rank  to rank + 1, from rank - 1
==========  ==================  ==================  ===========================

A rank without a buffer passes None (pycoll, MPI and torch.distributed all take
that).  These collectives have only the out-of-place form here.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
from common import Skip

#: Input values run below this: exact in int8 and bfloat16, and never the
#: poison byte 0x5A (90) of an int8 or uint8 output.
MODULUS = 61


def holds(collective: str, rank: int, root: int) -> tuple[bool, bool]:
    """(has a send buffer, has a receive buffer) for ``rank``."""
    if collective == "gather":
        return True, rank == root
    if collective == "scatter":
        return rank == root, True
    return True, True


def rank_data(rank: int, count: int, dtype: np.dtype) -> np.ndarray:
    """Rank ``rank``'s send buffer: each value tells the sender and the place
    (mod 61), so a block from the wrong rank or in the wrong place differs."""
    i = np.arange(count, dtype=np.int64)
    return ((7 * i + 17 * rank + 1) % MODULUS).astype(dtype)


def expected(
    collective: str, rank: int, n: int, root: int, send: int, recv: int, dtype: Any
) -> np.ndarray | None:
    """The NumPy reference of ``rank``'s receive buffer (None where it has none).

    ``send`` and ``recv`` are the element counts of the two buffers on a rank
    that has both (the root of gather and scatter)."""
    if collective == "alltoall":
        k = recv // n
        blocks = [rank_data(p, send, dtype)[rank * k : (rank + 1) * k] for p in range(n)]
        return np.concatenate(blocks)
    if collective == "gather":
        if rank != root:
            return None
        return np.concatenate([rank_data(p, send, dtype) for p in range(n)])
    if collective == "scatter":
        return rank_data(root, send, dtype)[rank * recv : (rank + 1) * recv]
    if collective == "sendrecv":
        return rank_data((rank - 1) % n, send, dtype)
    raise KeyError(collective)


def peers(rank: int, n: int) -> tuple[int, int]:
    """sendrecv's (destination, source): a ring shift, as nccl-tests' sendrecv_perf."""
    return (rank + 1) % n, (rank - 1) % n


def pycoll_call(
    comm: Any, collective: str, s: Any, r: Any, algorithm: str, root: int
) -> Callable[[], Any]:
    """pycoll's call on these buffers."""
    if collective == "alltoall":
        return lambda: comm.alltoall(s, r, algorithm=algorithm)
    if collective == "gather":
        return lambda: comm.gather(s, r, root=root, algorithm=algorithm)
    if collective == "scatter":
        return lambda: comm.scatter(s, r, root=root, algorithm=algorithm)
    dest, src = peers(comm.rank, comm.size)
    return lambda: comm.sendrecv(s, dest, r, src)


def mpi_call(w: Any, collective: str, s: Any, r: Any, root: int) -> Callable[[], Any]:
    """mpi4py's ``Alltoall``, ``Gather``, ``Scatter`` or ``Sendrecv``."""
    if collective == "alltoall":
        return lambda: w.Alltoall(s, r)
    if collective == "gather":
        return lambda: w.Gather(s, r, root=root)
    if collective == "scatter":
        return lambda: w.Scatter(s, r, root=root)
    dest, src = peers(w.Get_rank(), w.Get_size())
    return lambda: w.Sendrecv(s, dest, recvbuf=r, source=src)


def torch_call(
    dist: Any, group: Any, collective: str, ts: Any, tr: Any, root: int, rank: int, n: int
) -> Callable[[], Any]:
    """torch.distributed's ``all_to_all_single``, ``gather``, ``scatter``, or for
    sendrecv one ``isend`` and one ``irecv`` posted together
    (``batch_isend_irecv``).

    Raises:
        Skip: sendrecv at n = 1 (Gloo refuses a message to its own rank).
    """
    if collective == "alltoall":
        return lambda: dist.all_to_all_single(tr, ts, group=group)
    if collective == "gather":
        outs = list(tr.chunk(n)) if rank == root else None
        return lambda: dist.gather(ts, outs, dst=root, group=group)
    if collective == "scatter":
        ins = list(ts.chunk(n)) if rank == root else None
        return lambda: dist.scatter(tr, ins, src=root, group=group)
    if n == 1:
        raise Skip("torch.distributed sends no message to its own rank")
    dest, src = peers(rank, n)
    ops = [dist.P2POp(dist.isend, ts, dest, group), dist.P2POp(dist.irecv, tr, src, group)]

    def call() -> None:
        for req in dist.batch_isend_irecv(ops):
            req.wait()

    return call
