"""Machine limits for host collectives, and a memory-bandwidth bound per algorithm.

Measures, on host memory:

* ``copy``: single-process memcpy bandwidth, ``np.copyto(dst, src)`` on large
  arrays (bytes copied per second);
* ``add``: single-process ``np.add(a, b, out=c)`` throughput on float32 (bytes
  of output per second);
* ``copy_conc`` / ``add_conc``: the same with every rank of the MPI job running
  at once (``mpiexec -n 2 python benchmarks/limits.py``); reported as the
  aggregate over ranks and per rank.

Usage::

    python benchmarks/limits.py                       # single process
    mpiexec -n 2 python benchmarks/limits.py --json limits.json
    mpiexec -n 4 python benchmarks/sweep.py allreduce --limits ...   # from the sweep

The bound (model)
-----------------

On a host, every byte a copy-based transport (shm, tcp) moves is copied twice:
the sender copies it into the transport's memory (a shared-memory slot, a socket
buffer) and the receiver copies it out, or reduces it out (reads the slot and its
local operand, writes the result).  For the busiest rank of an algorithm, count

* ``sent`` bytes (each one copy),
* ``copied`` bytes received by copy or copied locally (each one copy),
* ``reduced`` bytes received into a reduction or reduced locally (each one
  ``a OP b -> out`` pass),

and bound the time of one call from below by::

    T_bound = (sent + copied) / B_copy + reduced / B_add

where ``B_copy`` and ``B_add`` are the per-rank bandwidths measured while all
ranks run at once (``copy_conc / n``, ``add_conc / n``), since the ranks share
the memory bus and, with more ranks than cores, the cores.  Then
``bound_busbw = size * busbw_factor / T_bound`` and the sweep reports
``busbw / bound_busbw`` (= ``T_bound / T_measured``).  Overlap of sends and
receives within a rank is ignored (they share the same bus), as are latency and
Python overhead, and the bandwidths are measured on arrays larger than the
last-level cache: the bound is meaningful for sizes well above the LLC
(cache-resident messages can exceed a fraction of 1).  The byte counts per algorithm (see :func:`traffic`):

* allreduce ring (N = size): sent 2(n-1)/n N, copied (n-1)/n N, reduced (n-1)/n N.
* allreduce tree (double binary tree, half the buffer per tree): per tree, a
  node receives-and-reduces from its first child, receives its second child's
  half into scratch and reduces it, sends the result up, receives the result
  from its parent and sends it to each child; counted exactly from the trees.
* allreduce oneshot: sent (n-1) N, copied n N (rows), reduced (n-1) N; with
  n = 2 sent N and reduced N (straight out of the transport).
* allgather ring (N = output size): sent (n-1)/n N, copied (n-1)/n N + N/n (own block).
* allgather tree: binomial gather to rank 0, then a binary-tree broadcast of N.
* reduce_scatter ring (N = input size): sent (n-1)/n N, reduced (n-1)/n N.
* reduce_scatter tree: tree reduce of N to rank 0, which then sends n-1 blocks.
* broadcast ring (chain): a middle rank receives N and sends N.
* broadcast tree: an interior rank receives N and sends N to each child.
* reduce ring: reduce-scatter, then the root receives n-1 segments.
* reduce tree: the up phase of the tree rooted at the root, N per link.
* direct (one host, the reader copies out of the owner's memory, so nothing is
  "sent"): allreduce copied 2(n-1)/n N (the peers' segments to reduce, then the
  peers' finished segments) and reduced (n-1)/n N; allgather copied (n-1)/n N +
  N/n; reduce_scatter copied and reduced (n-1)/n N; broadcast: a non-root copies
  N; reduce: the reduce-scatter, then the root copies (n-1)/n N more.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


@dataclass
class Limits:
    """Measured bandwidths in bytes per second (``*_conc``: aggregate over ``nprocs``)."""

    copy: float
    add: float
    copy_conc: float
    add_conc: float
    nprocs: int
    nbytes: int

    def per_rank(self) -> tuple[float, float]:
        """(copy, add) bandwidth available to one rank while all ``nprocs`` run."""
        return self.copy_conc / self.nprocs, self.add_conc / self.nprocs


def _time_loop(fn, iters: int) -> float:
    fn()  # first touch / warm-up
    best = float("inf")
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def copy_bw(nbytes: int = 256 << 20, iters: int = 5) -> float:
    """Bytes copied per second by ``np.copyto`` (best of ``iters``)."""
    src = np.ones(nbytes, np.uint8)
    dst = np.empty_like(src)
    return nbytes / _time_loop(lambda: np.copyto(dst, src), iters)


def add_bw(nbytes: int = 256 << 20, iters: int = 5) -> float:
    """Bytes of output per second of ``np.add`` on float32 (best of ``iters``)."""
    n = nbytes // 4
    a = np.ones(n, np.float32)
    b = np.ones(n, np.float32)
    c = np.empty_like(a)
    return nbytes / _time_loop(lambda: np.add(a, b, out=c), iters)


def _concurrent(mpi_comm, fn_bw, nbytes: int, iters: int) -> float:
    """Aggregate bandwidth with every rank running ``fn_bw``'s kernel at once."""
    from mpi4py import MPI

    kind = fn_bw.__name__
    if kind == "copy_bw":
        src = np.ones(nbytes, np.uint8)
        dst = np.empty_like(src)
        op = lambda: np.copyto(dst, src)
    else:
        a = np.ones(nbytes // 4, np.float32)
        b = np.ones_like(a)
        c = np.empty_like(a)
        op = lambda: np.add(a, b, out=c)
    op()
    mpi_comm.Barrier()
    t0 = time.perf_counter()
    for _ in range(iters):
        op()
    dt = time.perf_counter() - t0
    slowest = mpi_comm.allreduce(dt, op=MPI.MAX)
    return mpi_comm.Get_size() * nbytes * iters / slowest


def measure(mpi_comm=None, nbytes: int = 256 << 20, iters: int = 5) -> Limits:
    """Measure the limits; single-process figures on rank 0, concurrent ones on all.

    Every rank of ``mpi_comm`` must call it.  Without a communicator (or with
    one rank) the concurrent figures equal the single-process ones.
    """
    if mpi_comm is None or mpi_comm.Get_size() == 1:
        c, a = copy_bw(nbytes, iters), add_bw(nbytes, iters)
        return Limits(c, a, c, a, 1, nbytes)
    rank = mpi_comm.Get_rank()
    # single process first, while the others wait in a barrier
    c = a = 0.0
    if rank == 0:
        c, a = copy_bw(nbytes, iters), add_bw(nbytes, iters)
    mpi_comm.Barrier()
    c, a = mpi_comm.bcast((c, a), root=0)
    cc = _concurrent(mpi_comm, copy_bw, nbytes, iters)
    ac = _concurrent(mpi_comm, add_bw, nbytes, iters)
    return Limits(c, a, cc, ac, mpi_comm.Get_size(), nbytes)


# --------------------------------------------------------------------------- model
def traffic(
    collective: str, algorithm: str, n: int, size: int, root: int = 0
) -> list[dict[str, float]]:
    """Bytes sent / copied / reduced by each rank (see the module docstring).

    ``size`` is the nccl-tests size: the buffer for allreduce, broadcast and
    reduce, the output of allgather, the input of reduce_scatter.  ``auto`` is
    not an algorithm here; pass the algorithm it resolved to.
    """
    from pycoll.algorithms.tree import btree, double_btree, rooted_btree

    N = float(size)
    f = (n - 1) / n if n > 1 else 0.0
    if n <= 1:
        return [{"sent": 0.0, "copied": N, "reduced": 0.0}]
    per_rank: list[dict[str, float]] = []

    def tree_up(node: tuple[int | None, list[int]], H: float, c: dict[str, float]) -> None:
        parent, children = node
        if children:
            c["reduced"] += H  # first child straight into the reduction
            for _ in children[1:]:
                c["copied"] += H  # into scratch
                c["reduced"] += H  # out OP scratch
        if parent is not None:
            c["sent"] += H

    def tree_down(node: tuple[int | None, list[int]], H: float, c: dict[str, float]) -> None:
        parent, children = node
        if parent is not None:
            c["copied"] += H
        c["sent"] += H * len(children)

    for r in range(n):
        c = {"sent": 0.0, "copied": 0.0, "reduced": 0.0}
        if collective == "allreduce" and algorithm == "ring":
            c.update(sent=2 * f * N, copied=f * N, reduced=f * N)
        elif collective == "allreduce" and algorithm == "oneshot":
            if n == 2:  # the peer's bytes are reduced straight out of the transport
                c.update(sent=N, reduced=N)
            else:  # n-1 copies out, n-1 rows in, then n-1 reduction passes
                c.update(sent=(n - 1) * N, copied=n * N, reduced=(n - 1) * N)
        elif collective == "allreduce" and algorithm == "tree":
            for node in double_btree(n, r):
                tree_up(node, N / 2, c)
                tree_down(node, N / 2, c)
        elif collective == "allgather" and algorithm == "ring":
            c.update(sent=f * N, copied=f * N + N / n)
        elif collective == "allgather" and algorithm == "tree":
            c["copied"] += N / n
            bit = 1
            while bit < n:  # binomial gather, as pycoll.algorithms.tree.allgather
                if r & bit:
                    c["sent"] += (min(r + bit, n) - r) * N / n
                    break
                if r + bit < n:
                    c["copied"] += (min(r + 2 * bit, n) - (r + bit)) * N / n
                bit <<= 1
            tree_down(btree(n, r), N, c)
        elif collective == "reduce_scatter" and algorithm == "ring":
            c.update(sent=f * N, reduced=f * N)
        elif collective == "reduce_scatter" and algorithm == "tree":
            tree_up(btree(n, r), N, c)
            if r == 0:
                c["sent"] += f * N
                c["copied"] += N / n
            else:
                c["copied"] += N / n
        elif collective == "broadcast" and algorithm == "ring":
            v = (r - root) % n
            c.update(sent=N if v < n - 1 else 0.0, copied=N if v else 0.0)
        elif collective == "broadcast" and algorithm == "tree":
            tree_down(rooted_btree(n, r, root), N, c)
        elif collective == "reduce" and algorithm == "ring":
            c.update(sent=f * N + (N / n if r != root else 0.0), reduced=f * N)
            if r == root:
                c["copied"] += f * N
        elif collective == "reduce" and algorithm == "tree":
            tree_up(rooted_btree(n, r, root), N, c)
        elif algorithm == "direct":
            c.update(_direct(collective, n, r, root, N))
        else:
            raise KeyError(f"no traffic model for {collective}/{algorithm}")
        per_rank.append(c)
    return per_rank


def _direct(collective: str, n: int, r: int, root: int, N: float) -> dict[str, float]:
    """Bytes of the ``direct`` algorithms by address (large messages)."""
    f = (n - 1) / n
    if collective == "allreduce":
        return {"copied": 2 * f * N, "reduced": f * N}
    if collective == "allgather":
        return {"copied": f * N + N / n}
    if collective == "reduce_scatter":
        return {"copied": f * N, "reduced": f * N}
    if collective == "broadcast":
        return {"copied": 0.0 if r == root else N}
    if collective == "reduce":
        return {"copied": f * N * (2 if r == root else 1), "reduced": f * N}
    raise KeyError(f"no traffic model for {collective}/direct")


def bound_time(
    collective: str, algorithm: str, n: int, size: int, lim: Limits, root: int = 0
) -> float | None:
    """Lower bound in seconds on one call (the model in the module docstring).

    Returns None for an algorithm the model does not know.
    """
    bc, ba = lim.per_rank()
    try:
        per_rank = traffic(collective, algorithm, n, size, root)
    except KeyError:
        return None
    return max((c["sent"] + c["copied"]) / bc + c["reduced"] / ba for c in per_rank)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bytes", default="256M", help="array size (default 256M)")
    ap.add_argument("-n", "--iters", type=int, default=5)
    ap.add_argument("--json", default=None, help="write the limits here")
    a = ap.parse_args(argv)
    from common import parse_size

    nbytes = parse_size(a.bytes)
    comm = None
    if any(k in os.environ for k in ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMI_SIZE")):
        from mpi4py import MPI

        comm = MPI.COMM_WORLD
    lim = measure(comm, nbytes, a.iters)
    if comm is None or comm.Get_rank() == 0:
        print(f"# limits over {nbytes} B arrays, best of {a.iters}")
        print(f"copy (1 process)          : {lim.copy / 1e9:8.2f} GB/s")
        print(f"np.add float32 (1 process): {lim.add / 1e9:8.2f} GB/s of output")
        print(
            f"copy ({lim.nprocs} at once)           : {lim.copy_conc / 1e9:8.2f} GB/s aggregate, "
            f"{lim.per_rank()[0] / 1e9:.2f} per rank"
        )
        print(
            f"np.add ({lim.nprocs} at once)         : {lim.add_conc / 1e9:8.2f} GB/s aggregate, "
            f"{lim.per_rank()[1] / 1e9:.2f} per rank"
        )
        if a.json:
            Path(a.json).write_text(json.dumps(asdict(lim), indent=1))


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    main()
