"""The tcp endpoint blob, and which of a peer's addresses to try.

``listen`` returns a small versioned binary blob (``struct``, never pickle)::

    header  <4sBBBBI8s   magic "PCTC", version, flags, naddr, 0, rank, host id
    naddr x <BBHI16s     family (4|6), prefix length, port, IPv6 scope, address
    trailer <I           CRC-32 of everything before it

The host id (:func:`~transports.tcp.interfaces.host_id`) is a hash of the boot
id and the network namespace: two ranks with equal ids share a loopback device,
nothing else may use one.  The blob carries no secret.
"""

from __future__ import annotations

import ipaddress
import struct
import zlib
from dataclasses import dataclass

from transports.base import BlobError
from transports.tcp.interfaces import MAX_ADDRS, NAME, Address

BLOB_MAGIC = b"PCTC"
BLOB_VERSION = 1
BLOB_LOOPBACK_ONLY = 0x01
_BLOB_HEAD = struct.Struct("<4sBBBBI8s")
_BLOB_ADDR = struct.Struct("<BBHI16s")
_BLOB_TAIL = struct.Struct("<I")
MAX_BLOB = _BLOB_HEAD.size + MAX_ADDRS * _BLOB_ADDR.size + _BLOB_TAIL.size


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
