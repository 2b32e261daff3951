"""Completion queue and work completion (``pyverbs.cq``)."""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING

from transports.rdma.soft import enums as e
from transports.rdma.soft.pyverbs_error import PyverbsRDMAError

if TYPE_CHECKING:
    from typing import Self  # 3.11; annotations only (3.10 has none)

    from transports.rdma.soft.device import Context


class WC:
    """A work completion (``ibv_wc``)."""

    __slots__ = (
        "byte_len",
        "dlid_path_bits",
        "imm_data",
        "opcode",
        "pkey_index",
        "qp_num",
        "sl",
        "slid",
        "src_qp",
        "status",
        "vendor_err",
        "wc_flags",
        "wr_id",
    )  # fmt: skip

    def __init__(
        self,
        wr_id: int = 0,
        status: int = 0,
        opcode: int = 0,
        vendor_err: int = 0,
        byte_len: int = 0,
        qp_num: int = 0,
        src_qp: int = 0,
        imm_data: int = 0,
        wc_flags: int = 0,
        pkey_index: int = 0,
        slid: int = 0,
        sl: int = 0,
        dlid_path_bits: int = 0,
    ) -> None:
        self.wr_id = wr_id
        self.status = status
        self.opcode = opcode
        self.vendor_err = vendor_err
        self.byte_len = byte_len
        self.qp_num = qp_num
        self.src_qp = src_qp
        self.imm_data = imm_data
        self.wc_flags = wc_flags
        self.pkey_index = pkey_index
        self.slid = slid
        self.sl = sl
        self.dlid_path_bits = dlid_path_bits

    def __repr__(self) -> str:
        return (
            f"WC(wr_id={self.wr_id}, status={e.wc_status_name(self.status)}, opcode={self.opcode}, "
            f"byte_len={self.byte_len}, qp_num={self.qp_num}, imm_data={self.imm_data:#x})"
        )


class CQ:
    """A completion queue of up to ``cqe`` entries, polled without blocking.

    Completions are produced by the context's progress thread; ``poll`` only
    takes what is there, as ``ibv_poll_cq`` does.  An overrun (more than
    ``cqe`` unpolled completions) is an asynchronous error on a real HCA; here
    the queue grows and nothing is lost.
    """

    def __init__(
        self,
        creator: Context,
        cqe: int,
        cq_context: object = None,
        channel: object = None,
        comp_vector: int = 0,
    ) -> None:
        if cqe <= 0:
            raise PyverbsRDMAError("Failed to create CQ", 22)
        self.context = creator
        self.cqe = cqe
        self.cq_context = cq_context
        self._wcs: deque[WC] = deque()
        self._closed = False
        creator._add_ref(self)

    def poll(self, num_entries: int = 1) -> tuple[int, list[WC]]:
        """Take up to ``num_entries`` completions: ``(count, [WC, ...])``.

        An empty queue first lets the calling thread run the NIC's ready work
        (as a provider's poll does), so a polling thread sees a completion
        without waiting for the progress thread to wake up.
        """
        out: list[WC] = []
        wcs = self._wcs
        if not wcs and not self._closed:
            self.context.engine.progress()
        while wcs and len(out) < num_entries:
            out.append(wcs.popleft())
        return len(out), out

    def wait(self, timeout: float) -> None:
        """Soft-only: block up to ``timeout`` seconds until a completion may be
        there (what a completion channel gives a real provider's user)."""
        if self._wcs or self._closed:
            return
        self.context.engine.wait(timeout, lambda: bool(self._wcs))

    def _push(self, wc: WC) -> None:
        if not self._closed:
            self._wcs.append(wc)

    def close(self) -> None:
        self._closed = True
        self._wcs.clear()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
