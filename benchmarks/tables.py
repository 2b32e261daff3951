"""Markdown tables for RESULTS.md from sweep.py JSON files.

::

    python benchmarks/tables.py results/sweep_n2.json results/sweep_n4.json results/allreduce256M_n*.json

pycoll's figure in each row is ``auto`` (what a user gets): measured as a system
of its own where the sweep timed it (``--algorithm all`` does, since ``auto`` may
run several algorithms, see ``pycoll/tune.py``), else the algorithm the cost
model picks (``auto_choice``); next to the best measured algorithm.  ``x MPI`` / ``x Gloo`` are baseline time /
pycoll time: above 1 pycoll is faster.  Times are medians over repetitions.

The table of ``auto`` against the best judges three ways: by the mean time per
call (nccl-tests' ``time``), each a median over repetitions; by the median time
per call (the slowest rank's), which a preempted call does not move (on the
2-core machine one stall in a loop of small calls doubles a mean); and *per
repetition*: the median over repetitions of auto's per-call median / each
algorithm's in the same repetition, where every system takes one turn, so a
spell of the machine that slows the whole repetition cancels out.  Its misses
are listed.  The last table, the same code measured twice, is the noise of one
point in each of these ways.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any


def load(paths: list[str]) -> list[dict[str, Any]]:
    recs: list[dict[str, Any]] = []
    for p in paths:
        recs.extend(json.loads(Path(p).read_text())["records"])
    return recs


def index(recs: list[dict[str, Any]]) -> dict[tuple, dict[str, dict[str, Any]]]:
    """(collective, n, size) -> system label -> record with median time."""
    by: dict[tuple, dict[str, list[dict[str, Any]]]] = defaultdict(lambda: defaultdict(list))
    for r in recs:
        label = f"pycoll:{r['algorithm']}" if r["system"] == "pycoll" else r["system"]
        by[(r["collective"], r["nranks"], r["size"])][label].append(r)
    out: dict[tuple, dict[str, dict[str, Any]]] = {}
    for key, systems in by.items():
        out[key] = {}
        for label, rs in systems.items():
            m = dict(rs[0])
            m["time_us"] = statistics.median(x["time_us"] for x in rs)
            if all("time_us_median" in x for x in rs):
                m["time_us_median"] = statistics.median(x["time_us_median"] for x in rs)
            m["busbw"] = statistics.median(x["busbw"] for x in rs)
            out[key][label] = m
    return out


def by_rep(recs: list[dict[str, Any]]) -> dict[tuple, dict[str, dict[int, dict[str, Any]]]]:
    """(collective, n, size) -> pycoll algorithm -> repetition -> record."""
    out: dict[tuple, dict[str, dict[int, dict[str, Any]]]] = defaultdict(lambda: defaultdict(dict))
    for r in recs:
        if r["system"] == "pycoll":
            out[(r["collective"], r["nranks"], r["size"])][r["algorithm"]][r["rep"]] = r
    return out


def paired(a: dict[int, dict[str, Any]], b: dict[int, dict[str, Any]]) -> float:
    """The median over repetitions of a's per-call median / b's, in the
    repetitions that timed both (nan where none did)."""
    reps = sorted(set(a) & set(b))
    if not reps or not all("time_us_median" in x[r] for x in (a, b) for r in reps):
        return float("nan")
    return statistics.median(a[r]["time_us_median"] / b[r]["time_us_median"] for r in reps)


#: The ways the auto table and the same-code table judge, in their order.
WAYS = ("by mean", "by per-call median", "per repetition")


def same_code(
    reps: dict[tuple, dict[str, dict[int, dict[str, Any]]]],
) -> dict[str, dict[int, list[float]]]:
    """way -> n -> auto's time / its model's pick's time at each point where
    ``auto`` tuned nothing (so ran the same code): how far apart a point puts one
    algorithm measured twice, judged each way of :data:`WAYS`; ``reps`` is
    :func:`by_rep`'s."""
    out: dict[str, dict[int, list[float]]] = {w: defaultdict(list) for w in WAYS}
    for (_, n, _), algos in sorted(reps.items()):
        auto = algos.get("auto")
        if not auto or any(r.get("auto_ran") for r in auto.values()):
            continue
        twin = algos.get(next(iter(auto.values()))["auto_choice"])
        if not twin:
            continue
        for w, key in zip(WAYS[:2], ("time_us", "time_us_median"), strict=True):
            if all(key in r for r in (*auto.values(), *twin.values())):
                a_ = statistics.median(r[key] for r in auto.values())
                out[w][n].append(a_ / statistics.median(r[key] for r in twin.values()))
        p = paired(auto, twin)
        if p == p:
            out[WAYS[2]][n].append(p)
    return out


def pick(systems: dict[str, dict[str, Any]]) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
    """(auto's record, best record of a named algorithm)."""
    py = {k: v for k, v in systems.items() if k.startswith("pycoll:")}
    named = [v for k, v in py.items() if k != "pycoll:auto"]
    if not named:
        return None, None
    best = min(named, key=lambda r: r["time_us"])
    auto = py.get("pycoll:auto")
    if auto is None:
        choice = next(iter(py.values()))["auto_choice"]
        auto = py.get(f"pycoll:{choice}")
    return auto, best


def fmt_size(n: int) -> str:
    for unit, m in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= m:
            return f"{n / m:g} {unit}"
    return f"{n} B"


def ratio(base: dict[str, Any] | None, mine: dict[str, Any]) -> str:
    return f"{base['time_us'] / mine['time_us']:.2f}" if base else "-"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("json", nargs="+")
    ap.add_argument("--min-bytes", type=int, default=1 << 20, help="bandwidth tables from here")
    a = ap.parse_args(argv)
    recs = load(a.json)
    idx = index(recs)
    ns = sorted({k[1] for k in idx})

    def algo_of(r: dict[str, Any]) -> str:
        return str(r["resolved_algorithm"])

    print("### allreduce: latency at 8 B (us) and busbw (GB/s)\n")
    print("| n | size | pycoll auto (algo) | best algo | MPI | Gloo | x MPI | x Gloo |")
    print("|---|---|---|---|---|---|---|---|")
    for n in ns:
        for size in sorted(s for (c, nn, s) in idx if c == "allreduce" and nn == n):
            if size not in (8, 16 << 20, 256 << 20) and size < 256 << 20:
                continue
            sy = idx[("allreduce", n, size)]
            auto, best = pick(sy)
            if auto is None or best is None:
                continue
            mpi, gloo = sy.get("mpi"), sy.get("gloo")
            key = "time_us" if size <= 8 else "busbw"
            unit = "us" if size <= 8 else "GB/s"

            def v(r: dict[str, Any] | None, key: str = key) -> str:
                return f"{r[key]:.2f}" if r else "-"

            print(
                f"| {n} | {fmt_size(size)} ({unit}) | {v(auto)} ({algo_of(auto)}) | "
                f"{v(best)} ({algo_of(best)}) | {v(mpi)} | {v(gloo)} | "
                f"{ratio(mpi, auto)} | {ratio(gloo, auto)} |"
            )
    print("\n### other collectives at >= 1 MiB: busbw (GB/s)\n")
    print(
        "| collective | n | size | pycoll auto (algo) | best algo | MPI | Gloo | x MPI | x Gloo |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for coll in ("allgather", "broadcast", "reduce_scatter", "reduce"):
        for n in ns:
            for size in sorted(s for (c, nn, s) in idx if c == coll and nn == n):
                if size < a.min_bytes:
                    continue
                sy = idx[(coll, n, size)]
                auto, best = pick(sy)
                if auto is None or best is None:
                    continue
                mpi, gloo = sy.get("mpi"), sy.get("gloo")
                print(
                    f"| {coll} | {n} | {fmt_size(size)} | {auto['busbw']:.2f} ({algo_of(auto)}) | "
                    f"{best['busbw']:.2f} ({algo_of(best)}) | "
                    f"{mpi['busbw'] if mpi else float('nan'):.2f} | "
                    f"{gloo['busbw'] if gloo else float('nan'):.2f} | "
                    f"{ratio(mpi, auto)} | {ratio(gloo, auto)} |"
                )
    print("\n### auto vs best measured algorithm (within 10%)\n")
    print(
        "| collective | n | sizes | auto: by mean, by per-call median, per repetition "
        "| the model's pick: the same | auto's misses per repetition "
        "(size: auto ran -> faster algorithm, time ratio) |"
    )
    print("|---|---|---|---|---|---|")
    reps = by_rep(recs)
    for coll in ("allreduce", "allgather", "broadcast", "reduce_scatter", "reduce"):
        for n in ns:
            keys = sorted(k for k in idx if k[0] == coll and k[1] == n)
            total = 0
            good = {"auto": [0, 0, 0], "model": [0, 0, 0]}
            misses = []
            for k in keys:
                py = {lb: r for lb, r in idx[k].items() if lb.startswith("pycoll:")}
                if len(py) < 2:
                    continue
                auto, best = pick(idx[k])
                if auto is None or best is None:
                    continue
                total += 1
                model = py.get(f"pycoll:{auto['auto_choice']}")
                named = [r for lb, r in py.items() if lb != "pycoll:auto"]
                algos = reps[k]
                for who, r in (("auto", auto), ("model", model)):
                    if r is None:
                        continue
                    g = good[who]
                    g[0] += r["time_us"] <= 1.1 * best["time_us"]
                    if all("time_us_median" in x for x in (r, *named)):
                        g[1] += r["time_us_median"] <= 1.1 * min(x["time_us_median"] for x in named)
                    mine = algos.get(r["algorithm"], {})
                    worst = max(
                        ((paired(mine, rs), a_) for a_, rs in algos.items() if a_ != "auto"),
                        default=(float("nan"), ""),
                    )
                    g[2] += worst[0] <= 1.1
                    if who == "auto" and worst[0] > 1.1:
                        misses.append(
                            f"{fmt_size(k[2])}: {algo_of(auto)} -> {worst[1]} ({worst[0]:.2f}x)"
                        )
            if total:
                a_, m_ = (", ".join(f"{x}/{total}" for x in good[w]) for w in ("auto", "model"))
                print(f"| {coll} | {n} | {total} | {a_} | {m_} | {'; '.join(misses) or '-'} |")
    twins = same_code(reps)
    if any(twins[w] for w in WAYS):
        print(
            "\nThe same code measured twice: where `auto` tuned nothing it runs its model's "
            "pick, and auto's time / that algorithm's time, judged each way, was\n"
        )
        print("| n | way | points | 10th percentile | median | 90th | above 1.1 | below 1/1.1 |")
        print("|---|---|---|---|---|---|---|---|")
        for n in sorted({n for w in WAYS for n in twins[w]}):
            for w in WAYS:
                v = twins[w].get(n)
                if not v:
                    continue
                q = statistics.quantiles(v, n=10) if len(v) > 1 else v * 9
                print(
                    f"| {n} | {w} | {len(v)} | {q[0]:.2f} | {statistics.median(v):.2f} "
                    f"| {q[8]:.2f} | {sum(x > 1.1 for x in v)} | {sum(x < 1 / 1.1 for x in v)} |"
                )
    return 0


if __name__ == "__main__":
    sys.exit(main())
