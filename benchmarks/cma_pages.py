"""Cross-memory copies by the kind of page on each side.

``process_vm_readv`` and ``process_vm_writev`` pin the other process's pages
for the copy; how fast depends on whether those are 2 MiB huge pages or 4 KiB
ones.  This times both calls between two ranks, for every mix of page kinds
(``hostmem`` policies ``on`` and ``off``), with one rank copying or both at
once.  Run under mpiexec with two ranks; rank 0 prints::

    mpiexec -n 2 python benchmarks/cma_pages.py 2M 4M

Columns: the call, the page kind of the source and of the destination (remote:
the other process's), one copier or both, the median time of a copy over
``--reps`` (after ``--warm`` untimed) and its rate.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

import hostmem
from common import parse_size  # (puts the repository on sys.path)

from transports import _cma

KINDS = ("off", "on")  # hostmem policies: 4 KiB pages, huge pages


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("sizes", nargs="+", help="bytes a copy (2M, 4M)")
    ap.add_argument("--reps", type=int, default=40)
    ap.add_argument("--warm", type=int, default=5)
    a = ap.parse_args(argv)
    a.sizes = [parse_size(s) for s in a.sizes]
    return a


def main(argv: list[str] | None = None) -> int:
    from mpi4py import MPI

    args = parse_args(argv)
    w = MPI.COMM_WORLD
    if w.Get_size() != 2:
        raise SystemExit("cma_pages.py runs with exactly two ranks")
    if not _cma.available():
        raise SystemExit("process_vm_readv/writev are not available here")
    r, peer = w.Get_rank(), 1 - w.Get_rank()
    pid = w.sendrecv(os.getpid(), peer)

    def addr(a: np.ndarray) -> int:
        return int(a.__array_interface__["data"][0])

    if r == 0:
        print(f"# {'call':<6} {'from':>4} {'to':>4} {'copiers':>7} {'bytes':>10} "
              f"{'us':>8} {'GB/s':>6}")  # fmt: skip
    for nbytes in args.sizes:
        count = nbytes // 4
        src = {k: hostmem.empty(count, np.float32, k) for k in KINDS}
        dst = {k: hostmem.empty(count, np.float32, k) for k in KINDS}
        for a in (*src.values(), *dst.values()):
            a[:] = r  # every page touched before the peer pins it
        their_src = w.sendrecv({k: addr(a) for k, a in src.items()}, peer)
        their_dst = w.sendrecv({k: addr(a) for k, a in dst.items()}, peer)
        for call in ("read", "write"):
            for ks in KINDS:
                for kd in KINDS:
                    for both in (False, True):
                        times: list[float] = []
                        for i in range(args.warm + args.reps):
                            w.Barrier()
                            if r == 0 or both:
                                t = time.perf_counter()
                                if call == "read":  # the peer's source into our destination
                                    _cma.read(pid, their_src[ks], addr(dst[kd]), nbytes)
                                else:  # our source into the peer's destination
                                    _cma.write(pid, their_dst[kd], addr(src[ks]), nbytes)
                                if i >= args.warm:
                                    times.append(time.perf_counter() - t)
                        worst: Any = w.allreduce(
                            statistics.median(times) if times else 0.0, MPI.MAX
                        )
                        if r == 0:
                            rs = "remote" if call == "read" else "local"
                            rd = "local" if call == "read" else "remote"
                            print(
                                f"  {call:<6} {ks:>4} {kd:>4} {'both' if both else 'one':>7} "
                                f"{nbytes:>10} {worst * 1e6:8.1f} {nbytes / worst / 1e9:6.1f}"
                                f"   ({rs} {'huge' if ks == 'on' else 'small'} -> "
                                f"{rd} {'huge' if kd == 'on' else 'small'})",
                                flush=True,
                            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
