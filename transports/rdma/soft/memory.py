"""How the emulated NIC reaches the bytes of a memory region.

A real HCA reads and writes memory by DMA.  The soft provider does the same
work with ordinary copies: host memory is viewed at its virtual address with
``ctypes`` (``memoryview`` over the raw range, no copy), GPU memory is reached
with CUDA copies through a bounce buffer (:class:`CudaMemory`), because a
user-space process cannot map a GPU dma-buf or a peer-memory BAR.
"""

from __future__ import annotations

import ctypes
import logging
from collections.abc import Callable
from typing import Protocol

log = logging.getLogger(__name__)
_said_cuda = False


class Memory(Protocol):
    is_device: bool

    def read(self, off: int, n: int) -> memoryview:
        """Bytes ``[off, off+n)`` of the region (a view or a fresh copy)."""
        ...

    def write_target(self, off: int, n: int) -> tuple[memoryview, Callable[[], None] | None]:
        """A view to fill with ``n`` bytes for ``[off, off+n)``, and a commit step (or None)."""
        ...


def raw_view(addr: int, length: int) -> memoryview:
    """A writable byte view of ``length`` bytes at virtual address ``addr``."""
    if length == 0:
        return memoryview(bytearray(0))
    return memoryview((ctypes.c_ubyte * length).from_address(addr)).cast("B")


def buffer_address(obj: object) -> tuple[int, int, memoryview]:
    """(address, nbytes, byte view) of a C-contiguous buffer-protocol object."""
    mv = memoryview(obj).cast("B")  # type: ignore[arg-type]
    if mv.readonly:
        import numpy as np

        addr = int(np.frombuffer(mv, dtype=np.uint8).ctypes.data) if len(mv) else 0
    else:
        addr = ctypes.addressof(ctypes.c_char.from_buffer(mv)) if len(mv) else 0
    return addr, len(mv), mv


class HostMemory:
    """A host range at a virtual address; the "DMA" is a view of it."""

    is_device = False

    def __init__(self, addr: int, length: int, keepalive: object = None) -> None:
        self.addr = addr
        self.length = length
        self._keepalive = keepalive
        self._view = raw_view(addr, length)

    def read(self, off: int, n: int) -> memoryview:
        return self._view[off : off + n]

    def write_target(self, off: int, n: int) -> tuple[memoryview, Callable[[], None] | None]:
        return self._view[off : off + n], None


class CudaMemory:
    """A GPU range; every access is a CUDA copy through a host bounce buffer."""

    is_device = True

    def __init__(self, dev_ptr: int, length: int) -> None:
        from transports.rdma.soft import cuda

        global _said_cuda
        if not _said_cuda:
            _said_cuda = True
            log.info(
                "soft RDMA: GPU memory is reached with CUDA copies through host memory "
                "(emulated, not DMA)"
            )
        self.addr = dev_ptr
        self.length = length
        self._copier = cuda.Copier.for_pointer(dev_ptr)

    def read(self, off: int, n: int) -> memoryview:
        buf = bytearray(n)
        self._copier.dtoh(buf, self.addr + off, n)
        return memoryview(buf)

    def write_target(self, off: int, n: int) -> tuple[memoryview, Callable[[], None] | None]:
        buf = bytearray(n)
        dst = self.addr + off

        def commit() -> None:
            self._copier.htod(dst, buf, n)

        return memoryview(buf), commit
