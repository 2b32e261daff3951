"""Merge gpu_sweep.py JSON files into one markdown table (busbw in GB/s)."""

from __future__ import annotations

import json
import os
import sys


def main(paths: list[str]) -> None:
    for p in paths:
        if not os.path.exists(p):
            print(f"(no results: {p})\n")
            continue
        with open(p) as fh:
            d = json.load(fh)
        m = d["meta"]
        print(f"## n = {m['n']} ranks on {m['device']} (routes {m['routes']})\n")
        ce = m.get("ceilings_GBps", {})
        if ce:
            print("ceilings (GB/s, one way): " + ", ".join(f"{k} {v:.1f}" for k, v in ce.items()))
            print()
        for key, over in (("staging_legs_GBps", "shm"), ("tcp_legs_GBps", "tcp")):
            legs = m.get(key)
            if legs:
                cells = "; ".join(
                    f"rank {r}: " + ", ".join(f"{k} {v:.1f}" for k, v in d.items())
                    for r, d in enumerate(legs)
                )
                print(
                    f"staging legs over {over}, GB/s of copy time in a staged 256 MiB "
                    f"allreduce: {cells}\n"
                )
        impls = sorted(
            {r["impl"] for r in d["rows"]},
            key=[
                "pycoll",
                "pycoll-ring",
                "pycoll-16M",
                "pycoll-staged",
                "pycoll-staged-tcp",
                "mpi-staged",
                "gloo",
            ].index,
        )
        for coll in dict.fromkeys(r["coll"] for r in d["rows"]):
            print(f"### {coll}: busbw GB/s (time us)\n")
            print("| bytes | " + " | ".join(impls) + " |")
            print("|---:|" + "---:|" * len(impls))
            sizes = sorted({r["bytes"] for r in d["rows"] if r["coll"] == coll})
            for s in sizes:
                cells = []
                for i in impls:
                    r = [
                        x
                        for x in d["rows"]
                        if x["coll"] == coll and x["bytes"] == s and x["impl"] == i
                    ]
                    cells.append(f"{r[0]['busbw']:.2f} ({r[0]['time_us']:.0f})" if r else "-")
                print(f"| {s} | " + " | ".join(cells) + " |")
            print()


if __name__ == "__main__":
    main(sys.argv[1:])
