"""The Communicator: validated collectives over the bootstrap's connections."""

from __future__ import annotations

import collections
import ctypes
import functools
import logging
import os
import threading
import traceback
import weakref
import zlib
from _thread import get_ident
from collections.abc import Callable
from concurrent.futures import CancelledError, Future, ThreadPoolExecutor
from dataclasses import dataclass
from time import monotonic
from typing import Any, NoReturn

import numpy as np

from pycoll import algorithms
from pycoll.algorithms import cost, direct
from pycoll.algorithms.links import Links
from pycoll.bootstrap import Wiring, wire
from pycoll.buffers import Buffer, as_buffer, data_ptr, device_signature, is_torch
from pycoll.config import SLICED_COPY_BYTES, TRACE, Config, setup_logging
from pycoll.diagnose import RankStatus, StatusChannel, decode, grace_for, summary
from pycoll.errors import (
    CollectiveMismatchError,
    CollectiveTimeout,
    CommunicatorClosedError,
    ConcurrentCallError,
    InvalidArgumentError,
    PycollError,
    from_transport,
)
from pycoll.gpu import setup as gpu_setup
from pycoll.gpu.jobs import Job
from pycoll.reduce import DTYPES, ReduceOp, check_op_dtype, finish_avg, parse_op, ufunc
from pycoll.rendezvous import Bootstrap
from pycoll.tune import Tuner, tunable
from transports.base import Backoff, Deadline, TagMismatchError
from transports.base import TransportError as WireError

log = logging.getLogger(__name__)

_COLL_IDS = {
    "allreduce": 1,
    "allgather": 2,
    "broadcast": 3,
    "reduce_scatter": 4,
    "reduce": 5,
    "barrier": 6,
}
_WORKER = "pycoll-progress"  # the name of the worker (progress) thread
_DTYPE_IDS = {dt: i for i, dt in enumerate(DTYPES.values(), 1)}
_OP_IDS = {op: i for i, op in enumerate(ReduceOp, 1)}
_M32 = 0xFFFFFFFF
#: Fingerprints of pycoll's own exchanges inside a call, which every rank makes
#: whatever it was called with (PYCOLL_CHECK's, a tuner's agreement).
_CHECK_FP = 0x43484B31  # "CHK1"
_AGREE_FP = 0x41475231  # "AGR1"
#: Fingerprints of calls this rank made, kept to name a peer's call in a mismatch.
FINGERPRINTS_MAX = 256


def fingerprint(collective: str, count: int, dtype: Any, op: ReduceOp | None, root: int) -> int:
    """The 32-bit fingerprint of a call: what every rank of a matched call
    shares (the collective, count, dtype, op and root; not the algorithm, which
    ``auto`` may vary per call, nor the arrays).

    It travels with every message of the call (the high half of its tag, the
    low half the call's sequence number) and is folded into the group
    segment's chain (:mod:`transports.shm_group`).  Derived from the names of
    the dtype and op, so new ones need no table here."""
    dt = "-" if dtype is None else np.dtype(dtype).name
    key = f"{collective}|{count}|{dt}|{'-' if op is None else op.value}|{root}"
    return zlib.crc32(key.encode())


class Request:
    """An asynchronous collective (``async_op=True``).

    ``wait(timeout)`` blocks until it finishes and returns its output (or raises
    its error); ``test()`` says whether it has finished; ``exception()`` gives the
    error, if any, once finished.
    """

    def __init__(self, future: Future[Any], what: str, rank: int) -> None:
        self._future = future
        self._what = what
        self._rank = rank

    def wait(self, timeout: float | None = None) -> Any:
        """Block until done; return the output array.

        Raises:
            CollectiveTimeout: still running after ``timeout`` seconds (the
                collective itself goes on, bounded by PYCOLL_TIMEOUT; its
                ``missing`` is empty, for no rank is known to be late).
            CommunicatorClosedError: ``abort()`` or ``close()`` ended it, or
                dropped it before it started.
        """
        try:
            return self._future.result(timeout)
        except TimeoutError:
            raise CollectiveTimeout(
                f"rank {self._rank}: {self._what} still running after wait(timeout={timeout}); "
                "it goes on (PYCOLL_TIMEOUT bounds it)",
                rank=self._rank,
            ) from None
        except CancelledError:
            raise self._dropped() from None

    def _dropped(self) -> CommunicatorClosedError:
        return CommunicatorClosedError(
            f"rank {self._rank}: {self._what}: the communicator was aborted before it started"
        )

    def test(self) -> bool:
        return self._future.done()

    def add_done_callback(self, fn: Callable[[Request], None]) -> None:
        """Call ``fn(self)`` once the collective finishes (at once if it has).

        It runs on pycoll's worker thread; keep it short and do not start
        collectives from it.
        """
        self._future.add_done_callback(lambda _: fn(self))

    def exception(self) -> BaseException | None:
        if not self._future.done():
            return None
        if self._future.cancelled():
            return self._dropped()
        return self._future.exception()

    def __repr__(self) -> str:
        state = "done" if self._future.done() else "pending"
        return f"<pycoll.Request {self._what} {state}>"


class DeviceRequest(Request):
    """An asynchronous device collective (``async_op=True`` on device buffers).

    As NCCL's: :meth:`wait` makes the caller's current stream (torch's for torch
    tensors, CuPy's otherwise) wait for the collective, on the device, and
    returns at once; work queued on that stream afterwards sees the output.
    ``wait(host=True)`` blocks the host until the output is ready for it too.
    Until ``wait``, the caller's stream does not wait for the collective.
    A failure raises from ``wait`` where it is already known, and otherwise from
    the communicator's next call.
    """

    def __init__(
        self, future: Future[Any], what: str, rank: int, job: Job, result: Any, like: Any, gpu: Any
    ) -> None:
        super().__init__(future, what, rank)
        self._job = job
        self._result = result
        self._like = like  # the input: torch's or CuPy's current stream
        self._gpu = gpu

    def wait(self, timeout: float | None = None, *, host: bool = False) -> Any:
        """Make the current stream wait for the collective; return its output.

        Args:
            timeout: with ``host=True``: seconds before the host wait gives up.
            host: block the host until the output is on the device (then the host
                may read it, as after a stream synchronize).

        Raises:
            CollectiveTimeout: ``host=True`` and not done after ``timeout``.
        """
        if host:
            t0 = monotonic()
            super().wait(timeout)
            left = None if timeout is None else max(0.0, timeout - (monotonic() - t0))
            self._gpu.inflight.wait(self._job, left)
            return self._result
        if self._future.done() or not self._job.gated:
            super().wait(timeout)  # raises its failure (ungated: waits for the host part)
        from pycoll.gpu.context import resolve_stream

        gpu = self._gpu
        stream = resolve_stream(None, self._like, gpu.device, self._rank, self._what)
        gpu.inflight.stream_wait(self._job, stream)
        return self._result

    def test(self) -> bool:
        """Whether the collective is over, on the device too."""
        return self._future.done() and self._gpu.inflight.complete(self._job)


@dataclass(frozen=True, slots=True)
class Call:
    """What a collective call runs (made once per plan and kind of call)."""

    collective: str
    count: int
    dtype: Any
    op: ReduceOp | None
    root: int
    algorithm: str

    @property
    def fp(self) -> int:
        """Its :func:`fingerprint`."""
        return fingerprint(self.collective, self.count, self.dtype, self.op, self.root)


#: The flight recorder keeps each call as a list ``[seq, call, started, ended,
#: status]`` (a :class:`Record` when read): the fast path makes one every call,
#: and a list costs half of what a dataclass does (0.22 against 0.48 us with the
#: two clock reads, on the 2-core machine).
_SEQ, _CALL, _STARTED, _ENDED, _STATUS = range(5)


@dataclass(frozen=True, slots=True)
class Record:
    """One entry of the flight recorder: the recent collectives of this rank."""

    seq: int
    call: Call
    started: float
    ended: float | None = None
    status: str = "running"

    @property
    def collective(self) -> str:
        return self.call.collective

    def __str__(self) -> str:
        c = self.call
        dur = "" if self.ended is None else f" {1e6 * (self.ended - self.started):.0f}us"
        op = "-" if c.op is None else c.op.value
        return (
            f"#{self.seq} {c.collective}(count={c.count}, dtype={c.dtype}, "
            f"op={op}, root={c.root}, algo={c.algorithm}) {self.status}{dur}"
        )


#: The fast path holds the arrays of plans up to this size; larger ones it
#: holds by weak references (see _Plan).
PLAN_MAX_BYTES = 256 << 10
#: ... and at most this many plans (the oldest goes first).
PLAN_MAX = 32
#: Steps (the algorithm of a plan, made ready for one kind of call) kept for
#: plans to share, the oldest going first.  At n = 2 on the 2-core machine an
#: allreduce of 8 B on a fresh view each call (no plan to replay) took 49-54 us
#: a call with them and 66-69 without (the same arrays each call: 12.8).
STEPS_MAX = 64
#: ``auto`` keeps a tuner (or its absence) for the first this many kinds of call
#: (collective, size, dtype, op, root); later kinds take the model's choice and
#: are not kept (the cache never grows past this).
TUNERS_MAX = 256
#: Plans of larger arrays, which hold no memory (not even scratch): more of
#: them, so that a training step's gradient buckets keep theirs.  (Making a plan costs a few
#: microseconds more than the slow path: on the 2-core machine, 40 arrays of
#: 280 KB allreduced in turn at n = 1 took 10.6 us a call with room for 32
#: plans, 4.4 without plans for them, 2.9 with room for all.)
WEAK_PLAN_MAX = 256
#: Kinds of call (see _Kind) kept, the oldest going first (each holds a step,
#: which plans share, and no array).
KINDS_MAX = 64


class _Plan:
    """A validated blocking host collective, replayed while its arguments are unchanged.

    The communicator's fast path: the second and later calls of a collective on
    the same NumPy arrays with the same arguments skip validation and set-up.
    Plans are keyed by the arrays' ``id`` and the other arguments.  A plan
    applies only while each array keeps its shape, strides and dtype and, where
    it is written, its ``writeable`` flag: then every check of the slow path
    would pass again with the same outcome (the algorithm too, which depends on
    nothing else).  Anything else takes the slow path, which raises the same
    errors as ever before any byte moves.

    A plan of arrays up to :data:`PLAN_MAX_BYTES` holds them, so an id cannot be
    reused for another object while its plan lives, and the data pointer of an
    array cannot change under the reference it holds.  A larger one (``weak``)
    must not keep a large array alive: it holds weak references, whose callbacks
    drop it from the communicator's plans when an array goes, and views of the
    arrays' memory that hold no reference (:func:`_unowned`).  It applies only
    to the very objects it was made for, at the same data pointers, so it never
    touches memory that is not theirs; and it returns them by what it was given
    (:data:`_SENDBUF`, :data:`_RECVBUF`).  Each replay costs a pointer check
    more, under a microsecond against the copies of a quarter MiB.

    Device arrays (CuPy's and torch's) that ``auto`` sends through the host get
    plans too: there the data pointer is part of what must not change, since a
    torch tensor's storage can be swapped under the same object.

    Calls on NumPy arrays with no plan of their own run by their kind of call
    (:class:`_Kind`) where one was made.
    """

    __slots__ = (
        "call",
        "o",
        "odtype",
        "optr",
        "oshape",
        "ostrides",
        "run",
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

    def __init__(
        self,
        what: str,
        x: Any,
        xw: bool,
        o: Any,
        run: Callable[[], Any],
        buf: Buffer,
        op: ReduceOp | None,
        root: int,
        algo: str,
    ) -> None:
        self.x, self.o = x, o
        self.sig: tuple[Any, Any] | None = None
        self.weak = False
        if not isinstance(x, np.ndarray):  # device arrays: signatures, not NumPy's attributes
            self.sig = (device_signature(x), None if o is None else device_signature(o))
        else:
            self.xshape, self.xstrides, self.xdtype, self.xw = x.shape, x.strides, x.dtype, xw
            if o is not None:
                self.oshape, self.ostrides, self.odtype = o.shape, o.strides, o.dtype
            # the detached flats of a large plan (see Communicator._detached)
            self.weak = isinstance(buf.obj, _Held)
            if self.weak:
                self.xptr = data_ptr(x)
                self.optr = None if o is None else data_ptr(o)
        self.run = run
        self.tid = get_ident()  # the thread it is for: its waiting policy is that thread's
        self.call = Call(what, buf.count, buf.dtype, op, root, algo)

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
        o2 = self.o
        return o2 is None or (
            o.shape == self.oshape
            and o.strides == self.ostrides
            and o.dtype is self.odtype
            and o.flags.writeable
        )

    def _same_objects(self, x: Any, o: Any) -> bool:
        """A weak plan: whether ``x`` and ``o`` are its arrays, at the same addresses."""
        if self.x() is not x or data_ptr(x) != self.xptr:
            return False
        return self.o is None or (self.o() is o and data_ptr(o) == self.optr)


class _Kind:
    """A validated blocking host collective on NumPy arrays of one kind, run on
    whatever arrays of that kind come next.

    Where a :class:`_Plan` is for the very arrays it was made with, a kind is for
    every NumPy array of the same dtype, shape and strides (and output of the
    same), with the same other arguments: a call on a fresh view or a new array
    each step (``tensor.numpy()`` in a training loop) finds no plan, but its
    kind.  Every check of the slow path depends on those attributes alone but
    two, which the kind redoes each call (:meth:`Communicator._known_kind`):
    that the arrays written are writeable, and that input and output do not
    share memory.  Each thread has its own kinds, as it has its own plans and
    steps (its waiting policy).  So a call on a kind raises nothing the slow path
    would have raised, and anything else (an in-place call by the same array,
    an overlap, a device array) goes the slow path.

    ``run(sendbuf, recvbuf)`` runs the collective on the caller's arrays and
    returns its result.  A kind holds no array.  ``last``: weak references to
    the arrays of its last call; the same arrays once more make a plan, which
    replays faster.
    """

    __slots__ = ("call", "last", "ow", "run", "xw")

    def __init__(
        self,
        what: str,
        run: Callable[[Any, Any], Any],
        x: Buffer,
        op: ReduceOp | None,
        root: int,
        algo: str,
        xw: bool,
        ow: bool,
    ) -> None:
        self.run = run
        self.call = Call(what, x.count, x.dtype, op, root, algo)
        self.xw, self.ow = xw, ow  # sendbuf, recvbuf written (ow: and must not overlap)
        self.last: tuple[weakref.ref[Any], weakref.ref[Any] | None] | None = None


class _Held:
    """What a weak plan returns in place of the caller's sendbuf or recvbuf (it
    holds neither): :meth:`Communicator._replay` hands back the object passed."""

    __slots__ = ("name",)

    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return f"<the caller's {self.name}>"


_SENDBUF = _Held("sendbuf")
_RECVBUF = _Held("recvbuf")


def _unowned(a: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    """A flat view of ``a``'s memory that holds no reference to ``a``: valid only
    while ``a`` lives (a weak plan checks that before every use)."""
    raw = (ctypes.c_char * a.nbytes).from_address(data_ptr(a))
    return np.frombuffer(memoryview(raw).cast("B"), a.dtype)


def _unwrapped(run: Callable[[], Any]) -> Callable[[], Any]:
    return run


def _rejects(slow: Callable[..., Any]) -> Callable[..., Any]:
    """A collective's slow path, whose rejected calls still count (:meth:`Communicator._reject`)."""

    @functools.wraps(slow)
    def checked(self: Communicator, *args: Any) -> Any:
        try:
            return slow(self, *args)
        except InvalidArgumentError as exc:
            if not getattr(exc, "_counted", False):  # else _execute counted it
                self._reject(slow.__name__[1:].removesuffix("_slow"))
            raise

    return checked


class Communicator:
    """A group of ranks that run collectives together.

    Create it with :func:`pycoll.init`.  Every collective validates its
    arguments before any byte moves, and all ranks of the group must call the
    same collectives in the same order.  The guard that is always on sees it
    where they do not: each message carries its call's tag (sequence number and
    :func:`fingerprint`), each group step a chain of fingerprints, and a rank
    that meets another raises :class:`CollectiveMismatchError` and closes its
    connections so that its peers fail too.  A call rejected for its arguments
    counts as a call (:meth:`_reject`).  ``PYCOLL_CHECK=1`` compares every
    rank's call (and sequence number) before it runs, for a message that names
    each rank's arguments.

    Threads: any thread may call, one collective at a time; with several
    threads the program makes the order the same on every rank (each call after
    the last returned, or ``async_op=True`` calls, which run in submission order
    on the worker thread, blocking calls made meanwhile after them).  A call
    that enters while another thread's collective runs raises
    :class:`ConcurrentCallError`, so does the one it overlapped when it ends,
    and the communicator is unusable: overlapping calls have no order every rank
    shares, and pycoll never pairs them by chance.  The check is a lock taken
    without waiting.  ``PYCOLL_TIMEOUT`` counts seconds without
    progress (:class:`transports.base.Deadline`).
    """

    def __init__(self, bootstrap: Bootstrap, config: Config) -> None:
        self.config = config
        self.rank: int = bootstrap.rank
        self.size: int = bootstrap.size
        setup_logging(config.debug, self.rank)
        self._bootstrap = bootstrap
        try:
            self._wiring: Wiring | None = wire(bootstrap, config)
        except BaseException:
            bootstrap.close()
            raise
        self._conns = self._wiring.conns
        self._kinds = dict(self._wiring.kind)
        self._kinds[self.rank] = "self"
        # memory every rank shares (one host): the "direct" algorithms need it
        self._group = self._wiring.group
        self._candidates: dict[str, tuple[str, ...]] = {}
        # auto's online choices, by (collective, bytes, dtype, op, root); None: not tuned
        self._tuners: dict[tuple[Any, ...], Tuner | None] = {}
        # ... and the name and function each runs its calls by, made once
        self._tuned: dict[Tuner, tuple[str, Callable[..., None]]] = {}
        try:  # the device side (second connection table, cuda_ipc); None without a GPU
            self._gpu = gpu_setup(bootstrap, config, self.rank, self.size)
            # per rank: CPUs, shm peers
            shm = [p for p, k in self._wiring.kind.items() if k == "shm"]
            seen = bootstrap.allgather((sorted(_cpus()), shm), config.timeout, "pycoll.init: CPUs")
        except BaseException:
            if getattr(self, "_gpu", None) is not None:
                self._gpu.close()
            self._wiring.close()
            bootstrap.close()
            raise
        self._closed = False
        self._aborted = False
        self._failed: BaseException | None = None
        # a device collective failed on the progress thread and no call has raised it yet
        self._unseen = False
        self._seq = 0
        # the current call's message tag and fingerprint (_execute sets them for
        # _links; plans' steps set their own), and the calls seen, by fingerprint
        self._tag = 0
        self._fp = 0
        self._fps: dict[int, Call] = {}
        self._recent: collections.deque[list[Any]] = collections.deque(maxlen=32)
        # More ranks on a host than cores they may run on?  The waiting policy
        # follows this rank's host; the algorithms follow every rank's verdict
        # (any), so that all ranks pick the same algorithm and the same steps.

        def crowded(r: int) -> bool:
            cpus, peers = seen[r]
            return 1 + len(peers) > len(set(cpus).union(*(seen[p][0] for p in peers)))

        self._crowded = any(crowded(r) for r in range(self.size))
        self._backoff = _waiting_policy(crowded(self.rank))
        # Asynchronous collectives run on a worker thread beside the caller's
        # computation: there a spinning waiter would take the core (and the GIL)
        # that the computation needs, so it naps almost at once instead.
        self._polite = Backoff(spins=4, yields=16, max_sleep=200e-6)
        self._links_cache: dict[tuple[Any, ReduceOp | None], Links] = {}
        self._caller = threading.current_thread()
        # the fast path: validated blocking host calls, by their arguments (_Plan)
        self._plans: dict[tuple[Any, ...], _Plan] = {}
        self._weak_plans: dict[tuple[Any, ...], _Plan] = {}  # of large arrays (_Plan)
        self._steps: dict[tuple[Any, ...], Callable[[Any, Any], None]] = {}  # (_step)
        self._kinds_made: dict[tuple[Any, ...], _Kind] = {}  # calls on new arrays (_Kind)
        self._executor: ThreadPoolExecutor | None = None
        self._inflight = 0
        self._lock = threading.Lock()
        # Held while a collective runs, inline or on the worker (see the class
        # docstring): taken without waiting, so that a second thread's call fails
        # rather than interleave.  On the 2-core machine it made a replayed
        # 8 B allreduce at n = 1 0.2-0.3 us slower (0.90-0.98 against 1.19-1.39 us).
        busy = threading.Lock()
        self._enter, self._leave = busy.acquire, busy.release
        # side channel for naming the culprits of a timeout (pycoll.diagnose)
        self._status = StatusChannel(bootstrap)

    # ------------------------------------------------------------------ public
    def transport_of(self, peer: int, *, device: bool = False) -> str:
        """The transport used to reach ``peer``: "self", "shm", "tcp", "rdma:host"...

        With ``device=True``: how device (GPU) buffers reach it: "cuda_ipc",
        "rdma:gdr", "rdma:dmabuf", or "staged:<host transport>" (pinned host copies).

        Raises:
            InvalidArgumentError: ``peer`` is not a rank of this communicator.
        """
        if not isinstance(peer, (int, np.integer)) or not 0 <= peer < self.size:
            raise InvalidArgumentError(
                f"rank {self.rank}: transport_of: peer={peer!r} is not in [0, {self.size})"
            )
        if device and self._gpu is not None:
            return str(self._gpu.kind(int(peer), self._conns, self._kinds))
        return self._kinds[int(peer)]

    def allreduce(
        self,
        sendbuf: Any,
        recvbuf: Any = None,
        *,
        op: str | ReduceOp = "sum",
        algorithm: str = "auto",
        async_op: bool = False,
        stream: Any = None,
    ) -> Any:
        """Reduce ``sendbuf`` across ranks; every rank gets the result.

        Args:
            sendbuf: contiguous array; with ``recvbuf=None`` the result lands in it.
            recvbuf: output of the same size and dtype, or None for in place.
            op: "sum", "prod", "min", "max", "avg", "band", "bor", "bxor" or a
                :class:`ReduceOp` (which takes which dtype: :mod:`pycoll.reduce`).
            algorithm: "auto" (the cost model's pick, see :mod:`pycoll.tune`), or
                "ring", "tree", "direct" (every rank on one host) or "oneshot";
                the other collectives take the same but "oneshot".
            async_op: return a :class:`Request` instead of waiting.
            stream: device buffers only: the CUDA stream the collective is ordered
                on (CuPy or torch stream, or a ``cudaStream_t`` int); default the
                current stream.  See :mod:`pycoll.gpu.context` for the semantics.

        Returns:
            The output array (or a Request).

        Raises:
            InvalidArgumentError: bad buffers, op, dtype or algorithm.
            TransportError: the collective failed; the communicator is unusable.
        """
        if not async_op and stream is None and not self._inflight:
            try:
                key = ("allreduce", id(sendbuf), id(recvbuf), op, algorithm)
                p = self._plans.get(key) or self._weak_plans.get(key)
            except TypeError:  # unhashable op or algorithm: the slow path says why
                p = None
            if p is not None and p.fits(sendbuf, recvbuf) and get_ident() == p.tid:
                return self._replay(p, sendbuf, recvbuf)
            kd = self._known_kind(("allreduce", op, algorithm), sendbuf, recvbuf)
            if kd is not None:
                return self._replay(kd, sendbuf, recvbuf)
        return self._allreduce_slow(sendbuf, recvbuf, op, algorithm, async_op, stream)

    @_rejects
    def _allreduce_slow(
        self,
        sendbuf: Any,
        recvbuf: Any,
        op: str | ReduceOp,
        algorithm: str,
        async_op: bool,
        stream: Any,
    ) -> Any:
        """allreduce without a plan or kind to replay: check, pick, plan or run.

        Each collective's slow path is a method of its own, apart from the fast
        path, so that the closures made here cost a replayed call nothing: CPython
        makes a function's cells, those closures' variables, on every entry."""
        what = "allreduce"
        self._check_open(what)
        rop = parse_op(op, self.rank, what)
        x = as_buffer(sendbuf, self.rank, what, "sendbuf", writable=recvbuf is None)
        out = x if recvbuf is None else self._output(recvbuf, x, x.count, what)
        self._check_alias(x, out, 0, what)
        check_op_dtype(rop, x.dtype, self.rank, what)
        algo = self._algorithm(what, algorithm, x.nbytes)
        if x.is_device and self._gpu is not None and not self._via_host(what, algorithm, x.nbytes):
            algo = self._device_algorithm(what, algorithm, algo)
            dc = self._gpu.call(what, x, out, stream, self._conns, self._polite, async_op)
            return self._submit_device(
                what, dc, lambda: dc.allreduce(rop, algo), out.obj, async_op, x, rop, 0, algo
            )
        tuner = self._tuner(what, algorithm, x.nbytes, x.dtype, rop, 0)
        algo, run_algo = self._host_algorithm(what, algo, tuner)
        if self._plannable(async_op, stream, x, out):
            key = (what, id(sendbuf), id(recvbuf), op, algorithm)
            p = self._plan_allreduce(key, sendbuf, recvbuf, x, out, rop, algo, tuner)
            self._add_kind(
                (what, op, algorithm),
                sendbuf,
                recvbuf,
                lambda: self._kind(what, x, recvbuf is not None, rop, 0, algo, tuner),
            )
            return self._replay(p, sendbuf, recvbuf)

        def body(xa: Any, oa: Any) -> None:
            if self.size == 1:
                if oa is not xa:
                    oa[...] = xa
            else:
                run_algo(self._links(x.dtype, rop), xa, oa)
            if rop is ReduceOp.AVG:
                finish_avg(oa, self.size)

        return self._staged(what, body, x, out, out.obj, async_op, rop, 0, algo, stream=stream)

    def allgather(
        self,
        sendbuf: Any,
        recvbuf: Any = None,
        *,
        algorithm: str = "auto",
        async_op: bool = False,
        stream: Any = None,
    ) -> Any:
        """Gather every rank's ``sendbuf`` into everyone's output, rank-major.

        Args:
            sendbuf: contiguous array of k elements (may be block ``rank`` of
                ``recvbuf`` itself, for in place).
            recvbuf: output of ``size * k`` elements; None allocates one of shape
                ``(size, *sendbuf.shape)``.
            algorithm, async_op, stream: as for :meth:`allreduce`.

        Returns:
            The output array (or a Request).
        """
        if not async_op and stream is None and not self._inflight:
            try:
                key = ("allgather", id(sendbuf), id(recvbuf), algorithm)
                p = self._plans.get(key) or self._weak_plans.get(key)
            except TypeError:
                p = None
            if p is not None and p.fits(sendbuf, recvbuf) and get_ident() == p.tid:
                return self._replay(p, sendbuf, recvbuf)
            kd = self._known_kind(("allgather", algorithm), sendbuf, recvbuf)
            if kd is not None:
                return self._replay(kd, sendbuf, recvbuf)
        return self._allgather_slow(sendbuf, recvbuf, algorithm, async_op, stream)

    @_rejects
    def _allgather_slow(
        self,
        sendbuf: Any,
        recvbuf: Any,
        algorithm: str,
        async_op: bool,
        stream: Any,
    ) -> Any:
        """allgather without a plan or kind to replay (see :meth:`_allreduce_slow`)."""
        what = "allgather"
        self._check_open(what)
        x = as_buffer(sendbuf, self.rank, what, "sendbuf", writable=False)
        given = recvbuf
        if recvbuf is None:
            recvbuf = _empty_like(x, (self.size, *x.shape))
        out = self._output(recvbuf, x, self.size * x.count, what)
        self._check_alias(x, out, self.rank * x.nbytes, what)
        algo = self._algorithm(what, algorithm, x.nbytes)
        k, r = x.count, self.rank
        if x.is_device and self._gpu is not None and not self._via_host(what, algorithm, x.nbytes):
            algo = self._device_algorithm(what, algorithm, algo)
            dc = self._gpu.call(what, x, out, stream, self._conns, self._polite, async_op)
            return self._submit_device(
                what, dc, lambda: dc.allgather(algo), out.obj, async_op, x, None, 0, algo
            )
        tuner = self._tuner(what, algorithm, x.nbytes, x.dtype, None, 0)
        algo, run_algo = self._host_algorithm(what, algo, tuner)
        if self._plannable(async_op, stream, x, out, given is None):
            key = (what, id(sendbuf), id(given), algorithm)
            p = self._plan_allgather(key, sendbuf, given, x, out, algo, tuner)
            self._add_kind(
                (what, algorithm),
                sendbuf,
                given,
                lambda: self._kind(what, x, given is not None, None, 0, algo, tuner),
            )
            return self._replay(p, sendbuf, given)

        def body(xa: Any, oa: Any) -> None:
            mine = oa[r * k : (r + 1) * k]
            if not _same(mine, xa):
                mine[...] = xa
            if self.size > 1 and k:
                run_algo(self._links(x.dtype, None), xa, oa)

        return self._staged(what, body, x, out, out.obj, async_op, None, 0, algo, stream=stream)

    def broadcast(
        self,
        buf: Any,
        *,
        root: int = 0,
        algorithm: str = "auto",
        async_op: bool = False,
        stream: Any = None,
    ) -> Any:
        """Copy ``buf`` from ``root`` to every rank, in place.

        ``algorithm``, ``async_op`` and ``stream`` are as for :meth:`allreduce`.

        Returns:
            ``buf`` (or a Request).
        """
        if not async_op and stream is None and not self._inflight and type(root) is int:
            try:
                key = ("broadcast", id(buf), root, algorithm)
                p = self._plans.get(key) or self._weak_plans.get(key)
            except TypeError:
                p = None
            if p is not None and p.fits(buf, None) and get_ident() == p.tid:
                return self._replay(p, buf, None)
            kd = self._known_kind(("broadcast", root, algorithm), buf, None)
            if kd is not None:
                return self._replay(kd, buf, None)
        return self._broadcast_slow(buf, root, algorithm, async_op, stream)

    @_rejects
    def _broadcast_slow(
        self,
        buf: Any,
        root: int,
        algorithm: str,
        async_op: bool,
        stream: Any,
    ) -> Any:
        """broadcast without a plan or kind to replay (see :meth:`_allreduce_slow`)."""
        what = "broadcast"
        self._check_open(what)
        self._check_root(root, what)
        b = as_buffer(buf, self.rank, what, "buf", writable=self.rank != root)
        algo = self._algorithm(what, algorithm, b.nbytes)
        if b.is_device and self._gpu is not None and not self._via_host(what, algorithm, b.nbytes):
            algo = self._device_algorithm(what, algorithm, algo)
            dc = self._gpu.call(what, b, None, stream, self._conns, self._polite, async_op)
            return self._submit_device(
                what, dc, lambda: dc.broadcast(root, algo), b.obj, async_op, b, None, root, algo
            )
        tuner = self._tuner(what, algorithm, b.nbytes, b.dtype, None, root)
        algo, run_algo = self._host_algorithm(what, algo, tuner)
        if type(root) is int and self._plannable(async_op, stream, b, None):
            key = (what, id(buf), root, algorithm)
            p = self._plan_broadcast(key, buf, b, root, algo, tuner)
            self._add_kind(
                (what, root, algorithm),
                buf,
                None,
                lambda: self._kind(what, b, False, None, root, algo, tuner),
            )
            return self._replay(p, buf, None)

        def body(ba: Any, _: Any) -> None:
            if self.size > 1 and b.count:
                run_algo(self._links(b.dtype, None), ba, root)

        return self._staged(
            what,
            body,
            b,
            b,
            b.obj,
            async_op,
            None,
            root,
            algo,
            copy_in=self.rank == root,
            copy_out=self.rank != root,
            stream=stream,
        )

    def reduce_scatter(
        self,
        sendbuf: Any,
        recvbuf: Any = None,
        *,
        op: str | ReduceOp = "sum",
        algorithm: str = "auto",
        async_op: bool = False,
        stream: Any = None,
    ) -> Any:
        """Reduce ``sendbuf`` (``size * k`` elements); rank r gets reduced block r.

        ``op``, ``algorithm``, ``async_op`` and ``stream`` are as for :meth:`allreduce`.

        Returns:
            The k-element output (or a Request); a new 1-D array if ``recvbuf`` is None.
        """
        if not async_op and stream is None and not self._inflight:
            try:
                key = ("reduce_scatter", id(sendbuf), id(recvbuf), op, algorithm)
                p = self._plans.get(key) or self._weak_plans.get(key)
            except TypeError:
                p = None
            if p is not None and p.fits(sendbuf, recvbuf) and get_ident() == p.tid:
                return self._replay(p, sendbuf, recvbuf)
            kd = self._known_kind(("reduce_scatter", op, algorithm), sendbuf, recvbuf)
            if kd is not None:
                return self._replay(kd, sendbuf, recvbuf)
        return self._reduce_scatter_slow(sendbuf, recvbuf, op, algorithm, async_op, stream)

    @_rejects
    def _reduce_scatter_slow(
        self,
        sendbuf: Any,
        recvbuf: Any,
        op: str | ReduceOp,
        algorithm: str,
        async_op: bool,
        stream: Any,
    ) -> Any:
        """reduce_scatter without a plan or kind to replay (see :meth:`_allreduce_slow`)."""
        what = "reduce_scatter"
        self._check_open(what)
        rop = parse_op(op, self.rank, what)
        x = as_buffer(sendbuf, self.rank, what, "sendbuf", writable=False)
        given = recvbuf
        if x.count % self.size:
            raise InvalidArgumentError(
                f"rank {self.rank}: {what}: sendbuf has {x.count} elements, "
                f"not a multiple of the communicator size {self.size}"
            )
        k = x.count // self.size
        if recvbuf is None:
            recvbuf = _empty_like(x, (k,))
        out = self._output(recvbuf, x, k, what)
        self._check_alias(x, out, None, what)
        check_op_dtype(rop, x.dtype, self.rank, what)
        algo = self._algorithm(what, algorithm, x.nbytes)
        if x.is_device and self._gpu is not None and not self._via_host(what, algorithm, x.nbytes):
            algo = self._device_algorithm(what, algorithm, algo)
            dc = self._gpu.call(what, x, out, stream, self._conns, self._polite, async_op)
            return self._submit_device(
                what, dc, lambda: dc.reduce_scatter(rop, algo), out.obj, async_op, x, rop, 0, algo
            )
        tuner = self._tuner(what, algorithm, x.nbytes, x.dtype, rop, 0)
        algo, run_algo = self._host_algorithm(what, algo, tuner)
        if self._plannable(async_op, stream, x, out, given is None):
            key = (what, id(sendbuf), id(given), op, algorithm)
            p = self._plan_reduce_scatter(key, sendbuf, given, x, out, rop, algo, tuner)
            self._add_kind(
                (what, op, algorithm),
                sendbuf,
                given,
                lambda: self._kind(what, x, given is not None, rop, 0, algo, tuner),
            )
            return self._replay(p, sendbuf, given)

        def body(xa: Any, oa: Any) -> None:
            if self.size == 1:
                oa[...] = xa
            elif k:
                run_algo(self._links(x.dtype, rop), xa, oa)
            if rop is ReduceOp.AVG:
                finish_avg(oa, self.size)

        return self._staged(what, body, x, out, out.obj, async_op, rop, 0, algo, stream=stream)

    def reduce(
        self,
        sendbuf: Any,
        recvbuf: Any = None,
        *,
        root: int = 0,
        op: str | ReduceOp = "sum",
        algorithm: str = "auto",
        async_op: bool = False,
        stream: Any = None,
    ) -> Any:
        """Reduce ``sendbuf`` across ranks into ``recvbuf`` on ``root``.

        On the root, ``recvbuf=None`` means in place (into ``sendbuf``); other
        ranks ignore ``recvbuf``.  ``op``, ``algorithm``, ``async_op`` and
        ``stream`` are as for :meth:`allreduce`.

        Returns:
            The output on the root, None elsewhere (or a Request).
        """
        if not async_op and stream is None and not self._inflight and type(root) is int:
            try:
                key = ("reduce", id(sendbuf), id(recvbuf), root, op, algorithm)
                p = self._plans.get(key) or self._weak_plans.get(key)
            except TypeError:
                p = None
            if p is not None and p.fits(sendbuf, recvbuf) and get_ident() == p.tid:
                return self._replay(p, sendbuf, recvbuf)
            kd = self._known_kind(("reduce", root, op, algorithm), sendbuf, recvbuf)
            if kd is not None:
                return self._replay(kd, sendbuf, recvbuf)
        return self._reduce_slow(sendbuf, recvbuf, root, op, algorithm, async_op, stream)

    @_rejects
    def _reduce_slow(
        self,
        sendbuf: Any,
        recvbuf: Any,
        root: int,
        op: str | ReduceOp,
        algorithm: str,
        async_op: bool,
        stream: Any,
    ) -> Any:
        """reduce without a plan or kind to replay (see :meth:`_allreduce_slow`)."""
        what = "reduce"
        self._check_open(what)
        self._check_root(root, what)
        rop = parse_op(op, self.rank, what)
        is_root = self.rank == root
        x = as_buffer(sendbuf, self.rank, what, "sendbuf", writable=is_root and recvbuf is None)
        out: Buffer | None = None
        if is_root:
            out = x if recvbuf is None else self._output(recvbuf, x, x.count, what)
            self._check_alias(x, out, 0, what)
        check_op_dtype(rop, x.dtype, self.rank, what)
        algo = self._algorithm(what, algorithm, x.nbytes)
        if x.is_device and self._gpu is not None and not self._via_host(what, algorithm, x.nbytes):
            algo = self._device_algorithm(what, algorithm, algo)
            dc = self._gpu.call(what, x, out, stream, self._conns, self._polite, async_op)
            res = None if out is None else out.obj
            return self._submit_device(
                what, dc, lambda: dc.reduce(rop, root, algo), res, async_op, x, rop, root, algo
            )
        tuner = self._tuner(what, algorithm, x.nbytes, x.dtype, rop, root)
        algo, run_algo = self._host_algorithm(what, algo, tuner)
        if type(root) is int and self._plannable(async_op, stream, x, out):
            key = (what, id(sendbuf), id(recvbuf), root, op, algorithm)
            p = self._plan_reduce(key, sendbuf, recvbuf, x, out, rop, root, algo, tuner)
            self._add_kind(
                (what, root, op, algorithm),
                sendbuf,
                recvbuf,
                lambda: self._kind(what, x, recvbuf is not None, rop, root, algo, tuner),
            )
            return self._replay(p, sendbuf, recvbuf)

        def body(xa: Any, oa: Any) -> None:
            if oa is None:
                oa = np.empty_like(xa)
            if self.size == 1:
                if oa is not xa:
                    oa[...] = xa
            elif x.count:
                run_algo(self._links(x.dtype, rop), xa, oa, root)
            if rop is ReduceOp.AVG and is_root:
                finish_avg(oa, self.size)

        return self._staged(
            what,
            body,
            x,
            out,
            out.obj if out is not None else None,
            async_op,
            rop,
            root,
            algo,
            stream=stream,
        )

    def barrier(self) -> None:
        """Return once every rank has entered the barrier (dissemination, log2 n rounds)."""
        what = "barrier"
        self._check_open(what)
        token = np.zeros(1, np.uint8)

        def run() -> None:
            n, r = self.size, self.rank
            L = self._links(token.dtype, None)
            if self._group is not None:
                algorithms.get(what, "direct")(L)
                return
            got = np.empty(1, np.uint8)
            d = 1
            while d < n:
                L.send((r + d) % n, token)
                L.wait(L.recv((r - d) % n, got))
                d <<= 1
            L.finish()

        dummy = Buffer(token, token, -1)
        algo = "dissemination" if self._group is None else "direct"
        self._submit(what, run, False, dummy, None, 0, algo)

    def close(self) -> None:
        """Release every connection and segment; idempotent."""
        if self._closed:
            return
        self._closed = True
        self._plans.clear()  # they hold views of the group segment
        self._weak_plans.clear()
        self._steps.clear()
        self._kinds_made.clear()
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None
        if self._gpu is not None:
            self._gpu.close()
            self._gpu = None
        if self._wiring is not None:
            self._wiring.close()
            self._wiring = None
        self._conns = {}
        self._status.close()
        self._bootstrap.close()
        if self._unseen:  # a device collective's output is wrong and nothing said so
            self._unseen = False
            raise CommunicatorClosedError(
                f"rank {self.rank}: close: a device collective failed after its call "
                f"returned, and no later call reported it: {self._failed}"
            ) from self._failed

    def abort(self) -> None:
        """Tear down at once without waiting for peers or queued collectives.

        A collective it interrupts on this rank (on another thread, or queued)
        raises :class:`CommunicatorClosedError`, whatever the transport; peers
        waiting on this rank raise :class:`PeerAbortedError`.
        """
        self._aborted = True
        self._closed = True
        self._plans.clear()
        self._weak_plans.clear()
        self._steps.clear()
        self._kinds_made.clear()
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)
            self._executor = None
        if self._gpu is not None:
            self._gpu.close()
            self._gpu = None
        if self._wiring is not None:
            self._wiring.close()
            self._wiring = None
        self._conns = {}
        self._status.close()
        self._bootstrap.close()

    def recent(self) -> list[str]:
        """The flight recorder: this rank's recent collectives, oldest first."""
        return [str(r) for r in self._records()]

    def _records(self) -> list[Record]:
        return [Record(*e) for e in self._recent]

    def __enter__(self) -> Communicator:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<pycoll.Communicator rank {self.rank} of {self.size}>"

    # ------------------------------------------------------------------ helpers
    def _check_open(self, what: str) -> None:
        if self._closed:
            raise CommunicatorClosedError(f"rank {self.rank}: {what}: communicator is closed")
        if self._failed is not None:
            if not threading.current_thread().name.startswith(_WORKER):
                self._unseen = False  # reported to the caller
            raise CommunicatorClosedError(
                f"rank {self.rank}: {what}: communicator is unusable after an earlier "
                f"failure: {self._failed}"
            ) from self._failed

    def _check_root(self, root: object, what: str) -> None:
        if (
            not isinstance(root, (int, np.integer))
            or isinstance(root, bool)
            or not 0 <= int(root) < self.size
        ):
            raise InvalidArgumentError(
                f"rank {self.rank}: {what}: root={root!r} is not in [0, {self.size})"
            )

    def _output(self, recvbuf: Any, x: Buffer, count: int, what: str) -> Buffer:
        out = as_buffer(recvbuf, self.rank, what, "recvbuf", writable=True)
        if out.dtype != x.dtype:
            raise InvalidArgumentError(
                f"rank {self.rank}: {what}: recvbuf dtype {out.dtype} differs from "
                f"sendbuf dtype {x.dtype}"
            )
        if out.count != count:
            raise InvalidArgumentError(
                f"rank {self.rank}: {what}: recvbuf has {out.count} elements, expected {count}"
            )
        if out.device != x.device:
            raise InvalidArgumentError(
                f"rank {self.rank}: {what}: recvbuf is on "
                f"{'host' if out.device < 0 else f'cuda:{out.device}'} but sendbuf on "
                f"{'host' if x.device < 0 else f'cuda:{x.device}'}"
            )
        return out

    def _check_alias(self, x: Buffer, out: Buffer, at: int | None, what: str) -> None:
        """``out`` may hold ``x`` whole at byte ``at`` (in place) or not touch it;
        ``at`` None: the collective has no in-place form."""
        if at is None:
            if _overlaps(x, out):
                raise InvalidArgumentError(
                    f"rank {self.rank}: {what}: recvbuf overlaps sendbuf; use separate arrays"
                )
            return
        if not _aliases(x, out, at):
            return
        if what == "allgather":
            how = f"in place, sendbuf must be exactly block {self.rank} of recvbuf"
        else:
            how = "in place, pass the same array (or no recvbuf)"
        raise InvalidArgumentError(
            f"rank {self.rank}: {what}: recvbuf partly overlaps sendbuf; for {how}, "
            "else use separate arrays"
        )

    def _candidates_for(self, what: str) -> tuple[str, ...]:
        avail = self._candidates.get(what)
        if avail is None:
            avail = self._candidates[what] = tuple(
                a for a in algorithms.names(what) if self._usable(a)
            )
        return avail

    def _algorithm(self, what: str, algorithm: str, nbytes: int) -> str:
        avail = self._candidates_for(what)
        if not isinstance(algorithm, str):
            raise InvalidArgumentError(
                f"rank {self.rank}: {what}: algorithm={algorithm!r} must be a string"
            )
        name = algorithm.lower()
        if name == "auto":
            name = self.config.algorithm_for(what) or "auto"
        if name == "auto":
            return cost.choose(what, avail, self.size, nbytes, self.config.chunk_bytes)
        if name not in avail:
            if name in algorithms.names(what):
                raise InvalidArgumentError(
                    f"rank {self.rank}: {what}: algorithm={algorithm!r} is not available "
                    f"here: {self._unusable_why(name)}"
                )
            raise InvalidArgumentError(
                f"rank {self.rank}: {what}: algorithm={algorithm!r} is not one of "
                f"{', '.join(('auto', *algorithms.names(what)))}"
            )
        return name

    def _usable(self, algorithm: str) -> bool:
        """Whether host ``algorithm`` can run here (``direct`` needs the shared group)."""
        return algorithm != "direct" or self.size == 1 or self._group is not None

    def _unusable_why(self, algorithm: str) -> str:
        assert self._wiring is not None
        return f"{algorithm} needs every rank on one host sharing memory ({self._wiring.group_why})"

    def _tuner(
        self,
        what: str,
        requested: str,
        nbytes: int,
        dtype: np.dtype[Any],
        op: ReduceOp | None,
        root: int,
    ) -> Tuner | None:
        """The online choice for host calls of this kind (:mod:`pycoll.tune`), or
        None where ``auto`` was not asked for, tuning is off, results could
        depend on the algorithm, or the model sees no close contender.  Made at
        the first call of its kind, which every rank makes at the same point, and
        kept (plans hold it), so every rank's schedule counts the same calls."""
        if (
            self.size < 2
            or not self.config.tune
            or not tunable(what, self.size, dtype)
            or requested.lower() != "auto"
            or self.config.algorithm_for(what)
        ):
            return None
        key = (what, nbytes, dtype, op, root)
        try:
            return self._tuners[key]
        except KeyError:
            pass
        if len(self._tuners) >= TUNERS_MAX:
            # Later kinds are left to the model and not recorded: the cache stays
            # bounded, and every rank, making the same calls, stops at the same kind.
            # (No tuner is ever evicted: plans of one rank may hold one that another
            # rank would make afresh, and their schedules would part.)
            return None
        t = None
        names = cost.contenders(
            what,
            self._candidates_for(what),
            self.size,
            nbytes,
            self.config.chunk_bytes,
        )
        if len(names) > 1:
            label = f"{what} {nbytes} B {dtype}" + (f" {op.name.lower()}" if op else "")
            t = Tuner(label, names, self._agree)
        self._tuners[key] = t
        return t

    def _host_algorithm(
        self, what: str, algo: str, tuner: Tuner | None
    ) -> tuple[str, Callable[..., None]]:
        """The name a call records and the function that runs it on host arrays:
        ``algo``'s, or one that runs what ``tuner`` names."""
        if tuner is None:
            return algo, algorithms.get(what, algo)
        try:
            return self._tuned[tuner]
        except KeyError:
            fns = [algorithms.get(what, a) for a in tuner.names]
            made = self._tuned[tuner] = (f"auto[{','.join(tuner.names)}]", tuner.over(fns))
            return made

    def _agree(self, v: np.ndarray) -> np.ndarray:
        """``v`` summed over the ranks, the same bits on each (a tuner's round ends)."""
        out = np.empty_like(v)
        L = self._links(v.dtype, ReduceOp.SUM)
        # every rank agrees at the same call, by whichever path it runs it
        L.tag, L.fp = (_AGREE_FP << 32) | (self._seq & _M32), _AGREE_FP
        a = cost.choose(
            "allreduce",
            self._candidates_for("allreduce"),
            self.size,
            v.nbytes,
            self.config.chunk_bytes,
        )
        algorithms.get("allreduce", a)(L, v, out)
        return out

    def _via_host(self, what: str, requested: str, nbytes: int) -> bool:
        """Whether a device collective goes through host memory and the host
        algorithms: small messages when ``auto`` picks (see
        :meth:`Config.device_host_limit`), except, on a GPU that all ranks share
        and with the default limits, where a rank's copy back to the device would
        be under :data:`~pycoll.config.SLICED_COPY_BYTES`.  A broadcast between
        two ranks stays: its one copy back is queued and nothing waits for it
        (15-17 us a call on the H200, against 55-80 us on the device; at n = 4
        the host path took 410 us).
        The choice depends only on what every rank passes, so all ranks agree."""
        if self.size == 1 or nbytes > self.config.device_host_limit(what):
            return False
        if requested.lower() != "auto" or self.config.algorithm_for(what):
            return False
        g = self._gpu
        if g is None or not g.shared_device or (what == "broadcast" and self.size == 2):
            return True
        if self.config.device_host_bytes is not None:
            return True
        if what == "allgather":
            back = nbytes * self.size
        elif what == "reduce_scatter":
            back = nbytes // self.size
        else:
            back = nbytes
        return back >= SLICED_COPY_BYTES

    def _device_algorithm(self, what: str, requested: str, algo: str) -> str:
        """The algorithm for device buffers: ``direct`` (one-sided windows between
        every pair) when all pairs have them and no other one was asked for."""
        assert self._gpu is not None
        explicit = requested.lower() != "auto" or bool(self.config.algorithm_for(what))
        if self._gpu.one_sided and (algo == "direct" or not explicit):
            return "direct"
        return "ring" if algo == "direct" else algo

    def _links(self, dtype: np.dtype[Any], op: ReduceOp | None) -> Links:
        """The Links for (dtype, op), reused across calls.

        Their deadline is PYCOLL_TIMEOUT of inactivity: each wait re-arms it
        (:meth:`transports.base.Deadline.overdue`), so a call sets none.

        Only one collective runs at a time (async ones on the worker thread, and
        blocking ones inline only while none is queued), and each one ends with
        ``finish()``, so a cached Links holds no pending request between calls.
        """
        key = (dtype, op)
        L = self._links_cache.get(key)
        if L is None or L.conns is not self._conns:
            L = Links(
                self.rank,
                self.size,
                self._conns,
                Deadline(None, self.config.timeout),
                self.config.chunk_bytes,
                dtype,
                None if op is None else ufunc(op),
                self._backoff,
                self._group,
                self._crowded,
            )
            self._links_cache[key] = L
        L.tag, L.fp = self._tag, self._fp  # the running call's (see _execute)
        L._backoff = (
            self._polite if threading.current_thread() is not self._caller else self._backoff
        )
        return L

    def _staged(
        self,
        what: str,
        body: Callable[[Any, Any], None],
        x: Buffer,
        out: Buffer | None,
        result: Any,
        async_op: bool,
        op: ReduceOp | None,
        root: int,
        algo: str,
        copy_in: bool = True,
        copy_out: bool = True,
        stream: Any = None,
    ) -> Any:
        """Submit the host collective ``body(hx, ho)``: on host arrays themselves;
        device buffers go through pinned copies ordered on ``stream`` (a job of the
        progress thread, :meth:`GpuContext.through_host`) when this rank has a GPU
        context, else through plain host copies."""
        if x.is_device and self._gpu is not None:
            job = self._gpu.through_host(x, out, stream, copy_in, copy_out, async_op)
            return self._submit_device(
                what, job, lambda: job.run(body), result, async_op, x, op, root, algo
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

        return self._submit(what, run, async_op, x, op, root, algo)

    def _submit(
        self,
        what: str,
        run: Callable[[], Any],
        async_op: bool,
        x: Buffer,
        op: ReduceOp | None,
        root: int,
        algo: str,
    ) -> Any:
        if async_op:
            with self._lock:
                if self._executor is None:
                    self._executor = ThreadPoolExecutor(1, thread_name_prefix=_WORKER)
                self._inflight += 1
                fut = self._executor.submit(self._execute, what, run, x, op, root, algo)
            fut.add_done_callback(self._done)
            return Request(fut, what, self.rank)
        with self._lock:
            queued = self._inflight > 0
            if queued:
                assert self._executor is not None
                self._inflight += 1
                fut = self._executor.submit(self._execute, what, run, x, op, root, algo)
        if queued:
            fut.add_done_callback(self._done)
            try:
                return fut.result()
            except CommunicatorClosedError:
                self._unseen = False  # an earlier device failure, reported here
                raise
        return self._execute(what, run, x, op, root, algo)

    def _submit_device(
        self,
        what: str,
        job: Job,
        run: Callable[[], Any],
        result: Any,
        async_op: bool,
        x: Buffer,
        op: ReduceOp | None,
        root: int,
        algo: str,
    ) -> Any:
        """Hand a started device collective to the progress thread and return at
        once: ``result`` (its output), or a :class:`DeviceRequest`; without eager
        module loading a blocking one runs as a host call does (see
        :mod:`pycoll.gpu.jobs`).  The caller's
        side is already enqueued (see :mod:`pycoll.gpu.jobs`)."""
        if not job.gated and not async_op:  # lazy module loading: as a host call
            try:
                self._submit(what, run, False, x, op, root, algo)
            finally:
                job.settle()
            return result
        try:
            with self._lock:
                if self._executor is None:
                    self._executor = ThreadPoolExecutor(1, thread_name_prefix=_WORKER)
                fut = self._executor.submit(
                    self._execute_device, job, async_op, what, run, x, op, root, algo
                )
                self._inflight += 1
        except BaseException:
            job.settle()  # it will never run: no stream may wait for it
            raise
        fut.add_done_callback(self._done)
        if async_op:
            assert self._gpu is not None
            return DeviceRequest(fut, what, self.rank, job, result, x.obj, self._gpu)
        return result

    def _execute_device(
        self,
        job: Job,
        async_op: bool,
        what: str,
        run: Callable[[], Any],
        x: Buffer,
        op: ReduceOp | None,
        root: int,
        algo: str,
    ) -> Any:
        """:meth:`_execute` on the progress thread, for a device collective.  Its
        gate opens whatever happens; a blocking call's failure, which no caller
        holds a Request for, leaves the communicator unusable (also a user error
        found this late) and is raised by the next call or by :meth:`close`."""
        try:
            return self._execute(what, run, x, op, root, algo)
        except BaseException as exc:
            if not async_op:
                if self._failed is None:
                    self._failed = exc
                if self._failed is exc:
                    self._unseen = True
            raise
        finally:
            job.settle()

    def _done(self, _: Future[Any]) -> None:
        with self._lock:
            self._inflight -= 1

    def _execute(
        self,
        what: str,
        run: Callable[[], Any],
        x: Buffer,
        op: ReduceOp | None,
        root: int,
        algo: str,
    ) -> Any:
        self._check_open(what)
        if not self._enter(False):
            self._intruded(what)
        try:
            self._seq = seq = self._seq + 1
            call = Call(what, x.count, x.dtype, op, root, algo)
            fp = self._fp = call.fp
            self._tag = (fp << 32) | (seq & _M32)  # what _links gives this call's messages
            self._seen(call)
            rec: list[Any] = [seq, call, monotonic(), None, "running"]
            self._recent.append(rec)
            trace = log.isEnabledFor(TRACE)
            if trace:
                log.log(TRACE, "start %s", Record(*rec))
            try:
                if self.config.check:
                    self._check_match(self._seq, call, x, op)
                result = run()
            except BaseException as exc:
                self._fail(rec, exc)
        finally:
            self._leave()
        if self._failed is not None:  # another thread's call came in meanwhile
            self._overlapped(rec)
        rec[_ENDED] = monotonic()
        rec[_STATUS] = "ok"
        if trace:
            log.log(TRACE, "done %s", Record(*rec))
        return result

    def _replay(self, p: _Plan | _Kind, sendbuf: Any, recvbuf: Any) -> Any:
        """Run a plan or a kind of call (the fast path): what :meth:`_execute`
        does, minus the checks that its making already did.  ``sendbuf`` and
        ``recvbuf``: what the caller passed (a weak plan returns them by
        reference, see :class:`_Held`; a kind runs on them)."""
        if not self._enter(False):
            self._intruded(p.call.collective)
        try:
            self._seq = seq = self._seq + 1
            rec: list[Any] = [seq, p.call, monotonic(), None, "running"]
            self._recent.append(rec)
            trace = log.isEnabledFor(TRACE)
            if trace:
                log.log(TRACE, "start %s", Record(*rec))
            try:
                run: Any = p.run  # a plan's takes no arguments, a kind's the caller's arrays
                result = run() if type(p) is _Plan else run(sendbuf, recvbuf)
            except BaseException as exc:
                self._fail(rec, exc)
        finally:
            self._leave()
        if self._failed is not None:  # another thread's call came in meanwhile
            self._overlapped(rec)
        rec[_ENDED] = monotonic()
        rec[_STATUS] = "ok"
        if trace:
            log.log(TRACE, "done %s", Record(*rec))
        if result is _SENDBUF:
            return sendbuf
        return recvbuf if result is _RECVBUF else result

    def _intruded(self, what: str) -> NoReturn:
        """A call found another thread's collective running: fail it, and leave
        the communicator unusable so that the running one fails too (its peers
        may have paired it with a different call)."""
        cur = self._recent[-1] if self._recent else None
        running = f" (#{cur[_SEQ]} {cur[_CALL].collective})" if cur is not None else ""
        err = ConcurrentCallError(
            f"rank {self.rank}: {what}: called while another thread's collective{running} "
            "runs on this communicator; collectives pair up across ranks by their order, and "
            "calls that overlap have none that every rank shares, so both fail and the "
            "communicator is unusable.  Call collectives from one thread at a time (the "
            "next after the last returned), or queue them with async_op=True",
            rank=self.rank,
        )
        if self._failed is None:
            self._failed = err
        self._forget_plans()
        log.error("%s", err)
        raise err

    def _overlapped(self, rec: list[Any]) -> NoReturn:
        """Collective ``rec`` ran while the communicator failed on another thread
        (a call that overlapped it, see :meth:`_intruded`): its result is not
        to be trusted."""
        failed = self._failed
        rec[_STATUS] = "failed: overlapped"
        if isinstance(failed, ConcurrentCallError):
            err: PycollError = ConcurrentCallError(
                f"rank {self.rank}: {rec[_CALL].collective} #{rec[_SEQ]}: another thread "
                "called a collective while this one ran; its result cannot be trusted "
                f"(peers may have paired it with another call): {failed}",
                rank=self.rank,
            )
        else:
            err = CommunicatorClosedError(
                f"rank {self.rank}: {rec[_CALL].collective} #{rec[_SEQ]}: the communicator "
                f"failed on another thread while this collective ran: {failed}"
            )
        raise err from failed

    def _forget_plans(self) -> None:
        self._plans.clear()
        self._weak_plans.clear()
        self._steps.clear()  # they hold views of the group segment too
        self._kinds_made.clear()  # ... and so do the kinds' steps

    def _fail(self, rec: list[Any], exc: BaseException) -> NoReturn:
        """Record the failure of collective ``rec`` (its flight recorder entry)
        and raise it as a pycoll error.

        Transport errors become pycoll's; every error but a user error leaves the
        communicator unusable.
        """
        where = f"{rec[_CALL].collective} #{rec[_SEQ]}"
        if isinstance(exc, TagMismatchError):
            mis = self._mismatch(rec, exc)
            mis.__cause__ = exc
            exc = mis
        elif self._closed and not isinstance(exc, (PycollError, KeyboardInterrupt)):
            # close() or abort() tore the connections down under the collective:
            # one class whatever the transport made of it (its error is the cause)
            how = "aborted" if self._aborted else "closed"
            err: PycollError = CommunicatorClosedError(
                f"rank {self.rank}: {where}: the communicator was {how} while it ran"
            )
            err.__cause__ = exc
            exc = err
        elif isinstance(exc, WireError):
            err = from_transport(exc, self.rank, where, self._kinds)
            err.__cause__ = exc
            exc = err
        rec[_STATUS] = f"failed: {type(exc).__name__}"
        if isinstance(exc, InvalidArgumentError):
            exc._counted = True  # type: ignore[attr-defined]  # this call took its number
            raise exc
        if self._failed is None:
            self._failed = exc
        self._forget_plans()
        # The finished frames below us may hold views of shared segments (a slot
        # the collective was reading); the error outlives them in the Request, in
        # _failed and in the caller's hands, so drop their locals (the traceback's
        # lines stay), or abort()/close() could not unmap those segments.
        for e in (exc, exc.__cause__):
            if e is not None:
                traceback.clear_frames(e.__traceback__)
        if isinstance(exc, PycollError):
            exc.recorder = tuple(self.recent())
            if isinstance(exc, CollectiveTimeout):
                self._explain_timeout(exc)
            # Raised, so not logged at ERROR too (the user would see it twice).
            log.info("rank %d raises: %s", self.rank, exc)
            log.info("flight recorder of rank %d:\n  %s", self.rank, "\n  ".join(exc.recorder))
        if isinstance(exc, CollectiveMismatchError) and self._wiring is not None:
            # The peers may wait for bytes this rank will never send, or have
            # more of the mismatched call to run: closing every connection and
            # the group makes them fail now (a peer gone), not at the timeout.
            self._wiring.close()
            self._wiring = None
            self._conns = {}
        raise exc

    def _reject(self, what: str) -> None:
        """Count a call that was rejected for its arguments: it takes a sequence
        number (and a step of the group's chain) as if it had run.

        Ranks that all reject a call stay in step.  A rank that alone rejects it
        and goes on is then one call apart from the others, and its next
        collective raises :class:`CollectiveMismatchError` on every rank instead
        of pairing its calls with the others' previous ones, off by one for the
        rest of the job.  Behind queued asynchronous calls it counts in turn."""
        with self._lock:
            if self._inflight:
                assert self._executor is not None
                self._inflight += 1
                self._executor.submit(self._skip, what).add_done_callback(self._done)
                return
        self._skip(what)

    def _skip(self, what: str) -> None:
        self._seq += 1
        now = monotonic()
        self._recent.append(
            [
                self._seq,
                Call(what, 0, None, None, 0, "-"),
                now,
                now,
                "rejected: InvalidArgumentError",
            ]
        )
        if self._group is not None and self._wiring is not None:
            self._group.skip(zlib.crc32(f"rejected|{what}".encode()))

    def _seen(self, call: Call) -> None:
        """Keep ``call`` by fingerprint, to name a peer's call in a mismatch."""
        fps = self._fps
        fp = call.fp
        if fp not in fps:
            _make_room(fps, FINGERPRINTS_MAX)
            fps[fp] = call

    def _mismatch(self, rec: list[Any], exc: TagMismatchError) -> CollectiveMismatchError:
        """The error for a message (or a group step) whose tag says another call."""
        call: Call = rec[_CALL]
        here = f"rank {self.rank}: {call.collective} #{rec[_SEQ]}"
        p = exc.peer
        if exc.transport == "shm" and "group:" in str(exc):  # the group's chain of calls
            why = str(exc)
        else:
            got_seq, got_fp = exc.got & _M32, exc.got >> 32
            mine_seq, mine_fp = exc.expected & _M32, exc.expected >> 32
            theirs = self._fps.get(got_fp)
            desc = _describe(theirs) if theirs is not None else f"fingerprint {got_fp:#010x}"
            why = (
                f"rank {p} sent a message of its call #{got_seq} ({desc}) where this rank "
                f"runs call #{mine_seq} ({_describe(call)})"
            )
            if got_seq != mine_seq:
                why += (
                    f"; the ranks are {abs(got_seq - mine_seq)} call(s) apart (one skipped, or "
                    "alone rejected, a call)"
                )
            elif got_fp == mine_fp:
                why += "; the same call, another message: do the ranks run the same algorithm?"
        return CollectiveMismatchError(
            f"{here}: mismatched collectives: {why} (via {exc.transport})",
            rank=self.rank,
            ranks=() if p is None else (p,),
            transport=exc.transport,
        )

    # ------------------------------------------------------------------ fast path
    def _plannable(
        self, async_op: bool, stream: Any, x: Buffer, out: Buffer | None, fresh: bool = False
    ) -> bool:
        """Whether this call may become a plan (see :class:`_Plan`): a blocking call
        on host arrays with nothing queued, or on CuPy or torch device arrays
        that go through the host (their size is bounded by that choice) into an
        output the caller gave (``fresh``: pycoll would allocate it).  NumPy arrays
        of any size: the large ones make weak plans (:meth:`_detached`).  torch CPU
        tensors up to :data:`PLAN_MAX_BYTES`, checked by signature as on a device
        (a plan holds them).  Other buffers (memoryview, bytearray, ...) never:
        no export of theirs outlives the call, so a bytearray stays resizable."""
        if async_op or stream is not None or self.config.check or self._inflight:
            return False
        if x.is_device:
            return False  # device buffers: a job of the progress thread each call
        if isinstance(x.obj, np.ndarray) and (out is None or isinstance(out.obj, np.ndarray)):
            return True
        return (
            not fresh
            and x.nbytes <= PLAN_MAX_BYTES
            and is_torch(x.obj)
            and (out is None or (is_torch(out.obj) and out.nbytes <= PLAN_MAX_BYTES))
        )

    def _host_side(
        self, x: Buffer, out: Buffer | None, copy_in: bool = True, copy_out: bool = True
    ) -> tuple[Buffer, Buffer | None, Callable[[Callable[[], Any]], Callable[[], Any]]]:
        """The host buffers a plan runs on (plans are of host arrays only), and the
        wrapper of its ``run`` (none)."""
        x, out = self._detached(x, out)
        return x, out, _unwrapped

    @staticmethod
    def _detached(x: Buffer, out: Buffer | None) -> tuple[Buffer, Buffer | None]:
        """The host buffers of a plan: the caller's up to :data:`PLAN_MAX_BYTES`;
        above, views that do not keep the caller's arrays alive, standing for
        them by :data:`_SENDBUF` and :data:`_RECVBUF` (a weak plan, see :class:`_Plan`)."""
        if x.nbytes <= PLAN_MAX_BYTES and (out is None or out.nbytes <= PLAN_MAX_BYTES):
            return x, out
        dx = Buffer(_SENDBUF, _unowned(x.flat), x.device, x.logical)
        if out is None or out is x:  # in place
            return dx, None if out is None else dx
        return dx, Buffer(_RECVBUF, _unowned(out.flat), out.device, out.logical)

    def _keep(self, key: tuple[Any, ...], p: _Plan) -> _Plan:
        self._seen(p.call)
        plans = self._weak_plans if p.weak else self._plans
        _make_room(plans, WEAK_PLAN_MAX if p.weak else PLAN_MAX)
        if p.weak:

            def forget(ref: weakref.ref[Any]) -> None:  # an array of the plan is gone
                q = plans.get(key)
                if q is not None and (q.x is ref or q.o is ref):
                    plans.pop(key, None)

            p.x = weakref.ref(p.x, forget)
            if p.o is not None:
                p.o = weakref.ref(p.o, forget)
        plans[key] = p
        return p

    def _known_kind(self, head: tuple[Any, ...], sendbuf: Any, recvbuf: Any) -> _Kind | None:
        """The kind of call (:class:`_Kind`) ``head`` on these arrays, or None
        where there is none or these arrays may not use it."""
        try:
            k = self._kinds_made.get(_kind_key(head, sendbuf, recvbuf))  # type: ignore[arg-type]
        except TypeError:  # an unhashable op or algorithm: the slow path says why
            return None
        if k is None:
            return None
        if k.xw and not sendbuf.flags.writeable:
            return None
        if k.ow and (not recvbuf.flags.writeable or np.may_share_memory(sendbuf, recvbuf)):
            return None
        last = k.last
        if last is not None and last[0]() is sendbuf and (last[1] is None or last[1]() is recvbuf):
            return None  # the same arrays twice in a row: the slow path makes them a plan
        k.last = (weakref.ref(sendbuf), None if recvbuf is None else weakref.ref(recvbuf))
        return k

    def _add_kind(
        self, head: tuple[Any, ...], sendbuf: Any, recvbuf: Any, make: Callable[[], _Kind]
    ) -> None:
        """Keep the kind of call ``head`` on NumPy arrays like these (``make()``
        makes it), unless there is one: the slow path calls it with each plan."""
        key = _kind_key(head, sendbuf, recvbuf)
        kinds = self._kinds_made
        if key is None or key in kinds:
            return
        _make_room(kinds, KINDS_MAX)
        kinds[key] = make()

    def _kind(
        self,
        what: str,
        x: Buffer,
        given: bool,
        rop: ReduceOp | None,
        root: int,
        algo: str,
        tuner: Tuner | None,
    ) -> _Kind:
        """The kind of call (:class:`_Kind`) ``what`` on arrays like ``x``, with an
        output given (``given``) or not.  It takes the steps its plan would take
        (:meth:`_plan_allreduce` and the others), so ranks may mix the two."""
        n, r, c, dtype = self.size, self.rank, x.count, x.dtype
        is_root = r == root
        # an allreduce of nothing still steps with its peers, as its plan does
        moves = n > 1 and (c > 0 or what == "allreduce")
        step = self._step(what, algo, dtype, rop, c, root, tuner) if moves else None
        avg = rop is ReduceOp.AVG and (what != "reduce" or is_root)
        # what each call does besides the step, settled here rather than per call
        bcast = what == "broadcast"
        scratch = what == "reduce" and not is_root  # the output is scratch, None returned
        gather = what == "allgather"
        fresh = not given and what in ("allgather", "reduce_scatter")  # a new output a call
        shape = (n, *x.shape) if gather else (c // n,)
        copy = n == 1 and not gather  # alone: out of place, the output is the input

        def run(s: Any, o: Any) -> Any:
            xa = s.reshape(-1)
            if bcast:
                if step is not None:
                    step(xa, None)
                return s
            if scratch:
                oa = np.empty_like(xa)
            elif fresh:
                o = np.empty(shape, dtype)
                oa = o.reshape(-1)
            else:
                oa = xa if o is None else o.reshape(-1)
            if gather:
                oa[r * c : (r + 1) * c] = xa
            if step is not None:
                step(xa, oa)
            elif copy and oa is not xa:
                oa[...] = xa
            if avg:
                finish_avg(oa, n)
            if scratch:
                return None
            return s if o is None else o

        # written: sendbuf in place, or an output that must not overlap sendbuf
        if bcast:
            xw = not is_root
        else:
            xw = not given and (what == "allreduce" or (what == "reduce" and is_root))
        ow = given and (what != "reduce" or is_root)
        kind = _Kind(what, run, x, rop, root, algo, xw, ow)
        self._seen(kind.call)
        return kind

    def _step(
        self,
        what: str,
        algo: str,
        dtype: np.dtype[Any],
        op: ReduceOp | None,
        count: int,
        root: int,
        tuner: Tuner | None = None,
    ) -> Callable[[Any, Any], None]:
        """``step(x, out)``: algorithm ``algo`` of ``what`` on flat host arrays,
        (the body of a plan, size > 1); with a
        ``tuner``, the algorithm it names for each call.

        A step depends on none of the arrays, so plans of the same kind of call
        share one (:data:`STEPS_MAX`): a call on arrays the fast path does not
        know (a fresh view, a new array each time) still skips making it."""
        key = (what, algo, dtype, op, count, root, tuner, get_ident())
        step = self._steps.get(key)
        if step is None:
            _make_room(self._steps, STEPS_MAX)
            step = self._steps[key] = self._make_step(key)
        return step

    def _make_step(self, key: tuple[Any, ...]) -> Callable[[Any, Any], None]:
        """The step of ``key``, ``_step``'s arguments and the calling thread."""
        what, algo, dtype, op, count, root, tuner, _ = key
        if tuner is not None:
            return tuner.over([self._step(what, a, dtype, op, count, root) for a in tuner.names])
        L = self._links(dtype, op)
        bo = L.backoff  # the waiting policy of this thread
        fp = fingerprint(what, count, dtype, op, root)  # made once: a call adds a store
        if algo == "direct":
            fast = direct.prepare(what, L, bo, count, root, fp)
            if fast is not None:
                return fast
        hi = fp << 32
        g = algorithms.get(what, algo)
        # the algorithms' signatures: broadcast is in place (b is None), reduce has a root
        args: Callable[[Any, Any], tuple[Any, ...]] = {
            "broadcast": lambda a, b: (a, root),
            "reduce": lambda a, b: (a, b, root),
        }.get(what, lambda a, b: (a, b))

        def step(a: Any, b: Any) -> None:
            L._backoff = bo  # an asynchronous call may have left another one
            L.tag, L.fp = hi | (self._seq & _M32), fp  # _replay has counted this call
            g(L, *args(a, b))

        return step

    def _plan_allreduce(
        self,
        key: tuple[Any, ...],
        sendbuf: Any,
        recvbuf: Any,
        x: Buffer,
        out: Buffer,
        rop: ReduceOp,
        algo: str,
        tuner: Tuner | None = None,
    ) -> _Plan:
        x, ho, wrap = self._host_side(x, out)
        assert ho is not None
        n, xa, oa, res = self.size, x.flat, ho.flat, ho.obj
        avg = rop is ReduceOp.AVG
        if n == 1:
            copy = oa is not xa

            def run() -> Any:
                if copy:
                    oa[...] = xa
                if avg:
                    finish_avg(oa, n)
                return res

        else:
            step = self._step("allreduce", algo, x.dtype, rop, x.count, 0, tuner)

            def run() -> Any:
                step(xa, oa)
                if avg:
                    finish_avg(oa, n)
                return res

        return self._keep(
            key, _Plan("allreduce", sendbuf, recvbuf is None, recvbuf, wrap(run), x, rop, 0, algo)
        )

    def _plan_allgather(
        self,
        key: tuple[Any, ...],
        sendbuf: Any,
        recvbuf: Any,
        x: Buffer,
        out: Buffer,
        algo: str,
        tuner: Tuner | None = None,
    ) -> _Plan:
        x, ho, wrap = self._host_side(x, out)
        assert ho is not None
        n, r, k, xa = self.size, self.rank, x.count, x.flat
        step = self._step("allgather", algo, x.dtype, None, k, 0, tuner) if n > 1 and k else None
        if recvbuf is None:
            shape, dtype = (n, *sendbuf.shape), x.dtype

            def run() -> Any:
                o = np.empty(shape, dtype)
                oa = o.reshape(-1)
                oa[r * k : (r + 1) * k] = xa
                if step is not None:
                    step(xa, oa)
                return o

        else:
            oa, res = ho.flat, ho.obj
            mine = oa[r * k : (r + 1) * k]
            copy = not _same(mine, xa)

            def run() -> Any:
                if copy:
                    mine[...] = xa
                if step is not None:
                    step(xa, oa)
                return res

        p = _Plan("allgather", sendbuf, False, recvbuf, wrap(run), x, None, 0, algo)
        return self._keep(key, p)

    def _plan_broadcast(
        self,
        key: tuple[Any, ...],
        buf: Any,
        b: Buffer,
        root: int,
        algo: str,
        tuner: Tuner | None = None,
    ) -> _Plan:
        b, _, wrap = self._host_side(b, b, self.rank == root, self.rank != root)
        ba, res = b.flat, b.obj
        if self.size > 1 and b.count:
            step = self._step("broadcast", algo, b.dtype, None, b.count, root, tuner)

            def run() -> Any:
                step(ba, None)
                return res

        else:

            def run() -> Any:
                return res

        w = self.rank != root
        return self._keep(key, _Plan("broadcast", buf, w, None, wrap(run), b, None, root, algo))

    def _plan_reduce_scatter(
        self,
        key: tuple[Any, ...],
        sendbuf: Any,
        recvbuf: Any,
        x: Buffer,
        out: Buffer,
        rop: ReduceOp,
        algo: str,
        tuner: Tuner | None = None,
    ) -> _Plan:
        x, ho, wrap = self._host_side(x, out)
        assert ho is not None
        n, xa, k = self.size, x.flat, ho.count
        avg = rop is ReduceOp.AVG
        step = (
            self._step("reduce_scatter", algo, x.dtype, rop, x.count, 0, tuner) if n > 1 else None
        )

        def body(oa: Any) -> None:
            if step is None:
                oa[...] = xa
            elif k:
                step(xa, oa)
            if avg:
                finish_avg(oa, n)

        if recvbuf is None:
            dtype = x.dtype

            def run() -> Any:
                o = np.empty((k,), dtype)
                body(o)
                return o

        elif step is not None and k and not avg:
            oa, res = ho.flat, ho.obj

            def run() -> Any:  # the usual call: body's tests made once
                step(xa, oa)
                return res

        else:
            oa, res = ho.flat, ho.obj

            def run() -> Any:
                body(oa)
                return res

        return self._keep(
            key, _Plan("reduce_scatter", sendbuf, False, recvbuf, wrap(run), x, rop, 0, algo)
        )

    def _plan_reduce(
        self,
        key: tuple[Any, ...],
        sendbuf: Any,
        recvbuf: Any,
        x: Buffer,
        out: Buffer | None,
        rop: ReduceOp,
        root: int,
        algo: str,
        tuner: Tuner | None = None,
    ) -> _Plan:
        x, out, wrap = self._host_side(x, out)
        n, xa = self.size, x.flat
        is_root = self.rank == root
        # Off the root the output is scratch.  A weak plan (large arrays) holds no
        # memory: it takes fresh scratch each call, as the slow path does.
        fresh = out is None and isinstance(x.obj, _Held)
        oa = out.flat if out is not None else np.empty(0 if fresh else xa.size, xa.dtype)
        res = out.obj if out is not None else None
        avg = rop is ReduceOp.AVG and is_root
        if n == 1:
            copy = oa is not xa

            def run() -> Any:
                if copy:
                    oa[...] = xa
                if avg:
                    finish_avg(oa, n)
                return res

        elif x.count:
            step = self._step("reduce", algo, x.dtype, rop, x.count, root, tuner)

            def run() -> Any:
                step(xa, np.empty_like(xa) if fresh else oa)
                if avg:
                    finish_avg(oa, n)
                return res

        else:

            def run() -> Any:
                if avg:
                    finish_avg(oa, n)
                return res

        o = recvbuf if is_root else None
        w = is_root and recvbuf is None
        return self._keep(key, _Plan("reduce", sendbuf, w, o, wrap(run), x, rop, root, algo))

    def _explain_timeout(self, exc: CollectiveTimeout) -> None:
        """Ask the live ranks where they are (pycoll.diagnose) and say it in ``exc``."""
        recs = self._records()
        cur = recs[-1]
        mine = summary(self.rank, recs, _COLL_IDS)
        names = {v: k for k, v in _COLL_IDS.items()}
        got = self._status.exchange(mine, grace_for(self.config.timeout))
        reports = {self.rank: decode(mine, names)}
        for p, words in got.items():
            reports[p] = decode(words, names)
        status: dict[int, str] = {}
        arrived: list[int] = []
        for p in range(self.size):
            st = reports.get(p)
            if st is None:
                status[p] = str(RankStatus(p, answered=False))
                continue
            status[p] = str(st)
            if st.current_seq == cur.seq and st.current == cur.collective and st.state != "done":
                arrived.append(p)
        missing = [p for p in range(self.size) if p not in arrived]
        exc.waiting_on = exc.missing
        exc.status = status
        if got:  # else nobody answered: the peers we waited on are all we know
            exc.missing = tuple(missing) or exc.waiting_on
        exc.args = (
            f"{exc.args[0]}: no progress for {self.config.timeout:g} s (PYCOLL_TIMEOUT); "
            f"ranks that did not arrive at {cur.collective} #{cur.seq}: {list(exc.missing)}; "
            f"status: {'; '.join(status.values())}; recent collectives on rank {self.rank}: "
            + " | ".join(self.recent()[-4:]),
        )

    def _check_match(self, seq: int, call: Call, x: Buffer, op: ReduceOp | None) -> None:
        """PYCOLL_CHECK=1: compare what every rank is about to run (one small allgather)."""
        if self.size == 1:
            return
        sig = np.array(
            [
                seq,
                _COLL_IDS[call.collective],
                x.count,
                _DTYPE_IDS.get(x.dtype, 0),
                _OP_IDS.get(op, 0) if op else 0,
                call.root,
                _algo_id(call.algorithm),
            ],
            np.int64,
        )
        if call.collective == "broadcast":
            sig[1] = x.count
        allsig = np.empty((self.size, sig.size), np.int64)
        allsig[self.rank] = sig
        L = self._links(sig.dtype, None)
        L.tag, L.fp = _CHECK_FP << 32, _CHECK_FP  # the same on every rank, whatever its call
        algorithms.get("allgather", "ring")(L, sig, allsig.reshape(-1))
        names = ("sequence number", "collective", "count", "dtype", "op", "root", "algorithm")
        problems: list[str] = []
        odd: set[int] = set()
        for col, name in enumerate(names):
            vals = allsig[:, col]
            if (vals != vals[0]).any():
                decode_v = _decoder(name)
                by = {r: decode_v(int(v)) for r, v in enumerate(vals)}
                groups: dict[object, list[int]] = {}
                for r, v in by.items():
                    groups.setdefault(v, []).append(r)
                detail = "; ".join(f"ranks {rs}: {v}" for v, rs in groups.items())
                problems.append(f"{name} ({detail})")
                odd.update(r for r, v in by.items() if v != by[self.rank])
        if problems:
            raise CollectiveMismatchError(
                f"rank {self.rank}: collective #{seq}: ranks disagree on " + ", ".join(problems),
                rank=self.rank,
                ranks=sorted(odd),
            )


def _cpus() -> set[int]:
    """The CPUs this process may run on."""
    try:
        return set(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return set(range(os.cpu_count() or 1))


def _waiting_policy(crowded: bool) -> Backoff:
    """How a blocking collective waits, given whether this host runs more ranks
    than it has cores.

    With a core per rank, a short spin answers fastest.  With more ranks than
    cores, a spinning waiter holds the very core its peer needs: it yields at
    once, and keeps yielding (never sleeping: a nap lasts 50 us or more) for a
    few milliseconds before it naps.
    """
    if crowded:
        return Backoff(spins=0, yields=20000)
    return Backoff()


def _make_room(cache: dict[Any, Any], limit: int) -> None:
    """Drop the oldest entry of ``cache`` (dicts keep insertion order) if one more
    would pass ``limit``: how plans, steps and kinds stay bounded."""
    if len(cache) >= limit:
        del cache[next(iter(cache))]


def _kind_key(head: tuple[Any, ...], sendbuf: Any, recvbuf: Any) -> tuple[Any, ...] | None:
    """What a call ``head`` on ``sendbuf`` and ``recvbuf`` from this thread is
    checked by: their dtypes, shapes and strides (:class:`_Kind`); None unless
    both are NumPy arrays."""
    if type(sendbuf) is not np.ndarray:
        return None
    x = (head, get_ident(), sendbuf.dtype, sendbuf.shape, sendbuf.strides)
    if recvbuf is None:
        return x
    if type(recvbuf) is not np.ndarray:
        return None
    return (*x, recvbuf.dtype, recvbuf.shape, recvbuf.strides)


def _describe(call: Call) -> str:
    op = "" if call.op is None else f", op={call.op.value}"
    return f"{call.collective}(count={call.count}, dtype={call.dtype}{op}, root={call.root})"


def _known_algorithms() -> tuple[str, ...]:
    """Every algorithm name of every collective, sorted: the same on every rank."""
    return tuple(sorted({n for c in _COLL_IDS for n in algorithms.names(c)} | {"dissemination"}))


#: The flag of an ``auto[a,b,...]`` id (a tuner's contenders, see _algo_id).
_TUNED_ID = 1 << 60


def _algo_id(name: str) -> int:
    """An algorithm's name as a number every rank computes alike (str hash() is
    salted per process).  A tuner's ``auto[a,b,...]`` packs its contenders'
    indices into :func:`_known_algorithms`, 4 bits each in order, so that
    :func:`_decoder` gives the name back; any other name is a CRC."""
    if name.startswith("auto[") and name.endswith("]"):
        known = _known_algorithms()
        parts = name[5:-1].split(",")
        if len(known) < 16 and len(parts) <= 14 and all(a in known for a in parts):
            v = _TUNED_ID
            for i, a in enumerate(parts):
                v |= (known.index(a) + 1) << (4 * i)
            return v
    return zlib.crc32(name.encode()) & 0xFFFF


def _tuned_name(v: int) -> str | None:
    """The ``auto[...]`` name of an id :func:`_algo_id` packed, else None."""
    if v & ~(_TUNED_ID - 1) != _TUNED_ID:
        return None
    known, parts = _known_algorithms(), []
    v &= _TUNED_ID - 1
    while v:
        i = (v & 0xF) - 1
        if not 0 <= i < len(known):
            return None
        parts.append(known[i])
        v >>= 4
    return f"auto[{','.join(parts)}]"


def _decoder(name: str) -> Callable[[int], object]:
    if name == "collective":
        inv = {v: k for k, v in _COLL_IDS.items()}
        return lambda v: inv.get(v, v)
    if name == "dtype":
        inv2 = {v: str(k) for k, v in _DTYPE_IDS.items()}
        return lambda v: inv2.get(v, v)
    if name == "op":
        inv3 = {v: k.value for k, v in _OP_IDS.items()}
        return lambda v: inv3.get(v, "-")
    if name == "algorithm":
        inv4 = {_algo_id(n): n for n in _known_algorithms()}
        return lambda v: inv4.get(v) or _tuned_name(v) or v
    return lambda v: v


def _aliases(x: Buffer, out: Buffer, at: int) -> bool:
    """Whether ``out`` overlaps ``x`` other than by holding it whole at byte ``at``."""
    if out is x or not _overlaps(x, out):
        return False
    return bool(data_ptr(x.flat) != data_ptr(out.flat) + at)


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, np.ndarray) and isinstance(b, np.ndarray):
        return bool(a.__array_interface__["data"][0] == b.__array_interface__["data"][0])
    return False


def _overlaps(a: Buffer, b: Buffer) -> bool:
    if a.device != b.device:
        return False
    fa, fb = a.flat, b.flat
    if isinstance(fa, np.ndarray) and isinstance(fb, np.ndarray):
        # the same test on the byte ranges, in C: 0.56 us, against 4.1 for the
        # two data_ptr lookups below (on the 2-core machine)
        return bool(np.may_share_memory(fa, fb))
    pa, pb = data_ptr(fa), data_ptr(fb)
    return pa < pb + b.nbytes and pb < pa + a.nbytes


def _empty_like(x: Buffer, shape: tuple[int, ...]) -> Any:
    if is_torch(x.obj):
        return x.obj.new_empty(shape)  # same family, dtype and device as the input
    if x.is_device:
        import cupy

        with cupy.cuda.Device(x.device):
            return cupy.empty(shape, x.dtype)
    return np.empty(shape, x.dtype)
