"""One rank of the device fault tests, bootstrapped over a FileStore (no MPI):
``device_rank.py DIR RANK SIZE PATH WHEN [EXITS]``.

Every rank inits with a short timeout on the path ``PATH`` (``direct``,
``ring``, ``host``: pinned host memory, ``staged``: no device connection), runs
one float32 allreduce of 4 MiB on a CuPy array, then:

- rank ``EXITS`` (default 1) exits without ``close()`` ``before`` the second
  allreduce, or ``during`` it: 0.5 s later (the other rank waits inside its
  call meanwhile, or its stream does), right after issuing it with
  ``async_op=True``;
- the other rank runs two more allreduces, each followed by a device
  synchronize, and reports how they ended: the first may complete where the
  exiting rank's part of it did, with the right sum; the one that fails must
  raise.  On a shared GPU rank 0 leads (its kernel reads both ranks'
  buffers) and rank 1 only exposes its own and has its stream wait for rank
  0's release, so rank 0 exiting leaves rank 1's stream waiting.

Each rank prints one JSON line: the error's class and message, how long the
failing call took, whether ``close()`` returned, and what it left in /dev/shm.
"""

from __future__ import annotations

import glob
import json
import os
import sys
import time

import cupy as cp

import pycoll
from pycoll.stores import FileStore

TIMEOUT = 8.0
PATHS = {  # name: (init keywords, algorithm)
    "direct": ({}, "auto"),
    "ring": ({}, "ring"),
    "host": ({"device_host_bytes": 8 << 20}, "auto"),
    "staged": ({"device_transports": ()}, "ring"),
}

path, rank, size, which, when = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), *sys.argv[4:6]
exits = int(sys.argv[6]) if len(sys.argv) > 6 else 1
kw, algo = PATHS[which]
cp.cuda.Device(0).use()
out: dict[str, object] = {"rank": rank}
comm = pycoll.init(store=FileStore(path), rank=rank, size=size, timeout=TIMEOUT, **kw)
x = cp.full(1 << 20, rank + 1.0, cp.float32)
comm.allreduce(x, algorithm=algo)
cp.cuda.Device().synchronize()
out["first"] = float(x[0])
if rank == exits:
    if when == "during":  # rank 0 has been waiting inside its call for a while
        time.sleep(0.5)
        x.fill(rank + 1.0)
        comm.allreduce(x, algorithm=algo, async_op=True)
    print(json.dumps({"rank": rank, "exiting": when}), flush=True)
    os._exit(3)
# A call that the exiting rank's last (async) one paired with may complete, with the right
# sum; the one after it cannot.
out["completed"] = []
out["sync_s"] = []  # how long each device synchronize after a call took
out["error"] = None
for _ in range(2):
    x.fill(rank + 1.0)
    t0 = time.monotonic()
    try:
        comm.allreduce(x, algorithm=algo)
        t1 = time.monotonic()
        cp.cuda.Device().synchronize()
        out["sync_s"].append(round(time.monotonic() - t1, 3))
    except pycoll.PycollError as exc:
        out["error"] = type(exc).__name__
        out["message"] = str(exc)[:400]
        out["elapsed"] = time.monotonic() - t0
        break
    out["completed"].append([float(x.min()), float(x.max())])
t1 = time.monotonic()
try:
    comm.close()
except pycoll.PycollError as exc:  # a failure no call reported
    out["close_error"] = type(exc).__name__
out["close_s"] = time.monotonic() - t1
out["segments"] = [s for s in glob.glob("/dev/shm/pycoll-*")]
print(json.dumps(out), flush=True)
