"""What every collective shares: the validated call (:class:`Spec`), the checks
that make one, and the :class:`Collective` a module of this package subclasses.

A collective says what a call *means*, never how bytes move: which arguments
are valid, the output's shape, and its *envelope*, the work around the
algorithm's step that is the same on every path (the copy when a rank is
alone, a rank's own block, the division that finishes ``avg``).  The envelope
is written once and runs on host arrays (the slow path, plans, kinds; see
:mod:`pycoll.plans`) and on device arrays (:mod:`pycoll.gpu.context`) alike:
it touches arrays only through indexing, assignment and :class:`ArrayOps`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any, Protocol

import numpy as np

from pycoll.buffers import Buffer, as_buffer, copy_into, data_ptr, is_torch
from pycoll.errors import InvalidArgumentError
from pycoll.reduce import ReduceOp, finish_avg

#: ``step(x, out)``: an algorithm's run on flat arrays (``out`` None for broadcast).
Step = Callable[[Any, Any], None]
#: ``prepare(x, out)`` binds the flat arrays of one call and returns what runs it.
Prepare = Callable[[Any, Any], Callable[[], None]]


class ArrayOps(Protocol):
    """What an envelope needs besides indexing: host (:data:`HOST`) or device."""

    def finish_avg(self, out: Any, n: int, dtype: np.dtype[Any]) -> None:
        """Divide a sum by ``n`` in place (every rank does the same operation)."""
        ...

    def empty_like(self, a: Any) -> Any:
        """Scratch memory like ``a``, where ``a`` lives."""
        ...

    def copy(self, dst: Any, src: Any) -> None:
        """``dst[...] = src``, as fast as the memory allows."""
        ...


class _HostOps:
    @staticmethod
    def finish_avg(out: Any, n: int, dtype: np.dtype[Any]) -> None:
        finish_avg(out, n)

    @staticmethod
    def empty_like(a: Any) -> Any:
        return np.empty_like(a)

    copy = staticmethod(copy_into)  # itself: a replayed small call pays one Python call


HOST: ArrayOps = _HostOps()


@dataclass(slots=True)
class Spec:
    """One validated call: everything its paths need, made once by :meth:`Collective.check`.

    Attributes:
        coll: the collective.
        n, r: the communicator's size and this rank.
        x: the input (broadcast: the buffer).
        out: the output (broadcast: ``x``); None off the root of a reduce.
        op: the reduction, None where there is none.
        root: the root (0 where there is none).
        given: the caller passed ``recvbuf`` (else the output is ``x`` itself, or
            one pycoll allocates: :meth:`Collective.fresh_shape`).
        in_place: the output holds the input where this rank's result goes, so
            the envelope copies nothing there.
        x_written: the call writes ``x`` (in place by omission; broadcast off the root).
        result: what the call returns.
        count: the element count the call's fingerprint names (None: ``x``'s);
            ranks of a matched call agree on it.
        layout: for the v-variants, a digest of the counts every rank passes
            (folded into the fingerprint); ``counts``: the counts themselves.
    """

    coll: Collective
    n: int
    r: int
    x: Buffer
    out: Buffer | None
    op: ReduceOp | None
    root: int
    given: bool
    in_place: bool
    x_written: bool
    result: Any
    count: int | None = None
    layout: int = 0
    counts: Any = None

    @property
    def fp_count(self) -> int:
        return self.x.count if self.count is None else self.count

    @property
    def nbytes(self) -> int:
        """The bytes the cost model and the policy judge the call by (the same on
        every rank of a matched call, so all ranks choose alike)."""
        return self.fp_count * self.x.dtype.itemsize


class Collective:
    """The meaning of one collective; a module of this package makes one instance.

    Class attributes:
        name: the public method's name.
        ident: its number in ``PYCOLL_CHECK``'s comparison (every rank alike).
        signature: the algorithm's arguments after its Links: ``("x", "out")``,
            ``("x", "root")`` or ``("x", "out", "root")``.
        reduces: it takes ``op`` (and its algorithms a reduction).
        always_steps: an empty call still takes its algorithm's step with its
            peers (so that a rank calling with another count meets a mismatch
            rather than a rank that went on).
        plannable: blocking host calls may be replayed (:mod:`pycoll.plans`).
        windows: it has a one-sided device algorithm (:mod:`pycoll.gpu.windows`).
    """

    name = "?"
    ident = 0
    signature: tuple[str, ...] = ("x", "out")
    reduces = False
    always_steps = False
    plannable = True
    windows = False

    def check(
        self, n: int, r: int, sendbuf: Any, recvbuf: Any, op: Any, root: Any, extra: Any = None
    ) -> Spec:
        """Validate a call; raise :class:`InvalidArgumentError` before any byte moves.
        ``extra``: the v-variants' counts."""
        raise NotImplementedError

    def envelope(self, spec: Spec, step: Step | None, ops: ArrayOps) -> Prepare:
        """What a call of ``spec``'s kind runs around ``step`` (None: nothing to
        move, see :meth:`moves`), on flat arrays bound by the returned ``prepare``."""
        raise NotImplementedError

    def entry_form(self, spec: Spec, step: Step | None) -> tuple[Step, int] | None:
        """How a kind of ``spec``'s call on the host may run on the caller's own
        arrays, where its envelope is that little: ``(step, own)``, the run being
        ``step(sendbuf, recvbuf)`` (``step(sendbuf, sendbuf)`` with no recvbuf)
        after ``sendbuf`` is copied into ``recvbuf`` at byte ``own`` (no copy
        where negative); else None (:meth:`pycoll.plans.Plans.add_kind`)."""
        if step is None or bare_step(self.envelope(spec, step, HOST)) is not step:
            return None
        return step, -1

    def moves(self, spec: Spec) -> bool:
        """Whether the algorithm runs at all (several ranks, bytes to move)."""
        return spec.n > 1 and (spec.x.count > 0 or self.always_steps)

    def fresh_shape(self, spec: Spec) -> tuple[int, ...] | None:
        """The shape of an output pycoll allocates each call (no ``recvbuf``), else None."""
        return None

    def staging(self, spec: Spec) -> tuple[bool, bool]:
        """Device buffers through host copies: whether the input is copied in
        and the output copied back."""
        return True, spec.out is not None

    def args(self, spec: Spec, x: Any, out: Any) -> tuple[Any, ...]:
        """The algorithm's arguments after its Links, by :attr:`signature`."""
        sig = self.signature
        if sig == ("x", "root"):
            return (x, spec.root)
        if sig == ("x", "out", "root"):
            return (x, out, spec.root)
        return (x, out) if sig else ()

    def __repr__(self) -> str:
        return f"<collective {self.name}>"


def own_then(
    step: Step | None, ops: ArrayOps, part: Callable[[Any, Any], tuple[Any, Any]]
) -> Prepare:
    """The envelope of a collective whose rank keeps a part of its own: ``part(x,
    out)`` gives (where in the output, what of the input), copied before ``step``."""
    copy = ops.copy

    def prepare(x: Any, out: Any) -> Callable[[], None]:
        dst, src = part(x, out)

        def run() -> None:
            copy(dst, src)
            if step is not None:
                step(x, out)

        return run

    return prepare


def reducing(
    step: Step | None,
    ops: ArrayOps,
    n: int,
    dtype: np.dtype[Any],
    *,
    copy: bool,
    avg: bool,
    scratch: bool = False,
) -> Prepare:
    """The envelope of a reduction: ``copy`` the input (a rank alone) or run
    ``step``, then divide by ``n`` for ``avg``; ``scratch``: an output of None
    is scratch made for the call (a reduce off its root)."""
    if step is not None and not (copy or avg or scratch):
        return partial(partial, step)

    def run(x: Any, out: Any) -> None:
        if scratch and out is None:
            out = ops.empty_like(x)
        if copy:
            ops.copy(out, x)
        elif step is not None:
            step(x, out)
        if avg:
            ops.finish_avg(out, n, dtype)

    return partial(partial, run)


def bare_step(prepare: Prepare) -> Step | None:
    """The step that ``prepare`` runs and nothing else around it, where it is
    :func:`reducing`'s bare form (``partial(partial, step)``); else None."""
    if type(prepare) is partial and prepare.func is partial and not prepare.keywords:
        if len(prepare.args) == 1:
            return prepare.args[0]  # type: ignore[no-any-return]
    return None


def nothing(x: Any, out: Any) -> Callable[[], None]:
    """The ``prepare`` of a call with nothing to do (a rank alone, no bytes)."""
    return _noop


def _noop() -> None:
    pass


# ---------------------------------------------------------------------- checks
def blocks(x: Buffer, n: int, r: int, what: str, arg: str = "sendbuf") -> int:
    """Elements a block of ``x``, which must hold ``n`` of them."""
    if x.count % n:
        raise InvalidArgumentError(
            f"rank {r}: {what}: {arg} has {x.count} elements, "
            f"not a multiple of the communicator size {n}"
        )
    return x.count // n


def check_root(root: object, n: int, r: int, what: str) -> int:
    if not isinstance(root, (int, np.integer)) or isinstance(root, bool) or not 0 <= root < n:
        raise InvalidArgumentError(f"rank {r}: {what}: root={root!r} is not in [0, {n})")
    return int(root)


def output(recvbuf: Any, x: Buffer, count: int, r: int, what: str) -> Buffer:
    """``recvbuf`` as the output of ``count`` elements of ``x``'s dtype, on its device."""
    out = as_buffer(recvbuf, r, what, "recvbuf", writable=True)
    if out.dtype != x.dtype:
        raise InvalidArgumentError(
            f"rank {r}: {what}: recvbuf dtype {out.dtype} differs from sendbuf dtype {x.dtype}"
        )
    if out.count != count:
        raise InvalidArgumentError(
            f"rank {r}: {what}: recvbuf has {out.count} elements, expected {count}"
        )
    if out.device != x.device:
        raise InvalidArgumentError(
            f"rank {r}: {what}: recvbuf is on {_where(out.device)} but sendbuf on "
            f"{_where(x.device)}"
        )
    return out


def _where(device: int) -> str:
    return "host" if device < 0 else f"cuda:{device}"


def check_alias(x: Buffer, out: Buffer, at: int | None, r: int, what: str, how: str = "") -> bool:
    """``out`` may hold ``x`` whole at byte ``at`` (in place) or not touch it;
    ``at`` None: the collective has no in-place form.  Returns whether it is in place.

    ``how``: what in place means, for the message (default: the same array)."""
    if out is x:
        return True
    if not overlaps(x, out):
        return False
    if at is not None and data_ptr(x.flat) == data_ptr(out.flat) + at:
        return True
    if at is None:
        raise InvalidArgumentError(
            f"rank {r}: {what}: recvbuf overlaps sendbuf; use separate arrays"
        )
    how = how or "pass the same array (or no recvbuf)"
    raise InvalidArgumentError(
        f"rank {r}: {what}: recvbuf partly overlaps sendbuf; for in place, {how}, "
        "else use separate arrays"
    )


def overlaps(a: Buffer, b: Buffer) -> bool:
    if a.device != b.device:
        return False
    fa, fb = a.flat, b.flat
    if isinstance(fa, np.ndarray) and isinstance(fb, np.ndarray):
        # the same test on the byte ranges, in C: 0.56 us, against 4.1 for the
        # two data_ptr lookups below (on the 2-core machine)
        return bool(np.may_share_memory(fa, fb))
    pa, pb = data_ptr(fa), data_ptr(fb)
    return pa < pb + b.nbytes and pb < pa + a.nbytes


def empty_like(x: Buffer, shape: tuple[int, ...]) -> Any:
    """A new array of ``shape`` of the same family, dtype and device as ``x``."""
    if is_torch(x.obj):
        return x.obj.new_empty(shape)
    if x.is_device:
        import cupy

        with cupy.cuda.Device(x.device):
            return cupy.empty(shape, x.dtype)
    return np.empty(shape, x.dtype)
