"""The RDMA transport: RC queue pairs, credit flow control, WRITE WITH IMMEDIATE.

Per rank: one device context, protection domain and completion queue; one RC QP
per peer, created at :meth:`RdmaTransport.listen` so that the endpoint blob can
carry every QP number.  Each rank also registers a receive area: for every peer,
``nslots`` slots of ``slot_bytes`` that only that peer writes into.

Data path (sender s -> receiver r)::

    isend: copy piece -> s's staging slot k -> RDMA WRITE WITH IMM into r's slot k
           (imm: message sequence, last-piece flag, device flag, credits for
           s's own slots)                                 [needs one credit]
    r: CQ gives RECV_RDMA_WITH_IMM (slot k, byte_len) -> sink(offset, view of slot k)
       -> slot k free -> its credit rides on r's next data piece to s, or goes
       back as a zero-byte WRITE WITH IMM once half the slots are owed

A sender starts with ``nslots`` credits; a slot is reused only after the
receiver's sink has consumed it and the local write has completed.  Holding
back fewer than half the credits cannot stall a sender: while it has none left,
at least half the slots hold data that the receiver will consume (and owe)
once it posts the receive, which the flow-control rule requires anyway.  A
small message back and forth therefore costs one write each way, no credit
write.  Both sides
of a connection progress whenever any request of the transport is tested, so two
ranks that both isend large messages and then irecv never deadlock.

The memory path (``rdma_memory``: dmabuf, gdr, host) decides how *GPU* memory
becomes visible to the NIC (:meth:`RdmaTransport._register_device`: the device
slots and device staging); host slots and staging are host memory on every path.

Message tags (:meth:`Connection.isend`'s ``tag``) do not travel on this
transport yet: the 32 bits of immediate data hold the sequence, flags and
credits, and a slot header would change the slots' layout.  A receive checks a
message's sequence number and size only, so mismatched calls of the same size
are not caught here (pycoll's ``PYCOLL_CHECK=1`` still catches them).  A QP error becomes a
:class:`~transports.base.PeerClosedError` naming the peer and the work
completion status.

Closing says goodbye: a zero-byte WRITE WITH IMM flagged :data:`IMM_GOODBYE`,
after everything already posted, so the peer's receives fail at once with
:class:`~transports.base.PeerClosedError` once the bytes sent before it are
delivered (a hardware peer would otherwise learn only when it next sends and
its retries run out).  A rank that exits without closing sends it from its
exit hook (:mod:`transports._exit`).
"""

from __future__ import annotations

import logging
import random
import struct
import threading
import time
import zlib
from collections import deque
from dataclasses import dataclass
from typing import Any

from transports import _exit
from transports.base import (
    PIECE_ALIGN,
    BlobError,
    Cap,
    ConnectError,
    Connection,
    DeviceSink,
    DeviceSpan,
    DoneRequest,
    PeerClosedError,
    Request,
    Sink,
    Transport,
    TransportError,
    TransportOptions,
)
from transports.rdma import dmabuf, gdr, host
from transports.rdma.host import HostBuffer, Registration
from transports.rdma.verbs import open_verbs, soft_fabric

log = logging.getLogger(__name__)

# ------------------------------------------------------------------ blob format
#: Endpoint blob, little-endian, version 2:
#:   header  BLOB_HEADER  magic b"PCRD", version, provider (0 pyverbs, 1 soft),
#:           port, mtu (ibv_mtu), lid, rank, size, nslots, slot_bytes, rkey,
#:           slots base address, gid[16], fabric[16], device slots' rkey and
#:           base address (zeros when this rank has no device slots)
#:   entries BLOB_ENTRY x size: (qp_num, psn) of the QP this rank made for peer i
#:           (zeros for its own rank)
#:   trailer CRC-32 of everything before it
BLOB_MAGIC = b"PCRD"
BLOB_VERSION = 2
BLOB_HEADER = struct.Struct("<4sBBBBHxxIIIIIQ16s16sIxxxxQ")
BLOB_ENTRY = struct.Struct("<II")
BLOB_CRC = struct.Struct("<I")
PROVIDER_CODE = {"pyverbs": 0, "soft": 1}

IMM_CREDIT = 1 << 31  # a credit-only write: the low 16 bits are the count
IMM_GOODBYE = 1 << 30  # with IMM_CREDIT: the sender closed (or is exiting); nothing follows
IMM_LAST = 1 << 16
IMM_DEVICE = 1 << 17  # the piece is in the receiver's device slot, not its host slot
IMM_PIGGY_SHIFT = 18  # credits riding on a data piece: bits 18..30
IMM_PIGGY_MAX = (1 << 13) - 1
WR_DATA = 1 << 32
WR_CREDIT = 2 << 32
WR_RECV = 3 << 32
WR_GOODBYE = 4 << 32
#: How long close() waits for its goodbye to leave (the NIC may drop what a
#: destroyed QP still holds); the exit hook waits this long for all of them.
GOODBYE_WAIT = 0.1

MEMORY_PATHS = ("dmabuf", "gdr", "host")


@dataclass
class Endpoint:
    """A parsed endpoint blob (see the format above)."""

    provider: int
    port: int
    mtu: int
    lid: int
    rank: int
    size: int
    nslots: int
    slot_bytes: int
    rkey: int
    slots_addr: int
    gid: bytes
    fabric: bytes
    qps: list[tuple[int, int]]
    dev_rkey: int = 0
    dev_addr: int = 0

    def pack(self) -> bytes:
        head = BLOB_HEADER.pack(
            BLOB_MAGIC, BLOB_VERSION, self.provider, self.port, self.mtu, self.lid, self.rank, self.size,
            self.nslots, self.slot_bytes, self.rkey, self.slots_addr, self.gid, self.fabric,
            self.dev_rkey, self.dev_addr,
        )  # fmt: skip
        body = head + b"".join(BLOB_ENTRY.pack(q, p) for q, p in self.qps)
        return body + BLOB_CRC.pack(zlib.crc32(body))

    @classmethod
    def unpack(cls, blob: bytes) -> Endpoint:
        """Parse strictly; anything off raises :class:`BlobError`."""
        if not isinstance(blob, bytes | bytearray | memoryview):
            raise BlobError(
                f"rdma endpoint blob must be bytes, not {type(blob).__name__}",
                transport="rdma",
            )
        blob = bytes(blob)
        if len(blob) < BLOB_HEADER.size + BLOB_CRC.size:
            raise BlobError(f"rdma endpoint blob truncated ({len(blob)} bytes)", transport="rdma")
        fields = BLOB_HEADER.unpack_from(blob)
        magic, version = fields[0], fields[1]
        if magic != BLOB_MAGIC:
            raise BlobError(f"not an rdma endpoint blob (magic {magic!r})", transport="rdma")
        if version != BLOB_VERSION:
            raise BlobError(
                f"rdma endpoint blob version {version}, expected {BLOB_VERSION}",
                transport="rdma",
            )
        (
            _,
            _,
            provider,
            port,
            mtu,
            lid,
            rank,
            size,
            nslots,
            slot_bytes,
            rkey,
            slots_addr,
            gid,
            fabric,
            dev_rkey,
            dev_addr,
        ) = fields
        want = BLOB_HEADER.size + size * BLOB_ENTRY.size + BLOB_CRC.size
        if len(blob) != want:
            raise BlobError(
                f"rdma endpoint blob is {len(blob)} bytes, expected {want}",
                transport="rdma",
            )
        (crc,) = BLOB_CRC.unpack_from(blob, want - BLOB_CRC.size)
        if crc != zlib.crc32(blob[: want - BLOB_CRC.size]):
            raise BlobError("rdma endpoint blob checksum mismatch (corrupted)", transport="rdma")
        if (
            provider not in PROVIDER_CODE.values()
            or not 1 <= mtu <= 5
            or rank >= size
            or nslots < 1
            or slot_bytes < PIECE_ALIGN
            or slot_bytes % PIECE_ALIGN
        ):
            raise BlobError("rdma endpoint blob has out-of-range fields", transport="rdma")
        qps = [
            BLOB_ENTRY.unpack_from(blob, BLOB_HEADER.size + i * BLOB_ENTRY.size)
            for i in range(size)
        ]
        return cls(
            provider=provider, port=port, mtu=mtu, lid=lid, rank=rank, size=size, nslots=nslots,
            slot_bytes=slot_bytes, rkey=rkey, slots_addr=slots_addr, gid=gid, fabric=fabric, qps=qps,
            dev_rkey=dev_rkey, dev_addr=dev_addr,
        )  # fmt: skip


def _peer_index(owner: int, peer: int) -> int:
    """Index of ``peer``'s slot group inside ``owner``'s receive area (owner skipped)."""
    return peer if peer < owner else peer - 1


# ------------------------------------------------------------------ requests
class _ConnReq(Request):
    """A send or receive on one connection; testing it progresses the connection."""

    def __init__(self, conn: RdmaConnection, nbytes: int) -> None:
        self.peer = conn.peer
        self.conn = conn
        self.nbytes = nbytes
        self.seq = 0

    def _progress(self) -> bool:
        conn = self.conn
        conn._progress()
        if self._done:  # completed before the connection broke: still a success
            return True
        conn._raise_if_broken(self)
        return False

    def check_peer(self) -> None:
        self.conn._raise_if_broken(self)

    def block(self, seconds: float) -> None:
        """The idle hook of :func:`transports.base.idle_round`."""
        self.conn.tr.block(seconds)


class _SendReq(_ConnReq):
    def __init__(self, conn: RdmaConnection, data: memoryview | DeviceSpan) -> None:
        super().__init__(conn, data.nbytes if isinstance(data, DeviceSpan) else len(data))
        self.data = data
        self.posted = 0  # bytes handed to the NIC
        self.outstanding = 0  # writes not yet completed


class _RecvReq(_ConnReq):
    def __init__(
        self, conn: RdmaConnection, nbytes: int, sink: Sink | DeviceSink, device: bool = False
    ) -> None:
        super().__init__(conn, nbytes)
        self.sink = sink
        self.device = device
        self.received = 0


# ------------------------------------------------------------------ connection
class RdmaConnection(Connection):
    """One peer: its QP, the peer's slots we write into, our slots it writes into."""

    def __init__(self, tr: RdmaTransport, peer: int, qp: Any, remote: Endpoint) -> None:
        self.tr = tr
        self.peer = peer
        self.qp = qp
        self.qp_num = int(qp.qp_num)
        self.transport = f"rdma:{tr.memory_path}"
        e = tr.verbs.e
        self._e = e
        n, sb = tr.nslots, tr.slot_bytes
        self.nslots, self.slot_bytes = n, sb
        # where we write: the peer's slots for us
        self.remote_rkey = remote.rkey
        self.remote_base = remote.slots_addr + _peer_index(remote.rank, tr.rank) * n * sb
        # where the peer writes: our slots for it
        off = _peer_index(tr.rank, peer) * n * sb
        self.recv_view = tr.recv_area.view[off : off + n * sb]
        # send staging, registered once
        self.staging = HostBuffer(n * sb)
        self.staging_mr = host.register(
            tr.verbs, tr.pd, self.staging.addr, n * sb, e.IBV_ACCESS_LOCAL_WRITE
        )
        self.credits = n
        self.send_slot = 0
        self.staging_owner: list[_SendReq | None] = [None] * n
        self.sendq: deque[_SendReq] = deque()
        self.send_seq = 0
        self.sq_used = 0
        self.credits_to_return = 0
        self.recvq: deque[_RecvReq] = deque()
        self.recv_seq = 0
        self.recv_slot = 0
        self.arrivals: deque[tuple[int, int, int]] = deque()  # (slot, nbytes, imm)
        # consumed slots in arrival order, each with the CUDA event its device
        # sink's work must pass before the slot is handed back (None: free now)
        self.consumed: deque[Any] = deque()
        self.error: TransportError | None = None
        # the peer's goodbye: raised once every byte it sent before it is delivered
        self.goodbye: PeerClosedError | None = None
        self._bye = 0  # ours: 0 not sent, 1 posted, 2 completed (or failed)
        self.closed = False
        # device paths (dmabuf, gdr): our device slots for this peer, the peer's
        # device slots for us (when it has any) and device send staging
        if tr.memory_path in ("dmabuf", "gdr"):
            self.caps = Cap.DEVICE | Cap.SINK_STREAM
        self.device = tr.device
        # the stream handed to device sinks (set_sink_stream).  0 (the default):
        # the legacy default stream, and each piece's sink work is waited for.
        self._sink_stream = 0
        self.dev_recv_ptr = 0
        self.remote_dev_rkey = 0
        self.remote_dev_base = 0
        self.dev_staging: int = 0
        self.dev_staging_reg: Registration | None = None
        if Cap.DEVICE in self.caps:
            self.dev_recv_ptr = tr.dev_recv_ptr + off
            if remote.dev_rkey:
                self.remote_dev_rkey = remote.dev_rkey
                self.remote_dev_base = remote.dev_addr + _peer_index(remote.rank, tr.rank) * n * sb
                self.dev_staging = tr.cuda.alloc(n * sb)
                try:
                    self.dev_staging_reg = tr._register_device(
                        self.dev_staging, n * sb, e.IBV_ACCESS_LOCAL_WRITE
                    )
                except BaseException:
                    tr.cuda.free(self.dev_staging)
                    self.staging_mr.close()
                    self.staging.close()
                    raise

    # ------------------------------------------------------------ public verbs
    # A zero-byte message moves nothing and needs no peer: it completes at once,
    # even when the peer has already finished its work and closed (a fast rank
    # may close before a slow one posts its last, empty, message to it).
    def isend(self, data: memoryview, tag: int = 0) -> Request:
        # The tag does not travel yet: the immediate data has no room for it (see
        # the module docstring); a mismatch shows only where the sizes differ.
        mv = (
            memoryview(data).cast("B")
            if not isinstance(data, memoryview) or data.format != "B"
            else data
        )
        if len(mv) == 0 and not self.closed:
            return DoneRequest(self.peer)
        return self._queue_send(_SendReq(self, mv))

    def irecv(self, nbytes: int, sink: Sink, tag: int = 0) -> Request:
        if nbytes == 0 and not self.closed:
            return DoneRequest(self.peer)
        return self._queue_recv(_RecvReq(self, nbytes, sink))

    def isend_device(self, data: DeviceSpan) -> Request:
        """Post a send of device memory (paths dmabuf and gdr).

        Each piece is copied on ``data.stream`` (after the work queued there) into
        this connection's registered device staging and written from there into
        the peer's device slot; a peer without device slots gets it in its host
        slot instead (staged through this side's host staging).
        """
        if Cap.DEVICE not in self.caps:
            return super().isend_device(data)
        if data.nbytes == 0 and not self.closed:
            return DoneRequest(self.peer)
        return self._queue_send(_SendReq(self, data))

    def irecv_device(self, nbytes: int, sink: DeviceSink, device: int) -> Request:
        """Post a receive whose pieces reach ``sink`` as spans of this side's device
        slots (on the stream of :meth:`set_sink_stream`); a slot is reused only
        after the work the sink enqueued there has finished (a CUDA event)."""
        if Cap.DEVICE not in self.caps:
            return super().irecv_device(nbytes, sink, device)
        if device != self.device:
            raise TransportError(
                f"rdma device slots are on GPU {self.device}, not GPU {device}",
                peer=self.peer,
                transport=self.transport,
            )
        if nbytes == 0 and not self.closed:
            return DoneRequest(self.peer)
        return self._queue_recv(_RecvReq(self, nbytes, sink, device=True))

    def set_sink_stream(self, stream: int) -> None:
        """Hand device sinks ``stream``: a slot then goes back to the sender once a
        CUDA event recorded there after the sink's work has completed, instead
        of waiting for each piece's sink work at once."""
        if Cap.SINK_STREAM not in self.caps:
            super().set_sink_stream(stream)  # raises: the host path has no device sinks
        self._sink_stream = stream

    def _queue_send(self, req: _SendReq) -> Request:
        self._raise_if_broken()
        req.seq = self.send_seq
        self.send_seq = (self.send_seq + 1) & 0xFFFF
        self.sendq.append(req)
        self._progress()
        return req

    def _queue_recv(self, req: _RecvReq) -> Request:
        self._raise_if_broken(req)
        req.seq = self.recv_seq
        self.recv_seq = (self.recv_seq + 1) & 0xFFFF
        self.recvq.append(req)
        self._progress()
        return req

    def check_peer(self) -> None:
        self._raise_if_broken()

    def post_goodbye(self) -> bool:
        """Tell the peer that nothing more comes from here (a zero-byte write with
        :data:`IMM_GOODBYE`), after everything already posted; best effort.

        Its receives then fail with :class:`PeerClosedError` instead of waiting
        for their timeout: a hardware peer whose partner is gone learns it only
        when it next sends, and the soft provider only when the sockets close.
        Returns whether it was posted.
        """
        with self.tr._lock:
            if self.closed or self._bye or self.error is not None or self.goodbye is not None:
                return False
            if self.sq_used >= self.tr.max_send_wr:
                return False
            wr = self.tr.verbs.SendWR(
                wr_id=WR_GOODBYE,
                opcode=self._e.IBV_WR_RDMA_WRITE_WITH_IMM,
                num_sge=0,
                imm_data=IMM_CREDIT | IMM_GOODBYE,
            )
            wr.set_wr_rdma(self.remote_rkey, self.remote_base)
            try:
                self._post_send(wr)
            except TransportError:
                return False
            self._bye = 1
            return True

    def close(self) -> None:
        if self.closed:
            return
        if self.post_goodbye():
            self.tr.await_goodbyes([self], GOODBYE_WAIT)
        self.closed = True
        self.tr._forget(self)
        for obj in (self.qp, self.staging_mr, self.dev_staging_reg):
            try:
                if obj is not None:
                    obj.close()
            except Exception:  # already torn down with the context
                pass
        if self.dev_staging:
            try:
                self.tr.cuda.free(self.dev_staging)
            except Exception as exc:
                log.debug("rdma: freeing device staging: %s", exc)
            self.dev_staging = 0
        self.staging.close()
        if self.error is None:
            self.error = PeerClosedError(
                f"rdma connection to peer {self.peer} is closed",
                peer=self.peer,
                transport=self.transport,
            )

    # ------------------------------------------------------------ progress
    def _raise_if_broken(self, req: _ConnReq | None = None) -> None:
        """Raise the connection's error, or the peer's goodbye; but a receive
        (``req``) first gets the bytes that arrived before either, and after a
        goodbye a send already on the wire waits for its completion (the peer's
        ACK may trail its goodbye: the two travel unordered)."""
        if self.error is None and self.goodbye is None:
            return
        if self.arrivals and isinstance(req, _RecvReq) and not self.closed:
            return
        if self.error is not None:
            raise self.error
        if isinstance(req, _SendReq) and req.posted == req.nbytes:
            return
        raise self.goodbye  # type: ignore[misc]

    def _progress(self) -> None:
        """Take completions, deliver arrivals, post what flow control allows.

        Arrivals that completed before an error are still delivered, so a
        message the peer sent just before it closed is not lost; the error is
        raised by the requests it leaves unfinished.
        """
        self.tr._poll()
        self._deliver()
        if self.error is None:
            self._reap_slots()
            self._pump_sends()
            self._return_credits()

    def _fail(self, exc: TransportError) -> None:
        if self.error is None:
            self.error = exc
            log.debug("%s", exc)

    def _wc_error(self, wc: Any) -> TransportError:
        """The exception for a failed work completion: the peer, the status, a hint.

        Retry-exceeded and flush statuses mean the peer (or the path to it) is
        gone: :class:`PeerClosedError`.  Access and protocol statuses mean a
        request was refused (bad rkey, out of bounds, missing access rights):
        a plain :class:`TransportError`.
        """
        e = self._e
        status = int(wc.status)
        name = self.tr.verbs.wc_status_name(status)
        kind = {
            WR_DATA: "data write",
            WR_CREDIT: "credit write",
            WR_RECV: "receive",
            WR_GOODBYE: "goodbye write",
        }.get(wc.wr_id & ~0xFFFFFFFF, "request")
        hint = _WC_HINTS.get(name, "")
        msg = (
            f"rdma QP to peer {self.peer} failed: work completion {name} (status {status}) "
            f"on a {kind} (wr_id {wc.wr_id:#x}){': ' + hint if hint else ''}"
        )
        gone = status in (e.IBV_WC_RETRY_EXC_ERR, e.IBV_WC_RNR_RETRY_EXC_ERR, e.IBV_WC_WR_FLUSH_ERR)
        cls = PeerClosedError if gone else TransportError
        return cls(msg, peer=self.peer, transport=self.transport)

    def _on_wc(self, wc: Any) -> None:
        e = self._e
        if wc.status != e.IBV_WC_SUCCESS:
            if wc.wr_id & ~0xFFFFFFFF == WR_GOODBYE:
                self._bye = 2
            self._fail(self._wc_error(wc))
            return
        kind = wc.wr_id & ~0xFFFFFFFF
        if kind == WR_RECV:
            self._post_recv()
            imm = int(wc.imm_data)
            if imm & IMM_CREDIT:
                self.credits += imm & 0xFFFF
                if imm & IMM_GOODBYE and self.goodbye is None:
                    self.goodbye = PeerClosedError(
                        f"rdma: peer {self.peer} closed its connection",
                        peer=self.peer,
                        transport=self.transport,
                    )
            else:
                self.credits += (imm >> IMM_PIGGY_SHIFT) & IMM_PIGGY_MAX
                self.arrivals.append((self.recv_slot, int(wc.byte_len), imm))
                self.recv_slot = (self.recv_slot + 1) % self.nslots
        elif kind == WR_DATA:
            self.sq_used -= 1
            slot = wc.wr_id & 0xFFFF
            req = self.staging_owner[slot]
            self.staging_owner[slot] = None
            if req is not None:
                req.outstanding -= 1
                if req.outstanding == 0 and req.posted == req.nbytes:
                    req._done = True
        elif kind == WR_CREDIT:
            self.sq_used -= 1
        elif kind == WR_GOODBYE:
            self.sq_used -= 1
            self._bye = 2

    def _post_recv(self) -> None:
        self.qp.post_recv(self.tr.verbs.RecvWR(wr_id=WR_RECV | self.qp_num, num_sge=0))

    def _deliver(self) -> None:
        sb = self.slot_bytes
        flushed = False
        while self.arrivals and self.recvq:
            slot, n, imm = self.arrivals[0]
            req = self.recvq[0]
            last = bool(imm & IMM_LAST)
            end = req.received + n
            if (
                (imm & 0xFFFF) != req.seq
                or end > req.nbytes
                or last != (end == req.nbytes)
                or (not last and n != sb)
            ):
                self._fail(
                    TransportError(
                        f"rdma: message from peer {self.peer} does not match the posted receive "
                        f"(receive #{req.seq} of {req.nbytes} bytes, got piece of message #{imm & 0xFFFF}, "
                        f"{n} bytes at offset {req.received})",
                        peer=self.peer,
                        transport=self.transport,
                    )
                )
                raise self.error  # type: ignore[misc]
            self.arrivals.popleft()
            base = slot * sb
            in_device = bool(imm & IMM_DEVICE)
            event = None
            try:
                if req.device:
                    cuda = self.tr.cuda
                    ptr = self.dev_recv_ptr + base
                    if not in_device:  # the peer staged it through our host slot
                        host_addr = HostBuffer.address_of(self.recv_view[base : base + n])
                        cuda.copy_htod(ptr, host_addr, n, self._sink_stream)
                    elif self.tr.flusher is not None and not flushed:
                        # gdr: the NIC's writes must reach GPU memory before a kernel reads
                        # them; one READ flushes every piece that arrived before it
                        assert self.tr.dev_recv_reg is not None
                        self.tr.flusher.flush(self.tr.dev_recv_reg)
                        flushed = True
                    req.sink(req.received, DeviceSpan(ptr, n, self.device, self._sink_stream))  # type: ignore[arg-type]
                    if self._sink_stream:
                        event = cuda.record(self._sink_stream)
                    else:
                        # Nobody named the consumer's stream: the sink's work on the
                        # legacy stream is not ordered before a non-blocking stream's,
                        # so it is finished here.
                        cuda.synchronize(0)
                else:
                    view = self.recv_view[base : base + n]
                    if in_device:  # a device piece for a host receive: bring it over
                        self.tr.cuda.copy_dtoh(
                            HostBuffer.address_of(view), self.dev_recv_ptr + base, n, 0
                        )
                    req.sink(req.received, view)  # type: ignore[arg-type]
            except BaseException as exc:
                req._error = exc
                self.recvq.popleft()
                raise
            finally:
                self.consumed.append(event)
            req.received = end
            if last:
                self.recvq.popleft()
                req._done = True

    def _pump_sends(self) -> None:
        tr = self.tr
        verbs, e = tr.verbs, self._e
        sb = self.slot_bytes
        while self.sendq and self.credits > 0 and self.sq_used < tr.max_send_wr - 1:
            slot = self.send_slot
            if self.staging_owner[slot] is not None:
                return  # the write out of this staging slot has not completed yet
            req = self.sendq[0]
            n = min(sb, req.nbytes - req.posted)
            base = slot * sb
            last = req.posted + n == req.nbytes
            give = min(self.credits_to_return, IMM_PIGGY_MAX)
            imm = req.seq | (IMM_LAST if last else 0) | (give << IMM_PIGGY_SHIFT)
            rkey, raddr = self.remote_rkey, self.remote_base + base
            if isinstance(req.data, DeviceSpan):
                span = req.data
                src = span.ptr + req.posted
                if self.remote_dev_rkey and self.dev_staging_reg is not None:
                    tr.cuda.copy_dtod(self.dev_staging + base, src, n, span.stream)
                    reg = self.dev_staging_reg
                    sge = verbs.SGE(reg.addr + base, n, reg.lkey)
                    rkey, raddr = self.remote_dev_rkey, self.remote_dev_base + base
                    imm |= IMM_DEVICE
                else:  # the peer has host slots only
                    tr.cuda.copy_dtoh(self.staging.addr + base, src, n, span.stream)
                    sge = verbs.SGE(self.staging.addr + base, n, self.staging_mr.lkey)
            else:
                self.staging.view[base : base + n] = req.data[req.posted : req.posted + n]
                sge = verbs.SGE(self.staging.addr + base, n, self.staging_mr.lkey)
            wr = verbs.SendWR(
                wr_id=WR_DATA | slot,
                opcode=e.IBV_WR_RDMA_WRITE_WITH_IMM,
                num_sge=1,
                sg=[sge],
                imm_data=imm,
            )
            wr.set_wr_rdma(rkey, raddr)
            self._post_send(wr)
            self.credits_to_return -= give
            self.staging_owner[slot] = req
            req.outstanding += 1
            req.posted += n
            self.credits -= 1
            self.send_slot = (slot + 1) % self.nslots
            if last:
                self.sendq.popleft()

    def _reap_slots(self) -> None:
        """Consumed slots whose sink work is done become credits owed, in slot order
        (the peer reuses its slots round-robin)."""
        consumed = self.consumed
        while consumed and (consumed[0] is None or self.tr.cuda.done(consumed[0])):
            consumed.popleft()
            self.credits_to_return += 1

    def _return_credits(self) -> None:
        """Send owed credits on their own once half the slots are owed."""
        if self.credits_to_return < max(1, self.nslots // 2) or self.sq_used >= self.tr.max_send_wr:
            return
        e = self._e
        wr = self.tr.verbs.SendWR(
            wr_id=WR_CREDIT,
            opcode=e.IBV_WR_RDMA_WRITE_WITH_IMM,
            num_sge=0,
            imm_data=IMM_CREDIT | self.credits_to_return,
        )
        wr.set_wr_rdma(self.remote_rkey, self.remote_base)
        self._post_send(wr)
        self.credits_to_return = 0

    def _post_send(self, wr: Any) -> None:
        try:
            self.qp.post_send(wr)
        except Exception as exc:
            state = _qp_state_name(self.tr.verbs, self.qp)
            why = (
                f"the QP is in state {state}, not RTS"
                if state != "IBV_QPS_RTS"
                else "the send queue refused it"
            )
            self._fail(
                TransportError(
                    f"rdma post_send to peer {self.peer} failed: {why} ({exc})",
                    peer=self.peer,
                    transport=self.transport,
                    errno=getattr(exc, "error_code", None),
                )
            )
            raise self.error from exc  # type: ignore[misc]
        self.sq_used += 1


# ------------------------------------------------------------------ transport
class RdmaTransport(Transport):
    """RDMA over verbs (pyverbs or the soft provider).

    Options read from ``options.extra``: ``rdma_provider`` (auto, pyverbs, soft),
    ``rdma_memory`` (auto, dmabuf, gdr, host), ``rdma_device``, ``rdma_port``,
    ``rdma_gid_index``, ``rdma_gdr_level`` (PIX, PXB, PHB, NODE, SYS),
    ``rdma_gpu`` (CUDA device of this rank's device slots; default: the current
    CUDA context's device, else 0), ``soft_addr``,
    ``soft_caps`` (comma list: peermem, dmabuf).

    With the dmabuf or gdr path, :meth:`listen` also allocates device receive
    slots (``nslots`` x ``slot_bytes`` per peer, ``cuMemAlloc``) and registers
    them through that path; their rkey and address travel in the blob, and
    connections declare :attr:`~transports.base.Cap.DEVICE`.

    Args:
        options: as every transport.
        cuda: the CUDA access object (:class:`~transports.rdma.cuda.CudaDriver`
            or a stand-in with its methods); default: a CudaDriver, made only
            when a device path is chosen.
    """

    name = "rdma"

    def __init__(self, options: TransportOptions, *, cuda: Any = None) -> None:
        super().__init__(options)
        #: CUDA device of the device slots: ``rdma_gpu``, else the device of the
        #: CUDA context current when the path is chosen, else 0
        self.device = int(options.get("rdma_gpu", "0") or 0)
        self.cuda: Any = cuda
        self._own_cuda = cuda is None
        self.dev_recv_ptr = 0
        self.dev_recv_reg: Registration | None = None
        self.flusher: gdr.Flusher | None = None
        self.rank = options.rank
        self.size = options.size
        self.slot_bytes = max(PIECE_ALIGN, options.slot_bytes // PIECE_ALIGN * PIECE_ALIGN)
        self.nslots = max(1, min(options.nslots, 0x7FFF))
        self.max_send_wr = 2 * self.nslots + 8
        self.max_recv_wr = 2 * self.nslots + 8
        self.verbs: Any = None  # a Verbs once listen() ran
        self._blob: bytes | None = None
        self._conns: dict[int, RdmaConnection] = {}
        self._lock = threading.RLock()
        self._closed = False
        self.memory_path = "host"

    # ------------------------------------------------------------ setup
    def listen(self) -> bytes:
        if self._blob is not None:
            return self._blob
        opts = self.options
        try:
            verbs = self.verbs = open_verbs(opts)
            e = verbs.e
            self.ctx = verbs.open_context()
            self.pd = verbs.PD(self.ctx)
            cqe = (self.max_send_wr + self.max_recv_wr) * max(1, self.size - 1) + 16
            self.cq = verbs.CQ(self.ctx, cqe)
            self.port_num = int(opts.get("rdma_port", "1") or 1)
            port = self.ctx.query_port(self.port_num)
            self.lid = int(port.lid)
            self.mtu = int(port.active_mtu)
            self.gid_index = self._gid_index()
            self.gid = self.ctx.query_gid(self.port_num, self.gid_index)
            npeers = max(0, self.size - 1)
            area = npeers * self.nslots * self.slot_bytes
            self.recv_area = HostBuffer(area)
            access = e.IBV_ACCESS_LOCAL_WRITE | e.IBV_ACCESS_REMOTE_WRITE
            self.recv_mr = host.register(verbs, self.pd, self.recv_area.addr, max(area, 1), access)
            self.qps: dict[int, Any] = {}
            self.psns: dict[int, int] = {}
            rng = random.Random()
            for peer in range(self.size):
                if peer == self.rank:
                    continue
                cap = verbs.QPCap(
                    max_send_wr=self.max_send_wr,
                    max_recv_wr=self.max_recv_wr,
                    max_send_sge=1,
                    max_recv_sge=1,
                )
                init = verbs.QPInitAttr(
                    qp_type=e.IBV_QPT_RC,
                    scq=self.cq,
                    rcq=self.cq,
                    cap=cap,
                    sq_sig_all=1,
                )
                qp = verbs.QP(self.pd, init)
                attr = verbs.QPAttr()
                attr.qp_access_flags = access
                attr.port_num = self.port_num
                attr.pkey_index = 0
                qp.to_init(attr)
                for _ in range(self.max_recv_wr):
                    qp.post_recv(verbs.RecvWR(wr_id=WR_RECV | int(qp.qp_num), num_sge=0))
                self.qps[peer] = qp
                self.psns[peer] = rng.randrange(1 << 24)
        except TransportError:
            self.close()
            raise
        except Exception as exc:
            self.close()
            raise ConnectError(f"rdma setup failed: {exc}", transport="rdma") from exc
        self.memory_path = self._choose_memory_path()
        if self.memory_path in ("dmabuf", "gdr"):
            try:
                self._setup_device_slots()
            except Exception as exc:
                self.close()
                if isinstance(exc, TransportError):
                    raise
                raise ConnectError(
                    f"rdma:{self.memory_path} device slots could not be set up: {exc}",
                    transport="rdma",
                ) from exc
        fabric = (
            soft_fabric(verbs.context_kwargs["soft_addr"])
            if verbs.name == "soft"
            else self._hw_fabric()
        )
        ep = Endpoint(
            provider=PROVIDER_CODE[verbs.name], port=self.port_num, mtu=self.mtu, lid=self.lid, rank=self.rank,
            size=self.size, nslots=self.nslots, slot_bytes=self.slot_bytes, rkey=self.recv_mr.rkey,
            slots_addr=self.recv_mr.addr, gid=_gid_bytes(self.gid), fabric=fabric,
            qps=[(int(self.qps[p].qp_num), self.psns[p]) if p != self.rank else (0, 0) for p in range(self.size)],
            dev_rkey=self.dev_recv_reg.rkey if self.dev_recv_reg else 0,
            dev_addr=self.dev_recv_reg.addr if self.dev_recv_reg else 0,
        )  # fmt: skip
        self._blob = ep.pack()
        _exit.watch(self)
        where = f" at {verbs.context_kwargs['soft_addr']}" if verbs.name == "soft" else ""
        log.info(
            "rdma: rank %d listening via %s (%s)%s, lid %d, gid %s, memory path %s",
            self.rank, verbs.name, verbs.device, where, self.lid, _gid_bytes(self.gid).hex(),
            self.memory_path,
        )  # fmt: skip
        return self._blob

    def _setup_device_slots(self) -> None:
        """Device receive slots for every peer, registered through the memory path."""
        if self.cuda is None:
            from transports.rdma.cuda import CudaDriver

            self.cuda = CudaDriver(self.device)
        e = self.verbs.e
        area = max(0, self.size - 1) * self.nslots * self.slot_bytes
        self.dev_recv_ptr = self.cuda.alloc(area)
        access = e.IBV_ACCESS_LOCAL_WRITE | e.IBV_ACCESS_REMOTE_WRITE | e.IBV_ACCESS_REMOTE_READ
        self.dev_recv_reg = self._register_device(self.dev_recv_ptr, max(area, 1), access)
        if self.memory_path == "gdr":
            timeout = float(self.options.timeout)
            self.flusher = gdr.Flusher(
                self.verbs, self.ctx, self.pd, self.port_num, self.gid, self.lid, timeout
            )
        if self.verbs.name == "soft":
            log.info(
                "rdma: soft provider moves bytes to and from GPU %d with CUDA copies "
                "(rdma:%s is emulated, not DMA)",
                self.device,
                self.memory_path,
            )

    def _register_device(self, ptr: int, nbytes: int, access: int) -> Registration:
        """Register device memory: a dma-buf MR (dmabuf) or an MR on the CUDA pointer (gdr)."""
        if self.memory_path == "dmabuf":
            return dmabuf.register(self.verbs, self.pd, ptr, nbytes, access, self.cuda)
        return gdr.register(self.verbs, self.pd, ptr, nbytes, access)

    def _gid_index(self) -> int:
        wanted = self.options.get("rdma_gid_index", "auto")
        if wanted and wanted != "auto":
            return int(wanted)
        # prefer an IPv4-mapped (RoCE v2) GID, as NCCL does, else index 0
        for idx in range(16):
            try:
                raw = _gid_bytes(self.ctx.query_gid(self.port_num, idx))
            except Exception:
                break
            if raw[:12] == b"\0" * 10 + b"\xff\xff":
                return idx
        return 0

    def _hw_fabric(self) -> bytes:
        raw = _gid_bytes(self.gid)
        return (b"ib:" + raw[:8]).ljust(16, b"\0") if self.lid else b"roce".ljust(16, b"\0")

    def _choose_memory_path(self) -> str:
        """dmabuf, then gdr, then host (``rdma_memory=auto``), logging every refusal."""
        from transports.rdma import caps as capmod

        wanted = (self.options.get("rdma_memory", "auto") or "auto").lower()
        if wanted not in (*MEMORY_PATHS, "auto"):
            raise ConnectError(
                f"unknown rdma_memory {wanted!r}; use auto, dmabuf, gdr or host",
                transport="rdma",
            )
        if wanted == "host":
            return "host"
        verbs = self.verbs
        c = capmod.Capabilities()
        c.gpus, c.gpu_error = self.cuda.gpus() if self.cuda is not None else capmod.detect_gpus()
        if c.gpus and not self.options.get("rdma_gpu"):
            from transports.rdma.cuda import current_device

            self.device = current_device()
        soft_caps = (
            frozenset(verbs.context_kwargs.get("soft_caps", ()))
            if verbs.name == "soft"
            else frozenset()
        )
        if verbs.name == "pyverbs" and c.gpus:
            c.nics = [n for n in capmod.detect_nics() if n.name == verbs.device]
            for nic in c.nics:
                nic.dmabuf, nic.dmabuf_why = capmod.probe_nic_dmabuf(verbs, self.ctx, self.pd)
            c.peermem = capmod.peermem_file()
            for g in c.gpus:
                for nic in c.nics:
                    if nic.pci_path:
                        gpath = f"/sys/bus/pci/devices/{g.pci_bus_id}"
                        c.distances[(g.index, nic.name)] = capmod.pci_distance(gpath, nic.pci_path)
        statuses = capmod.memory_paths(
            c,
            provider=verbs.name,
            soft_caps=soft_caps,
            gdr_level=self.options.get("rdma_gdr_level", "PXB") or "PXB",
            gpu=self.device,
        )
        order = MEMORY_PATHS if wanted == "auto" else (wanted,)
        for st in statuses:
            if st.name not in order:
                continue
            if st.usable:
                log.info("rdma: memory path %s chosen: %s", st.name, st.reason)
                return st.name
            log.info("rdma: memory path %s refused: %s", st.name, st.reason)
        if wanted != "auto":
            raise ConnectError(
                f"rdma_memory={wanted} requested but unusable (see log)",
                transport="rdma",
            )
        return "host"

    def can_connect(self, local: bytes, peer: bytes) -> tuple[bool, str]:
        try:
            a, b = Endpoint.unpack(local), Endpoint.unpack(peer)
        except BlobError as exc:
            return False, str(exc)
        if a.provider != b.provider:
            return False, "one side uses pyverbs, the other the soft provider"
        if a.fabric != b.fabric:
            return (
                False,
                "the peer's RDMA port is on another fabric (or another network namespace)",
            )
        if (a.nslots, a.slot_bytes) != (b.nslots, b.slot_bytes):
            return False, "slot geometry differs between the ranks"
        if a.size != b.size:
            return False, "the blobs disagree on the job size"
        return True, "same RDMA fabric"

    def connect(self, peer_rank: int, peer: bytes) -> Connection:
        if self._blob is None:
            self.listen()
        remote = Endpoint.unpack(peer)
        if remote.rank != peer_rank or remote.size != self.size or peer_rank == self.rank:
            raise ConnectError(
                f"rdma blob of rank {remote.rank}/{remote.size} given for peer {peer_rank}/{self.size}",
                peer=peer_rank,
                transport="rdma",
            )
        ok, why = self.can_connect(self._blob, peer)  # type: ignore[arg-type]
        if not ok:
            raise ConnectError(
                f"rdma cannot reach peer {peer_rank}: {why}",
                peer=peer_rank,
                transport="rdma",
            )
        dest_qpn, dest_psn = remote.qps[self.rank]
        if dest_qpn == 0:
            raise BlobError(
                f"rdma blob of peer {peer_rank} has no QP for rank {self.rank}",
                peer=peer_rank,
            )
        verbs = self.verbs
        e = verbs.e
        qp = self.qps[peer_rank]
        attr = verbs.QPAttr()
        attr.qp_access_flags = e.IBV_ACCESS_LOCAL_WRITE | e.IBV_ACCESS_REMOTE_WRITE
        attr.port_num = self.port_num
        attr.path_mtu = min(self.mtu, remote.mtu)
        attr.dest_qp_num = dest_qpn
        attr.rq_psn = dest_psn
        attr.sq_psn = self.psns[peer_rank]
        attr.max_dest_rd_atomic = 1
        attr.max_rd_atomic = 1
        attr.min_rnr_timer = 12  # 0.64 ms
        attr.timeout = int(
            self.options.get("rdma_timeout", "20") or 20
        )  # 4.096 us * 2**20 ~ 4 s per try
        attr.retry_cnt = 7
        attr.rnr_retry = 7  # credits make RNR impossible; retry forever if it happens anyway
        gr = verbs.GlobalRoute(dgid=verbs.GID(_gid_str(remote.gid)), sgid_index=self.gid_index)
        attr.ah_attr = verbs.AHAttr(port_num=self.port_num, is_global=1, dlid=remote.lid, gr=gr)
        try:
            qp.to_rtr(attr)
            qp.to_rts(attr)
        except Exception as exc:
            raise ConnectError(
                f"rdma: QP to peer {peer_rank} failed to reach RTS: {exc}",
                peer=peer_rank,
                transport="rdma",
            ) from exc
        conn = RdmaConnection(self, peer_rank, qp, remote)
        with self._lock:
            self._conns[conn.qp_num] = conn
        return conn

    # ------------------------------------------------------------ progress
    def _poll(self) -> None:
        with self._lock:
            while True:
                n, wcs = self.cq.poll(32)
                for wc in wcs:
                    conn = self._conns.get(int(wc.qp_num))
                    if conn is not None:
                        conn._on_wc(wc)
                if n < 32:
                    return

    def block(self, seconds: float) -> None:
        """Wait up to ``seconds`` for the CQ to have something (requests' idle hook).

        The soft provider's CQ can be waited on (its NIC work then runs in this
        thread); with pyverbs this is a plain sleep.
        """
        cq = getattr(self, "cq", None)
        if cq is None or self._closed or self.verbs.name != "soft":
            time.sleep(seconds)
        else:
            cq.wait(seconds)

    def await_goodbyes(self, conns: list[RdmaConnection], seconds: float) -> None:
        """Progress until the goodbyes of ``conns`` have left, at most ``seconds``."""
        end = time.monotonic() + seconds
        while any(c._bye == 1 and c.error is None for c in conns) and time.monotonic() < end:
            self._poll()
            self.block(1e-3)

    def mark_exiting(self) -> None:
        """At interpreter exit without close(): every peer gets our goodbye
        (:mod:`transports._exit`); nothing is freed."""
        if self._closed:
            return
        conns = [c for c in list(self._conns.values()) if c.post_goodbye()]
        self.await_goodbyes(conns, GOODBYE_WAIT)

    def _forget(self, conn: RdmaConnection) -> None:
        with self._lock:
            self._conns.pop(conn.qp_num, None)
            self.qps.pop(conn.peer, None)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        _exit.forget(self)
        for conn in list(self._conns.values()):
            conn.close()
        for name in ("qps",):
            for qp in getattr(self, name, {}).values():
                qp.close()
        for name in ("flusher", "dev_recv_reg", "recv_mr", "cq", "pd", "ctx"):
            obj = getattr(self, name, None)
            if obj is not None:
                try:
                    obj.close()
                except Exception as exc:  # keep releasing the rest
                    log.debug("rdma: closing %s: %s", name, exc)
        area = getattr(self, "recv_area", None)
        if area is not None:
            area.close()
        if self.cuda is not None:
            try:
                if self.dev_recv_ptr:
                    self.cuda.free(self.dev_recv_ptr)
                    self.dev_recv_ptr = 0
                if self._own_cuda:
                    self.cuda.close()
            except Exception as exc:
                log.debug("rdma: releasing CUDA memory: %s", exc)


#: What a failed work completion usually means, for the error message.
_WC_HINTS = {
    "IBV_WC_REM_ACCESS_ERR": "the peer refused the RDMA access (wrong rkey, out of the "
    "registered bounds, or no remote access right); nothing was written",
    "IBV_WC_REM_INV_REQ_ERR": "the peer refused the request as invalid",
    "IBV_WC_REM_OP_ERR": "the peer could not complete the operation",
    "IBV_WC_LOC_PROT_ERR": "a local buffer is not covered by its memory region (lkey)",
    "IBV_WC_LOC_LEN_ERR": "a message is longer than the posted receive",
    "IBV_WC_RETRY_EXC_ERR": "the peer stopped answering (process gone, QP destroyed, "
    "or the path to it down)",
    "IBV_WC_RNR_RETRY_EXC_ERR": "the peer had no receive posted for too long",
    "IBV_WC_WR_FLUSH_ERR": "the QP is in the error state (the peer went away or an "
    "earlier request failed)",
}


def _qp_state_name(verbs: Any, qp: Any) -> str:
    """The QP's state as ``IBV_QPS_*`` (``?`` when it cannot be queried)."""
    try:
        state = int(qp.qp_state)
    except Exception:
        try:
            attr, _ = qp.query(verbs.e.IBV_QP_STATE)
            state = int(attr.qp_state)
        except Exception:
            return "?"
    return str(verbs.e.name_of("IBV_QPS_", state))


def _gid_bytes(gid: Any) -> bytes:
    """16 raw bytes of a pyverbs or soft GID (its ``gid`` is the colon hex form)."""
    text = str(gid.gid if hasattr(gid, "gid") else gid)
    raw = bytes.fromhex(text.replace(":", ""))
    if len(raw) != 16:
        raise BlobError(f"unexpected GID {text!r}")
    return raw


def _gid_str(raw: bytes) -> str:
    h = raw.hex()
    return ":".join(h[i : i + 4] for i in range(0, 32, 4))
