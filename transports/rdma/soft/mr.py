"""Memory regions (``pyverbs.mr``): MR and DmaBufMR.

An MR is a range of virtual addresses (``MR``) or of a dma-buf's offsets
(``DmaBufMR``, whose I/O virtual address is its offset, as
``ibv_reg_dmabuf_mr(pd, offset, length, iova=offset, fd, access)`` in pyverbs)
with an lkey and an rkey.  The target side of every RDMA operation checks the
rkey, the PD, the access flags and the bounds before a byte moves.
"""

from __future__ import annotations

import mmap
import os
from typing import TYPE_CHECKING, Any

from transports.rdma.soft import enums as e
from transports.rdma.soft.memory import (
    CudaMemory,
    HostMemory,
    Memory,
    buffer_address,
    raw_view,
)
from transports.rdma.soft.pd import PD
from transports.rdma.soft.pyverbs_error import PyverbsError, PyverbsRDMAError

if TYPE_CHECKING:
    from typing import Self  # 3.11; annotations only (3.10 has none)

EINVAL = 22
EFAULT = 14
EOPNOTSUPP = 95


def _check_access(access: int) -> None:
    remote_w = access & (e.IBV_ACCESS_REMOTE_WRITE | e.IBV_ACCESS_REMOTE_ATOMIC)
    if remote_w and not access & e.IBV_ACCESS_LOCAL_WRITE:
        raise PyverbsRDMAError(
            f"Failed to register a MR. length: ?, access flags: {access} (remote write needs local write)",
            EINVAL,
        )


class MR:
    """``MR(pd, length, access, address=None)``.

    Without ``address`` a zeroed page-aligned buffer is allocated, as pyverbs
    does; ``buf`` is its address.  With ``address`` (an int) that range is
    registered.  A soft-only extra: ``address`` may also be a buffer-protocol
    object (NumPy array, memoryview, mmap), which the MR then keeps alive.
    When the context claims ``peermem`` and ``address`` is a CUDA device
    pointer, the range is GPU memory, reached with CUDA copies.
    """

    def __init__(
        self, pd: PD, length: int, access: int, address: Any = None, **_kw: object
    ) -> None:
        _check_access(access)
        self.pd = pd
        self.ctx = pd.ctx
        self.access = access
        self.length = length
        self.iova = 0
        self._owned: mmap.mmap | None = None
        keep: object = None
        if address is None:
            self._owned = mmap.mmap(-1, max(length, 1))
            self._host_view = memoryview(self._owned)
            self.buf = buffer_address(self._host_view)[0]
            mem: Memory = HostMemory(self.buf, length, keepalive=self._owned)
        elif isinstance(address, int):
            self.buf = address
            mem = self._memory_at(address, length)
        else:
            addr, nbytes, view = buffer_address(address)
            if nbytes < length:
                raise PyverbsRDMAError(
                    f"Failed to register a MR. length: {length} > buffer {nbytes}",
                    EFAULT,
                )
            keep = (address, view)
            self.buf = addr
            mem = HostMemory(addr, length, keepalive=keep)
        self.iova = self.buf
        self.memory: Memory = mem
        self.lkey = self.rkey = self.ctx._new_key()
        self.ctx.mrs[self.lkey] = self
        self.ctx._add_ref(self)
        self._closed = False

    def _memory_at(self, address: int, length: int) -> Memory:
        if "peermem" in self.ctx.soft_caps:
            from transports.rdma.soft import cuda

            if cuda.is_device_pointer(address):
                return CudaMemory(address, length)
        return HostMemory(address, length)

    # ----------------------------------------------------------------- checks
    def contains(self, addr: int, n: int) -> bool:
        return self.iova <= addr and addr + n <= self.iova + self.length

    # -------------------------------------------------------------- user I/O
    def write(self, data: bytes | str, length: int, offset: int = 0) -> None:
        """Copy ``length`` bytes of ``data`` into the region at ``offset``."""
        if isinstance(data, str):
            data = data.encode()
        if offset + length > self.length:
            raise PyverbsError(f"write of {length} bytes at {offset} is outside the MR")
        view, commit = self.memory.write_target(offset, length)
        view[:] = memoryview(data).cast("B")[:length]
        if commit is not None:
            commit()

    def read(self, length: int, offset: int) -> bytes:
        if offset + length > self.length:
            raise PyverbsError(f"read of {length} bytes at {offset} is outside the MR")
        return bytes(self.memory.read(offset, length))

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.ctx.mrs.pop(self.lkey, None)
        if self._owned is not None:
            self.memory = HostMemory(0, 0)
            self._host_view.release()
            self._owned.close()
            self._owned = None

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class DmaBufMR(MR):
    """``DmaBufMR(pd, length, access, dmabuf, offset=0)``: a dma-buf range, iova = offset.

    ``dmabuf`` is a file descriptor (or an object with ``fd``, like pyverbs'
    ``DmaBuf``).  Requires the context to claim ``dmabuf``, else the
    registration fails with EOPNOTSUPP as on a NIC without dma-buf support.

    The soft NIC cannot import a GPU's dma-buf.  Two ways to give it the bytes:

    * ``soft_cuda_ptr``: the CUDA device address of the dma-buf's byte 0 (the
      exported range's start); the emulation then moves data with CUDA copies
      and closes nothing.  This is what pycoll's dmabuf path passes.
    * otherwise the fd is mapped with ``mmap`` (works for host-memory dma-bufs
      such as a memfd or udmabuf), which is how the tests exercise offset-based
      addressing on a CPU machine.
    """

    def __init__(
        self,
        pd: PD,
        length: int,
        access: int,
        dmabuf: Any = None,
        offset: int = 0,
        gpu: int = 0,
        gtt: int = 0,
        *,
        soft_cuda_ptr: int | None = None,
    ) -> None:
        if "dmabuf" not in pd.ctx.soft_caps:
            raise PyverbsRDMAError(
                f"Failed to register a dma-buf MR. length: {length}, access flags: {access}",
                EOPNOTSUPP,
            )
        fd = dmabuf if isinstance(dmabuf, int) else getattr(dmabuf, "fd", None)
        if fd is None or fd < 0:
            raise PyverbsRDMAError(
                f"Failed to register a dma-buf MR. length: {length}, access flags: {access}",
                9,
            )  # EBADF
        _check_access(access)
        self.dmabuf = dmabuf
        self.offset = offset
        self._map: mmap.mmap | None = None
        if soft_cuda_ptr is not None:
            mem: Memory = CudaMemory(soft_cuda_ptr + offset, length)
        else:
            try:
                os.fstat(fd)
                self._map = mmap.mmap(fd, offset + length, mmap.MAP_SHARED)
            except (OSError, ValueError) as exc:
                raise PyverbsRDMAError(
                    f"Failed to register a dma-buf MR. length: {length}, access flags: {access} "
                    f"(the soft provider cannot map fd {fd}: {exc})",
                    EOPNOTSUPP,
                ) from exc
            view = memoryview(self._map)
            mem = HostMemory(buffer_address(view)[0] + offset, length, keepalive=view)
            self._mapview = view
        super().__init__(pd, length, access, address=0)
        self.memory = mem
        self.buf = 0
        self.iova = offset

    def _memory_at(self, address: int, length: int) -> Memory:
        return HostMemory(0, 0)  # replaced right after

    def close(self) -> None:
        if self._closed:
            return
        super().close()
        self.memory = HostMemory(0, 0)
        if self._map is not None:
            self._mapview.release()
            self._map.close()
            self._map = None


__all__ = ["MR", "DmaBufMR", "raw_view"]
