"""TCP transport: sockets between ranks on different hosts, host-staged.

The pieces, one module per concern:

* :mod:`~transports.tcp.interfaces`: which local addresses to listen on
  (``options.socket_ifname``, NCCL_SOCKET_IFNAME-style) and the host id;
* :mod:`~transports.tcp.blob`: the versioned endpoint blob and the choice of a
  peer's address (:func:`plan_route`);
* :mod:`~transports.tcp.handshake`: the higher rank of a pair dials, the lower
  accepts; challenge, hello and acknowledgement, each side proving that it holds
  the job's secret (HMAC-SHA256), strangers dropped without failing the job;
* :mod:`~transports.tcp.connection`: the data path, ``tcp_nsocks`` sockets per
  connection, messages cut into ``slot_bytes`` chunks behind CRC-checked frame
  headers, bytes read only once their receive is posted;
* :mod:`~transports.tcp.transport`: :class:`TcpTransport`, which puts them together.
"""

from __future__ import annotations

from transports.tcp.blob import Endpoint, decode_blob, encode_blob, plan_route
from transports.tcp.connection import _FRAME as _FRAME  # the frame header (wire tests)
from transports.tcp.connection import (
    BYE_MAGIC,
    FRAME_MAGIC,
    HDR,
    TcpConnection,
    frame_header,
    goodbye_header,
)
from transports.tcp.interfaces import NAME, Address, host_id, select_interfaces
from transports.tcp.transport import DEFAULT_BUFSIZE, DEFAULT_NSOCKS, TcpTransport

__all__ = [
    "BYE_MAGIC",
    "DEFAULT_BUFSIZE",
    "DEFAULT_NSOCKS",
    "FRAME_MAGIC",
    "HDR",
    "NAME",
    "Address",
    "Endpoint",
    "TcpConnection",
    "TcpTransport",
    "decode_blob",
    "encode_blob",
    "frame_header",
    "goodbye_header",
    "host_id",
    "plan_route",
    "select_interfaces",
]
