"""One rank bootstrapped over a FileStore, no MPI: ``store_rank.py DIR RANK SIZE [k=v...]``.

It inits (the ``k=v`` are Config overrides; ints and tuples as Python
literals), runs one allreduce, and prints one JSON line: the result, how each
peer is reached, how long init took, and whether mpi4py was imported.
"""

from __future__ import annotations

import ast
import json
import sys
import time

import numpy as np

import pycoll
from pycoll.stores import FileStore

path, rank, size = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
cfg = {}
for kv in sys.argv[4:]:
    k, _, v = kv.partition("=")
    try:
        cfg[k] = ast.literal_eval(v)
    except (ValueError, SyntaxError):
        cfg[k] = v
t0 = time.monotonic()
out: dict[str, object] = {"rank": rank}
try:
    with pycoll.init(store=FileStore(path), rank=rank, size=size, **cfg) as comm:
        out["init_s"] = time.monotonic() - t0
        x = np.full(5, rank + 1.0)
        comm.allreduce(x)
        out["sum"] = x.tolist()
        out["via"] = {p: comm.transport_of(p) for p in range(size)}
except pycoll.PycollError as exc:
    out["error"] = type(exc).__name__
    out["message"] = str(exc)
    out["init_s"] = time.monotonic() - t0
out["mpi4py"] = "mpi4py" in sys.modules
print(json.dumps(out), flush=True)
