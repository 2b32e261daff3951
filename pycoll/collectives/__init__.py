"""The collectives, one module each: what a call means (checks into a
:class:`~pycoll.collectives.base.Spec`, the output's shape, the envelope around
the algorithm).  A new collective is a module here, a line in :data:`COLLECTIVES`
and its tests; its algorithms live in :mod:`pycoll.algorithms`.
"""

from __future__ import annotations

from pycoll.collectives.allgather import ALLGATHER
from pycoll.collectives.allgatherv import ALLGATHERV
from pycoll.collectives.allreduce import ALLREDUCE
from pycoll.collectives.alltoall import ALLTOALL
from pycoll.collectives.alltoallv import ALLTOALLV
from pycoll.collectives.barrier import BARRIER
from pycoll.collectives.base import HOST, ArrayOps, Collective, Spec
from pycoll.collectives.broadcast import BROADCAST
from pycoll.collectives.gather import GATHER
from pycoll.collectives.reduce import REDUCE
from pycoll.collectives.reduce_scatter import REDUCE_SCATTER
from pycoll.collectives.reduce_scatterv import REDUCE_SCATTERV
from pycoll.collectives.scatter import SCATTER

#: Every collective by name (its ``ident`` is PYCOLL_CHECK's number for it).
COLLECTIVES: dict[str, Collective] = {
    c.name: c
    for c in (
        ALLREDUCE,
        ALLGATHER,
        BROADCAST,
        REDUCE_SCATTER,
        REDUCE,
        BARRIER,
        ALLTOALL,
        GATHER,
        SCATTER,
        ALLGATHERV,
        REDUCE_SCATTERV,
        ALLTOALLV,
    )
}

__all__ = [
    "ALLGATHER",
    "ALLGATHERV",
    "ALLREDUCE",
    "ALLTOALL",
    "ALLTOALLV",
    "BARRIER",
    "BROADCAST",
    "COLLECTIVES",
    "GATHER",
    "HOST",
    "REDUCE",
    "REDUCE_SCATTER",
    "REDUCE_SCATTERV",
    "SCATTER",
    "ArrayOps",
    "Collective",
    "Spec",
]
