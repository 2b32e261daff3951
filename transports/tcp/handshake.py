"""The tcp connection handshake: challenge, hello, acknowledgement.

Of a pair, the higher rank dials the lower rank's listener; the lower rank
accepts.  The acceptor sends a random challenge, the dialler answers with a
hello (its rank, the socket's index, and an HMAC-SHA256 over the challenge
keyed by the job's secret), and the acceptor acknowledges with an HMAC of its
own so both ends know they share the secret.  A stranger on the port (bad magic,
bad MAC, silence) is logged and dropped; it never fails the job.  Sockets from
ranks other than the one being waited for are stashed by their hello until
``connect`` is called for that rank (:class:`Acceptor`).
"""

from __future__ import annotations

import errno
import hashlib
import hmac
import logging
import secrets
import selectors
import socket
import struct
import time
from dataclasses import dataclass, field

from transports.base import PIECE_ALIGN, ConnectError, Deadline
from transports.tcp.interfaces import NAME

logger = logging.getLogger(__name__)

#: A peer that connects but sends no valid hello within this time is dropped.
HANDSHAKE_SECONDS = 30.0
#: Half-done handshakes held at once; past this the oldest is dropped (idle
#: strangers must not take every descriptor).
MAX_PENDING = 64
#: Errors of accept() that say "no descriptor or memory now": back off, from 10 ms
#: doubling to this, instead of retrying at once (a busy loop).
_NO_ROOM = (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM)
_MAX_ACCEPT_PAUSE = 1.0

HS_VERSION = 2  # 2: streams may end with a goodbye (connection.py)
# challenge: magic, version, acceptor rank, nonce
_CHALLENGE = struct.Struct("<4sB3xI16s")
# hello: magic, version, src, dst, socket index, nsocks, chunk bytes, nonce, mac
_HELLO_BODY = struct.Struct("<4sB3xIIHHI16s")
_HELLO_LEN = _HELLO_BODY.size + 32
# ack: magic, mac
_ACK = struct.Struct("<4s32s")


class _Quiet:
    """Log a recurring message at most once a second, saying how many were held back."""

    def __init__(self) -> None:
        self._next: dict[str, float] = {}
        self._held: dict[str, int] = {}

    def __call__(self, level: int, key: str, msg: str, *args: object) -> None:
        now = time.monotonic()
        if now < self._next.get(key, 0.0):
            self._held[key] = self._held.get(key, 0) + 1
            return
        self._next[key] = now + 1.0
        held = self._held.pop(key, 0)
        if held:
            msg += f" ({held} more like it in the last second)"
        logger.log(level, msg, *args)


def recv_exact(sock: socket.socket, n: int, deadline: Deadline, what: str) -> bytes:
    """Read exactly ``n`` bytes from a blocking socket before ``deadline``."""
    buf = bytearray()
    while len(buf) < n:
        left = None if deadline.at is None else deadline.at - time.monotonic()
        if left is not None and left <= 0:
            raise TimeoutError(f"timed out reading the {what}")
        sock.settimeout(left)
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise ConnectionResetError(errno.ECONNRESET, f"connection closed during the {what}")
        buf += chunk
    return bytes(buf)


def tune(sock: socket.socket, bufsize: int) -> None:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    if bufsize:
        for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
            try:
                sock.setsockopt(socket.SOL_SOCKET, opt, bufsize)
            except OSError:  # capped by net.core.[rw]mem_max; not fatal
                pass


def _hello_mac(secret: bytes, challenge: bytes, body: bytes) -> bytes:
    return hmac.new(secret, b"pycoll-tcp-hello\0" + challenge + body, hashlib.sha256).digest()


def _ack_mac(secret: bytes, hello_mac: bytes) -> bytes:
    return hmac.new(secret, b"pycoll-tcp-ack\0" + hello_mac, hashlib.sha256).digest()


@dataclass
class _Pending:
    """An accepted socket whose hello has not arrived yet."""

    sock: socket.socket
    peername: str
    challenge: bytes
    expires: float
    got: bytearray = field(default_factory=bytearray)


@dataclass
class Stashed:
    """Sockets of one peer that passed the handshake."""

    nsocks: int
    chunk: int
    socks: dict[int, socket.socket] = field(default_factory=dict)


def client_handshake(
    sock: socket.socket,
    *,
    me: int,
    peer_rank: int,
    index: int,
    nsocks: int,
    chunk: int,
    secret: bytes,
    deadline: Deadline,
) -> None:
    """The dialler's side: answer the acceptor's challenge with a hello for socket
    ``index`` of ``nsocks``, then check the acknowledgement.

    Raises:
        ConnectError: the listener is not ``peer_rank`` of this job, the socket
            failed or timed out, or the acknowledgement is bad (secret mismatch).
    """
    try:
        challenge = recv_exact(sock, _CHALLENGE.size, deadline, "challenge")
        magic, version, arank, _ = _CHALLENGE.unpack(challenge)
        if magic != b"PCTH" or version != HS_VERSION or arank != peer_rank:
            raise ConnectError(
                f"tcp: the listener at rank {peer_rank}'s address is not rank {peer_rank} "
                f"of this job (magic {magic!r}, version {version}, rank {arank})",
                peer=peer_rank,
                transport=NAME,
            )
        body = _HELLO_BODY.pack(
            b"PCTh",
            HS_VERSION,
            me,
            peer_rank,
            index,
            nsocks,
            chunk,
            secrets.token_bytes(16),
        )
        mac = _hello_mac(secret, challenge, body)
        sock.settimeout(10.0)
        sock.sendall(body + mac)
        ack = recv_exact(sock, _ACK.size, deadline, "acknowledgement")
    except (OSError, TimeoutError) as exc:
        raise ConnectError(
            f"tcp: handshake with rank {peer_rank} failed: {exc}"
            + (
                " (the peer dropped us: do both ranks share the job secret?)"
                if isinstance(exc, ConnectionResetError)
                else ""
            ),
            peer=peer_rank,
            transport=NAME,
            errno=getattr(exc, "errno", None),
        ) from exc
    amagic, amac = _ACK.unpack(ack)
    if amagic != b"PCTa" or not hmac.compare_digest(amac, _ack_mac(secret, mac)):
        raise ConnectError(
            f"tcp: rank {peer_rank} answered with a bad acknowledgement (secret mismatch)",
            peer=peer_rank,
            transport=NAME,
        )


class Acceptor:
    """The accepting side of set-up: the listeners, the half-done handshakes and
    the authenticated sockets stashed by their dialler's rank.

    Args:
        rank: this rank (the acceptor; only higher ranks dial it).
        size: number of ranks.
        secret: the job's shared secret.
        timeout: the set-up timeout in seconds, named in :meth:`accept_until`'s
            error (the deadline it is given decides when it gives up).
        bufsize: SO_SNDBUF/SO_RCVBUF bytes for accepted sockets (0: autotuning).
    """

    def __init__(self, rank: int, size: int, secret: bytes, timeout: float, bufsize: int) -> None:
        self.rank = rank
        self.size = size
        self.secret = secret
        self.timeout = timeout
        self.bufsize = bufsize
        self.listeners: list[socket.socket] = []
        self.pending: dict[int, _Pending] = {}  # fd -> half-done handshake
        self.stash: dict[int, Stashed] = {}  # peer rank -> sockets
        self._quiet = _Quiet()
        self._accept_pause = 0.0  # seconds; grows while accept() finds no descriptor
        self._accept_again = 0.0  # monotonic time before which nothing is accepted

    def accept_until(self, peer_rank: int, deadline: Deadline) -> Stashed:
        """Serve every incoming handshake until all of ``peer_rank``'s sockets are in."""

        def ready() -> Stashed | None:
            st = self.stash.get(peer_rank)
            if st is not None and len(st.socks) == st.nsocks:
                return self.stash.pop(peer_rank)
            return None

        if not self.listeners:
            raise ConnectError(
                f"tcp: rank {self.rank} no longer listens (sealed after set-up)",
                peer=peer_rank,
                transport=NAME,
            )
        with selectors.DefaultSelector() as sel:
            listening = False
            for p in self.pending.values():
                sel.register(p.sock, selectors.EVENT_READ, p)
            try:
                # Hellos may have arrived while nobody was serving: read them first.
                for p in list(self.pending.values()):
                    self._read_hello(p, sel)
                while (st := ready()) is None:
                    now = time.monotonic()
                    if deadline.at is not None and now >= deadline.at:
                        raise ConnectError(
                            f"tcp: rank {self.rank} waited {self.timeout:g}s "
                            f"for rank {peer_rank} to connect",
                            peer=peer_rank,
                            transport=NAME,
                        )
                    for p in list(self.pending.values()):
                        if now >= p.expires:
                            self._quiet(
                                logging.WARNING,
                                "late",
                                "tcp: dropping %s: no valid hello in time",
                                p.peername,
                            )
                            self.drop(p, sel)
                    if listening != (now >= self._accept_again):  # out of descriptors: pause
                        listening = not listening
                        for lsock in self.listeners:
                            if listening:
                                sel.register(lsock, selectors.EVENT_READ, None)
                            else:
                                sel.unregister(lsock)
                    wait = 0.25 if deadline.at is None else min(0.25, deadline.at - now)
                    if not listening:
                        wait = min(wait, max(0.0, self._accept_again - now))
                    for key, _ in sel.select(max(0.0, wait)):
                        if key.data is None:
                            self._accept_ready(key.fileobj, sel)  # type: ignore[arg-type]
                        else:
                            self._read_hello(key.data, sel)
                return st
            finally:
                for key in list(sel.get_map().values()):
                    sel.unregister(key.fileobj)

    def _accept_ready(self, lsock: socket.socket, sel: selectors.BaseSelector) -> None:
        while True:
            try:
                sock, addr = lsock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:  # e.g. EMFILE: the connection waits in the backlog
                if exc.errno in _NO_ROOM:
                    self._accept_pause = min(_MAX_ACCEPT_PAUSE, max(0.01, 2 * self._accept_pause))
                    self._accept_again = time.monotonic() + self._accept_pause
                self._quiet(
                    logging.WARNING,
                    "accept",
                    "tcp: accept failed: %s; retrying in %.2f s",
                    exc,
                    self._accept_pause,
                )
                return
            self._accept_pause = 0.0
            if len(self.pending) >= MAX_PENDING:  # idle strangers: drop the oldest
                oldest = min(self.pending.values(), key=lambda q: q.expires)
                self._quiet(
                    logging.WARNING,
                    "full",
                    "tcp: %d handshakes pending; dropping the oldest, from %s",
                    len(self.pending),
                    oldest.peername,
                )
                self.drop(oldest, sel)
            sock.setblocking(False)
            challenge = _CHALLENGE.pack(b"PCTH", HS_VERSION, self.rank, secrets.token_bytes(16))
            peername = f"{addr[0]}:{addr[1]}"
            try:
                tune(sock, self.bufsize)
                sock.send(challenge)  # 28 bytes always fit a fresh socket's buffer
            except OSError as exc:
                logger.info("tcp: %s left before the handshake: %s", peername, exc)
                sock.close()
                continue
            p = _Pending(sock, peername, challenge, time.monotonic() + HANDSHAKE_SECONDS)
            self.pending[sock.fileno()] = p
            sel.register(sock, selectors.EVENT_READ, p)

    def drop(self, p: _Pending, sel: selectors.BaseSelector | None) -> None:
        self.pending.pop(p.sock.fileno(), None)
        if sel is not None:
            try:
                sel.unregister(p.sock)
            except (KeyError, ValueError):
                pass
        p.sock.close()

    def _read_hello(self, p: _Pending, sel: selectors.BaseSelector) -> None:
        try:
            data = p.sock.recv(_HELLO_LEN - len(p.got))
        except (BlockingIOError, InterruptedError):
            return
        except OSError as exc:
            logger.info("tcp: %s failed during the handshake: %s", p.peername, exc)
            self.drop(p, sel)
            return
        if not data:
            logger.info("tcp: %s closed before its hello", p.peername)
            self.drop(p, sel)
            return
        p.got += data
        if len(p.got) < _HELLO_LEN:
            return
        body, mac = bytes(p.got[: _HELLO_BODY.size]), bytes(p.got[_HELLO_BODY.size :])
        magic, version, src, dst, index, nsocks, chunk, _ = _HELLO_BODY.unpack(body)
        me = self.rank
        bad = None
        if magic != b"PCTh" or version != HS_VERSION:
            bad = "not a pycoll tcp hello"
        elif not hmac.compare_digest(mac, _hello_mac(self.secret, p.challenge, body)):
            bad = "bad secret"
        elif dst != me or not me < src < self.size:
            bad = f"hello from rank {src} to rank {dst} does not belong here"
        elif not (index < nsocks and chunk >= PIECE_ALIGN and chunk % PIECE_ALIGN == 0):
            bad = f"bad parameters (socket {index}/{nsocks}, chunk {chunk})"
        if bad is not None:
            self._quiet(
                logging.WARNING, "bad", "tcp: dropping connection from %s: %s", p.peername, bad
            )
            self.drop(p, sel)
            return
        st = self.stash.setdefault(src, Stashed(nsocks, chunk))
        if (st.nsocks, st.chunk) != (nsocks, chunk) or index in st.socks:
            logger.warning(
                "tcp: dropping socket %d from rank %d (%s): inconsistent with earlier sockets",
                index,
                src,
                p.peername,
            )
            self.drop(p, sel)
            return
        try:
            p.sock.setblocking(True)
            p.sock.settimeout(10.0)
            p.sock.sendall(_ACK.pack(b"PCTa", _ack_mac(self.secret, mac)))
        except OSError as exc:
            logger.info("tcp: rank %d left during the handshake: %s", src, exc)
            self.drop(p, sel)
            return
        self.pending.pop(p.sock.fileno(), None)
        sel.unregister(p.sock)
        st.socks[index] = p.sock
        logger.debug("tcp: rank %d accepted socket %d/%d from rank %d", me, index, nsocks, src)

    def seal(self) -> None:
        """Close the listeners and any half-done or unclaimed handshake (a
        stranger then meets a refused connection)."""
        for st in self.stash.values():
            for s in st.socks.values():
                s.close()
        self.stash.clear()
        for p in list(self.pending.values()):
            self.drop(p, None)
        self.close_listeners()

    def close_listeners(self) -> None:
        for s in self.listeners:
            s.close()
        self.listeners.clear()
