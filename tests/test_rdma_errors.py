"""Error paths of the RDMA transport on the soft provider.

Each failure must surface as a :class:`TransportError` (or its subclass
:class:`PeerClosedError` when the peer is gone) that names the peer and the
work-completion status, and must write nothing where it should not: the
receiver's slot area is filled with a canary before each test and checked after.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

from transports.base import (
    Deadline,
    PeerClosedError,
    TransportError,
    TransportOptions,
    wait_all,
)
from transports.rdma import RdmaTransport
from transports.rdma.soft import QPAttr
from transports.rdma.soft import enums as e
from transports.rdma.transport import Endpoint

ROOT = Path(__file__).resolve().parent.parent
CANARY = 0xC3
SLOT = 4096
NSLOTS = 4


def options(rank: int, slot_bytes: int = SLOT, nslots: int = NSLOTS) -> TransportOptions:
    return TransportOptions(
        rank=rank,
        size=2,
        timeout=30.0,
        slot_bytes=slot_bytes,
        nslots=nslots,
        extra=(("rdma_provider", "soft"),),
    )


def tampered(blob: bytes, **fields: int) -> bytes:
    """The blob with some header fields changed (and a valid checksum)."""
    ep = Endpoint.unpack(blob)
    for k, v in fields.items():
        setattr(ep, k, v)
    return ep.pack()


@pytest.fixture
def make_pair():
    made: list[RdmaTransport] = []

    def make(**remote_fields: int):
        """Rank 0 connects to rank 1 through a blob with ``remote_fields`` changed."""
        ts = [RdmaTransport(options(r)) for r in range(2)]
        made.extend(ts)
        blobs = [t.listen() for t in ts]
        c0 = ts[0].connect(1, tampered(blobs[1], **remote_fields) if remote_fields else blobs[1])
        c1 = ts[1].connect(0, blobs[0])
        ts[1].recv_area.array[:] = CANARY  # where rank 0 may write, and nothing else
        return ts, c0, c1

    yield make
    for t in made:
        t.close()


def canary_intact(t: RdmaTransport) -> bool:
    return bool((t.recv_area.array == CANARY).all())


@pytest.mark.timeout(30)
def test_wrong_rkey_is_a_remote_access_error_and_writes_nothing(make_pair):
    ts, c0, _ = make_pair()
    good = Endpoint.unpack(ts[1].listen()).rkey
    ts, c0, _ = make_pair(rkey=good ^ 0x5A5A)
    with pytest.raises(TransportError, match=r"peer 1 .*IBV_WC_REM_ACCESS_ERR.*wrong rkey") as info:
        wait_all([c0.isend(memoryview(np.ones(100, np.uint8)))], Deadline.after(10))
    assert not isinstance(info.value, PeerClosedError)  # the peer is there; it said no
    assert info.value.peer == 1 and info.value.transport == "rdma:host"
    assert canary_intact(ts[1])
    with pytest.raises(TransportError):  # the connection stays failed
        c0.isend(memoryview(b"x"))


@pytest.mark.timeout(30)
def test_out_of_bounds_write_is_refused_and_writes_nothing(make_pair):
    ts, _, _ = make_pair()
    base = Endpoint.unpack(ts[1].listen()).slots_addr
    # Shift the peer's slot base so that the first full slot ends 64 bytes past
    # the registered area: the write must be refused as a whole.
    ts, c0, _ = make_pair(slots_addr=base + (NSLOTS - 1) * SLOT + 64)
    with pytest.raises(TransportError, match=r"peer 1 .*IBV_WC_REM_ACCESS_ERR") as info:
        wait_all([c0.isend(memoryview(np.full(SLOT, 7, np.uint8)))], Deadline.after(10))
    assert info.value.peer == 1
    assert canary_intact(ts[1])


@pytest.mark.timeout(30)
def test_qp_not_in_rts_fails_the_post(make_pair):
    ts, c0, _ = make_pair()
    attr = QPAttr(qp_state=e.IBV_QPS_RESET)
    c0.qp.modify(attr, e.IBV_QP_STATE)
    with pytest.raises(TransportError, match=r"peer 1 .*IBV_QPS_RESET, not RTS") as info:
        wait_all([c0.isend(memoryview(np.ones(10, np.uint8)))], Deadline.after(10))
    assert info.value.peer == 1 and info.value.errno == 22
    assert canary_intact(ts[1])


@pytest.mark.timeout(30)
def test_qp_in_error_state_flushes(make_pair):
    ts, c0, _ = make_pair()
    c0.qp.modify(QPAttr(qp_state=e.IBV_QPS_ERR), e.IBV_QP_STATE)
    with pytest.raises(PeerClosedError, match=r"peer 1 .*IBV_WC_WR_FLUSH_ERR"):
        wait_all([c0.isend(memoryview(np.ones(10, np.uint8)))], Deadline.after(10))
    assert canary_intact(ts[1])


# ------------------------------------------------------------------ a killed peer
PEER = textwrap.dedent(
    """
    import sys
    import numpy as np
    from transports.base import Deadline, TransportOptions, wait_all
    from transports.rdma import RdmaTransport

    n, slot = int(sys.argv[1]), int(sys.argv[2])
    opts = TransportOptions(rank=1, size=2, timeout=30.0, slot_bytes=slot, nslots=4,
                            extra=(("rdma_provider", "soft"),))
    t = RdmaTransport(opts)
    print(t.listen().hex(), flush=True)
    c = t.connect(0, bytes.fromhex(sys.stdin.readline()))
    data = np.full(n, 0x5A, np.uint8)
    out = np.empty(n, np.uint8)
    print("sending", flush=True)
    wait_all([c.isend(memoryview(data)), c.irecv_into(memoryview(out))], Deadline.after(120))
    """
)


@pytest.mark.timeout(90)
def test_peer_process_killed_mid_transfer():
    """A real second process, SIGKILLed while both directions are mid-message."""
    n, slot = 64 << 20, 64 << 10
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    child = subprocess.Popen(
        [sys.executable, "-c", PEER, str(n), str(slot)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        env=env,
        text=True,
    )
    t = RdmaTransport(options(0, slot_bytes=slot))
    try:
        assert child.stdin is not None and child.stdout is not None
        blob = t.listen()
        peer_blob = bytes.fromhex(child.stdout.readline())
        child.stdin.write(blob.hex() + "\n")
        child.stdin.flush()
        c = t.connect(1, peer_blob)
        assert child.stdout.readline().strip() == "sending"

        out = np.full(n, CANARY, np.uint8)
        got = [0]

        def sink(off: int, piece: memoryview) -> None:
            assert off == got[0]  # in order, no gaps
            out[off : off + len(piece)] = piece
            got[0] += len(piece)

        send = c.isend(memoryview(np.full(n, 0x11, np.uint8)))
        recv = c.irecv(n, sink)
        deadline = time.monotonic() + 30
        while got[0] == 0 and time.monotonic() < deadline:  # let the transfer start
            recv.test()
            send.test()
        assert 0 < got[0] < n, got[0]
        os.kill(child.pid, signal.SIGKILL)
        child.wait(10)
        t0 = time.monotonic()
        with pytest.raises(
            PeerClosedError, match=r"peer 1 .*IBV_WC_(RETRY_EXC|WR_FLUSH)_ERR"
        ) as info:
            wait_all([send, recv], Deadline.after(30))
        assert time.monotonic() - t0 < 10, "the loss of the peer was noticed late"
        assert info.value.peer == 1 and info.value.transport == "rdma:host"
        k = got[0]
        assert 0 < k < n
        assert (out[:k] == 0x5A).all(), "delivered bytes are the peer's"
        assert (out[k:] == CANARY).all(), "nothing written past what was delivered"
        with pytest.raises(PeerClosedError):  # and the connection stays failed
            c.isend(memoryview(b"x"))
    finally:
        if child.poll() is None:
            child.kill()
            child.wait(10)
        t.close()


@pytest.mark.timeout(120)
def test_goodbye_fails_what_the_peer_will_not_serve_and_nothing_else(make_pair):
    """close() sends a goodbye.  A message that arrived before it is still
    delivered, a send already on the wire still completes (its ACK may trail the
    goodbye), and only what the peer will never serve fails, at once."""
    for _ in range(10):
        ts, c0, c1 = make_pair()
        big = os.urandom(3 * SLOT + 5)
        late = os.urandom(100)
        out = bytearray(len(big))
        send = c1.isend(memoryview(big))
        send_late = c0.isend(memoryview(late))  # rank 1 receives it after rank 0 closed
        wait_all([c0.irecv_into(memoryview(out))], Deadline.after(30))
        wait_all([send_late], Deadline.after(30))
        c0.close()
        wait_all([send], Deadline.after(30))  # on the wire before the goodbye: no error
        got = bytearray(len(late))
        wait_all([c1.irecv_into(memoryview(got))], Deadline.after(30))
        assert out == big and got == late
        t = time.monotonic()
        with pytest.raises(PeerClosedError):  # the goodbye, or the destroyed QP's flush
            wait_all([c1.irecv_into(memoryview(bytearray(8)))], Deadline.after(30))
        assert time.monotonic() - t < 1.0
        for tr in ts:
            tr.close()
