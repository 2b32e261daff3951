"""Where a replayed blocking device allreduce spends its host time, per rank.
Under mpiexec on a GPU machine:

    mpiexec -n 2 python benchmarks/gpu_phases.py [--bytes 1M] [--calls 100] [--queued]

Timers wrap the functions a replay of a device plan goes through
(:mod:`pycoll.gpu.replay`, the windows, the driver calls of the stream words);
each prints its median start, as an offset from the call's start, and its
median duration, over ``--calls`` calls made right after a barrier on a CuPy
stream.  Each timer adds about half a microsecond to the call, so the total is
above an untimed call's (``gpu_return.py``).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import defaultdict
from typing import Any

import cupy as cp
from mpi4py import MPI

import pycoll
from pycoll import dispatch, engine
from pycoll.config import parse_bytes
from pycoll.gpu import replay, windows
from transports.cuda_ipc import windows as ipc_windows

W = MPI.COMM_WORLD
RANK, N = W.Get_rank(), W.Get_size()
_ns = time.perf_counter_ns
_start = [0]
_seen: dict[str, list[tuple[float, float]]] = defaultdict(list)


def _timed(owner: Any, name: str) -> None:
    f = getattr(owner, name)
    label = f"{getattr(owner, '__name__', '?').split('.')[-1]}.{name}"

    def timed(*args: Any, **kwargs: Any) -> Any:
        t = _ns()
        try:
            return f(*args, **kwargs)
        finally:
            _seen[label].append(((t - _start[0]) / 1e3, (_ns() - t) / 1e3))

    setattr(owner, name, timed)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--bytes", default="1M")
    p.add_argument("--calls", type=int, default=100)
    p.add_argument(
        "--queued",
        action="store_true",
        help="record an event on the stream before each call (as gpu_return.py does): "
        "the stream is not idle when the call exposes its buffers",
    )
    args = p.parse_args()
    cp.cuda.Device(RANK % cp.cuda.runtime.getDeviceCount()).use()
    for owner, name in [
        (dispatch.Dispatch, "call"),
        (replay.DevicePlan, "fits"),
        (engine.Engine, "replay"),
        (replay.DevicePlan, "run"),
        (windows.KeptWindows, "open"),
        (windows.KeptWindows, "expose"),
        (windows.KeptWindows, "reduce_all"),
        (windows.Windows, "release"),
        (windows.Windows, "wait_released"),
        (ipc_windows._Window, "_await"),
        (ipc_windows._Window, "_on_stream"),
        (ipc_windows, "stream_wait"),
        (ipc_windows, "stream_write"),
        (ipc_windows, "stream_idle"),
    ]:
        _timed(owner, name)
    comm = pycoll.init(timeout=60)
    s = cp.cuda.Stream(non_blocking=True)
    with s:
        x = cp.ones(parse_bytes(args.bytes) // 4, cp.float32)
    for _ in range(30):  # a plan, its kernel loaded, the windows mapped
        W.Barrier()
        comm.allreduce(x, stream=s)
        s.synchronize()
    _seen.clear()
    total = []
    for _ in range(args.calls):
        W.Barrier()
        if args.queued:
            cp.cuda.Event().record(s)
        _start[0] = _ns()
        comm.allreduce(x, stream=s)
        total.append((_ns() - _start[0]) / 1e3)
        s.synchronize()
    lines = [f"rank {RANK}: return median {statistics.median(total):.1f} us (min {min(total):.1f})"]
    for label, v in sorted(_seen.items(), key=lambda kv: statistics.median(a for a, _ in kv[1])):
        lines.append(
            f"   {label:28s} n/call {len(v) / args.calls:4.1f}  "
            f"start@ {statistics.median(a for a, _ in v):7.1f}  "
            f"dur {statistics.median(d for _, d in v):7.1f} us"
        )
    for r in range(N):
        if r == RANK:
            print("\n".join(lines), flush=True)
        W.Barrier()
    comm.close()


if __name__ == "__main__":
    main()
