"""The tcp data path: a connection's sockets, frames and requests.

A connection owns ``tcp_nsocks`` sockets (like ``NCCL_NSOCKS_PERTHREAD``).  Each
message is cut into chunks of ``slot_bytes``; chunk ``j`` travels on socket
``j % nsocks`` behind a 40-byte frame header (sequence number, message size,
offset, length, the message's tag, CRC of the header), so a desynchronised or
corrupted stream raises :class:`~transports.base.TransportError` instead of
hanging, and a message tagged otherwise than its receive raises
:class:`~transports.base.TagMismatchError`.  Receivers read each chunk into a
per-socket staging slot and hand it to the sink in offset order; bytes are only
read once the matching receive is posted, and any request's progress drives the
whole connection in both directions, which is what makes the flow-control rule
of :mod:`transports.base` hold.  :meth:`TcpConnection.probe` reads the next
header on socket 0 only, where every message's chunk 0 travels.

A connection closed because another rank failed (:meth:`TcpConnection.close_because`)
ends each socket's stream with a *goodbye*: a frame header of its own magic
(:data:`BYE_MAGIC`) whose tag field holds the rank that failed, and no payload,
after the frame that was going out (finished) and before the FIN.  A reader
meets it where it expects the next header and raises
:class:`~transports.base.PeerClosedError` with ``cause_rank`` set; one that
learns otherwise that the peer is gone (EOF, a reset, a hang-up) reads what is
left of the streams, skipping the frames no receive took, to find it
(:meth:`TcpConnection._last_words`).  Only a broken header looks at that magic,
so the data path pays nothing for it.
"""

from __future__ import annotations

import collections
import errno
import fcntl
import select
import socket
import struct
import termios
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from transports.base import (
    Cap,
    Connection,
    DoneRequest,
    PeerClosedError,
    Request,
    Sink,
    TransportError,
    tag_mismatch,
)
from transports.tcp.interfaces import NAME

if TYPE_CHECKING:
    from transports.tcp.transport import TcpTransport

#: Staging slots per socket: one being filled while the other waits its turn.
SLOTS_PER_SOCKET = 2
#: Progress rounds per call before control returns to the caller, so one busy
#: connection cannot starve the other requests of a ``wait_all``.
MAX_ROUNDS = 8

FRAME_MAGIC = 0x5043  # "PC"
BYE_MAGIC = 0x4742  # "BG": a goodbye, see the module docstring
#: How long closing with a reason may spend on its goodbyes (finishing the frame
#: under way, then the goodbye, then the peer's acknowledgement), and how long a
#: reader waits for one once the peer is gone; both only after a failure.
GOODBYE_WAIT = 0.1
# magic, flags, sequence, message bytes, offset, length, the message's tag, and
# the crc32 of the rest
_FRAME_HEAD = struct.Struct("<HHIQQIQ")
_FRAME = struct.Struct("<HHIQQIQI")
_FRAME_CRC_SPAN = _FRAME_HEAD.size
HDR = _FRAME.size


def frame_header(seq: int, total: int, off: int, length: int, tag: int) -> bytes:
    """The header of a chunk of ``length`` bytes at ``off`` of message ``seq``."""
    head = _FRAME_HEAD.pack(FRAME_MAGIC, 0, seq, total, off, length, tag)
    return head + struct.pack("<I", zlib.crc32(head))


def goodbye_header(cause: int) -> bytes:
    """The goodbye that ends a stream whose sender closes because rank ``cause`` failed."""
    head = _FRAME_HEAD.pack(BYE_MAGIC, 0, 0, 0, 0, 0, cause)
    return head + struct.pack("<I", zlib.crc32(head))


class _SendReq(Request):
    def __init__(self, conn: TcpConnection, frames: int) -> None:
        self.peer = conn.peer
        self._conn = conn
        self._left = frames

    def _progress(self) -> bool:
        if self._left:
            self._conn._progress()
        return self._left == 0

    @property
    def activity(self) -> int:  # type: ignore[override]
        return self._conn.moves

    def check_peer(self) -> None:
        self._conn._check_pending(lambda: self._left == 0)


@dataclass(eq=False)
class _Chunk:
    req: _RecvReq
    sock: int
    offset: int
    length: int
    buf: memoryview | None = None
    filled: int = 0


class _RecvReq(Request):
    def __init__(self, conn: TcpConnection, seq: int, nbytes: int, sink: Sink, tag: int) -> None:
        self.peer = conn.peer
        self._conn = conn
        self.seq = seq
        self.tag = tag
        self.nbytes = nbytes
        self.sink = sink
        self.chunks: list[_Chunk] = []
        self.head = 0  # next chunk to hand to the sink

    @property
    def finished(self) -> bool:
        return self.head == len(self.chunks)

    def _progress(self) -> bool:
        if not self.finished:
            self._conn._progress()
        return self.finished

    @property
    def activity(self) -> int:  # type: ignore[override]
        return self._conn.moves

    def check_peer(self) -> None:
        self._conn._check_pending(lambda: self.finished)


@dataclass(eq=False)
class _Frame:
    req: _SendReq
    hdr: bytes
    payload: memoryview
    sent: int = 0


@dataclass(eq=False)
class _RxSocket:
    """Receive state of one socket: its schedule of chunks and its staging slots."""

    sched: collections.deque[_Chunk] = field(default_factory=collections.deque)
    hdr: bytearray = field(default_factory=lambda: bytearray(HDR))
    hdr_got: int = 0
    checked: bool = False  # the header is whole and matches the scheduled chunk
    free: list[memoryview] = field(default_factory=list)
    nslots: int = 0


class TcpConnection(Connection):
    """``nsocks`` non-blocking sockets to one peer; see the module docstring."""

    transport = NAME
    caps = Cap.PROBE

    def __init__(
        self,
        peer: int,
        socks: list[socket.socket],
        chunk: int,
        owner: TcpTransport | None = None,
    ) -> None:
        self.peer = peer
        self.chunk = chunk
        self._socks = socks
        self._owner = owner
        self._sendq: list[collections.deque[_Frame]] = [collections.deque() for _ in socks]
        self._rx = [_RxSocket() for _ in socks]
        self._recvq: collections.deque[_RecvReq] = collections.deque()
        self._send_seq = 0
        self._recv_seq = 0
        self._error: TransportError | None = None
        self._closed = False
        self.moves = 0  # progress rounds that moved bytes (a request's ``activity``)

    # ----------------------------------------------------------------- posting
    def isend(self, data: memoryview, tag: int = 0) -> Request:
        """Post a send of ``data``; it goes out as chunks spread over the sockets."""
        self._usable()
        mv = memoryview(data)
        if mv.format != "B" or mv.ndim != 1:
            mv = mv.cast("B")
        seq = self._send_seq & 0xFFFFFFFF
        self._send_seq += 1
        n = mv.nbytes
        if n == 0:
            return DoneRequest(self.peer)
        nchunks = -(-n // self.chunk)
        req = _SendReq(self, nchunks)
        nsocks = len(self._socks)
        for j in range(nchunks):
            off = j * self.chunk
            length = min(self.chunk, n - off)
            hdr = frame_header(seq, n, off, length, tag)
            self._sendq[j % nsocks].append(_Frame(req, hdr, mv[off : off + length]))
        return req

    def irecv(self, nbytes: int, sink: Sink, tag: int = 0) -> Request:
        """Post a receive of ``nbytes``; pieces go to ``sink`` in offset order."""
        self._usable()
        if nbytes < 0:
            raise ValueError(f"irecv of {nbytes} bytes")
        seq = self._recv_seq & 0xFFFFFFFF
        self._recv_seq += 1
        if nbytes == 0:
            return DoneRequest(self.peer)
        req = _RecvReq(self, seq, nbytes, sink, tag)
        nsocks = len(self._socks)
        for j in range(-(-nbytes // self.chunk)):
            off = j * self.chunk
            ch = _Chunk(req, j % nsocks, off, min(self.chunk, nbytes - off))
            req.chunks.append(ch)
            self._rx[ch.sock].sched.append(ch)
        self._recvq.append(req)
        return req

    def probe(self) -> int | None:
        """The tag in the next frame header on socket 0, read without blocking.

        Chunk 0 of every message travels on socket 0, so with no receive posted
        the next bytes there are the next message's header.  They are read into
        the header buffer the data path uses, and the receive posted next goes
        on from there (checking the header against itself as always).
        """
        self._usable()
        if self._recvq:
            return None
        rx = self._rx[0]
        try:
            while rx.hdr_got < HDR:
                n = self._socks[0].recv_into(memoryview(rx.hdr)[rx.hdr_got :])
                if n == 0:
                    raise PeerClosedError(
                        f"tcp peer rank {self.peer} has closed the connection",
                        peer=self.peer,
                        transport=NAME,
                    )
                rx.hdr_got += n
            tag = self._intact(rx.hdr)[6]
        except (BlockingIOError, InterruptedError):
            return None
        except TransportError as exc:
            self._fail(exc)
            raise
        except OSError as exc:
            err = self._os_error(exc, "probing")
            self._fail(err)
            raise err from exc
        return tag

    def _usable(self) -> None:
        if self._error is not None:
            raise self._error
        if self._closed:
            raise TransportError(
                f"tcp connection to rank {self.peer} is closed",
                peer=self.peer,
                transport=NAME,
            )

    # ----------------------------------------------------------------- progress
    def _progress(self) -> bool:
        """Move bytes in both directions without blocking; True if anything moved."""
        self._usable()
        any_moved = False
        try:
            for _ in range(MAX_ROUNDS):
                moved = self._pump_send()
                moved = self._pump_recv() or moved
                if not moved:
                    break
                any_moved = True
        except TransportError as exc:
            self._fail(exc)
            raise
        except Exception as exc:
            # A sink raised: the stream is intact but the request is lost; never
            # leave the connection half-working.
            err = TransportError(
                f"tcp connection to rank {self.peer}: receive sink raised {exc!r}",
                peer=self.peer,
                transport=NAME,
            )
            self._fail(err)
            raise err from exc
        if any_moved:
            self.moves += 1
        return any_moved

    def _fail(self, exc: TransportError) -> None:
        if self._error is not None:
            return
        if isinstance(exc, PeerClosedError) and exc.cause_rank is None and not self._closed:
            cause = self._last_words()
            if cause is not None:  # it closed because another rank failed: say so
                exc.cause_rank = cause
                exc.args = (f"{exc.args[0]}; it closed because rank {cause} failed",)
        self._error = exc

    def _os_error(self, exc: OSError, doing: str) -> TransportError:
        gone = {
            errno.EPIPE,
            errno.ECONNRESET,
            errno.ECONNABORTED,
            errno.ETIMEDOUT,
            errno.EHOSTUNREACH,
        }
        cls = PeerClosedError if exc.errno in gone else TransportError
        return cls(
            f"tcp connection to rank {self.peer} failed while {doing}: {exc}",
            peer=self.peer,
            transport=NAME,
            errno=exc.errno,
        )

    def _pump_send(self) -> bool:
        moved = False
        for s, q in enumerate(self._sendq):
            sock = self._socks[s]
            while q:
                fr = q[0]
                total = HDR + len(fr.payload)
                try:
                    if fr.sent < HDR:
                        n = sock.sendmsg(
                            [memoryview(fr.hdr)[fr.sent :], fr.payload],
                            (),
                            socket.MSG_NOSIGNAL,
                        )
                    else:
                        n = sock.send(fr.payload[fr.sent - HDR :], socket.MSG_NOSIGNAL)
                except (BlockingIOError, InterruptedError):
                    break
                except OSError as exc:
                    raise self._os_error(exc, "sending") from exc
                moved = moved or n > 0
                fr.sent += n
                if fr.sent < total:
                    break  # the socket buffer is full
                q.popleft()
                fr.req._left -= 1
        return moved

    def _pump_recv(self) -> bool:
        moved = False
        for s, rx in enumerate(self._rx):
            sock = self._socks[s]
            while rx.sched:
                ch = rx.sched[0]
                try:
                    if not rx.checked:
                        # a probe may have read the header (or part of it) already
                        if rx.hdr_got < HDR:
                            n = sock.recv_into(memoryview(rx.hdr)[rx.hdr_got :])
                            if n == 0:
                                raise self._eof(ch)
                            moved = True
                            rx.hdr_got += n
                            if rx.hdr_got < HDR:
                                break
                        self._check_header(rx.hdr, ch)
                        rx.checked = True
                    if ch.buf is None:
                        if not rx.free:
                            if rx.nslots >= SLOTS_PER_SOCKET:
                                break  # both slots wait for the sink: back-pressure
                            rx.free.append(memoryview(bytearray(self.chunk)))
                            rx.nslots += 1
                        ch.buf = rx.free.pop()
                    n = sock.recv_into(ch.buf[ch.filled : ch.length])
                    if n == 0:
                        raise self._eof(ch)
                except (BlockingIOError, InterruptedError):
                    break
                except OSError as exc:
                    raise self._os_error(exc, "receiving") from exc
                moved = True
                ch.filled += n
                if ch.filled < ch.length:
                    continue
                rx.sched.popleft()
                rx.hdr_got = 0
                rx.checked = False
            moved = self._deliver() or moved
        return moved

    def _deliver(self) -> bool:
        """Hand complete chunks to sinks in posted order; free their slots."""
        moved = False
        while self._recvq:
            req = self._recvq[0]
            ch = req.chunks[req.head]
            if ch.buf is None or ch.filled < ch.length:
                break
            buf, ch.buf = ch.buf, None
            try:
                req.sink(ch.offset, buf[: ch.length])
            finally:
                self._rx[ch.sock].free.append(buf)
            req.head += 1
            moved = True
            if req.finished:
                self._recvq.popleft()
        return moved

    def _intact(self, hdr: bytearray) -> tuple[int, ...]:
        """The fields of a whole frame header whose magic and CRC are right.

        Raises:
            PeerClosedError: the header is the peer's goodbye (``cause_rank`` set).
            TransportError: the header is broken.
        """
        fields = _FRAME.unpack(hdr)
        if fields[0] != FRAME_MAGIC or fields[-1] != zlib.crc32(memoryview(hdr)[:_FRAME_CRC_SPAN]):
            cause = _goodbye(hdr)
            if cause is not None:
                raise self._closed_because(cause)
            raise TransportError(
                f"tcp stream from rank {self.peer} is corrupted (bad frame header)",
                peer=self.peer,
                transport=NAME,
            )
        return fields

    def _closed_because(self, cause: int) -> PeerClosedError:
        return PeerClosedError(
            f"tcp peer rank {self.peer} closed the connection because rank {cause} failed",
            peer=self.peer,
            transport=NAME,
            cause_rank=cause,
        )

    def _check_header(self, hdr: bytearray, ch: _Chunk) -> None:
        _magic, _flags, seq, total, off, length, tag, _crc = self._intact(hdr)
        if tag != ch.req.tag:  # before any byte reaches the sink
            raise tag_mismatch(NAME, self.peer, tag, ch.req.tag)
        want = (ch.req.seq, ch.req.nbytes, ch.offset, ch.length)
        if (seq, total, off, length) != want:
            raise TransportError(
                f"tcp stream from rank {self.peer} is out of step: got message #{seq} of "
                f"{total} bytes (chunk at {off}, {length} bytes), expected message "
                f"#{want[0]} of {want[1]} bytes (chunk at {want[2]}, {want[3]} bytes); "
                "do both ranks post the same sends and receives in the same order?",
                peer=self.peer,
                transport=NAME,
            )

    def _eof(self, ch: _Chunk) -> PeerClosedError:
        return PeerClosedError(
            f"tcp peer rank {self.peer} closed the connection during a transfer "
            f"(message #{ch.req.seq}, {ch.req.nbytes} bytes)",
            peer=self.peer,
            transport=NAME,
        )

    # ----------------------------------------------------------------- liveness
    def _hung_up(self) -> bool:
        return any(_hung_up(s) for s in self._socks)

    def check_peer(self) -> None:
        """Raise :class:`PeerClosedError` if the peer closed or reset the connection."""
        self._usable()
        if self._hung_up():
            err = PeerClosedError(
                f"tcp peer rank {self.peer} has closed the connection",
                peer=self.peer,
                transport=NAME,
            )
            self._fail(err)
            raise err

    def check_incoming(self) -> None:
        self._usable()
        if self._hung_up() and not self._recvq and self.probe() is not None:
            return  # the header of a message sent before the close: it is taken first
        self.check_peer()

    def _check_pending(self, done: Callable[[], bool]) -> None:
        """A request's liveness check: drain what already arrived, then judge."""
        if done():
            return
        self._usable()
        if not self._hung_up():
            return
        # Bytes sent just before the peer closed still count: drain them first.
        while self._progress():
            if done():
                return
        if not done():
            self.check_peer()

    def _last_words(self) -> int | None:
        """The peer is gone: the rank its goodbye names, read from what is left of
        its streams (frames that no receive took are skipped), or None when no
        socket ends with one within :data:`GOODBYE_WAIT`."""
        end = time.monotonic() + GOODBYE_WAIT
        buf = memoryview(bytearray(1 << 16))
        for s, sock in enumerate(self._socks):
            rx = self._rx[s]
            # where the stream stands: inside a chunk's payload, or a header begun
            skip = rx.sched[0].length - rx.sched[0].filled if rx.checked else 0
            head = bytearray(rx.hdr[: rx.hdr_got]) if not rx.checked else bytearray()
            while True:
                if len(head) >= HDR:
                    cause = _goodbye(head[:HDR])
                    if cause is not None:
                        return cause
                    fields = _FRAME.unpack(head[:HDR])
                    if fields[0] != FRAME_MAGIC:
                        break  # not a stream we can follow
                    skip = fields[5]
                    del head[:HDR]
                    cut = min(skip, len(head))
                    del head[:cut]
                    skip -= cut
                    continue
                try:
                    n = sock.recv_into(buf)
                except (BlockingIOError, InterruptedError):
                    if not _ready(sock, select.POLLIN, end):
                        break
                    continue
                except OSError:
                    break
                if n == 0:
                    break
                cut = min(skip, n)
                skip -= cut
                head += buf[cut:n]
        return None

    # ----------------------------------------------------------------- close
    def close_because(self, rank: int) -> None:
        """Close, ending each stream with a goodbye that names ``rank`` (see the
        module docstring): the frame under way is finished first, frames not
        begun are dropped, and each socket waits (within :data:`GOODBYE_WAIT` in
        all) until the peer has its bytes, since closing with unread input
        resets the connection and drops what is still queued.  Best effort."""
        if self._closed:
            return
        if not isinstance(self._error, PeerClosedError):
            end = time.monotonic() + GOODBYE_WAIT
            bye = goodbye_header(rank)
            for s, sock in enumerate(self._socks):
                if _hung_up(sock):
                    continue  # the peer is closing or gone: it reads no more
                q = self._sendq[s]
                fr = q[0] if q and q[0].sent else None
                rest = b"" if fr is None else bytes(fr.hdr + bytes(fr.payload))[fr.sent :]
                try:
                    if _send_all(sock, rest + bye, end):
                        sock.shutdown(socket.SHUT_WR)
                        _drained(sock, end)
                except OSError:
                    pass
        self.close()

    def close(self) -> None:
        """Close the sockets; pending requests then raise.  Idempotent."""
        if self._closed:
            return
        self._closed = True
        for s in self._socks:
            s.close()
        for q in self._sendq:
            q.clear()
        for rx in self._rx:
            rx.sched.clear()
            rx.free.clear()
        self._recvq.clear()
        if self._owner is not None:
            self._owner._forget(self)
            self._owner = None


def _goodbye(hdr: bytes | bytearray) -> int | None:
    """The rank a goodbye header names, or None if ``hdr`` is not an intact goodbye."""
    magic, *_, cause, crc = _FRAME.unpack(hdr)
    if magic != BYE_MAGIC or crc != zlib.crc32(memoryview(hdr)[:_FRAME_CRC_SPAN]):
        return None
    return int(cause)


def _send_all(sock: socket.socket, data: bytes, end: float) -> bool:
    """Send ``data`` on a non-blocking socket before monotonic time ``end``; whether it all went."""
    view = memoryview(data)
    while view:
        try:
            view = view[sock.send(view, socket.MSG_NOSIGNAL) :]
        except (BlockingIOError, InterruptedError):
            if not _ready(sock, select.POLLOUT, end):
                return False
    return True


def _ready(sock: socket.socket, events: int, end: float) -> bool:
    """Wait until ``sock`` has one of ``events`` (or an error), at most until ``end``."""
    left = end - time.monotonic()
    if left <= 0:
        return False
    poller = select.poll()
    poller.register(sock, events)
    return bool(poller.poll(left * 1000))


def _hung_up(sock: socket.socket) -> bool:
    """Whether the peer closed or reset ``sock`` (or shut down its sending side)."""
    poller = select.poll()
    poller.register(sock, select.POLLRDHUP | select.POLLHUP | select.POLLERR)
    return bool(poller.poll(0))


def _drained(sock: socket.socket, end: float) -> None:
    """Wait, until monotonic time ``end`` at most, for the peer to acknowledge
    every byte sent on ``sock`` (Linux: TIOCOUTQ counts those not yet acknowledged),
    or to hang up (then it reads no more)."""
    nap = 1e-4
    while True:
        left = fcntl.ioctl(sock.fileno(), termios.TIOCOUTQ, b"\0\0\0\0")
        if not int.from_bytes(left, "little") or _hung_up(sock) or time.monotonic() >= end:
            return
        time.sleep(nap)
        nap = min(2 * nap, 5e-3)
