"""Work requests of pyverbs (``pyverbs.wr``): SGE, SendWR, RecvWR."""

from __future__ import annotations

from transports.rdma.soft import enums as e


class SGE:
    """One scatter/gather element: ``length`` bytes at ``addr`` in the MR of ``lkey``."""

    __slots__ = ("addr", "length", "lkey")

    def __init__(self, addr: int, length: int, lkey: int) -> None:
        self.addr = addr
        self.length = length
        self.lkey = lkey


class SendWR:
    """A send-queue work request (``ibv_send_wr``)."""

    def __init__(
        self,
        wr_id: int = 0,
        opcode: int = e.IBV_WR_SEND,
        num_sge: int = 0,
        imm_data: int = 0,
        sg: list[SGE] | None = None,
        send_flags: int = e.IBV_SEND_SIGNALED,
    ) -> None:
        self.wr_id = wr_id
        self.opcode = opcode
        self.num_sge = num_sge
        self.imm_data = imm_data
        self.sg = list(sg) if sg else []
        self.send_flags = send_flags
        self.rkey = 0
        self.remote_addr = 0

    def set_wr_rdma(self, rkey: int, addr: int) -> None:
        """Target of an RDMA WRITE/READ: ``addr`` in the peer's MR of ``rkey``."""
        self.rkey = rkey
        self.remote_addr = addr


class RecvWR:
    """A receive-queue work request (``ibv_recv_wr``)."""

    def __init__(self, wr_id: int = 0, num_sge: int = 0, sg: list[SGE] | None = None) -> None:
        self.wr_id = wr_id
        self.num_sge = num_sge
        self.sg = list(sg) if sg else []
