"""The RC wire protocol of the soft provider (runs on the progress thread).

Each connected QP pair uses two TCP streams: the *requester* stream that a QP
opens to its peer carries its requests and brings back ACKs, NAKs and READ
responses; the *responder* stream the peer opened carries the peer's requests.
Every request carries a PSN; the responder executes requests in PSN order and
acknowledges them (ACKs are coalesced per batch of reads).  The target side
checks rkey, PD, access flags and bounds *before* a byte is written, so a bad
request writes nothing and is answered with a NAK.  Receiver-not-ready is
go-back-N as on the wire: the responder NAKs the PSN and drops what follows
until that PSN comes again; the requester waits the responder's RNR timer and
resends everything outstanding from that PSN, up to ``rnr_retry`` times (7 means
forever).
"""

from __future__ import annotations

import errno
import hmac
import struct
from collections import deque
from typing import TYPE_CHECKING

from transports.rdma.soft import engine as eng
from transports.rdma.soft import enums as e
from transports.rdma.soft.engine import Link, hello

if TYPE_CHECKING:
    from transports.rdma.soft.mr import MR
    from transports.rdma.soft.qp import QP, SendRec

#: request header: opcode, PSN, rkey, immediate, remote address, length
REQ = struct.Struct("<BxxxIIIQQ")
#: response header: kind, PSN, syndrome (RNR timer), length (READ responses)
RESP = struct.Struct("<BxxxIII")

OP_WRITE, OP_WRITE_IMM, OP_SEND, OP_SEND_IMM, OP_READ = 1, 2, 3, 4, 5
ACK, NAK_RNR, NAK_ACCESS, NAK_INVALID, NAK_OPERATION, NAK_SEQ, READ_RESP = (
    1,
    2,
    3,
    4,
    5,
    6,
    7,
)

_WIRE_OP = {
    e.IBV_WR_RDMA_WRITE: OP_WRITE,
    e.IBV_WR_RDMA_WRITE_WITH_IMM: OP_WRITE_IMM,
    e.IBV_WR_SEND: OP_SEND,
    e.IBV_WR_SEND_WITH_IMM: OP_SEND_IMM,
    e.IBV_WR_RDMA_READ: OP_READ,
}
_NAK_STATUS = {
    NAK_ACCESS: e.IBV_WC_REM_ACCESS_ERR,
    NAK_INVALID: e.IBV_WC_REM_INV_REQ_ERR,
    NAK_OPERATION: e.IBV_WC_REM_OP_ERR,
    NAK_SEQ: e.IBV_WC_RETRY_EXC_ERR,
}
#: IB "RNR NAK timer" field -> seconds (index 0 is the longest, 655.36 ms)
RNR_DELAY = [
    655.36, 0.01, 0.02, 0.03, 0.04, 0.06, 0.08, 0.12, 0.16, 0.24, 0.32, 0.48, 0.64, 0.96, 1.28, 1.92,
    2.56, 3.84, 5.12, 7.68, 10.24, 15.36, 20.48, 30.72, 40.96, 61.44, 81.92, 122.88, 163.84, 245.76,
    327.68, 491.52,
]  # fmt: skip
PSN_MASK = 0xFFFFFF
#: How long a QP whose peer ended its request stream still waits for the
#: responses to its own requests, which come on the other stream
#: (:meth:`Responder.on_link_lost`); twice what the peer's close may spend
#: sending what it queued (``engine.CLOSE_FLUSH``).
RESPONSE_GRACE = 1.0


def _psn_le(a: int, b: int) -> bool:
    """a <= b in 24-bit serial arithmetic."""
    return ((b - a) & PSN_MASK) < 0x800000


class Requester:
    """Sends a QP's work requests and matches the responses."""

    def __init__(self, qp: QP) -> None:
        self.qp = qp
        self.engine = qp.engine
        self.inflight: deque[SendRec] = deque()
        self.next_psn = qp.attr.sq_psn & PSN_MASK
        self.rnr_left = qp.attr.rnr_retry
        self.rnr_wait = False
        self.link: Link | None = None
        self.ready = False  # the handshake on ``link`` is done: requests may go
        self._hdr = bytearray(RESP.size)
        a = qp.attr
        # Transport timer: connect attempts to an unreachable host are retried for
        # timeout * (retry_cnt + 1) (4.096 us * 2**timeout each; 0 means forever),
        # then the WRs fail with IBV_WC_RETRY_EXC_ERR as on a real HCA whose peer
        # never answers.  A refused connection (the peer's port is closed) fails
        # at once.
        per_try = 4.096e-6 * (1 << a.timeout) if a.timeout else None
        self._connect_budget = None if per_try is None else max(1.0, per_try * (a.retry_cnt + 1))
        self._connect_spent = 0.0
        self._connect()

    # ----------------------------------------------------------------- connect
    def _connect(self) -> None:
        """Connect to the peer's context and run the handshake (see :mod:`.engine`)."""
        qp = self.qp
        ah = qp.attr.ah_attr
        host = ah.dgid.ipv4() if ah.is_global else None
        self.ready = False
        link = self.link = self.engine.connect(host or "127.0.0.1", ah.dlid, self)
        buf = bytearray(eng.CHALLENGE.size)
        link.expect(memoryview(buf), lambda: self._on_challenge(link, buf))
        self.engine.call_later(eng.HANDSHAKE_SECONDS, lambda: self._handshake_expired(link))

    def _on_challenge(self, link: Link, buf: bytearray) -> None:
        magic, version, nonce = eng.CHALLENGE.unpack(buf)
        if magic != eng.CHALLENGE_MAGIC or version != eng.HELLO_VERSION:
            link.lost(
                ConnectionError(f"the peer's port sent no soft RDMA challenge ({bytes(magic)!r})")
            )
            return
        qp = self.qp
        greeting = hello(
            qp.ctx.secret, nonce, qp.attr.dest_qp_num, qp.qp_num, bytes(qp.ctx.gid), qp.ctx.lid
        )
        want = eng.ack(qp.ctx.secret, greeting[-32:])
        got = bytearray(eng.ACK.size)
        link.expect(memoryview(got), lambda: self._on_ack(link, got, want))
        link.send(greeting)

    def _on_ack(self, link: Link, got: bytearray, want: bytes) -> None:
        if not hmac.compare_digest(bytes(got), want):
            link.lost(ConnectionError("the peer's port answered without the job's secret"))
            return
        self.ready = True
        link.expect(memoryview(self._hdr), self._on_resp)
        self.pump()

    def _handshake_expired(self, link: Link) -> None:
        if link is self.link and not self.ready and not link.closed:
            link.lost(TimeoutError(f"no handshake within {eng.HANDSHAKE_SECONDS:g} s"))

    def on_link_lost(self, link: Link, exc: BaseException | None) -> None:
        if link is not self.link or self.qp.qp_state == e.IBV_QPS_ERR:
            return
        # A context listens from its creation until it closes, before its address
        # is ever published: a refused connection means the peer is gone, so the
        # QP fails at once.  An unreachable host may be a network still coming up.
        unreachable = isinstance(exc, OSError) and exc.errno in (
            errno.EHOSTUNREACH,
            errno.ENETUNREACH,
        )
        if (
            unreachable
            and not link.established
            and (self._connect_budget is None or self._connect_spent < self._connect_budget)
        ):
            self._connect_spent += 0.05
            self.link = None
            self.engine.call_later(0.05, self._retry_connect)
            return
        self.link = None
        self.qp._to_error(e.IBV_WC_RETRY_EXC_ERR)

    def _retry_connect(self) -> None:
        if self.qp.qp_state == e.IBV_QPS_RTS and self.link is None and not self.qp._closed:
            self._connect()
            self.pump()

    def after_read(self) -> None:
        pass

    # ------------------------------------------------------------------ send
    def pump(self) -> None:
        """Transmit queued WRs (progress thread)."""
        qp = self.qp
        if qp.qp_state == e.IBV_QPS_ERR:
            qp._to_error()
            return
        if self.link is None or self.rnr_wait or not self.ready:
            return
        while qp.sq and qp.qp_state == e.IBV_QPS_RTS:
            rec = qp.sq.popleft()
            status = self._prepare(rec)
            if status != e.IBV_WC_SUCCESS:
                qp._fail(rec, status)
                return
            rec.psn = self.next_psn
            self.next_psn = (self.next_psn + 1) & PSN_MASK
            self.inflight.append(rec)
            self._transmit(rec)

    def _prepare(self, rec: SendRec) -> int:
        """Resolve the local SGEs (lkey, PD, bounds, access) once."""
        if rec.prepared:
            return e.IBV_WC_SUCCESS
        mrs = self.qp.ctx.mrs
        is_read = rec.opcode == e.IBV_WR_RDMA_READ
        for addr, n, lkey in rec.sg:
            mr: MR | None = mrs.get(lkey)  # type: ignore[assignment]
            if mr is None or mr.pd is not self.qp.pd or not mr.contains(addr, n):
                if rec.inline is None:
                    return e.IBV_WC_LOC_PROT_ERR
                continue
            if is_read:
                if not mr.access & e.IBV_ACCESS_LOCAL_WRITE:
                    return e.IBV_WC_LOC_PROT_ERR
                rec.targets.append((mr, addr - mr.iova, n))
            elif rec.inline is None:
                rec.payload.append(mr.memory.read(addr - mr.iova, n))
        if rec.inline is not None:
            rec.payload = [memoryview(rec.inline)]
        rec.length = sum(n for _, n, _ in rec.sg)
        rec.prepared = True
        return e.IBV_WC_SUCCESS

    def _transmit(self, rec: SendRec) -> None:
        assert self.link is not None
        hdr = REQ.pack(_WIRE_OP[rec.opcode], rec.psn, rec.rkey, rec.imm, rec.raddr, rec.length)
        if rec.opcode == e.IBV_WR_RDMA_READ:
            self.link.send(hdr)
        else:
            self.link.send(hdr, *rec.payload)

    # ------------------------------------------------------------- responses
    def _ack_through(self, psn: int, inclusive: bool) -> None:
        """Complete inflight WRs up to ``psn`` (ACKs are cumulative)."""
        inflight = self.inflight
        while inflight:
            rec = inflight[0]
            if rec.psn == psn and not inclusive:
                return
            if not _psn_le(rec.psn, psn):
                return
            inflight.popleft()
            self.qp._complete_send(rec, e.IBV_WC_SUCCESS)

    def _on_resp(self) -> None:
        kind, psn, syndrome, length = RESP.unpack(self._hdr)
        link = self.link
        assert link is not None
        next_hdr = memoryview(self._hdr)
        if kind == ACK:
            self.rnr_left = self.qp.attr.rnr_retry
            self._ack_through(psn, inclusive=True)
            link.expect(next_hdr, self._on_resp)
            self.pump()
            return
        self._ack_through(psn, inclusive=False)  # everything before it is implicitly acknowledged
        rec = self.inflight[0] if self.inflight else None
        if rec is None or rec.psn != psn:
            self.qp._to_error(e.IBV_WC_BAD_RESP_ERR)
            return
        if kind == READ_RESP:
            self._read_into(rec, list(rec.targets), length)
            return
        if kind == NAK_RNR:
            if self.qp.attr.rnr_retry != 7:
                self.rnr_left -= 1
                if self.rnr_left < 0:
                    self.inflight.popleft()
                    self.qp._fail(rec, e.IBV_WC_RNR_RETRY_EXC_ERR)
                    return
            self.rnr_wait = True
            link.expect(next_hdr, self._on_resp)
            self.engine.call_later(RNR_DELAY[syndrome & 31] / 1000.0, self._resend)
            return
        self.inflight.popleft()
        self.qp._fail(rec, _NAK_STATUS.get(kind, e.IBV_WC_BAD_RESP_ERR))

    def _read_into(self, rec: SendRec, targets: list[tuple[object, int, int]], left: int) -> None:
        link = self.link
        assert link is not None
        if left == 0 or not targets:
            self.inflight.popleft()
            self.qp._complete_send(rec, e.IBV_WC_SUCCESS)
            link.discard(left, lambda: link.expect(memoryview(self._hdr), self._on_resp))
            return
        mr, off, n = targets.pop(0)
        n = min(n, left)
        view, commit = mr.memory.write_target(off, n)  # type: ignore[attr-defined]

        def placed() -> None:
            if commit is not None:
                commit()
            self._read_into(rec, targets, left - n)

        link.expect(view, placed)

    def _resend(self) -> None:
        self.rnr_wait = False
        if self.qp.qp_state != e.IBV_QPS_RTS or self.link is None or not self.ready:
            return
        for rec in self.inflight:
            self._transmit(rec)
        self.pump()

    def finish(self) -> None:
        if self.link is not None:
            self.link.finish()

    def link_close(self) -> None:
        if self.link is not None:
            self.link.close()


class Responder:
    """Executes the peer's requests against this context's memory regions."""

    def __init__(self, qp: QP, link: Link) -> None:
        self.qp = qp
        self.link = link
        self.epsn = qp.attr.rq_psn & PSN_MASK
        self.rnr_psn: int | None = None
        self.seq_nak_sent = False
        self.ack_due: int | None = None
        self._hdr = bytearray(REQ.size)
        link.owner = self
        link.expect(memoryview(self._hdr), self._on_req)
        link.resume()

    def _next(self) -> None:
        self.link.expect(memoryview(self._hdr), self._on_req)

    def _respond(
        self,
        kind: int,
        psn: int,
        syndrome: int = 0,
        length: int = 0,
        data: memoryview | None = None,
    ) -> None:
        self.after_read()
        self.link.send(RESP.pack(kind, psn, syndrome, length), *(() if data is None else (data,)))

    def after_read(self) -> None:
        if self.ack_due is not None:
            psn, self.ack_due = self.ack_due, None
            self.link.send(RESP.pack(ACK, psn, 0, 0))

    def on_link_lost(self, link: Link, exc: BaseException | None) -> None:
        """The peer's request stream ended: it destroyed its QP, or its process is gone.

        The responses to *our* requests come back on the other stream, and nothing
        orders the two (two sockets, each read when the selector lists it): ACKs
        the peer sent before it closed may still be unread.  A real HCA acknowledges
        a request when it places it, whatever the peer's process does next, so such
        requests succeed.  With requests in flight the QP therefore waits for that
        stream: its own end (the peer closed both) fails what is still unanswered,
        and :data:`RESPONSE_GRACE` bounds the wait should it stay open.  With none,
        the QP fails at once, so a receive from a peer that is gone is flushed.
        """
        qp = self.qp
        if qp.responder is not self or qp.qp_state == e.IBV_QPS_ERR:
            return
        req = qp.requester
        rlink = req.link if req is not None and req.inflight else None
        if rlink is not None and rlink.established and not rlink.closed:
            qp.engine.call_later(RESPONSE_GRACE, self._peer_gone)
            return
        qp._to_error(e.IBV_WC_RETRY_EXC_ERR)

    def _peer_gone(self) -> None:
        qp = self.qp
        if qp.responder is self and not qp._closed and qp.qp_state != e.IBV_QPS_ERR:
            qp._to_error(e.IBV_WC_RETRY_EXC_ERR)

    def finish(self) -> None:
        self.after_read()
        self.link.finish()

    def link_close(self) -> None:
        self.link.close()

    # --------------------------------------------------------------- requests
    def _on_req(self) -> None:
        op, psn, rkey, imm, raddr, length = REQ.unpack(self._hdr)
        payload = 0 if op == OP_READ else length
        if self.rnr_psn is not None:
            if psn != self.rnr_psn:
                self.link.discard(payload, self._next)  # go-back-N: wait for the NAKed PSN
                return
            self.rnr_psn = None
        elif psn != self.epsn:
            if not self.seq_nak_sent:
                self.seq_nak_sent = True
                self._respond(NAK_SEQ, psn)
            self.link.discard(payload, self._next)
            return
        qp = self.qp
        if qp.qp_state not in (e.IBV_QPS_RTR, e.IBV_QPS_RTS):
            self.link.discard(payload, self._next)
            return
        if op == OP_WRITE:
            self._write(psn, raddr, rkey, length, None)
        elif op == OP_WRITE_IMM:
            if not qp.rq:
                self._rnr(psn, payload)
            else:
                self._write(psn, raddr, rkey, length, imm)
        elif op in (OP_SEND, OP_SEND_IMM):
            if not qp.rq:
                self._rnr(psn, payload)
            else:
                self._send(psn, length, imm if op == OP_SEND_IMM else None)
        elif op == OP_READ:
            self._read(psn, raddr, rkey, length)
        else:
            self._error(psn, payload, NAK_INVALID)

    def _rnr(self, psn: int, payload: int) -> None:
        self.rnr_psn = psn
        self._respond(NAK_RNR, psn, syndrome=self.qp.attr.min_rnr_timer)
        self.link.discard(payload, self._next)

    def _error(self, psn: int, payload: int, nak: int) -> None:
        """Answer a bad request: nothing is written, the NAK goes out, the QP enters ERR."""
        self._respond(nak, psn)
        self.link.discard(payload, self._next)
        self.qp._to_error()

    def _target(self, rkey: int, raddr: int, n: int, need: int) -> tuple[MR | None, int]:
        """The MR an incoming RDMA may touch, or (None, NAK kind)."""
        qp = self.qp
        if not qp.attr.qp_access_flags & need:
            return None, NAK_INVALID
        mr: MR | None = qp.ctx.mrs.get(rkey)  # type: ignore[assignment]
        if mr is None or mr.pd is not qp.pd or not mr.access & need or not mr.contains(raddr, n):
            return None, NAK_ACCESS
        return mr, 0

    def _done(self, psn: int) -> None:
        self.epsn = (psn + 1) & PSN_MASK
        self.ack_due = psn
        self._next()

    def _write(self, psn: int, raddr: int, rkey: int, n: int, imm: int | None) -> None:
        qp = self.qp

        def placed(commit: object = None) -> None:
            if commit is not None:
                commit()  # type: ignore[operator]
            if imm is not None:
                qp._complete_recv(
                    qp.rq.popleft(),
                    e.IBV_WC_SUCCESS,
                    e.IBV_WC_RECV_RDMA_WITH_IMM,
                    n,
                    imm,
                )
            self._done(psn)

        if n == 0:  # a zero-length write checks no key
            self.link.expect(memoryview(b""), placed)
            return
        mr, nak = self._target(rkey, raddr, n, e.IBV_ACCESS_REMOTE_WRITE)
        if mr is None:
            self._error(psn, n, nak)
            return
        view, commit = mr.memory.write_target(raddr - mr.iova, n)
        self.link.expect(view, lambda: placed(commit))

    def _send(self, psn: int, n: int, imm: int | None) -> None:
        qp = self.qp
        recv = qp.rq[0]
        pieces: list[tuple[memoryview, object]] = []
        room = 0
        for addr, ln, lkey in recv.sg:
            mr: MR | None = qp.ctx.mrs.get(lkey)  # type: ignore[assignment]
            if (
                mr is None
                or mr.pd is not qp.pd
                or not mr.contains(addr, ln)
                or not mr.access & e.IBV_ACCESS_LOCAL_WRITE
            ):
                qp.rq.popleft()
                qp._complete_recv(recv, e.IBV_WC_LOC_PROT_ERR, e.IBV_WC_RECV, 0, None)
                self._error(psn, n, NAK_OPERATION)
                return
            take = min(ln, n - room)
            if take > 0:
                pieces.append(mr.memory.write_target(addr - mr.iova, take))
            room += ln
        if room < n:
            qp.rq.popleft()
            qp._complete_recv(recv, e.IBV_WC_LOC_LEN_ERR, e.IBV_WC_RECV, 0, None)
            self._error(psn, n, NAK_INVALID)
            return

        def scatter() -> None:
            if pieces:
                view, commit = pieces.pop(0)

                def placed() -> None:
                    if commit is not None:
                        commit()  # type: ignore[operator]
                    scatter()

                self.link.expect(view, placed)
                return
            qp._complete_recv(qp.rq.popleft(), e.IBV_WC_SUCCESS, e.IBV_WC_RECV, n, imm)
            self._done(psn)

        scatter()

    def _read(self, psn: int, raddr: int, rkey: int, n: int) -> None:
        data = memoryview(b"")
        if n:
            mr, nak = self._target(rkey, raddr, n, e.IBV_ACCESS_REMOTE_READ)
            if mr is None:
                self._error(psn, 0, nak)
                return
            data = mr.memory.read(raddr - mr.iova, n)
        self._respond(READ_RESP, psn, length=n, data=data)
        self.epsn = (psn + 1) & PSN_MASK
        self._next()
