"""Head to head: a few systems at a few sizes, taking turns every few milliseconds.

Run under mpiexec; rank 0 prints::

    mpiexec -n 3 python benchmarks/versus.py reduce 512K 2M --systems auto,direct,tree
    mpiexec -n 2 python benchmarks/versus.py allreduce 2M --systems auto,direct,oneshot,mpi
    mpiexec -n 4 python benchmarks/versus.py alltoall 1M 4M 16M --systems auto,mpi,gloo --rounds 11
    mpiexec -n 2 python benchmarks/versus.py pingpong 8 1K 1M 16M --systems pycoll,mpi
    git show REV:pycoll/algorithms/direct.py > /tmp/direct_rev.py
    mpiexec -n 2 python benchmarks/versus.py allgather 4M --systems direct,direct@direct_rev,mpi \\
        --algorithms-from /tmp/direct_rev.py

``sweep.py`` times each system for up to ``--max-time`` seconds in turn.  On a
shared VM the machine's state moves over such spans (and, where ranks outnumber
cores, the scheduler's placement can hold for most of a second), so the same
code measured twice in one repetition can land more than 10% apart.  Here the
systems take turns in short blocks (about ``--block-time`` seconds of calls
each, after ``--warm`` untimed calls), in a new order each round, and each
system's time in a round is compared with the first system's time in the same
round.  A slow spell then falls on every system alike, and the ratio's spread
over the rounds says how far one run can be trusted.  A block right after a
Gloo block warms up for at least ``--settle`` seconds (Gloo's ranks sleep
between calls, and the calls after them ran up to 2x slower for 100-250 ms;
see sweep.py).

Columns, per size and system: calls per block, the median over rounds of the
per-call mean on the slowest rank (us), and that time over the first system's
in the same round: median, 10th and 90th percentile over rounds.  For ``auto``
the last column is what it ran (its tuner, :mod:`pycoll.tune`, may time
contenders as it goes).  Systems: ``auto``, any algorithm of the collective,
``mpi`` (host buffers), ``gloo`` (torch.distributed) and ``torch-pycoll``
(torch.distributed over a ``"pycoll"`` group).  Every system's output
is checked once against the NumPy reference before the rounds, and again after
them.  Sizes are nccl-tests' (see sweep.py): for alltoall each rank's send and
receive buffer, for gather the root's output, for scatter the root's input, for
sendrecv the message each rank sends to rank + 1.

``pingpong`` times point-to-point instead (``pingpong.py``): rank 0 sends
``size`` bytes to rank 1 and waits for them to come back (at n > 2 the other
ranks idle); systems ``pycoll`` (``send``/``recv``), ``mpi`` and ``gloo``.
``time(us)`` is half the round trip and ``GB/s`` is size / that time.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

import pingpong
from common import (
    COLLECTIVES,
    EXCHANGES,
    OPS,
    Skip,
    geometry,
    host_meta,
    parse_dtype,
    parse_size,
    run_or_abort,
)
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

BASELINES = ("mpi", "gloo", "torch-pycoll")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        description="systems head to head in short alternating blocks (run under mpiexec)",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument(
        "collective",
        choices=(*COLLECTIVES, *EXCHANGES, "pingpong"),
        help="a collective, or pingpong (rank 0 to rank 1 and back)",
    )
    ap.add_argument("sizes", nargs="+", help="nccl-tests sizes in bytes (8, 512K, 2M)")
    ap.add_argument(
        "--systems",
        default=None,
        help="comma list: auto, algorithm names, mpi, gloo; all = auto and every "
        "algorithm (default auto,direct); pingpong: pycoll, mpi, gloo (default pycoll,mpi)",
    )
    ap.add_argument("--rounds", type=int, default=41, help="rounds (every system once each)")
    ap.add_argument("--block-time", type=float, default=0.01, help="seconds of calls per block")
    ap.add_argument("--warm", type=int, default=3, help="untimed calls before each block")
    ap.add_argument(
        "--settle",
        type=float,
        default=0.25,
        help="after a Gloo block, the next block warms up at least this many seconds",
    )
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
    if a.systems is None:
        a.systems = "pycoll,mpi" if a.collective == "pingpong" else "auto,direct"
    a.systems = [s.strip().lower() for s in a.systems.split(",") if s.strip()]
    if a.rounds < 1 or a.block_time <= 0 or a.warm < 0 or a.settle < 0:
        ap.error("--rounds must be >= 1, --block-time > 0, --warm >= 0, --settle >= 0")
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


def pilot(w: Any, call: Callable[[], Any]) -> float:
    """Seconds per call on the slowest rank, from about a tenth of a second of
    calls (at least 3); every rank makes the same calls, so it ends by agreement."""
    from mpi4py import MPI

    k, batch, t0 = 0, 1, time.perf_counter()
    while True:
        for _ in range(batch):
            call()
        k += batch
        spent = w.allreduce(time.perf_counter() - t0, op=MPI.MAX)
        if k >= 3 and spent >= 0.1:
            return spent / k
        batch *= 2


def block_calls(per_call: float, block_time: float) -> int:
    """Calls in a block of about ``block_time`` seconds (1 to 10000)."""
    return max(1, min(10_000, round(block_time / per_call)))


def warm_up(w: Any, call: Callable[[], Any], warm: int, settle: float) -> bool:
    """``warm`` untimed calls, and more in batches until ``settle`` seconds have
    passed on the slowest rank; True where it settled."""
    from mpi4py import MPI

    t0 = time.perf_counter()
    for _ in range(warm):
        call()
    if settle <= 0:
        return False
    while w.allreduce(time.perf_counter() - t0, op=MPI.MAX) < settle:
        for _ in range(max(1, warm)):
            call()
    return True


def median_times(
    w: Any,
    calls: dict[str, Callable[[], Any]],
    block_time: float,
    rounds: int,
    warm: int,
    seed: str,
) -> dict[str, float]:
    """Per label, the median over ``rounds`` of its block's per-call time on the
    slowest rank, in microseconds: a pilot sets each system's calls per block
    (about ``block_time`` seconds), then :func:`alternate`."""
    per = {name: block_calls(pilot(w, c), block_time) for name, c in calls.items()}
    times, _ = alternate(w, {name: (c, per[name]) for name, c in calls.items()}, rounds, warm, seed)
    return {name: statistics.median(t) * 1e6 for name, t in times.items()}


def alternate(
    w: Any,
    calls: dict[str, tuple[Callable[[], Any], int]],
    rounds: int,
    warm: int,
    seed: str,
    settle: float = 0.0,
    sleepers: frozenset[str] = frozenset(),
) -> tuple[dict[str, list[float]], dict[str, list[bool]]]:
    """Time every system in blocks, a new order each round.

    Args:
        calls: per label, the call and the calls per block.
        seed: the shuffle's seed (the same on every rank).
        settle: seconds the block after one of ``sleepers`` warms up at least.

    Returns:
        Per label, per round: the per-call mean of the block on the slowest rank
        (seconds), and whether that block settled.
    """
    from mpi4py import MPI

    labels = list(calls)
    times: dict[str, list[float]] = {lab: [] for lab in labels}
    settled: dict[str, list[bool]] = {lab: [] for lab in labels}
    clock = time.perf_counter
    after_sleeper = False
    for rnd in range(rounds):
        order = list(labels)
        random.Random(f"{seed} {rnd}").shuffle(order)
        for lab in order:
            call, k = calls[lab]
            pause = settle if after_sleeper and lab not in sleepers else 0.0
            settled[lab].append(warm_up(w, call, warm, pause))
            after_sleeper = lab in sleepers
            w.Barrier()
            t0 = clock()
            for _ in range(k):
                call()
            times[lab].append(w.allreduce((clock() - t0) / k, op=MPI.MAX))
    return times, settled


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


def _systems(args: argparse.Namespace, reg: tuple[str, ...]) -> list[System]:
    """``--systems`` as System objects; SystemExit names one that is unknown."""
    if args.collective == "pingpong":
        for s in args.systems:
            if s not in pingpong.SYSTEMS:
                raise SystemExit(f"--systems: {s!r} is not one of {', '.join(pingpong.SYSTEMS)}")
        return [System(s) if s != "pycoll" else System("pycoll", "send/recv") for s in args.systems]
    if "all" in args.systems:  # auto and every algorithm, where "all" stands
        i = args.systems.index("all")
        more = [a for a in ("auto", *reg) if a not in args.systems]
        args.systems[i : i + 1] = more
    for s in args.systems:
        if s not in ("auto", *BASELINES, *reg):
            raise SystemExit(
                f"--systems: {s!r} is not auto, {', '.join(BASELINES)} or one of {', '.join(reg)}"
            )
    return [System(s) if s in BASELINES else System("pycoll", s) for s in args.systems]


def _pingpong_prepared(runner: Runner, system: System, case: Case, bufs: Any) -> Prepared:
    rank = runner.rank
    if system.kind == "gloo":
        if runner.dist is None:
            raise Skip("torch.distributed not initialised")
        send, recv = runner._tensor(bufs.send, case), runner._tensor(bufs.recv, case)
        handle: Any = runner.dist
    else:
        send, recv = bufs.send, bufs.recv
        handle = runner.comm if system.kind == "pycoll" else runner.mpi
    call = pingpong.calls(system.kind, handle, send, recv, rank)

    def load() -> None:
        pingpong.load(bufs.send, bufs.recv, rank, case.dtype, bufs.poison)

    return Prepared(call, load, lambda: pingpong.landed(bufs.send, bufs.recv, rank))


def _prepare(
    w: Any, runner: Runner, systems: list[System], case: Case, bufs: Any, ref: Any, say: Any
) -> tuple[dict[str, Prepared], dict[str, int]]:
    """Each system's call, checked once; a baseline that cannot run this case
    (any rank's reason) is left out with a line, as the sweep does."""
    prep: dict[str, Prepared] = {}
    wrong: dict[str, int] = {}
    for s in systems:
        err = ""
        p: Prepared | None = None
        try:
            if case.collective == "pingpong":
                p = _pingpong_prepared(runner, s, case, bufs)
            else:
                p = runner.prepare(s, case, bufs)
            p.load()
            p.call()
        except Exception as exc:
            if s.kind == "pycoll" and not isinstance(exc, Skip):
                raise
            err = str(exc) if isinstance(exc, Skip) else f"{type(exc).__name__}: {exc}"
            err = err.splitlines()[0][:120] if err else type(exc).__name__
        err = next((e for e in w.allgather(err) if e), "")
        if err:
            say(f"# {s.label.removeprefix('pycoll:')}: skipped at {case.size} B: {err}")
            continue
        assert p is not None
        prep[s.label] = p
        wrong[s.label] = _check(w, p, ref, case)
    return prep, wrong


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
    ping = coll == "pingpong"
    for path in args.algorithms_from:
        load_algorithms(path)
    reg = () if ping else algorithms.names(coll)
    systems = _systems(args, reg)
    if ping and n < 2:
        raise SystemExit("pingpong needs at least 2 ranks")
    if not 0 <= args.root < n:
        raise SystemExit(f"--root {args.root} is not in [0, {n})")
    dtype, dname, _ = parse_dtype(args.datatype)
    cfg: dict[str, Any] = {}
    if args.transport:
        cfg["transports"] = tuple(t.strip() for t in args.transport.split(",") if t.strip())
    comm = pycoll.init(w, **cfg)
    runner = Runner(args, w, comm, np)
    if any(s.kind in ("gloo", "torch-pycoll") for s in systems):
        why = runner.init_torch(False, any(s.kind == "torch-pycoll" for s in systems))
        if why:
            say(f"# gloo, torch-pycoll: skipped: {why}")
            systems = [s for s in systems if s.kind not in ("gloo", "torch-pycoll")]
    if not systems:
        raise SystemExit("--systems: none of them can run here")
    first = systems[0].label
    names = {s.label: s.label.removeprefix("pycoll:") for s in systems}
    if ping:
        names = {s.label: s.kind for s in systems}
    wide = max(10, *(len(v) for v in names.values()))
    short = names[first]
    meta = host_meta()
    what = "pingpong rank 0 <-> 1" if ping else f"{coll} {dname} {args.op}"
    say(
        f"# versus: {what}, n = {n}, {args.rounds} rounds of blocks of "
        f"about {args.block_time * 1e3:g} ms after {args.warm} untimed calls, "
        "a new order each round"
    )
    if ping:
        say(f"# time: half the round trip, median over rounds; GB/s: size / time; x{short}:")
    else:
        say(f"# time: median over rounds of the per-call mean on the slowest rank; x{short}:")
    say(f"# that time over {short}'s in the same round (median, 10th and 90th percentile)")
    bw_head = f" {'GB/s':>8}" if ping else ""
    say(
        f"#{'size':>11} {'system':>{wide}} {'calls':>6} {'time(us)':>10}{bw_head} "
        f"{'x' + short:>8} {'p10':>6} {'p90':>6}" + ("" if ping else "  ran")
    )
    records: list[dict[str, Any]] = []
    total_wrong = 0
    misses: list[str] = []  # systems that beat the first by more than 10%, and where
    missed: set[int] = set()  # the sizes of those
    sleepers = frozenset(s.label for s in systems if s.kind == "gloo")
    for size in args.sizes:
        sc, rc, tc = geometry(coll, size, dtype.itemsize, n)
        nbytes = max(sc, rc) * dtype.itemsize  # nccl-tests' size: the larger buffer
        case = Case(coll, nbytes, sc, rc, tc, dtype, dname, args.op, args.root, False)
        bufs = make_buffers(case, np, args.hugepages, rank)
        ref = pingpong.reference(sc, rank, dtype) if ping else expected(case, rank, n)
        # inputs stay as loaded: every call reads the same send buffer (broadcast
        # rewrites the root's data with itself)
        prep, wrong = _prepare(w, runner, systems, case, bufs, ref, say)
        if first not in prep:
            raise SystemExit(f"{short} cannot run at {case.size} B: nothing to compare with")
        calls = {
            lab: (p.call, block_calls(pilot(w, p.call), args.block_time)) for lab, p in prep.items()
        }
        in_bytes = input_bytes(case)
        before = tuned_calls(comm, coll, in_bytes) if reg else {}
        secs, settled = alternate(
            w, calls, args.rounds, args.warm, f"{coll} {case.size}", args.settle, sleepers
        )
        half = 0.5 if ping else 1.0  # a ping-pong call is a round trip
        times = {lab: [t * 1e6 * half for t in ts] for lab, ts in secs.items()}
        ran: dict[str, int] = {}
        if reg:
            after = tuned_calls(comm, coll, in_bytes)
            ran = {a: c - before.get(a, 0) for a, c in after.items() if c - before.get(a, 0)}
            if not ran and "pycoll:auto" in calls:  # untuned: auto runs its model's pick
                pick = comm._policy.algorithm(coll, "auto", in_bytes)
                ran = {pick: args.rounds * calls["pycoll:auto"][1]}
        for lab, p in prep.items():  # and once more after the rounds
            wrong[lab] += _check(w, p, ref, case)
        for s in systems:
            lab = s.label
            if lab not in prep:
                continue
            ratio = [t / f for t, f in zip(times[lab], times[first], strict=True)]
            med = statistics.median(ratio)
            t_med = statistics.median(times[lab])
            total_wrong += wrong[lab]
            if med < 1 / 1.1:
                misses.append(f"{case.size} B: {names[lab]} {1 / med:.2f}x")
                missed.add(case.size)
            note = ""
            if lab == "pycoll:auto" and ran:
                note = ", ".join(f"{a} {c}" for a, c in sorted(ran.items(), key=lambda x: -x[1]))
            if wrong[lab]:
                note += f"  #wrong {wrong[lab]}"
            bw = f" {case.size / t_med / 1e3:>8.3f}" if ping else ""
            row = (
                f"{case.size:>12} {names[lab]:>{wide}} {calls[lab][1]:>6} "
                f"{t_med:>10.2f}{bw} {med:>8.3f} "
                f"{_pct(ratio, 10):>6.3f} {_pct(ratio, 90):>6.3f}  {note}"
            )
            say(row.rstrip())
            for rnd, t in enumerate(times[lab]):
                rec = {
                    "collective": coll,
                    "size": case.size,
                    "count": case.count,
                    "nranks": n,
                    "system": s.kind,
                    "algorithm": (s.algorithm or None) if not ping else None,
                    "round": rnd,
                    "calls": calls[lab][1],
                    "settled": settled[lab][rnd],
                    "time_us": t,
                    "ratio": ratio[rnd],
                    "wrong": wrong[lab],
                    "auto_ran": ran if lab == "pycoll:auto" else None,
                    "dtype": dname,
                    "op": args.op,
                    "root": args.root,
                    "host": meta["host"],
                    "date": meta["date"],
                }
                if ping:
                    rec["bw_GBps"] = case.size / t / 1e3
                records.append(rec)
    hits = len(args.sizes) - len(missed)
    say(
        f"# {short} within 10% of every other system at {hits} of "
        f"{len(args.sizes)} sizes" + (f"; faster by more: {'; '.join(misses)}" if misses else "")
    )
    say(f"# Out of bounds values : {total_wrong} {'OK' if total_wrong == 0 else 'FAILED'}")
    if runner.dist is not None:
        runner.dist.destroy_process_group()
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
