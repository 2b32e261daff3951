"""An RDMA connection's data path: credit flow control over WRITE WITH IMMEDIATE.

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
write.  Both sides of a connection progress whenever any request of the
transport is tested, so two ranks that both isend large messages and then
irecv never deadlock.

Message tags (:meth:`Connection.isend`'s ``tag``) travel in the host slots: the
32 bits of immediate data hold the sequence, flags and credits, so a host slot
starts with a :data:`HOST_HEAD`-byte head whose last 8 bytes are the tag, and
the same write carries the tag and the piece (``slot_bytes - HOST_HEAD`` bytes
of data at most).  A receive checks each piece's sequence number, size and tag
(:class:`~transports.base.TagMismatchError` before any byte reaches the sink),
and :meth:`RdmaConnection.probe` reads the tag of the oldest arrival no receive
took.  A piece bound for the peer's device slot has its tag written ahead of
it, 8 bytes into the head of the same slot's host side (a plain RDMA WRITE:
writes on one QP land in order, so the tag is there when the piece's
immediate arrives), and the receive checks it as a host piece's.
A QP error becomes a :class:`~transports.base.PeerClosedError` naming the peer
and the work completion status.

Closing says goodbye: a zero-byte WRITE WITH IMM flagged :data:`IMM_GOODBYE`,
after everything already posted, so the peer's receives fail at once with
:class:`~transports.base.PeerClosedError` once the bytes sent before it are
delivered (a hardware peer would otherwise learn only when it next sends and
its retries run out).  A rank that exits without closing sends it from its
exit hook (:mod:`transports._exit`).  A goodbye carries no credits: its low
bits (:data:`IMM_BYE_CAUSE`) hold the rank that the sender closes because of
plus one (:meth:`RdmaConnection.close_because`), 0 when it gives no reason, and
the peer's error carries that rank as ``cause_rank``.
"""

from __future__ import annotations

import logging
import struct
from collections import deque
from typing import TYPE_CHECKING, Any

from transports.base import (
    PIECE_ALIGN,
    Cap,
    Connection,
    DeviceSink,
    DeviceSpan,
    DoneRequest,
    PeerClosedError,
    Request,
    Sink,
    TransportError,
    tag_mismatch,
)
from transports.rdma import host
from transports.rdma.host import HostBuffer, Registration

if TYPE_CHECKING:
    from transports.rdma.transport import Endpoint, RdmaTransport

log = logging.getLogger(__name__)

IMM_CREDIT = 1 << 31  # a credit-only write: the low 16 bits are the count
IMM_GOODBYE = 1 << 30  # with IMM_CREDIT: the sender closed (or is exiting); nothing follows
IMM_BYE_CAUSE = IMM_GOODBYE - 1  # in a goodbye: 1 + the rank it closed because of, or 0
IMM_LAST = 1 << 16
IMM_DEVICE = 1 << 17  # the piece is in the receiver's device slot, not its host slot
IMM_PIGGY_SHIFT = 18  # credits riding on a data piece: bits 18..30
IMM_PIGGY_MAX = (1 << 13) - 1
WR_DATA = 1 << 32
WR_CREDIT = 2 << 32
WR_RECV = 3 << 32
WR_GOODBYE = 4 << 32
WR_TAG = 5 << 32  # the tag ahead of a device piece
#: A host slot's head: the data of a piece written there starts this far in,
#: and the message's tag (8 bytes) sits just before it, so one write carries
#: both, with 8 bytes more on the wire.  Device slots carry data only.
HOST_HEAD = PIECE_ALIGN
_TAG = struct.Struct("<Q")
TAG_AT = HOST_HEAD - _TAG.size
#: How long close() waits for its goodbye to leave (the NIC may drop what a
#: destroyed QP still holds); the exit hook waits this long for all of them.
GOODBYE_WAIT = 0.1


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
    def __init__(self, conn: RdmaConnection, data: memoryview | DeviceSpan, tag: int = 0) -> None:
        super().__init__(conn, data.nbytes if isinstance(data, DeviceSpan) else len(data))
        self.data = data
        self.tag = tag
        self.posted = 0  # bytes handed to the NIC
        self.outstanding = 0  # writes not yet completed


class _RecvReq(_ConnReq):
    def __init__(
        self,
        conn: RdmaConnection,
        nbytes: int,
        sink: Sink | DeviceSink,
        device: bool = False,
        tag: int = 0,
    ) -> None:
        super().__init__(conn, nbytes)
        self.sink = sink
        self.device = device
        self.tag = tag
        self.received = 0


# ------------------------------------------------------------------ connection
class RdmaConnection(Connection):
    """One peer: its QP, the peer's slots we write into, our slots it writes into."""

    #: and Cap.DEVICE | Cap.SINK_STREAM on the dmabuf and gdr paths
    caps = Cap.PROBE

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
            self.caps |= Cap.DEVICE | Cap.SINK_STREAM
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
        mv = (
            memoryview(data).cast("B")
            if not isinstance(data, memoryview) or data.format != "B"
            else data
        )
        if len(mv) == 0 and not self.closed:
            return DoneRequest(self.peer)
        return self._queue_send(_SendReq(self, mv, tag))

    def irecv(self, nbytes: int, sink: Sink, tag: int = 0) -> Request:
        if nbytes == 0 and not self.closed:
            return DoneRequest(self.peer)
        return self._queue_recv(_RecvReq(self, nbytes, sink, tag=tag))

    def probe(self) -> int | None:
        """The tag in the host slot of the oldest arrival that no receive took:
        with no receive posted, every earlier message was taken whole, so that
        arrival is the first piece of the next message.  A piece in a device slot
        carries no tag; its message is reported as tag 0 (device sends take none).
        Progresses the connection (polls the completion queue) first."""
        if self.closed:
            self._raise_if_broken()  # closed here: its error says so
        self._progress()
        if self.recvq:
            return None
        if not self.arrivals:
            self._raise_if_broken()  # the peer's goodbye, or this side's error
            return None
        slot = self.arrivals[0][0]
        return int(_TAG.unpack_from(self.recv_view, slot * self.slot_bytes + TAG_AT)[0])

    def isend_device(self, data: DeviceSpan, tag: int = 0) -> Request:
        """Post a send of device memory (paths dmabuf and gdr).

        Each piece is copied on ``data.stream`` (after the work queued there) into
        this connection's registered device staging and written from there into
        the peer's device slot; a peer without device slots gets it in its host
        slot instead (staged through this side's host staging).  ``tag`` goes
        with every piece (ahead of a device piece: the module's docstring).
        """
        if Cap.DEVICE not in self.caps:
            return super().isend_device(data)
        if data.nbytes == 0 and not self.closed:
            return DoneRequest(self.peer)
        return self._queue_send(_SendReq(self, data, tag))

    def irecv_device(self, nbytes: int, sink: DeviceSink, device: int, tag: int = 0) -> Request:
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
        return self._queue_recv(_RecvReq(self, nbytes, sink, device=True, tag=tag))

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

    def check_incoming(self) -> None:
        if not self.closed and not self.recvq:
            self._progress()
            if self.arrivals and not self.recvq:
                return  # a message that arrived before the goodbye or the break
        self._raise_if_broken()

    def post_goodbye(self, cause: int | None = None) -> bool:
        """Tell the peer that nothing more comes from here (a zero-byte write with
        :data:`IMM_GOODBYE`), after everything already posted; best effort.

        Its receives then fail with :class:`PeerClosedError` instead of waiting
        for their timeout: a hardware peer whose partner is gone learns it only
        when it next sends, and the soft provider only when the sockets close.
        ``cause``: the rank this side closes because of, which the peer's error
        names (``cause_rank``).  Returns whether it was posted.
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
                imm_data=IMM_CREDIT | IMM_GOODBYE | (0 if cause is None else cause + 1),
            )
            wr.set_wr_rdma(self.remote_rkey, self.remote_base)
            try:
                self._post_send(wr)
            except TransportError:
                return False
            self._bye = 1
            return True

    def close_because(self, rank: int) -> None:
        """Close; the goodbye names ``rank`` (see the module docstring)."""
        self._close(rank)

    def close(self) -> None:
        self._close(None)

    def _close(self, cause: int | None) -> None:
        if self.closed:
            return
        if self.post_goodbye(cause):
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
        bye = self.goodbye
        if self.error is not None:
            if bye is not None and bye.cause_rank is not None and not self.closed:
                raise bye  # the QP broke after a goodbye that said why: the reason wins
            raise self.error
        if isinstance(req, _SendReq) and req.posted == req.nbytes:
            return
        raise bye  # type: ignore[misc]

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
            WR_TAG: "tag write",
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
                if not imm & IMM_GOODBYE:
                    self.credits += imm & 0xFFFF
                elif self.goodbye is None:
                    cause = (imm & IMM_BYE_CAUSE) - 1
                    why = f" because rank {cause} failed" if cause >= 0 else ""
                    self.goodbye = PeerClosedError(
                        f"rdma: peer {self.peer} closed its connection{why}",
                        peer=self.peer,
                        transport=self.transport,
                        cause_rank=cause if cause >= 0 else None,
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
        elif kind in (WR_CREDIT, WR_TAG):
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
            in_device = bool(imm & IMM_DEVICE)
            if not in_device:
                n -= _TAG.size  # the write carried the tag before the data
            last = bool(imm & IMM_LAST)
            end = req.received + n
            if (
                (imm & 0xFFFF) != req.seq
                or n <= 0
                or end > req.nbytes
                or last != (end == req.nbytes)
                or (not last and n != (sb if in_device else sb - HOST_HEAD))
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
            base = slot * sb
            # a host piece's data follows the slot's head; a device piece for a host
            # receive is brought over to the start of the (idle) host slot
            hbase = base if in_device else base + HOST_HEAD
            # (a device piece's tag came ahead of it, to the same place)
            tag = int(_TAG.unpack_from(self.recv_view, base + TAG_AT)[0])
            if tag != req.tag:  # before any byte reaches the sink
                self._fail(tag_mismatch(self.transport, self.peer, tag, req.tag))
                raise self.error  # type: ignore[misc]
            self.arrivals.popleft()
            event = None
            try:
                if req.device:
                    cuda = self.tr.cuda
                    ptr = self.dev_recv_ptr + base
                    if not in_device:  # the peer staged it through our host slot
                        host_addr = HostBuffer.address_of(self.recv_view[hbase : hbase + n])
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
                    view = self.recv_view[hbase : hbase + n]
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
            data = req.data
            to_device = (
                isinstance(data, DeviceSpan)
                and self.remote_dev_rkey != 0
                and self.dev_staging_reg is not None
            )
            n = min(sb if to_device else sb - HOST_HEAD, req.nbytes - req.posted)
            base = slot * sb
            last = req.posted + n == req.nbytes
            give = min(self.credits_to_return, IMM_PIGGY_MAX)
            imm = req.seq | (IMM_LAST if last else 0) | (give << IMM_PIGGY_SHIFT)
            if to_device:
                assert isinstance(data, DeviceSpan) and self.dev_staging_reg is not None
                if self.sq_used >= tr.max_send_wr - 2:
                    return  # room for the tag's write and the piece's
                # the tag, ahead of the piece, into the head of the peer's host slot
                _TAG.pack_into(self.staging.view, base + TAG_AT, req.tag)
                tag_wr = verbs.SendWR(
                    wr_id=WR_TAG | slot,
                    opcode=e.IBV_WR_RDMA_WRITE,
                    num_sge=1,
                    sg=[
                        verbs.SGE(
                            self.staging.addr + base + TAG_AT, _TAG.size, self.staging_mr.lkey
                        )
                    ],
                )
                tag_wr.set_wr_rdma(self.remote_rkey, self.remote_base + base + TAG_AT)
                self._post_send(tag_wr)
                tr.cuda.copy_dtod(self.dev_staging + base, data.ptr + req.posted, n, data.stream)
                reg = self.dev_staging_reg
                sge = verbs.SGE(reg.addr + base, n, reg.lkey)
                rkey, raddr = self.remote_dev_rkey, self.remote_dev_base + base
                imm |= IMM_DEVICE
            else:
                # into the peer's host slot: the tag, then the data (see HOST_HEAD)
                _TAG.pack_into(self.staging.view, base + TAG_AT, req.tag)
                at = base + HOST_HEAD
                if isinstance(data, DeviceSpan):  # the peer has host slots only
                    tr.cuda.copy_dtoh(self.staging.addr + at, data.ptr + req.posted, n, data.stream)
                else:
                    self.staging.view[at : at + n] = data[req.posted : req.posted + n]
                sge = verbs.SGE(
                    self.staging.addr + base + TAG_AT, _TAG.size + n, self.staging_mr.lkey
                )
                rkey, raddr = self.remote_rkey, self.remote_base + base + TAG_AT
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
