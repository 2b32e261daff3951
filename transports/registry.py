"""Transport names and their classes, imported only when asked for.

pycoll probes transports in priority order by these names (``PYCOLL_TRANSPORT``).
"""

from __future__ import annotations

import importlib

from transports.base import Transport

#: name -> "module:Class"; the default priority order is shm, rdma, tcp.
_CLASSES = {
    "shm": "transports.shm:ShmTransport",
    "rdma": "transports.rdma:RdmaTransport",
    "tcp": "transports.tcp:TcpTransport",
    # device memory only (pycoll wires it in a second table, for GPU buffers)
    "cuda_ipc": "transports.cuda_ipc:CudaIpcTransport",
}

NAMES: tuple[str, ...] = tuple(_CLASSES)


def transport_class(name: str) -> type[Transport]:
    """The class for ``name``.

    Raises:
        KeyError: the name is unknown.
        ImportError: its module (or an optional dependency) cannot be imported.
    """
    module, _, cls = _CLASSES[name].partition(":")
    return getattr(importlib.import_module(module), cls)  # type: ignore[no-any-return]
