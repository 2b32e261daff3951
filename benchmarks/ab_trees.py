"""Two versions of pycoll head to head: whole jobs of each, taking turns.

``versus.py`` times systems of one pycoll in one job; a change to the
communicator itself (a guard on the fast path, a lock) needs two pycoll trees,
and one process imports only one.  Here each round starts one job per tree, in
a new order each round, with that tree on ``PYTHONPATH``; each job times
``--blocks`` blocks of ``--calls`` replayed calls and reports the median block
(per-call mean on the slowest rank).  The ratio B/A is taken per round, so a
slow spell of the machine falls on both sides alike::

    git worktree add /tmp/base main
    python benchmarks/ab_trees.py --a /tmp/base --b . -n 2 --bytes 8 --rounds 15

Rank 0 of each job prints one JSON line; the driver prints the median ratio
and its 10th and 90th percentiles over the rounds.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve()


def _inner(args: argparse.Namespace) -> None:
    import numpy as np
    from mpi4py import MPI

    import pycoll

    comm = pycoll.init()
    count = max(1, args.bytes // 4)
    x = np.ones(count, np.float32)
    out = np.empty(count * (comm.size if args.collective == "allgather" else 1), np.float32)
    call = {
        "allreduce": lambda: comm.allreduce(x, out),
        "allgather": lambda: comm.allgather(x, out),
        "broadcast": lambda: comm.broadcast(x),
    }[args.collective]
    for _ in range(args.calls):  # warm: plans made, tuner settled
        call()
    blocks = []
    for _ in range(args.blocks):
        comm.barrier()
        t0 = time.perf_counter()
        for _ in range(args.calls):
            call()
        blocks.append((time.perf_counter() - t0) / args.calls)
    slowest = MPI.COMM_WORLD.allreduce(statistics.median(blocks), op=MPI.MAX)
    if args.collective == "allreduce":
        assert float(out[0]) == comm.size, "wrong result"
    if comm.rank == 0:
        print(json.dumps({"us": slowest * 1e6, "pycoll": pycoll.__file__}), flush=True)
    comm.close()


def _job(tree: str, args: argparse.Namespace) -> float:
    mpiexec = Path(sys.executable).parent / "mpiexec"
    cmd = [str(mpiexec if mpiexec.exists() else "mpiexec"), "-n", str(args.n), sys.executable]
    cmd += [str(HERE), "--inner", "--collective", args.collective, "--bytes", str(args.bytes)]
    cmd += ["--calls", str(args.calls), "--blocks", str(args.blocks)]
    env = dict(os.environ, PYTHONPATH=str(Path(tree).resolve()))
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300, check=True)
    line = [ln for ln in res.stdout.splitlines() if ln.startswith("{")][-1]
    doc = json.loads(line)
    if not doc["pycoll"].startswith(str(Path(tree).resolve())):
        raise SystemExit(f"job imported {doc['pycoll']}, not the tree {tree}")
    return float(doc["us"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--a", default=".", help="tree A (the base)")
    ap.add_argument("--b", default=".", help="tree B (the change)")
    ap.add_argument("-n", type=int, default=2, help="ranks per job")
    ap.add_argument(
        "--collective", default="allreduce", choices=("allreduce", "allgather", "broadcast")
    )
    ap.add_argument("--bytes", type=int, default=8)
    ap.add_argument("--calls", type=int, default=2000, help="calls per block")
    ap.add_argument("--blocks", type=int, default=9, help="blocks per job")
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--inner", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.inner:
        _inner(args)
        return
    times: dict[str, list[float]] = {"A": [], "B": []}
    ratios = []
    for r in range(args.rounds):
        order = [("A", args.a), ("B", args.b)]
        random.shuffle(order)
        got = {name: _job(tree, args) for name, tree in order}
        for name, us in got.items():
            times[name].append(us)
        ratios.append(got["B"] / got["A"])
        print(
            f"round {r:2d}: A {got['A']:.2f} us  B {got['B']:.2f} us  B/A {ratios[-1]:.3f}",
            flush=True,
        )
    q = statistics.quantiles(ratios, n=10) if len(ratios) >= 2 else [ratios[0]] * 9
    print(
        f"{args.collective} {args.bytes} B n={args.n}: A median {statistics.median(times['A']):.2f} us, "
        f"B median {statistics.median(times['B']):.2f} us, B/A median {statistics.median(ratios):.3f} "
        f"(p10 {q[0]:.3f}, p90 {q[-1]:.3f}, {args.rounds} rounds)"
    )


if __name__ == "__main__":
    main()
