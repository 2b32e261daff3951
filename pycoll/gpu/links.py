"""What an algorithm sees for device buffers: :class:`DeviceLinks`.

The algorithms are the host ones; they slice arrays generically, so CuPy slices
go through them unchanged.  Per peer, :class:`DeviceLinks` picks the route:

* a device connection (:attr:`~transports.base.Cap.DEVICE`: ``cuda_ipc`` from
  the device table, or an RDMA connection registered with GPUDirect/DMA-BUF) moves the bytes GPU to GPU
  through :meth:`~transports.base.Connection.isend_device` and
  :meth:`~transports.base.Connection.irecv_device`; a receive's sink copies or
  reduces straight out of the transport's device memory;
* any other connection (shm, tcp, rdma:host) goes through pinned host memory
  (:mod:`pycoll.gpu.staging`).

All device work of a collective is enqueued on one stream (the collective's
internal stream), so it is ordered in the order the algorithm posts it; where a
transport hands a sink a span on another stream, that stream first waits for
ours (an event).  Reductions compute ``out = local OP incoming``, as on the host.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from pycoll.algorithms.links import Links
from pycoll.gpu import external_stream
from pycoll.gpu.staging import Pinned, StagedRecv, StagedSend
from transports.base import (
    Backoff,
    Cap,
    Connection,
    Deadline,
    DeviceSpan,
    DoneRequest,
    Request,
)

_D2D = 3  # cudaMemcpyDeviceToDevice
_DEFAULT = 4  # cudaMemcpyDefault


class DeviceLinks(Links):
    """Point-to-point operations on CuPy arrays for one device collective.

    Args:
        rank, size, conns, deadline, chunk_bytes, backoff: as :class:`Links`
            (``conns`` are the host connections).
        dconns: peer -> device-capable connection (the device table).
        dtype: the collective's logical dtype (bfloat16 travels as uint16).
        reduce: ``f(a, b, out=c)`` on device, or None.
        device: the CUDA device ordinal.
        stream: the CuPy stream the collective's work goes on.
        pool: pinned buffers for staging.
        piece: staging piece size in bytes.
    """

    __slots__ = ("_cp", "_dconns", "_device", "_ev", "_pool", "_rt", "_sptr", "_stream", "piece")

    def __init__(
        self,
        rank: int,
        size: int,
        conns: dict[int, Connection],
        dconns: dict[int, Connection],
        deadline: Deadline,
        chunk_bytes: int,
        dtype: np.dtype[Any],
        reduce: Callable[..., Any] | None,
        backoff: Backoff,
        device: int,
        stream: Any,
        pool: Pinned,
        piece: int,
    ) -> None:
        super().__init__(rank, size, conns, deadline, chunk_bytes, dtype, reduce, backoff)
        import cupy

        self._cp = cupy
        self._rt = cupy.cuda.runtime
        self._dconns = dconns
        self._device = device
        self._stream = stream
        self._sptr = int(stream.ptr)
        self._pool = pool
        self._ev = 0
        self.piece = piece
        for c in dconns.values():
            if Cap.SINK_STREAM in c.caps:
                c.set_sink_stream(self._sptr)  # receive sinks run on our stream too

    # ----------------------------------------------------------------- routing
    def _route(self, peer: int) -> Connection:
        c = self._dconns.get(peer)
        if c is not None:
            return c
        return self.conns[peer]

    def empty(self, shape: Any, dtype: Any) -> Any:
        """Scratch memory for the algorithms, on this collective's device."""
        return self._cp.empty(shape, dtype)

    # ----------------------------------------------------------------- posting
    def send(self, peer: int, a: Any) -> Request:
        conn = self._route(peer)
        n = int(a.nbytes)
        ptr = int(a.data.ptr)
        if n == 0:
            req: Request = DoneRequest(peer)
        elif Cap.DEVICE in conn.caps:
            req = conn.isend_device(DeviceSpan(ptr, n, self._device, self._sptr), self.tag)
        else:
            req = StagedSend(conn, ptr, n, self.piece, self._sptr, self._pool, self.tag)
        self._pending.append(req)
        return req

    def recv(self, peer: int, out: Any) -> Request:
        conn = self._route(peer)
        if out.nbytes == 0:
            return DoneRequest(peer)
        if Cap.DEVICE not in conn.caps:
            return StagedRecv(
                conn, out, None, None, self.piece, self._stream, self._pool, tag=self.tag
            )
        rt = self._rt
        optr = int(out.data.ptr)

        def sink(off: int, span: DeviceSpan) -> None:
            self._order(span.stream)
            rt.memcpyAsync(optr + off, span.ptr, span.nbytes, _DEFAULT, span.stream)

        return conn.irecv_device(int(out.nbytes), sink, self._device, self.tag)

    def recv_reduce(self, peer: int, out: Any, local: Any, incoming_first: bool = False) -> Request:
        f = self.reduce
        assert f is not None
        conn = self._route(peer)
        if out.nbytes == 0:
            return DoneRequest(peer)
        if Cap.DEVICE not in conn.caps:
            return StagedRecv(
                conn, out, local, f, self.piece, self._stream, self._pool, incoming_first, self.tag
            )
        cp = self._cp
        dt = out.dtype
        isz = dt.itemsize
        dev = self._device

        def sink(off: int, span: DeviceSpan) -> None:
            self._order(span.stream)
            i = off // isz
            j = i + span.nbytes // isz
            mem = cp.cuda.UnownedMemory(span.ptr, span.nbytes, self, dev)
            inc = cp.ndarray((j - i,), dt, cp.cuda.MemoryPointer(mem, 0))
            with self._stream_of(span.stream):
                if incoming_first:
                    f(inc, local[i:j], out=out[i:j])
                else:
                    f(local[i:j], inc, out=out[i:j])

        return conn.irecv_device(int(out.nbytes), sink, dev, self.tag)

    # ----------------------------------------------------------------- streams
    def _stream_of(self, ptr: int) -> Any:
        if ptr == self._sptr:
            return self._stream
        return external_stream(ptr, self._device)

    def _order(self, ptr: int) -> None:
        """Make stream ``ptr`` wait for the work already queued on ours."""
        if ptr == self._sptr:
            return
        if not self._ev:
            self._ev = int(self._rt.eventCreateWithFlags(0x2))
        self._rt.eventRecord(self._ev, self._sptr)
        self._rt.streamWaitEvent(ptr, self._ev, 0)

    def finish(self) -> None:
        super().finish()
        if self._ev:
            self._rt.eventDestroy(self._ev)
            self._ev = 0
