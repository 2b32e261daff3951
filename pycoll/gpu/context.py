"""Device collectives: streams, events and the per-collective bodies.

Stream semantics (the mechanics are in :mod:`pycoll.gpu.jobs`):

* A device collective is ordered after the work already queued on the
  caller's stream: the ``stream=`` argument (a CuPy stream, a torch stream or a
  raw ``cudaStream_t`` as an int), else the current stream (torch's for torch
  tensors, CuPy's otherwise).  pycoll's stream waits for an event recorded there.
* Work queued on that stream after a blocking call waits for the collective.
* A blocking call returns once its host part is done: at once for ``direct``
  (one-sided windows: the host waits only for the peers' descriptors), once
  every byte has moved for ``ring``/``tree``, staging and small messages through
  pinned memory (their host drives the transfers, polling CUDA events).
* With ``async_op=True`` the host part runs on the progress thread and the call
  returns at once; ``Request.wait()`` waits for the host part and makes the
  current stream wait for the device work, ``Request.wait(host=True)`` waits for
  that too.
* Buffers stay referenced until their device work is over.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import numpy as np

from pycoll import algorithms
from pycoll.buffers import Buffer, data_ptr
from pycoll.collectives.base import Spec
from pycoll.errors import CollectiveTimeout, InvalidArgumentError
from pycoll.gpu import reduce as dreduce
from pycoll.gpu import windows
from pycoll.gpu.jobs import Gates, Inflight, Job, poll
from pycoll.gpu.links import DeviceLinks
from pycoll.gpu.staging import Pinned, piece_bytes
from pycoll.gpu.windows import Scratch, Windows
from pycoll.reduce import ReduceOp
from transports.base import Backoff, Cap, Connection, Deadline
from transports.cuda_driver import stream_idle

log = logging.getLogger(__name__)

_D2H, _H2D = 2, 1  # cudaMemcpyDeviceToHost, cudaMemcpyHostToDevice
_NOT_READY = 600  # cudaErrorNotReady


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
        # the stream of the last copy back out of the mirrors; _back_event is
        # recorded after it (a call on another stream waits for it on the device)
        self._back: int | None = None
        self._back_event: Any = None
        # made now: making them synchronizes the device, which no call may do
        self._gates, self._gates_mem = Gates.on_device(device)
        # the words by which pycoll's stream waits for the caller's (see DeviceCall)
        self._starts, self._starts_mem = Gates.on_device(device)
        #: calls return at once, the caller's stream waiting for a gate (see
        #: pycoll.gpu.jobs); off: a closed gate deadlocks with the loading of a
        #: CUDA module (CuPy's kernels at their first use) on any thread of any
        #: rank whose collective the gate waits for, seen on an H200
        self.gated = False
        self._copy: Any = None  # see copy_stream
        #: the jobs whose device work may not be over (they keep their buffers)
        self.inflight = Inflight(self._rt(), timeout, rank)

    def kind(self, peer: int, host_conns: dict[int, Connection], host_kinds: dict[int, str]) -> str:
        """How device bytes reach ``peer``: "cuda_ipc", "rdma:gdr", ... or "staged:shm"."""
        if peer == self.rank:
            return "self"
        if peer in self.dconns:
            return self.kinds[peer]
        c = host_conns.get(peer)
        if c is not None and Cap.DEVICE in c.caps:
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
        async_op: bool,
        tag_of: Callable[[], int],
    ) -> DeviceCall:
        """Validate and start a device collective (see :class:`DeviceCall`);
        ``tag_of()``: the running call's tag, once its engine has numbered it.

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
        return DeviceCall(self, x, out, user, host_conns, backoff, async_op, tag_of)

    def gates(self) -> Gates:
        assert self._gates is not None, "the context is closed"
        return self._gates

    def starts(self) -> Gates:
        assert self._starts_mem is not None, "the context is closed"
        return self._starts

    def copy_stream(self) -> int:
        """The stream of asynchronous calls' copies back and retire events (only
        the caller's thread enqueues there, never the progress thread)."""
        if self._copy is None:
            import cupy

            with cupy.cuda.Device(self.device):
                self._copy = cupy.cuda.Stream(non_blocking=True)
        return int(self._copy.ptr)

    def through_host(
        self,
        x: Buffer,
        out: Buffer | None,
        stream: Any,
        copy_in: bool,
        copy_out: bool,
        async_op: bool,
    ) -> HostJob:
        """Start a collective on pinned copies of device buffers (see :class:`HostJob`).

        The copy in, the wait for the host collective and the copy out are
        enqueued now, on the caller's stream (``stream=`` or the current one);
        the progress thread runs the host collective with :meth:`HostJob.run`.
        """
        import cupy

        if int(cupy.cuda.runtime.getDevice()) != self.device:
            with cupy.cuda.Device(self.device):
                return self.through_host(x, out, stream, copy_in, copy_out, async_op)
        user = resolve_stream(stream, x.obj, self.device, self.rank, "collective")
        hptr, hv, optr, ov = self._host_views(x, out)
        job = HostJob(self, user, async_op, hv, ov)
        job.keep += [x.obj, None if out is None else out.obj, *self._mirrors.values()]
        try:
            job.enqueue(
                hptr,
                data_ptr(x.flat),
                x.nbytes if copy_in else 0,
                data_ptr(out.flat) if out is not None else 0,
                optr,
                out.nbytes if out is not None and copy_out else 0,
            )
            self.inflight.add(job)
        except BaseException:
            job.settle()  # no stream may wait for a job that will not run
            raise
        return job

    def _host_views(
        self, x: Buffer, out: Buffer | None
    ) -> tuple[int, np.ndarray, int, np.ndarray | None]:
        """Pinned mirrors of ``x`` and ``out`` as typed host arrays, with their
        addresses: ``(x_ptr, x_view, out_ptr, out_view)``.  Where one lies inside
        the other (in place: the same memory, or this rank's block of an
        allgather's output, or of a reduce_scatter's input) both are views of one
        mirror, at the same distance apart: the host collective sees the same
        aliasing as the caller's call (its envelope skips the own block, say)."""
        dt = x.dtype  # the logical dtype: bfloat16 on the host too
        if out is not None and out.device == x.device:
            at = data_ptr(x.flat) - data_ptr(out.flat)  # x's offset in out
            if 0 <= at and at + x.nbytes <= out.nbytes:
                hptr, h = self._mirror(0, out.nbytes)
                hv = h[at : at + x.nbytes].view(dt)
                return hptr + at, hv, hptr, hv if out is x else h[: out.nbytes].view(out.dtype)
            if 0 <= -at and -at + out.nbytes <= x.nbytes:  # out inside x
                hptr, h = self._mirror(0, x.nbytes)
                ov = h[-at : -at + out.nbytes].view(out.dtype)
                return hptr, h[: x.nbytes].view(dt), hptr - at, ov
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

    def announce_closed(self, cause: int | None) -> None:
        """After a failure that closes the host connections: the device peers see
        this rank closed too (because rank ``cause`` failed), so their next
        exposure or wait on it raises now, not when its slots run out or the
        timeout passes; the connections themselves close with the context."""
        for c in self.dconns.values():
            c.announce_close(cause)

    def close(self) -> Exception | None:
        """Release everything; first open the gates of jobs that never ran and wait
        (bounded by the timeout) for the device work of the others to end.
        Returns the first failure a connection saw after its call had returned
        (a stream let go: :meth:`~transports.base.Connection.stream_failure`)."""
        self.inflight.close()
        conns = list(self.dconns.values())
        if self._close is not None:
            self._close()
            self._close = None
        lost = next((e for e in (c.stream_failure() for c in conns) if e is not None), None)
        if self._scratch is not None:
            self._scratch.close()
            self._scratch = None
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
        self._copy = None
        self._gates_mem = None
        self._starts_mem = None
        return lost


class HostJob(Job):
    """A device collective through pinned host memory (small messages with ``auto``).

    On the caller's thread (:meth:`enqueue`), on the caller's stream: a wait for
    the last copy out of the mirrors where that ran on another stream, the copy of
    the input into its pinned mirror and the event ``ready``; then, on the same
    stream (a blocking call) or on the copy stream (``async_op``, so that the
    caller's stream runs on until ``Request.wait``): the wait for the gate, the
    copy of the output back and the retire event.  On the progress thread
    (:meth:`run`): wait (polling, bounded by the timeout) for ``ready``, run the
    host collective on the mirrors, open the gate.

    Ungated (see :mod:`pycoll.gpu.jobs`), :meth:`run` does it all: the copy in,
    the wait for it, the host collective and the copy out.

    The mirrors are the context's, reused by the next call: its copy in is
    queued after this call's copy out (on the same stream, or after
    ``_back_event``), and the host collective of the next call starts only once
    that copy in is done.
    """

    def __init__(
        self, ctx: GpuContext, user: int, async_op: bool, hv: np.ndarray, ov: np.ndarray | None
    ) -> None:
        super().__init__(ctx.gates(), ctx._rt(), ctx.gated)
        self.ctx = ctx
        self.user = user
        self.async_op = async_op
        self.hv, self.ov = hv, ov
        self.ready = 0
        self._copies = (0, 0, 0, 0, 0, 0)

    def enqueue(
        self, hptr: int, src: int, in_bytes: int, dst: int, optr: int, out_bytes: int
    ) -> None:
        """The caller's side (gated; an ungated job does it all in :meth:`run`)."""
        self._copies = (hptr, src, in_bytes, dst, optr, out_bytes)
        if self.gated:
            self._copy_in()
            self._copy_out()

    def _copy_in(self) -> None:
        rt, ctx, user = self._rt, self.ctx, self.user
        hptr, src, in_bytes = self._copies[:3]
        if ctx._back is not None and ctx._back != user:
            rt.streamWaitEvent(user, ctx._back_event, 0)
        if in_bytes:
            rt.memcpyAsync(hptr, src, in_bytes, _D2H, user)
        self.ready = self.event(user)

    def _copy_out(self) -> None:
        rt, ctx = self._rt, self.ctx
        dst, optr, out_bytes = self._copies[3:]
        back = ctx.copy_stream() if self.async_op else self.user
        if self.gated:
            self.gates.wait(back, self.seq)
        if out_bytes:
            rt.memcpyAsync(dst, optr, out_bytes, _H2D, back)
        if ctx._back_event is None:
            ctx._back_event = rt.eventCreateWithFlags(2)  # cudaEventDisableTiming
        rt.eventRecord(ctx._back_event, back)
        ctx._back = back
        self.retire = self.event(back)

    def run(self, body: Callable[[Any, Any], None]) -> None:
        """The progress thread's part (an ungated job's whole): the host collective
        ``body(hx, ho)``."""
        import cupy

        rt, ctx = self._rt, self.ctx
        with cupy.cuda.Device(ctx.device):
            if not self.gated:
                self._copy_in()
            poll(
                lambda: rt.eventQuery(self.ready) != _NOT_READY,
                ctx.timeout,
                lambda: CollectiveTimeout(
                    f"rank {ctx.rank}: the work queued on the stream before a device "
                    f"collective did not finish within {ctx.timeout:g} s (PYCOLL_TIMEOUT)",
                    rank=ctx.rank,
                ),
            )
            body(self.hv, self.ov)
            if self.gated:
                self.gates.open_now(self.seq)
            else:
                self._copy_out()
            self.opened = True

    def stream_wait(self, stream: int) -> None:
        self._rt.streamWaitEvent(stream, self.retire, 0)


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


class DeviceCall(Job):
    """One device collective through the device algorithms (see :mod:`pycoll.gpu.jobs`).

    On the caller's thread (here): the start word written on the caller's
    stream (none where that stream is idle and no earlier call is in flight),
    then the wait for the gate and the retire event on that stream (a
    blocking call) or on the copy stream (``async_op``).  On the progress thread
    (the collective bodies below): pycoll's stream waits for the start word, the
    algorithm runs on it, and the gate opens after its last work.  Ungated (see
    :mod:`pycoll.gpu.jobs`), a blocking call's host part runs before it returns,
    and then the caller's stream waits for the gate.

    The two streams meet through words (``cuStreamWriteValue32`` and
    ``cuStreamWaitValue32``), not events.  Where ranks share a GPU, a stream
    blocked on an event while its collective waits for another process kept
    the GPU for a whole time slice: on the H200 at n = 2, a 1 MiB direct
    allreduce took 2.1-4.5 ms of GPU time with events between the streams
    against 0.3 ms with words (``benchmarks/RESULTS.md``).
    """

    def __init__(
        self,
        ctx: GpuContext,
        x: Buffer,
        out: Buffer | None,
        user: int,
        host_conns: dict[int, Connection],
        backoff: Backoff,
        async_op: bool,
        tag_of: Callable[[], int],
    ) -> None:
        import cupy

        super().__init__(ctx.gates(), cupy.cuda.runtime, ctx.gated)
        self._cp = cupy
        self.async_op = async_op
        #: the running call's tag (its engine's, read when the call runs), which
        #: the windows' exposures and the links' pieces carry
        self.tag_of = tag_of
        self.ctx = ctx
        self.x = x
        self.out = out
        self.user = user
        self._conns = host_conns
        self._backoff = backoff
        self.keep += [x.obj, None if out is None else out.obj]
        with cupy.cuda.Device(ctx.device):
            # Nothing queued before the call, on the caller's stream or by an earlier
            # call: pycoll's stream has nothing to wait for, and stays idle until the
            # collective's own work (a window exposed then is signaled by the host,
            # transports/cuda_ipc/windows.py).  Else it waits for the start word.
            ctx.inflight.reap()
            self.hop = bool(len(ctx.inflight)) or not stream_idle(user)
            if self.hop:
                ctx.starts().open(user, self.seq)
            if not self.gated:  # see _run
                ctx.inflight.add(self)
                return
            after = ctx.copy_stream() if async_op else user
            self.gates.wait(after, self.seq)
            try:
                self.retire = self.event(after)
                ctx.inflight.add(self)
            except BaseException:
                self.settle()  # no stream may wait for a job that will not run
                raise

    def links(self, op: ReduceOp | None) -> DeviceLinks:
        ctx = self.ctx
        dt = self.x.dtype
        L = DeviceLinks(
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
        L.tag = self.tag_of()  # its pieces carry the call's tag, on every path
        return L

    def windows(self) -> Windows:
        ctx = self.ctx
        W = Windows(
            ctx.rank,
            ctx.size,
            ctx.dconns,
            ctx.stream(),
            Deadline.after(ctx.timeout, idle=True),
            ctx.scratch(),
            ctx.shared_device,
        )
        W.tag = self.tag_of()
        return W

    def _run(self, body: Callable[[], Any]) -> Any:
        """Run ``body`` on pycoll's stream, after the caller's stream's earlier work,
        and open the gate after it (the progress thread's part)."""
        with self._cp.cuda.Device(self.ctx.device):
            s = self.ctx.stream()
            if self.hop:
                self.ctx.starts().wait(s.ptr, self.seq)
            with s:
                result = body()
            if self.gated:
                self.open_after(s.ptr)
            else:  # the caller's stream waits for our work: the gate's word
                end = self.event(s.ptr)
                if not self.async_op:
                    self.open_after(s.ptr)
                    self.gates.wait(self.user, self.seq)
                self.retire = end
                self.opened = True
        return result

    # ----------------------------------------------------------------- the call
    def runner(self, spec: Spec, algo: str) -> Callable[[], Any]:
        """What the worker runs for call ``spec`` by ``algo``: the collective's
        envelope (:meth:`pycoll.collectives.base.Collective.envelope`) around the
        device algorithm, on pycoll's stream."""
        prepare = self.prepare(spec, algo)
        x, out = spec.x, spec.out

        def run() -> Any:
            self._run(lambda: prepare(x.flat, None if out is None else out.flat)())
            return spec.result

        return run

    def prepare(self, spec: Spec, algo: str, W: Windows | None = None) -> Any:
        """The collective's envelope around the device algorithm ``algo``
        (``W``: the windows every call of ``direct`` uses, else fresh ones)."""
        coll = spec.coll
        if algo == "direct" and coll.name == "allgather":
            spec = replace(spec, in_place=True)  # the windows write our own block too
        return coll.envelope(spec, self._step(spec, algo, W), self)

    def _step(
        self, spec: Spec, algo: str, W: Windows | None = None
    ) -> Callable[[Any, Any], None] | None:
        """``step(x, out)``: the device algorithm ``algo`` of ``spec``'s collective;
        None where nothing moves (one rank, no bytes; a v-variant's rank with no
        bytes of its own still relays the others')."""
        coll, op = spec.coll, spec.op
        if not coll.moves(spec):
            return None
        if algo == "direct":  # one-sided windows (pycoll.gpu.windows)
            fn = getattr(windows, coll.name)
            pre = (op, spec.x.dtype) if coll.reduces else ()
            win = self.windows if W is None else (lambda: W)
            return lambda a, b: fn(win(), *pre, *coll.args(spec, a, b))
        g = algorithms.get(coll.name, algo)
        return lambda a, b: g(self.links(op), *coll.args(spec, a, b))

    # ArrayOps (pycoll.collectives.base) on device arrays
    @staticmethod
    def finish_avg(out: Any, n: int, dtype: np.dtype[Any]) -> None:
        dreduce.finish_avg(out, n, dtype)

    def empty_like(self, a: Any) -> Any:
        return self._cp.empty_like(a)

    @staticmethod
    def copy(dst: Any, src: Any) -> None:
        dst[...] = src
