"""Semantics of the software RDMA provider, including its error paths."""

from __future__ import annotations

import os
import time

import numpy as np
import pytest

from transports.rdma import soft as v

e = v.enums
RW = e.IBV_ACCESS_LOCAL_WRITE | e.IBV_ACCESS_REMOTE_WRITE | e.IBV_ACCESS_REMOTE_READ


class Node:
    def __init__(self, caps: tuple[str, ...] = ()) -> None:
        self.ctx = v.Context(name="soft0", soft_caps=caps)
        self.pd = v.PD(self.ctx)
        self.cq = v.CQ(self.ctx, 64)
        cap = v.QPCap(max_send_wr=16, max_recv_wr=16, max_send_sge=2, max_recv_sge=2)
        self.qp = v.QP(
            self.pd,
            v.QPInitAttr(qp_type=e.IBV_QPT_RC, scq=self.cq, rcq=self.cq, cap=cap),
        )

    def attr_for(self, peer: Node, rnr_retry: int = 7, min_rnr_timer: int = 1) -> v.QPAttr:
        a = v.QPAttr()
        a.qp_access_flags = RW
        a.path_mtu = e.IBV_MTU_1024
        a.dest_qp_num = peer.qp.qp_num
        a.rq_psn = a.sq_psn = 7
        a.max_rd_atomic = a.max_dest_rd_atomic = 1
        a.timeout, a.retry_cnt, a.rnr_retry, a.min_rnr_timer = (
            14,
            7,
            rnr_retry,
            min_rnr_timer,
        )
        gr = v.GlobalRoute(dgid=peer.ctx.query_gid(1, 0))
        a.ah_attr = v.AHAttr(port_num=1, is_global=1, dlid=peer.ctx.query_port(1).lid, gr=gr)
        return a

    def close(self) -> None:
        self.ctx.close()


def poll(cq: v.CQ, n: int = 1, timeout: float = 10.0) -> list[v.WC]:
    out: list[v.WC] = []
    end = time.monotonic() + timeout
    while len(out) < n and time.monotonic() < end:
        k, wcs = cq.poll(n - len(out))
        out += wcs
        if not k:
            time.sleep(1e-4)
    return out


@pytest.fixture
def pair():
    a, b = Node(), Node()
    yield a, b
    a.close()
    b.close()


def connect(a: Node, b: Node, **kw: int) -> None:
    a.qp.to_rts(a.attr_for(b, **kw))
    b.qp.to_rts(b.attr_for(a, **kw))


def write_wr(wr_id, mr, n, rkey, raddr, opcode=e.IBV_WR_RDMA_WRITE, imm=0, off=0):
    wr = v.SendWR(
        wr_id=wr_id,
        opcode=opcode,
        num_sge=1,
        sg=[v.SGE(mr.buf + off, n, mr.lkey)],
        imm_data=imm,
    )
    wr.set_wr_rdma(rkey, raddr)
    return wr


@pytest.mark.timeout(30)
def test_write_with_imm_consumes_receive(pair):
    a, b = pair
    connect(a, b)
    src = np.arange(1 << 16, dtype=np.uint32)
    dst = np.zeros_like(src)
    mra = v.MR(a.pd, src.nbytes, e.IBV_ACCESS_LOCAL_WRITE, address=src)
    mrb = v.MR(b.pd, dst.nbytes, RW, address=dst)
    b.qp.post_recv(v.RecvWR(wr_id=42))
    a.qp.post_send(
        write_wr(
            1,
            mra,
            src.nbytes,
            mrb.rkey,
            mrb.buf,
            e.IBV_WR_RDMA_WRITE_WITH_IMM,
            imm=0xABCD,
        )
    )
    (sw,) = poll(a.cq)
    (rw,) = poll(b.cq)
    assert sw.status == e.IBV_WC_SUCCESS and sw.opcode == e.IBV_WC_RDMA_WRITE and sw.wr_id == 1
    assert rw.status == e.IBV_WC_SUCCESS and rw.opcode == e.IBV_WC_RECV_RDMA_WITH_IMM
    assert rw.wr_id == 42 and rw.imm_data == 0xABCD and rw.byte_len == src.nbytes
    assert rw.wc_flags & e.IBV_WC_WITH_IMM
    np.testing.assert_array_equal(dst, src)


@pytest.mark.timeout(30)
def test_send_recv_scatter_and_read(pair):
    a, b = pair
    connect(a, b)
    mra = v.MR(a.pd, 4096, RW)
    mrb = v.MR(b.pd, 4096, RW)
    mra.write(b"hello, verbs", 12)
    sg = [v.SGE(mrb.buf, 5, mrb.lkey), v.SGE(mrb.buf + 100, 100, mrb.lkey)]
    b.qp.post_recv(v.RecvWR(wr_id=5, num_sge=2, sg=sg))
    a.qp.post_send(
        v.SendWR(wr_id=6, opcode=e.IBV_WR_SEND, num_sge=1, sg=[v.SGE(mra.buf, 12, mra.lkey)])
    )
    assert poll(a.cq)[0].status == e.IBV_WC_SUCCESS
    rw = poll(b.cq)[0]
    assert (rw.status, rw.opcode, rw.byte_len) == (e.IBV_WC_SUCCESS, e.IBV_WC_RECV, 12)
    assert mrb.read(5, 0) == b"hello" and mrb.read(7, 100) == b", verbs"
    # RDMA READ back from b into a at offset 1000
    wr = v.SendWR(
        wr_id=7,
        opcode=e.IBV_WR_RDMA_READ,
        num_sge=1,
        sg=[v.SGE(mra.buf + 1000, 5, mra.lkey)],
    )
    wr.set_wr_rdma(mrb.rkey, mrb.buf)
    a.qp.post_send(wr)
    rd = poll(a.cq)[0]
    assert (rd.status, rd.opcode, rd.byte_len) == (
        e.IBV_WC_SUCCESS,
        e.IBV_WC_RDMA_READ,
        5,
    )
    assert mra.read(5, 1000) == b"hello"


@pytest.mark.timeout(30)
def test_many_in_order(pair):
    a, b = pair
    connect(a, b)
    mra = v.MR(a.pd, 1 << 16, RW)
    mrb = v.MR(b.pd, 1 << 16, RW)
    seen = []
    for i in range(200):
        mra.write(bytes([i % 256]) * 8, 8, offset=(i % 16) * 8)
        b.qp.post_recv(v.RecvWR(wr_id=i))
        a.qp.post_send(
            write_wr(
                i,
                mra,
                8,
                mrb.rkey,
                mrb.buf,
                e.IBV_WR_RDMA_WRITE_WITH_IMM,
                imm=i,
                off=(i % 16) * 8,
            )
        )
        if i % 8 == 7:
            assert all(w.status == 0 for w in poll(a.cq, 8))
            seen += [w.imm_data for w in poll(b.cq, 8)]
    assert seen == list(range(200))


@pytest.mark.timeout(30)
def test_wrong_rkey_is_remote_access_error_and_writes_nothing(pair):
    a, b = pair
    connect(a, b)
    src = np.full(4096, 7, np.uint8)
    dst = np.zeros(4096, np.uint8)
    mra = v.MR(a.pd, src.nbytes, e.IBV_ACCESS_LOCAL_WRITE, address=src)
    mrb = v.MR(b.pd, dst.nbytes, RW, address=dst)
    a.qp.post_send(write_wr(1, mra, 4096, mrb.rkey ^ 0x5A5A, mrb.buf))
    a.qp.post_send(write_wr(2, mra, 16, mrb.rkey, mrb.buf))  # behind the bad one: flushed
    wcs = poll(a.cq, 2)
    assert [w.status for w in wcs] == [e.IBV_WC_REM_ACCESS_ERR, e.IBV_WC_WR_FLUSH_ERR]
    assert not dst.any()
    assert a.qp.qp_state == e.IBV_QPS_ERR


@pytest.mark.timeout(30)
def test_out_of_bounds_write_is_refused(pair):
    a, b = pair
    connect(a, b)
    src = np.full(8192, 9, np.uint8)
    big = np.zeros(8192, np.uint8)  # only the first half is registered
    mra = v.MR(a.pd, src.nbytes, e.IBV_ACCESS_LOCAL_WRITE, address=src)
    mrb = v.MR(b.pd, 4096, RW, address=big)
    a.qp.post_send(write_wr(1, mra, 200, mrb.rkey, mrb.buf + 4000))
    (wc,) = poll(a.cq)
    assert wc.status == e.IBV_WC_REM_ACCESS_ERR
    assert not big.any()


@pytest.mark.timeout(30)
def test_missing_remote_write_access(pair):
    a, b = pair
    connect(a, b)
    mra = v.MR(a.pd, 64, RW)
    mrb = v.MR(b.pd, 64, e.IBV_ACCESS_LOCAL_WRITE)  # no remote write
    a.qp.post_send(write_wr(1, mra, 8, mrb.rkey, mrb.buf))
    assert poll(a.cq)[0].status == e.IBV_WC_REM_ACCESS_ERR
    with pytest.raises(v.PyverbsRDMAError):
        v.MR(b.pd, 64, e.IBV_ACCESS_REMOTE_WRITE)  # remote write without local write: EINVAL


@pytest.mark.timeout(30)
def test_post_send_outside_rts_fails(pair):
    a, b = pair
    mra = v.MR(a.pd, 64, RW)
    wr = v.SendWR(wr_id=1, opcode=e.IBV_WR_SEND, num_sge=1, sg=[v.SGE(mra.buf, 8, mra.lkey)])
    with pytest.raises(v.PyverbsRDMAError) as info:
        a.qp.post_send(wr)  # RESET
    assert info.value.error_code == 22
    with pytest.raises(v.PyverbsRDMAError):
        a.qp.post_recv(v.RecvWR())  # RESET
    a.qp.to_rtr(a.attr_for(b))
    assert a.qp.qp_state == e.IBV_QPS_RTR
    with pytest.raises(v.PyverbsRDMAError):
        a.qp.post_send(wr)  # RTR
    a.qp.post_recv(v.RecvWR())  # allowed from INIT on
    bad = v.QPAttr(qp_state=e.IBV_QPS_RTS)
    with pytest.raises(v.PyverbsRDMAError):
        b.qp.modify(bad, e.IBV_QP_STATE)  # RESET -> RTS is not a legal transition


@pytest.mark.timeout(30)
def test_error_state_flushes(pair):
    a, b = pair
    connect(a, b)
    mra = v.MR(a.pd, 64, RW)
    for i in range(3):
        b.qp.post_recv(v.RecvWR(wr_id=i))
    b.qp.modify(v.QPAttr(qp_state=e.IBV_QPS_ERR), e.IBV_QP_STATE)
    wcs = poll(b.cq, 3)
    assert [w.status for w in wcs] == [e.IBV_WC_WR_FLUSH_ERR] * 3
    b.qp.post_recv(v.RecvWR(wr_id=9))  # posting in ERR completes with a flush
    assert poll(b.cq)[0].status == e.IBV_WC_WR_FLUSH_ERR
    del mra


@pytest.mark.timeout(30)
def test_rnr_retry_exhausted(pair):
    a, b = pair
    connect(a, b, rnr_retry=2, min_rnr_timer=1)
    mra = v.MR(a.pd, 64, RW)
    mrb = v.MR(b.pd, 64, RW)
    a.qp.post_send(write_wr(1, mra, 8, mrb.rkey, mrb.buf, e.IBV_WR_RDMA_WRITE_WITH_IMM))
    assert poll(a.cq)[0].status == e.IBV_WC_RNR_RETRY_EXC_ERR


@pytest.mark.timeout(30)
def test_rnr_then_receive_posted_succeeds(pair):
    a, b = pair
    connect(a, b, rnr_retry=7, min_rnr_timer=14)  # 1.28 ms per retry, forever
    mra = v.MR(a.pd, 64, RW)
    mrb = v.MR(b.pd, 64, RW)
    mra.write(b"abcdefgh", 8)
    a.qp.post_send(write_wr(1, mra, 8, mrb.rkey, mrb.buf, e.IBV_WR_RDMA_WRITE_WITH_IMM, imm=3))
    a.qp.post_send(write_wr(2, mra, 8, mrb.rkey, mrb.buf + 8))  # behind it, resent in order
    time.sleep(0.05)
    assert a.cq.poll(1)[0] == 0
    b.qp.post_recv(v.RecvWR(wr_id=77))
    assert [w.status for w in poll(a.cq, 2)] == [0, 0]
    rw = poll(b.cq)[0]
    assert rw.wr_id == 77 and rw.imm_data == 3
    assert mrb.read(16, 0) == b"abcdefgh" * 2


@pytest.mark.timeout(30)
def test_peer_disappears(pair):
    a, b = pair
    connect(a, b)
    mra = v.MR(a.pd, 64, RW)
    mrb = v.MR(b.pd, 64, RW)
    a.qp.post_recv(v.RecvWR(wr_id=11))
    b.close()  # peer context gone: its sockets close
    deadline = time.monotonic() + 10
    while a.qp.qp_state != e.IBV_QPS_ERR and time.monotonic() < deadline:
        time.sleep(0.01)
    assert a.qp.qp_state == e.IBV_QPS_ERR
    assert poll(a.cq)[0].status == e.IBV_WC_WR_FLUSH_ERR
    a.qp.post_send(write_wr(1, mra, 8, mrb.rkey, 0))
    assert poll(a.cq)[0].status == e.IBV_WC_WR_FLUSH_ERR


def _wait_until(cond, timeout: float = 10.0) -> bool:
    end = time.monotonic() + timeout
    while not cond() and time.monotonic() < end:
        time.sleep(0.005)
    return cond()


def _peer_closes_before_its_ack_is_read(a: Node, b: Node):
    """a writes to b; b places the write (and ACKs it) and destroys its QP while
    a's NIC has not read that ACK yet: the responses to a's requests travel on
    another stream than b's requests, and nothing orders the two streams."""
    connect(a, b)
    mra = v.MR(a.pd, 64, RW)
    mrb = v.MR(b.pd, 64, RW)
    for i in range(2):
        b.qp.post_recv(v.RecvWR(wr_id=100 + i))
    imm = e.IBV_WR_RDMA_WRITE_WITH_IMM
    a.qp.post_send(write_wr(1, mra, 8, mrb.rkey, mrb.buf, imm))
    assert poll(a.cq)[0].status == e.IBV_WC_SUCCESS and poll(b.cq)[0].status == 0
    assert _wait_until(lambda: a.qp.responder is not None)  # b's request stream is up
    with a.ctx.engine.lock:  # a's NIC leaves the responses to its requests unread
        a.qp.requester.link.pause()
    a.qp.post_send(write_wr(2, mra, 8, mrb.rkey, mrb.buf + 8, imm))
    (rw,) = poll(b.cq)  # b saw the write complete: its ACK has gone out
    assert rw.status == e.IBV_WC_SUCCESS and rw.wr_id == 101
    b.qp.close()  # as Communicator.close: local, both of b's streams end
    responder = a.qp.responder
    assert _wait_until(lambda: responder.link.closed)  # a's NIC saw b's request stream end
    return mra, mrb


@pytest.mark.timeout(30)
def test_ack_sent_before_the_peer_closed_is_not_lost(pair):
    """The end of the peer's request stream does not fail a write the peer
    already acknowledged (a real HCA ACKs on placement, whatever the peer's
    process does next); the peer's loss still puts the QP in ERR."""
    a, b = pair
    keep = _peer_closes_before_its_ack_is_read(a, b)
    with a.ctx.engine.lock:
        a.qp.requester.link.resume()
    (sw,) = poll(a.cq)
    assert sw.wr_id == 2 and sw.status == e.IBV_WC_SUCCESS, sw
    # the requester stream's own end follows its ACKs: the QP then fails at once
    assert _wait_until(lambda: a.qp.qp_state == e.IBV_QPS_ERR, 2.0)
    del keep


@pytest.mark.timeout(30)
def test_unanswered_write_fails_soon_after_the_peer_request_stream_ends(pair):
    """A write whose ACK never comes still fails with RETRY_EXC_ERR, within the
    grace the provider gives the responses' stream, not after a transport timeout."""
    a, b = pair
    keep = _peer_closes_before_its_ack_is_read(a, b)  # and a never reads the ACK
    t0 = time.monotonic()
    (sw,) = poll(a.cq, timeout=10)
    assert sw.wr_id == 2 and sw.status == e.IBV_WC_RETRY_EXC_ERR, sw
    assert time.monotonic() - t0 < 5
    assert a.qp.qp_state == e.IBV_QPS_ERR
    del keep


@pytest.mark.timeout(30)
def test_peer_never_listening_gives_retry_exceeded():
    a, b = Node(), Node()
    attr = a.attr_for(b)
    attr.timeout, attr.retry_cnt = 1, 0  # shortest transport timer: the 1 s floor
    b.close()
    try:
        a.qp.to_rts(attr)
        mra = v.MR(a.pd, 64, RW)
        a.qp.post_send(write_wr(1, mra, 8, 1, 0))
        (wc,) = poll(a.cq, timeout=10)
        assert wc.status == e.IBV_WC_RETRY_EXC_ERR
    finally:
        a.close()


@pytest.mark.timeout(30)
def test_dmabuf_mr_is_offset_addressed():
    a, b = Node(), Node(caps=("dmabuf",))
    try:
        connect(a, b)
        fd = os.memfd_create("pycoll-test-dmabuf")
        os.ftruncate(fd, 16384)
        mrb = v.DmaBufMR(b.pd, 4096, RW, fd, offset=8192)
        assert mrb.rkey and mrb.offset == 8192
        mra = v.MR(a.pd, 64, RW)
        mra.write(b"DMABUF!!", 8)
        a.qp.post_send(write_wr(1, mra, 8, mrb.rkey, 8192 + 16))  # iova = offset
        assert poll(a.cq)[0].status == e.IBV_WC_SUCCESS
        assert os.pread(fd, 8, 8192 + 16) == b"DMABUF!!"
        a.qp.post_send(write_wr(2, mra, 8, mrb.rkey, 16))  # below the iova range
        assert poll(a.cq)[0].status == e.IBV_WC_REM_ACCESS_ERR
        mrb.close()
        os.close(fd)
    finally:
        a.close()
        b.close()


@pytest.mark.timeout(30)
def test_dmabuf_needs_the_claimed_capability_and_a_valid_fd():
    with v.Context(name="soft0") as ctx:
        pd = v.PD(ctx)
        with pytest.raises(v.PyverbsRDMAError) as info:
            v.DmaBufMR(pd, 4096, RW, -1, 0)
        assert info.value.error_code == 95  # EOPNOTSUPP: NIC without dma-buf
    with v.Context(name="soft0", soft_caps={"dmabuf"}) as ctx:
        pd = v.PD(ctx)
        with pytest.raises(v.PyverbsRDMAError) as info:
            v.DmaBufMR(pd, 4096, RW, -1, 0)
        assert info.value.error_code == 9  # EBADF: the probe's "yes"


@pytest.mark.timeout(10)
def test_only_loopback_or_benchmark_addresses():
    with pytest.raises(v.PyverbsUserError):
        v.Context(name="soft0", soft_addr="8.8.8.8")
    with pytest.raises(v.PyverbsRDMAError):
        v.Context(name="mlx5_0")
