"""CUDA copies for the soft provider's "DMA" into GPU memory (imported lazily).

Uses NVIDIA's ``cuda.bindings`` driver API when it imports, else CuPy's runtime
API.  The progress thread is not the thread that allocated the memory, so the
pointer's own CUDA context is made current there before each copy.
"""

from __future__ import annotations

import ctypes
from typing import Any


def _host_ptr(buf: bytearray) -> int:
    return ctypes.addressof(ctypes.c_char.from_buffer(buf)) if len(buf) else 0


def _driver() -> Any:
    try:
        from cuda.bindings import driver
    except ImportError:
        return None
    return driver


def _check(res: Any) -> Any:
    err, *rest = res if isinstance(res, tuple) else (res,)
    if int(err) != 0:
        raise RuntimeError(f"CUDA driver call failed: {err}")
    return rest[0] if len(rest) == 1 else rest


def is_device_pointer(ptr: int) -> bool:
    """True when ``ptr`` is CUDA device memory (False when CUDA is absent)."""
    drv = _driver()
    if drv is not None:
        res = drv.cuPointerGetAttribute(
            drv.CUpointer_attribute.CU_POINTER_ATTRIBUTE_MEMORY_TYPE, ptr
        )
        if int(res[0]) != 0:
            return False
        return int(res[1]) == int(drv.CUmemorytype.CU_MEMORYTYPE_DEVICE)
    try:
        import cupy
    except ImportError:
        return False
    try:
        attrs = cupy.cuda.runtime.pointerGetAttributes(ptr)
    except Exception:
        return False
    return int(attrs.type) == 2  # cudaMemoryTypeDevice


class Copier:
    """Host<->device copies valid from any thread."""

    def __init__(self, drv: Any, ctx: Any) -> None:
        self._drv = drv
        self._ctx = ctx

    @classmethod
    def for_pointer(cls, ptr: int) -> Copier:
        drv = _driver()
        if drv is None:
            return cls(None, None)
        ctx = _check(
            drv.cuPointerGetAttribute(drv.CUpointer_attribute.CU_POINTER_ATTRIBUTE_CONTEXT, ptr)
        )
        return cls(drv, ctx)

    def _enter(self) -> None:
        if self._drv is not None:
            _check(self._drv.cuCtxSetCurrent(self._ctx))

    def htod(self, dst: int, src: bytearray, n: int) -> None:
        if n == 0:
            return
        self._enter()
        if self._drv is not None:
            _check(self._drv.cuMemcpyHtoD(dst, _host_ptr(src), n))
        else:
            import cupy

            cupy.cuda.runtime.memcpy(dst, _host_ptr(src), n, cupy.cuda.runtime.memcpyHostToDevice)

    def dtoh(self, dst: bytearray, src: int, n: int) -> None:
        if n == 0:
            return
        self._enter()
        if self._drv is not None:
            _check(self._drv.cuMemcpyDtoH(_host_ptr(dst), src, n))
        else:
            import cupy

            cupy.cuda.runtime.memcpy(_host_ptr(dst), src, n, cupy.cuda.runtime.memcpyDeviceToHost)
