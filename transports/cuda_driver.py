"""CUDA helpers that any transport (and the layer above) may use: which device is
current, where an allocation starts, its IPC handle, 32-bit words that streams
write and wait on, host memory the device can see, whether a stream is idle,
and the few calls that only queue work (:class:`Queuer`).

CuPy's runtime module and the driver library (``libcuda.so.1``, through ctypes,
for the few calls CuPy lacks) are loaded on first use, never at import time, so
``import transports`` works on a machine without a GPU.
"""

from __future__ import annotations

import ctypes
from typing import Any

from transports.base import TransportError, UnshareableMemoryError

__all__ = [
    "Launch",
    "Queuer",
    "allocation_base",
    "driver",
    "export",
    "host_map",
    "host_unmap",
    "on_device",
    "runtime",
    "stream_idle",
    "stream_wait",
    "stream_write",
]

_WAIT_GEQ = 0x0  # CU_STREAM_WAIT_VALUE_GEQ: (int32_t)(*addr - value) >= 0, wrap-safe


def runtime() -> Any:
    """CuPy's runtime module (imported on first use, never at import time)."""
    import cupy

    return cupy.cuda.runtime


_libcuda: Any = None


def driver() -> Any:
    """The CUDA driver library, for the few calls CuPy's runtime module lacks."""
    global _libcuda
    if _libcuda is None:
        lib = ctypes.CDLL("libcuda.so.1")
        lib.cuMemGetAddressRange_v2.argtypes = [
            ctypes.POINTER(ctypes.c_uint64),
            ctypes.POINTER(ctypes.c_size_t),
            ctypes.c_uint64,
        ]
        for fn in (lib.cuStreamWriteValue32_v2, lib.cuStreamWaitValue32_v2):
            fn.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint32, ctypes.c_uint]
        lib.cuStreamQuery.argtypes = [ctypes.c_void_p]
        lib.cuLaunchKernel.argtypes = (
            [ctypes.c_void_p]
            + [ctypes.c_uint] * 7
            + [
                ctypes.c_void_p,
                ctypes.c_void_p,
                ctypes.c_void_p,
            ]
        )
        lib.cuMemHostGetDevicePointer_v2.argtypes = [
            ctypes.POINTER(ctypes.c_uint64),
            ctypes.c_void_p,
            ctypes.c_uint,
        ]
        _libcuda = lib
    return _libcuda


_INVALID_CONTEXT = 201  # CUDA_ERROR_INVALID_CONTEXT


def _call(fn: Any, *args: Any, bind: Any = None) -> int:
    """``fn(*args)``, a driver call, on the calling thread's current context.  A
    thread that has made no runtime call yet (a progress thread) has none: then
    ``bind()`` makes one current, once, and the call runs again; by default
    ``cudaFree(NULL)`` binds the current device's primary context."""
    err = fn(*args)
    if err == _INVALID_CONTEXT:
        if bind is None:
            runtime().free(0)
        else:
            bind()
        err = fn(*args)
    return int(err)


def stream_write(stream: int, addr: int, value: int) -> None:
    """Enqueue ``*addr = value`` (32 bits) on ``stream``, after its queued work."""
    err = _call(driver().cuStreamWriteValue32_v2, stream, addr, value & 0xFFFFFFFF, 0)
    if err:
        raise TransportError(f"cuda: cuStreamWriteValue32 failed with CUDA error {err}")


def stream_wait(stream: int, addr: int, value: int) -> None:
    """Make ``stream`` wait until the 32-bit word at ``addr`` reaches ``value``."""
    err = _call(driver().cuStreamWaitValue32_v2, stream, addr, value & 0xFFFFFFFF, _WAIT_GEQ)
    if err:
        raise TransportError(f"cuda: cuStreamWaitValue32 failed with CUDA error {err}")


class Launch:
    """One kernel launch with fixed arguments, ready to enqueue again and again
    (``cuLaunchKernel`` with its parameter array packed once: a few microseconds
    less than a launch that packs its arguments each time).

    Args:
        function: the ``CUfunction`` (CuPy's ``RawKernel(...).kernel.ptr``).
        blocks, threads: a one-dimensional grid.
        stream: the ``cudaStream_t`` it goes on.
        args: the kernel's parameters as ctypes values (pointers as ``c_uint64``).
    """

    __slots__ = ("_args", "_fn", "_params", "blocks", "stream", "threads")

    def __init__(self, function: int, blocks: int, threads: int, stream: int, args: list) -> None:
        self._fn = function
        self.blocks, self.threads, self.stream = blocks, threads, stream
        self._args = args  # the values the parameter array points at
        self._params = (ctypes.c_void_p * len(args))(*(ctypes.addressof(a) for a in args))

    def __call__(self) -> None:
        err = _call(
            driver().cuLaunchKernel,
            self._fn,
            self.blocks,
            1,
            1,
            self.threads,
            1,
            1,
            0,
            self.stream,
            self._params,
            None,
        )
        if err:
            raise TransportError(f"cuda: cuLaunchKernel failed with CUDA error {err}")


_NOT_READY = 600  # CUDA_ERROR_NOT_READY


def stream_idle(stream: int) -> bool:
    """Whether everything queued on ``stream`` so far has run (its waits included)."""
    err = _call(driver().cuStreamQuery, stream)
    if err and err != _NOT_READY:
        raise TransportError(f"cuda: cuStreamQuery failed with CUDA error {err}")
    return not err


_HOST_MAPPED = 0x1 | 0x2  # cudaHostRegisterPortable | cudaHostRegisterMapped


def host_map(addr: int, nbytes: int) -> int:
    """Pin host memory (say, a shared segment) and map it for every device; returns
    its device address, which streams may write and wait on (:func:`stream_wait`).
    Undo with :func:`host_unmap` once no queued work touches it."""
    try:
        runtime().hostRegister(addr, nbytes, _HOST_MAPPED)
    except Exception as exc:
        raise TransportError(f"cuda: cannot map host memory for the device: {exc}") from exc
    dev = ctypes.c_uint64()
    err = _call(driver().cuMemHostGetDevicePointer_v2, ctypes.byref(dev), addr, 0)
    if err:
        runtime().hostUnregister(addr)
        raise TransportError(f"cuda: cuMemHostGetDevicePointer failed with CUDA error {err}")
    return int(dev.value)


def host_unmap(addr: int) -> None:
    runtime().hostUnregister(addr)


def allocation_base(ptr: int) -> int:
    """The base address of the CUDA allocation holding device pointer ``ptr``.

    Raises:
        UnshareableMemoryError: ``ptr`` is not device memory.
    """
    base, size = ctypes.c_uint64(), ctypes.c_size_t()
    err = _call(driver().cuMemGetAddressRange_v2, ctypes.byref(base), ctypes.byref(size), ptr)
    if err:
        raise UnshareableMemoryError(
            f"cuda: {ptr:#x} is not device memory (cuMemGetAddressRange: error {err})"
        )
    return int(base.value)


def export(ptr: int) -> tuple[bytes, int]:
    """The IPC handle of the allocation holding device pointer ``ptr``, and the
    offset of ``ptr`` in it (``cudaIpcGetMemHandle`` names whole allocations).

    Raises:
        UnshareableMemoryError: the memory cannot be shared (say, from a
            stream-ordered ``cudaMallocAsync`` pool or the virtual-memory APIs).
    """
    base = allocation_base(ptr)
    try:
        handle = runtime().ipcGetMemHandle(base)
    except Exception as exc:
        raise UnshareableMemoryError(
            f"cuda: device memory at {ptr:#x} cannot be shared: {exc}"
        ) from exc
    return bytes(handle), ptr - base


class Queuer:
    """Driver calls that only queue work or look at an event, made with the GIL
    held (``ctypes.PyDLL``): copies between pinned host memory and the device,
    event records and queries, and a stream's wait for an event.

    A call that releases the GIL must take it back, and while another thread of
    the process runs Python (a progress thread polling) that costs more than
    the call: the same eight calls through torch took 24-39 us alone and 40-75
    us beside such a thread on the H200 machine (benchmarks/RESULTS.md, "DDP's
    bucket allreduces").  None of these calls waits for the device, so holding
    the GIL through them blocks no one for long.  A copy must involve pinned
    host memory (or only device memory); a copy to or from pageable memory
    waits for the stream.

    Streams and events are raw handles (``cudaStream_t``, ``cudaEvent_t``: torch's
    ``Stream.cuda_stream`` and ``Event.cuda_event`` are such handles).  A thread
    without a current context (one that made no CUDA call yet) gets ``device``'s
    primary context, as the runtime API would bind it.

    Args:
        device: the CUDA device ordinal the streams and events belong to.
    """

    _lib: Any = None

    def __init__(self, device: int) -> None:
        self.device = device
        if Queuer._lib is None:
            lib = ctypes.PyDLL("libcuda.so.1")
            u64, vp, uint = ctypes.c_uint64, ctypes.c_void_p, ctypes.c_uint
            lib.cuMemcpyAsync.argtypes = [u64, u64, ctypes.c_size_t, vp]
            lib.cuEventCreate.argtypes = [ctypes.POINTER(vp), uint]
            lib.cuEventRecord.argtypes = [vp, vp]
            lib.cuEventQuery.argtypes = [vp]
            lib.cuEventDestroy_v2.argtypes = [vp]
            lib.cuStreamWaitEvent.argtypes = [vp, vp, uint]
            lib.cuDeviceGet.argtypes = [ctypes.POINTER(ctypes.c_int), ctypes.c_int]
            lib.cuDevicePrimaryCtxRetain.argtypes = [ctypes.POINTER(vp), ctypes.c_int]
            lib.cuCtxSetCurrent.argtypes = [vp]
            Queuer._lib = lib
        self._lib = Queuer._lib

    def _call(self, name: str, *args: Any) -> int:
        err = _call(getattr(self._lib, name), *args, bind=self._bind)
        if err and not (name == "cuEventQuery" and err == _NOT_READY):
            raise TransportError(f"cuda: {name} failed with CUDA error {err}")
        return err

    def _bind(self) -> None:
        """Make the device's primary context current on this thread."""
        lib, dev, ctx = self._lib, ctypes.c_int(), ctypes.c_void_p()
        err = lib.cuDeviceGet(ctypes.byref(dev), self.device)
        if not err:
            err = lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev)
        if not err:
            err = lib.cuCtxSetCurrent(ctx)
        if err:
            raise TransportError(
                f"cuda: cannot make device {self.device}'s context current (CUDA error {err})"
            )

    def copy(self, dst: int, src: int, nbytes: int, stream: int) -> None:
        """Queue a copy of ``nbytes`` from address ``src`` to ``dst`` on ``stream``."""
        self._call("cuMemcpyAsync", dst, src, nbytes, stream)

    def event(self) -> int:
        """A new event (no timing), freed with :meth:`free`."""
        ev = ctypes.c_void_p()
        self._call("cuEventCreate", ctypes.byref(ev), _EVENT_DISABLE_TIMING)
        return int(ev.value or 0)

    def record(self, event: int, stream: int) -> None:
        """Record ``event`` on ``stream``: it fires once the work queued so far has run."""
        self._call("cuEventRecord", event, stream)

    def wait(self, stream: int, event: int) -> None:
        """Make ``stream``'s later work wait for ``event`` (on the device)."""
        self._call("cuStreamWaitEvent", stream, event, 0)

    def done(self, event: int) -> bool:
        """Whether ``event`` has fired (or was never recorded)."""
        return not self._call("cuEventQuery", event)

    def free(self, event: int) -> None:
        """Free an event from :meth:`event` (errors ignored: at exit, the driver may be gone)."""
        self._lib.cuEventDestroy_v2(event)


_EVENT_DISABLE_TIMING = 0x2  # CU_EVENT_DISABLE_TIMING


class on_device:  # lower case: used like a function, ``with on_device(d):``
    """``with on_device(d):`` makes CUDA device ``d`` current, then restores the old one."""

    __slots__ = ("_dev", "_old", "_rt")

    def __init__(self, dev: int) -> None:
        self._dev = dev
        self._rt = runtime()
        self._old = -1

    def __enter__(self) -> None:
        self._old = int(self._rt.getDevice())
        if self._old != self._dev:
            self._rt.setDevice(self._dev)

    def __exit__(self, *exc: object) -> None:
        if self._old != self._dev:
            self._rt.setDevice(self._old)
