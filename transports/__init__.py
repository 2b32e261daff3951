"""Point-to-point transports between two ranks: shared memory, TCP, RDMA.

This package is the lower layer of pycoll and stands alone: it never imports
``pycoll`` or mpi4py.  It deals in byte ranges and opaque endpoint blobs that the
layer above exchanges.  :mod:`transports.base` holds the interface.
"""

from __future__ import annotations

import logging

from transports.base import (
    Backoff,
    BlobError,
    Cap,
    ConnectError,
    Connection,
    Deadline,
    DeviceSpan,
    DoneRequest,
    PeerClosedError,
    Request,
    Transport,
    TransportError,
    TransportOptions,
    TransportTimeout,
    UnshareableMemoryError,
    wait_all,
)

__all__ = [
    "Backoff",
    "BlobError",
    "Cap",
    "ConnectError",
    "Connection",
    "Deadline",
    "DeviceSpan",
    "DoneRequest",
    "PeerClosedError",
    "Request",
    "Transport",
    "TransportError",
    "TransportOptions",
    "TransportTimeout",
    "UnshareableMemoryError",
    "wait_all",
]

# A library attaches no handler of its own (pycoll's PYCOLL_DEBUG attaches one).
logging.getLogger(__name__).addHandler(logging.NullHandler())
