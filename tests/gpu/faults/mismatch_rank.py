"""One rank of the device mismatch test, bootstrapped over a FileStore (no MPI):
``mismatch_rank.py DIR RANK SIZE``.

Every rank inits with a short timeout and runs one float32 allreduce of 4 MiB
on a CuPy array (``direct``, the default between CUDA IPC peers).  Then rank 0
calls an allreduce while the others call a broadcast from rank 0 of the same
bytes: rank 0, which opens the others' windows (every rank shares the GPU),
must raise ``CollectiveMismatchError`` before any byte moves (its array keeps
its value); the others' calls may return (their host
part, an exposure, is done), and one of their next calls must raise.  The
others never touch their arrays again: their streams wait for a release that
never comes (docs/gpu.md, "Streams and the host").

Each rank prints one JSON line and leaves with ``os._exit`` (a stream that
waits forever would hold up the interpreter's CUDA teardown).
"""

from __future__ import annotations

import json
import os
import sys
import time

import cupy as cp

import pycoll
from pycoll.stores import FileStore

TIMEOUT = 8.0
path, rank, size = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
cp.cuda.Device(0).use()
out: dict[str, object] = {"rank": rank, "error": None}
comm = pycoll.init(store=FileStore(path), rank=rank, size=size, timeout=TIMEOUT)
x = cp.full(1 << 20, rank + 1.0, cp.float32)
comm.allreduce(x)
cp.cuda.Device().synchronize()
out["first"] = float(x[0])
x.fill(rank + 1.0)
cp.cuda.Device().synchronize()
t0 = time.monotonic()
calls = 0
try:
    if rank == 0:
        comm.allreduce(x)
        calls = 1
    else:
        for calls in range(1, 7):  # the window slots (4) run out by the 5th
            comm.broadcast(x, root=0)
except pycoll.PycollError as exc:
    out["error"] = type(exc).__name__
    out["message"] = str(exc)[:600]
out["calls"] = calls
out["elapsed"] = time.monotonic() - t0
if rank == 0:
    out["kept"] = [float(x.min()), float(x.max())]  # no byte moved
    t1 = time.monotonic()
    comm.close()
    out["close_s"] = time.monotonic() - t1
print(json.dumps(out), flush=True)
os._exit(0)
