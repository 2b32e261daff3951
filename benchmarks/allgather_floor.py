"""The copies of a large allgather on one host, alone, against pycoll and MPI.

Run under mpiexec; rank 0 prints::

    mpiexec -n 2 python benchmarks/allgather_floor.py
    mpiexec -n 3 python benchmarks/allgather_floor.py --sizes 16M,64M

An out-of-place allgather by address moves each rank's block ``k`` bytes into
every output: each rank copies its own block into its output and makes one
cross-memory copy per peer (``process_vm_writev`` of its block into the peer's
output, or ``process_vm_readv`` of the peer's block into its own).  No
algorithm moves fewer bytes.  Here those copies run with nothing around them
but an MPI barrier before and after (the buffers' addresses are exchanged
once), in three orders:

* ``two-pass-write``: the own block whole, then one write a peer;
* ``two-pass-read``: the own block whole, then one read a peer;
* ``one-pass``: 256 KiB pieces, each copied into the own output and written to
  every peer before the next, so each piece is read from memory once (what
  pycoll's ``direct`` does by address from :data:`pycoll.buffers.OWN_PLACED_MIN`).

They take turns with pycoll's ``allgather(x, out, algorithm="direct")`` and
mpi4py's ``Allgather`` on the same arrays, allocated as ``matrix.py`` allocates
them (the input by ``numpy.random``, the output by ``np.empty``).  Timing is
``versus.py``'s: a pilot sets the calls per block (about ``--block-time``),
then ``--rounds`` rounds of one block per system in a shuffled order, the
block's per-call mean on the slowest rank, the median over rounds.  Every
system's output is checked against NumPy once before the rounds.  Times are
also given over the fastest of the three orders.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import exit_status, fmt_size, parse_size
from versus import median_times

from transports._cma import read as cma_read
from transports._cma import write as cma_write

SIZES = "16M"
#: the pieces of ``one-pass`` (pycoll.algorithms.direct.OWN_PIECE_BYTES)
PIECE = 256 << 10


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default=SIZES, help=f"comma list of output sizes ({SIZES})")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--block-time", type=float, default=0.05)
    ap.add_argument("--warm", type=int, default=3)
    return ap.parse_args(argv)


def _input(rank: int, k: int) -> np.ndarray:
    return np.random.default_rng([rank, k]).standard_normal(k, dtype=np.float32)


def _calls(comm: Any, w: Any, size: int) -> tuple[dict[str, Callable[[], Any]], Any, Any]:
    """Per system, one allgather of ``size`` output bytes; and the arrays."""
    n, r = w.size, w.rank
    k = max(1, size // 4 // n)
    nb = 4 * k
    x = _input(r, k)
    out = np.empty(n * k, np.float32)
    where = w.allgather((os.getpid(), x.ctypes.data, out.ctypes.data))
    others = [(r + d) % n for d in range(1, n)]

    def own() -> None:
        out[r * k : (r + 1) * k] = x

    def two_pass_write() -> None:
        w.Barrier()
        own()
        for j in others:
            pid, _, theirs = where[j]
            cma_write(pid, theirs + r * nb, x.ctypes.data, nb)
        w.Barrier()

    def two_pass_read() -> None:
        w.Barrier()
        own()
        for j in others:
            pid, theirs, _ = where[j]
            cma_read(pid, theirs, out.ctypes.data + j * nb, nb)
        w.Barrier()

    piece = max(1, PIECE // 4)

    def one_pass() -> None:
        w.Barrier()
        for lo in range(0, k, piece):
            part = x[lo : lo + piece]
            out[r * k + lo : r * k + lo + part.size] = part
            for j in others:
                pid, _, theirs = where[j]
                cma_write(pid, theirs + r * nb + 4 * lo, part.ctypes.data, part.nbytes)
        w.Barrier()

    calls = {
        "two-pass-write": two_pass_write,
        "two-pass-read": two_pass_read,
        "one-pass": one_pass,
        "pycoll": lambda: comm.allgather(x, out, algorithm="direct"),
        "mpi": lambda: w.Allgather(x, out),
    }
    return calls, x, out


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    from mpi4py import MPI

    import pycoll

    w = MPI.COMM_WORLD
    n, r = w.size, w.rank
    rows: list[dict[str, Any]] = []
    with pycoll.init(w) as comm:
        for size in (parse_size(s) for s in args.sizes.split(",")):
            calls, x, out = _calls(comm, w, size)
            want = np.concatenate([_input(q, x.size) for q in range(n)])
            wrong = 0
            for call in calls.values():
                out[:] = np.nan
                call()
                wrong += int(not np.array_equal(out, want))
            wrong = w.allreduce(wrong, op=MPI.SUM)
            med = median_times(w, calls, args.block_time, args.rounds, args.warm, f"floor {size}")
            floor = min(med["two-pass-write"], med["two-pass-read"], med["one-pass"])
            rows.append({"size": size, "wrong": wrong, **{f"{k}_us": v for k, v in med.items()}})
            if r == 0:
                print(
                    f"n = {n} allgather {fmt_size(size):>5}: "
                    + "  ".join(f"{k} {v:8.1f} us ({v / floor:4.2f}x)" for k, v in med.items())
                    + f"  wrong {wrong}",
                    flush=True,
                )
    return rows


def main(argv: list[str] | None = None) -> int:
    return exit_status(run, parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
