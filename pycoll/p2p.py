"""Point-to-point messages on the connections the collectives use.

A message is two transport messages on the pair's connection: a 32-byte
header (its communicator's context, the user's tag, the element count and the
dtype) and the payload.  Both carry a transport tag made of a fingerprint of
their own (:data:`HDR_FP`, :data:`DATA_FP`) and the number of point-to-point
messages sent on that connection so far, which the receiving side counts too;
a collective's message where a point-to-point one is due, or the reverse,
raises :class:`~pycoll.CollectiveMismatchError` rather than pair the two.

Matching, as MPI's: a receive takes the earliest message of its communicator
with its tag from its source (any source with ``peer=None``); messages from one
source match in the order they were sent.  A message whose receive is posted
lands straight in the receive's buffer; one that arrives first waits in this
rank's memory (*unexpected*) until a receive takes it.  A receive whose buffer
holds another count or dtype than the message raises, and never writes a part.

Ordering with collectives, as NCCL's: the calls of a communicator (and of its
sub-communicators, which share its connections) run in one order on each rank,
and a collective completes every point-to-point call posted before it first.
So a pair of ranks must post point-to-point calls and collectives in an order
that can complete (a rank that starts a collective while its peer still waits
for a message from it raises instead of hanging).  Point-to-point calls among
themselves complete in any order: ``irecv`` then ``isend`` on two ranks, or a
ring shift in :meth:`Communicator.group`, never deadlock.

Everything here runs under the communicator's lock, on the caller's thread
or the worker (:mod:`pycoll.engine`); requests progress when waited on, tested,
or when a later call of the communicator runs.
"""

from __future__ import annotations

import contextlib
import struct
import weakref
import zlib
from collections.abc import Callable, Iterable, Iterator
from time import monotonic
from typing import Any

import numpy as np

from pycoll.buffers import Buffer, as_buffer
from pycoll.errors import CollectiveMismatchError, CollectiveTimeout, InvalidArgumentError
from pycoll.guard import Call
from pycoll.plans import make_room
from pycoll.reduce import DTYPES
from transports.base import (
    Backoff,
    Cap,
    Connection,
    Deadline,
    Request,
    idle_round,
    wait_all,
)

_HDR = struct.Struct("<IIqQI12x")  # magic, context, tag, count, dtype id (32 bytes)
_MAGIC = 0x50325031  # "P2P1"
HDR_FP = zlib.crc32(b"pycoll point-to-point header")
DATA_FP = zlib.crc32(b"pycoll point-to-point payload")
#: A payload that fits travels inside its header's message, padded to the least
#: of these sizes that holds both: one transport message instead of two, which
#: halves a small message's cost.  Each size has its own fingerprint, so the
#: receiver knows the message's size from its tag (``probe``).
EAGER_SIZES = (256, 4096, 32768)
EAGER_FPS = {
    zlib.crc32(f"pycoll point-to-point eager message {b}".encode()): b for b in EAGER_SIZES
}
_EAGER_FP_OF = {b: fp for fp, b in EAGER_FPS.items()}
EAGER_MAX = EAGER_SIZES[-1] - _HDR.size
_M32 = 0xFFFFFFFF
_DTYPE_IDS = {dt: i for i, dt in enumerate(DTYPES.values(), 1)}
_DTYPES = {i: dt for dt, i in _DTYPE_IDS.items()}


def _eager_size(nbytes: int) -> int:
    """The eager message that holds a header and ``nbytes`` of payload."""
    need = _HDR.size + nbytes
    for b in EAGER_SIZES:
        if need <= b:
            return b
    raise ValueError(f"{nbytes} bytes are not an eager message")


def _bytes(a: Any) -> memoryview:
    return memoryview(a.view(np.uint8))


class Message:
    """A message whose header arrived before a receive took it (unexpected)."""

    __slots__ = ("count", "ctx", "data", "dtype", "peer", "req", "tag")

    def __init__(self, peer: int, ctx: int, tag: int, count: int, dtype: int) -> None:
        self.peer, self.ctx, self.tag, self.count, self.dtype = peer, ctx, tag, count, dtype
        self.data: np.ndarray | None = None
        self.req: Request | None = None  # its payload, still arriving

    @property
    def arrived(self) -> bool:
        return self.req is None or self.req._done


class Op:
    """One posted send or receive.

    Attributes:
        ctx: its communicator's context; ``peer``: the family rank it sends to or
            receives from (None: any of ``peers``); ``tag``: the user's tag.
        buf: the data (a send) or the output (a receive).
        source: a receive's sender, once matched (a family rank).
        done, error: how it ended.
    """

    __slots__ = (
        "buf",
        "ctx",
        "done",
        "error",
        "hdr",
        "msg",
        "mv",
        "peer",
        "peers",
        "reqs",
        "send",
        "source",
        "stream",
        "tag",
        "user",
    )

    def __init__(
        self, send: bool, ctx: int, peer: int | None, tag: int, buf: Buffer, peers: tuple[int, ...]
    ) -> None:
        self.send, self.ctx, self.peer, self.tag, self.buf, self.peers = (
            send,
            ctx,
            peer,
            tag,
            buf,
            peers,
        )
        self.reqs: list[Request] = []
        self.hdr: np.ndarray | None = None
        self.msg: Message | None = None  # an unexpected message it took, still arriving
        self.source: int | None = None
        self.done = False
        self.error: BaseException | None = None
        self.user: Buffer = buf  # what the caller passed (``buf`` is its host copy)
        self.stream: Any = None  # a device ``user``'s stream: the copies are ordered on it
        self.mv: memoryview | None = None  # ``buf``'s bytes, once asked for

    def data(self) -> memoryview:
        """The bytes of ``buf`` (a view, made once)."""
        mv = self.mv
        if mv is None:
            mv = self.mv = _bytes(self.buf.flat)
        return mv

    def header(self) -> tuple[int, int, int, int, int]:
        """The fields of this op's message header (:data:`_HDR`)."""
        b = self.buf
        return (_MAGIC, self.ctx, self.tag, b.count, _DTYPE_IDS.get(b.dtype, 0))

    def accepts(self, m: Message) -> bool:
        return (
            m.ctx == self.ctx
            and m.tag == self.tag
            and (self.peer == m.peer if self.peer is not None else m.peer in self.peers)
        )

    def describe(self) -> str:
        who = "any source" if self.peer is None else f"rank {self.peer}"
        kind = "send to" if self.send else "recv from"
        return f"{kind} {who} (tag {self.tag}, {self.buf.count} x {self.buf.dtype})"


class PointToPoint:
    """The point-to-point state of a family of communicators (one set of connections).

    Args:
        rank: this process' rank in the family's root communicator.
        conns: root rank -> connection.
        timeout: seconds without progress before a wait raises.
        name: maps a root rank and context to a rank of that context's
            communicator, for messages.
    """

    def __init__(self, rank: int, conns: dict[int, Connection], timeout: float) -> None:
        self.rank = rank
        self.conns = conns
        self.timeout = timeout
        self.sent: dict[int, int] = {}  # messages sent on each connection
        self.taken: dict[int, int] = {}  # headers taken off each connection
        self.heads: dict[int, tuple[Request, np.ndarray]] = {}  # header receives in flight
        self.arriving: dict[int, Message | Op] = {}  # payloads in flight, one per connection
        self.unexpected: list[Message] = []
        self.recvs: list[Op] = []
        self.sends: list[Op] = []

        #: anything posted and not yet over (a collective completes it first)
        self.live = False
        # the messages of a call alone (send_now, recv_now), reused: it waits for them
        self._eager = {b: np.empty(b, np.uint8) for b in EAGER_SIZES}
        self._eager_in = {b: _bytes(a) for b, a in self._eager.items()}
        self._eager_out = {b: _bytes(np.empty(b, np.uint8)) for b in EAGER_SIZES}

    @property
    def pending(self) -> bool:
        return bool(self.recvs or self.sends or self.heads or self.arriving)

    # ------------------------------------------------------------------ posting
    def post_send(self, op: Op, kept: bool = False) -> None:
        """Post send ``op``; ``kept``: an eager message goes out of the buffer kept
        for it (only for a send waited for before the next is posted)."""
        peer = op.peer
        assert peer is not None
        self.live = True
        b = op.buf
        if peer == self.rank:  # to itself: no connection, a copy
            m = Message(peer, op.ctx, op.tag, b.count, _DTYPE_IDS.get(b.dtype, 0))
            m.data = np.frombuffer(op.data(), np.uint8).copy()
            for r in self.recvs:
                if r.msg is None and r.source is None and r.accepts(m):
                    self._take(r, m)
                    break
            else:
                self.unexpected.append(m)
            op.done = True
            return
        conn = self.conns[peer]
        n = self.sent.get(peer, 0)
        self.sent[peer] = n + 1
        fields = op.header()
        nbytes = b.nbytes
        if nbytes <= EAGER_MAX:  # one message: header, payload, padding
            size = _eager_size(nbytes)
            if kept:
                view = self._eager_out[size]
            else:  # the op holds it while the send is in flight
                op.hdr = msg = np.empty(size, np.uint8)
                view = _bytes(msg)
            _HDR.pack_into(view, 0, *fields)
            if nbytes:
                view[_HDR.size : _HDR.size + nbytes] = op.data()
            op.reqs = [conn.isend(view, (_EAGER_FP_OF[size] << 32) | (n & _M32))]
        else:
            op.hdr = np.frombuffer(_HDR.pack(*fields), np.uint8).copy()
            op.reqs = [
                conn.isend(_bytes(op.hdr), (HDR_FP << 32) | (n & _M32)),
                conn.isend_copied(op.data(), (DATA_FP << 32) | (n & _M32)),
            ]
        self.sends.append(op)

    def post_recv(self, op: Op) -> None:
        self.live = True
        for m in self.unexpected:
            if op.accepts(m):
                self.unexpected.remove(m)
                self._take(op, m)
                if not op.done:
                    self.recvs.append(op)
                return
        self.recvs.append(op)

    def _take(self, op: Op, m: Message) -> None:
        """Receive ``op`` takes unexpected message ``m`` (arrived or arriving)."""
        op.source = m.peer
        if not self._fits(op, m):
            op.done = True
            return
        if m.arrived:
            self._deliver(op, m)
        else:
            op.msg = m

    def _fits(self, op: Op, m: Message) -> bool:
        b = op.buf
        if m.count == b.count and m.dtype == _DTYPE_IDS.get(b.dtype, 0):
            return True
        theirs = _DTYPES.get(m.dtype, "bytes")
        op.error = CollectiveMismatchError(
            f"rank {self.rank}: recv: rank {m.peer} sent {m.count} x {theirs} (tag {m.tag}) "
            f"where this rank receives {b.count} x {b.dtype} into recvbuf; nothing was "
            "written (a size or dtype mismatch)",
            rank=self.rank,
            ranks=(m.peer,),
        )
        return False

    def _deliver(self, op: Op, m: Message) -> None:
        if m.count:
            assert m.data is not None
            op.data()[:] = _bytes(m.data)
        op.done = True

    # ------------------------------------------------------------------ progress
    def progress(self) -> bool:
        """Advance everything without blocking; whether anything moved."""
        moved = False
        for op in self.sends:
            for r in op.reqs:
                if not r._done and r.test():
                    moved = True
            op.done = all(r._done for r in op.reqs)
        if any(op.done for op in self.sends):
            self.sends = [op for op in self.sends if not op.done]
        for peer, m in list(self.arriving.items()):
            req = m.req if isinstance(m, Message) else m.reqs[-1]
            if req is not None and (req._done or req.test()):
                moved = True
                del self.arriving[peer]
                if isinstance(m, Op):
                    m.done = True
        for peer, (req, hdr) in list(self.heads.items()):
            if req._done or req.test():
                moved = True
                del self.heads[peer]
                self._header(peer, hdr)
        for op in self.recvs:
            if op.msg is not None and op.msg.arrived:
                self._deliver(op, op.msg)
                op.msg = None
                moved = True
        if any(op.done for op in self.recvs):
            self.recvs = [op for op in self.recvs if not op.done]
        self._want_headers()
        self.live = self.pending
        return moved

    def _want_headers(self) -> None:
        """Receive the next message's header where a pending receive may need it:
        on its source's connection, or any source's, once one has arrived there
        (:meth:`~transports.base.Connection.probe` tells a header from an eager
        message, and both from a collective's message)."""
        busy = self.heads.keys() | self.arriving.keys()
        for op in self.recvs:
            if op.msg is not None:
                continue
            peers: Iterable[int] = (op.peer,) if op.peer is not None else op.peers
            for p in peers:
                if p in busy or p == self.rank:  # its own messages wait in unexpected
                    continue
                conn = self.conns[p]
                tag = conn.probe()
                if tag is None:
                    continue
                n = self.taken.get(p, 0)
                kind = tag >> 32
                if (kind != HDR_FP and kind not in EAGER_FPS) or tag & _M32 != n & _M32:
                    if op.peer is None:
                        continue  # another source may send it
                    raise self._not_p2p(p, op)
                hdr = np.empty(EAGER_FPS.get(kind, _HDR.size), np.uint8)
                self.heads[p] = (conn.irecv_into(_bytes(hdr), tag), hdr)
                busy = busy | {p}

    def _not_p2p(self, peer: int, op: Op) -> CollectiveMismatchError:
        return CollectiveMismatchError(
            f"rank {self.rank}: {op.describe()}: rank {peer}'s next message is not a "
            "point-to-point message of this order (it started a collective, or other calls, "
            "that this rank has not): point-to-point calls and collectives must be posted "
            "in an order both ranks share",
            rank=self.rank,
            ranks=(peer,),
        )

    def _header(self, peer: int, hdr: np.ndarray) -> None:
        """A header from ``peer`` arrived: route its payload (an eager message's
        is inside it)."""
        magic, ctx, tag, count, dtype = _HDR.unpack(hdr[: _HDR.size].tobytes())
        if magic != _MAGIC:
            raise CollectiveMismatchError(
                f"rank {self.rank}: a point-to-point header from rank {peer} is corrupt",
                rank=self.rank,
                ranks=(peer,),
            )
        n = self.taken.get(peer, 0)
        self.taken[peer] = n + 1
        m = Message(peer, ctx, tag, count, dtype)
        dt = _DTYPES.get(dtype)
        nbytes = count * (dt.itemsize if dt is not None else 1)
        if hdr.size > _HDR.size:  # an eager message: the payload came with it
            m.data = hdr[_HDR.size : _HDR.size + nbytes]
            for op in self.recvs:
                if op.msg is None and op.source is None and op.accepts(m):
                    self._take(op, m)
                    return
            m.data = m.data.copy()  # (``hdr`` may be reused)
            self.unexpected.append(m)
            return
        conn = self.conns[peer]
        data_tag = (DATA_FP << 32) | (n & _M32)
        for op in self.recvs:
            if op.msg is None and op.source is None and op.accepts(m):
                op.source = peer
                if self._fits(op, m):
                    op.reqs = [conn.irecv_into(op.data(), data_tag)]
                    if nbytes:
                        self.arriving[peer] = op
                    else:
                        op.done = True
                    return
                op.done = True  # the error is set; the payload is drained below
                break
        else:
            self.unexpected.append(m)
        m.data = np.empty(nbytes, np.uint8)
        m.req = conn.irecv_into(_bytes(m.data), data_tag)
        if nbytes:
            self.arriving[peer] = m
        else:
            m.req = None

    # ------------------------------------------------------------------ one call alone
    def send_now(self, op: Op, backoff: Backoff) -> None:
        """A blocking send while nothing else is pending: its requests waited for
        alone, without the general bookkeeping (nothing else can need progress);
        an eager message goes out of the buffer kept for it."""
        assert not self.pending
        self.post_send(op, kept=True)
        if not op.done:  # (a send to itself is)
            self.sends.clear()  # only ``op``
            reqs = op.reqs
            if not all(r._done or r.test() for r in reqs):
                wait_all(reqs, Deadline(None, self.timeout), backoff)
            op.done = True
        self.live = False

    def recv_now(self, op: Op, backoff: Backoff) -> None:
        """A blocking receive from one peer while nothing else is pending: the
        common case, done without the general bookkeeping when the peer's next
        message is an eager one (else as :meth:`post_recv` and :meth:`complete`)."""
        peer = op.peer
        assert peer is not None and not self.pending and peer != self.rank
        if not self.unexpected:
            conn = self.conns[peer]
            deadline = Deadline(None, self.timeout)
            backoff.reset()
            tag = conn.probe()
            idle = None
            while tag is None:
                idle = idle or _Idle([peer], self.conns)
                idle_round(backoff, [idle], deadline)
                tag = conn.probe()
            n = self.taken.get(peer, 0)
            size = EAGER_FPS.get(tag >> 32, _HDR.size if tag >> 32 == HDR_FP else 0)
            if size and tag & _M32 == n & _M32:
                eager = size > _HDR.size
                buf = self._eager[size] if eager else np.empty(size, np.uint8)
                req = conn.irecv_into(self._eager_in[size] if eager else _bytes(buf), tag)
                if not req.test():
                    wait_all([req], deadline, backoff)
                if eager and self._take_eager(op, size, n):
                    return
                self.recvs.append(op)
                self._header(peer, buf)  # takes the message, or posts its payload
                if op.done:
                    self.recvs.remove(op)
                    self.live = self.pending
                    return
                self.complete([op], backoff)
                return
        self.post_recv(op)
        self.complete([op], backoff)

    def _take_eager(self, op: Op, size: int, n: int) -> bool:
        """:meth:`recv_now`'s eager message of ``size`` (the ``n``-th from op's peer)
        when it is the one ``op`` receives, of its count and dtype: copied into
        op's buffer and done.  Otherwise nothing changes and it returns False."""
        msg = self._eager_in[size]
        if _HDR.unpack_from(msg) != op.header():
            return False  # (:meth:`_header` routes or refuses it)
        b = op.buf
        peer = op.peer
        assert peer is not None
        self.taken[peer] = n + 1
        if b.nbytes:
            op.data()[:] = msg[_HDR.size : _HDR.size + b.nbytes]
        op.source = peer
        op.done = True
        self.live = False
        return True

    # ------------------------------------------------------------------ waiting
    def complete(
        self, ops: Iterable[Op], backoff: Backoff, stop: Callable[[], bool] | None = None
    ) -> None:
        """Progress until every op of ``ops`` is done (``stop()``: or until it says so).

        Raises:
            TransportTimeout: no progress for ``timeout`` seconds.
        """
        ops = list(ops)
        deadline = Deadline(None, self.timeout)
        backoff.reset()
        while True:
            moved = self.progress()
            if all(op.done for op in ops) or (stop is not None and stop()):
                return
            if moved:
                backoff.reset()
                continue
            waiting = [r for op in ops for r in op.reqs if not r._done]
            waiting += [r for r, _ in self.heads.values()]
            waiting.append(_Idle(self._awaited(ops), self.conns))
            idle_round(backoff, waiting, deadline)

    def drain(self, backoff: Backoff) -> None:
        """Complete every pending operation (before a collective runs)."""
        self.complete([*self.sends, *self.recvs], backoff, lambda: not self.pending)

    def complete_by(self, op: Op, backoff: Backoff, seconds: float) -> None:
        """Progress until ``op`` is done or ``seconds`` have passed."""
        end = monotonic() + seconds
        self.complete([op], backoff, lambda: monotonic() >= end)

    def _awaited(self, ops: list[Op]) -> list[int]:
        """The peers the pending ops wait for (a receive from any source: all)."""
        peers: set[int] = set()
        for op in ops:
            if not op.done:
                peers.update(op.peers if op.peer is None else (op.peer,))
        peers.discard(self.rank)
        return sorted(peers)


class _Idle(Request):
    """What a wait for messages not yet arrived (nothing posted for them) gives
    :func:`idle_round`: never done, the first awaited peer named in a timeout,
    and every awaited peer's connection asked whether it is alive (or has left
    a message to take, :meth:`Connection.check_incoming`)."""

    def __init__(self, peers: list[int], conns: dict[int, Connection]) -> None:
        self.peer = peers[0] if peers else -1
        self._conns = [conns[p] for p in peers if p in conns]

    def _progress(self) -> bool:
        return False

    def check_peer(self) -> None:
        for c in self._conns:
            c.check_incoming()


# ---------------------------------------------------------------------- the calls
#: Blocking sends and receives of host arrays on the same array, peer and tag
#: are replayed without their checks (:class:`_Again`); one holds its array up
#: to this size, and a larger one only by a weak reference (a 1 MiB ping-pong
#: went from 91-98 to 85-89 us a way so) ...
AGAIN_MAX_BYTES = 256 << 10
#: ... at most this many of them.
AGAIN_MAX = 32


#: A quick receive (:meth:`PeerCalls._quick`) waits this many rounds of the CPU's
#: pause for its message before it takes the usual way, which backs off; none
#: where ranks outnumber cores.  A ping-pong's message arrives within a call's
#: time on the other rank (a few microseconds); 2048 rounds are about 55 us on
#: the 2-core VM (27 ns a round), for which take holds the GIL.
QUICK_SPINS = 2048


class _Again:
    """A validated blocking send or receive, run again on the same array, peer
    and tag without its checks, while the array keeps its shape, strides, dtype
    and (a receive's) ``writeable`` flag: every check of the first call would
    pass again.  It holds the array, so its ``id`` is not reused while it lives,
    or, beyond :data:`AGAIN_MAX_BYTES`, a weak reference to it that must still
    name the very array (``weak``: then each run views it afresh, and nothing
    here keeps its memory); the second checked call in a row on that array
    makes it (:meth:`PeerCalls._remember`).

    A ping-pong's call costs a third as much this way (benchmarks/RESULTS.md,
    "Point-to-point and alltoall against MPI and Gloo").

    An eager message to or from another rank over a connection with
    :attr:`~transports.base.Cap.QUICK` can go quicker still (:meth:`PeerCalls._quick`):
    ``conn`` is that connection, ``head`` the message's header (the same each
    time), ``size`` its eager size and ``fp`` its transport tag's upper half;
    otherwise (or with ``quick`` off: ``PYCOLL_COMPILED=0``) ``conn`` is None."""

    __slots__ = (
        "a",
        "buf",
        "call",
        "conn",
        "dtype",
        "fp",
        "head",
        "local",
        "mv",
        "peer",
        "run",
        "shape",
        "size",
        "strides",
        "weak",
    )

    def __init__(
        self,
        a: np.ndarray,
        op: Op,
        call: Call,
        run: Callable[[Op], None],
        p2p: PointToPoint,
        local: int,
        quick: bool,
    ) -> None:
        self.weak = a.nbytes > AGAIN_MAX_BYTES
        self.a: Any = weakref.ref(a) if self.weak else a
        self.shape, self.strides, self.dtype = a.shape, a.strides, a.dtype
        self.peer, self.call, self.run = op.peer, call, run
        self.buf: Buffer | None = None if self.weak else op.buf
        self.mv: memoryview | None = None if self.weak else op.data()
        self.local = local  # the peer as the communicator's rank
        self.conn: Connection | None = None
        b, peer = op.buf, op.peer
        if quick and peer is not None and peer != p2p.rank and b.nbytes <= EAGER_MAX:
            conn = p2p.conns[peer]
            if Cap.QUICK in conn.caps:
                self.conn = conn
                self.size = _eager_size(b.nbytes)
                self.fp = _EAGER_FP_OF[self.size] << 32
                self.head = _HDR.pack(*op.header())

    def fits(self, a: np.ndarray, send: bool) -> bool:
        return (
            (not self.weak or self.a() is a)
            and a.shape == self.shape
            and a.strides == self.strides
            and a.dtype is self.dtype
            and (send or a.flags.writeable)
        )


class PeerCalls:
    """The point-to-point calls of one communicator (:meth:`Communicator.send`
    and the others delegate here); ranks are the communicator's own, the
    connections the family's."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.p2p: PointToPoint = engine.fam.p2p
        self.local = {m: i for i, m in enumerate(engine.members)}
        self.grouped: list[Op] | None = None  # the calls inside ``group()``
        self.last_source: int | None = None
        self._calls: dict[tuple[Any, ...], Call] = {}
        self._again: dict[tuple[Any, ...], _Again] = {}
        self._seen: dict[tuple[Any, ...], weakref.ref[np.ndarray]] = {}  # checked once
        nothing = np.empty(0, np.uint8)
        self._nothing = Buffer(nothing, nothing, -1)

    def _op(self, send: bool, buf: Any, peer: Any, tag: Any, what: str) -> Op:
        eng = self.engine
        r, n = eng.rank, eng.size
        if peer is None and send:
            raise InvalidArgumentError(f"rank {r}: {what}: a send needs a destination peer")
        if peer is not None and (
            not isinstance(peer, (int, np.integer)) or isinstance(peer, bool) or not 0 <= peer < n
        ):
            raise InvalidArgumentError(f"rank {r}: {what}: peer={peer!r} is not in [0, {n})")
        if (
            not isinstance(tag, (int, np.integer))
            or isinstance(tag, bool)
            or not -(1 << 63) <= tag < 1 << 63
        ):
            raise InvalidArgumentError(f"rank {r}: {what}: tag={tag!r} must be a 64-bit integer")
        arg = "sendbuf" if send else "recvbuf"
        b = as_buffer(buf, r, what, arg, writable=not send)
        staged, stream = b, None
        if b.is_device:  # through host memory (the device path for these is to come)
            stream = _current_stream(b, r, what)
            host = b.flat.get(stream=stream) if send else np.empty(b.count, b.dtype)
            staged = Buffer(host, host, -1, b.logical)
        members = eng.members
        op = Op(
            send,
            eng.ctx,
            None if peer is None else members[int(peer)],
            int(tag),
            staged,
            members,
        )
        op.user, op.stream = b, stream
        return op

    def call(self, send: bool, buf: Any, peer: Any, tag: Any, async_op: bool) -> Any:
        """One send or receive: posted with the group (inside ``group()``), else now."""
        # the same array, peer and tag again (plain ints: a bad one, unhashable
        # or not, is refused by the checks below)
        again_key = (
            not async_op
            and self.grouped is None
            and type(buf) is np.ndarray
            and type(tag) is int
            and (peer is None or type(peer) is int)
        )
        if again_key:
            again = self._again.get((send, id(buf), peer, tag))
            if again is not None and again.fits(buf, send) and not self.engine.fam.inflight:
                if again.conn is not None and self._quick(again, send):
                    return None if send else buf
                b = again.buf
                if b is None:  # (weak: a fresh view, as the checks would make)
                    b = Buffer(buf, buf.reshape(-1), -1)
                op = Op(send, self.engine.ctx, again.peer, int(tag), b, self.engine.members)
                op.mv = again.mv
                self.engine.execute(lambda: again.run(op), again.call, 0, numbered=False)
                return self.finish(op)
        what = "send" if send else "recv"
        eng = self.engine
        eng.check_open(what)
        op = self._op(send, buf, peer, tag, what)
        if self.grouped is not None:
            self.grouped.append(op)
            return P2PRequest(op, self)
        if async_op:
            self._post([op], what)
            return P2PRequest(op, self)
        self._post([op], what, complete=True)  # one call of the engine, posted and done
        if again_key and op.error is None:
            self._remember(send, buf, peer, tag, op, what)
        return self.finish(op)

    def _remember(
        self, send: bool, buf: np.ndarray, peer: Any, tag: int, op: Op, what: str
    ) -> None:
        """After a checked blocking call: the second in a row on the very same
        array makes its :class:`_Again` (a fresh view each call, as the torch
        backend passes, never does, so no plan holds a caller's memory for nothing)."""
        key = (send, id(buf), peer, tag)
        seen = self._seen.get(key)
        if seen is not None and seen() is buf:
            del self._seen[key]
            make_room(self._again, AGAIN_MAX)
            local = self._local_peer(op)
            call = self._record(what, op.buf, local)
            quick = self.engine.config.compiled
            self._again[key] = _Again(buf, op, call, self._alone, self.p2p, local, quick)
            return
        make_room(self._seen, AGAIN_MAX)
        self._seen[key] = weakref.ref(buf)

    def _quick(self, a: _Again, send: bool) -> bool:
        """Replayed call ``a`` (an eager message, see :class:`_Again`) in one
        transport step, when nothing else is under way: no failure, nothing
        posted or unexpected, no other thread in a call.  False: nothing
        happened (the message did not fit the ring, or the one arriving is
        not ``a``'s or not there yet): the caller takes the usual way, which
        waits, backs off, matches and raises as a first call does.  Another
        thread's call that came in meanwhile fails this one too, as it does a
        call the usual way (:meth:`Engine._overlapped`)."""
        eng = self.engine
        fam = eng.fam
        p2p = self.p2p
        if eng.closed or fam.closed or fam.failed is not None or p2p.live:
            return False
        if not eng.enter(False):
            return False  # (the usual way raises ConcurrentCallError)
        try:
            peer = a.peer
            assert a.conn is not None and peer is not None
            if send:
                n = p2p.sent.get(peer, 0)
                if not a.conn.put_now(a.head, a.mv, a.size, a.fp | (n & _M32)):
                    return False
                p2p.sent[peer] = n + 1
            else:
                if p2p.unexpected:
                    return False
                n = p2p.taken.get(peer, 0)
                spins = 0 if eng.crowded else QUICK_SPINS
                if a.conn.take_now(a.head, a.mv, a.size, a.fp | (n & _M32), spins) <= 0:
                    return False
                p2p.taken[peer] = n + 1
                self.last_source = a.local
            t = monotonic()
            rec = [eng.seq, a.call, t, t, "ok"]
            eng.recent.append(rec)
        finally:
            eng.leave()
        if fam.failed is not None:  # another thread's call came in meanwhile
            eng._overlapped(rec)
        return True

    def _post(self, ops: list[Op], what: str, complete: bool = False) -> None:
        p2p = self.p2p
        eng = self.engine

        def run() -> None:
            if complete and len(ops) == 1:
                self._alone(ops[0])
                return
            for op in ops:
                if op.send:
                    p2p.post_send(op)
                else:
                    p2p.post_recv(op)
            if complete:
                p2p.complete(ops, eng.backoff)

        first = ops[0]
        eng.submit(
            run, False, self._record(what, first.buf, self._local_peer(first)), 0, numbered=False
        )

    def _alone(self, op: Op) -> None:
        """Post blocking call ``op`` and complete it (under the engine's execute):
        by :meth:`PointToPoint.send_now` or ``recv_now`` when nothing else is
        pending and it names a peer other than this rank."""
        p2p = self.p2p
        if not p2p.pending:
            if op.send:
                p2p.send_now(op, self.engine.backoff)
                return
            if op.peer is not None and op.peer != p2p.rank:
                p2p.recv_now(op, self.engine.backoff)
                return
        if op.send:
            p2p.post_send(op)
        else:
            p2p.post_recv(op)
        p2p.complete([op], self.engine.backoff)

    def _local_peer(self, op: Op) -> int:
        """Op's peer as this communicator's rank (-1: any source)."""
        return -1 if op.peer is None else self.local.get(op.peer, -1)

    def _record(self, what: str, b: Buffer, peer: int) -> Call:
        """The flight recorder's entry of a call (kept: making one costs a fingerprint)."""
        key = (what, b.count, b.dtype, peer)
        c = self._calls.get(key)
        if c is None:
            make_room(self._calls, 64)
            c = self._calls[key] = Call(what, b.count, b.dtype, None, peer, "p2p", self.engine.ctx)
        return c

    def complete(self, ops: list[Op], what: str) -> None:
        """Progress until ``ops`` are done (inline, or behind queued calls)."""
        if all(op.done for op in ops):
            return
        eng = self.engine
        call = self._record(what, ops[0].buf, -1)
        eng.submit(lambda: self.p2p.complete(ops, eng.backoff), False, call, 0, numbered=False)

    @contextlib.contextmanager
    def group(self) -> Iterator[None]:
        """``Communicator.group``: the calls made inside are collected, then
        posted together and completed on exit (none, on an exception)."""
        if self.grouped is not None:
            raise InvalidArgumentError(f"rank {self.engine.rank}: group: already inside a group()")
        ops: list[Op] = []
        self.grouped = ops
        try:
            yield
        finally:
            self.grouped = None
        self.run_group(ops)

    def run_group(self, ops: list[Op]) -> None:
        """Post the calls of a ``group()`` together and complete them."""
        if ops:
            self._post(ops, "group", complete=True)
            for op in ops:
                self.finish(op)

    def poke(self) -> None:
        """One round of progress, unless calls are queued on the worker."""
        eng = self.engine
        if eng.fam.inflight:
            return
        call = self._record("test", self._nothing, -1)
        eng.submit(self.p2p.progress, False, call, 0, numbered=False)

    def finish(self, op: Op) -> Any:
        """A completed op's result: raise its error, copy a staged receive back."""
        if op.error is not None:
            err = op.error
            err._contained = True  # type: ignore[attr-defined]  # the stream is intact
            raise err
        if not op.send:
            if op.source is not None:
                self.last_source = self.local.get(op.source)
            if op.user is not op.buf:
                op.user.flat.set(op.buf.flat, stream=op.stream)
            return op.user.obj
        return None


def _current_stream(b: Buffer, rank: int, what: str) -> Any:
    """The stream that orders the caller's work on device buffer ``b``, as the
    collectives take it with no ``stream=``: torch's current stream for a torch
    tensor, CuPy's otherwise.  The copy of a send out of ``b`` runs there after
    that work (CuPy's own current stream would not wait for a torch stream), and
    a receive's copy into ``b`` comes before the work queued there later."""
    from pycoll.gpu import external_stream
    from pycoll.gpu.context import resolve_stream

    return external_stream(resolve_stream(None, b.obj, b.device, rank, what), b.device)


class P2PRequest:
    """A point-to-point call (``async_op=True``, or inside ``group()``).

    ``wait(timeout)`` progresses it (and every other pending one) until done
    and returns the receive's output (None for a send); ``test()`` says
    whether it is done; ``source`` is a receive's sender, once matched.
    """

    def __init__(self, op: Op, calls: PeerCalls) -> None:
        self._op = op
        self._calls = calls

    @property
    def source(self) -> int | None:
        s = self._op.source
        return None if s is None else self._calls.local.get(s)

    def wait(self, timeout: float | None = None) -> Any:
        """Block until done (``timeout``: at most that many seconds)."""
        calls, op = self._calls, self._op
        if not op.done:
            if calls.grouped is not None and op in calls.grouped:
                raise InvalidArgumentError(
                    f"rank {calls.engine.rank}: wait: this call is inside group(), which "
                    "posts it on exit; wait after the with block"
                )
            what = "send" if op.send else "recv"
            if timeout is None:
                calls.complete([op], what)
            else:
                eng = calls.engine
                call = calls._record(what, op.buf, -1)
                run = lambda: calls.p2p.complete_by(op, eng.backoff, timeout)
                eng.submit(run, False, call, 0, numbered=False)
                if not op.done:
                    raise CollectiveTimeout(
                        f"rank {eng.rank}: {op.describe()} still pending after "
                        f"wait(timeout={timeout}); it goes on",
                        rank=eng.rank,
                    )
        return calls.finish(op)

    def test(self) -> bool:
        """Whether it is done (progressing it a little when no call is queued)."""
        if not self._op.done:
            self._calls.poke()
        return self._op.done

    def exception(self) -> BaseException | None:
        return self._op.error if self._op.done else None

    def __repr__(self) -> str:
        return f"<pycoll.P2PRequest {self._op.describe()} {'done' if self._op.done else 'pending'}>"
