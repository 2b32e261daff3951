"""README's example: an in-place average, an allgather and an asynchronous allreduce.

    mpiexec -n 4 python examples/example.py

Every rank prints its rank, the first element of the result (the average of
the ranks, then summed over the ranks: n (n - 1) / 2), the gathered ranks and
the transport that reaches each peer.
"""

import numpy as np

import pycoll

with pycoll.init() as comm:  # ranks from mpi4py's COMM_WORLD
    grad = np.full(1 << 20, comm.rank, np.float32)
    comm.allreduce(grad, op="avg")  # in place; every rank gets the same bits
    rows = comm.allgather(np.array([comm.rank]))  # shape (size, 1)
    req = comm.allreduce(grad, async_op=True)  # overlaps with your computation
    req.wait()
    kinds = [comm.transport_of(p) for p in range(comm.size)]
    # one write per rank (the newline in it): the ranks share one stdout
    print(f"{comm.rank} {grad[0]} {rows.ravel()} {kinds}\n", end="", flush=True)
