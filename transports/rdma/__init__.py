"""RDMA transport: RC queue pairs over verbs (pyverbs, or the soft provider).

``RdmaTransport`` (:mod:`.transport`) is the entry point and sets up the QPs,
``RdmaConnection`` (:mod:`.connection`) moves the bytes; :mod:`.verbs` picks the provider,
:mod:`.host`, :mod:`.gdr` and :mod:`.dmabuf` are the memory paths, :mod:`.caps`
reports what the machine supports, and :mod:`.soft` is the software provider.
"""

from __future__ import annotations

from transports.rdma.connection import RdmaConnection
from transports.rdma.transport import RdmaTransport

__all__ = ["RdmaConnection", "RdmaTransport"]
