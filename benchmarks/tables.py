"""Markdown tables for RESULTS.md from sweep.py JSON files.

::

    python benchmarks/tables.py results/sweep_n2.json results/sweep_n4.json results/allreduce256M_n*.json

pycoll's figure in each row is ``auto`` (what a user gets): measured as a system
of its own where the sweep timed it (``--algorithm all`` does, since ``auto`` may
run several algorithms, see ``pycoll/tune.py``), else the algorithm the cost
model picks (``auto_choice``); next to the best measured algorithm.  ``x MPI`` / ``x Gloo`` are baseline time /
pycoll time: above 1 pycoll is faster.  Times are medians over repetitions.

The table of ``auto`` against the best judges by the mean time per call
(nccl-tests' ``time``) and, beside it, by the median time per call (the
slowest rank's), which a preempted call does not move: on the 2-core machine
one stall in a loop of small calls doubles a mean.  The last table, the same
code measured twice, is the noise of one point.
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


def same_code(recs: list[dict[str, Any]]) -> dict[int, list[float]]:
    """n -> auto's time / its model's pick's time at each point where ``auto``
    tuned nothing (so ran the same code): how far apart a point puts one
    algorithm measured twice (medians over repetitions, as in the tables)."""
    by: dict[tuple, list[dict[str, Any]]] = defaultdict(list)
    for r in recs:
        if r["system"] == "pycoll":
            by[(r["collective"], r["nranks"], r["size"], r["algorithm"])].append(r)
    out: dict[int, list[float]] = defaultdict(list)
    for (coll, n, size, algo), rs in sorted(by.items()):
        if algo != "auto" or any(r.get("auto_ran") for r in rs):
            continue
        twin = by.get((coll, n, size, rs[0]["auto_choice"]))
        if twin:
            t = statistics.median(r["time_us"] for r in rs)
            out[n].append(t / statistics.median(r["time_us"] for r in twin))
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
        "| collective | n | sizes | auto within 10% | misses (size: auto -> best, time ratio) "
        "| the model's pick within 10% | by per-call median: auto, the model's pick |"
    )
    print("|---|---|---|---|---|---|---|")
    for coll in ("allreduce", "allgather", "broadcast", "reduce_scatter", "reduce"):
        for n in ns:
            keys = sorted(k for k in idx if k[0] == coll and k[1] == n)
            good = total = model_good = 0
            med_good = [0, 0]  # auto, the model's pick
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
                model_good += bool(model and model["time_us"] <= 1.1 * best["time_us"])
                named = [r for lb, r in py.items() if lb != "pycoll:auto"]
                if model and all("time_us_median" in r for r in (auto, *named)):
                    fastest = min(r["time_us_median"] for r in named)
                    for i, r in enumerate((auto, model)):
                        med_good[i] += r["time_us_median"] <= 1.1 * fastest
                if auto["time_us"] <= 1.1 * best["time_us"]:
                    good += 1
                else:
                    misses.append(
                        f"{fmt_size(k[2])}: {algo_of(auto)} -> {algo_of(best)} "
                        f"({auto['time_us'] / best['time_us']:.1f}x)"
                    )
            if total:
                print(
                    f"| {coll} | {n} | {total} | {good}/{total} | {'; '.join(misses) or '-'} "
                    f"| {model_good}/{total} | {med_good[0]}/{total}, {med_good[1]}/{total} |"
                )
    twins = same_code(recs)
    if twins:
        print(
            "\nThe same code measured twice: where `auto` tuned nothing it runs its model's "
            "pick, and auto's time / that algorithm's time was\n"
        )
        print("| n | points | 10th percentile | median | 90th | above 1.1 | below 1/1.1 |")
        print("|---|---|---|---|---|---|---|")
        for n, v in sorted(twins.items()):
            q = statistics.quantiles(v, n=10) if len(v) > 1 else v * 9
            print(
                f"| {n} | {len(v)} | {q[0]:.2f} | {statistics.median(v):.2f} | {q[8]:.2f} "
                f"| {sum(x > 1.1 for x in v)} | {sum(x < 1 / 1.1 for x in v)} |"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
