"""``pycoll.init()`` under mpiexec; each rank prints one JSON line of its outcome.

``init_mpi.py OUTDIR TIMEOUT [stall]`` (each rank also writes OUTDIR/rankN.json): with ``stall``, rank 1 hangs for 60 s inside
tcp's ``listen`` (a rank stuck in set-up); the others must not wait past the
timeout, and must name it.  Settings come from the environment (mpiexec's
``-env`` may give each rank its own).
"""

from __future__ import annotations

import json
import os
import sys
import time

import numpy as np
from mpi4py import MPI

import pycoll
import transports.tcp

RANK = MPI.COMM_WORLD.Get_rank()
OUT, TIMEOUT, STALL = sys.argv[1], float(sys.argv[2]), sys.argv[3:] == ["stall"]
if STALL and RANK == 1:
    transports.tcp.TcpTransport.listen = lambda self: time.sleep(60)  # type: ignore[assignment,method-assign,return-value]
t0 = time.monotonic()
out: dict[str, object] = {"rank": RANK}
try:
    with pycoll.init(timeout=TIMEOUT) as comm:
        x = np.ones(3)
        comm.allreduce(x)
        out["sum"] = x.tolist()
except Exception as exc:
    out["error"] = type(exc).__name__
    out["message"] = str(exc)
    out["peer"] = getattr(exc, "peer", None)
out["elapsed"] = time.monotonic() - t0
with open(os.path.join(OUT, f"rank{RANK}.json.tmp"), "w") as f:
    json.dump(out, f)
os.replace(os.path.join(OUT, f"rank{RANK}.json.tmp"), os.path.join(OUT, f"rank{RANK}.json"))
# the launcher tears the job down once one rank exits: wait for the others' reports
others = [r for r in range(MPI.COMM_WORLD.Get_size()) if not (STALL and r == 1)]
end = time.monotonic() + 20
while time.monotonic() < end and not all(
    os.path.exists(os.path.join(OUT, f"rank{r}.json")) for r in others
):
    time.sleep(0.05)
os._exit(0)  # a stalled rank must not hold MPI_Finalize
