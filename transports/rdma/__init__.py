"""RDMA transport: RC queue pairs over verbs (pyverbs, or the soft provider).

``RdmaTransport`` is the entry point; :mod:`.verbs` picks the provider,
:mod:`.host`, :mod:`.gdr` and :mod:`.dmabuf` are the memory paths, :mod:`.caps`
reports what the machine supports, and :mod:`.soft` is the software provider.
"""

from __future__ import annotations

from transports.rdma.transport import RdmaConnection, RdmaTransport

__all__ = ["RdmaConnection", "RdmaTransport"]
