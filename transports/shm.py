"""Shared-memory transport for ranks on one host.

One segment per pair of ranks, created by the lower rank (mode 0600) without a
name: the higher rank opens it through the creator's descriptor, which it finds
in the creator's directory (:mod:`transports._segment` gives the rule and the
protocol).  Nothing is ever named in ``/dev/shm``, so a crash at any moment,
set-up included, leaks nothing: the memory goes with the last process that maps it.

Layout (offsets in bytes)::

    0      header: magic, version, nslots, slot_bytes, identity (at 32), pid,
           "closed" word (and why: transports._segment.closed_word) and shared
           send buffer's handle per side; per direction (at 1536 and 1792) the
           words of a copy from both ends
    4096   direction 0 (lo -> hi) control: head, tail (own cache lines), slot metadata
           (piece length, offset, descriptor address, the message's tag)
    6144   direction 1 (hi -> lo) control
    8192   direction 0 slots, then direction 1 slots; each slot is slot_bytes + 4096

Flow control per direction is a ring of ``nslots`` slots with two counters:
the sender owns ``head`` (slots published), the receiver owns ``tail`` (slots
released).  The sender fills slot ``head % nslots`` when ``head - tail < nslots``,
writes the slot's metadata, then stores ``head + 1`` with release semantics; the
receiver loads ``head`` with acquire semantics, hands the slot's bytes to the
sink (which copies or reduces straight out of the slot), then stores ``tail + 1``
with release semantics.  :mod:`transports._atomic` states why this ordering
holds on x86-64 and on weakly ordered CPUs such as aarch64.

A piece is written into its slot at the same offset within a 4 KiB page as its
source: memcpy between addresses whose page offsets differ by a few bytes runs
several times slower on the machines we measured.

A message moves through the slots in pieces of at most :data:`PIECE_BYTES`, so
the receiver copies one out while the sender copies the next in.

Large messages skip the slots (from :data:`CMA_MIN_BYTES` by ``isend``, from
:data:`COPIED_CMA_MIN_BYTES` by ``isend_copied``): a slot then holds a
descriptor of where the bytes are, and the send completes once the receiver
has taken them (``tail`` passes the slot).  The bytes are either in the
sender's own memory, which the receiver reads with one cross-memory copy
(:mod:`transports._cma`), or in the sender's *shared send buffer*
(:meth:`ShmConnection.send_buffer`), a nameless segment of
its own (made on first use; its handle is in the pair segment's header, written
before the first descriptor that points into it) that both sides map: the receiver's sink reads them in place, so bytes
that a GPU copied into it reach the receiving GPU with no CPU copy at all.

A large message of ``isend_copied`` in the sender's memory is copied from both
ends (:data:`HELP_MIN_BYTES`): the receiver says where the bytes go in words of
the header page (``_HELP_OFF``), and the two sides take pieces by a
compare-and-swap on a word that names the copy, the receiver reading and the
sender writing, until none is left; the receiver completes the message when
every piece is written.
"""

from __future__ import annotations

import errno
import logging
import mmap
import os
import secrets
import struct
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import numpy as np

from transports import _atomic, _cma, _exit, _segment
from transports.base import (
    PIECE_ALIGN,
    BlobError,
    Cap,
    ConnectError,
    Connection,
    Deadline,
    DoneRequest,
    PeerClosedError,
    QueuedRequest,
    Request,
    Sink,
    Transport,
    TransportError,
    TransportOptions,
    tag_mismatch,
)

log = logging.getLogger(__name__)

_ring: Any
try:  # the compiled ring step (transports/_ring.c), built by pip install where a C
    from transports import _ring  # compiler is found; without it put_now and take_now
except ImportError:  # pragma: no cover - never take the fast way (Connection's defaults)
    _ring = None

SHM_DIR = _segment.SHM_DIR
_MAGIC = 0x70636F6C6C73686D  # "pcollshm"
_VERSION = 5
_PAGE = 4096
_HDR = struct.Struct("<IIQ")  # at offset 8, after the magic: version, nslots, slot_bytes
_CTRL0 = 4096
_CTRL_SIZE = 2048
_DATA0 = 8192
# per-side words in the header: pid and "closed" word, on their own cache lines
_PID_OFF = (256, 384)
_CLOSED_OFF = (512, 640)
# per side: "I can read my peer's memory directly" (0 unknown, 1 yes, 2 no), and
# the address of my mapping of this segment (what the peer probes)
_CMA_OFF = (768, 896)
_MAPADDR_OFF = (1024, 1152)
# per side: the handle (descriptor + 1) of the side's shared send buffer, 0 before
_SBUF_FD_OFF = (1280, 1408)
# per direction: a large message read in place is copied from both ends at once
# (_help_recv, _help_send): the copy's id and next piece, its pieces done (id
# above, count below), and the receiver's address; each on its own cache line
_HELP_OFF = (1536, 1792)
#: A message of ``isend_copied`` read in place (a direct-read descriptor) of at
#: least this size into a receive's buffer is copied from both ends: the
#: receiver reads pieces (:func:`help_pieces`) from the sender's memory while the
#: sender, waiting for it anyway, writes others into the receiver's (both by
#: cross-memory copy), each taking the next piece not yet taken.  A 2 MiB
#: point-to-point message took 165-175 us a way so, against 248-257 through the
#: slots.  Collectives' messages (``isend``) do not: a rank that sends in a ring
#: also receives, and at n = 4 on two cores a ring allgather of 8 MiB took 7.8 ms
#: so, instead of 6.8.
HELP_MIN_BYTES = 1 << 20
#: At close, how long a receive waits for the pieces its sender took (see
#: :meth:`ShmConnection._end_help`); the buffers of those that never came are
#: kept in :data:`_KEPT` until the process exits.
HELP_CLOSE_SECONDS = 1.0
_KEPT: list[Any] = []
#: The pieces of a copy from both ends: a quarter of the message, from
#: :data:`HELP_PIECE_MIN` to :data:`HELP_PIECE` bytes, so that both ends copy
#: from 1 MiB on (one 1 MiB piece took 144-148 us a way; four of 256 KiB, 99-104).
HELP_PIECE = 1 << 20
HELP_PIECE_MIN = 256 << 10
_M32 = 0xFFFFFFFF
# piece length, offset within the slot, (for a direct-read descriptor) the
# address of the bytes in the sender's memory, else 0, and the message's tag
_META = struct.Struct("<QQQQ")
#: Messages at least this large go by a direct-read descriptor when the receiver
#: can read the sender's memory (cross-memory attach).
CMA_MIN_BYTES = 256 << 10
_CMA_TEMP = 256 << 10  # reduce sinks get the bytes in cache-sized pieces
#: A message through the slots moves in pieces of at most this many bytes, so the
#: receiver copies one piece out while the sender copies the next in: a 1 MiB
#: point-to-point message took 94 us a way in 256 KiB pieces, 190-206 us as one
#: 1 MiB piece, and 144-153 us by a cross-memory read (the 2-core VM of
#: benchmarks/RESULTS.md, "Point-to-point and alltoall against MPI and Gloo").
PIECE_BYTES = 256 << 10
#: ``isend_copied`` lets the receiver read a message this large in place (and
#: so, from :data:`HELP_MIN_BYTES`, both ends copy it); smaller ones go through
#: the slots, where a 512 KiB message took 80-87 us a way against 84-85 by a
#: cross-memory read.
COPIED_CMA_MIN_BYTES = 1 << 20

#: In a descriptor's offset field: the bytes are in the sender's shared send
#: buffer, at the descriptor's address taken as an offset into that buffer.
_IN_SBUF = 1 << 63
#: In a direct-read descriptor's offset field: the sender writes pieces of it
#: too, if the receiver copies into a buffer (:meth:`ShmConnection._help_recv`).
_HELPS = 1 << 62
#: Messages up to this size are copied into a slot when posted, if nothing is
#: queued before them, and taken out when a receive is posted if already there
#: (``_put_small``, ``_take_small``): a point-to-point ping-pong of 8 B took
#: 2.2 us of transport time instead of 6.3 (the 2-core VM of benchmarks/RESULTS.md)
_SMALL = 32 << 10
_SBUF_MAGIC = 0x7063736275660000  # "pcsbuf"; header: magic, then the buffer's size

_BLOB = struct.Struct("<4sHH16sQQQQQQ")  # tag, version, rank... see _Identity
_BLOB_TAG = b"PCSM"


class _Identity:
    """What decides whether two ranks can share memory.

    Same kernel boot (``boot_id``), same IPC namespace, and the same ``/dev/shm``
    filesystem instance (tmpfs device number).  Containers on one machine with
    their own IPC namespace or their own /dev/shm fail one of these and fall back
    to a network transport instead of failing.
    """

    def __init__(self, rank: int, token: bytes) -> None:
        self.rank = rank
        self.token = token  # 8 random bytes naming this rank's segments
        self.boot = _segment.boot_id()
        self.ipc_ns = _segment.ns_inode("ipc")
        self.pid_ns = _segment.ns_inode("pid")
        self.shm_dev = _segment.shm_device()
        self.pid = os.getpid()
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
            self.dirfd,
        )

    @classmethod
    def unpack(cls, blob: bytes) -> _Identity:
        if not isinstance(blob, bytes | bytearray | memoryview):
            raise BlobError(f"shm endpoint blob must be bytes, not {type(blob).__name__}")
        if len(blob) != _BLOB.size:
            raise BlobError(f"shm endpoint blob has {len(blob)} bytes, expected {_BLOB.size}")
        tag, ver, _, boot, token, ipc, pidns, dev, rp, dirfd = _BLOB.unpack(blob)
        if tag != _BLOB_TAG or ver != _VERSION:
            raise BlobError(f"not a shm endpoint blob (tag {tag!r}, version {ver})")
        self = cls.__new__(cls)
        self.boot, self.ipc_ns, self.pid_ns, self.shm_dev = boot, ipc, pidns, dev
        self.token = token.to_bytes(8, "little")
        self.rank, self.pid = rp >> 32, rp & 0xFFFFFFFF
        self.dirfd = dirfd
        return self


def help_pieces(nbytes: int) -> tuple[int, int]:
    """The piece of an ``nbytes`` copy from both ends and how many there are
    (both ends compute them)."""
    size = min(HELP_PIECE, max(HELP_PIECE_MIN, nbytes // 4 // _PAGE * _PAGE))
    return size, -(-nbytes // size)


def _segment_bytes(nslots: int, slot_bytes: int) -> int:
    return _DATA0 + 2 * nslots * (slot_bytes + _PAGE)


class ShmTransport(Transport):
    """Connections through a shared segment per pair of ranks on one host."""

    name = "shm"

    def __init__(self, options: TransportOptions) -> None:
        super().__init__(options)
        self._me = _Identity(options.rank, secrets.token_bytes(8))
        # the slots' metadata must fit the control block after head and tail
        self.nslots = min(max(2, options.nslots), (_CTRL_SIZE - 256) // _META.size)
        slot = max(_PAGE, options.slot_bytes // _PAGE * _PAGE)
        # Containers often give /dev/shm only 64 MiB.  If every pair of ranks were on
        # this host, all segments together should take at most half of what is free.
        try:
            pairs = max(1, options.size * (options.size - 1) // 2)
            budget = _segment.free_bytes() // 2 // pairs
            fit = (budget - _DATA0) // (2 * self.nslots) - _PAGE
            if fit < slot:
                slot = max(_PAGE, fit // _PAGE * _PAGE)
                log.info("shm: %s is small; using %d-byte slots", SHM_DIR, slot)
        except OSError:
            pass
        self.slot_bytes = slot
        self._conns: list[ShmConnection] = []
        self._dir: _segment.Directory | None = None

    def listen(self) -> bytes:
        """The endpoint blob, once a pair segment is known to fit in /dev/shm.

        Raises:
            ConnectError: /dev/shm has no room for one segment (errno ENOSPC): the
                bootstrap then falls back to the next allowed transport.
        """
        if self.options.size > 1:
            _segment.probe_room(
                _segment_bytes(self.nslots, self.slot_bytes),
                transport="shm",
                hint="enlarge it (docker --shm-size) or lower PYCOLL_CHUNK_BYTES",
            )
        if self._dir is None:
            self._dir = _segment.Directory(self.options.size, self._me.token, "shm")
            self._me.dirfd = self._dir.fd
        return self._me.pack()

    def can_connect(self, local: bytes, peer: bytes) -> tuple[bool, str]:
        a, b = _Identity.unpack(local), _Identity.unpack(peer)
        ok, why = _atomic.available()
        if not ok:
            return False, why
        return _segment.shared_memory_verdict(a, b)

    def connect(self, peer_rank: int, peer: bytes) -> Connection:
        other = _Identity.unpack(peer)
        if other.rank != peer_rank:
            raise BlobError(f"shm blob for rank {peer_rank} says rank {other.rank}")
        me = self._me
        lo, hi = (me, other) if me.rank < other.rank else (other, me)
        name = f"shm {lo.rank}-{hi.rank}"
        ident = lo.token + struct.pack("<II", lo.rank, hi.rank)
        creator = me is lo
        if self._dir is None:
            self.listen()
        assert self._dir is not None
        if creator:
            mm, fd = self._create(ident, _segment_bytes(self.nslots, self.slot_bytes), peer_rank)
        else:
            fd = -1
            mm = self._attach(other, ident, peer_rank)
        try:
            conn = ShmConnection(
                mm,
                name,
                creator,
                peer_rank,
                other.pid,
                int(self.options.get("shm_cma_min", str(CMA_MIN_BYTES)) or 0),
                handle=fd,
                ident=ident,
            )
        except BaseException:
            mm.close()
            if fd >= 0:
                os.close(fd)
            raise
        if creator:
            self._dir.publish(peer_rank, fd)  # last: the peer trusts what it then finds
        self._conns.append(conn)
        log.debug(
            "shm: rank %d %s segment %s (%d bytes)",
            me.rank,
            "created" if creator else "attached",
            name,
            len(mm),
        )
        return conn

    def _create(self, ident: bytes, size: int, peer: int) -> tuple[mmap.mmap, int]:
        mm, fd = _segment.create(
            size,
            ident=ident,
            peer=peer,
            transport="shm",
            hint="enlarge it (docker --shm-size) or lower PYCOLL_CHUNK_BYTES",
        )
        _HDR.pack_into(mm, 8, _VERSION, self.nslots, self.slot_bytes)
        struct.pack_into("<Q", mm, _PID_OFF[0], os.getpid())
        # magic last: the attacher checks it before trusting the rest
        struct.pack_into("<Q", mm, 0, _MAGIC)
        return mm, fd

    def _attach(self, lo: _Identity, ident: bytes, peer: int) -> mmap.mmap:
        timeout = self.options.timeout
        common = {"peer": peer, "transport": "shm"}
        handle = _segment.find(
            lo.pid,
            lo.dirfd,
            lo.token,
            self._me.rank,
            deadline=Deadline.after(timeout),
            timeout=timeout,
            **common,  # type: ignore[arg-type]
        )
        mm = _segment.attach(lo.pid, handle, magic=_MAGIC, ident=ident, min_size=_DATA0, **common)  # type: ignore[arg-type]
        size = len(mm)
        ver, nslots, slot_bytes = _HDR.unpack_from(mm, 8)
        # The creator chose the geometry (it sized the segment to fit /dev/shm).
        if (
            ver != _VERSION
            or nslots < 2
            or slot_bytes % _PAGE
            or _segment_bytes(nslots, slot_bytes) != size
        ):
            mm.close()
            raise ConnectError(
                f"shm segment of rank {peer} has version {ver} and geometry {nslots}x{slot_bytes}, "
                f"which does not match its size {size}: ranks run different pycoll versions?",
                peer=peer,
                transport="shm",
            )
        struct.pack_into("<Q", mm, _PID_OFF[1], os.getpid())
        return mm

    def close(self) -> None:
        for c in self._conns:
            c.close()
        self._conns.clear()
        if self._dir is not None:
            self._dir.close()
            self._dir = None


class _Direction:
    """One ring of slots: counters, metadata and data views."""

    __slots__ = (
        "base",
        "ctrl",
        "data",
        "head",
        "meta_off",
        "nslots",
        "piece",
        "slot_bytes",
        "stride",
        "tail",
    )

    def __init__(self, mm: mmap.mmap, d: int, nslots: int, slot_bytes: int) -> None:
        self.ctrl = ctrl = _CTRL0 + d * _CTRL_SIZE
        self.head = _atomic.Counter(mm, ctrl)
        self.tail = _atomic.Counter(mm, ctrl + 128)
        self.meta_off = ctrl + 256
        self.nslots = nslots
        self.slot_bytes = slot_bytes
        self.piece = min(slot_bytes, PIECE_BYTES)  # a message's bytes per slot
        self.stride = slot_bytes + _PAGE
        self.base = _DATA0 + d * nslots * self.stride
        self.data = np.frombuffer(mm, dtype=np.uint8)

    def ring(self, mm: mmap.mmap) -> tuple[Any, ...]:
        """The mapping and the offsets :mod:`transports._ring` works on."""
        return (
            mm,
            self.base,
            self.stride,
            self.meta_off,
            self.ctrl,
            self.ctrl + 128,
            self.nslots,
            self.slot_bytes,
        )


class ShmConnection(Connection):
    transport = "shm"
    caps = Cap.SHARED_SEND_BUFFERS | Cap.PROBE

    def __init__(
        self,
        mm: mmap.mmap,
        name: str,
        creator: bool,
        peer: int,
        peer_pid: int,
        cma_min: int = CMA_MIN_BYTES,
        *,
        handle: int = -1,
        ident: bytes = b"",
    ) -> None:
        self.peer = peer
        self._mm = mm
        self._name = name
        self._handle = handle  # the creator's descriptor of the segment (-1: none)
        self._ident = ident
        self._creator = creator
        self._side = 0 if creator else 1
        self._peer_pid = peer_pid
        self._in_process = peer_pid == os.getpid()
        _, nslots, slot_bytes = _HDR.unpack_from(mm, 8)
        out_d, in_d = (0, 1) if creator else (1, 0)
        self._out = _Direction(mm, out_d, nslots, slot_bytes)
        self._in = _Direction(mm, in_d, nslots, slot_bytes)
        self._sends: deque[_ShmSend] = deque()
        self._recvs: deque[_ShmRecv] = deque()
        self._closed = False
        self._cause: int | None = None  # the rank this side closes because of (close_because)
        self._sent = 0  # local copies of our own counters
        self._recvd = 0
        self._closed_peer = _atomic.Counter(mm, _CLOSED_OFF[1 - self._side])
        self._closed_me = _atomic.Counter(mm, _CLOSED_OFF[self._side])
        # Direct reads (see transports._cma): we publish our mapping's address so the
        # peer can probe us; each side probes when it first receives.
        self._cma_me = _atomic.Counter(mm, _CMA_OFF[self._side])
        self._cma_peer = _atomic.Counter(mm, _CMA_OFF[1 - self._side])
        self._cma_min = cma_min if (peer_pid and _cma.available()) else 0
        self._peer_reads_us = False
        # both ends of a large copy (_help_recv, _help_send): the words of each
        # direction, and whether this process can take part (the compiled claim)
        self._helps = _ring is not None and bool(self._cma_min)
        self._help_at = (_HELP_OFF[in_d], _HELP_OFF[out_d])  # claim; done at +64, dest +128
        # ours as the receiver (claim, done, dest), and the receiver's dest as sender
        self._help_in = [_atomic.Counter(mm, _HELP_OFF[in_d] + k) for k in (0, 64, 128)]
        self._help_dest = _atomic.Counter(mm, _HELP_OFF[out_d] + 128)
        self._acks: deque[_ShmSend] = deque()
        self._temp: Any = None
        self._ring_out: tuple[Any, ...] | None = None
        self._ring_in: tuple[Any, ...] | None = None
        if _ring is not None:
            self._ring_out, self._ring_in = self._out.ring(mm), self._in.ring(mm)
            self.caps = ShmConnection.caps | Cap.QUICK
        # shared send buffers (send_buffer): ours, and the peer's as mapped here
        self._sbuf: Any = None
        self._sbuf_mm: mmap.mmap | None = None
        self._sbuf_fd = -1
        self._sbuf_addr = 0
        self._sbuf_failed = False
        self._rbuf: Any = None
        self._rbuf_mm: mmap.mmap | None = None
        if self._cma_min:
            base = np.frombuffer(mm, dtype=np.uint8).__array_interface__["data"][0]
            struct.pack_into("<Q", mm, _MAPADDR_OFF[self._side], base)
        else:
            self._cma_me.store(2)
        _exit.watch(self)

    # ------------------------------------------------------------------ posting
    def isend(self, data: memoryview, tag: int = 0) -> Request:
        return self._isend(data, tag, True)

    def isend_copied(self, data: memoryview, tag: int = 0) -> Request:
        return self._isend(data, tag, data.nbytes >= COPIED_CMA_MIN_BYTES, True)

    def _isend(self, data: memoryview, tag: int, direct: bool, copied: bool = False) -> Request:
        """``direct``: a large message may go by a direct-read descriptor;
        ``copied``: and then be copied from both ends (:meth:`_help_send`)."""
        self._check_open()
        n = data.nbytes
        if n == 0:
            return DoneRequest(self.peer)
        if (
            n <= _SMALL
            and not self._sends
            and (self._sbuf is None or not self._in_sbuf(data))
            and self._put_small(data, n, tag)
        ):
            return DoneRequest(self.peer)
        if copied and n >= HELP_MIN_BYTES and self._helps and not self._cma_me.load():
            self._probe_cma()  # (we write into the receiver only once we could read it)
        req = _ShmSend(self, np.frombuffer(data, dtype=np.uint8), tag, direct, copied)
        self._sends.append(req)
        return req

    def _in_sbuf(self, data: memoryview) -> bool:
        """Whether ``data`` lies in this side's shared send buffer (then it is
        described, never copied)."""
        at = np.frombuffer(data, np.uint8).__array_interface__["data"][0] - self._sbuf_addr
        return 0 <= at < self._sbuf.size  # type: ignore[union-attr]

    def _put_small(self, data: memoryview, n: int, tag: int) -> bool:
        """A small message with no send queued before it, into a free slot now
        (what :meth:`_progress_sends` would do with it, at page offset 0); False:
        the ring is full."""
        out = self._out
        head = self._sent
        if n > out.slot_bytes or head - out.tail.load() >= out.nslots:
            return False
        self._write_slot(head, data, n, 0, tag)
        self._sent = head + 1
        return True

    def _write_slot(self, head: int, piece: Any, n: int, o: int, tag: int) -> None:
        """Write the ``n`` bytes of ``piece`` at page offset ``o`` of the outbound
        slot for message piece ``head``, with its metadata, and publish it."""
        out = self._out
        slot = head % out.nslots
        start = out.base + slot * out.stride + o
        self._mm[start : start + n] = piece
        _META.pack_into(self._mm, out.meta_off + _META.size * slot, n, o, 0, tag)
        out.head.store(head + 1)  # release: the slot and its metadata are written

    def put_now(self, head: Any, body: Any, nbytes: int, tag: int) -> bool:
        """:meth:`Connection.put_now`: into the next free slot, with nothing queued,
        in one compiled step (what :meth:`_put_small` does for one buffer)."""
        if self._closed or self._sends or self._ring_out is None:
            return False  # (closed: the usual send raises)
        if _ring.put(self._ring_out, self._sent, head, body, nbytes, tag):
            self._sent += 1
            return True
        return False

    def take_now(self, head: Any, out: Any, nbytes: int, tag: int, spins: int) -> int:
        """:meth:`Connection.take_now`: the oldest unread slot, with no receive
        queued, in one compiled step (what :meth:`_take_small` does, with its
        head compared)."""
        if self._closed or self._recvs or self._ring_in is None:
            return 0
        if self._in_process:  # ranks as threads: the peer cannot store while take
            spins = 0  # holds the GIL
        got: int = _ring.take(self._ring_in, self._recvd, head, out, nbytes, tag, spins)
        if got > 0:
            self._recvd += 1
        return got

    def irecv(self, nbytes: int, sink: Sink, tag: int = 0) -> Request:
        return self._irecv(nbytes, sink, None, tag)

    def irecv_into(self, out: memoryview, tag: int = 0) -> Request:
        self._check_open()
        if not self._recvs and 0 < out.nbytes <= _SMALL and self._take_small(out, tag):
            return DoneRequest(self.peer)

        def copy(off: int, piece: memoryview) -> None:
            out[off : off + len(piece)] = piece

        return self._irecv(len(out), copy, np.frombuffer(out, dtype=np.uint8), tag)

    def send_buffer(self, nbytes: int) -> np.ndarray | None:
        self._check_open()
        if self._sbuf is None and not self._sbuf_failed:
            size = -(-max(1, nbytes) // _PAGE) * _PAGE
            try:
                # at most half of what /dev/shm has free: the slots may need the rest
                if _PAGE + size > _segment.free_bytes() // 2:
                    raise OSError(errno.ENOSPC, f"{SHM_DIR} has too little room")
                mm, fd = _segment.create(
                    _PAGE + size, ident=self._ident, peer=self.peer, transport="shm"
                )
            except (OSError, TransportError) as exc:
                log.info("shm: no shared send buffer to peer %d (%s); sends copy", self.peer, exc)
                self._sbuf_failed = True
                return None
            struct.pack_into("<Q", mm, 8, size)
            struct.pack_into("<Q", mm, 0, _SBUF_MAGIC)
            # its handle, before any descriptor that points into it (head's release)
            struct.pack_into("<Q", self._mm, _SBUF_FD_OFF[self._side], fd + 1)
            self._sbuf_mm, self._sbuf_fd = mm, fd
            self._sbuf = np.frombuffer(mm, np.uint8, size, _PAGE)
            self._sbuf_addr = self._sbuf.__array_interface__["data"][0]
            log.debug("shm: shared send buffer (%d bytes) to peer %d", size, self.peer)
        if self._sbuf is None or nbytes > self._sbuf.size:
            return None
        return self._sbuf  # type: ignore[no-any-return]

    def recv_buffer(self) -> np.ndarray | None:
        return self._rbuf  # type: ignore[no-any-return]

    def probe(self) -> int | None:
        """The tag in the metadata of the inbound ring's oldest unread slot: with no
        receive queued, every earlier message was taken whole, so that slot (a
        piece or a descriptor) starts the next message."""
        self._check_open()
        if self._recvs:
            return None
        inn = self._in
        if inn.head.load() <= self._recvd:  # acquire: the slot's metadata is written
            return None
        slot = self._recvd % inn.nslots
        return int(_META.unpack_from(self._mm, inn.meta_off + _META.size * slot)[3])

    def _irecv(self, nbytes: int, sink: Sink, dest: Any, tag: int) -> Request:
        self._check_open()
        if nbytes == 0:
            return DoneRequest(self.peer)
        if self._cma_min and not self._cma_me.load():
            self._probe_cma()
        req = _ShmRecv(self, nbytes, sink, dest, tag)
        self._recvs.append(req)
        return req

    def _take_small(self, out: memoryview, tag: int) -> bool:
        """With no receive queued: a message of ``out``'s size already whole in the
        oldest unread slot, copied now (what :meth:`_progress_recvs` would do);
        False: none there (or not of one slot: the queued receive deals with it).

        At any page offset: a send queued behind a full ring goes through
        ``put_pieces``, which writes at the source's page offset, and a receive
        that then declined it queued itself, which kept the ring full: a 1 KiB
        gather at n = 2 stayed at 10-13 us a call that way (2.7 taking it here)."""
        inn = self._in
        tail = self._recvd
        if inn.head.load() <= tail:  # acquire: the slot and its metadata are written
            return False
        slot = tail % inn.nslots
        n, o, addr, got = _META.unpack_from(self._mm, inn.meta_off + _META.size * slot)
        if got != tag:  # before any byte reaches ``out``
            raise tag_mismatch("shm", self.peer, got, tag)
        if n != out.nbytes or addr or o >= _PAGE:
            return False
        start = inn.base + slot * inn.stride + o
        out[:] = self._mm[start : start + n]
        self._recvd = tail + 1
        inn.tail.store(tail + 1)
        return True

    def _probe_cma(self) -> None:
        """Try one direct read of the peer's mapping; publish whether it worked."""
        addr = struct.unpack_from("<Q", self._mm, _MAPADDR_OFF[1 - self._side])[0]
        if not addr:
            return  # the peer has not published yet; try at the next receive
        got = np.zeros(1, np.uint64)
        try:
            _cma.read(self._peer_pid, addr, got.__array_interface__["data"][0], 8)
            ok = int(got[0]) == _MAGIC
        except OSError as exc:
            log.info("shm: direct reads from peer %d refused (%s); using slots", self.peer, exc)
            ok = False
        self._cma_me.store(1 if ok else 2)

    # ------------------------------------------------------------------ progress
    def _progress_sends(self) -> None:
        out = self._out
        tail = out.tail.load()
        acks = self._acks
        while acks and acks[0].need_tail <= tail:
            acks.popleft()._done = True
        if acks and acks[0].helps:
            self._help_send(acks[0])
        q = self._sends
        while q:
            req = q[0]
            src = req.src
            total = src.size
            head = self._sent
            described = None
            if req.off == 0 and self._sbuf is not None and req.addr:
                at = req.addr - self._sbuf_addr
                if 0 <= at <= self._sbuf.size - total:
                    described = (_IN_SBUF, at)  # the receiver reads it in place
            if described is None and req.off == 0 and req.direct and total >= self._cma_min > 0:
                if self._peer_can_read():
                    described = (0, req.addr)  # the receiver copies out of our memory
                    if req.copied and total >= HELP_MIN_BYTES and self._can_help():
                        described = (_HELPS, req.addr)  # and we write some of it
            if described is not None:
                if head - tail >= out.nslots:
                    return
                # A descriptor: the send completes when the receiver says so (tail
                # passes this slot).
                slot = head % out.nslots
                _META.pack_into(
                    self._mm, out.meta_off + _META.size * slot, total, *described, req.tag
                )
                head += 1
                out.head.store(head)
                self._sent = head
                req.off = total
                req.need_tail = head
                req.helps = described[0] == _HELPS
                acks.append(req)
                q.popleft()
                continue
            if self._ring_out is not None and self.compiled:  # the same, compiled (_ring.c)
                head, req.off = _ring.put_pieces(
                    self._ring_out, head, src, req.off, out.piece, req.tag, self.spins
                )
            while req.off < total and head - tail < out.nslots:
                n = min(out.piece, total - req.off)
                # same page offset as the source: see the module docstring
                o = (req.addr + req.off) % _PAGE
                self._write_slot(head, src[req.off : req.off + n], n, o, req.tag)
                head += 1
                req.off += n
            self._sent = head
            if req.off < total:
                return
            req._done = True
            q.popleft()

    def _can_help(self) -> bool:
        """Whether this side writes pieces of its large messages into the
        receiver's memory (:meth:`_help_send`): it can, by its own probe."""
        return self._helps and self._cma_me.load() == 1

    def _peer_can_read(self) -> bool:
        if not self._peer_reads_us:
            self._peer_reads_us = self._cma_peer.load() == 1
        return self._peer_reads_us

    def _progress_recvs(self) -> None:
        inn = self._in
        q = self._recvs
        while q:
            req = q[0]
            tail = self._recvd
            if req.dest is not None and self._ring_in is not None and self.compiled:
                # plain pieces into the receive's buffer, compiled (_ring.c)
                tail, req.off, _ = _ring.take_pieces(
                    self._ring_in, tail, req.dest, req.off, inn.piece, req.tag, self.spins
                )
            head = inn.head.load()
            while req.off < req.nbytes and tail < head:
                slot = tail % inn.nslots
                n, o, addr, tag = _META.unpack_from(self._mm, inn.meta_off + _META.size * slot)
                if tag != req.tag:  # before any byte reaches the sink
                    raise tag_mismatch("shm", self.peer, tag, req.tag)
                if o == _IN_SBUF or addr:
                    if o == _IN_SBUF:
                        self._take_shared(req, n, addr)
                    elif not self._read_direct(req, n, addr, tail, o == _HELPS):
                        break  # the sender still copies its pieces: at the next progress
                    tail += 1
                    inn.tail.store(tail)
                    req.off += n
                    continue
                want = min(inn.piece, req.nbytes - req.off)
                if n != want or o >= _PAGE:
                    raise TransportError(
                        f"shm: peer {self.peer} sent a {n}-byte piece where {want} were "
                        "expected (mismatched messages: do both ranks run the same collective?)",
                        peer=self.peer,
                        transport="shm",
                    )
                start = inn.base + slot * inn.stride + o
                req.sink(req.off, memoryview(inn.data[start : start + n]))  # type: ignore[arg-type]
                tail += 1
                inn.tail.store(tail)
                req.off += n
            self._recvd = tail
            if req.off < req.nbytes:
                return
            req._done = True
            q.popleft()

    def _take_shared(self, req: _ShmRecv, n: int, at: int) -> None:
        """Consume a descriptor of ``n`` bytes at offset ``at`` of the peer's shared
        send buffer: the sink reads them in place."""
        buf = self._rbuf if self._rbuf is not None else self._attach_rbuf()
        if n != req.nbytes - req.off or at + n > buf.size:
            raise TransportError(
                f"shm: peer {self.peer} described {n} bytes at {at} of its {buf.size}-byte "
                f"send buffer where {req.nbytes - req.off} were expected (mismatched messages?)",
                peer=self.peer,
                transport="shm",
            )
        req.sink(req.off, memoryview(buf[at : at + n]))  # type: ignore[arg-type]

    def _attach_rbuf(self) -> Any:
        handle = struct.unpack_from("<Q", self._mm, _SBUF_FD_OFF[1 - self._side])[0] - 1
        if handle < 0:
            raise TransportError(
                f"shm: peer {self.peer} described bytes in a shared send buffer it never made",
                peer=self.peer,
                transport="shm",
            )
        mm = _segment.attach(
            self._peer_pid,
            handle,
            magic=_SBUF_MAGIC,
            ident=self._ident,
            min_size=2 * _PAGE,
            peer=self.peer,
            transport="shm",
        )
        size = struct.unpack_from("<Q", mm, 8)[0]
        if _PAGE + size > len(mm):
            mm.close()
            raise TransportError(
                f"shm: the send buffer of peer {self.peer} says {size} bytes but maps "
                f"{len(mm) - _PAGE}",
                peer=self.peer,
                transport="shm",
            )
        self._rbuf_mm = mm
        self._rbuf = np.frombuffer(mm, np.uint8, size, _PAGE)
        log.debug("shm: mapped peer %d's shared send buffer (%d bytes)", self.peer, size)
        return self._rbuf

    def _read_direct(self, req: _ShmRecv, n: int, addr: int, tail: int, helps: bool) -> bool:
        """Consume descriptor ``tail`` (of the inbound ring): copy ``n`` bytes from
        the peer's address ``addr``; ``helps``: the sender offers to copy some
        (:meth:`_help_recv`).  False: this side's part is done and the sender's
        pieces are not yet; call again."""
        if req.help:
            return self._helped(req)
        if n != req.nbytes - req.off or self._cma_me.load() != 1:
            raise TransportError(
                f"shm: peer {self.peer} sent a {n}-byte direct-read descriptor where "
                f"{req.nbytes - req.off} bytes were expected (mismatched messages?)",
                peer=self.peer,
                transport="shm",
            )
        try:
            if req.dest is not None:
                to = req.dest[req.off : req.off + n].__array_interface__["data"][0]
                if helps and self._helps:
                    return self._help_recv(req, n, addr, to, (tail + 1) & _M32)
                _cma.read(self._peer_pid, addr, to, n)
                return True
            if self._temp is None:
                self._temp = np.empty(_CMA_TEMP + _PAGE, np.uint8)
            for sub in range(0, n, _CMA_TEMP):
                m = min(_CMA_TEMP, n - sub)
                # the same page offset as the source, as for slots
                o = (addr + sub) % _PAGE
                t = self._temp[o : o + m]
                _cma.read(self._peer_pid, addr + sub, t.__array_interface__["data"][0], m)
                req.sink(req.off + sub, memoryview(t))  # type: ignore[arg-type]
        except OSError as exc:
            raise self._cma_error("read", n, exc) from exc
        return True

    def _cma_error(self, what: str, n: int, exc: OSError) -> TransportError:
        cls = PeerClosedError if exc.errno == errno.ESRCH else TransportError
        return cls(
            f"shm: direct {what} of {n} bytes with peer {self.peer}: {exc.strerror}",
            peer=self.peer,
            transport="shm",
            errno=exc.errno,
        )

    def _help_recv(self, req: _ShmRecv, n: int, addr: int, to: int, ident: int) -> bool:
        """Copy ``n`` bytes from the peer's ``addr`` to ``to`` from both ends: say
        where they go (the copy's words, ``ident`` the descriptor's number), then
        take pieces until none is left; the sender takes others meanwhile
        (:meth:`_help_send`).  False: some of its pieces are still being written."""
        claim, done, dest = self._help_in
        _, pieces = help_pieces(n)
        req.help = (ident, pieces)  # (before the sender may write: see close)
        dest.store(to)
        done.store(ident << 32)
        claim.store(ident << 32)  # release: the address and the count are there first
        pid = self._peer_pid
        self._copy_pieces(
            self._help_at[0],
            ident,
            n,
            "read",
            lambda off, m: _cma.read(pid, addr + off, to + off, m),
        )
        return self._helped(req)

    def _copy_pieces(
        self, at: int, ident: int, n: int, what: str, copy: Callable[[int, int], None]
    ) -> None:
        """This side's part of copy ``ident`` of ``n`` bytes (its words at offset
        ``at``): take the next piece until none is left, ``copy(offset, length)``
        it and count it done.  Both ends run this, each with its own copy."""
        size, pieces = help_pieces(n)
        while (k := _ring.claim(self._mm, at, ident, pieces)) >= 0:
            off = k * size
            try:
                copy(off, min(size, n - off))
            except OSError as exc:
                raise self._cma_error(what, n, exc) from exc
            _ring.add(self._mm, at + 64, 1)

    def _helped(self, req: _ShmRecv) -> bool:
        """Whether every piece of ``req``'s copy from both ends is written."""
        assert req.help is not None
        ident, pieces = req.help
        if self._help_in[1].load() != (ident << 32) | pieces:
            return False
        req.help = None
        return True

    def _help_send(self, req: _ShmSend) -> None:
        """While the receiver copies large message ``req`` in place: write the
        pieces it has not taken into its buffer (:meth:`_help_recv`), if it
        asked for that copy."""
        dest, pid, src = self._help_dest, self._peer_pid, req.addr
        self._copy_pieces(
            self._help_at[1],
            req.need_tail & _M32,
            req.src.size,
            "write",  # (the address is read after each claim, which orders it)
            lambda off, m: _cma.write(pid, dest.load() + off, src + off, m),
        )

    def _end_help(self) -> None:
        """At close, before this side lets go of a receive's buffer: no further
        piece of a copy from both ends may land in it.  Take every piece left,
        then wait for those the sender took (while it lives, at most
        :data:`HELP_CLOSE_SECONDS`); past that, keep the buffer for good rather
        than let a late piece land in memory reused for something else."""
        req = self._recvs[0] if self._recvs else None
        if req is None or req.help is None:
            return
        ident, pieces = req.help
        at = self._help_at[0]
        written = pieces
        while _ring.claim(self._mm, at, ident, pieces) >= 0:
            written -= 1  # (taken here: never written)
        end = time.monotonic() + HELP_CLOSE_SECONDS
        while self._help_in[1].load() < (ident << 32) | written:
            gone = _segment.process_gone(self._peer_pid)
            if gone or time.monotonic() > end:
                if not gone:
                    _KEPT.append(req.dest)
                    log.warning(
                        "shm: peer %d may still write into a receive's buffer; it is kept",
                        self.peer,
                    )
                return
            time.sleep(1e-4)

    # ------------------------------------------------------------------ health
    def check_peer(self) -> None:
        # A peer may finish its last send and close (or exit) before we read the
        # bytes; while undelivered bytes wait in our inbound ring, it is not gone
        # (unless we wait for pieces it took of a copy from both ends).
        self._check_alive(self._bytes_wait)

    def check_incoming(self) -> None:
        self._check_alive(lambda: not self._recvs and self._in.head.load() > self._recvd)

    def _check_alive(self, there: Callable[[], bool]) -> None:
        self._check_open()  # closed under a pending request (abort): fail it, never spin
        _segment.check_alive(
            self._closed_peer,
            self._peer_pid,
            f"shm: peer {self.peer}",
            peer=self.peer,
            transport="shm",
            there=there,
        )

    def _bytes_wait(self) -> bool:
        """Whether the receive at the head of the queue has bytes in our inbound ring."""
        q = self._recvs
        return bool(q) and self._in.head.load() > self._recvd and q[0].help is None

    def mark_exiting(self) -> None:
        """At interpreter exit without close(): the peer sees "closed" (:mod:`transports._exit`)."""
        if not self._closed:
            self._closed_me.store(1)

    def _check_open(self) -> None:
        if self._closed:
            raise TransportError(
                f"shm connection to peer {self.peer} is closed", peer=self.peer, transport="shm"
            )

    def close_because(self, rank: int) -> None:
        """Close; the peer reads ``rank`` with our "closed" word (one store)."""
        self._cause = rank
        self.close()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        _exit.forget(self)
        try:
            self._closed_me.store(_segment.closed_word(self._cause))
        except ValueError:
            pass
        self._end_help()
        for c in (self._out.head, self._out.tail, self._in.head, self._in.tail):
            c.release_buffer()
        for c in (self._closed_peer, self._closed_me, self._cma_me, self._cma_peer):
            c.release_buffer()
        for c in (*self._help_in, self._help_dest):
            c.release_buffer()
        self._temp = None
        self._out.data = self._in.data = None  # type: ignore[assignment]
        self._sbuf = self._rbuf = None
        self._sends.clear()
        self._recvs.clear()
        self._acks.clear()
        for mm, what in (
            (self._mm, "segment"),
            (self._sbuf_mm, "shared send buffer"),
            (self._rbuf_mm, "peer's shared send buffer"),
        ):
            if mm is None:
                continue
            try:
                mm.close()
            except BufferError:  # a view escaped; the mapping goes with the process
                log.warning("shm: %s %s still has views; not unmapped", self._name, what)
        for fd in (self._handle, self._sbuf_fd):
            if fd >= 0:
                os.close(fd)
        self._handle = self._sbuf_fd = -1


class _ShmSend(QueuedRequest):
    def __init__(
        self, conn: ShmConnection, src: Any, tag: int, direct: bool = True, copied: bool = False
    ) -> None:
        super().__init__(conn, conn._progress_sends)
        self.src = src
        self.tag = tag
        # where the bytes sit (page offset of slot copies, descriptors); small
        # messages skip the lookup, which costs as much as their copy, unless this
        # side has a shared send buffer, which they may come from
        big = src.size >= _PAGE or conn._sbuf is not None
        self.addr = src.__array_interface__["data"][0] if big else 0
        self.off = 0
        self.need_tail = 0
        self.direct = direct  # may go by a direct-read descriptor (see isend_copied)
        self.copied = copied  # by isend_copied: the sender waits for it anyway
        self.helps = False  # described, offering to write pieces (_help_send)


class _ShmRecv(QueuedRequest):
    def __init__(
        self, conn: ShmConnection, nbytes: int, sink: Sink, dest: Any = None, tag: int = 0
    ) -> None:
        super().__init__(conn, conn._progress_recvs)
        self.tag = tag
        self.nbytes = nbytes
        self.sink = sink
        self.dest = dest
        self.off = 0
        self.help: tuple[int, int] | None = None  # a copy from both ends under way


assert PIECE_ALIGN <= _PAGE
