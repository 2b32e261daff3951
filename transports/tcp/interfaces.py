"""Which local addresses the tcp transport listens on (interface discovery).

``options.socket_ifname`` follows ``NCCL_SOCKET_IFNAME``: ``eth,ib`` (prefixes),
``=eth0`` (exact), ``^docker,lo`` (exclude).  The default takes every up,
non-loopback interface except docker bridges, and falls back to loopback only
when nothing else exists; the blob then says "loopback only" and
:meth:`~transports.tcp.TcpTransport.can_connect` refuses peers in another
network namespace.  :func:`host_id` names this kernel boot and network
namespace: two ranks with equal ids share a loopback device.
"""

from __future__ import annotations

import array
import fcntl
import hashlib
import ipaddress
import os
import socket
import struct
from dataclasses import dataclass, field

from transports.base import ConnectError

NAME = "tcp"
#: Addresses one endpoint lists at most (the blob's limit).
MAX_ADDRS = 16

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
