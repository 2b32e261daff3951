"""One suite for every transport: both ends in one process."""

from __future__ import annotations

import os

import numpy as np
import pytest

from tests.transport_pairs import connected_pair, transport_available
from transports.base import Cap, Deadline, TransportError, wait_all

NAMES = ["shm", "tcp", "rdma"]
EXTRA = {"rdma": {"rdma_provider": "soft"}}


def _pair(name: str, **kw: object):
    ok, why = transport_available(name)
    if not ok:
        pytest.skip(why)
    if name in EXTRA:
        kw.setdefault("extra", EXTRA[name])
    return connected_pair(name, **kw)


def _exchange(a, b, x: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """a sends x and b sends y, at the same time; both post sends first."""
    gx, gy = np.empty_like(y), np.empty_like(x)
    reqs = [
        a.isend(memoryview(x).cast("B")),
        b.isend(memoryview(y).cast("B")),
        a.irecv_into(memoryview(gx).cast("B")),
        b.irecv_into(memoryview(gy).cast("B")),
    ]
    wait_all(reqs, Deadline.after(30))
    return gy, gx


pytestmark = [pytest.mark.timeout(120), pytest.mark.parametrize("name", NAMES)]


@pytest.mark.parametrize("nbytes", [0, 1, 63, 64, 4097, 65537, (1 << 20) + 3, 9 << 20])
def test_bidirectional_sizes(name: str, nbytes: int) -> None:
    rng = np.random.default_rng(nbytes)
    x = rng.integers(0, 256, nbytes, dtype=np.uint8)
    y = rng.integers(0, 256, nbytes, dtype=np.uint8)
    with _pair(name, slot_bytes=1 << 16, nslots=2) as (a, b):
        gx, gy = _exchange(a, b, x, y)
        assert np.array_equal(gx, x) and np.array_equal(gy, y)


def test_many_messages_in_order(name: str) -> None:
    with _pair(name, slot_bytes=1 << 12, nslots=2) as (a, b):
        msgs = [np.full(k * 37 + 1, k, dtype=np.uint8) for k in range(40)]
        sends = [a.isend(memoryview(m)) for m in msgs]
        outs = [np.empty_like(m) for m in msgs]
        recvs = [b.irecv_into(memoryview(o)) for o in outs]
        wait_all(sends + recvs, Deadline.after(30))
        for m, o in zip(msgs, outs, strict=True):
            assert np.array_equal(m, o)


def test_sink_pieces_are_aligned_and_ordered(name: str) -> None:
    n = (1 << 18) + 12
    x = np.arange(n // 4, dtype=np.float32)
    seen: list[tuple[int, int]] = []
    out = np.zeros_like(x)

    def sink(off: int, piece: memoryview) -> None:
        seen.append((off, len(piece)))
        np.add(
            out[off // 4 : (off + len(piece)) // 4],
            np.frombuffer(piece, np.float32),
            out=out[off // 4 : (off + len(piece)) // 4],
        )

    with _pair(name, slot_bytes=1 << 14, nslots=2) as (a, b):
        wait_all([a.isend(memoryview(x).cast("B")), b.irecv(x.nbytes, sink)], Deadline.after(30))
    assert np.array_equal(out, x)
    offs = [o for o, _ in seen]
    assert offs == sorted(offs) and offs[0] == 0
    assert all(o % 64 == 0 for o in offs)
    assert sum(n for _, n in seen) == x.nbytes


def test_wait_times_out_naming_peer(name: str) -> None:
    with _pair(name) as (a, b):
        r = a.irecv_into(memoryview(bytearray(8)))
        with pytest.raises(TransportError) as ei:
            wait_all([r], Deadline.after(0.3))
        assert "1" in str(ei.value)


def test_closed_peer_is_reported(name: str) -> None:
    with _pair(name) as (a, b):
        b.close()
        r = a.irecv_into(memoryview(bytearray(8)))
        with pytest.raises(TransportError):
            wait_all([r], Deadline.after(10))


def test_close_is_idempotent_and_leaks_no_fds(name: str) -> None:
    before = set(os.listdir("/proc/self/fd"))
    with _pair(name) as (a, b):
        wait_all(
            [a.isend(memoryview(b"hello")), b.irecv_into(memoryview(bytearray(5)))],
            Deadline.after(10),
        )
        a.close()
        a.close()
    after = set(os.listdir("/proc/self/fd"))
    assert after <= before | set(), f"leaked fds: {after - before}"


def test_shared_send_buffer(name: str) -> None:
    """Sends from a shared send buffer reach the sink as views of the peer's
    mapping of the same pages (no copy), and complete only once the sink returns;
    receives into a buffer and slot-sized sends from it still work."""
    with _pair(name, slot_bytes=4096, nslots=2) as (a, b):
        buf = a.send_buffer(3 * 4096 + 5)
        if Cap.SHARED_SEND_BUFFERS not in a.caps:
            assert buf is None and b.recv_buffer() is None
            return
        assert buf is not None and buf.nbytes >= 3 * 4096 + 5
        assert a.send_buffer(buf.nbytes + 1) is None  # the first call fixed the size
        rng = np.random.default_rng(7)
        for n, at in ((3 * 4096 + 5, 0), (100, 4096), (1, buf.nbytes - 1)):
            buf[at : at + n] = rng.integers(0, 256, n, dtype=np.uint8)
            seen: list[tuple[int, int, bytes]] = []
            s = a.isend(memoryview(buf[at : at + n]))
            sent_before_sink_returned = []

            def sink(off: int, v: memoryview, seen=seen, s=s) -> None:
                sent_before_sink_returned.append(s.test())
                got = np.frombuffer(v, np.uint8)
                peer = b.recv_buffer()
                assert peer is not None  # mapped by now, and the view lies in it
                lo = peer.__array_interface__["data"][0]
                addr = got.__array_interface__["data"][0]
                assert lo + at == addr
                seen.append((off, len(v), bytes(v)))

            r = b.irecv(n, sink)
            wait_all([s, r], Deadline.after(30))
            assert seen == [(0, n, bytes(buf[at : at + n]))]
            assert sent_before_sink_returned == [False]
        # a receive into a buffer takes a copy of the described bytes
        buf[:4097] = 9
        got = np.zeros(4097, np.uint8)
        wait_all(
            [a.isend(memoryview(buf[:4097])), b.irecv_into(memoryview(got))], Deadline.after(30)
        )
        assert (got == 9).all()
        # bytes from elsewhere go the usual ways, both directions
        x = np.arange(70_000, dtype=np.uint8)
        gy, gx = _exchange(a, b, x, x[::-1].copy())
        assert np.array_equal(gy, x) and np.array_equal(gx, x[::-1])
        del buf, s, r, sink  # (their views of the buffer: close unmaps it)
    leftovers = [f for f in os.listdir("/dev/shm") if f.startswith("pycoll-")]
    assert not leftovers
