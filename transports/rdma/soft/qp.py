"""Queue pairs (``pyverbs.qp``): QPCap, QPInitAttr, QPAttr, QP.

Only RC QPs are emulated.  The state machine follows ``ibv_modify_qp``:
RESET -> INIT -> RTR -> RTS, any state -> ERR or RESET; a transition without
its required attributes, or one the table does not allow, fails with EINVAL.
``post_send`` needs RTS and ``post_recv`` anything but RESET (EINVAL, as
libmlx5 answers); posting to a QP in ERR succeeds and completes with
IBV_WC_WR_FLUSH_ERR.  The wire protocol lives in :mod:`transports.rdma.soft.rc`.
"""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from transports.rdma.soft import enums as e
from transports.rdma.soft.addr import AHAttr
from transports.rdma.soft.cq import CQ, WC
from transports.rdma.soft.memory import raw_view
from transports.rdma.soft.pyverbs_error import PyverbsRDMAError, PyverbsUserError
from transports.rdma.soft.wr import RecvWR, SendWR

if TYPE_CHECKING:
    from typing import Self  # 3.11; annotations only (3.10 has none)

    from transports.rdma.soft.engine import Link
    from transports.rdma.soft.pd import PD
    from transports.rdma.soft.rc import Requester, Responder

EINVAL = 22
ENOMEM = 12

_REQUIRED = {
    e.IBV_QPS_INIT: e.IBV_QP_PKEY_INDEX | e.IBV_QP_PORT | e.IBV_QP_ACCESS_FLAGS,
    e.IBV_QPS_RTR: e.IBV_QP_AV
    | e.IBV_QP_PATH_MTU
    | e.IBV_QP_DEST_QPN
    | e.IBV_QP_RQ_PSN
    | e.IBV_QP_MAX_DEST_RD_ATOMIC
    | e.IBV_QP_MIN_RNR_TIMER,
    e.IBV_QPS_RTS: e.IBV_QP_TIMEOUT
    | e.IBV_QP_RETRY_CNT
    | e.IBV_QP_RNR_RETRY
    | e.IBV_QP_SQ_PSN
    | e.IBV_QP_MAX_QP_RD_ATOMIC,
}
_ALLOWED = {
    (e.IBV_QPS_RESET, e.IBV_QPS_INIT),
    (e.IBV_QPS_INIT, e.IBV_QPS_INIT),
    (e.IBV_QPS_INIT, e.IBV_QPS_RTR),
    (e.IBV_QPS_RTR, e.IBV_QPS_RTS),
    (e.IBV_QPS_RTS, e.IBV_QPS_RTS),
}
_SUPPORTED_OPS = {
    e.IBV_WR_RDMA_WRITE,
    e.IBV_WR_RDMA_WRITE_WITH_IMM,
    e.IBV_WR_SEND,
    e.IBV_WR_SEND_WITH_IMM,
    e.IBV_WR_RDMA_READ,
}


class QPCap:
    def __init__(
        self,
        max_send_wr: int = 1,
        max_recv_wr: int = 10,
        max_send_sge: int = 1,
        max_recv_sge: int = 1,
        max_inline_data: int = 0,
    ) -> None:
        self.max_send_wr = max_send_wr
        self.max_recv_wr = max_recv_wr
        self.max_send_sge = max_send_sge
        self.max_recv_sge = max_recv_sge
        self.max_inline_data = max_inline_data


class QPInitAttr:
    def __init__(
        self,
        qp_type: int = e.IBV_QPT_UD,
        qp_context: object = None,
        scq: CQ | None = None,
        rcq: CQ | None = None,
        srq: object = None,
        cap: QPCap | None = None,
        sq_sig_all: int = 1,
    ) -> None:
        self.qp_type = qp_type
        self.qp_context = qp_context
        self.send_cq = scq
        self.recv_cq = rcq
        self.srq = srq
        self.cap = cap if cap is not None else QPCap()
        self.sq_sig_all = sq_sig_all


class QPAttr:
    """``ibv_qp_attr``; fields not given are zero, as in the C struct."""

    def __init__(
        self,
        qp_state: int = e.IBV_QPS_INIT,
        cur_qp_state: int = e.IBV_QPS_RESET,
        port_num: int = 1,
    ) -> None:
        self.qp_state = qp_state
        self.cur_qp_state = cur_qp_state
        self.port_num = port_num
        self.qp_access_flags = 0
        self.pkey_index = 0
        self.path_mtu = 0
        self.dest_qp_num = 0
        self.rq_psn = 0
        self.sq_psn = 0
        self.qkey = 0
        self.max_rd_atomic = 0
        self.max_dest_rd_atomic = 0
        self.min_rnr_timer = 0
        self.timeout = 0
        self.retry_cnt = 0
        self.rnr_retry = 0
        self.ah_attr = AHAttr()
        self.cap = QPCap()


@dataclass
class SendRec:
    """A posted send WR as the emulated NIC keeps it."""

    wr_id: int
    opcode: int
    sg: list[tuple[int, int, int]]
    imm: int
    rkey: int
    raddr: int
    signaled: bool
    inline: bytes | None = None
    psn: int = -1
    length: int = 0
    payload: list[memoryview] = field(default_factory=list)
    targets: list[tuple[object, int, int]] = field(default_factory=list)
    prepared: bool = False


@dataclass
class RecvRec:
    wr_id: int
    sg: list[tuple[int, int, int]]


class QP:
    """An RC queue pair: ``QP(pd, init_attr, qp_attr=None)``."""

    def __init__(self, creator: PD, init_attr: QPInitAttr, qp_attr: QPAttr | None = None) -> None:
        if init_attr.qp_type != e.IBV_QPT_RC:
            raise PyverbsRDMAError(
                "Failed to create QP (the soft provider emulates RC QPs only)", 95
            )
        if init_attr.send_cq is None or init_attr.recv_cq is None:
            raise PyverbsRDMAError(
                "Failed to create QP (send and receive CQs are required)", EINVAL
            )
        self.pd = creator
        self.ctx = creator.ctx
        self.engine = self.ctx.engine
        self.qp_type = init_attr.qp_type
        self.send_cq: CQ = init_attr.send_cq
        self.recv_cq: CQ = init_attr.recv_cq
        self.sq_sig_all = bool(init_attr.sq_sig_all)
        self.cap = init_attr.cap
        self.qp_num = self.ctx._new_qpn()
        self.qp_state = e.IBV_QPS_RESET
        self.attr = QPAttr(qp_state=e.IBV_QPS_RESET)
        self.sq: deque[SendRec] = deque()
        self.rq: deque[RecvRec] = deque()
        self._lock = threading.Lock()
        self._send_outstanding = 0
        self._parked: list[tuple[Link, int, bytes, int]] = []
        self.requester: Requester | None = None
        self.responder: Responder | None = None
        self._closed = False
        self.ctx.qps[self.qp_num] = self
        self.ctx._add_ref(self)
        if qp_attr is not None:
            self.to_init(qp_attr)

    # ------------------------------------------------------------------ state
    def _get_comp_mask(self, dst: str) -> int:
        key = {"INIT": e.IBV_QPS_INIT, "RTR": e.IBV_QPS_RTR, "RTS": e.IBV_QPS_RTS}[dst]
        return _REQUIRED[key] | e.IBV_QP_STATE

    def to_init(self, qp_attr: QPAttr) -> None:
        qp_attr.qp_state = e.IBV_QPS_INIT
        self._modify(qp_attr, self._get_comp_mask("INIT"), "Failed to modify QP state to init")

    def to_rtr(self, qp_attr: QPAttr) -> None:
        if self.qp_state != e.IBV_QPS_INIT:
            self.to_init(qp_attr)
        qp_attr.qp_state = e.IBV_QPS_RTR
        self._modify(qp_attr, self._get_comp_mask("RTR"), "Failed to modify QP state to RTR")

    def to_rts(self, qp_attr: QPAttr) -> None:
        if self.qp_state != e.IBV_QPS_RTR:
            self.to_rtr(qp_attr)
        qp_attr.qp_state = e.IBV_QPS_RTS
        self._modify(qp_attr, self._get_comp_mask("RTS"), "Failed to modify QP state to RTS")

    def modify(self, qp_attr: QPAttr, comp_mask: int) -> None:
        self._modify(qp_attr, comp_mask, "Failed to modify QP")

    def _modify(self, attr: QPAttr, mask: int, what: str) -> None:
        cur = self.qp_state
        new = attr.qp_state if mask & e.IBV_QP_STATE else cur
        if new in (e.IBV_QPS_ERR, e.IBV_QPS_RESET):
            self._copy_attrs(attr, mask)
            if new == e.IBV_QPS_ERR:
                self.qp_state = e.IBV_QPS_ERR
                self.engine.call_soon(lambda: self._to_error())
            else:
                self.qp_state = e.IBV_QPS_RESET
                self.engine.call_soon(self._reset)
            return
        need = _REQUIRED.get(new, 0) if new != cur else 0
        if (cur, new) not in _ALLOWED or (mask & need) != need:
            raise PyverbsRDMAError(f"{what} (returned {EINVAL})", EINVAL)
        if new == e.IBV_QPS_RTR and not (e.IBV_MTU_256 <= attr.path_mtu <= e.IBV_MTU_4096):
            raise PyverbsRDMAError(f"{what} (returned {EINVAL})", EINVAL)
        self._copy_attrs(attr, mask)
        self.qp_state = new
        if new == e.IBV_QPS_RTR and cur != new:
            self.engine.call_soon(self._on_rtr)
        elif new == e.IBV_QPS_RTS and cur != new:
            self.engine.call_soon(self._on_rts)

    def _copy_attrs(self, attr: QPAttr, mask: int) -> None:
        a = self.attr
        for bit, name in (
            (e.IBV_QP_ACCESS_FLAGS, "qp_access_flags"),
            (e.IBV_QP_PKEY_INDEX, "pkey_index"),
            (e.IBV_QP_PORT, "port_num"),
            (e.IBV_QP_AV, "ah_attr"),
            (e.IBV_QP_PATH_MTU, "path_mtu"),
            (e.IBV_QP_TIMEOUT, "timeout"),
            (e.IBV_QP_RETRY_CNT, "retry_cnt"),
            (e.IBV_QP_RNR_RETRY, "rnr_retry"),
            (e.IBV_QP_RQ_PSN, "rq_psn"),
            (e.IBV_QP_MAX_QP_RD_ATOMIC, "max_rd_atomic"),
            (e.IBV_QP_MIN_RNR_TIMER, "min_rnr_timer"),
            (e.IBV_QP_SQ_PSN, "sq_psn"),
            (e.IBV_QP_MAX_DEST_RD_ATOMIC, "max_dest_rd_atomic"),
            (e.IBV_QP_DEST_QPN, "dest_qp_num"),
        ):
            if mask & bit:
                setattr(a, name, getattr(attr, name))
        a.qp_state = self.qp_state

    def query(self, attr_mask: int) -> tuple[QPAttr, QPInitAttr]:
        self.attr.qp_state = self.qp_state
        init = QPInitAttr(
            self.qp_type,
            None,
            self.send_cq,
            self.recv_cq,
            None,
            self.cap,
            int(self.sq_sig_all),
        )
        return self.attr, init

    # ------------------------------------------------------------------ posting
    def post_send(self, wr: SendWR, bad_wr: SendWR | None = None) -> None:
        state = self.qp_state
        if state not in (e.IBV_QPS_RTS, e.IBV_QPS_ERR):
            raise PyverbsRDMAError(f"Failed to post send (returned {EINVAL})", EINVAL)
        sg = [(s.addr, s.length, s.lkey) for s in wr.sg[: wr.num_sge]]
        if (
            wr.opcode not in _SUPPORTED_OPS
            or len(sg) > self.cap.max_send_sge
            or len(sg) < wr.num_sge
        ):
            raise PyverbsRDMAError(f"Failed to post send (returned {EINVAL})", EINVAL)
        inline = None
        if wr.send_flags & e.IBV_SEND_INLINE and wr.opcode != e.IBV_WR_RDMA_READ:
            if sum(s[1] for s in sg) > self.cap.max_inline_data:
                raise PyverbsRDMAError(f"Failed to post send (returned {EINVAL})", EINVAL)
            inline = b"".join(bytes(raw_view(a, n)) for a, n, _ in sg)
        with self._lock:
            if self._send_outstanding >= self.cap.max_send_wr:
                raise PyverbsRDMAError(f"Failed to post send (returned {ENOMEM})", ENOMEM)
            self._send_outstanding += 1
        signaled = self.sq_sig_all or bool(wr.send_flags & e.IBV_SEND_SIGNALED)
        self.sq.append(
            SendRec(
                wr.wr_id,
                wr.opcode,
                sg,
                wr.imm_data,
                wr.rkey,
                wr.remote_addr,
                signaled,
                inline,
            )
        )
        self.engine.call_soon(self._kick)

    def post_recv(self, wr: RecvWR, bad_wr: RecvWR | None = None) -> None:
        if self.qp_state == e.IBV_QPS_RESET:
            raise PyverbsRDMAError(f"Failed to post recv (returned {EINVAL})", EINVAL)
        sg = [(s.addr, s.length, s.lkey) for s in wr.sg[: wr.num_sge]]
        if len(sg) > self.cap.max_recv_sge:
            raise PyverbsRDMAError(f"Failed to post recv (returned {EINVAL})", EINVAL)
        if len(self.rq) >= self.cap.max_recv_wr:
            raise PyverbsRDMAError(f"Failed to post recv (returned {ENOMEM})", ENOMEM)
        self.rq.append(RecvRec(wr.wr_id, sg))
        if self.qp_state == e.IBV_QPS_ERR:
            self.engine.call_soon(self._to_error)

    # ------------------------------------------------------------- completions
    def _complete_send(self, rec: SendRec, status: int) -> None:
        with self._lock:
            self._send_outstanding -= 1
        if status == e.IBV_WC_SUCCESS and not rec.signaled:
            return
        op = {
            e.IBV_WR_RDMA_WRITE: e.IBV_WC_RDMA_WRITE,
            e.IBV_WR_RDMA_WRITE_WITH_IMM: e.IBV_WC_RDMA_WRITE,
            e.IBV_WR_SEND: e.IBV_WC_SEND,
            e.IBV_WR_SEND_WITH_IMM: e.IBV_WC_SEND,
            e.IBV_WR_RDMA_READ: e.IBV_WC_RDMA_READ,
        }[rec.opcode]
        self.send_cq._push(
            WC(rec.wr_id, status, op, 0, rec.length, self.qp_num, self.attr.dest_qp_num)
        )

    def _complete_recv(
        self, rec: RecvRec, status: int, opcode: int, byte_len: int, imm: int | None
    ) -> None:
        flags = e.IBV_WC_WITH_IMM if imm is not None else 0
        self.recv_cq._push(
            WC(
                rec.wr_id,
                status,
                opcode,
                0,
                byte_len,
                self.qp_num,
                self.attr.dest_qp_num,
                imm or 0,
                flags,
            )
        )

    # ------------------------------------------------ progress thread callbacks
    def _kick(self) -> None:
        if self.qp_state == e.IBV_QPS_ERR:
            self._to_error()
        elif self.requester is not None:
            self.requester.pump()

    def _on_rtr(self) -> None:
        parked, self._parked = self._parked, []
        for link, src_qpn, src_gid, src_lid in parked:
            self._attach_inbound(link, src_qpn, src_gid, src_lid)

    def _on_rts(self) -> None:
        from transports.rdma.soft.rc import Requester

        if self.requester is None and self.qp_state == e.IBV_QPS_RTS:
            self.requester = Requester(self)
        self._kick()

    def _attach_inbound(self, link: Link, src_qpn: int, src_gid: bytes, src_lid: int) -> None:
        """A peer connected to this QP (progress thread)."""
        from transports.rdma.soft.rc import Responder

        state = self.qp_state
        if state in (e.IBV_QPS_RESET, e.IBV_QPS_INIT):
            self._parked.append((link, src_qpn, src_gid, src_lid))
            return
        ah = self.attr.ah_attr
        if (
            state not in (e.IBV_QPS_RTR, e.IBV_QPS_RTS)
            or self._closed
            or src_qpn != self.attr.dest_qp_num
            or src_gid != bytes(ah.dgid)
            or src_lid != ah.dlid
        ):
            link.close()  # not the peer this RC QP is connected to
            return
        if self.responder is not None:
            self.responder.link.close()
        self.responder = Responder(self, link)

    def _fail(self, rec: SendRec, status: int) -> None:
        """Complete ``rec`` with an error status and move the QP to ERR."""
        self._complete_send(rec, status)
        self._to_error()

    def _to_error(self, first_status: int | None = None) -> None:
        """Enter ERR: flush every outstanding WR (progress thread)."""
        self.qp_state = e.IBV_QPS_ERR
        self.attr.qp_state = e.IBV_QPS_ERR
        recs: list[SendRec] = []
        if self.requester is not None:
            recs.extend(self.requester.inflight)
            self.requester.inflight.clear()
            self.requester.finish()
        while self.sq:
            recs.append(self.sq.popleft())
        for i, rec in enumerate(recs):
            status = (
                first_status if (i == 0 and first_status is not None) else e.IBV_WC_WR_FLUSH_ERR
            )
            self._complete_send(rec, status)
        while self.rq:
            self._complete_recv(self.rq.popleft(), e.IBV_WC_WR_FLUSH_ERR, e.IBV_WC_RECV, 0, None)
        if self.responder is not None:
            self.responder.finish()
        for link, *_ in self._parked:
            link.close()
        self._parked.clear()

    def _reset(self) -> None:
        self._drop_links()
        self.sq.clear()
        self.rq.clear()
        with self._lock:
            self._send_outstanding = 0

    def _drop_links(self) -> None:
        for side in (self.requester, self.responder):
            if side is not None:
                side.link_close()
        self.requester = self.responder = None
        for link, *_ in self._parked:
            link.close()
        self._parked.clear()

    # ------------------------------------------------------------------ misc
    def close(self) -> None:
        """Destroy the QP; its connections close, so the peer QP sees an error."""
        if self._closed:
            return
        self._closed = True
        self.qp_state = e.IBV_QPS_RESET
        self.ctx.qps.pop(self.qp_num, None)
        if self.engine.in_thread():
            self._drop_links()
        else:
            self.engine.call_soon(self._drop_links)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


__all__ = ["QP", "PyverbsUserError", "QPAttr", "QPCap", "QPInitAttr"]
