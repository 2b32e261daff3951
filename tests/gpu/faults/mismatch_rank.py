"""One rank of the device mismatch test, bootstrapped over a FileStore (no MPI):
``mismatch_rank.py DIR RANK SIZE PATH``.

Every rank inits with a short timeout on the path ``PATH`` (``direct``, the
default between CUDA IPC peers; ``ring`` over cuda_ipc; ``staged``: no device
connection) and runs one float32 allreduce of 4 MiB on a CuPy array.  Then
rank 0 calls an allreduce while the others call a broadcast from rank 0 of the
same bytes.  The calls must not pair: on ``direct`` rank 0, which opens the
others' windows (every rank shares the GPU), raises ``CollectiveMismatchError``
before any byte moves, and the others' calls may return (their host part, an
exposure, is done) until one of their next calls raises; they never touch
their arrays again, since their streams wait for a release that never comes
(docs/gpu.md, "Streams and the host").  On ``ring`` and ``staged`` every rank's
call raises, and no byte reaches an array.

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
PATHS = {
    "direct": ({}, "auto"),
    "ring": ({}, "ring"),
    "staged": ({"device_transports": ()}, "ring"),
}
path, rank, size, which = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
kw, algo = PATHS[which]
cp.cuda.Device(0).use()
out: dict[str, object] = {"rank": rank, "error": None}
comm = pycoll.init(store=FileStore(path), rank=rank, size=size, timeout=TIMEOUT, **kw)
x = cp.full(1 << 20, rank + 1.0, cp.float32)
comm.allreduce(x, algorithm=algo)
cp.cuda.Device().synchronize()
out["first"] = float(x[0])
x.fill(rank + 1.0)
cp.cuda.Device().synchronize()
t0 = time.monotonic()
calls = 0
try:
    if rank == 0:
        calls = 1
        comm.allreduce(x, algorithm=algo)
    else:
        for calls in range(1, 7):  # a direct window's slots (4) run out by the 5th
            comm.broadcast(x, root=0, algorithm=algo)
except pycoll.PycollError as exc:
    out["error"] = type(exc).__name__
    out["message"] = str(exc)[:600]
out["calls"] = calls
out["elapsed"] = time.monotonic() - t0
if rank == 0 or which != "direct":
    out["kept"] = [float(x.min()), float(x.max())]  # no byte moved
    t1 = time.monotonic()
    comm.close()
    out["close_s"] = time.monotonic() - t1
print(json.dumps(out), flush=True)
os._exit(0)
