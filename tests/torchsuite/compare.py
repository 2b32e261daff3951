"""Tabulate runs of :mod:`.run`: counts per backend and world size, and the tests
that pass on a reference backend but fail on another, with the reason.

::

    python -m tests.torchsuite.compare gloo-2.json pycoll-2.json gloo-3.json pycoll-3.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any


def load(paths: list[str]) -> list[dict[str, Any]]:
    return [json.loads(Path(p).read_text()) for p in paths]


def counts(run: dict[str, Any]) -> dict[str, int]:
    c = {"pass": 0, "fail": 0, "skip": 0}
    for o in run["tests"].values():
        c[o["status"]] += 1
    return c


def regressions(ref: dict[str, Any], run: dict[str, Any]) -> dict[str, str]:
    """Tests that pass in ``ref`` and fail in ``run``: name -> ``run``'s reason."""
    mine = run["tests"]
    return {
        name: mine[name]["reason"]
        for name, o in sorted(ref["tests"].items())
        if o["status"] == "pass" and name in mine and mine[name]["status"] == "fail"
    }


def label(run: dict[str, Any]) -> str:
    gate = run.get("gate_as", run["backend"])
    return run["backend"] if gate == run["backend"] else f"{run['backend']} (gated as {gate})"


def table(runs: list[dict[str, Any]], reference: str) -> str:
    lines = [
        "| backend | world size | pass | fail | skip | total |",
        "|---|---|---|---|---|---|",
    ]
    for r in sorted(runs, key=lambda r: (r["world_size"], r["backend"] != reference, label(r))):
        c = counts(r)
        total = sum(c.values())
        lines.append(
            f"| {label(r)} | {r['world_size']} | {c['pass']} | {c['fail']} | "
            f"{c['skip']} | {total} |"
        )
    for r in runs:
        if r["backend"] == reference:
            continue
        refs = [x for x in runs if x["backend"] == reference and x["world_size"] == r["world_size"]]
        if not refs:
            continue
        lost = regressions(refs[0], r)
        lines += [
            "",
            f"Pass on {reference}, fail on {label(r)} at {r['world_size']}: {len(lost)}",
        ]
        lines += [f"- `{name}`: {why}" for name, why in lost.items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("runs", nargs="+", help="JSON files written by tests.torchsuite.run")
    p.add_argument("--reference", default="gloo", help="the backend to compare with (gloo)")
    args = p.parse_args(argv)
    print(table(load(args.runs), args.reference))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
