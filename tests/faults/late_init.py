"""Rank 1 calls pycoll.init long after PYCOLL_TIMEOUT: the others must not hang,
and must name it."""

import sys
import time

from mpi4py import MPI

import pycoll

if MPI.COMM_WORLD.Get_rank() == 1:
    time.sleep(float(sys.argv[1]))
    sys.exit(0)
try:
    pycoll.init(timeout=float(sys.argv[2]))
except pycoll.ConnectError as exc:
    print(f"RAISED {MPI.COMM_WORLD.Get_rank()} {exc} (peer {exc.peer})", flush=True)
    sys.exit(0)
print("NOT RAISED", flush=True)
