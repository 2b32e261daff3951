"""What each driver call and Python step of a replayed ``direct`` call costs the
host, on a GPU machine:

    python benchmarks/gpu_driver_calls.py [--calls 4000]
    mpiexec -n 2 python benchmarks/gpu_driver_calls.py   # two processes on the GPU

Each line is the median (and the 10th percentile) of ``--calls`` timed calls
on an idle non-blocking CuPy stream: the calls pycoll makes through ctypes
(``transports/cuda_driver.py``), the same calls through ``cuda.bindings``
where it is installed, CuPy's event calls, and the Python steps of a replay
(a stream's context, the current device, a deadline).  Calls that enqueue work
synchronize the stream every 64 calls.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

import cupy as cp

from transports import cuda_driver as cd
from transports.base import Deadline

RANK = int(os.environ.get("OMPI_COMM_WORLD_RANK", os.environ.get("PMI_RANK", "0")))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--calls", type=int, default=4000)
    calls = p.parse_args().calls
    cp.cuda.Device(0).use()
    s = cp.cuda.Stream(non_blocking=True)
    sp = int(s.ptr)
    word = (ctypes.c_uint32 * 16)()
    dev = cd.host_map(ctypes.addressof(word), ctypes.sizeof(word))
    rt = cp.cuda.runtime
    ev = int(rt.eventCreateWithFlags(2))
    nop = cp.RawKernel(r'extern "C" __global__ void nop(float* x, long long n) {}', "nop")
    x = cp.zeros(16, cp.float32)
    launch = cd.Launch(
        int(nop.kernel.ptr), 1, 32, sp, [ctypes.c_uint64(int(x.data.ptr)), ctypes.c_int64(16)]
    )
    s.synchronize()
    count = [0]

    def write() -> None:
        count[0] += 1
        cd.stream_write(sp, dev, count[0])

    def context() -> None:
        with s:
            pass

    cases: list[tuple[str, Callable[[], Any], bool]] = [
        ("ctypes cuStreamQuery (idle)", lambda: cd.stream_idle(sp), False),
        ("ctypes cuStreamWriteValue32", write, True),
        ("ctypes cuStreamWaitValue32 (met)", lambda: cd.stream_wait(sp, dev, 0), True),
        ("ctypes cuLaunchKernel (packed)", launch, True),
        ("cupy eventRecord", lambda: rt.eventRecord(ev, sp), True),
        ("cupy eventQuery", lambda: rt.eventQuery(ev), False),
    ]
    try:
        from cuda.bindings import driver as cbd

        cs = cbd.CUstream(sp)

        def write_b() -> None:
            count[0] += 1
            cbd.cuStreamWriteValue32(cs, dev, count[0], 0)

        cases += [
            ("cuda.bindings cuStreamQuery (idle)", lambda: cbd.cuStreamQuery(cs), False),
            ("cuda.bindings cuStreamWriteValue32", write_b, True),
        ]
    except ImportError:
        pass
    cases += [
        ("with stream: (enter and exit)", context, False),
        ("cupy runtime.getDevice", rt.getDevice, False),
        ("Deadline.after(60, idle=True)", lambda: Deadline.after(60.0, idle=True), False),
    ]
    for label, f, enqueues in cases:
        f()
        s.synchronize()
        took = []
        for i in range(calls):
            t = time.perf_counter_ns()
            f()
            took.append(time.perf_counter_ns() - t)
            if enqueues and i % 64 == 63:
                s.synchronize()
        s.synchronize()
        took.sort()
        print(
            f"rank {RANK} {label:38s} median {statistics.median(took) / 1e3:6.2f} us"
            f"  p10 {took[calls // 10] / 1e3:6.2f}",
            flush=True,
        )
    rt.eventDestroy(ev)
    cd.host_unmap(ctypes.addressof(word))


if __name__ == "__main__":
    main()
