"""TCP transport: sockets between ranks on different hosts, host-staged.

Endpoint blob
    ``listen`` binds one listening socket per chosen address and returns a small
    versioned binary blob (``struct``, never pickle)::

        header  <4sBBBBI8s   magic "PCTC", version, flags, naddr, 0, rank, host id
        naddr x <BBHI16s     family (4|6), prefix length, port, IPv6 scope, address
        trailer <I           CRC-32 of everything before it

    The host id is a hash of the boot id and the network namespace: two ranks
    with equal ids share a loopback device, nothing else may use one.  The blob
    carries no secret.

Interfaces
    ``options.socket_ifname`` follows ``NCCL_SOCKET_IFNAME``: ``eth,ib`` (prefixes),
    ``=eth0`` (exact), ``^docker,lo`` (exclude).  The default takes every up,
    non-loopback interface except docker bridges, and falls back to loopback only
    when nothing else exists; the blob then says "loopback only" and
    :meth:`TcpTransport.can_connect` refuses peers in another network namespace.

Connection setup
    Of a pair, the higher rank dials the lower rank's listener; the lower rank
    accepts.  The acceptor sends a random challenge, the dialler answers with a
    hello (its rank, the socket's index, and an HMAC-SHA256 over the challenge
    keyed by ``options.secret``), and the acceptor acknowledges with an HMAC of
    its own so both ends know they share the secret.  A stranger on the port (bad
    magic, bad MAC, silence) is logged and dropped; it never fails the job.
    Sockets from ranks other than the one being waited for are stashed by their
    hello until ``connect`` is called for that rank.

Data path
    A connection owns ``tcp_nsocks`` sockets (like ``NCCL_NSOCKS_PERTHREAD``).
    Each message is cut into chunks of ``slot_bytes``; chunk ``j`` travels on
    socket ``j % nsocks`` behind a 40-byte frame header (sequence number, message
    size, offset, length, the message's tag, CRC of the header), so a
    desynchronised or corrupted stream raises :class:`TransportError` instead of
    hanging, and a message tagged otherwise than its receive raises
    :class:`~transports.base.TagMismatchError`.  Receivers read each
    chunk into a per-socket staging slot and hand it to the sink in offset order;
    bytes are only read once the matching receive is posted, and any request's
    progress drives the whole connection in both directions, which is what makes
    the flow-control rule of :mod:`transports.base` hold.
"""

from __future__ import annotations

import array
import collections
import errno
import fcntl
import hashlib
import hmac
import ipaddress
import logging
import os
import secrets
import select
import selectors
import socket
import struct
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field

from transports.base import (
    PIECE_ALIGN,
    BlobError,
    ConnectError,
    Connection,
    Deadline,
    DoneRequest,
    PeerClosedError,
    Request,
    Sink,
    Transport,
    TransportError,
    TransportOptions,
    tag_mismatch,
)

__all__ = ["TcpConnection", "TcpTransport", "select_interfaces"]

logger = logging.getLogger(__name__)

NAME = "tcp"

# --------------------------------------------------------------------------- tunables
#: Sockets per connection.  Measured over loopback on a 2-core machine, one
#: socket moves the most bytes per CPU second; more sockets help only on real
#: NICs where one TCP stream cannot fill the link.
DEFAULT_NSOCKS = 1
#: SO_SNDBUF/SO_RCVBUF request in bytes; 0 leaves Linux's autotuning alone
#: (autotuning may grow past ``net.core.rmem_max``, an explicit size may not).
DEFAULT_BUFSIZE = 4 << 20
#: Staging slots per socket: one being filled while the other waits its turn.
SLOTS_PER_SOCKET = 2
#: Progress rounds per call before control returns to the caller, so one busy
#: connection cannot starve the other requests of a ``wait_all``.
MAX_ROUNDS = 8
#: A peer that connects but sends no valid hello within this time is dropped.
HANDSHAKE_SECONDS = 30.0
#: Half-done handshakes held at once; past this the oldest is dropped (idle
#: strangers must not take every descriptor).
MAX_PENDING = 64
#: Errors of accept() that say "no descriptor or memory now": back off, from 10 ms
#: doubling to this, instead of retrying at once (a busy loop).
_NO_ROOM = (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM)
_MAX_ACCEPT_PAUSE = 1.0


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


# --------------------------------------------------------------------------- wire formats
BLOB_MAGIC = b"PCTC"
BLOB_VERSION = 1
BLOB_LOOPBACK_ONLY = 0x01
_BLOB_HEAD = struct.Struct("<4sBBBBI8s")
_BLOB_ADDR = struct.Struct("<BBHI16s")
_BLOB_TAIL = struct.Struct("<I")
MAX_ADDRS = 16
MAX_BLOB = _BLOB_HEAD.size + MAX_ADDRS * _BLOB_ADDR.size + _BLOB_TAIL.size

HS_VERSION = 1
# challenge: magic, version, acceptor rank, nonce
_CHALLENGE = struct.Struct("<4sB3xI16s")
# hello: magic, version, src, dst, socket index, nsocks, chunk bytes, nonce, mac
_HELLO_BODY = struct.Struct("<4sB3xIIHHI16s")
_HELLO_LEN = _HELLO_BODY.size + 32
# ack: magic, mac
_ACK = struct.Struct("<4s32s")

FRAME_MAGIC = 0x5043  # "PC"
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


# Linux ioctl numbers (<linux/sockios.h>) and interface flags (<net/if.h>).
_SIOCGIFCONF = 0x8912
_SIOCGIFFLAGS = 0x8913
_SIOCGIFNETMASK = 0x891B
_IFF_UP = 0x1
_IFF_LOOPBACK = 0x8
# /proc/net/if_inet6 flags that make an address unusable for listening.
_IFA_F_DADFAILED = 0x08
_IFA_F_TENTATIVE = 0x40
_IPV6_SCOPE_LINK = 0x20


# --------------------------------------------------------------------------- interfaces
@dataclass(frozen=True)
class Address:
    """One address of an endpoint.

    Attributes:
        family: 4 or 6.
        host: the address as text.
        prefixlen: the subnet prefix length of the interface address.
        port: the listening port (0 before binding).
        scope_id: IPv6 scope (interface index) or 0.
        ifname: the interface it came from (local only; not in the blob).
    """

    family: int
    host: str
    prefixlen: int
    port: int = 0
    scope_id: int = 0
    ifname: str = ""

    @property
    def is_loopback(self) -> bool:
        return ipaddress.ip_address(self.host).is_loopback

    def sockaddr(self) -> tuple[str, int] | tuple[str, int, int, int]:
        if self.family == 4:
            return (self.host, self.port)
        return (self.host, self.port, 0, self.scope_id)

    def __str__(self) -> str:
        return f"{self.host}:{self.port}" if self.family == 4 else f"[{self.host}]:{self.port}"


@dataclass
class _Interface:
    name: str
    flags: int
    addrs: list[Address] = field(default_factory=list)

    @property
    def up(self) -> bool:
        return bool(self.flags & _IFF_UP)

    @property
    def loopback(self) -> bool:
        return bool(self.flags & _IFF_LOOPBACK)


def _ifreq_flags(sock: socket.socket, name: str) -> int:
    req = struct.pack("16sH22x", name.encode()[:15], 0)
    return int(struct.unpack("16sH", fcntl.ioctl(sock, _SIOCGIFFLAGS, req)[:18])[1])


def _ipv4_addresses(sock: socket.socket) -> list[tuple[str, str, int]]:
    """All IPv4 addresses as (interface, address, prefix length), via SIOCGIFCONF.

    SIOCGIFCONF lists every address (secondaries under their label, e.g.
    ``eth0:1``), where SIOCGIFADDR would give only the first one.
    """
    ifreq = 40 if struct.calcsize("P") == 8 else 32
    cap = 64
    while True:
        buf = array.array("B", bytes(cap * ifreq))
        addr, _ = buf.buffer_info()
        ifc = struct.pack("iL", cap * ifreq, addr)
        used = struct.unpack("iL", fcntl.ioctl(sock, _SIOCGIFCONF, ifc))[0]
        if used < cap * ifreq:
            break
        cap *= 4
    raw = buf.tobytes()
    out = []
    for off in range(0, used, ifreq):
        label = raw[off : off + 16].split(b"\0", 1)[0].decode(errors="replace")
        host = socket.inet_ntoa(raw[off + 20 : off + 24])
        try:
            req = struct.pack("16s24x", label.encode()[:15])
            mask = fcntl.ioctl(sock, _SIOCGIFNETMASK, req)[20:24]
            prefix = int.from_bytes(mask, "big").bit_count()
        except OSError:
            prefix = 32
        out.append((label.split(":", 1)[0], host, prefix))
    return out


def _ipv6_addresses() -> list[tuple[str, str, int, int]]:
    """Usable IPv6 addresses as (interface, address, prefix, scope id).

    Link-local addresses are left out (they need a scope that means nothing on
    the peer's side), as are tentative and duplicate ones.
    """
    try:
        with open("/proc/net/if_inet6", encoding="ascii") as f:
            lines = f.read().splitlines()
    except OSError:
        return []
    out = []
    for line in lines:
        parts = line.split()
        if len(parts) != 6:
            continue
        hexaddr, _index, plen, scope, flags, name = parts
        if int(scope, 16) == _IPV6_SCOPE_LINK:
            continue
        if int(flags, 16) & (_IFA_F_TENTATIVE | _IFA_F_DADFAILED):
            continue
        host = str(ipaddress.IPv6Address(bytes.fromhex(hexaddr)))
        out.append((name, host, int(plen, 16), 0))
    return out


def _interfaces() -> list[_Interface]:
    """Interfaces in kernel index order, with their flags and addresses."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        found: dict[str, _Interface] = {}
        for _, name in socket.if_nameindex():
            try:
                found[name] = _Interface(name, _ifreq_flags(sock, name))
            except OSError:
                continue
        for name, host, prefix in _ipv4_addresses(sock):
            if name in found:
                found[name].addrs.append(Address(4, host, prefix, ifname=name))
    for name, host, prefix, scope in _ipv6_addresses():
        if name in found:
            found[name].addrs.append(Address(6, host, prefix, scope_id=scope, ifname=name))
    return list(found.values())


def _match_ifname(spec: str) -> tuple[bool, bool, list[str]]:
    """Parse an NCCL_SOCKET_IFNAME value into (exclude, exact, names)."""
    exclude = spec.startswith("^")
    if exclude:
        spec = spec[1:]
    exact = spec.startswith("=")
    if exact:
        spec = spec[1:]
    return exclude, exact, [p for p in spec.split(",") if p]


def select_interfaces(spec: str | None) -> tuple[list[Address], bool, str]:
    """Choose the local addresses to listen on.

    Args:
        spec: ``NCCL_SOCKET_IFNAME``-style selection, or None for the default.

    Returns:
        ``(addresses, loopback_only, description)``; IPv4 addresses first.

    Raises:
        ConnectError: when ``spec`` matches no interface with an address.
    """
    ifaces = [i for i in _interfaces() if i.up and i.addrs]
    if spec:
        exclude, exact, names = _match_ifname(spec)

        def hit(name: str) -> bool:
            return any(name == n if exact else name.startswith(n) for n in names)

        chosen = [i for i in ifaces if hit(i.name) != exclude]
        if not chosen:
            have = ", ".join(i.name for i in ifaces) or "none"
            raise ConnectError(
                f"tcp: socket_ifname={spec!r} matches no up interface with an address "
                f"(up interfaces: {have})",
                transport=NAME,
            )
    else:
        chosen = [i for i in ifaces if not i.loopback and not i.name.startswith("docker")]
        if not chosen:
            chosen = [i for i in ifaces if not i.loopback]
        if not chosen:
            chosen = [i for i in ifaces if i.loopback]
    addrs = [a for i in chosen for a in i.addrs if a.family == 4]
    addrs += [a for i in chosen for a in i.addrs if a.family == 6]
    loop_only = bool(addrs) and all(a.is_loopback for a in addrs)
    if not addrs:
        # No interface reports an address at all (an empty namespace): loopback
        # still works between ranks of this namespace.
        addrs, loop_only = [Address(4, "127.0.0.1", 8, ifname="lo")], True
    desc = ", ".join(sorted({a.ifname for a in addrs}))
    return addrs[:MAX_ADDRS], loop_only, desc


def host_id() -> bytes:
    """8 bytes naming this kernel boot and network namespace (no secret in it)."""
    h = hashlib.sha256(b"pycoll-tcp-host")
    try:
        with open("/proc/sys/kernel/random/boot_id", "rb") as f:
            h.update(f.read().strip())
    except OSError:
        h.update(socket.gethostname().encode())
    try:
        st = os.stat("/proc/self/ns/net")
        h.update(struct.pack("<QQ", st.st_dev, st.st_ino))
    except OSError:
        h.update(socket.gethostname().encode())
    return h.digest()[:8]


# --------------------------------------------------------------------------- blob
@dataclass(frozen=True)
class Endpoint:
    """A parsed endpoint blob."""

    rank: int
    host_id: bytes
    loopback_only: bool
    addrs: tuple[Address, ...]


def encode_blob(ep: Endpoint) -> bytes:
    """Serialize an :class:`Endpoint` (see the module docstring for the layout)."""
    if not 1 <= len(ep.addrs) <= MAX_ADDRS:
        raise ValueError(f"an endpoint needs 1..{MAX_ADDRS} addresses, got {len(ep.addrs)}")
    flags = BLOB_LOOPBACK_ONLY if ep.loopback_only else 0
    out = bytearray(
        _BLOB_HEAD.pack(BLOB_MAGIC, BLOB_VERSION, flags, len(ep.addrs), 0, ep.rank, ep.host_id)
    )
    for a in ep.addrs:
        packed = ipaddress.ip_address(a.host).packed
        out += _BLOB_ADDR.pack(a.family, a.prefixlen, a.port, a.scope_id, packed.ljust(16, b"\0"))
    out += _BLOB_TAIL.pack(zlib.crc32(out))
    return bytes(out)


def decode_blob(blob: bytes) -> Endpoint:
    """Parse a blob strictly.

    Raises:
        BlobError: when it is truncated, oversized, corrupted or of another version.
    """
    if not isinstance(blob, bytes | bytearray | memoryview):
        raise BlobError(f"tcp blob must be bytes, got {type(blob).__name__}", transport=NAME)
    blob = bytes(blob)
    n = len(blob)
    if n > MAX_BLOB:
        raise BlobError(f"tcp blob too large ({n} > {MAX_BLOB} bytes)", transport=NAME)
    if n < _BLOB_HEAD.size + _BLOB_ADDR.size + _BLOB_TAIL.size:
        raise BlobError(f"tcp blob truncated ({n} bytes)", transport=NAME)
    magic, version, flags, naddr, zero, rank, hid = _BLOB_HEAD.unpack_from(blob)
    if magic != BLOB_MAGIC:
        raise BlobError(f"not a tcp endpoint blob (magic {magic!r})", transport=NAME)
    if version != BLOB_VERSION:
        raise BlobError(
            f"tcp blob version {version} is not supported (this build speaks {BLOB_VERSION})",
            transport=NAME,
        )
    want = _BLOB_HEAD.size + naddr * _BLOB_ADDR.size + _BLOB_TAIL.size
    if not 1 <= naddr <= MAX_ADDRS or n != want:
        raise BlobError(
            f"tcp blob length {n} does not match its {naddr} address(es)",
            transport=NAME,
        )
    (crc,) = _BLOB_TAIL.unpack_from(blob, n - _BLOB_TAIL.size)
    if crc != zlib.crc32(blob[: n - _BLOB_TAIL.size]):
        raise BlobError("tcp blob is corrupted (CRC mismatch)", transport=NAME)
    if flags & ~BLOB_LOOPBACK_ONLY or zero:
        raise BlobError(f"tcp blob has unknown flags {flags:#x}", transport=NAME)
    addrs = []
    for i in range(naddr):
        fam, plen, port, scope, raw = _BLOB_ADDR.unpack_from(
            blob, _BLOB_HEAD.size + i * _BLOB_ADDR.size
        )
        if fam == 4 and plen <= 32 and raw[4:] == bytes(12):
            host = str(ipaddress.IPv4Address(raw[:4]))
        elif fam == 6 and plen <= 128:
            host = str(ipaddress.IPv6Address(raw))
        else:
            raise BlobError(f"tcp blob address {i} is malformed (family {fam})", transport=NAME)
        if port == 0:
            raise BlobError(f"tcp blob address {i} has port 0", transport=NAME)
        addrs.append(Address(fam, host, plen, port, scope))
    return Endpoint(rank, hid, bool(flags & BLOB_LOOPBACK_ONLY), tuple(addrs))


def plan_route(local: Endpoint, peer: Endpoint) -> tuple[list[Address], str]:
    """Rank the peer's addresses by how likely this rank reaches them.

    Returns:
        ``(addresses, reason)``: best first; empty when none is plausible, and
        then ``reason`` says why.
    """
    if local.host_id == peer.host_id:
        return list(peer.addrs), f"same network namespace, {peer.addrs[0]}"
    if peer.loopback_only:
        return [], (
            f"rank {peer.rank} listens on loopback only ({peer.addrs[0].host}) and is on "
            "another host or network namespace; set socket_ifname to a shared interface"
        )
    if local.loopback_only:
        return [], (
            f"this rank (rank {local.rank}) has only loopback addresses and rank "
            f"{peer.rank} is on another host or network namespace"
        )
    nets = [ipaddress.ip_interface(f"{a.host}/{a.prefixlen}").network for a in local.addrs]
    families = {a.family for a in local.addrs if not a.is_loopback}
    same_net: list[Address] = []
    routed: list[Address] = []
    for a in peer.addrs:
        if a.is_loopback or a.family not in families:
            continue
        ip = ipaddress.ip_address(a.host)
        (same_net if any(ip in net for net in nets) else routed).append(a)
    if same_net:
        return same_net + routed, f"{same_net[0]} (shared subnet)"
    if routed:
        return routed, f"{routed[0]} (no shared subnet; relies on routing)"
    return [], (
        f"no address family in common with rank {peer.rank} "
        f"(local {[a.host for a in local.addrs]}, peer {[a.host for a in peer.addrs]})"
    )


# --------------------------------------------------------------------------- helpers
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


def _recv_exact(sock: socket.socket, n: int, deadline: Deadline, what: str) -> bytes:
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


def _tune(sock: socket.socket, bufsize: int) -> None:
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
class _Stashed:
    """Sockets of one peer that passed the handshake."""

    nsocks: int
    chunk: int
    socks: dict[int, socket.socket] = field(default_factory=dict)


# --------------------------------------------------------------------------- transport
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
        self._listeners: list[socket.socket] = []
        self._endpoint: Endpoint | None = None
        self._blob: bytes | None = None
        self._pending: dict[int, _Pending] = {}  # fd -> half-done handshake
        self._stash: dict[int, _Stashed] = {}  # peer rank -> sockets
        self._conns: list[TcpConnection] = []
        self._closed = False
        self._quiet = _Quiet()
        self._accept_pause = 0.0  # seconds; grows while accept() finds no descriptor
        self._accept_again = 0.0  # monotonic time before which nothing is accepted

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
                self._listeners.append(s)
                port = s.getsockname()[1]
                bound.append(Address(a.family, a.host, a.prefixlen, port, a.scope_id, a.ifname))
            if not bound:
                raise ConnectError(
                    f"tcp: could not listen on any address of {desc}", transport=NAME
                )
            self._endpoint = Endpoint(self.options.rank, host_id(), loop_only, tuple(bound))
            self._blob = encode_blob(self._endpoint)
        except BaseException:
            self._close_listeners()
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
            st = self._accept_until(peer_rank, deadline)
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
                    _tune(sock, self.bufsize)
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
                    self._client_handshake(sock, peer_rank, index, deadline)
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

    def _client_handshake(
        self, sock: socket.socket, peer_rank: int, index: int, deadline: Deadline
    ) -> None:
        me = self.options.rank
        try:
            challenge = _recv_exact(sock, _CHALLENGE.size, deadline, "challenge")
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
                self.nsocks,
                self.chunk,
                secrets.token_bytes(16),
            )
            mac = _hello_mac(self.options.secret, challenge, body)
            sock.settimeout(10.0)
            sock.sendall(body + mac)
            ack = _recv_exact(sock, _ACK.size, deadline, "acknowledgement")
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
        if amagic != b"PCTa" or not hmac.compare_digest(amac, _ack_mac(self.options.secret, mac)):
            raise ConnectError(
                f"tcp: rank {peer_rank} answered with a bad acknowledgement (secret mismatch)",
                peer=peer_rank,
                transport=NAME,
            )

    def _accept_until(self, peer_rank: int, deadline: Deadline) -> _Stashed:
        """Serve every incoming handshake until all of ``peer_rank``'s sockets are in."""

        def ready() -> _Stashed | None:
            st = self._stash.get(peer_rank)
            if st is not None and len(st.socks) == st.nsocks:
                return self._stash.pop(peer_rank)
            return None

        if not self._listeners:
            raise ConnectError(
                f"tcp: rank {self.options.rank} no longer listens (sealed after set-up)",
                peer=peer_rank,
                transport=NAME,
            )
        with selectors.DefaultSelector() as sel:
            listening = False
            for p in self._pending.values():
                sel.register(p.sock, selectors.EVENT_READ, p)
            try:
                # Hellos may have arrived while nobody was serving: read them first.
                for p in list(self._pending.values()):
                    self._read_hello(p, sel)
                while (st := ready()) is None:
                    now = time.monotonic()
                    if deadline.at is not None and now >= deadline.at:
                        raise ConnectError(
                            f"tcp: rank {self.options.rank} waited {self.options.timeout:g}s "
                            f"for rank {peer_rank} to connect",
                            peer=peer_rank,
                            transport=NAME,
                        )
                    for p in list(self._pending.values()):
                        if now >= p.expires:
                            self._quiet(
                                logging.WARNING,
                                "late",
                                "tcp: dropping %s: no valid hello in time",
                                p.peername,
                            )
                            self._drop(p, sel)
                    if listening != (now >= self._accept_again):  # out of descriptors: pause
                        listening = not listening
                        for lsock in self._listeners:
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
            if len(self._pending) >= MAX_PENDING:  # idle strangers: drop the oldest
                oldest = min(self._pending.values(), key=lambda q: q.expires)
                self._quiet(
                    logging.WARNING,
                    "full",
                    "tcp: %d handshakes pending; dropping the oldest, from %s",
                    len(self._pending),
                    oldest.peername,
                )
                self._drop(oldest, sel)
            sock.setblocking(False)
            challenge = _CHALLENGE.pack(
                b"PCTH", HS_VERSION, self.options.rank, secrets.token_bytes(16)
            )
            peername = f"{addr[0]}:{addr[1]}"
            try:
                _tune(sock, self.bufsize)
                sock.send(challenge)  # 28 bytes always fit a fresh socket's buffer
            except OSError as exc:
                logger.info("tcp: %s left before the handshake: %s", peername, exc)
                sock.close()
                continue
            p = _Pending(sock, peername, challenge, time.monotonic() + HANDSHAKE_SECONDS)
            self._pending[sock.fileno()] = p
            sel.register(sock, selectors.EVENT_READ, p)

    def _drop(self, p: _Pending, sel: selectors.BaseSelector | None) -> None:
        self._pending.pop(p.sock.fileno(), None)
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
            self._drop(p, sel)
            return
        if not data:
            logger.info("tcp: %s closed before its hello", p.peername)
            self._drop(p, sel)
            return
        p.got += data
        if len(p.got) < _HELLO_LEN:
            return
        body, mac = bytes(p.got[: _HELLO_BODY.size]), bytes(p.got[_HELLO_BODY.size :])
        magic, version, src, dst, index, nsocks, chunk, _ = _HELLO_BODY.unpack(body)
        me = self.options.rank
        bad = None
        if magic != b"PCTh" or version != HS_VERSION:
            bad = "not a pycoll tcp hello"
        elif not hmac.compare_digest(mac, _hello_mac(self.options.secret, p.challenge, body)):
            bad = "bad secret"
        elif dst != me or not me < src < self.options.size:
            bad = f"hello from rank {src} to rank {dst} does not belong here"
        elif not (index < nsocks and chunk >= PIECE_ALIGN and chunk % PIECE_ALIGN == 0):
            bad = f"bad parameters (socket {index}/{nsocks}, chunk {chunk})"
        if bad is not None:
            self._quiet(
                logging.WARNING, "bad", "tcp: dropping connection from %s: %s", p.peername, bad
            )
            self._drop(p, sel)
            return
        st = self._stash.setdefault(src, _Stashed(nsocks, chunk))
        if (st.nsocks, st.chunk) != (nsocks, chunk) or index in st.socks:
            logger.warning(
                "tcp: dropping socket %d from rank %d (%s): inconsistent with earlier sockets",
                index,
                src,
                p.peername,
            )
            self._drop(p, sel)
            return
        try:
            p.sock.setblocking(True)
            p.sock.settimeout(10.0)
            p.sock.sendall(_ACK.pack(b"PCTa", _ack_mac(self.options.secret, mac)))
        except OSError as exc:
            logger.info("tcp: rank %d left during the handshake: %s", src, exc)
            self._drop(p, sel)
            return
        self._pending.pop(p.sock.fileno(), None)
        sel.unregister(p.sock)
        st.socks[index] = p.sock
        logger.debug("tcp: rank %d accepted socket %d/%d from rank %d", me, index, nsocks, src)

    # ----------------------------------------------------------------- close
    def seal(self) -> None:
        """Every peer is connected: close the listeners and any half-done or
        unclaimed handshake (a stranger then meets a refused connection)."""
        for st in self._stash.values():
            for s in st.socks.values():
                s.close()
        self._stash.clear()
        for p in list(self._pending.values()):
            self._drop(p, None)
        self._close_listeners()
        logger.debug("tcp: rank %d sealed: no longer listening", self.options.rank)

    def _close_listeners(self) -> None:
        for s in self._listeners:
            s.close()
        self._listeners.clear()

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


# --------------------------------------------------------------------------- connection
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
    free: list[memoryview] = field(default_factory=list)
    nslots: int = 0


class TcpConnection(Connection):
    """``nsocks`` non-blocking sockets to one peer; see the module docstring."""

    transport = NAME

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
        if self._error is None:
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
                    if rx.hdr_got < HDR:
                        n = sock.recv_into(memoryview(rx.hdr)[rx.hdr_got :])
                        if n == 0:
                            raise self._eof(ch)
                        moved = True
                        rx.hdr_got += n
                        if rx.hdr_got < HDR:
                            break
                        self._check_header(rx.hdr, ch)
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

    def _check_header(self, hdr: bytearray, ch: _Chunk) -> None:
        magic, _flags, seq, total, off, length, tag, crc = _FRAME.unpack(hdr)
        if magic != FRAME_MAGIC or crc != zlib.crc32(memoryview(hdr)[:_FRAME_CRC_SPAN]):
            raise TransportError(
                f"tcp stream from rank {self.peer} is corrupted (bad frame header)",
                peer=self.peer,
                transport=NAME,
            )
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
        poller = select.poll()
        for s in self._socks:
            poller.register(s, select.POLLRDHUP | select.POLLHUP | select.POLLERR)
        return bool(poller.poll(0))

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

    # ----------------------------------------------------------------- close
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
