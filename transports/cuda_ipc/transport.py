"""The cuda_ipc transport: who can connect, and the control segment of each pair."""

from __future__ import annotations

import logging
import mmap
import os
import secrets
import struct
from typing import Any

from transports import _atomic, _segment
from transports.base import (
    BlobError,
    Cap,
    ConnectError,
    Connection,
    Deadline,
    Transport,
    TransportError,
    TransportOptions,
)
from transports.cuda_driver import runtime
from transports.cuda_ipc.layout import _HDR, _MAGIC, _MAX_SLOTS, _SEG_BYTES, _VERSION, NAME
from transports.cuda_ipc.rings import CudaIpcConnection

log = logging.getLogger(__name__)

_BLOB = struct.Struct("<4sHH16sQQQQQ16sQ")
_BLOB_TAG = b"PCIP"


class _Identity:
    """Same host (boot id), same IPC namespace and /dev/shm, and which GPU (PCI bus id)."""

    __slots__ = ("boot", "bus", "dirfd", "ipc_ns", "pid", "pid_ns", "rank", "shm_dev", "token")

    def __init__(self, rank: int, token: bytes, bus: bytes) -> None:
        self.rank = rank
        self.token = token
        self.boot = _segment.boot_id()
        self.ipc_ns = _segment.ns_inode("ipc")
        self.pid_ns = _segment.ns_inode("pid")
        self.shm_dev = _segment.shm_device()
        self.pid = os.getpid()
        self.bus = bus
        self.dirfd = 0  # this rank's segment directory (transports._segment.Directory)

    def pack(self) -> bytes:
        return _BLOB.pack(
            _BLOB_TAG,
            _VERSION,
            0,
            self.boot,
            int.from_bytes(self.token, "little"),
            self.ipc_ns,
            self.pid_ns,
            self.shm_dev,
            (self.rank << 32) | self.pid,
            self.bus.ljust(16, b"\0")[:16],
            self.dirfd,
        )

    @classmethod
    def unpack(cls, blob: bytes) -> _Identity:
        if len(blob) != _BLOB.size:
            raise BlobError(f"cuda_ipc endpoint blob has {len(blob)} bytes, expected {_BLOB.size}")
        tag, ver, _, boot, token, ipc, pidns, dev, rp, bus, dirfd = _BLOB.unpack(blob)
        if tag != _BLOB_TAG or ver != _VERSION:
            raise BlobError(f"not a cuda_ipc endpoint blob (tag {tag!r}, version {ver})")
        self = cls.__new__(cls)
        self.boot, self.ipc_ns, self.pid_ns, self.shm_dev = boot, ipc, pidns, dev
        self.token = token.to_bytes(8, "little")
        self.rank, self.pid = rp >> 32, rp & 0xFFFFFFFF
        self.bus = bus.rstrip(b"\0")
        self.dirfd = dirfd
        return self


class CudaIpcTransport(Transport):
    """Connections that move device memory through CUDA IPC between ranks of one host.

    The device is the current CUDA device when the transport is created (set it
    before ``pycoll.init``).  Slots are ``options.slot_bytes`` (at least 64 KiB).

    Raises:
        ImportError: CuPy is not installed.
        TransportError: no CUDA device is visible.
    """

    name = NAME

    def __init__(self, options: TransportOptions) -> None:
        super().__init__(options)
        rt = runtime()
        try:
            count = rt.getDeviceCount()
        except Exception as exc:
            raise TransportError(f"cuda_ipc: no CUDA device ({exc})", transport=NAME) from exc
        if count < 1:
            raise TransportError("cuda_ipc: no CUDA device", transport=NAME)
        self._rt = rt
        self.device = int(rt.getDevice())
        self._me = _Identity(options.rank, secrets.token_bytes(8), _bus_id(rt, self.device))
        self.nslots = min(_MAX_SLOTS, max(2, options.nslots))
        self.slot_bytes = max(1 << 16, -(-options.slot_bytes // 4096) * 4096)
        self._conns: list[CudaIpcConnection] = []
        self._dir: _segment.Directory | None = None
        self._handles: list[int] = []  # descriptors of the segments made here (see _segment)

    def listen(self) -> bytes:
        if self._dir is None:
            self._dir = _segment.Directory(self.options.size, self._me.token, NAME)
            self._me.dirfd = self._dir.fd
        return self._me.pack()

    def can_connect(self, local: bytes, peer: bytes) -> tuple[bool, str]:
        a, b = _Identity.unpack(local), _Identity.unpack(peer)
        ok, why = _atomic.available()
        if not ok:
            return False, why
        ok, why = _segment.shared_memory_verdict(a, b)
        if not ok:
            return False, why
        if a.bus == b.bus:
            return True, f"same host and GPU ({a.bus.decode()})"
        try:
            other = int(self._rt.deviceGetByPCIBusId(b.bus.decode()))
        except Exception:
            return False, f"the peer's GPU {b.bus.decode()} is not visible here"
        if not self._rt.deviceCanAccessPeer(self.device, other):
            return False, f"no peer access from GPU {a.bus.decode()} to {b.bus.decode()}"
        return True, f"same host, peer access {a.bus.decode()} -> {b.bus.decode()}"

    def connect(self, peer_rank: int, peer: bytes) -> Connection:
        other = _Identity.unpack(peer)
        if other.rank != peer_rank:
            raise BlobError(f"cuda_ipc blob for rank {peer_rank} says rank {other.rank}")
        me = self._me
        lo, hi = (me, other) if me.rank < other.rank else (other, me)
        name = f"cuda_ipc {lo.rank}-{hi.rank}"
        ident = lo.token + struct.pack("<II", lo.rank, hi.rank)
        creator = me is lo
        if self._dir is None:
            self.listen()
        assert self._dir is not None
        fd = -1
        if creator:
            mm, fd = self._create(ident, peer_rank)
        else:
            mm = self._attach(other, ident, peer_rank)
        try:
            conn = CudaIpcConnection(
                mm, name, creator, peer_rank, self.device, other.pid, self.options.timeout
            )
        except BaseException as exc:
            mm.close()
            if fd >= 0:
                os.close(fd)
            if isinstance(exc, TransportError) or not isinstance(exc, Exception):
                raise
            raise ConnectError(
                f"cuda_ipc: setting up device memory for peer {peer_rank}: {exc}",
                peer=peer_rank,
                transport=NAME,
            ) from exc
        if creator:
            self._handles.append(fd)
            self._dir.publish(peer_rank, fd)  # last: the peer trusts what it then finds
        if me.bus == other.bus:
            conn.caps |= Cap.SAME_DEVICE  # several ranks sharing one GPU
        self._conns.append(conn)
        log.debug("cuda_ipc: rank %d <-> %d over %s", me.rank, peer_rank, name)
        return conn

    def _create(self, ident: bytes, peer: int) -> tuple[mmap.mmap, int]:
        mm, fd = _segment.create(_SEG_BYTES, ident=ident, peer=peer, transport=NAME)
        _HDR.pack_into(mm, 8, _VERSION, self.nslots, self.slot_bytes)
        struct.pack_into("<Q", mm, 0, _MAGIC)  # last: the attacher checks it
        return mm, fd

    def _attach(self, lo: _Identity, ident: bytes, peer: int) -> mmap.mmap:
        timeout = self.options.timeout
        handle = _segment.find(
            lo.pid,
            lo.dirfd,
            lo.token,
            self._me.rank,
            peer=peer,
            transport=NAME,
            deadline=Deadline.after(timeout),
            timeout=timeout,
        )
        mm = _segment.attach(
            lo.pid,
            handle,
            magic=_MAGIC,
            ident=ident,
            min_size=_SEG_BYTES,
            peer=peer,
            transport=NAME,
        )
        ver, nslots, slot_bytes = _HDR.unpack_from(mm, 8)
        if ver != _VERSION or not 2 <= nslots <= _MAX_SLOTS or slot_bytes % 4096:
            mm.close()
            raise ConnectError(
                f"cuda_ipc: the segment of rank {peer} has version {ver} and geometry "
                f"{nslots}x{slot_bytes}: ranks run different pycoll versions?",
                peer=peer,
                transport=NAME,
            )
        return mm

    def close(self) -> None:
        for c in self._conns:
            c.close()
        self._conns.clear()
        for fd in self._handles:
            os.close(fd)
        self._handles.clear()
        if self._dir is not None:
            self._dir.close()
            self._dir = None


def _bus_id(rt: Any, dev: int) -> bytes:
    """The GPU's PCI bus id (the same in every process, whatever CUDA_VISIBLE_DEVICES says)."""
    try:
        bus = rt.deviceGetPCIBusId(dev)
    except AttributeError:
        import cupy

        bus = cupy.cuda.Device(dev).pci_bus_id
    return str(bus).lower().encode()[:16]
