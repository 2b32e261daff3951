"""Host memory path: the NIC reaches ordinary (pinned) host pages.

Registration is ``ibv_reg_mr`` on a host virtual address; the kernel pins the
pages and gives the NIC their bus addresses.  Every RDMA connection uses this
path for its flow-control slots and send staging.  GPU arrays on this path are
staged through pinned host memory by the layer above, which sees a connection
without :attr:`~transports.base.Cap.DEVICE`.
"""

from __future__ import annotations

import mmap
from dataclasses import dataclass
from typing import Any

import numpy as np

NAME = "host"


@dataclass
class Registration:
    """A registered range: what work requests and peers need to address it.

    ``addr`` is the address used in SGEs and by peers: the virtual address for
    host and gdr registrations, the offset (iova) for dma-buf ones.
    """

    mr: Any
    addr: int
    nbytes: int
    path: str

    @property
    def lkey(self) -> int:
        return int(self.mr.lkey)

    @property
    def rkey(self) -> int:
        return int(self.mr.rkey)

    def close(self) -> None:
        self.mr.close()


class HostBuffer:
    """Page-aligned host memory from ``mmap`` (pages are committed on first touch)."""

    def __init__(self, nbytes: int) -> None:
        self._map = mmap.mmap(-1, max(nbytes, 1))
        self.array = np.frombuffer(self._map, dtype=np.uint8, count=nbytes)
        self.view = memoryview(self._map)[:nbytes]
        self.addr = int(self.array.ctypes.data) if nbytes else 0
        self.nbytes = nbytes

    @staticmethod
    def address_of(mv: memoryview) -> int:
        """Virtual address of a byte view's first byte."""
        return int(np.frombuffer(mv, dtype=np.uint8).ctypes.data) if len(mv) else 0

    def close(self) -> None:
        if self._map is None:
            return
        self.view.release()
        del self.array
        try:
            self._map.close()
        except BufferError:  # a view still exported elsewhere; the mapping goes with it
            pass
        self._map = None  # type: ignore[assignment]


def register(verbs: Any, pd: Any, addr: int, nbytes: int, access: int) -> Registration:
    """``ibv_reg_mr`` on a host range."""
    return Registration(verbs.MR(pd, nbytes, access, address=addr), addr, nbytes, NAME)
