"""Where a replayed small call's time goes: the public call, a prepared call, the
Python replay and the plan's step alone, against MPI's call, in one job.

Run under mpiexec; rank 0 prints one line a layer::

    mpiexec -n 2 python benchmarks/replay_layers.py allreduce
    PYCOLL_COMPILED=0 mpiexec -n 2 python benchmarks/replay_layers.py broadcast

Each layer is timed as ``--calls`` calls back to back after an MPI barrier,
best of ``--repeats``, on the slowest rank (us a call).  The layers, outermost
first: ``comm.<collective>(x, out)`` (the compiled entry where it was built),
``comm.prepare(...)()``, ``Engine.replay`` of the call's plan (the Python
replay), and the plan's ``go()`` (the envelope and the step).  The arrays are
float32 of 2 elements a rank (8 B; allgather's output and reduce_scatter's input
n times that), out of place but broadcast; the timed layers reach into pycoll's
internals, so this is a diagnostic for pycoll's own developers, not a baseline.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from typing import Any

import numpy as np
from mpi4py import MPI

import pycoll

COLLECTIVES = ("allreduce", "allgather", "broadcast", "reduce_scatter")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("collective", choices=COLLECTIVES)
    ap.add_argument("--calls", type=int, default=20000)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args(argv)
    world = MPI.COMM_WORLD
    comm = pycoll.init()
    n, what = comm.size, args.collective
    x = np.ones(2 * (n if what == "reduce_scatter" else 1), np.float32)
    out = np.empty(2 * (n if what == "allgather" else 1), np.float32)
    o = None if what == "broadcast" else out

    def mpi() -> None:
        if what == "allreduce":
            world.Allreduce(x, out)
        elif what == "allgather":
            world.Allgather(x, out)
        elif what == "broadcast":
            world.Bcast(x, root=0)
        else:
            world.Reduce_scatter_block(x, out)

    def public() -> Any:
        if what == "broadcast":
            return comm.broadcast(x)
        return getattr(comm, what)(x, out)

    h = comm.prepare(what, x, o)
    for _ in range(3):  # the first calls make the plan
        public()
        h()
    eng = comm._engine
    plans = [p for p in eng.plans.plans.values() if p.x is x]
    if len(plans) != 1:
        raise SystemExit(f"rank {comm.rank}: {len(plans)} plans of the call, not one")
    p = plans[0]

    def timed(f: Callable[[], Any]) -> float:
        best = float("inf")
        for _ in range(args.repeats):
            world.Barrier()
            t0 = time.perf_counter()
            for _ in range(args.calls):
                f()
            best = min(best, (time.perf_counter() - t0) / args.calls)
        return max(world.allgather(best)) * 1e6

    layers: list[tuple[str, Callable[[], Any]]] = [
        ("mpi", mpi),
        (f"comm.{what}", public),
        ("prepared", h),
        ("Engine.replay", lambda: eng.replay(p, x, o)),
        ("plan.go (step)", p.go),
        ("mpi again", mpi),
    ]
    times = [(name, timed(f)) for name, f in layers]
    if comm.rank == 0:
        print(f"# {what}, n = {n}, 8 B a rank, {args.calls} calls, best of {args.repeats}")
        for name, t in times:
            print(f"{name:16s} {t:7.2f} us")
    comm.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
