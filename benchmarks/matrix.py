"""pycoll's ``auto`` against MPI, by collective and size: the "ahead of MPI at
every size" matrix.

Run under mpiexec; rank 0 prints::

    mpiexec -n 2 python benchmarks/matrix.py
    mpiexec -n 4 python benchmarks/matrix.py --json out/matrix_n4.json
    mpiexec -n 2 python benchmarks/matrix.py --sizes 8,1K --collectives allreduce
    mpiexec -n 2 python benchmarks/matrix.py --gloo --json out/matrix_gloo_n2.json

Cells are **MPI time / pycoll time**: above 1 pycoll is faster.

What runs: pycoll's ``comm.<collective>(..., algorithm="auto")`` and mpi4py's
``Allreduce``, ``Allgather``, ``Bcast`` and ``Reduce_scatter_block`` (the calls
of ``sweep.py``; out of place, broadcast in place from root 0, op sum), for
allreduce, allgather, broadcast and reduce_scatter at 8 B, 1 KiB, 64 KiB,
1 MiB, 16 MiB and 128 MiB (nccl-tests' sizes, as in sweep.py: the output of
allgather and gather, the input of reduce_scatter and scatter).  ``--collectives
all`` adds reduce, alltoall, gather and scatter (``Reduce``, ``Alltoall``,
``Gather``, ``Scatter``; root 0).  Both systems work on the very same
float32 arrays, allocated as a user's script would: inputs by
``numpy.random.Generator.standard_normal``, outputs by ``np.empty`` (no
page alignment, no huge-page policy: ``hostmem`` is not used).

How it times (``versus.py``'s machinery), for each collective and size:

1. A pilot: each system calls back to back for about 0.1 s (at least 3 calls);
   its time per call on the slowest rank sets the calls per block, about
   ``--block-time`` (50 ms) of calls, 1 to 10000.
2. ``--rounds`` (7) rounds; in each, the two systems take one block each, in an
   order shuffled anew each round (the same on every rank).  A block is
   ``--warm`` (3) untimed calls (no more than the shorter of the two blocks
   has calls), an MPI barrier, then the block's calls back to back; its time
   is the mean per call, the maximum over ranks.
3. A system's time is the median over rounds of its block times; the cell is
   MPI's over pycoll's.  The JSON also has each round's pair and the ratio's
   10th and 90th percentile over rounds, and each rank's fraction of the
   buffers on huge pages (``hugepage_frac``; column ``huge``): a cross-memory
   copy, which both systems use from about 256 KiB, runs at 2-3x the rate
   when the other side's pages are huge (benchmarks/RESULTS.md).

``--gloo`` adds torch.distributed's Gloo (``all_reduce``,
``all_gather_into_tensor``, ``broadcast``, ``reduce_scatter_tensor``,
``reduce``, ``all_to_all_single``, ``gather``, ``scatter``) on the same arrays,
a third system in the shuffled order: its cells are **Gloo time / pycoll
time**.  Gloo's ranks sleep between calls, so the block after a Gloo block
warms up for at least ``--settle`` seconds (as in ``versus.py``).

Each system's output is checked against NumPy before the rounds and after
them (poisoned first; reductions to a relative 1e-5, since the order of the
additions differs): ``#wrong`` counts elements over all ranks.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import fmt_size, geometry, host_meta, parse_size, run_or_abort
from exchanges import holds
from hostmem import hugepage_fraction
from sweep import Buffers, Case, Prepared, Runner, System, input_bytes, tuned_calls
from versus import alternate, block_calls, pilot

#: the four of the first matrix (the default), then the rest of the rooted and
#: personalized collectives (``--collectives all``)
COLLECTIVES = ("allreduce", "allgather", "broadcast", "reduce_scatter")
MORE = ("reduce", "alltoall", "gather", "scatter")
SIZES = "8,1K,64K,1M,16M,128M"
DTYPE = np.dtype(np.float32)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        description="pycoll auto against MPI by collective and size (run under mpiexec)",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--sizes", default=SIZES, help=f"comma list of sizes (default {SIZES})")
    ap.add_argument(
        "--collectives",
        default=",".join(COLLECTIVES),
        help=f"comma list of {', '.join(COLLECTIVES + MORE)}, or all (default the first four)",
    )
    ap.add_argument("--rounds", type=int, default=7, help="blocks per system (default 7)")
    ap.add_argument(
        "--block-time", type=float, default=0.05, help="seconds of calls per block (0.05)"
    )
    ap.add_argument("--warm", type=int, default=3, help="untimed calls before each block (3)")
    ap.add_argument("--transport", default=None, help="pycoll transports, e.g. shm")
    ap.add_argument(
        "--persistent",
        action="store_true",
        help="time pycoll's prepared calls (comm.prepare) against MPI's plain calls and "
        "MPI 4's persistent ones (Allreduce_init, ...)",
    )
    ap.add_argument(
        "--gloo",
        action="store_true",
        help="also time torch.distributed's Gloo on the same arrays (xgloo = Gloo time / "
        "pycoll time)",
    )
    ap.add_argument(
        "--settle",
        type=float,
        default=0.25,
        help="after a Gloo block, the next block warms up at least this many seconds (0.25)",
    )
    ap.add_argument("--json", default=None, help="write the matrix and every block here")
    a = ap.parse_args(argv)
    try:
        a.sizes = [parse_size(s) for s in a.sizes.split(",") if s.strip()]
    except (ValueError, ArithmeticError):
        ap.error(f"--sizes {a.sizes!r}: a comma list of sizes (8, 1K, 16M)")
    a.collectives = [c.strip() for c in a.collectives.split(",") if c.strip()]
    if a.collectives == ["all"]:
        a.collectives = list(COLLECTIVES + MORE)
    for c in a.collectives:
        if c not in COLLECTIVES + MORE:
            ap.error(f"--collectives: {c!r} is not one of {', '.join(COLLECTIVES + MORE)}")
    if a.persistent and set(a.collectives) - {*COLLECTIVES, "reduce"}:
        ap.error("--persistent: the first five collectives (no MPI persistent form of the rest)")
    if not a.sizes or any(s <= 0 for s in a.sizes) or not a.collectives:
        ap.error("--sizes and --collectives: at least one each, sizes above 0")
    if a.persistent and a.gloo:
        ap.error("--persistent and --gloo: one at a time (Gloo has no persistent calls)")
    if a.rounds < 1 or a.block_time <= 0 or a.warm < 0 or a.settle < 0:
        ap.error("--rounds must be >= 1, --block-time > 0, --warm >= 0, --settle >= 0")
    return a


def _input(rank: int, case: Case) -> np.ndarray:
    """Rank ``rank``'s input: standard normal float32 from a seed every rank knows."""
    which = (COLLECTIVES + MORE).index(case.collective)
    rng = np.random.default_rng([rank, which, case.size])
    return rng.standard_normal(case.send_count, dtype=DTYPE)


def _reference(case: Case, rank: int, n: int) -> np.ndarray | None:
    """NumPy's output on ``rank`` (sums in rank order); None where it has none."""
    c, root = case.collective, case.root
    if c == "broadcast":
        return _input(0, case)
    if c in ("allgather", "gather"):
        if c == "gather" and rank != root:
            return None
        return np.concatenate([_input(p, case) for p in range(n)])
    k = case.recv_count
    if c == "alltoall":
        k //= n
        return np.concatenate([_input(p, case)[rank * k : (rank + 1) * k] for p in range(n)])
    if c == "scatter":
        return _input(root, case)[rank * k : (rank + 1) * k]
    if c == "reduce" and rank != root:
        return None
    acc = _input(0, case)
    for p in range(1, n):
        acc += _input(p, case)
    if c == "reduce_scatter":
        return acc[rank * k : (rank + 1) * k]
    return acc


def _buffers(case: Case, rank: int) -> Buffers:
    """Plain NumPy arrays: the input from ``np.random``, the output ``np.empty``;
    None for a buffer the rank does not hold (gather's output off the root,
    scatter's input)."""
    x = _input(rank, case)
    if case.collective == "broadcast":
        return Buffers(x, x, np)
    has_send, has_recv = holds(case.collective, rank, case.root)
    return Buffers(
        x if has_send else None, np.empty(case.recv_count, DTYPE) if has_recv else None, np
    )


def _poison_outputs(case: Case, bufs: Buffers, rank: int) -> None:
    """Poison where the output lands (a broadcast's non-root buffers), inputs kept."""
    if case.collective != "broadcast":
        if bufs.recv is not None:
            bufs.poison(bufs.recv)
    elif rank != case.root:
        bufs.poison(bufs.send)


def _prepare(runner: Runner, system: System, case: Case, bufs: Buffers, load: Any) -> Prepared:
    """``system``'s call on the shared arrays, whose outputs ``load`` poisons
    before a check.  But Gloo's allreduce and reduce work in place: each rank's
    call gets an array of its own (off the root too, where a reduce needs one),
    which a check fills with the input, since a poisoned one would be reduced."""
    from dataclasses import replace

    if system.kind == "gloo" and case.collective in ("allreduce", "reduce"):
        mine = Buffers(bufs.send, np.empty(case.send_count, DTYPE), np)

        def fill() -> None:
            np.copyto(mine.recv, mine.send)

        return replace(runner.prepare(system, case, mine), load=fill)
    return replace(runner.prepare(system, case, bufs), load=load)


def _wrong(w: Any, p: Prepared, ref: np.ndarray | None) -> int:
    """Call once on poisoned outputs; elements off NumPy's, summed over ranks."""
    from mpi4py import MPI

    p.load()
    p.call()
    bad = 0
    if ref is not None:
        got = np.asarray(p.output()).reshape(-1)
        bad = int(np.count_nonzero(~np.isclose(got, ref, rtol=1e-5, atol=1e-5)))
    return int(w.allreduce(bad, op=MPI.SUM))


def _cell(x: float | None) -> str:
    return f"{x:>8.2f}" if x is not None else f"{'-':>8}"


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    from mpi4py import MPI

    import pycoll

    w = MPI.COMM_WORLD
    rank, n = w.Get_rank(), w.Get_size()

    def say(msg: str) -> None:
        if rank == 0:
            print(msg, flush=True)

    cfg: dict[str, Any] = {}
    if args.transport:
        cfg["transports"] = tuple(t.strip() for t in args.transport.split(",") if t.strip())
    comm = pycoll.init(w, **cfg)
    kinds = sorted({comm.transport_of(p) for p in range(n) if p != rank} or {"self"})
    transport = "+".join(sorted({k for ks in w.allgather(kinds) for k in ks}))
    runner = Runner(args, w, comm, np)
    systems = [System("pycoll", "auto"), System("mpi")]
    ours_label = "pycoll:auto"
    if args.persistent:
        systems = [
            System("pycoll-prepared"),
            System("pycoll", "auto"),
            System("mpi"),
            System("mpi-persistent"),
        ]
        ours_label = "pycoll-prepared"
    gloo = False
    if args.gloo:
        why = runner.init_torch(False, False)
        if why:
            say(f"# gloo: skipped: {why}")
        else:
            systems.append(System("gloo"))
            gloo = True
    sleepers = frozenset({"gloo"} if gloo else ())
    meta = host_meta()
    say(
        f"# matrix: pycoll {'prepared calls' if args.persistent else 'auto'} against MPI"
        f"{' (plain and persistent calls)' if args.persistent else ''}"
        f"{' and Gloo' if gloo else ''}, n = {n}, "
        f"transport {transport}, float32, "
        f"{args.rounds} rounds of one block of about {args.block_time * 1e3:g} ms per "
        "system, a new order each round"
    )
    say(
        "# time: median over rounds of the block's per-call mean on the slowest rank; "
        "xmpi = MPI time / pycoll time (above 1: pycoll faster), p10 p90 of it per round; "
        f"{'xgloo = Gloo time / pycoll time; ' if gloo else ''}"
        "huge: the fraction of each rank's buffers on huge pages"
    )
    gloo_head = f" {'gloo(us)':>10} {'xgloo':>7}" if gloo else ""
    say(
        f"#{'collective':>15} {'size':>10} {'pycoll(us)':>11} {'mpi(us)':>10} {'xmpi':>7} "
        f"{'p10':>6} {'p90':>6}{gloo_head} {'#wrong':>6}  {'huge':>14}  auto ran"
    )
    records: list[dict[str, Any]] = []
    cells: list[dict[str, Any]] = []
    total_wrong = 0
    for coll in args.collectives:
        for asked in args.sizes:
            sc, rc, tc = geometry(coll, asked, DTYPE.itemsize, n)
            nbytes = max(sc, rc) * DTYPE.itemsize  # nccl-tests' size: the larger buffer
            case = Case(coll, nbytes, sc, rc, tc, DTYPE, "float32", "sum", 0, False)
            bufs = _buffers(case, rank)
            ref = _reference(case, rank, n)
            load = lambda case=case, bufs=bufs: _poison_outputs(case, bufs, rank)
            prep = {s.label: _prepare(runner, s, case, bufs, load) for s in systems}
            wrong = {lab: _wrong(w, p, ref) for lab, p in prep.items()}
            calls = {
                lab: (p.call, block_calls(pilot(w, p.call), args.block_time))
                for lab, p in prep.items()
            }
            nb = input_bytes(case)
            before = tuned_calls(comm, coll, nb)
            warm = min(args.warm, *(k for _, k in calls.values()))  # no more than a block
            secs, _ = alternate(
                w, calls, args.rounds, warm, f"matrix {coll} {nbytes}", args.settle, sleepers
            )
            after = tuned_calls(comm, coll, nb)
            ran = {a: c - before.get(a, 0) for a, c in after.items() if c - before.get(a, 0)}
            if not ran:  # untuned: auto runs its model's pick
                ran = {comm._policy.algorithm(coll, "auto", nb): 0}
            for lab, p in prep.items():
                wrong[lab] += _wrong(w, p, ref)
            # what the kernel put under the buffers (both systems use these):
            # a cross-memory copy's rate depends on the other side's kind of page
            frac = hugepage_fraction(*(b for b in (bufs.send, bufs.recv) if b is not None))
            fracs = w.allgather(frac)
            ours, theirs = secs[ours_label], secs["mpi"]
            persistent = plain = None
            if args.persistent:
                persistent = statistics.median(secs["mpi-persistent"]) * 1e6
                plain = statistics.median(secs["pycoll:auto"]) * 1e6
                runner.free_persistent()
            per_round = [m / o for m, o in zip(theirs, ours, strict=True)]
            t_ours, t_mpi = statistics.median(ours) * 1e6, statistics.median(theirs) * 1e6
            ratio = t_mpi / t_ours
            t_gloo = statistics.median(secs["gloo"]) * 1e6 if gloo else None
            gloo_cols = "" if t_gloo is None else f" {t_gloo:>10.2f} {t_gloo / t_ours:>7.3f}"
            bad = sum(wrong.values())
            total_wrong += bad
            p10, p90 = np.percentile(per_round, [10, 90])
            what = ", ".join(f"{a} {c}" if c else a for a, c in ran.items())
            huge = "/".join("-" if f is None else f"{f:.2f}" for f in fracs)
            extra = (
                ""
                if persistent is None
                else f"  mpi-persistent {persistent:.2f} us, pycoll plain {plain:.2f} us"
            )
            say(
                f" {coll:>15} {nbytes:>10} {t_ours:>11.2f} {t_mpi:>10.2f} {ratio:>7.3f} "
                f"{p10:>6.3f} {p90:>6.3f}{gloo_cols} {bad:>6}  {huge:>14}  {what}{extra}"
            )
            cells.append(
                {
                    "collective": coll,
                    "size_asked": asked,
                    "size": nbytes,
                    "pycoll_us": t_ours,
                    "mpi_us": t_mpi,
                    "ratio": ratio,
                    "ratio_p10": float(p10),
                    "ratio_p90": float(p90),
                    "wrong": bad,
                    "calls": {lab: k for lab, (_, k) in calls.items()},
                    "auto_ran": ran,
                    "hugepage_frac": fracs,
                    "mpi_persistent_us": persistent,
                    "pycoll_plain_us": plain,
                    "gloo_us": t_gloo,
                    "ratio_gloo": None if t_gloo is None else t_gloo / t_ours,
                }
            )
            for lab, ts in secs.items():
                for rnd, t in enumerate(ts):
                    records.append(
                        {
                            "collective": coll,
                            "size": nbytes,
                            "nranks": n,
                            "system": lab
                            if lab.startswith("pycoll-") or not lab.startswith("pycoll")
                            else "pycoll",
                            "round": rnd,
                            "calls": calls[lab][1],
                            "time_us": t * 1e6,
                            "wrong": wrong[lab],
                        }
                    )
            del prep, calls, bufs, ref, load
    say("#")
    say(f"# MPI time / pycoll time, n = {n} (above 1: pycoll faster)")
    say(f"#{'collective':>15}" + "".join(f"{fmt_size(s):>8}" for s in args.sizes))
    by = {(c["collective"], c["size_asked"]): c["ratio"] for c in cells}
    for coll in args.collectives:
        say(f" {coll:>15}" + "".join(_cell(by.get((coll, s))) for s in args.sizes))
    if args.persistent:
        say(f"# MPI persistent time / pycoll prepared time, n = {n}")
        byp = {
            (c["collective"], c["size_asked"]): c["mpi_persistent_us"] / c["pycoll_us"]
            for c in cells
        }
        for coll in args.collectives:
            say(f" {coll:>15}" + "".join(_cell(byp.get((coll, s))) for s in args.sizes))
    if gloo:
        say(f"# Gloo time / pycoll time, n = {n}")
        byg = {(c["collective"], c["size_asked"]): c["ratio_gloo"] for c in cells}
        for coll in args.collectives:
            say(f" {coll:>15}" + "".join(_cell(byg.get((coll, s))) for s in args.sizes))
    ahead = sum(c["ratio"] > 1 for c in cells)
    say(f"# pycoll ahead in {ahead} of {len(cells)} cells")
    if gloo:
        ahead_g = sum(c["ratio_gloo"] > 1 for c in cells)
        say(f"# pycoll ahead of Gloo in {ahead_g} of {len(cells)} cells")
    say(f"# Out of bounds values : {total_wrong} {'OK' if total_wrong == 0 else 'FAILED'}")
    if gloo:
        runner.dist.destroy_process_group()
    comm.close()
    if rank == 0 and args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        doc = {
            "meta": {**meta, "argv": sys.argv, "nranks": n, "transport": transport},
            "matrix": cells,
            "records": records,
        }
        Path(args.json).write_text(json.dumps(doc, indent=1))
        say(f"# wrote {len(cells)} cells and {len(records)} blocks to {args.json}")
    return cells


def main(argv: list[str] | None = None) -> int:
    cells = run_or_abort(run, parse_args(argv))
    return 1 if any(c["wrong"] for c in cells) else 0


if __name__ == "__main__":
    sys.exit(main())
