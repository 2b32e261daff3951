"""DMA-BUF path: export GPU memory as a dma-buf fd, import it into the NIC.

The CUDA driver is the *exporter*: ``cuMemGetHandleForAddressRange(...,
CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD)`` wraps a page-aligned GPU range in a
dma-buf file descriptor.  The RDMA driver is the *importer*:
``ibv_reg_dmabuf_mr(pd, offset, length, iova, fd, access)`` (pyverbs'
``DmaBufMR``) attaches to the dma-buf through the kernel's dma-buf API and maps
its pages for the NIC, no vendor peer-memory module involved.

Allocations from a memory pool start anywhere inside a page, so the exported
range is the enclosing page-aligned one and the pointer's distance from its
start becomes the MR offset.  pyverbs registers with iova = offset, so work
requests and peers address the buffer by that offset, not by the CUDA pointer.
The fd is closed once the MR holds its own reference to the dma-buf.
"""

from __future__ import annotations

import mmap
import os
from typing import Any

from transports.base import TransportError
from transports.rdma.host import Registration

NAME = "dmabuf"


def export_range(ptr: int, nbytes: int, cuda: Any = None) -> tuple[int, int, int, int]:
    """Export the page-aligned range around ``[ptr, ptr+nbytes)``.

    Args:
        ptr, nbytes: the device range.
        cuda: a :class:`~transports.rdma.cuda.CudaDriver` (or a stand-in with
            ``export_dmabuf``); None uses ``cuda.bindings`` directly.

    Returns:
        (fd, aligned_base, offset, aligned_len): ``offset = ptr - aligned_base``.

    Raises:
        TransportError: cuda.bindings is missing or the export failed.
    """
    page = mmap.PAGESIZE
    base = ptr & ~(page - 1)
    offset = ptr - base
    length = (offset + nbytes + page - 1) & ~(page - 1)
    if cuda is not None:
        return int(cuda.export_dmabuf(base, length)), base, offset, length
    try:
        from cuda.bindings import driver as drv
    except ImportError as exc:
        raise TransportError("rdma:dmabuf needs cuda.bindings (pip install cuda-bindings)") from exc
    kind = drv.CUmemRangeHandleType.CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD
    err, fd = drv.cuMemGetHandleForAddressRange(base, length, kind, 0)
    if int(err):
        raise TransportError(
            f"cuMemGetHandleForAddressRange failed: {err}", transport="rdma:dmabuf"
        )
    return int(fd), base, offset, length


def register(
    verbs: Any, pd: Any, ptr: int, nbytes: int, access: int, cuda: Any = None
) -> Registration:
    """Register GPU memory through dma-buf; ``Registration.addr`` is the offset (iova).

    The fd is closed once the MR holds the dma-buf (also when registration fails).
    With the soft provider, ``cuda.soft_dma_ptr(base)`` says how it reaches the
    bytes: a CUDA pointer (copies through CUDA), or None to map the fd itself.
    """
    fd, base, offset, _ = export_range(ptr, nbytes, cuda)
    try:
        kwargs: dict[str, Any] = {}
        if verbs.name == "soft":
            soft_ptr = base if cuda is None else cuda.soft_dma_ptr(base)
            if soft_ptr is not None:
                kwargs["soft_cuda_ptr"] = soft_ptr
        mr = verbs.DmaBufMR(pd, nbytes, access, fd, offset, **kwargs)
    except TypeError as exc:
        raise TransportError(
            f"this pyverbs' DmaBufMR does not take an external dma-buf fd ({exc})",
            transport="rdma:dmabuf",
        ) from exc
    finally:
        os.close(fd)
    return Registration(mr, offset, nbytes, NAME)
