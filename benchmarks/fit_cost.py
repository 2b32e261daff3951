"""Fit the ``auto`` cost model's constants to measured sweeps.

``pycoll/algorithms/cost.py`` models one call as::

    T = a(alg, n, N) * alpha + b(alg, n, N) * beta + g(alg, n, N) * gamma

(``alpha`` seconds per sequential step, ``beta`` seconds per byte on a link,
``gamma`` seconds per byte reduced).  The model is linear in the constants, so
the coefficients ``a, b, g`` of each measured point are read off
``cost.estimate`` with unit constants, and the constants are fitted on
``log T_model - log T`` (default; Levenberg-Marquardt in log-constants, started
from the relative-error fit, so an outlier slowed down by a busy machine pulls
no harder than one that ran fast) or by non-negative least squares on the
relative error ``(T_model - T) / T`` (``--loss rel``).  Every (collective, algorithm, n, size) point weighs the
same; its time is the median over repetitions.  ``N`` is what pycoll's
communicator hands the model: the nccl-tests size of the sweep (the buffer of
allreduce, broadcast and reduce, the output of allgather, the input of
reduce_scatter).

Feed it sweeps run with every algorithm at several world sizes::

    for n in 2 3 4; do
      mpiexec -n $n python benchmarks/sweep.py all -b 8 -e 256M -f 4 --algorithm all \\
          --json results/sweep_n$n.json
    done
    python benchmarks/fit_cost.py results/sweep_n*.json

It prints the fitted ``Constants(...)`` (per transport if the files hold more
than one) and, for the current ``DEFAULT`` and the fitted constants, how often
``auto``'s choice among the measured algorithms is within 10% of the best
measured one.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import statistics
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import ROOT  # noqa: F401  (puts the repository on sys.path)

from pycoll.algorithms import cost, names


def load(paths: list[str]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for p in paths:
        doc = json.loads(Path(p).read_text())
        out.extend(doc["records"] if isinstance(doc, dict) else doc)
    return out


def points(
    records: list[dict[str, Any]], transport: str | None, stat: str = "time_us"
) -> dict[tuple, float]:
    """(transport, collective, algorithm, n, size, chunk) -> median seconds."""
    by: dict[tuple, list[float]] = defaultdict(list)
    for r in records:
        if r.get("system") != "pycoll" or r.get("algorithm") in (None, "auto"):
            continue
        if transport and r["transport"] != transport:
            continue
        # the model takes one rank's input: an allgather's block, not its whole output
        size = r["size"] // r["nranks"] if r["collective"] == "allgather" else r["size"]
        key = (
            r["transport"],
            r["collective"],
            r["algorithm"],
            r["nranks"],
            size,
            r["chunk_bytes"],
        )
        by[key].append(r.get(stat, r["time_us"]) * 1e-6)
    return {k: statistics.median(v) for k, v in by.items()}


def coefficients(coll: str, algo: str, n: int, size: int, chunk: int) -> np.ndarray | None:
    row = []
    for unit in ((1.0, 0.0, 0.0), (0.0, 1.0, 0.0), (0.0, 0.0, 1.0)):
        v = cost.estimate(coll, algo, n, size, chunk, cost.Constants(*unit))
        if not math.isfinite(v):
            return None
        row.append(v)
    return np.array(row)


def nnls(X: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Least squares with non-negative solution, by trying every support (3 unknowns)."""
    best, best_res = np.zeros(X.shape[1]), float(np.sum(y**2))
    for k in range(1, X.shape[1] + 1):
        for sup in itertools.combinations(range(X.shape[1]), k):
            cols = list(sup)
            sol, *_ = np.linalg.lstsq(X[:, cols], y, rcond=None)
            if (sol < 0).any():
                continue
            th = np.zeros(X.shape[1])
            th[cols] = sol
            res = float(np.sum((X @ th - y) ** 2))
            if res < best_res:
                best, best_res = th, res
    return best


def fit(X: np.ndarray, t: np.ndarray, loss: str) -> np.ndarray:
    # scale columns so the three unknowns are of similar magnitude
    scale = np.array([1e-5, 1e-9, 1e-9])
    Xs = X * scale
    theta = nnls(Xs / t[:, None], np.ones_like(t))
    if loss == "log" and (theta > 0).all():
        phi, lam = np.log(theta), 1e-2
        target = np.log(t)

        def resid(p: np.ndarray) -> np.ndarray:
            return np.log(Xs @ np.exp(p)) - target

        r = resid(phi)
        for _ in range(100):
            m = Xs @ np.exp(phi)
            J = Xs * np.exp(phi)[None, :] / m[:, None]
            A = J.T @ J + lam * np.eye(3)
            step = np.linalg.solve(A, -J.T @ r)
            r2 = resid(phi + step)
            if r2 @ r2 < r @ r:
                phi, r, lam = phi + step, r2, lam / 3
                if np.abs(step).max() < 1e-6:
                    break
            else:
                lam *= 5
        theta = np.exp(phi)
    return theta * scale


def fmt(k: cost.Constants) -> str:
    def inv(x: float) -> str:
        return f"1 / {1 / x / 1e9:.3g}e9" if x > 0 else "0.0"

    return f"Constants(alpha={k.alpha:.3g}, beta={inv(k.beta)}, gamma={inv(k.gamma)})"


def choice_quality(
    pts: dict[tuple, float], k: cost.Constants, tol: float = 0.10
) -> tuple[int, int, list[str]]:
    """How often the model's pick among the measured algorithms is within ``tol`` of the best."""
    groups: dict[tuple, dict[str, float]] = defaultdict(dict)
    for (tr, coll, algo, n, size, chunk), t in pts.items():
        groups[(tr, coll, n, size, chunk)][algo] = t
    good = total = 0
    misses = []
    for (tr, coll, n, size, chunk), ts in sorted(groups.items()):
        if len(ts) < 2:
            continue
        order = [a for a in names(coll) if a in ts] + [a for a in ts if a not in names(coll)]
        pick = min(order, key=lambda a: cost.estimate(coll, a, n, size, chunk, k))
        best = min(ts.values())
        total += 1
        if ts[pick] <= (1 + tol) * best:
            good += 1
        else:
            fastest = min(ts, key=ts.__getitem__)
            misses.append(
                f"  {tr} {coll} n={n} size={size}: picks {pick} ({ts[pick] * 1e6:.0f} us), "
                f"best {fastest} ({best * 1e6:.0f} us)"
            )
    return good, total, misses


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="fit alpha, beta, gamma of pycoll's cost model")
    ap.add_argument("json", nargs="+", help="sweep.py --json outputs")
    ap.add_argument("--loss", choices=("rel", "log"), default="log")
    ap.add_argument("--transport", default=None, help="only records of this transport")
    ap.add_argument(
        "--stat",
        choices=("mean", "median", "min"),
        default="mean",
        help="per-call figure to fit: the loop mean (default) or, on a noisy machine, "
        "the median or minimum per-call time",
    )
    ap.add_argument("--min-bytes", type=int, default=0, help="drop smaller sizes from the fit")
    ap.add_argument("-v", "--verbose", action="store_true", help="per-point model vs measured")
    a = ap.parse_args(argv)
    stat = {"mean": "time_us", "median": "time_us_median", "min": "time_us_min"}[a.stat]
    pts = points(load(a.json), a.transport, stat)
    if not pts:
        print("no pycoll records with an explicit algorithm in the input")
        return 1
    for tr in sorted({k[0] for k in pts}):
        mine = {k: v for k, v in pts.items() if k[0] == tr}
        rows, ts, keys = [], [], []
        for key, t in sorted(mine.items()):
            _, coll, algo, n, size, chunk = key
            if size < a.min_bytes:
                continue
            c = coefficients(coll, algo, n, size, chunk)
            if c is None:
                continue
            rows.append(c)
            ts.append(t)
            keys.append(key)
        if len(rows) < 3:
            print(f"{tr}: too few points ({len(rows)})")
            continue
        X, t = np.array(rows), np.array(ts)
        th = fit(X, t, a.loss)
        k = cost.Constants(*map(float, th))
        ns = sorted({key[3] for key in keys})
        print(f"# transport {tr}: {len(rows)} points, n in {ns}, loss {a.loss}")
        for label, kk in (("current DEFAULT", cost.DEFAULT), ("fitted", k)):
            model = X @ np.array([kk.alpha, kk.beta, kk.gamma])
            rel = np.abs(model - t) / t
            good, total, misses = choice_quality(mine, kk)
            print(
                f"{label:>16s}: {fmt(kk)}\n"
                f"{'':>16s}  median |rel err| {np.median(rel):.2f}, 90th pct {np.quantile(rel, 0.9):.2f}; "
                f"auto within 10% of best: {good}/{total}"
                + (f" ({100 * good / total:.0f}%)" if total else "")
            )
            if a.verbose and misses:
                print("\n".join(misses))
        if a.verbose:
            print(
                f"# {'collective':>14s} {'algo':>8s} {'n':>2s} {'size':>10s} {'measured us':>12s} {'model us':>10s}"
            )
            model = X @ th
            for key, tm, mm in zip(keys, t, model, strict=True):
                print(
                    f"  {key[1]:>14s} {key[2]:>8s} {key[3]:>2d} {key[4]:>10d} {tm * 1e6:12.1f} {mm * 1e6:10.1f}"
                )
        print(f"DEFAULT = {fmt(k)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
