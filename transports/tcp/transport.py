"""The tcp transport: listening, choosing a route, dialling or accepting.

See :mod:`transports.tcp` for the whole picture; the pieces live in
:mod:`~transports.tcp.interfaces` (which addresses), :mod:`~transports.tcp.blob`
(the endpoint blob), :mod:`~transports.tcp.handshake` (challenge and response)
and :mod:`~transports.tcp.connection` (the data path).
"""

from __future__ import annotations

import logging
import socket
import time

from transports.base import (
    PIECE_ALIGN,
    ConnectError,
    Deadline,
    Transport,
    TransportOptions,
)
from transports.tcp.blob import Endpoint, decode_blob, encode_blob, plan_route
from transports.tcp.connection import TcpConnection
from transports.tcp.handshake import Acceptor, client_handshake, tune
from transports.tcp.interfaces import NAME, Address, host_id, select_interfaces

logger = logging.getLogger(__name__)

#: Sockets per connection.  Measured over loopback on a 2-core machine, one
#: socket moves the most bytes per CPU second; more sockets help only on real
#: NICs where one TCP stream cannot fill the link.
DEFAULT_NSOCKS = 1
#: SO_SNDBUF/SO_RCVBUF request in bytes; 0 leaves Linux's autotuning alone
#: (autotuning may grow past ``net.core.rmem_max``, an explicit size may not).
DEFAULT_BUFSIZE = 4 << 20


def _int_option(options: TransportOptions, key: str, default: int, lo: int, hi: int) -> int:
    raw = options.get(key)
    if raw is None:
        return default
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"{key}={raw!r} is not an integer") from None
    if not lo <= value <= hi:
        raise ValueError(f"{key}={value} is outside [{lo}, {hi}]")
    return value


class TcpTransport(Transport):
    """Sockets between ranks; see the module docstring.

    Options read from ``options.extra``:
        ``tcp_nsocks``: sockets per connection (default :data:`DEFAULT_NSOCKS`).
        ``tcp_bufsize``: SO_SNDBUF/SO_RCVBUF bytes, 0 for kernel autotuning
        (default :data:`DEFAULT_BUFSIZE`).
    """

    name = NAME

    def __init__(self, options: TransportOptions) -> None:
        super().__init__(options)
        self.nsocks = _int_option(options, "tcp_nsocks", DEFAULT_NSOCKS, 1, 64)
        self.bufsize = _int_option(options, "tcp_bufsize", DEFAULT_BUFSIZE, 0, 1 << 30)
        # Chunks are slot-sized and aligned so every sink piece but the last is.
        self.chunk = max(PIECE_ALIGN, options.slot_bytes // PIECE_ALIGN * PIECE_ALIGN)
        self._endpoint: Endpoint | None = None
        self._blob: bytes | None = None
        self._acceptor = Acceptor(
            options.rank, options.size, options.secret, options.timeout, self.bufsize
        )
        self._conns: list[TcpConnection] = []
        self._closed = False

    # ----------------------------------------------------------------- listen
    def listen(self) -> bytes:
        """Bind a listener on each chosen address; return the endpoint blob.

        Raises:
            ConnectError: no interface matches, or no address could be bound.
        """
        if self._closed:
            raise ConnectError("tcp transport is closed", transport=NAME)
        if self._blob is not None:
            return self._blob
        addrs, loop_only, desc = select_interfaces(self.options.socket_ifname)
        bound: list[Address] = []
        backlog = min(4096, max(128, 2 * self.options.size * self.nsocks))
        try:
            for a in addrs:
                fam = socket.AF_INET if a.family == 4 else socket.AF_INET6
                s = socket.socket(fam, socket.SOCK_STREAM)
                try:
                    if fam == socket.AF_INET6:
                        s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
                    s.bind(Address(a.family, a.host, a.prefixlen, 0, a.scope_id).sockaddr())
                    s.listen(backlog)
                    s.setblocking(False)
                except OSError as exc:
                    s.close()
                    logger.debug("tcp: cannot listen on %s: %s", a.host, exc)
                    continue
                self._acceptor.listeners.append(s)
                port = s.getsockname()[1]
                bound.append(Address(a.family, a.host, a.prefixlen, port, a.scope_id, a.ifname))
            if not bound:
                raise ConnectError(
                    f"tcp: could not listen on any address of {desc}", transport=NAME
                )
            self._endpoint = Endpoint(self.options.rank, host_id(), loop_only, tuple(bound))
            self._blob = encode_blob(self._endpoint)
        except BaseException:
            self._acceptor.close_listeners()
            raise
        logger.info(
            "tcp: rank %d listening on %s (%s%s)",
            self.options.rank,
            ", ".join(map(str, bound)),
            desc,
            ", loopback only" if loop_only else "",
        )
        return self._blob

    # ----------------------------------------------------------------- probe
    def can_connect(self, local: bytes, peer: bytes) -> tuple[bool, str]:
        """Whether some address of ``peer`` is plausible from ``local``.

        Raises:
            BlobError: either blob is malformed.
        """
        lo, pe = decode_blob(local), decode_blob(peer)
        addrs, why = plan_route(lo, pe)
        if not addrs:
            return False, why
        return True, f"tcp to rank {pe.rank} via {why}"

    # ----------------------------------------------------------------- connect
    def connect(self, peer_rank: int, peer: bytes) -> TcpConnection:
        """Connect to ``peer_rank``: dial it if it is lower, else accept it.

        Raises:
            BlobError: the blob is malformed.
            ConnectError: no route, a failed handshake, or ``options.timeout`` passed.
        """
        if self._closed:
            raise ConnectError("tcp transport is closed", peer=peer_rank, transport=NAME)
        if self._endpoint is None:
            self.listen()
        assert self._endpoint is not None
        ep = decode_blob(peer)
        me = self.options.rank
        if ep.rank != peer_rank:
            raise ConnectError(
                f"tcp blob for rank {peer_rank} names rank {ep.rank}",
                peer=peer_rank,
                transport=NAME,
            )
        if peer_rank == me:
            raise ConnectError("tcp does not connect a rank to itself", peer=me, transport=NAME)
        deadline = Deadline.after(self.options.timeout)
        if peer_rank < me:
            addrs, why = plan_route(self._endpoint, ep)
            if not addrs:
                raise ConnectError(
                    f"tcp cannot reach rank {peer_rank}: {why}",
                    peer=peer_rank,
                    transport=NAME,
                )
            socks, nsocks, chunk, used = (
                self._dial(peer_rank, addrs, deadline),
                self.nsocks,
                self.chunk,
                why,
            )
        else:
            st = self._acceptor.accept_until(peer_rank, deadline)
            socks = [st.socks[i] for i in range(st.nsocks)]
            nsocks, chunk, used = st.nsocks, st.chunk, "accepted"
        for s in socks:
            s.setblocking(False)
        conn = TcpConnection(peer_rank, socks, chunk, self)
        self._conns.append(conn)
        logger.info(
            "tcp: rank %d <-> rank %d connected (%s, %d socket(s), %d-byte chunks)",
            me,
            peer_rank,
            used,
            nsocks,
            chunk,
        )
        return conn

    def _dial(
        self, peer_rank: int, addrs: list[Address], deadline: Deadline
    ) -> list[socket.socket]:
        """Open and authenticate ``nsocks`` sockets to the lower rank."""
        socks: list[socket.socket] = []
        try:
            for index in range(self.nsocks):
                sock, addr = self._dial_one(peer_rank, addrs, index, deadline)
                socks.append(sock)
                addrs = [addr] + [a for a in addrs if a != addr]  # the rest use what worked
        except BaseException:
            for s in socks:
                s.close()
            raise
        return socks

    def _dial_one(
        self, peer_rank: int, addrs: list[Address], index: int, deadline: Deadline
    ) -> tuple[socket.socket, Address]:
        delay = 0.01
        errors: list[str] = []
        while True:
            for a in addrs:
                fam = socket.AF_INET if a.family == 4 else socket.AF_INET6
                sock = socket.socket(fam, socket.SOCK_STREAM)
                try:
                    tune(sock, self.bufsize)
                    left = (
                        None if deadline.at is None else max(0.01, deadline.at - time.monotonic())
                    )
                    sock.settimeout(None if left is None else min(left, 10.0))
                    sock.connect(a.sockaddr())
                except OSError as exc:
                    sock.close()
                    errors.append(f"{a}: {exc}")
                    continue
                try:
                    client_handshake(
                        sock,
                        me=self.options.rank,
                        peer_rank=peer_rank,
                        index=index,
                        nsocks=self.nsocks,
                        chunk=self.chunk,
                        secret=self.options.secret,
                        deadline=deadline,
                    )
                except BaseException:
                    sock.close()
                    raise
                return sock, a
            if deadline.expired():
                raise ConnectError(
                    f"tcp: rank {self.options.rank} could not connect to rank {peer_rank} "
                    f"within {self.options.timeout:g}s (last errors: {'; '.join(errors[-len(addrs) :])})",
                    peer=peer_rank,
                    transport=NAME,
                )
            # The peer may not be listening yet (or a route is still coming up).
            time.sleep(delay)
            delay = min(delay * 2, 0.5)

    # ----------------------------------------------------------------- close
    def seal(self) -> None:
        """Every peer is connected: close the listeners and any half-done or
        unclaimed handshake (a stranger then meets a refused connection)."""
        self._acceptor.seal()
        logger.debug("tcp: rank %d sealed: no longer listening", self.options.rank)

    def close(self) -> None:
        """Close connections made here, stashed and half-open sockets, listeners."""
        if self._closed:
            return
        self._closed = True
        for conn in reversed(self._conns):
            conn.close()
        self._conns.clear()
        self.seal()

    def _forget(self, conn: TcpConnection) -> None:
        try:
            self._conns.remove(conn)
        except ValueError:
            pass
