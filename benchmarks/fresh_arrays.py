"""pycoll against MPI on fresh arrays: a new input and a new output every call.

Run under mpiexec; rank 0 prints::

    mpiexec -n 2 python benchmarks/fresh_arrays.py
    mpiexec -n 3 python benchmarks/fresh_arrays.py --sizes 8,1K --collectives allreduce

``matrix.py`` and ``sweep.py`` call on the same arrays again and again, as
nccl-tests does.  Many callers do not: a loss averaged each step
(``comm.allreduce(np.array([loss]), out)``) or a framework's fresh views
(``tensor.numpy()``) make new arrays every call, so a replay cache keyed by
the arrays never sees the same ones twice.  Here every call of both systems
allocates its float32 input (``np.full``) and output (``np.empty``) first;
the allocation is in both systems' times.

Calls: ``comm.allreduce(x, out)`` and ``Allreduce``, ``reduce_scatter`` and
``Reduce_scatter_block``, ``allgather`` and ``Allgather``, and the broadcast
in place from root 0 (``comm.broadcast(x)``, ``Bcast``); ``auto`` for pycoll.
Timing is ``versus.py``'s: a pilot sets the calls per block (about
``--block-time``), then ``--rounds`` rounds of one block per system in a
shuffled order, the block's per-call mean on the slowest rank, the median over
rounds.  Each system's output is checked against NumPy once before the rounds.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import exit_status, fmt_size, parse_size
from versus import median_times

COLLECTIVES = ("allreduce", "reduce_scatter", "allgather", "broadcast")
SIZES = "8,1K,64K"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default=SIZES, help=f"comma list (default {SIZES}): the output's")
    ap.add_argument("--collectives", default=",".join(COLLECTIVES))
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--block-time", type=float, default=0.05)
    ap.add_argument("--warm", type=int, default=3)
    return ap.parse_args(argv)


def _calls(
    comm: Any, w: Any, coll: str, size: int
) -> tuple[dict[str, Callable[[], Any]], Callable[[int], np.ndarray]]:
    """Per system, one call on fresh arrays; and rank q's input."""
    n, r = w.size, w.rank
    k = max(1, size // 4)  # the output's elements (the input's for broadcast)
    blk = max(1, k // n)
    inputs = {"allreduce": k, "reduce_scatter": n * blk, "allgather": blk, "broadcast": k}
    outs = {"allreduce": k, "reduce_scatter": blk, "allgather": n * blk}
    m = inputs[coll]

    def data(q: int) -> np.ndarray:
        return np.full(m, q + 1, np.float32)

    from mpi4py import MPI

    if coll == "broadcast":
        return {
            "pycoll": lambda: comm.broadcast(data(r), root=0),
            "mpi": lambda: w.Bcast(data(r), root=0),
        }, data
    o = outs[coll]
    mpi_call = {
        "allreduce": lambda x, y: w.Allreduce(x, y, op=MPI.SUM),
        "reduce_scatter": lambda x, y: w.Reduce_scatter_block(x, y, op=MPI.SUM),
        "allgather": lambda x, y: w.Allgather(x, y),
    }[coll]
    mine = getattr(comm, coll)

    def pycoll_call() -> Any:
        out = np.empty(o, np.float32)
        mine(data(r), out)
        return out

    def mpi() -> Any:
        out = np.empty(o, np.float32)
        mpi_call(data(r), out)
        return out

    return {"pycoll": pycoll_call, "mpi": mpi}, data


def _expected(coll: str, n: int, r: int, data: Callable[[int], np.ndarray]) -> np.ndarray:
    xs = [data(q) for q in range(n)]
    if coll == "allreduce":
        return np.sum(xs, axis=0, dtype=np.float32)
    if coll == "reduce_scatter":
        s = np.sum(xs, axis=0, dtype=np.float32)
        b = s.size // n
        return s[r * b : (r + 1) * b]
    if coll == "allgather":
        return np.concatenate(xs)
    return xs[0]


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    from mpi4py import MPI

    import pycoll

    w = MPI.COMM_WORLD
    n, r = w.size, w.rank
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    colls = args.collectives.split(",")
    rows: list[dict[str, Any]] = []
    with pycoll.init(w) as comm:
        for coll in colls:
            for size in sizes:
                calls, data = _calls(comm, w, coll, size)
                want = _expected(coll, n, r, data)
                wrong = 0
                for name, call in calls.items():
                    got = call()
                    if coll == "broadcast":  # in place: the call's own input
                        got = data(0) if name == "mpi" else got
                    wrong += int(not np.array_equal(got, want))
                wrong = w.allreduce(wrong, op=MPI.SUM)
                med = median_times(
                    w, calls, args.block_time, args.rounds, args.warm, f"fresh {coll} {size}"
                )
                rows.append(
                    {
                        "collective": coll,
                        "size": size,
                        "pycoll_us": med["pycoll"],
                        "mpi_us": med["mpi"],
                        "ratio": med["mpi"] / med["pycoll"],
                        "wrong": wrong,
                    }
                )
                if r == 0:
                    print(
                        f"{coll:>15} {fmt_size(size):>6} pycoll {med['pycoll']:8.2f} us  "
                        f"mpi {med['mpi']:8.2f} us  MPI/pycoll {med['mpi'] / med['pycoll']:5.2f}"
                        f"  wrong {wrong}",
                        flush=True,
                    )
    return rows


def main(argv: list[str] | None = None) -> int:
    return exit_status(run, parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
