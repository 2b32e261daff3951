"""pycoll: collective communication for Python, from NumPy and CUDA arrays.

::

    import pycoll
    comm = pycoll.init()                    # under mpirun / mpiexec
    comm.allreduce(grad, op="avg")          # in place

    # without MPI: any key-value store every rank reaches (torch's TCPStore,
    # pycoll.stores.FileStore, ...)
    comm = pycoll.init(store=store, rank=rank, size=size)
"""

from __future__ import annotations

from typing import Any

from pycoll.communicator import Communicator, Request
from pycoll.config import Config
from pycoll.errors import (
    CollectiveMismatchError,
    CollectiveTimeout,
    CommunicatorClosedError,
    ConcurrentCallError,
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
    "ConcurrentCallError",
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


def init(
    mpi_comm: Any = None,
    *,
    store: Any = None,
    rank: int | None = None,
    size: int | None = None,
    **config: Any,
) -> Communicator:
    """Create a communicator over the ranks of an mpi4py communicator, or of a store.

    ::

        comm = pycoll.init()                                  # MPI.COMM_WORLD
        comm = pycoll.init(mpi_comm)                          # any mpi4py communicator
        comm = pycoll.init(store=store, rank=r, size=n)       # no MPI at all

    Args:
        mpi_comm: an ``mpi4py.MPI.Comm``; default ``MPI.COMM_WORLD`` (when no
            ``store`` is given).  mpi4py is used only to bootstrap (exchange
            endpoints); data moves over pycoll's own transports.
        store: a key-value store with ``set(key, value)``, ``get(key)`` and
            ``wait(keys, timedelta)``, such as torch's ``dist.TCPStore`` or
            :class:`pycoll.stores.FileStore`; every rank passes one reaching the
            same keys.  mpi4py is then never imported.
        rank: this rank, with ``store``.
        size: the number of ranks, with ``store``.
        **config: overrides of :class:`Config` fields (e.g. ``timeout=30``,
            ``transports=("tcp",)``, ``chunk_bytes=65536``); they win over the
            ``PYCOLL_*`` environment variables.

    Every wait in ``init`` is bounded by the timeout (``PYCOLL_TIMEOUT``), and
    the ranks compare the settings that must agree (:data:`pycoll.bootstrap.AGREED`).

    Returns:
        The communicator; close it (or use it as a context manager) when done.

    Raises:
        InvalidArgumentError: a PYCOLL_* variable or override is invalid (or an
            override is not a :class:`Config` field), ``store`` comes without a
            valid ``rank`` and ``size`` (or with ``mpi_comm``), or a setting that
            must agree differs between ranks; the message names it and the rank(s).
        ConnectError: some pair of ranks could not be connected, or a rank did not
            answer within the timeout (the message names it).
    """
    from pycoll.rendezvous import Bootstrap, MpiBootstrap, StoreBootstrap

    if store is not None:
        if mpi_comm is not None:
            raise InvalidArgumentError("pycoll.init: pass mpi_comm or store, not both")
        if rank is None or size is None:
            raise InvalidArgumentError(
                f"pycoll.init: store= needs rank= and size= (got rank={rank!r}, size={size!r})"
            )
        who = rank
    else:
        if rank is not None or size is not None:
            raise InvalidArgumentError(
                "pycoll.init: rank= and size= go with store=; an MPI communicator has its own"
            )
        if mpi_comm is None:
            from mpi4py import MPI

            mpi_comm = MPI.COMM_WORLD
        who = mpi_comm.Get_rank()
    try:
        cfg = Config.from_env(**config)
    except InvalidArgumentError as exc:
        raise InvalidArgumentError(f"rank {who}: {exc}") from None
    boot: Bootstrap
    if store is not None:
        assert rank is not None and size is not None
        boot = StoreBootstrap(store, rank, size)
    else:
        boot = MpiBootstrap(mpi_comm)
    return Communicator(boot, cfg)
