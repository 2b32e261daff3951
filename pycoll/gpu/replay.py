"""Device plans: a blocking ``direct`` collective called again on the same CuPy
arrays and stream runs without its checks, as host plans do (:mod:`pycoll.plans`).

A blocking call's host part on a shared GPU is short (expose or open the
windows, one kernel, a few stream words), and the checks, the policy and the
setup of a call around it cost more than it: on the H200 at n = 2, a 1 MiB
allreduce spent about 55 us before its windows and 12 after them, of 118
(``benchmarks/RESULTS.md``).  A plan keeps what a call works out once and for
all: the checked :class:`~pycoll.collectives.base.Spec`, the algorithm, the
collective's envelope around it and windows that keep their spans, IPC handles
and peer views (:class:`~pycoll.gpu.windows.KeptWindows`).  A replay redoes
what may differ from call to call, as the first call does it:

* the caller's stream, its device and the arrays' shapes must be the plan's
  (else the call takes the slow path, and makes a plan of its own);
* the windows' handshakes with the peers, which check the sizes a peer
  exposed whenever its spans differ from the last ones;
* the engine's numbering and record of the call, and its failure handling.

A replay enqueues its work on the caller's stream itself, where an ordinary
call hops to pycoll's stream and back through stream words (and an event that
retires its job): the plan holds its arrays, and a blocking call's host part
is over when it returns, so nothing else needs that stream.  The windows order
their words across the two streams (``transports/cuda_ipc/windows.py``).

A plan is made only where every rank uses one GPU and the windows expose the
arrays themselves (no scratch copies), for CuPy arrays on a CuPy stream (the
torch backend hands pycoll kept CuPy views of its tensors and CuPy streams of
its streams, :mod:`pycoll.torch_backend.kept`), with ``PYCOLL_CHECK`` off.  It holds its arrays:
:data:`DEVICE_PLANS_MAX` plans at most per communicator, the oldest dropped
first, all of them on ``close()`` or a failure; a dropped plan's arrays are held
on until the work it queued is over (:meth:`DevicePlan.drop`).
"""

from __future__ import annotations

from _thread import get_ident
from typing import Any

from pycoll.errors import InvalidArgumentError
from pycoll.gpu import reduce as dreduce
from pycoll.gpu.context import resolve_stream
from pycoll.gpu.jobs import Job
from pycoll.gpu.windows import KeptWindows
from transports.base import Deadline

#: Device plans kept per communicator; each holds its arrays' memory.
DEVICE_PLANS_MAX = 16

#: The collectives whose ``direct`` algorithm a plan replays.
PLANNED = frozenset(("allreduce", "allgather", "reduce_scatter", "broadcast", "reduce"))


def _stream_types(cupy: Any) -> tuple[type, ...]:
    """CuPy's stream classes (``ExternalStream`` is not a ``Stream``)."""
    names = ("Stream", "ExternalStream")
    base = getattr(cupy.cuda.stream, "BaseStream", None)
    return tuple(getattr(cupy.cuda, n) for n in names if hasattr(cupy.cuda, n)) + (
        (base,) if isinstance(base, type) else ()
    )


class DevicePlan:
    """One blocking ``direct`` call of a collective, kept to run again (see the module).

    Args:
        ctx: the communicator's :class:`~pycoll.gpu.context.GpuContext`.
        dc: the :class:`~pycoll.gpu.context.DeviceCall` of the call that made it.
        spec, algo, call: that call's checked spec, algorithm and record.
        recvbuf, stream: its ``recvbuf`` and ``stream`` arguments.
    """

    __slots__ = (
        "_W",
        "_body",
        "_cp",
        "_ctx",
        "_hold",
        "_s",
        "_shapes",
        "_tag_of",
        "call",
        "result",
        "tid",
        "user",
    )

    def __init__(
        self, ctx: Any, dc: Any, spec: Any, algo: str, call: Any, recvbuf: Any, stream: Any
    ) -> None:
        import cupy

        self._ctx = ctx
        self.call = call
        self.user = dc.user
        self._tag_of = dc.tag_of
        # the caller's CuPy stream, held: a stream destroyed under a plan would
        # take its work (and drop()'s event) with it
        self._s = cupy.cuda.get_current_stream() if stream is None else stream
        self.tid = get_ident()
        x, out = spec.x, spec.out
        self._W = KeptWindows(
            ctx.rank,
            ctx.size,
            ctx.dconns,
            self._s,
            Deadline.after(ctx.timeout, idle=True),
            ctx.scratch(),
            ctx.shared_device,
        )
        if spec.coll.name == "allreduce":  # its kernel, loaded now (see nary_load)
            dreduce.nary_load(spec.op, x.dtype, ctx.size, ctx.size)
        prepare = dc.prepare(spec, algo, self._W)
        self._body = prepare(x.flat, None if out is None else out.flat)
        self.result = spec.result
        self._hold = (x.obj, x.flat) if out is None else (x.obj, x.flat, out.obj, out.flat)
        self._shapes = (x.obj.shape, None if recvbuf is None else recvbuf.shape)
        self._cp = cupy

    @staticmethod
    def eligible(ctx: Any, spec: Any, algo: str, stream: Any) -> bool:
        """Whether a call of ``spec`` by ``algo`` on ``stream`` may become a plan
        (see the module): on CuPy's current stream or a CuPy stream, which the
        plan holds and runs on (a raw ``cudaStream_t`` holds nothing)."""
        import cupy

        x, out = spec.x, spec.out
        if (
            algo != "direct"
            or not (stream is None or isinstance(stream, _stream_types(cupy)))
            or spec.coll.name not in PLANNED
            or not ctx.shared_device
            or ctx.gated
            or type(x.obj) is not cupy.ndarray
            or (out is not None and type(out.obj) is not cupy.ndarray)
        ):
            return False
        sc = ctx.scratch()
        return all(
            b is None or not b.nbytes or sc.shareable(int(b.flat.data.ptr)) for b in (x, out)
        )

    def fits(self, sendbuf: Any, recvbuf: Any, stream: Any) -> bool:
        """Whether a call on these arrays (the plan's, by identity) and ``stream``
        (as :func:`~pycoll.gpu.context.resolve_stream` takes it) is the plan's:
        same thread, current device, stream and shapes."""
        ctx = self._ctx
        if get_ident() != self.tid or self._cp.cuda.runtime.getDevice() != ctx.device:
            return False
        try:
            user = resolve_stream(stream, sendbuf, ctx.device, ctx.rank, "")
        except InvalidArgumentError:  # the slow path raises it, the call counted
            return False
        return user == self.user and self._shapes == (
            sendbuf.shape,
            None if recvbuf is None else recvbuf.shape,
        )

    def run(self, sendbuf: Any, recvbuf: Any) -> Any:
        """Run the call again, on the caller's stream (its engine's
        :meth:`~pycoll.engine.Engine.replay` numbers and records it)."""
        self._W.deadline = Deadline.after(self._ctx.timeout, idle=True)
        self._W.tag = self._tag_of()  # its engine numbered this call
        with self._s:
            self._body()
        return self.result

    def drop(self) -> None:
        """The plan is forgotten: its arrays stay held until the work it queued on
        its stream is over (as an ordinary call's job holds them)."""
        ctx = self._ctx
        if ctx._gates_mem is None:  # closed: its device work is over, or abandoned
            return
        job = Job(ctx.gates(), ctx._rt(), False)
        job.keep.append(self._hold)
        job.retire = job.event(self.user)
        job.opened = True
        ctx.inflight.add(job)
