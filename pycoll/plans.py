"""The replay cache: validated blocking host calls, run again without their checks.

The second and later calls of a collective on the same NumPy arrays with the
same arguments replay a :class:`Plan`; a call on fresh arrays of a known dtype,
shape and strides runs by its :class:`Kind`.  Both are made by the slow path
(:mod:`pycoll.dispatch`) from the call's :class:`~pycoll.collectives.base.Spec`
and its collective's envelope, so the fast path runs exactly what the slow path
would, minus the checks whose outcome cannot have changed.

Everything is bounded: :data:`PLAN_MAX` plans, :data:`WEAK_PLAN_MAX` plans of
large arrays, :data:`KINDS_MAX` kinds, :data:`STEPS_MAX` steps; the oldest
goes first.  A replayed 8 B allreduce costs about 1.0 us at n = 2 on the
2-core machine where the compiled entry runs its plan (:mod:`pycoll._replay`,
which reads a plan's :class:`Plan.fit`), about 3.9 us in Python
(``benchmarks/RESULTS.md``, "The matrix against MPI, now").
"""

from __future__ import annotations

import ctypes
import logging
import weakref
from _thread import get_ident
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import numpy as np

from pycoll.buffers import Buffer, data_ptr, device_signature
from pycoll.collectives.base import Prepare, Spec
from pycoll.guard import Call

#: The fast path holds the arrays of plans up to this size; larger ones it holds
#: by weak references (a *weak* plan, see :class:`Plan`).
PLAN_MAX_BYTES = 256 << 10
#: ... and at most this many plans.
PLAN_MAX = 32
#: Weak plans hold no memory, so more of them: a training step's gradient
#: buckets keep theirs (40 buckets of 280 KB at n = 1: 2.9 us a call with room
#: for all, 10.6 with room for 32).
WEAK_PLAN_MAX = 256
#: Steps (an algorithm made ready for one kind of call) that plans and kinds share.
STEPS_MAX = 64
#: Kinds of call kept (each holds a step and no array).
KINDS_MAX = 64

log = logging.getLogger(__name__)


def _drop(device_plan: Any) -> None:
    try:
        device_plan.drop()
    except Exception:  # a failed context: close() settles what it can
        log.debug("dropping a device plan failed", exc_info=True)


class Plan:
    """A validated blocking host call, replayed while its arguments are unchanged.

    Keyed by the collective, the arrays' ``id`` and the other arguments, a key
    :meth:`pycoll.dispatch.Dispatch.call` makes once per call.  It applies only while each array keeps its shape, strides and
    dtype and, where it is written, its ``writeable`` flag (:meth:`fits`): then
    every check of the slow path would pass again with the same outcome.

    A plan of arrays up to :data:`PLAN_MAX_BYTES` holds them, so an id cannot be
    reused while it lives.  A larger (``weak``) one holds weak references, whose
    callbacks drop it when an array goes, and views of the arrays' memory that
    hold no reference (:func:`_unowned`); it applies only to the very objects at
    the same data pointers, and returns them by :data:`SENDBUF`/:data:`RECVBUF`.

    ``go()`` runs the call; it returns the output where the plan allocates one
    each call, else None and the call returns ``res``.
    """

    __slots__ = (
        "call",
        "fit",
        "go",
        "o",
        "odtype",
        "optr",
        "oshape",
        "ostrides",
        "res",
        "sig",
        "tid",
        "weak",
        "x",
        "xdtype",
        "xptr",
        "xshape",
        "xstrides",
        "xw",
    )

    def __init__(self, x: Any, xw: bool, o: Any, weak: bool, call: Call) -> None:
        self.x, self.o = x, o
        self.sig: tuple[Any, Any] | None = None
        self.weak = weak
        if not isinstance(x, np.ndarray):  # torch CPU tensors: signatures
            self.sig = (device_signature(x), None if o is None else device_signature(o))
        else:
            self.xshape, self.xstrides, self.xdtype, self.xw = x.shape, x.strides, x.dtype, xw
            if o is not None:
                self.oshape, self.ostrides, self.odtype = o.shape, o.strides, o.dtype
            if weak:
                self.xptr = data_ptr(x)
                self.optr = None if o is None else data_ptr(o)
        self.tid = get_ident()  # the thread it is for: its waiting policy is that thread's
        self.call = call
        self.go: Callable[[], Any] = _unset
        self.res: Any = None
        #: the compiled entry's view of the plan (:mod:`pycoll._replay`), or None
        self.fit: Any = None

    def fits(self, x: Any, o: Any) -> bool:
        """Whether the arrays still look as they did when the plan was made."""
        sig = self.sig
        if sig is not None:
            return device_signature(x) == sig[0] and (
                sig[1] is None or device_signature(o) == sig[1]
            )
        if self.weak and not self._same_objects(x, o):
            return False
        if (
            x.shape != self.xshape
            or x.strides != self.xstrides
            or x.dtype is not self.xdtype
            or (self.xw and not x.flags.writeable)
        ):
            return False
        return self.o is None or (
            o.shape == self.oshape
            and o.strides == self.ostrides
            and o.dtype is self.odtype
            and o.flags.writeable
        )

    def _same_objects(self, x: Any, o: Any) -> bool:
        if self.x() is not x or data_ptr(x) != self.xptr:
            return False
        return self.o is None or (self.o() is o and data_ptr(o) == self.optr)


class Kind:
    """A validated blocking call on NumPy arrays of one kind, run on whatever
    arrays of that kind come next (a fresh view each step, ``tensor.numpy()``).

    Every check of the slow path depends on the arrays' dtype, shape and strides
    alone but two, which :meth:`Plans.known_kind` redoes each call: that the
    arrays written are writeable (``xw``, ``ow``) and that an output does not
    overlap the input.  ``run(sendbuf, recvbuf)`` returns the call's result;
    ``last``: weak references to its last arrays (the same ones again make a plan).
    """

    __slots__ = ("call", "fit", "last", "ow", "run", "xw")

    def __init__(self, run: Callable[[Any, Any], Any], call: Call, xw: bool, ow: bool) -> None:
        self.run = run
        self.call = call
        self.xw, self.ow = xw, ow
        self.last: tuple[weakref.ref[Any], weakref.ref[Any] | None] | None = None
        #: what the compiled entry runs it by, where it can (:meth:`Plans.add_kind`)
        self.fit: Any = None


class _Held:
    """What a weak plan returns in place of the caller's array (it holds none)."""

    __slots__ = ("name",)

    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return f"<the caller's {self.name}>"


SENDBUF = _Held("sendbuf")
RECVBUF = _Held("recvbuf")


def _unset() -> None:
    raise AssertionError("a plan replayed before it was made")


def _unowned(a: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    """A flat view of ``a``'s memory that holds no reference to ``a``."""
    raw = (ctypes.c_char * a.nbytes).from_address(data_ptr(a))
    return np.frombuffer(memoryview(raw).cast("B"), a.dtype)


def make_room(cache: dict[Any, Any], limit: int) -> None:
    """Drop the oldest entry of ``cache`` (dicts keep insertion order) if one more
    would pass ``limit``."""
    if len(cache) >= limit:
        del cache[next(iter(cache))]


def kind_key(head: tuple[Any, ...], sendbuf: Any, recvbuf: Any) -> tuple[Any, ...] | None:
    """What a call ``head`` on these arrays from this thread is checked by (their
    dtypes, shapes and strides); None unless both are NumPy arrays."""
    if type(sendbuf) is not np.ndarray:
        return None
    x = (head, get_ident(), sendbuf.dtype, sendbuf.shape, sendbuf.strides)
    if recvbuf is None:
        return x
    if type(recvbuf) is not np.ndarray:
        return None
    return (*x, recvbuf.dtype, recvbuf.shape, recvbuf.strides)


class Plans:
    """A communicator's plans, kinds and steps (see the module docstring).

    Args:
        make_step: makes the step of a key of :meth:`step` (the engine's).
        seen: records a call's fingerprint, to name it in a mismatch.
        fit_type: :class:`pycoll._replay.Fit`, to give each plan of NumPy
            arrays that it holds a view for the compiled entry; None: none.
        step_type: :class:`pycoll._step.Step`, whose steps the compiled entry
            runs on a kind's arrays as they come (:meth:`add_kind`); None: none.
    """

    def __init__(
        self,
        make_step: Callable[[tuple[Any, ...]], Callable[..., None]],
        seen: Callable[[Call], None],
        fit_type: Any = None,
        step_type: Any = None,
    ) -> None:
        self.fit_type = fit_type
        self.step_type = step_type
        #: called by :meth:`clear`: the compiled entry drops the last plan it kept
        self.on_clear: Callable[[], None] | None = None
        self.plans: dict[tuple[Any, ...], Plan] = {}
        self.weak_plans: dict[tuple[Any, ...], Plan] = {}
        self.kinds: dict[tuple[Any, ...], Kind] = {}
        self.steps: dict[tuple[Any, ...], Callable[..., None]] = {}
        #: blocking device calls kept to run again (:mod:`pycoll.gpu.replay`)
        self.device_plans: dict[tuple[Any, ...], Any] = {}
        self._make_step = make_step
        self._seen = seen
        #: how many times everything was forgotten: a plan held elsewhere (a
        #: :class:`pycoll.dispatch.Prepared`) is good while this has not moved
        self.epoch = 0

    def clear(self) -> None:
        """Forget everything (on close, and on a failure: steps hold views of segments)."""
        self.epoch += 1
        if self.on_clear is not None:
            self.on_clear()
        self.plans.clear()
        self.weak_plans.clear()
        self.steps.clear()
        self.kinds.clear()
        self.drop_device_plans()

    def add_device_plan(self, k: tuple[Any, ...], plan: Any, most: int) -> None:
        """Keep device ``plan`` under key ``k``, in place of the one there (the same
        arrays on another stream, say) and of the oldest beyond ``most``."""
        old = self.device_plans.pop(k, None)
        if old is not None:
            _drop(old)
        self.drop_device_plans(most - 1)
        self.device_plans[k] = plan

    def drop_device_plans(self, keep: int = 0) -> None:
        """Forget the oldest device plans until at most ``keep`` remain (each holds
        its arrays until its queued work is over: :meth:`DevicePlan.drop`)."""
        plans = self.device_plans
        while len(plans) > keep:
            _drop(plans.pop(next(iter(plans))))

    def step(self, k: tuple[Any, ...]) -> Callable[..., None]:
        """The step of ``k`` = (collective, algorithm, dtype, op, count, root,
        tuner): made once per thread and shared by the plans and kinds of that
        kind of call, since it depends on none of the arrays."""
        k = (*k, get_ident())
        s = self.steps.get(k)
        if s is None:
            make_room(self.steps, STEPS_MAX)
            s = self.steps[k] = self._make_step(k)
        return s

    # ------------------------------------------------------------------ plans
    def make_plan(
        self,
        k: tuple[Any, ...],
        spec: Spec,
        sendbuf: Any,
        recvbuf: Any,
        prepare: Prepare,
        call: Call,
    ) -> Plan:
        """The plan of call ``spec`` (made by the slow path), kept under ``k``."""
        coll = spec.coll
        x, out = _detached(spec.x, spec.out)
        weak = isinstance(x.obj, _Held)
        p = Plan(sendbuf, spec.x_written, recvbuf if spec.given else None, weak, call)
        xa = x.flat
        shape = coll.fresh_shape(spec)
        if shape is not None:
            dtype = x.dtype

            def fresh() -> Any:
                o = np.empty(shape, dtype)
                prepare(xa, o.reshape(-1))()
                return o

            p.go = fresh
        else:
            # off the root of a reduce the output is scratch: held by a plan of
            # small arrays, fresh each call of a weak one (which holds no memory)
            oa = out.flat if out is not None else None if weak else np.empty_like(xa)
            p.go = prepare(xa, oa)
            if spec.result is spec.x.obj:
                p.res = x.obj
            elif spec.out is not None and spec.result is spec.out.obj:
                p.res = out.obj if out is not None else None
        if self.fit_type is not None and type(sendbuf) is np.ndarray:
            o = p.o
            if o is None or type(o) is np.ndarray:
                # a weak plan's result is the caller's array: the entry returns its argument
                ret = 1 if p.res is SENDBUF else 2 if p.res is RECVBUF else 0
                try:
                    p.fit = self.fit_type(sendbuf, p.xw, o, p.go, p.res, call, p.tid, weak, ret)
                except ValueError:  # NumPy's array struct is not as _replay.c reads it
                    p.fit = None
        self._seen(call)
        plans = self.weak_plans if weak else self.plans
        make_room(plans, WEAK_PLAN_MAX if weak else PLAN_MAX)
        if weak:

            def forget(ref: weakref.ref[Any]) -> None:  # an array of the plan is gone
                q = plans.get(k)
                if q is not None and (q.x is ref or q.o is ref):
                    plans.pop(k, None)

            p.x = weakref.ref(p.x, forget)
            if p.o is not None:
                p.o = weakref.ref(p.o, forget)
        plans[k] = p
        return p

    # ------------------------------------------------------------------ kinds
    def known_kind(self, head: tuple[Any, ...], sendbuf: Any, recvbuf: Any) -> Kind | None:
        """The kind of call ``head`` on these arrays, or None where there is none
        or these arrays may not use it."""
        try:
            kd = self.kinds.get(kind_key(head, sendbuf, recvbuf))  # type: ignore[arg-type]
        except TypeError:  # an unhashable op or algorithm: the slow path says why
            return None
        if kd is None:
            return None
        if kd.xw and not sendbuf.flags.writeable:
            return None
        if kd.ow and (not recvbuf.flags.writeable or np.may_share_memory(sendbuf, recvbuf)):
            return None
        last = kd.last
        if last is not None and last[0]() is sendbuf and (last[1] is None or last[1]() is recvbuf):
            return None  # the same arrays twice in a row: the slow path makes them a plan
        kd.last = (weakref.ref(sendbuf), None if recvbuf is None else weakref.ref(recvbuf))
        return kd

    def add_kind(
        self,
        head: tuple[Any, ...],
        sendbuf: Any,
        recvbuf: Any,
        spec: Spec,
        envelope: Callable[[Spec], Prepare],
        call: Call,
        entry_form: Callable[[Spec], tuple[Any, int] | None] | None = None,
    ) -> None:
        """Keep the kind of call ``head`` on NumPy arrays like these, unless there
        is one; ``entry_form``: the collective's
        :meth:`~pycoll.collectives.base.Collective.entry_form` of its step, for
        the compiled entry (:meth:`_kind_fit`)."""
        k = kind_key(head, sendbuf, recvbuf)
        if k is None or k in self.kinds:
            return
        make_room(self.kinds, KINDS_MAX)
        kd = self.kinds[k] = _kind(spec, envelope, call)
        if self.fit_type is not None and self.step_type is not None and entry_form is not None:
            kd.fit = self._kind_fit(kd, spec, entry_form, sendbuf, recvbuf)
        self._seen(call)

    def _kind_fit(
        self,
        kd: Kind,
        spec: Spec,
        entry_form: Callable[[Spec], tuple[Any, int] | None],
        x: Any,
        o: Any,
    ) -> Any:
        """The compiled entry's Fit of kind ``kd``, or None.  Where the kind's run
        is its step on the flat arrays (``entry_form``; an own block copied
        first), that step a compiled :class:`pycoll._step.Step`, which takes any
        C-contiguous buffer of its bytes, the entry runs it on the caller's
        arrays as they are: ``step(sendbuf, recvbuf)``, or ``step(sendbuf,
        sendbuf)`` in place.  Not for an output pycoll allocates or scratch (a
        reduce off its root), nor for arrays that overlap."""
        if spec.coll.fresh_shape(spec) is not None or (spec.out is None and o is None):
            return None
        if not x.flags.c_contiguous:
            return None
        if o is not None and (
            type(o) is not np.ndarray or not o.flags.c_contiguous or np.may_share_memory(x, o)
        ):
            return None
        form = entry_form(_kind_spec(spec))
        if form is None or type(form[0]) is not self.step_type:
            return None
        step, own = form
        returns = spec.result is not None  # as _kind's run: its recvbuf, else its sendbuf
        ret = 0 if not returns else 1 if o is None else 2
        try:
            return self.fit_type(
                x, kd.xw, o, step, None, kd.call, get_ident(), False, ret, True, own
            )
        except ValueError:  # NumPy's array struct is not as _replay.c reads it
            return None


def _kind_spec(spec: Spec) -> Spec:
    """The call a kind runs for ``spec``'s: a given output only ever meets a kind
    when it does not overlap the input, so the envelope copies this rank's part."""
    return replace(spec, in_place=False) if spec.given and spec.in_place else spec


def _kind(spec: Spec, envelope: Callable[[Spec], Prepare], call: Call) -> Kind:
    """The kind of call ``spec`` is one of (see :func:`_kind_spec`)."""
    spec = _kind_spec(spec)
    prepare = envelope(spec)
    shape = spec.coll.fresh_shape(spec)
    dtype = spec.x.dtype
    scratch = spec.out is None  # off the root of a reduce
    returns = spec.result is not None

    def run(s: Any, o: Any) -> Any:
        xa = s.reshape(-1)
        if shape is not None:
            o = np.empty(shape, dtype)
            oa = o.reshape(-1)
        elif scratch:
            oa = None
        else:
            oa = xa if o is None else o.reshape(-1)
        prepare(xa, oa)()
        if not returns:
            return None
        return s if o is None else o

    return Kind(run, call, spec.x_written, spec.given and spec.out is not None)


def _detached(x: Buffer, out: Buffer | None) -> tuple[Buffer, Buffer | None]:
    """The host buffers of a plan: the caller's up to :data:`PLAN_MAX_BYTES`;
    above, views that do not keep the caller's arrays alive (a weak plan)."""
    if x.nbytes <= PLAN_MAX_BYTES and (out is None or out.nbytes <= PLAN_MAX_BYTES):
        return x, out
    dx = Buffer(SENDBUF, _unowned(x.flat), x.device, x.logical)
    if out is None or out is x:  # in place
        return dx, None if out is None else dx
    return dx, Buffer(RECVBUF, _unowned(out.flat), out.device, out.logical)
