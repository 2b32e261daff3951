"""The RDMA transport on the software provider, both ends in one process."""

from __future__ import annotations

import logging
import time

import numpy as np
import pytest

from transports.base import (
    BlobError,
    Deadline,
    PeerClosedError,
    TransportError,
    TransportOptions,
    wait_all,
)
from transports.rdma import RdmaTransport
from transports.rdma.transport import BLOB_HEADER, Endpoint


def options(
    rank: int, size: int = 2, slot_bytes: int = 4096, nslots: int = 4, **extra: str
) -> TransportOptions:
    ex = {"rdma_provider": "soft", **extra}
    return TransportOptions(
        rank=rank,
        size=size,
        timeout=30.0,
        slot_bytes=slot_bytes,
        nslots=nslots,
        extra=tuple(ex.items()),
    )


@pytest.fixture
def pair():
    ts = [RdmaTransport(options(r)) for r in range(2)]
    blobs = [t.listen() for t in ts]
    conns = [ts[0].connect(1, blobs[1]), ts[1].connect(0, blobs[0])]
    yield conns
    for c in conns:
        c.close()
    for t in ts:
        t.close()


def exchange(c0, c1, a: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Both ranks isend first, then irecv: the flow-control rule must keep this live."""
    ra, rb = np.zeros_like(a), np.zeros_like(b)
    reqs = [c0.isend(memoryview(a)), c1.isend(memoryview(b))]
    reqs += [
        c0.irecv_into(memoryview(rb).cast("B")),
        c1.irecv_into(memoryview(ra).cast("B")),
    ]
    wait_all(reqs, Deadline.after(60))
    return ra, rb


@pytest.mark.timeout(60)
@pytest.mark.parametrize("nbytes", [1, 63, 64, 4095, 4096, 4097, 3 * 4096 + 5, 1 << 20])
def test_bidirectional_sizes(pair, nbytes):
    rng = np.random.default_rng(nbytes)
    a = rng.integers(0, 256, nbytes, dtype=np.uint8)
    b = rng.integers(0, 256, nbytes, dtype=np.uint8)
    ra, rb = exchange(*pair, a, b)
    np.testing.assert_array_equal(ra, a)
    np.testing.assert_array_equal(rb, b)


@pytest.mark.timeout(60)
def test_large_both_ways_no_deadlock(pair):
    a = np.arange(4 << 20, dtype=np.uint8)
    b = a[::-1].copy()
    ra, rb = exchange(*pair, a, b)
    assert (ra == a).all() and (rb == b).all()


@pytest.mark.timeout(30)
def test_zero_bytes(pair):
    c0, c1 = pair
    s = c0.isend(memoryview(b""))
    r = c1.irecv(0, lambda off, v: pytest.fail("no piece expected"))
    wait_all([s, r], Deadline.after(5))
    a = np.arange(10, dtype=np.uint8)
    ra, _ = exchange(c0, c1, a, a)  # the connection still matches messages afterwards
    np.testing.assert_array_equal(ra, a)


@pytest.mark.timeout(60)
def test_many_messages_in_order(pair):
    c0, c1 = pair
    msgs = [np.full(1 + (i * 37) % 9000, i, dtype=np.uint8) for i in range(200)]
    sends = [c0.isend(memoryview(m)) for m in msgs]
    outs = [np.zeros_like(m) for m in msgs]
    recvs = [c1.irecv_into(memoryview(o)) for o in outs]
    wait_all(sends + recvs, Deadline.after(60))
    for m, o in zip(msgs, outs, strict=True):
        np.testing.assert_array_equal(o, m)


@pytest.mark.timeout(30)
def test_sink_pieces_are_aligned(pair):
    c0, c1 = pair
    data = np.arange(5 * 4096 + 100, dtype=np.uint8)
    pieces = []
    s = c0.isend(memoryview(data))
    r = c1.irecv(len(data), lambda off, v: pieces.append((off, len(v))))
    wait_all([s, r], Deadline.after(10))
    assert sum(n for _, n in pieces) == len(data)
    for off, n in pieces[:-1]:
        assert off % 64 == 0 and n % 64 == 0


@pytest.mark.timeout(30)
def test_size_mismatch_is_detected(pair):
    c0, c1 = pair
    s = c0.isend(memoryview(np.zeros(100, np.uint8)))
    with pytest.raises(TransportError, match="does not match"):  # at post or while waiting
        r = c1.irecv(50, lambda off, v: None)
        wait_all([s, r], Deadline.after(10))


@pytest.mark.timeout(30)
def test_connection_label_and_blob_roundtrip(pair):
    c0, _ = pair
    assert c0.transport == "rdma:host"
    t = RdmaTransport(options(0, size=3))
    try:
        ep = Endpoint.unpack(t.listen())
        assert (
            ep.size == 3 and ep.rank == 0 and ep.qps[0] == (0, 0) and all(q for q, _ in ep.qps[1:])
        )
    finally:
        t.close()


@pytest.mark.timeout(30)
def test_bad_blobs_raise_blob_error():
    t = RdmaTransport(options(0))
    try:
        good = t.listen()
        bad = [
            b"",
            good[:10],
            good[:-1],
            b"XXXX" + good[4:],
            good[:4] + bytes([99]) + good[5:],
            good[:-5] + bytes([good[-5] ^ 1]) + good[-4:],  # payload flipped: checksum
            good + b"\0",
        ]
        for blob in bad:
            with pytest.raises(BlobError):
                t.connect(1, blob)
            ok, why = t.can_connect(good, blob)
            assert not ok and why
        with pytest.raises(BlobError):
            Endpoint.unpack("not bytes")  # type: ignore[arg-type]
    finally:
        t.close()
    assert BLOB_HEADER.size == 88


@pytest.mark.timeout(30)
def test_connection_closed_by_peer(pair):
    c0, c1 = pair
    c1.tr.close()  # peer's whole transport goes away
    with pytest.raises(PeerClosedError, match="peer 1.*IBV_WC_"):  # at post or while waiting
        r = c0.irecv(10, lambda off, v: None)
        wait_all([r], Deadline.after(10))
    with pytest.raises(PeerClosedError):
        c0.isend(memoryview(b"x"))


@pytest.mark.timeout(30)
@pytest.mark.parametrize("peer_connects", [True, False])
def test_peer_gone_before_its_connections_settled(peer_connects):
    """The peer closes right after (or instead of) connecting, before its NIC made
    or accepted the streams: rank 0 must still learn of it, promptly."""
    ts = [RdmaTransport(options(r)) for r in range(2)]
    try:
        blobs = [t.listen() for t in ts]
        c0 = ts[0].connect(1, blobs[1])
        if peer_connects:
            ts[1].connect(0, blobs[0])
        ts[1].close()
        t0 = time.monotonic()
        with pytest.raises(PeerClosedError, match="peer 1.*IBV_WC_"):
            wait_all([c0.irecv(10, lambda off, v: None)], Deadline.after(10))
        assert time.monotonic() - t0 < 5
    finally:
        for t in ts:
            t.close()


@pytest.mark.timeout(30)
def test_empty_messages_need_no_peer(pair):
    """A rank that finished may close while a slower one still posts empty messages."""
    c0, c1 = pair
    c1.tr.close()
    with pytest.raises(PeerClosedError):
        wait_all([c0.irecv(1, lambda off, v: None)], Deadline.after(10))
    assert c0.isend(memoryview(b"")).test() and c0.irecv(0, lambda off, v: None).test()


@pytest.mark.timeout(30)
def test_message_sent_just_before_the_peer_closed_is_delivered(pair):
    c0, c1 = pair
    wait_all([c1.isend(memoryview(b"last words"))], Deadline.after(10))
    c1.tr.close()
    out = bytearray(10)
    wait_all([c0.irecv_into(memoryview(out))], Deadline.after(10))
    assert out == b"last words"
    with pytest.raises(PeerClosedError):
        wait_all([c0.irecv(1, lambda off, v: None)], Deadline.after(10))


@pytest.mark.timeout(30)
def test_local_close_then_use_raises(pair):
    c0, _ = pair
    c0.close()
    c0.close()  # idempotent
    with pytest.raises(PeerClosedError):
        c0.isend(memoryview(b"x"))


@pytest.mark.timeout(60)
def test_three_ranks_all_pairs():
    n = 3
    ts = [RdmaTransport(options(r, size=n, slot_bytes=8192, nslots=2)) for r in range(n)]
    blobs = [t.listen() for t in ts]
    conns = {(i, j): ts[i].connect(j, blobs[j]) for i in range(n) for j in range(n) if i != j}
    try:
        data = {(i, j): np.full(50000 + i * 10 + j, i * 16 + j, np.uint8) for (i, j) in conns}
        outs = {k: np.zeros_like(v) for k, v in data.items()}
        reqs = [conns[k].isend(memoryview(data[k])) for k in conns]
        reqs += [conns[(j, i)].irecv_into(memoryview(outs[(i, j)])) for (i, j) in conns]
        wait_all(reqs, Deadline.after(60))
        for k in data:  # noqa: PLC0206
            np.testing.assert_array_equal(outs[k], data[k])
    finally:
        for t in ts:
            t.close()


@pytest.mark.timeout(30)
def test_memory_path_auto_logs_refusals(caplog):
    caplog.set_level(logging.INFO, logger="transports.rdma.transport")
    t = RdmaTransport(options(0, rdma_memory="auto"))
    try:
        t.listen()
        assert t.memory_path in ("host", "gdr", "dmabuf")
        if t.memory_path == "host":
            text = caplog.text
            assert "dmabuf refused" in text and "gdr refused" in text
    finally:
        t.close()


@pytest.mark.timeout(30)
def test_unknown_provider_is_a_clear_error():
    t = RdmaTransport(options(0, rdma_provider="nope"))
    with pytest.raises(TransportError, match="unknown RDMA provider"):
        t.listen()
    t.close()
