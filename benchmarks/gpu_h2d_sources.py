"""How fast a pinned host-to-device copy runs, by who last wrote its source.

    python benchmarks/gpu_h2d_sources.py [--piece 4M] [--iters 40]

One process, one GPU.  Each line is the copy rate (GB/s of device time, events
around each copy) of ``--piece`` bytes from pinned host memory to the device when
the source was, just before each copy:

* untouched since it was filled once (and, for scale, one 256 MiB copy);
* written by the CPU (NumPy, or a cross-memory copy as the shm transport makes);
* written by a device-to-host copy;
* untouched, while another thread copies 64 MiB arrays (memory traffic);
* untouched, with a device-to-host copy running on a second stream (duplex);
* a shared-memory mapping registered with ``cudaHostRegister``, untouched and
  after a CPU write.

This is the measurement behind staging through shared send buffers
(``pycoll/gpu/staging.py``): on an H200 the copy ran at 42-43 GB/s after a CPU
write and at 52 GB/s otherwise.
"""

from __future__ import annotations

import argparse
import mmap
import os
import sys
import threading
from collections.abc import Callable

import cupy as cp
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from pycoll.config import parse_bytes
from transports import _cma

_H2D, _D2H = 1, 2


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--piece", default="4M")
    ap.add_argument("--iters", type=int, default=40)
    a = ap.parse_args()
    rt = cp.cuda.runtime
    n, iters = parse_bytes(a.piece), a.iters
    s = cp.cuda.Stream(non_blocking=True)
    dev, dev2 = cp.empty(n, cp.uint8), cp.empty(n, cp.uint8)
    mem = cp.cuda.alloc_pinned_memory(n)
    host = np.frombuffer(mem, np.uint8, n)
    host[:] = 1
    other = cp.cuda.alloc_pinned_memory(n)
    src = np.ones(n, np.uint8)
    pid = os.getpid()

    def rate(
        dst: int, sp: int, nbytes: int, kind: int, before: Callable[[], None] | None = None
    ) -> float:
        total = 0.0
        for i in range(iters + 4):
            if before is not None:
                before()
            e0, e1 = cp.cuda.Event(), cp.cuda.Event()
            e0.record(s)
            rt.memcpyAsync(dst, sp, nbytes, kind, s.ptr)
            e1.record(s)
            e1.synchronize()
            if i >= 4:
                total += cp.cuda.get_elapsed_time(e0, e1) * 1e-3
        return nbytes * iters / total / 1e9

    def show(what: str, gbps: float) -> None:
        print(f"{what:55} {gbps:6.1f} GB/s", flush=True)

    hp, dp = host.ctypes.data, dev.data.ptr
    show(f"h2d {n} B, source untouched", rate(dp, hp, n, _H2D))
    big = 256 << 20
    bm, bd = cp.cuda.alloc_pinned_memory(big), cp.empty(big, cp.uint8)
    show(f"h2d {big} B, source untouched", rate(bd.data.ptr, bm.ptr, big, _H2D))
    del bm, bd
    show(
        "h2d after a NumPy write of the source", rate(dp, hp, n, _H2D, lambda: np.copyto(host, src))
    )
    show(
        "h2d after a cross-memory write of the source",
        rate(dp, hp, n, _H2D, lambda: _cma.read(pid, src.ctypes.data, hp, n)),
    )

    def d2h_write() -> None:
        rt.memcpyAsync(hp, dev2.data.ptr, n, _D2H, s.ptr)
        s.synchronize()

    show("h2d after a device-to-host write of the source", rate(dp, hp, n, _H2D, d2h_write))
    arrays = [np.ones(64 << 20, np.uint8) for _ in range(2)]
    stop = threading.Event()

    def traffic() -> None:
        while not stop.is_set():
            np.copyto(arrays[0], arrays[1])

    th = threading.Thread(target=traffic)
    th.start()
    show("h2d, another thread copying 64 MiB arrays", rate(dp, hp, n, _H2D))
    stop.set()
    th.join()
    s2 = cp.cuda.Stream(non_blocking=True)
    e = [cp.cuda.Event() for _ in range(4)]
    e[0].record(s)
    e[2].record(s2)
    for _ in range(iters):
        rt.memcpyAsync(dp, hp, n, _H2D, s.ptr)
        rt.memcpyAsync(other.ptr, dev2.data.ptr, n, _D2H, s2.ptr)
    e[1].record(s)
    e[3].record(s2)
    e[1].synchronize()
    e[3].synchronize()
    for what, (a0, a1) in (("h2d", (0, 1)), ("d2h", (2, 3))):
        ms = cp.cuda.get_elapsed_time(e[a0], e[a1])
        show(f"{what}, both directions at once on two streams", n * iters / (ms * 1e-3) / 1e9)
    fd = os.open(f"/dev/shm/pycoll-h2d-{pid}", os.O_CREAT | os.O_RDWR | os.O_EXCL, 0o600)
    try:
        os.ftruncate(fd, n)
        mm = mmap.mmap(fd, n)
    finally:
        os.unlink(f"/dev/shm/pycoll-h2d-{pid}")
        os.close(fd)
    shared = np.frombuffer(mm, np.uint8)
    shared[:] = 1
    sp = shared.ctypes.data
    rt.hostRegister(sp, n, 0)
    show("h2d from registered shared memory, untouched", rate(dp, sp, n, _H2D))
    show(
        "h2d from registered shared memory after a CPU write",
        rate(dp, sp, n, _H2D, lambda: _cma.read(pid, src.ctypes.data, sp, n)),
    )
    rt.hostUnregister(sp)
    del shared
    mm.close()


if __name__ == "__main__":
    main()
