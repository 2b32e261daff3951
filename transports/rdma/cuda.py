"""The few CUDA driver calls the RDMA transport's device paths need.

:class:`CudaDriver` wraps NVIDIA's ``cuda.bindings`` (imported when the first
object is made, never at module import).  It works in the device's *primary*
context, the one CuPy and the runtime API use, so memory allocated here and a
user's CuPy arrays live in the same context.

The transport talks to CUDA only through this small surface (allocate, copy,
events, dma-buf export), so tests on machines without a GPU can pass an object
with the same methods that keeps "device" memory in host pages.
"""

from __future__ import annotations

import contextlib
import mmap
from collections.abc import Iterator
from typing import Any

from transports.base import TransportError
from transports.rdma.caps import GpuInfo, detect_gpus

PAGE = mmap.PAGESIZE


def _check(res: Any, what: str) -> Any:
    err, *rest = res if isinstance(res, tuple) else (res,)
    if int(err) != 0:
        raise TransportError(f"CUDA {what} failed: {err}", transport="rdma")
    if not rest:
        return None
    return rest[0] if len(rest) == 1 else rest


def current_device() -> int:
    """The device of the calling thread's current CUDA context (CuPy's
    ``Device(i).use()`` makes one current), else 0."""
    try:
        from cuda.bindings import driver as drv

        (err,) = drv.cuInit(0)
        if int(err):
            return 0
        err, dev = drv.cuCtxGetDevice()
        return int(dev) if int(err) == 0 else 0
    except Exception:  # no cuda.bindings, no driver, no current context
        return 0


class CudaDriver:
    """CUDA device ``device`` through the driver API (primary context).

    Raises:
        TransportError: cuda.bindings is missing or the device cannot be opened.
    """

    name = "cuda"

    def __init__(self, device: int = 0) -> None:
        try:
            from cuda.bindings import driver as drv
        except ImportError as exc:
            raise TransportError(
                "the rdma device paths need cuda.bindings (pip install cuda-bindings)",
                transport="rdma",
            ) from exc
        self.drv = drv
        self.device = device
        _check(drv.cuInit(0), "cuInit")
        self._dev = _check(drv.cuDeviceGet(device), "cuDeviceGet")
        self._ctx = _check(drv.cuDevicePrimaryCtxRetain(self._dev), "cuDevicePrimaryCtxRetain")
        self._events: list[Any] = []
        self._raw: dict[int, int] = {}  # aligned pointer -> allocation
        self._closed = False

    def gpus(self) -> tuple[list[GpuInfo], str]:
        return detect_gpus()

    @contextlib.contextmanager
    def _current(self) -> Iterator[None]:
        """The primary context, current in the calling thread for the block only
        (the caller's own current context is restored after)."""
        _check(self.drv.cuCtxPushCurrent(self._ctx), "cuCtxPushCurrent")
        try:
            yield
        finally:
            self.drv.cuCtxPopCurrent()

    # ------------------------------------------------------------------ memory
    def alloc(self, nbytes: int) -> int:
        """``cuMemAlloc`` (like cudaMalloc) of at least ``nbytes``, page-aligned start."""
        with self._current():
            raw = int(_check(self.drv.cuMemAlloc(max(nbytes, 1) + PAGE), "cuMemAlloc"))
        ptr = (raw + PAGE - 1) & ~(PAGE - 1)
        self._raw[ptr] = raw
        return ptr

    def free(self, ptr: int) -> None:
        raw = self._raw.pop(ptr, None)
        if raw is not None:
            with self._current():
                _check(self.drv.cuMemFree(raw), "cuMemFree")

    def copy_dtod(self, dst: int, src: int, nbytes: int, stream: int) -> None:
        """Copy on ``stream`` (after its queued work) and wait for it."""
        with self._current():
            _check(self.drv.cuMemcpyDtoDAsync(dst, src, nbytes, stream), "cuMemcpyDtoDAsync")
            _check(self.drv.cuStreamSynchronize(stream), "cuStreamSynchronize")

    def copy_dtoh(self, host_addr: int, src: int, nbytes: int, stream: int) -> None:
        with self._current():
            _check(self.drv.cuMemcpyDtoHAsync(host_addr, src, nbytes, stream), "cuMemcpyDtoHAsync")
            _check(self.drv.cuStreamSynchronize(stream), "cuStreamSynchronize")

    def copy_htod(self, dst: int, host_addr: int, nbytes: int, stream: int) -> None:
        with self._current():
            _check(self.drv.cuMemcpyHtoDAsync(dst, host_addr, nbytes, stream), "cuMemcpyHtoDAsync")
            _check(self.drv.cuStreamSynchronize(stream), "cuStreamSynchronize")

    def synchronize(self, stream: int) -> None:
        with self._current():
            _check(self.drv.cuStreamSynchronize(stream), "cuStreamSynchronize")

    # ------------------------------------------------------------------ events
    def record(self, stream: int) -> Any:
        """An event recorded on ``stream`` (from a small pool)."""
        drv = self.drv
        with self._current():
            if self._events:
                ev = self._events.pop()
            else:
                flags = drv.CUevent_flags.CU_EVENT_DISABLE_TIMING
                ev = _check(drv.cuEventCreate(flags), "cuEventCreate")
            _check(drv.cuEventRecord(ev, stream), "cuEventRecord")
        return ev

    def done(self, ev: Any) -> bool:
        """True once the work before ``ev`` finished; the event then goes back to the pool."""
        with self._current():
            (err,) = self.drv.cuEventQuery(ev)
        if err == self.drv.CUresult.CUDA_ERROR_NOT_READY:
            return False
        _check((err,), "cuEventQuery")
        self._events.append(ev)
        return True

    # ------------------------------------------------------------------ dma-buf
    def export_dmabuf(self, base: int, length: int) -> int:
        """A dma-buf fd for the page-aligned range ``[base, base+length)``."""
        kind = self.drv.CUmemRangeHandleType.CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD
        with self._current():
            fd = _check(
                self.drv.cuMemGetHandleForAddressRange(base, length, kind, 0),
                "cuMemGetHandleForAddressRange (dma-buf export)",
            )
        return int(fd)

    def soft_dma_ptr(self, base: int) -> int | None:
        """How the soft provider reaches an exported range: by its CUDA pointer."""
        return base

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            with self._current():
                for ev in self._events:
                    self.drv.cuEventDestroy(ev)
                for raw in self._raw.values():
                    self.drv.cuMemFree(raw)
        finally:
            self._events.clear()
            self._raw.clear()
            self.drv.cuDevicePrimaryCtxRelease(self._dev)
