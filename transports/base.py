"""The transport interface: one connection between two ranks.

A transport is a small table of verbs plus a capability probe:

* :meth:`Transport.listen` returns this rank's *endpoint blob* (opaque ``bytes``);
  the layer above exchanges the blobs between ranks (pycoll does it through
  mpi4py; this package never imports it).
* :meth:`Transport.can_connect` looks at the local and a peer's blob and answers
  ``(True, why)`` or ``(False, why_not)`` without side effects.
* :meth:`Transport.connect` builds a :class:`Connection` to that peer.

A :class:`Connection` moves byte ranges in both directions, non-blocking first:
:meth:`Connection.isend` and :meth:`Connection.irecv` return a :class:`Request`
whose :meth:`Request.test` makes progress and whose :meth:`Request.wait` blocks
on top of it with a :class:`Backoff`.  Messages on one connection are matched in
the order they were posted (like MPI's non-overtaking rule with one tag).

Received bytes are handed to a *sink* ``sink(offset, view)`` piece by piece, while
they still sit in the transport's own memory (a shared-memory slot, a socket
staging buffer, a registered RDMA slot).  A sink that copies gives ``recv``; a
sink that reduces gives NCCL's "reduce straight out of the slot" with no extra
copy.  Pieces arrive in order, and every piece but the last starts and ends on a
multiple of :data:`PIECE_ALIGN` bytes, so a sink can view them as any dtype.

Each message carries a 64-bit *tag* that the sender passes to :meth:`Connection.isend`
and the receiver to :meth:`Connection.irecv`; a transport puts it in the header it
already sends with each message (a shm slot's metadata, a tcp frame, an RDMA
slot header) and raises :class:`TagMismatchError`, before any byte reaches the
sink, when the two differ.  The tag is opaque here (pycoll puts the call's
sequence number and fingerprint in it), so two ranks that disagree on what they
are doing fail loudly instead of pairing the wrong messages.

Besides connections between two ranks, ranks on one host may share one segment
among all of them: :class:`Group` is its protocol (:mod:`transports.shm_group`
implements it), for algorithms in which every rank reads straight from every
other.

What a connection can do beyond host ``isend``/``irecv`` it declares in
:attr:`Connection.caps`, a set of :class:`Cap` flags: the layer above reads
that set and calls the matching verbs, and never probes a connection for
attributes.

Flow control rule the algorithms rely on: a posted send always completes once the
peer has *posted* the matching receive, whatever the message size, as long as
both sides keep calling ``test``/``wait`` on their requests (:func:`wait_all`).
"""

from __future__ import annotations

import abc
import enum
import os
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import numpy as np

#: Pieces handed to a sink start at multiples of this many bytes.
PIECE_ALIGN = 64

Sink = Callable[[int, memoryview], None]


# --------------------------------------------------------------------------- errors
class TransportError(Exception):
    """A failure inside a transport; carries the peer, the transport and errno.

    The collective layer translates these into its own exception tree at its
    boundary, keeping this one as ``__cause__``.
    """

    def __init__(
        self,
        message: str,
        *,
        peer: int | None = None,
        transport: str | None = None,
        errno: int | None = None,
    ) -> None:
        super().__init__(message)
        self.peer = peer
        self.transport = transport
        self.errno = errno


class ConnectError(TransportError):
    """Setting up a connection failed (bad blob, peer never attached, refused)."""


class PeerClosedError(TransportError):
    """The peer went away: closed socket, dead process behind a segment, QP error.

    Attributes:
        cause_rank: the rank the peer named when it closed: it closed its end
            because that rank failed (:meth:`Connection.close_because`).  None
            when it gave no reason: it closed, exited or died of its own accord,
            or was seen dead.
    """

    def __init__(self, message: str, *, cause_rank: int | None = None, **kw: object) -> None:
        super().__init__(message, **kw)  # type: ignore[arg-type]
        self.cause_rank = cause_rank


class TagMismatchError(TransportError):
    """A message arrived with another tag than the receive posted for it.

    ``got`` is the sender's tag, ``expected`` the receiver's (64-bit integers).
    ``of``: what carried it: ``"message"``, or ``"window"`` (a peer's exposure,
    :meth:`Connection.open_window`); ``"sizes"`` where ``got`` and ``expected``
    are the sizes of windows opened without tags.
    """

    def __init__(
        self, message: str, *, got: int, expected: int, of: str = "message", **kw: object
    ) -> None:
        super().__init__(message, **kw)  # type: ignore[arg-type]
        self.got = got
        self.expected = expected
        self.of = of


class TransportTimeout(TransportError):
    """A wait passed its deadline.  ``pending`` lists the peers still owed."""

    def __init__(self, message: str, *, pending: Sequence[int] = (), **kw: object) -> None:
        super().__init__(message, **kw)  # type: ignore[arg-type]
        self.pending = tuple(pending)


class BlobError(ConnectError):
    """An endpoint blob could not be parsed (truncated, corrupted, wrong version)."""


class UnshareableMemoryError(TransportError):
    """Device memory that cannot be exposed to another process (say, memory from a
    stream-ordered ``cudaMallocAsync`` pool for CUDA IPC)."""


# --------------------------------------------------------------------------- waiting
class Backoff:
    """Spin, then yield the CPU, then sleep with growing naps.

    Measured on 2-core machines: waking a process blocked in the kernel costs tens
    of microseconds, while a spin on shared memory answers in under one.  So a
    waiter spins first; but with more ranks than cores a spinner steals the very
    core its peer needs, so it soon yields and then sleeps.
    """

    __slots__ = ("_n", "max_sleep", "spins", "yields")

    def __init__(self, spins: int = 50, yields: int = 2000, max_sleep: float = 1e-3) -> None:
        self.spins = spins
        self.yields = yields
        self.max_sleep = max_sleep
        self._n = 0

    def reset(self) -> None:
        self._n = 0

    def pause(self, block: Callable[[float], None] | None = None) -> None:
        """Called after a round that made no progress.

        ``block(seconds)``, when given, takes the place of the sleep: a transport's
        wait for its next event, which may return early (see :func:`idle_round`).
        """
        n = self._n
        self._n = n + 1
        if n < self.spins:
            return
        if n < self.spins + self.yields:
            os.sched_yield()
            return
        k = n - self.spins - self.yields
        (block or time.sleep)(min(self.max_sleep, 20e-6 * (1 << min(k, 10))))


@dataclass
class Deadline:
    """When a wait gives up: at a monotonic time, or after a stretch without progress.

    ``at``: the monotonic time (``None``: never).  With ``idle`` seconds set it
    is an inactivity timeout, as NCCL's and torch's watchdogs keep: every check
    of a waiter that progressed since its last one (:meth:`overdue` with
    ``fresh``, or a new ``activity`` count) moves ``at`` to ``idle`` seconds
    ahead, so a slow transfer that keeps moving never times out and a peer that
    stopped does within about ``idle`` seconds.  ``watch``, when set, is called
    at every check and may raise (a failure known elsewhere ends the wait).
    """

    at: float | None
    idle: float | None = None
    watch: Callable[[], None] | None = None
    _seen: int = field(default=0, repr=False)

    @classmethod
    def after(cls, seconds: float | None, idle: bool = False) -> Deadline:
        """``seconds`` from now; ``idle``: and as many again after each progress."""
        at = None if seconds is None else time.monotonic() + seconds
        return cls(at, seconds if idle else None)

    def expired(self) -> bool:
        return self.at is not None and time.monotonic() >= self.at

    def overdue(self, fresh: bool, activity: int = 0) -> bool:
        """A waiter's periodic check: whether to give up now.

        Args:
            fresh: the waiter progressed since its previous check (its first
                check since it last reset its backoff).
            activity: a count that grows while bytes move (see
                :attr:`Request.activity`); a change counts as progress.
        """
        if self.watch is not None:
            self.watch()
        if self.idle is not None and (fresh or activity != self._seen):
            self._seen = activity
            self.at = time.monotonic() + self.idle
            return False
        return self.at is not None and time.monotonic() >= self.at


# --------------------------------------------------------------------------- requests
class Request(abc.ABC):
    """A pending operation.  ``test`` progresses it; ``wait`` blocks on top."""

    peer: int = -1
    _error: BaseException | None = None
    _done: bool = False
    #: grows while the request's bytes move before it completes (a transport that
    #: moves a message piece by piece says so; see :meth:`Deadline.overdue`)
    activity: int = 0

    @abc.abstractmethod
    def _progress(self) -> bool:
        """Advance as far as possible without blocking; True when complete."""

    def test(self) -> bool:
        if self._done:
            return True
        if self._error is not None:
            raise self._error
        try:
            self._done = self._progress()
        except BaseException as exc:
            self._error = exc
            raise
        return self._done

    def exception(self) -> BaseException | None:
        return self._error

    def wait(self, timeout: float | None = None) -> None:
        wait_all((self,), Deadline.after(timeout))


class QueuedRequest(Request):
    """A send or receive that its connection completes from a queue: testing it
    runs ``advance`` (that queue's progress) and then reads ``_done``."""

    def __init__(self, conn: Connection, advance: Callable[[], None]) -> None:
        self.conn = conn
        self.peer = conn.peer
        self._advance = advance

    def _progress(self) -> bool:
        self._advance()
        return self._done

    def check_peer(self) -> None:
        self.conn.check_peer()


class DoneRequest(Request):
    """A request that completed when it was posted (zero bytes, or a self-send)."""

    def __init__(self, peer: int = -1) -> None:
        self.peer = peer
        self._done = True

    def _progress(self) -> bool:
        return True


def wait_all(
    requests: Iterable[Request],
    deadline: Deadline,
    backoff: Backoff | None = None,
    idle: Callable[[], None] | None = None,
) -> None:
    """Progress every request until all complete.

    Args:
        requests: the requests; progressed round-robin.
        deadline: raise :class:`TransportTimeout` once it passes.
        backoff: how to wait when a round makes no progress.
        idle: called on slow rounds (after the spin phase); transports use it to
            check that their peers are still alive.

    Raises:
        TransportTimeout: naming the peers whose requests are still pending.
        TransportError: whatever a request raised.
    """
    pending = [r for r in requests if not r._done]
    if not pending:
        return
    bo = backoff or Backoff()
    bo.reset()
    while True:
        still = [r for r in pending if not r.test()]
        if not still:
            return
        if len(still) < len(pending):
            bo.reset()
        pending = still
        idle_round(bo, pending, deadline, idle)


def idle_round(
    bo: Backoff,
    pending: Sequence[Request],
    deadline: Deadline,
    idle: Callable[[], None] | None = None,
) -> None:
    """Back off after a round that made no progress; now and then check health.

    Every 64th slow round (after the spin phase) asks each pending request's
    peer whether it is still alive and checks the deadline; the first such
    check after progress (a reset of ``bo``) counts as progress for an
    inactivity deadline, and so does a change in the requests' ``activity``.  In the sleep phase
    a pending request's optional ``block(seconds)`` replaces the sleep, so a
    transport that can wait for its next event (the soft RDMA provider's CQ)
    wakes when it arrives rather than when the nap ends.

    Raises:
        TransportTimeout: the deadline passed; names the pending peers.
        PeerClosedError: a peer is known to be gone.
    """
    block = None
    if bo._n >= bo.spins + bo.yields:  # sleeping: a request may offer an event to wait for
        block = next((b for r in pending if (b := getattr(r, "block", None)) is not None), None)
    bo.pause(block)
    n = bo._n
    if n > bo.spins and n % 64 == 0:
        if idle is not None:
            idle()
        for r in pending:
            check = getattr(r, "check_peer", None)
            if check is not None:
                check()
        if deadline.overdue(n <= bo.spins + 64, sum(r.activity for r in pending)):
            peers = sorted({r.peer for r in pending})
            raise TransportTimeout(f"timed out waiting for peer(s) {peers}", pending=peers)


# --------------------------------------------------------------------------- interface
def tag_mismatch(transport: str, peer: int, got: int, expected: int) -> TagMismatchError:
    """The error for a message from ``peer`` tagged ``got`` where ``expected`` was posted."""
    return TagMismatchError(
        f"{transport}: a message from peer {peer} carries tag {got:#018x} where the posted "
        f"receive has {expected:#018x} (the two ranks disagree on the call)",
        got=got,
        expected=expected,
        peer=peer,
        transport=transport,
    )


@dataclass(frozen=True)
class DeviceSpan:
    """A range of CUDA device memory, for connections that move GPU bytes directly.

    Attributes:
        ptr: device pointer (an integer, as in ``__cuda_array_interface__``).
        nbytes: length in bytes.
        device: CUDA device ordinal.
        stream: the CUDA stream (handle as an int, 0 = default) the bytes are
            ordered on: a sender's bytes are ready once this stream's queued work
            is; a receiver's sink enqueues its work on it.
        handle, offset: the IPC handle of the allocation holding ``ptr`` and
            ``ptr``'s offset in it (``cuda_driver.export``), where the caller
            worked them out already and keeps the memory alive (else empty: a
            connection that exposes the span works them out each time).
        written: the peer writes into it (an output).  A connection that lets a
            stream go without the peer's write fills it with 0xFF bytes (NaN for
            floating types) first, so that a wrong result does not pass for one.
    """

    ptr: int
    nbytes: int
    device: int
    stream: int = 0
    handle: bytes = b""
    offset: int = 0
    written: bool = False

    def __getitem__(self, s: slice) -> DeviceSpan:
        start, stop, _ = s.indices(self.nbytes)
        return DeviceSpan(self.ptr + start, max(0, stop - start), self.device, self.stream)


DeviceSink = Callable[[int, DeviceSpan], None]


@dataclass(frozen=True)
class TransportOptions:
    """What a transport is told when it is created (the layer above fills it in).

    Attributes:
        rank: this rank in the job.
        size: number of ranks.
        timeout: seconds any setup wait may take before raising.
        secret: the job's shared secret (from the bootstrap); network transports
            drop peers that do not present it.
        socket_ifname: interface selection for network transports, NCCL-style
            (``eth``, ``=eth0``, ``^docker``), or None for the default.
        slot_bytes: bytes of one flow-control slot (shm) or staging buffer.
        nslots: slots per direction of a connection.
        extra: transport-specific settings (strings), e.g. ``{"rdma_memory": "auto"}``.
    """

    rank: int
    size: int
    timeout: float = 300.0
    secret: bytes = b""
    socket_ifname: str | None = None
    slot_bytes: int = 1 << 20
    nslots: int = 4
    extra: tuple[tuple[str, str], ...] = ()

    def get(self, key: str, default: str | None = None) -> str | None:
        for k, v in self.extra:
            if k == key:
                return v
        return default


class Cap(enum.Flag):
    """What a connection can do beyond host :meth:`~Connection.isend`/:meth:`~Connection.irecv`.

    A transport declares them in :attr:`Connection.caps`; the verbs that belong
    to a capability raise :class:`TransportError` on a connection without it
    (:meth:`Connection.send_buffer` returns None instead).
    """

    #: :meth:`Connection.send_buffer` can give memory the peer maps too.
    SHARED_SEND_BUFFERS = enum.auto()
    #: :meth:`Connection.isend_device`/:meth:`Connection.irecv_device` move GPU
    #: memory without host staging (CUDA IPC, GPUDirect RDMA, DMA-BUF).
    DEVICE = enum.auto()
    #: one-sided windows on device memory (:meth:`Connection.expose`,
    #: :meth:`Connection.open_window`, :meth:`Connection.release`,
    #: :meth:`Connection.wait_released`).
    ONE_SIDED = enum.auto()
    #: device receive sinks run on a stream the layer above names
    #: (:meth:`Connection.set_sink_stream`).
    SINK_STREAM = enum.auto()
    #: both ends use the same GPU (several ranks sharing one device).
    SAME_DEVICE = enum.auto()
    #: :meth:`Connection.probe` tells the tag of the next message without taking it.
    PROBE = enum.auto()
    #: :meth:`Connection.put_now`/:meth:`Connection.take_now` can move a small
    #: message in one step (on a connection without it they never do).
    QUICK = enum.auto()


class Connection(abc.ABC):
    """One bidirectional connection to one peer."""

    #: e.g. "shm", "tcp", "rdma:host"
    transport: str = "?"
    peer: int = -1
    #: what this connection can do beyond host sends and receives: each transport
    #: declares its set on its class, and an instance may refine it when it
    #: connects (say, :attr:`Cap.SAME_DEVICE`, known only after the handshake)
    caps: Cap = Cap(0)
    #: rounds a transport's compiled loop may wait on the peer (a bounded spin)
    #: before it returns to the caller's backoff; the owner sets it, to 0 where
    #: ranks outnumber cores (a spin there holds the core the peer needs)
    spins: int = 0
    #: whether the transport may run its compiled pieces (the owner turns them
    #: off to run the same steps in Python)
    compiled: bool = True

    @abc.abstractmethod
    def isend(self, data: memoryview, tag: int = 0) -> Request:
        """Post a send of ``data`` (bytes, C-contiguous).  Do not touch it until done.

        ``tag`` (64 bits) travels with the message; the matching receive must
        name the same one (see the module docstring).
        """

    def isend_copied(self, data: memoryview, tag: int = 0) -> Request:
        """:meth:`isend`, but the bytes travel through the transport's own buffers
        in pieces, the sender copying one while the receiver copies the one before,
        where the transport could instead let the receiver read them in place
        (shm's cross-memory reads).  The message is the same to the receiver.

        A caller that gains from both ends copying at once (a point-to-point
        message, whose sender waits anyway) uses it.  It is a preference: where
        reading in place wins anyway (shm: from 4 MiB, on the huge pages NumPy
        gives such arrays) the transport still does so.  This default is
        :meth:`isend`.
        """
        return self.isend(data, tag)

    def put_now(self, head: Any, body: Any, nbytes: int, tag: int) -> bool:
        """Send a small message of ``nbytes`` (the bytes of ``head``, those of
        ``body``, then padding) at once, if this connection can without queueing
        it: nothing is queued before it and there is room.  True: it is sent,
        and both buffers are free again; False: nothing was sent (use
        :meth:`isend`).  The receiver sees the message :meth:`isend` would have
        sent.  A step for a caller's fast path, where it is cheaper than a
        request (:attr:`Cap.QUICK`: shm's compiled ring step); this default never
        sends.
        """
        return False

    def take_now(self, head: Any, out: Any, nbytes: int, tag: int, spins: int) -> int:
        """Receive the next message at once, if it is the one expected: ``nbytes``
        in all, tagged ``tag``, its first bytes those of ``head``, no receive
        posted before it.  Waits at most ``spins`` rounds for it to arrive.
        1: it was taken, the bytes after ``head`` copied into ``out`` (its
        length); 0: nothing arrived; -1: the next message is another one.  On 0
        and -1 nothing changed: receive as usual (:meth:`probe`, :meth:`irecv`).
        This default never takes one (0).
        """
        return 0

    @abc.abstractmethod
    def irecv(self, nbytes: int, sink: Sink, tag: int = 0) -> Request:
        """Post a receive of ``nbytes``; each arriving piece goes to ``sink(offset, view)``.

        The view is only valid during the call.  A message whose tag is not
        ``tag`` raises :class:`TagMismatchError` and reaches no sink.
        """

    def irecv_into(self, out: memoryview, tag: int = 0) -> Request:
        """Post a receive straight into ``out`` (a byte view)."""

        def copy(off: int, piece: memoryview) -> None:
            out[off : off + len(piece)] = piece

        return self.irecv(len(out), copy, tag)

    def probe(self) -> int | None:
        """The tag of the next message this connection would deliver, without taking it.

        The tag is known once at least the message's first piece (or its
        descriptor, or its frame header) has arrived while no receive is posted
        on this connection; until then, and whenever a receive is pending (the
        message is that receive's), the answer is None.  Probing consumes
        nothing: a receive posted afterwards gets that message whole, and every
        probe gives the same answer until it has been received.  A message of
        zero bytes moves nothing on any transport and is never seen here.  A
        probe may progress the connection as testing a request does.

        Only with :attr:`Cap.PROBE`.

        Raises:
            TransportError: the connection has no :attr:`Cap.PROBE`, or it is
                broken (a corrupted stream; :class:`PeerClosedError` once the
                peer is known to have closed and nothing it sent is left).  A
                peer that died silently is the business of :meth:`check_peer`.
        """
        raise TransportError(
            f"{self.transport} cannot probe for messages",
            peer=self.peer,
            transport=self.transport,
        )

    def send_buffer(self, nbytes: int) -> np.ndarray | None:
        """This connection's shared send buffer: ``nbytes`` or more of host memory
        that the peer maps too, or None where there is none (a connection without
        :attr:`Cap.SHARED_SEND_BUFFERS`, or no room for it).

        A send of bytes that lie inside it travels as a descriptor: the receiver's
        sink gets a view of the same pages, with no copy on either side, and the
        send completes once that sink has returned.  So a sender that fills it by
        DMA (a GPU copy into memory registered with the GPU) and a receiver whose
        sink drains it by DMA move the bytes with no CPU touching them.  The first
        call fixes the size; a later call for more returns None.  The buffer lives
        until :meth:`close`, and its views must be dropped before then.
        """
        return None

    def recv_buffer(self) -> np.ndarray | None:
        """The peer's :meth:`send_buffer` as mapped here, once a send from it has
        arrived (else None): a receiver registers it with a device once."""
        return None

    def isend_device(self, data: DeviceSpan, tag: int = 0) -> Request:
        """Post a send of device memory (only with :attr:`Cap.DEVICE`), tagged as
        :meth:`isend`'s."""
        raise TransportError(
            f"{self.transport} cannot send device memory directly",
            peer=self.peer,
            transport=self.transport,
        )

    def irecv_device(self, nbytes: int, sink: DeviceSink, device: int, tag: int = 0) -> Request:
        """Post a receive whose pieces reach ``sink`` as device memory on ``device``
        (only with :attr:`Cap.DEVICE`); same ordering and alignment as :meth:`irecv`,
        and the same check of ``tag``."""
        raise TransportError(
            f"{self.transport} cannot receive into device memory directly",
            peer=self.peer,
            transport=self.transport,
        )

    def set_sink_stream(self, stream: int) -> None:
        """Run the sinks of later device receives on ``stream`` (a CUDA stream
        handle of this connection's device), so that their work is ordered with
        the rest of the caller's; only with :attr:`Cap.SINK_STREAM`.  Until it is
        called, the transport picks a stream of its own."""
        raise TransportError(
            f"{self.transport} takes no sink stream",
            peer=self.peer,
            transport=self.transport,
        )

    # One-sided windows on device memory (only with Cap.ONE_SIDED): the peer reads
    # and writes our buffers itself, ordered by device events, and the host never
    # waits for the device.

    def expose(
        self, spans: Sequence[DeviceSpan], stream: int, deadline: Deadline, tag: int = 0
    ) -> None:
        """Let the peer read and write ``spans`` once the work queued on ``stream`` is
        done.  Exposures are matched in order with the peer's :meth:`open_window`;
        a span stays exposed until the peer's matching :meth:`release`.  The very
        list handed again, its spans carrying their handles (``DeviceSpan.handle``),
        promises the same memory: the connection may skip describing it anew.
        ``tag`` (64 bits) names the exposing call, as a message's tag does."""
        raise self._not_one_sided()

    def open_window(self, stream: int, deadline: Deadline, tag: int = 0) -> list[DeviceSpan]:
        """The peer's next exposure, as spans usable in this process; work queued on
        ``stream`` after this call runs only after the peer's exposed data is ready.
        The same exposure as the last one may come back as the same list (not to
        be changed by the caller).

        Raises:
            TagMismatchError: the exposure carries another tag than ``tag`` (the
                peer's call is another one); nothing is mapped or enqueued.
        """
        raise self._not_one_sided()

    def release(self, stream: int) -> None:
        """Tell the peer that the work queued on ``stream`` so far is our last use of
        the window :meth:`open_window` returned last (oldest unreleased first)."""
        raise self._not_one_sided()

    def wait_released(self, stream: int, deadline: Deadline) -> None:
        """Make ``stream`` wait until the peer is done with our oldest exposure that
        this call has not yet waited for (its reads and writes of our memory)."""
        raise self._not_one_sided()

    def _not_one_sided(self) -> TransportError:
        return TransportError(
            f"{self.transport} has no one-sided device windows",
            peer=self.peer,
            transport=self.transport,
        )

    def check_peer(self) -> None:  # noqa: B027 - optional hook
        """Raise :class:`PeerClosedError` if the peer is known to be gone."""

    def stream_failure(self) -> TransportError | None:
        """A failure seen after the call it concerns returned: the peer never wrote
        what a stream of ours waited for, and the transport let the stream go
        rather than wait forever (that call's output is wrong).  The connection
        raises it at its next use; None when there was none."""
        return None

    def check_incoming(self) -> None:
        """:meth:`check_peer` for a wait for the peer's next message with no
        receive posted: a peer that sent a message and then closed is not gone
        while that message waits to be taken (a liveness check between a
        :meth:`probe` that saw nothing and the message's arrival must not lose
        it); it raises once nothing the peer sent is left."""
        self.check_peer()

    @abc.abstractmethod
    def close(self) -> None:
        """Release everything; idempotent."""

    def close_because(self, rank: int) -> None:
        """:meth:`close`, telling the peer why: this end closes because rank
        ``rank`` failed (it saw that rank's connection break, or heard it from
        another peer's goodbye).  The peer's next :class:`PeerClosedError` on this
        connection carries ``cause_rank = rank``, so that it names the rank that
        failed first rather than this one.

        The reason travels only here, on the way out: sends and receives carry
        nothing more for it.  Best effort: a peer that cannot read it (the goodbye
        lost, or the peer itself gone) sees a plain close.  A transport that has no
        way to say it closes plainly (this default).
        """
        self.close()

    def announce_close(self, cause: int | None = None) -> None:
        """Tell the peer that this end is about to close (because rank ``cause``
        failed, as :meth:`close_because` says it), before :meth:`close` releases
        anything: its waits on us raise :class:`PeerClosedError` from now on.  For
        a connection whose :meth:`close` must wait for device work first.  A
        transport that cannot say it early says it at :meth:`close` (this default)."""
        return

    def __enter__(self) -> Connection:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Transport(abc.ABC):
    """A factory of connections of one kind, created once per rank."""

    name: str = "?"

    def __init__(self, options: TransportOptions) -> None:
        self.options = options

    @abc.abstractmethod
    def listen(self) -> bytes:
        """Prepare to accept peers; return this rank's endpoint blob."""

    @abc.abstractmethod
    def can_connect(self, local: bytes, peer: bytes) -> tuple[bool, str]:
        """Whether this rank (blob ``local``) can reach the peer (blob ``peer``), and why."""

    @abc.abstractmethod
    def connect(self, peer_rank: int, peer: bytes) -> Connection:
        """Connect to ``peer_rank`` whose endpoint blob is ``peer``.

        Both ranks of a pair call ``connect`` for each other; implementations
        decide who creates and who attaches by comparing ranks.
        """

    def seal(self) -> None:  # noqa: B027 - optional hook
        """Every peer is connected: release what only set-up needed (listeners,
        half-done handshakes); later ``connect`` calls may fail.  Idempotent."""

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release listening resources; idempotent."""

    def __enter__(self) -> Transport:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# --------------------------------------------------------------------------- node group
class Group(Protocol):
    """Memory that every rank of a group shares (ranks on one host): the node-wide
    segment that :class:`transports.shm_group.ShmGroup` implements.

    Every rank counts the same steps (``seq``); for each it writes its slot or
    posts ranges of its own memory, publishes the step, and says when it is done
    reading the others'.  Each rank has ``slots`` (K) slots and ``words`` (W, a
    multiple of K) posted words and ranges: step ``s`` uses slot ``s % K`` and
    word and range ``s % W``.  A step of at most ``sub_bytes`` a rank (small)
    fills part ``(s // K) % (W / K)`` of its slot, one of more fills it from its
    start; what a step uses is rewritten once every peer is done with it (see
    :meth:`claim`).
    """

    rank: int
    size: int
    slot_bytes: int
    slots: int  # slots per rank (K); step s uses slot s % K
    words: int  # posted words (and ranges) per rank (W); step s uses word s % W
    sub_bytes: int  # the part of a slot a small step fills
    last_big: int  # the last step that may have filled this rank's whole slot
    cma: bool  # whether posted ranges may be read and written (else all goes by slots)
    seq: int  # the last step this rank used
    ahead: int  # steps a rank may post before it has consumed them (at most slots)
    # The chain of the calls' fingerprints as of the latest step, and as of the
    # step of each slot index, kept above ``step_bits``; a step does ``chain =
    # (chain * chain_mul + (fp << step_bits)) & chain_mask``, ``chains[s % words]
    # = chain`` (what :meth:`step` does; steps written out for post_word and
    # wait_word need not keep ``chains``), and its posted word is ``chain | s``.
    chain: int
    chains: list[int]
    chain_mul: int
    chain_mask: int
    step_bits: int

    def step(self, fingerprint: int) -> int:
        """Take the next step (``seq + 1``) of a call with this fingerprint; return it."""
        ...

    def skip(self, fingerprint: int) -> None:
        """Fold a call that took no step (one this rank rejected) into the chain."""
        ...

    def small(self, nbytes: int) -> bool:
        """Whether a step of ``nbytes`` a rank fills only its part of a slot."""
        ...

    def views(self, dtype: Any, count: int, small: bool | None = None) -> list[list[Any]]:
        """``views[seq % words][j]``: rank j's slot for step ``seq`` (its part, where
        the step is ``small``; None: where ``count`` elements are) as ``count``
        elements of ``dtype``."""
        ...

    def claim(self, seq: int, deadline: Deadline, backoff: Backoff, small: bool = False) -> None:
        """Wait until this rank may rewrite its slot and posted word for step ``seq``
        (every step that posts claims first, even one that fills no slot):
        every peer is done with step ``seq - slots``, or, where ``small`` (the
        step fills at most its part of the slot, or none), with step ``seq -
        words`` and with the last step that filled the whole slot, if later
        than ``seq - slots``."""
        ...

    def post(self, seq: int, addr: int = 0, nbytes: int = 0, consumed: bool = True) -> None:
        """Publish step ``seq`` (and a range of this process's memory peers may read);
        ``consumed``: this rank is done with step ``seq - 1`` (see ``ahead``)."""
        ...

    def done(self, seq: int) -> None:
        """This rank has finished reading everything of step ``seq``."""
        ...

    def post_word(self, i: int, word: int, seq: int) -> None:
        """``post(seq)`` with its posted word made by the caller (``i = seq % words``)."""
        ...

    def wait_word(
        self, peers: Iterable[int], i: int, word: int, deadline: Deadline, backoff: Backoff
    ) -> None:
        """``wait`` for the step of the caller-made posted word ``word``."""
        ...

    def wait(self, peers: Iterable[int], seq: int, deadline: Deadline, backoff: Backoff) -> None:
        """Until every rank of ``peers`` posted step ``seq``; a peer whose step ``seq``
        has another chain raises :class:`transports.base.TagMismatchError`."""
        ...

    def addresses(self, j: int, i: int, small: bool = False) -> tuple[int, int, int]:
        """Where rank j's slot for word index ``i`` (small: its part), its posted
        word of that index and its "done" word lie in this process (for a
        compiled step that writes and reads them as :meth:`post_word`,
        :meth:`wait_word` and :meth:`done` do)."""
        ...

    def control(self) -> Any:
        """Where the control words lie (``memory``, ``ctrl0``, ``line``, ``done``,
        ``closed``, ``ranges``) and the ranks' ``pids``, for a compiled step that
        loads and stores the words itself as these methods do."""
        ...

    def pid(self, j: int) -> int:
        """Rank ``j``'s pid in this pid namespace (0: unknown)."""
        ...

    def range_error(self, what: str, j: int, offset: int, n: int, nbytes: int) -> TransportError:
        """The error of a ``what`` (read, write) outside rank ``j``'s posted range."""
        ...

    def copy_error(self, what: str, j: int, n: int, err: int) -> TransportError:
        """The error of a direct ``what`` of ``n`` bytes with rank ``j`` that failed with ``err``."""
        ...

    def wait_done(
        self, peers: Iterable[int], seq: int, deadline: Deadline, backoff: Backoff
    ) -> None:
        """Until every rank of ``peers`` is done with step ``seq``."""
        ...

    def read(self, j: int, seq: int, offset: int, out: Any) -> None:
        """Copy bytes of the range rank j posted for step ``seq``, from ``offset``, into ``out``."""
        ...

    def read_at(self, j: int, seq: int, offset: int, local: int, n: int) -> None:
        """:meth:`read` into the ``n`` bytes at address ``local`` of this process."""
        ...

    def write(self, j: int, seq: int, offset: int, src: Any) -> None:
        """Copy ``src`` into the range rank j posted for step ``seq``, from ``offset``."""
        ...
