"""GPUDirect RDMA path: ``ibv_reg_mr`` straight on a CUDA device pointer.

With the nvidia_peermem module loaded, the RDMA core asks NVIDIA's driver to pin
the GPU pages (``nvidia_p2p_get_pages``) and hands the NIC bus addresses inside
the GPU's PCI BAR, so the NIC reads and writes GPU memory directly.  It is used
only when peer memory is present and the GPU and NIC are close on PCIe (at most
``rdma_gdr_level``, like ``NCCL_NET_GDR_LEVEL``; default PXB).

Writes by the NIC into GPU memory may still sit in PCIe buffers when the
completion arrives; before a kernel consumes received data the receiver issues a
*flush*: an RDMA READ of a few bytes of the buffer through a loopback QP, which
cannot complete before earlier writes have landed (:class:`Flusher`).
"""

from __future__ import annotations

import time
from typing import Any

from transports.base import Backoff, TransportError
from transports.rdma.host import HostBuffer, Registration

NAME = "gdr"


def register(verbs: Any, pd: Any, dev_ptr: int, nbytes: int, access: int) -> Registration:
    """``ibv_reg_mr`` on GPU memory (needs peermem on a real HCA)."""
    return Registration(verbs.MR(pd, nbytes, access, address=dev_ptr), dev_ptr, nbytes, NAME)


class Flusher:
    """A QP connected to itself, used to issue the receive-side flush READ."""

    def __init__(
        self,
        verbs: Any,
        ctx: Any,
        pd: Any,
        port_num: int,
        gid: Any,
        lid: int,
        timeout: float,
    ) -> None:
        e = verbs.e
        self.verbs = verbs
        self.timeout = timeout
        self.cq = verbs.CQ(ctx, 16)
        cap = verbs.QPCap(max_send_wr=4, max_recv_wr=1)
        self.qp = verbs.QP(
            pd,
            verbs.QPInitAttr(qp_type=e.IBV_QPT_RC, scq=self.cq, rcq=self.cq, cap=cap),
        )
        self.scratch = HostBuffer(64)
        self.scratch_mr = verbs.MR(pd, 64, e.IBV_ACCESS_LOCAL_WRITE, address=self.scratch.addr)
        attr = verbs.QPAttr()
        attr.qp_access_flags = e.IBV_ACCESS_REMOTE_READ | e.IBV_ACCESS_LOCAL_WRITE
        attr.port_num = port_num
        attr.path_mtu = e.IBV_MTU_1024
        attr.dest_qp_num = self.qp.qp_num
        attr.rq_psn = attr.sq_psn = 0
        attr.max_rd_atomic = attr.max_dest_rd_atomic = 1
        attr.min_rnr_timer = 12
        attr.timeout, attr.retry_cnt, attr.rnr_retry = 14, 7, 7
        gr = verbs.GlobalRoute(dgid=gid, sgid_index=0)
        attr.ah_attr = verbs.AHAttr(port_num=port_num, is_global=1, dlid=lid, gr=gr)
        self.qp.to_rts(attr)

    def flush(self, reg: Registration) -> None:
        """Make every completed NIC write into ``reg`` visible to the GPU."""
        e = self.verbs.e
        sge = self.verbs.SGE(self.scratch.addr, 4, self.scratch_mr.lkey)
        wr = self.verbs.SendWR(wr_id=0xF1, opcode=e.IBV_WR_RDMA_READ, num_sge=1, sg=[sge])
        wr.set_wr_rdma(reg.rkey, reg.addr)
        self.qp.post_send(wr)
        end = time.monotonic() + self.timeout
        bo = Backoff()
        while True:
            n, wcs = self.cq.poll(1)
            if n:
                if wcs[0].status != e.IBV_WC_SUCCESS:
                    raise TransportError(
                        f"rdma:gdr flush READ failed: {self.verbs.wc_status_name(wcs[0].status)}",
                        transport="rdma:gdr",
                    )
                return
            if time.monotonic() > end:
                raise TransportError("rdma:gdr flush READ timed out", transport="rdma:gdr")
            bo.pause()

    def close(self) -> None:
        for obj in (self.qp, self.scratch_mr, self.cq):
            obj.close()
        self.scratch.close()
