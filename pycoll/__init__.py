"""pycoll: collective communication for Python, from NumPy and CUDA arrays.

::

    import pycoll
    comm = pycoll.init()                    # under mpirun / mpiexec
    comm.allreduce(grad, op="avg")          # in place
"""

from __future__ import annotations

from typing import Any

from pycoll.communicator import Communicator, Request
from pycoll.config import Config
from pycoll.errors import (
    CollectiveMismatchError,
    CollectiveTimeout,
    CommunicatorClosedError,
    ConnectError,
    InvalidArgumentError,
    PeerAbortedError,
    PycollError,
    TransportError,
    UnsupportedError,
)
from pycoll.reduce import DTYPES, ReduceOp

__version__ = "0.1.0"

__all__ = [
    "DTYPES",
    "CollectiveMismatchError",
    "CollectiveTimeout",
    "Communicator",
    "CommunicatorClosedError",
    "Config",
    "ConnectError",
    "InvalidArgumentError",
    "PeerAbortedError",
    "PycollError",
    "ReduceOp",
    "Request",
    "TransportError",
    "UnsupportedError",
    "__version__",
    "init",
]


def init(mpi_comm: Any = None, **config: Any) -> Communicator:
    """Create a communicator over the ranks of an mpi4py communicator.

    Args:
        mpi_comm: an ``mpi4py.MPI.Comm``; default ``MPI.COMM_WORLD``.  mpi4py is
            used only to bootstrap (exchange endpoints); data moves over pycoll's
            own transports.
        **config: overrides of :class:`Config` fields (e.g. ``timeout=30``,
            ``transports=("tcp",)``, ``chunk_bytes=65536``); they win over the
            ``PYCOLL_*`` environment variables.

    Returns:
        The communicator; close it (or use it as a context manager) when done.

    Raises:
        InvalidArgumentError: a PYCOLL_* variable or override is invalid (or an
            override is not a :class:`Config` field); the message names it and
            this rank.
        ConnectError: some pair of ranks could not be connected.
    """
    if mpi_comm is None:
        from mpi4py import MPI

        mpi_comm = MPI.COMM_WORLD
    try:
        cfg = Config.from_env(**config)
    except InvalidArgumentError as exc:
        raise InvalidArgumentError(f"rank {mpi_comm.Get_rank()}: {exc}") from None
    return Communicator(mpi_comm, cfg)
