"""Copies whose destination starts a short distance after the source modulo the page.

REP MOVSB (glibc's memcpy from about 2 KiB up, below its non-temporal
threshold; the kernel's cross-memory copy at any length on CPUs with fast
string moves) runs many times slower where the destination starts 1-63 bytes
after the source modulo the 4 KiB page.  This times, in one process, for each
size and skew (destination page offset minus the source's, which starts a
page):

* ``numpy``: ``dst[...] = src`` (memcpy);
* ``copy``: ``pycoll._step.copy``, which goes back to front where skewed;
* ``readv``: one ``process_vm_readv`` of this process's own memory (ctypes);
* ``cma``: ``transports._cma.read``, which takes a skewed copy through a buffer
  of the thread that lies as the source does.

The fastest of ``--reps`` timings of ``--calls`` calls, in us a call::

    python benchmarks/skewed_copies.py --sizes 64K,1M --skews 0,16,48,2000
"""

from __future__ import annotations

import argparse
import ctypes
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

import hostmem
from common import parse_size  # (puts the repository on sys.path)

from transports import _cma

PAGE = 4096


def _readv() -> Callable[[int, int, int], None]:
    """One process_vm_readv of this process: (dst, src, nbytes)."""
    from transports._cma import _IOVec
    from transports._cma import _readv as call

    pid = os.getpid()

    def read(dst: int, src: int, n: int) -> None:
        lv, rv = _IOVec(dst, n), _IOVec(src, n)
        if call(pid, ctypes.byref(lv), 1, ctypes.byref(rv), 1, 0) != n:
            raise OSError(ctypes.get_errno(), "process_vm_readv moved less")

    return read


def _copies(
    dst: np.ndarray, src: np.ndarray, readv: Callable[[int, int, int], None]
) -> list[Callable[[], None]]:
    """The four copies of ``src`` into ``dst``, in the columns' order."""
    from pycoll._step import copy

    pid, sa, da, n = os.getpid(), src.ctypes.data, dst.ctypes.data, src.nbytes
    return [
        lambda: dst.__setitem__(Ellipsis, src),
        lambda: copy(dst, src),
        lambda: readv(da, sa, n),
        lambda: _cma.read(pid, sa, da, n),
    ]


def best_us(f: Callable[[], None], calls: int, reps: int) -> float:
    f()
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        for _ in range(calls):
            f()
        best = min(best, (time.perf_counter() - t) / calls)
    return best * 1e6


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="64K,1M")
    ap.add_argument("--skews", default="0,16,48,2000", help="bytes, below the page size")
    ap.add_argument("--calls", type=int, default=50)
    ap.add_argument("--reps", type=int, default=7)
    args = ap.parse_args(argv)
    if not _cma.available() or _cma._vm_copy is None:
        raise SystemExit("process_vm_readv or transports._ring is not here")
    readv = _readv()
    print("# us a call, the fastest of --reps; source page-aligned, huge pages both")
    print(f"#{'bytes':>9} {'skew':>5} {'numpy':>8} {'copy':>8} {'readv':>8} {'cma':>8}")
    for n in (parse_size(s) for s in args.sizes.split(",")):
        src = hostmem.empty(n, np.uint8, "on")
        src[:] = np.random.default_rng(n).integers(0, 256, n, dtype=np.uint8)
        for skew in (int(s) % PAGE for s in args.skews.split(",")):
            dst = hostmem.empty(n + PAGE, np.uint8, "on")[skew : skew + n]
            times = [best_us(f, args.calls, args.reps) for f in _copies(dst, src, readv)]
            if not np.array_equal(dst, src):
                raise SystemExit(f"{n} bytes at skew {skew}: the copy is wrong")
            print(f"{n:>10} {skew:>5} " + " ".join(f"{t:>8.2f}" for t in times), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
