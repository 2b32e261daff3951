"""Head to head: a few systems at a few sizes, taking turns every few milliseconds.

Run under mpiexec; rank 0 prints::

    mpiexec -n 3 python benchmarks/versus.py reduce 512K 2M --systems auto,direct,tree
    mpiexec -n 2 python benchmarks/versus.py allreduce 2M --systems auto,direct,oneshot,mpi
    git show REV:pycoll/algorithms/direct.py > /tmp/direct_rev.py
    mpiexec -n 2 python benchmarks/versus.py allgather 4M --systems direct,direct@direct_rev,mpi \
        --algorithms-from /tmp/direct_rev.py

``sweep.py`` times each system for up to ``--max-time`` seconds in turn.  On a
shared VM the machine's state moves over such spans (and, where ranks outnumber
cores, the scheduler's placement can hold for most of a second), so the same
code measured twice in one repetition can land more than 10% apart.  Here the
systems take turns in short blocks (about ``--block-time`` seconds of calls
each, after ``--warm`` untimed calls), in a new order each round, and each
system's time in a round is compared with the first system's time in the same
round.  A slow spell then falls on every system alike, and the ratio's spread
over the rounds says how far one run can be trusted.

Columns, per size and system: calls per block, the median over rounds of the
per-call mean on the slowest rank (us), and that time over the first system's
in the same round: median, 10th and 90th percentile over rounds.  For ``auto``
the last column is what it ran (its tuner, :mod:`pycoll.tune`, may time
contenders as it goes).  Systems: ``auto``, any algorithm of the collective,
and ``mpi`` (host buffers).  Every system's output is checked once against the
NumPy reference before the rounds, and again after them.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import COLLECTIVES, OPS, geometry, host_meta, parse_dtype, parse_size, run_or_abort
from sweep import (
    Case,
    Prepared,
    Runner,
    System,
    count_wrong,
    expected,
    input_bytes,
    make_buffers,
    tuned_calls,
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        description="systems head to head in short alternating blocks (run under mpiexec)",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("collective", choices=COLLECTIVES)
    ap.add_argument("sizes", nargs="+", help="nccl-tests sizes in bytes (8, 512K, 2M)")
    ap.add_argument(
        "--systems",
        default="auto,direct",
        help="comma list: auto, algorithm names, mpi; all = auto and every algorithm",
    )
    ap.add_argument("--rounds", type=int, default=41, help="rounds (every system once each)")
    ap.add_argument("--block-time", type=float, default=0.01, help="seconds of calls per block")
    ap.add_argument("--warm", type=int, default=3, help="untimed calls before each block")
    ap.add_argument("-d", "--datatype", default="float32")
    ap.add_argument("-o", "--op", default="sum", choices=OPS)
    ap.add_argument("--root", type=int, default=0)
    ap.add_argument("--transport", default=None, help="pycoll transports, e.g. shm")
    ap.add_argument("--hugepages", default="numpy", choices=("numpy", "on", "off"))
    ap.add_argument("--json", default=None, help="write one record per system, size and round")
    ap.add_argument(
        "--algorithms-from",
        action="append",
        default=[],
        metavar="FILE",
        help="an algorithm module of another version (git show REV:pycoll/algorithms/"
        "direct.py > direct_REV.py); its algorithms join as NAME@STEM (direct@direct_rev)",
    )
    a = ap.parse_args(argv)
    a.sizes = [parse_size(s) for s in a.sizes]
    a.systems = [s.strip().lower() for s in a.systems.split(",") if s.strip()]
    if a.rounds < 1 or a.block_time <= 0 or a.warm < 0:
        ap.error("--rounds must be >= 1, --block-time > 0, --warm >= 0")
    if len(set(a.systems)) != len(a.systems) or not a.systems:
        ap.error(f"--systems: a comma list of distinct names, not {','.join(a.systems)!r}")
    return a


def _pct(xs: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(xs), q))


def _check(w: Any, p: Prepared, ref: np.ndarray | None, case: Case) -> int:
    """Load the inputs, call once, and count wrong output elements over all ranks."""
    from mpi4py import MPI

    p.load()
    p.call()
    return int(w.allreduce(count_wrong(p.output(), ref, case), op=MPI.SUM))


def load_algorithms(path: str) -> None:
    """Register the algorithms that module file ``path`` registers, each as
    ``name@stem`` beside the current ones, to time two versions in one job.

    Only the module is another version; what it imports is the current code.
    Such names are not the communicator's ``direct``, so small calls do not
    take its prepared fast path: compare them above the slot size."""
    import importlib.util

    from pycoll.algorithms import registry

    stem = Path(path).stem.lower()
    spec = importlib.util.spec_from_file_location(f"pycoll.algorithms._{stem}", path)
    if spec is None or spec.loader is None:
        raise SystemExit(f"--algorithms-from: cannot load {path!r}")
    real = registry.register
    registry.register = lambda c, name: real(c, f"{name}@{stem}")  # type: ignore[assignment]
    try:
        spec.loader.exec_module(importlib.util.module_from_spec(spec))
    finally:
        registry.register = real


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    from mpi4py import MPI

    import pycoll
    from pycoll import algorithms

    w = MPI.COMM_WORLD
    rank, n = w.Get_rank(), w.Get_size()

    def say(msg: str) -> None:
        if rank == 0:
            print(msg, flush=True)

    coll = args.collective
    for path in args.algorithms_from:
        load_algorithms(path)
    reg = algorithms.names(coll)
    if "all" in args.systems:  # auto and every algorithm, where "all" stands
        i = args.systems.index("all")
        more = [a for a in ("auto", *reg) if a not in args.systems]
        args.systems[i : i + 1] = more
    for s in args.systems:
        if s not in ("auto", "mpi", *reg):
            raise SystemExit(f"--systems: {s!r} is not auto, mpi or one of {', '.join(reg)}")
    if not 0 <= args.root < n:
        raise SystemExit(f"--root {args.root} is not in [0, {n})")
    dtype, dname, _ = parse_dtype(args.datatype)
    cfg: dict[str, Any] = {}
    if args.transport:
        cfg["transports"] = tuple(t.strip() for t in args.transport.split(",") if t.strip())
    comm = pycoll.init(w, **cfg)
    runner = Runner(args, w, comm, np)
    systems = [System("mpi") if s == "mpi" else System("pycoll", s) for s in args.systems]
    first = systems[0].label
    wide = max(10, *(len(s) for s in args.systems))
    short = first.removeprefix("pycoll:")
    meta = host_meta()
    say(
        f"# versus: {coll} {dname} {args.op}, n = {n}, {args.rounds} rounds of blocks of "
        f"about {args.block_time * 1e3:g} ms after {args.warm} untimed calls, "
        "a new order each round"
    )
    say(f"# time: median over rounds of the per-call mean on the slowest rank; x{short}:")
    say(f"# that time over {short}'s in the same round (median, 10th and 90th percentile)")
    say(
        f"#{'size':>11} {'system':>{wide}} {'calls':>6} {'time(us)':>10} "
        f"{'x' + short:>8} {'p10':>6} {'p90':>6}  ran"
    )
    records: list[dict[str, Any]] = []
    total_wrong = 0
    misses: list[str] = []  # systems that beat the first by more than 10%, and where
    missed: set[int] = set()  # the sizes of those
    clock = time.perf_counter
    for size in args.sizes:
        sc, rc, tc = geometry(coll, size, dtype.itemsize, n)
        case = Case(coll, tc * dtype.itemsize, sc, rc, tc, dtype, dname, args.op, args.root, False)
        bufs = make_buffers(case, np, args.hugepages)
        ref = expected(case, rank, n)
        prep = {s.label: runner.prepare(s, case, bufs) for s in systems}
        # inputs stay as loaded: every call reads the same send buffer (broadcast
        # rewrites the root's data with itself)
        wrong = {s.label: _check(w, prep[s.label], ref, case) for s in systems}
        per: dict[str, float] = {}
        for s in systems:  # a pilot: calls per block from a tenth of a second of calls
            call, k, batch, t0 = prep[s.label].call, 0, 1, clock()
            while True:  # every rank makes the same calls: the pilot ends by agreement
                for _ in range(batch):
                    call()
                k += batch
                spent = w.allreduce(clock() - t0, op=MPI.MAX)
                if k >= 3 and spent >= 0.1:
                    break
                batch *= 2
            per[s.label] = spent / k
        calls = {lab: max(1, min(10_000, round(args.block_time / t))) for lab, t in per.items()}
        nbytes = input_bytes(case)
        before = tuned_calls(comm, coll, nbytes)
        times: dict[str, list[float]] = {s.label: [] for s in systems}
        for rnd in range(args.rounds):
            order = list(systems)
            random.Random(f"{coll} {case.size} {rnd}").shuffle(order)
            for s in order:
                call, k = prep[s.label].call, calls[s.label]
                for _ in range(args.warm):
                    call()
                w.Barrier()
                t0 = clock()
                for _ in range(k):
                    call()
                t = w.allreduce((clock() - t0) / k, op=MPI.MAX)
                times[s.label].append(t * 1e6)
        after = tuned_calls(comm, coll, nbytes)
        ran = {a: c - before.get(a, 0) for a, c in after.items() if c - before.get(a, 0)}
        if not ran:  # untuned: auto runs its model's pick
            ran = {
                comm._policy.algorithm(coll, "auto", nbytes): args.rounds
                * calls.get("pycoll:auto", 0)
            }
        for s in systems:  # and once more after the rounds
            wrong[s.label] += _check(w, prep[s.label], ref, case)
        for s in systems:
            lab = s.label
            ratio = [t / f for t, f in zip(times[lab], times[first], strict=True)]
            med = statistics.median(ratio)
            total_wrong += wrong[lab]
            if med < 1 / 1.1:
                misses.append(f"{case.size} B: {s.algorithm or s.kind} {1 / med:.2f}x")
                missed.add(case.size)
            what = ""
            if lab == "pycoll:auto":
                what = ", ".join(f"{a} {c}" for a, c in sorted(ran.items(), key=lambda x: -x[1]))
            if wrong[lab]:
                what += f"  #wrong {wrong[lab]}"
            row = (
                f"{case.size:>12} {lab.removeprefix('pycoll:'):>{wide}} {calls[lab]:>6} "
                f"{statistics.median(times[lab]):>10.2f} {med:>8.3f} "
                f"{_pct(ratio, 10):>6.3f} {_pct(ratio, 90):>6.3f}  {what}"
            )
            say(row.rstrip())
            for rnd, t in enumerate(times[lab]):
                records.append(
                    {
                        "collective": coll,
                        "size": case.size,
                        "nranks": n,
                        "system": s.kind,
                        "algorithm": s.algorithm or None,
                        "round": rnd,
                        "calls": calls[lab],
                        "time_us": t,
                        "ratio": ratio[rnd],
                        "wrong": wrong[lab],
                        "auto_ran": ran if lab == "pycoll:auto" else None,
                        "dtype": dname,
                        "op": args.op,
                        "host": meta["host"],
                        "date": meta["date"],
                    }
                )
    hits = len(args.sizes) - len(missed)
    say(
        f"# {short} within 10% of every other system at {hits} of "
        f"{len(args.sizes)} sizes" + (f"; faster by more: {'; '.join(misses)}" if misses else "")
    )
    say(f"# Out of bounds values : {total_wrong} {'OK' if total_wrong == 0 else 'FAILED'}")
    comm.close()
    if rank == 0 and args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        doc = {"meta": {**meta, "argv": sys.argv, "nranks": n}, "records": records}
        Path(args.json).write_text(json.dumps(doc, indent=1))
        say(f"# wrote {len(records)} records to {args.json}")
    return records


def main(argv: list[str] | None = None) -> int:
    records = run_or_abort(run, parse_args(argv))
    return 1 if any(r["wrong"] for r in records) else 0


if __name__ == "__main__":
    sys.exit(main())
