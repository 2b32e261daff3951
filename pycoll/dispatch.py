"""From a public call to the engine: the path of every collective.

1. **Fast entry.** A blocking call on arrays the replay cache knows runs its
   plan or its kind (:mod:`pycoll.plans`); the plan's key is made here once.
   A :class:`Prepared` call holds its plan and skips even that lookup.  Where
   it was built, the compiled entry (:mod:`pycoll._replay`, the public
   methods' :attr:`Dispatch.entry`) runs a plan of NumPy arrays before any
   of this, and hands every other call to :meth:`Dispatch.call`.
2. **Slow path.** Otherwise the collective checks the call into a
   :class:`~pycoll.collectives.base.Spec` (raising before any byte moves), the
   policy picks the algorithm (:mod:`pycoll.policy`), and the call runs:
   device buffers on the device (:mod:`pycoll.gpu.context`) or through pinned
   host copies; host buffers by a new plan (blocking calls on NumPy arrays,
   then replayed), or as one call (:meth:`Dispatch.staged`).

A call rejected for its arguments still takes a sequence number
(:meth:`pycoll.engine.Engine.reject`), so the ranks' numbering stays in step.
"""

from __future__ import annotations

from _thread import get_ident
from typing import Any

import numpy as np

from pycoll.buffers import is_torch
from pycoll.collectives.base import HOST, Collective, Spec
from pycoll.engine import Engine
from pycoll.errors import InvalidArgumentError
from pycoll.gpu.replay import DEVICE_PLANS_MAX, DevicePlan
from pycoll.guard import Call
from pycoll.plans import PLAN_MAX_BYTES
from pycoll.policy import Policy


class Dispatch:
    """Runs the calls of one communicator (see the module docstring).

    Args:
        engine, policy: the communicator's.
        gpu: its device side (:class:`pycoll.gpu.context.GpuContext`), or None.
        device: device buffers may take the device algorithms (else they go
            through pinned host memory and the host algorithms).
    """

    def __init__(self, engine: Engine, policy: Policy, gpu: Any, device: bool = True) -> None:
        self.engine = engine
        self.device = device and gpu is not None  # else device buffers go through the host
        self._fam = engine.fam
        self.policy = policy
        self.gpu = gpu
        self.size = engine.size
        self.rank = engine.rank
        self._plans = engine.plans.plans
        self._weak = engine.plans.weak_plans
        self._known_kind = engine.plans.known_kind
        self._device_plans = engine.plans.device_plans
        self._replay = engine.replay
        #: the public methods' entry: :meth:`call` behind the compiled entry
        #: where it was built (:meth:`pycoll.engine.Engine.entry`)
        self.entry = engine.entry(self.call)

    def call(
        self,
        coll: Collective,
        sendbuf: Any,
        recvbuf: Any,
        op: Any,
        root: Any,
        algorithm: Any,
        async_op: bool,
        stream: Any,
    ) -> Any:
        """Run one call of ``coll``: replayed if the cache knows it, else the slow path."""
        k = None
        if not async_op and not self._fam.inflight and type(root) is int:
            try:
                # the one key of a call's plan (:class:`pycoll.plans.Plan`), made
                # here once and handed to the slow path, which keeps plans by it
                k = (coll, id(sendbuf), id(recvbuf), op, root, algorithm)
                dp = self._device_plans.get(k) if self._device_plans else None
                p = None if stream is not None else self._plans.get(k) or self._weak.get(k)
            except TypeError:  # unhashable op or algorithm: the slow path says why
                k = p = dp = None
            if dp is not None and dp.fits(sendbuf, recvbuf, stream):
                return self._replay(dp, sendbuf, recvbuf)
            if p is not None and p.fits(sendbuf, recvbuf) and get_ident() == p.tid:
                return self._replay(p, sendbuf, recvbuf)
            if k is not None and stream is None:
                kd = self._known_kind((coll, op, root, algorithm), sendbuf, recvbuf)
                if kd is not None:
                    return self._replay(kd, sendbuf, recvbuf)
        return self._checked(coll, k, sendbuf, recvbuf, op, root, algorithm, async_op, stream)

    def prepare(
        self, coll: Collective, sendbuf: Any, recvbuf: Any, op: Any, root: Any, algorithm: Any
    ) -> Prepared:
        """A :class:`Prepared` call of ``coll`` on these arrays."""
        return Prepared(self, coll, sendbuf, recvbuf, op, root, algorithm)

    def call_v(
        self,
        coll: Collective,
        sendbuf: Any,
        recvbuf: Any,
        counts: Any,
        op: Any,
        async_op: bool,
        stream: Any,
    ) -> Any:
        """Run one call of a v-variant (``counts``: its element counts), by the slow path."""
        return self._checked(coll, None, sendbuf, recvbuf, op, 0, "auto", async_op, stream, counts)

    def _checked(self, coll: Collective, *args: Any) -> Any:
        """The slow path; a call rejected for its arguments still takes its number."""
        try:
            return self._slow(coll, *args)
        except InvalidArgumentError as exc:
            if not getattr(exc, "_counted", False):  # else the engine counted it
                self.engine.reject(coll.name)
            raise

    def _slow(
        self,
        coll: Collective,
        k: tuple[Any, ...] | None,
        sendbuf: Any,
        recvbuf: Any,
        op: Any,
        root: Any,
        algorithm: Any,
        async_op: bool,
        stream: Any,
        extra: Any = None,
    ) -> Any:
        """The slow path (a method of its own, apart from the fast entry, so that
        the closures made here cost a replayed call nothing)."""
        eng, policy, what = self.engine, self.policy, coll.name
        eng.check_open(what)
        spec = coll.check(self.size, self.rank, sendbuf, recvbuf, op, root, extra)
        algo = policy.algorithm(what, algorithm, spec.nbytes)
        x = spec.x
        if x.is_device and self.device and not policy.via_host(what, algorithm, spec.nbytes):
            out = spec.out
            if x.obj is not sendbuf or not (
                out is None or out.obj is (sendbuf if recvbuf is None else recvbuf)
            ):
                k = None  # a plan holds, and is found by, the caller's own arrays (no fresh output)
            algo = policy.device(coll, algorithm, algo)
            return self._device(spec, algo, async_op, stream, k, recvbuf)
        tuner = policy.tuner(what, algorithm, spec.nbytes, x.dtype, spec.op, spec.root)
        algo, run_algo = policy.host(what, algo, tuner)
        call = self._record(spec, algo)
        if k is not None and self._plannable(async_op, stream, spec, sendbuf):
            plans = eng.plans
            step = None
            if coll.moves(spec):
                step = plans.step((what, algo, x.dtype, spec.op, spec.fp_count, spec.root, tuner))
            p = plans.make_plan(k, spec, sendbuf, recvbuf, coll.envelope(spec, step, HOST), call)
            plans.add_kind(
                (coll, op, root, algorithm),
                sendbuf,
                recvbuf,
                spec,
                lambda s: coll.envelope(s, step, HOST),
                call,
                lambda s: coll.entry_form(s, step),
            )
            return eng.replay(p, sendbuf, recvbuf)
        step = None
        if coll.moves(spec):

            def step(a: Any, b: Any) -> None:
                run_algo(eng.links(x.dtype, spec.op), *coll.args(spec, a, b))

        prepare = coll.envelope(spec, step, HOST)
        return self.staged(spec, lambda xa, oa: prepare(xa, oa)(), call, async_op, stream)

    def _record(self, spec: Spec, algo: str) -> Call:
        """What the engine numbers, tags and records for call ``spec`` run by ``algo``."""
        x = spec.x
        return Call(
            spec.coll.name,
            spec.fp_count,
            x.dtype,
            spec.op,
            spec.root,
            algo,
            self.engine.ctx,
            spec.layout,
        )

    def _plannable(self, async_op: bool, stream: Any, spec: Spec, sendbuf: Any) -> bool:
        """Whether this call may become a plan: a blocking call on host arrays with
        nothing queued.  NumPy arrays of any size (the large ones make weak
        plans); torch CPU tensors up to :data:`PLAN_MAX_BYTES` into an output the
        caller gave, checked by signature (a plan holds them).  Other buffers
        (memoryview, bytearray, ...) never: no export of theirs outlives the
        call, so a bytearray stays resizable."""
        x, out = spec.x, spec.out
        if (
            not spec.coll.plannable
            or x.obj is not sendbuf  # a plan is found by sendbuf: it must hold that
            or async_op
            or stream is not None
            or self.engine.config.check
            or self._fam.inflight
            or x.is_device
        ):
            return False
        if isinstance(x.obj, np.ndarray) and (out is None or isinstance(out.obj, np.ndarray)):
            return True
        return (
            spec.coll.fresh_shape(spec) is None
            and x.nbytes <= PLAN_MAX_BYTES
            and is_torch(x.obj)
            and (out is None or (is_torch(out.obj) and out.nbytes <= PLAN_MAX_BYTES))
        )

    def staged(self, spec: Spec, body: Any, call: Call, async_op: bool, stream: Any) -> Any:
        """Submit the host collective ``body(x, out)``: on host arrays themselves;
        device buffers go through pinned copies ordered on ``stream`` (a job of
        the worker, :meth:`GpuContext.through_host`) when this rank has a GPU
        context, else through plain host copies."""
        eng, x, out, result = self.engine, spec.x, spec.out, spec.result
        copy_in, copy_out = spec.coll.staging(spec)
        ident = spec.coll.ident
        if x.is_device and self.gpu is not None:
            job = self.gpu.through_host(x, out, stream, copy_in, copy_out, async_op)
            return eng.submit_device(
                job, lambda: job.run(body), result, async_op, call, ident, self.gpu, x.obj
            )

        def run() -> Any:
            if not x.is_device:
                body(x.flat, None if out is None else out.flat)
                return result
            hx = x.flat.get() if copy_in else np.empty(x.count, x.dtype)
            if out is None:
                ho = None
            elif out.same_memory(x):
                ho = hx
            else:
                ho = np.empty(out.count, out.dtype)
            body(hx, ho)
            if out is not None and copy_out:
                out.flat.set(ho)
            return result

        return eng.submit(run, async_op, call, ident)

    def _device(
        self,
        spec: Spec,
        algo: str,
        async_op: bool,
        stream: Any,
        k: tuple[Any, ...] | None = None,
        recvbuf: Any = None,
    ) -> Any:
        """A collective on device buffers, by the device algorithms; a blocking
        call that may run again as a device plan (``k``: its key; ``recvbuf``:
        the caller's) leaves one."""
        eng, gpu, x = self.engine, self.gpu, spec.x
        dc = gpu.call(
            spec.coll.name, x, spec.out, stream, eng.conns, eng.fam.polite, async_op, eng.call_tag
        )
        run = dc.runner(spec, algo)
        call = self._record(spec, algo)
        result = eng.submit_device(
            dc, run, spec.result, async_op, call, spec.coll.ident, gpu, x.obj
        )
        if (
            k is not None
            and not async_op
            and not eng.config.check
            and DevicePlan.eligible(gpu, spec, algo, stream)
        ):
            plan = DevicePlan(gpu, dc, spec, algo, call, recvbuf, stream)
            eng.plans.add_device_plan(k, plan, DEVICE_PLANS_MAX)
        return result


class Prepared:
    """One blocking collective call on fixed arrays, made once and run by calling
    it, as MPI 4's persistent collectives (``MPI_Allreduce_init``) are:
    ``h = comm.prepare("allreduce", x)`` then ``h()`` does what
    ``comm.allreduce(x)`` does, arrays' contents read afresh each time.

    The first call is an ordinary one (checked, planned); later ones run the
    plan it left in the replay cache straight away, skipping the public method
    and the cache lookup (:meth:`Dispatch.call`), while that plan is good: the
    cache was not cleared since (a close or a failure clears it), no
    asynchronous call is in flight, the arrays still look as they did, and
    the same thread calls.  Otherwise it is an ordinary call again, which also
    raises what such a call raises.  Calls without a plan (device buffers,
    torch tensors beyond what plans hold, a barrier) are always ordinary
    ones.  Where the compiled entry was built
    (:mod:`pycoll._replay`), a call with a plan goes through it instead: it
    finds the plan by the key of the last call faster than these checks run.
    """

    __slots__ = (
        "_args",
        "_dispatch",
        "_entry",
        "_epoch",
        "_key",
        "_o",
        "_plan",
        "_x",
        "collective",
    )

    def __init__(
        self,
        dispatch: Dispatch,
        coll: Collective,
        sendbuf: Any,
        recvbuf: Any,
        op: Any,
        root: Any,
        algorithm: Any,
    ) -> None:
        self._dispatch = dispatch
        self._args = (coll, sendbuf, recvbuf, op, root, algorithm)
        try:  # Dispatch.call's key of the call's plan
            self._key: tuple[Any, ...] | None = (
                coll,
                id(sendbuf),
                id(recvbuf),
                op,
                root,
                algorithm,
            )
            hash(self._key)
        except TypeError:  # an unhashable op or algorithm: the call says why
            self._key = None
        self._plan: Any = None
        self._epoch = -1
        self._x, self._o = sendbuf, recvbuf
        self.collective: str = coll.name
        # the compiled entry finds a plan faster than the checks below
        self._entry = None if dispatch.entry == dispatch.call else dispatch.entry

    def __call__(self) -> Any:
        e = self._entry
        if e is not None and self._plan is not None:  # the entry finds it faster
            coll, x, o, op, root, algorithm = self._args
            return e(coll, x, o, op, root, algorithm, False, None)
        d = self._dispatch
        p = self._plan
        if (
            p is not None
            and self._epoch == d.engine.plans.epoch
            and not d._fam.inflight
            and p.fits(self._x, self._o)
            and get_ident() == p.tid
        ):
            return d._replay(p, self._x, self._o)
        coll, x, o, op, root, algorithm = self._args
        result = d.call(coll, x, o, op, root, algorithm, False, None)
        k = self._key
        if k is not None:
            self._plan = d._plans.get(k) or d._weak.get(k)
            self._epoch = d.engine.plans.epoch
        return result
