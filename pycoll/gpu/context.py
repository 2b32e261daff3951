"""Device collectives: streams, events and the per-collective bodies.

Stream semantics (as NCCL's, with one honest difference):

* A device collective is ordered after the work already queued on the
  caller's stream: the ``stream=`` argument (a CuPy stream, a torch stream or a
  raw ``cudaStream_t`` as an int), else the current stream (torch's for torch
  tensors, CuPy's otherwise).  An event is recorded on it when the collective
  is called.
* Work queued on that stream after the call waits for the collective: an
  event recorded after its last write is waited on by the stream
  (``cudaStreamWaitEvent``).
* ``direct`` (one-sided windows, :mod:`pycoll.gpu.direct`) does not block the
  host: pycoll's stream waits for the start event and everything is enqueued.
* ``ring``/``tree`` block the host: the host thread synchronizes the start event
  before moving any byte (so the algorithms can run on pycoll's own non-blocking
  stream) and drives every transfer by polling events, so the call returns once
  all bytes have moved; only the last local step (the division of ``avg``, a
  final local reduction) may still be queued, and the stream waits for it.
* Small messages that ``auto`` sends through the host (:meth:`GpuContext.through_host`)
  block until the input is copied out and the host collective is done; the copy
  back is queued on the stream (work queued after it sees the result), and the
  next such call waits for it only if it could not be ordered after it anyway.
* With ``async_op=True`` the collective runs on pycoll's thread; its output is
  ready for the host and for work queued on the stream once ``Request.wait()``
  has returned (work queued before that is not ordered after it).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import numpy as np

from pycoll import algorithms
from pycoll.buffers import Buffer, data_ptr
from pycoll.errors import InvalidArgumentError
from pycoll.gpu import direct
from pycoll.gpu import reduce as dreduce
from pycoll.gpu.direct import Scratch, Windows
from pycoll.gpu.links import DeviceLinks
from pycoll.gpu.staging import Pinned, piece_bytes
from pycoll.reduce import ReduceOp
from transports.base import Backoff, Connection, Deadline

log = logging.getLogger(__name__)

_D2H, _H2D = 2, 1  # cudaMemcpyDeviceToHost, cudaMemcpyHostToDevice


class GpuContext:
    """A communicator's device side: its GPU, device connections, stream and pinned pool.

    Args:
        rank, size: as the communicator's.
        device: the CUDA device current at ``pycoll.init`` (device buffers must live there).
        dconns: peer -> device-capable connection (may be empty: all staged).
        kinds: peer -> transport name of those connections.
        chunk_bytes: the device pipeline chunk.
        timeout: seconds before a blocked device collective raises.
        close: releases the device connections.
    """

    def __init__(
        self,
        rank: int,
        size: int,
        device: int,
        dconns: dict[int, Connection],
        kinds: dict[int, str],
        chunk_bytes: int,
        timeout: float,
        close: Callable[[], None] | None = None,
    ) -> None:
        self.rank = rank
        self.size = size
        self.device = device
        self.dconns = dconns
        self.kinds = kinds
        self.chunk_bytes = chunk_bytes
        self.timeout = timeout
        self._close = close
        self._stream: Any = None
        self._pool: Pinned | None = None
        #: every pair has one-sided windows (agreed by all ranks at setup)
        self.one_sided = False
        #: every rank uses this same GPU (agreed by all ranks at setup)
        self.shared_device = False
        self._scratch: Scratch | None = None
        self._mirrors: dict[int, tuple[Any, np.ndarray]] = {}  # pinned copies, small messages
        # the stream of the last copy back out of the mirrors, until it is known
        # done; _back_event is recorded after it
        self._back: int | None = None
        self._back_event: Any = None

    def kind(self, peer: int, host_conns: dict[int, Connection], host_kinds: dict[int, str]) -> str:
        """How device bytes reach ``peer``: "cuda_ipc", "rdma:gdr", ... or "staged:shm"."""
        if peer == self.rank:
            return "self"
        if peer in self.dconns:
            return self.kinds[peer]
        c = host_conns.get(peer)
        if c is not None and c.device_capable:
            return host_kinds[peer]
        return f"staged:{host_kinds.get(peer, '?')}"

    def stream(self) -> Any:
        if self._stream is None:
            import cupy

            with cupy.cuda.Device(self.device):
                self._stream = cupy.cuda.Stream(non_blocking=True)
        return self._stream

    def scratch(self) -> Scratch:
        if self._scratch is None:
            self._scratch = Scratch(self.device)
        return self._scratch

    def pool(self) -> Pinned:
        if self._pool is None:
            self._pool = Pinned(self.device)
        return self._pool

    def call(
        self,
        what: str,
        x: Buffer,
        out: Buffer | None,
        stream: Any,
        host_conns: dict[int, Connection],
        backoff: Backoff,
    ) -> DeviceCall:
        """Validate and start a device collective (records the start event).

        Raises:
            InvalidArgumentError: a buffer on another device, or a bad ``stream``.
        """
        for b, arg in ((x, "sendbuf"), (out, "recvbuf")):
            if b is not None and b.device != self.device:
                raise InvalidArgumentError(
                    f"rank {self.rank}: {what}: {arg} is on cuda:{b.device}, but this "
                    f"communicator's device is cuda:{self.device} (the current device at "
                    "pycoll.init)"
                )
        user = resolve_stream(stream, x.obj, self.device, self.rank, what)
        return DeviceCall(self, x, out, user, host_conns, backoff)

    def through_host(
        self,
        body: Callable[[Any, Any], None],
        x: Buffer,
        out: Buffer | None,
        stream: Any,
        copy_in: bool,
        copy_out: bool,
        rank: int,
    ) -> None:
        """Run the host ``body(hx, ho)`` on pinned copies of device buffers.

        The copies are ordered on the caller's stream (``stream=`` or the current
        one); the host waits for the copy in and runs the host collective; the
        copy out is queued on that stream (see :meth:`_round_trip`).  The pinned
        buffers are kept per size (one collective runs at a time).
        """
        import cupy

        rt = cupy.cuda.runtime
        if int(rt.getDevice()) != self.device:
            with cupy.cuda.Device(self.device):
                self.through_host(body, x, out, stream, copy_in, copy_out, rank)
            return
        user = resolve_stream(stream, x.obj, self.device, rank, "collective")
        hptr, hv, optr, ov = self._host_views(x, out)
        self._round_trip(
            user,
            hptr,
            data_ptr(x.flat),
            x.nbytes if copy_in else 0,
            data_ptr(out.flat) if out is not None else 0,
            optr,
            out.nbytes if out is not None and copy_out else 0,
            lambda: body(hv, ov),
        )

    def _round_trip(
        self,
        stream: int,
        hptr: int,
        src: int,
        in_bytes: int,
        dst: int,
        optr: int,
        out_bytes: int,
        run: Callable[[], Any],
    ) -> Any:
        """Copy ``in_bytes`` from device ``src`` to the mirror at ``hptr`` and wait
        for it, ``run()`` on the host, then queue the copy of ``out_bytes`` from
        the mirror at ``optr`` back to ``dst``, all on ``stream``; returns what
        ``run`` returned.

        The mirrors are reused, so first the last copy back out of them must be
        over: a copy in on the same stream, which the host waits for, comes after
        it; otherwise the host waits for the event recorded after it.
        """
        rt = self._rt()
        back = self._back
        if back is not None:
            if not (in_bytes and back == stream):
                rt.eventSynchronize(self._back_event)
            self._back = None
        if in_bytes:
            rt.memcpyAsync(hptr, src, in_bytes, _D2H, stream)
            rt.streamSynchronize(stream)
        res = run()
        if out_bytes:
            rt.memcpyAsync(dst, optr, out_bytes, _H2D, stream)
            if self._back_event is None:
                self._back_event = rt.eventCreateWithFlags(2)  # cudaEventDisableTiming
            rt.eventRecord(self._back_event, stream)
            self._back = stream
        return res

    def planned(
        self, x: Buffer, out: Buffer | None, copy_in: bool, copy_out: bool
    ) -> tuple[Buffer, Buffer | None, Callable[[Callable[[], Any]], Callable[[], Any]]]:
        """:meth:`through_host` for the communicator's fast path (its plans).

        Returns host Buffers over the pinned mirrors of ``x`` and ``out`` (their
        ``obj`` stays the caller's device array), and ``wrap(run)``: a function
        that runs ``run()`` (the host collective on those mirrors) through
        :meth:`_round_trip` on the caller's current stream (CuPy's or torch's,
        looked up each call).
        """
        import cupy

        hptr, hv, optr, ov = self._host_views(x, out)
        hx = Buffer(x.obj, hv, -1)
        ho = None if out is None else hx if ov is hv else Buffer(out.obj, ov, -1)
        dev, xn, xp = self.device, x.nbytes if copy_in else 0, data_ptr(x.flat)
        on = out.nbytes if out is not None and copy_out else 0
        op_ = data_ptr(out.flat) if out is not None else 0
        if type(x.obj).__module__.split(".", 1)[0] == "torch":
            import torch

            def current() -> int:
                return int(torch.cuda.current_stream(dev).cuda_stream)

        else:
            get = cupy.cuda.get_current_stream

            def current() -> int:
                return int(get().ptr)

        get_device, round_trip = cupy.cuda.runtime.getDevice, self._round_trip

        def wrap(run: Callable[[], Any]) -> Callable[[], Any]:
            def device_run() -> Any:
                if get_device() != dev:
                    with cupy.cuda.Device(dev):
                        return device_run()
                return round_trip(current(), hptr, xp, xn, op_, optr, on, run)

            return device_run

        return hx, ho, wrap

    def _host_views(
        self, x: Buffer, out: Buffer | None
    ) -> tuple[int, np.ndarray, int, np.ndarray | None]:
        """Pinned mirrors of ``x`` and ``out`` as typed host arrays, with their
        addresses: ``(x_ptr, x_view, out_ptr, out_view)``.  When ``out`` starts
        where ``x`` does (in place, or block 0 of an in-place allgather) both are
        views of one mirror, large enough for the larger."""
        dt = x.dtype  # the logical dtype: bfloat16 on the host too
        if out is not None and out.same_memory(x):
            hptr, h = self._mirror(0, max(x.nbytes, out.nbytes))
            hv = h[: x.nbytes].view(dt)
            return hptr, hv, hptr, hv if out is x else h[: out.nbytes].view(out.dtype)
        hptr, h = self._mirror(0, x.nbytes)
        hv = h[: x.nbytes].view(dt)
        if out is None:
            return hptr, hv, 0, None
        optr, o = self._mirror(1, out.nbytes)
        return hptr, hv, optr, o[: out.nbytes].view(out.dtype)

    def _mirror(self, slot: int, nbytes: int) -> tuple[int, np.ndarray]:
        """Pinned host memory of at least ``nbytes`` (kept; grown by powers of two)."""
        have = self._mirrors.get(slot)
        if have is None or len(have[1]) < nbytes:
            import cupy

            size = 1 << max(12, (nbytes - 1).bit_length())
            mem = cupy.cuda.alloc_pinned_memory(size)
            self._mirrors[slot] = have = (mem, np.frombuffer(mem, np.uint8, size))
        return int(have[0].ptr), have[1]

    @staticmethod
    def _rt() -> Any:
        import cupy

        return cupy.cuda.runtime

    def close(self) -> None:
        if self._close is not None:
            self._close()
            self._close = None
        if self._scratch is not None:
            self._scratch.close()
            self._scratch = None
        if self._back is not None:  # the mirrors are freed below
            self._rt().eventSynchronize(self._back_event)
            self._back = None
        if self._back_event is not None:
            self._rt().eventDestroy(self._back_event)
            self._back_event = None
        self._mirrors.clear()
        self.dconns = {}
        if self._pool is not None:
            self._pool.close()
            self._pool = None
        self._stream = None


def resolve_stream(stream: Any, obj: Any, device: int, rank: int, what: str) -> int:
    """The caller's stream as a ``cudaStream_t`` integer.

    Raises:
        InvalidArgumentError: ``stream`` is neither None, an int, a CuPy stream
            (``.ptr``) nor a torch stream (``.cuda_stream``).
    """
    if stream is None:
        if type(obj).__module__.split(".", 1)[0] == "torch":
            import torch

            return int(torch.cuda.current_stream(device).cuda_stream)
        import cupy

        if int(cupy.cuda.runtime.getDevice()) == device:
            return int(cupy.cuda.get_current_stream().ptr)
        with cupy.cuda.Device(device):
            return int(cupy.cuda.get_current_stream().ptr)
    if isinstance(stream, (int, np.integer)) and not isinstance(stream, bool):
        return int(stream)
    for attr in ("ptr", "cuda_stream"):
        v = getattr(stream, attr, None)
        if isinstance(v, int) and not isinstance(v, bool):
            return v
    raise InvalidArgumentError(
        f"rank {rank}: {what}: stream={stream!r} is not a CUDA stream "
        "(pass a cupy.cuda.Stream, a torch.cuda.Stream or a cudaStream_t as an int)"
    )


class DeviceCall:
    """One device collective: the start event now, the body when it runs."""

    def __init__(
        self,
        ctx: GpuContext,
        x: Buffer,
        out: Buffer | None,
        user: int,
        host_conns: dict[int, Connection],
        backoff: Backoff,
    ) -> None:
        import cupy

        self._cp = cupy
        self._rt = cupy.cuda.runtime
        self.ctx = ctx
        self.x = x
        self.out = out
        self.user = user
        self._conns = host_conns
        self._backoff = backoff
        with cupy.cuda.Device(ctx.device):
            self._start = int(self._rt.eventCreateWithFlags(0x2))
            self._rt.eventRecord(self._start, user)

    def links(self, op: ReduceOp | None) -> DeviceLinks:
        ctx = self.ctx
        dt = self.x.dtype
        return DeviceLinks(
            ctx.rank,
            ctx.size,
            self._conns,
            ctx.dconns,
            Deadline.after(ctx.timeout, idle=True),
            ctx.chunk_bytes,
            dt,
            None if op is None else dreduce.reducer(op, dt),
            self._backoff,
            ctx.device,
            ctx.stream(),
            ctx.pool(),
            piece_bytes(ctx.chunk_bytes),
        )

    def windows(self) -> Windows:
        ctx = self.ctx
        return Windows(
            ctx.rank,
            ctx.size,
            ctx.dconns,
            ctx.stream(),
            Deadline.after(ctx.timeout, idle=True),
            ctx.scratch(),
            ctx.shared_device,
        )

    def _run(self, body: Callable[[], Any], host_waits: bool = True) -> Any:
        """Run ``body`` on pycoll's stream, after the caller's stream's earlier work.

        ``host_waits``: the body drives transfers from the host, so the host first
        waits for that work; otherwise (one-sided windows) only the stream waits.
        """
        rt = self._rt
        with self._cp.cuda.Device(self.ctx.device):
            try:
                s = self.ctx.stream()
                if host_waits:
                    rt.eventSynchronize(self._start)  # the stream's earlier work is done
                else:
                    rt.streamWaitEvent(s.ptr, self._start, 0)
                with s:
                    result = body()
                end = int(rt.eventCreateWithFlags(0x2))
                rt.eventRecord(end, s.ptr)
                rt.streamWaitEvent(self.user, end, 0)  # later work waits for us
                rt.eventDestroy(end)  # released once it completes
            finally:
                rt.eventDestroy(self._start)
        return result

    # ----------------------------------------------------------------- bodies
    def allreduce(self, op: ReduceOp, algo: str) -> Any:
        x, out = self.x, self.out
        assert out is not None

        def body() -> None:
            xa, oa = x.flat, out.flat
            if self.ctx.size == 1:
                if data_ptr(oa) != data_ptr(xa):
                    oa[...] = xa
            elif x.count and algo == "direct":
                direct.allreduce(self.windows(), op, x.dtype, xa, oa)
            elif x.count:
                algorithms.get("allreduce", algo)(self.links(op), xa, oa)
            if op is ReduceOp.AVG:
                dreduce.finish_avg(oa, self.ctx.size, x.dtype)

        self._run(body, algo != "direct")
        return out.obj

    def allgather(self, algo: str) -> Any:
        x, out = self.x, self.out
        assert out is not None
        n, r, k = self.ctx.size, self.ctx.rank, x.count

        def body() -> None:
            xa, oa = x.flat, out.flat
            if n > 1 and k and algo == "direct":
                direct.allgather(self.windows(), xa, oa)  # places our own block too
                return
            mine = oa[r * k : (r + 1) * k]
            if k and data_ptr(mine) != data_ptr(xa):
                mine[...] = xa
            if n > 1 and k:
                algorithms.get("allgather", algo)(self.links(None), xa, oa)

        self._run(body, algo != "direct")
        return out.obj

    def broadcast(self, root: int, algo: str) -> Any:
        b = self.x

        def body() -> None:
            if self.ctx.size > 1 and b.count and algo == "direct":
                direct.broadcast(self.windows(), b.flat, root)
            elif self.ctx.size > 1 and b.count:
                algorithms.get("broadcast", algo)(self.links(None), b.flat, root)

        self._run(body, algo != "direct")
        return b.obj

    def reduce_scatter(self, op: ReduceOp, algo: str) -> Any:
        x, out = self.x, self.out
        assert out is not None

        def body() -> None:
            xa, oa = x.flat, out.flat
            if self.ctx.size == 1:
                oa[...] = xa
            elif oa.size and algo == "direct":
                direct.reduce_scatter(self.windows(), op, x.dtype, xa, oa)
            elif oa.size:
                algorithms.get("reduce_scatter", algo)(self.links(op), xa, oa)
            if op is ReduceOp.AVG:
                dreduce.finish_avg(oa, self.ctx.size, x.dtype)

        self._run(body, algo != "direct")
        return out.obj

    def reduce(self, op: ReduceOp, root: int, algo: str) -> Any:
        x, out = self.x, self.out
        is_root = self.ctx.rank == root

        def body() -> None:
            xa = x.flat
            oa = out.flat if out is not None else self._cp.empty_like(xa)
            if self.ctx.size == 1:
                if data_ptr(oa) != data_ptr(xa):
                    oa[...] = xa
            elif x.count and algo == "direct":
                direct.reduce(self.windows(), op, x.dtype, xa, oa, root)
            elif x.count:
                algorithms.get("reduce", algo)(self.links(op), xa, oa, root)
            if op is ReduceOp.AVG and is_root:
                dreduce.finish_avg(oa, self.ctx.size, x.dtype)

        self._run(body, algo != "direct")
        return out.obj if out is not None else None
