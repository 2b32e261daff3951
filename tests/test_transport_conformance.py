"""One suite for every transport: both ends in one process."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import pytest

from tests.transport_pairs import connected_pair, transport_available
from transports.base import (
    Cap,
    Connection,
    Deadline,
    PeerClosedError,
    TagMismatchError,
    TransportError,
    wait_all,
)

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


def test_a_zero_byte_message_behind_which_another_waits(name: str) -> None:
    """A zero-byte message (a call with a zero count) is received as nothing,
    also when the next call's message has arrived behind it: that one stays for
    its own receive."""
    with _pair(name) as (a, b):
        x = np.arange(5, dtype=np.uint8)
        sends = [a.isend(memoryview(x[:0]), tag=5), a.isend(memoryview(x), tag=7)]
        wait_all(sends, Deadline.after(30))
        time.sleep(0.05)  # both have arrived
        wait_all([b.irecv_into(memoryview(np.empty(0, np.uint8)), tag=5)], Deadline.after(30))
        got = np.zeros_like(x)
        wait_all([b.irecv_into(memoryview(got), tag=7)], Deadline.after(30))
        assert np.array_equal(got, x)


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


def test_copied_sends_arrive_whole_and_skip_direct_reads(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``isend_copied`` delivers the same message as ``isend``, into a buffer or a
    sink; on shm, below COPIED_CMA_MIN_BYTES, it moves through the slots in
    pieces of at most PIECE_BYTES, never by a cross-memory read, while ``isend``
    of the same size does read."""
    from transports import _cma, shm

    reads: list[int] = []
    real = _cma.read

    def counted(pid: int, remote: int, local: int, nbytes: int) -> None:
        if nbytes > 8:  # (not the probe of whether reads work)
            reads.append(nbytes)
        real(pid, remote, local, nbytes)

    monkeypatch.setattr(_cma, "read", counted)
    rng = np.random.default_rng(7)
    with _pair(name, slot_bytes=1 << 20, nslots=2) as (a, b):
        below = shm.COPIED_CMA_MIN_BYTES
        for nbytes in (below // 2 + 3, below - 5):
            x = rng.integers(0, 256, nbytes, dtype=np.uint8)
            out = np.zeros_like(x)
            wait_all(
                [a.isend_copied(memoryview(x)), b.irecv_into(memoryview(out))], Deadline.after(30)
            )
            assert np.array_equal(out, x)
            pieces: list[tuple[int, int]] = []
            sunk = np.zeros_like(x)

            def sink(off: int, piece: memoryview) -> None:
                pieces.append((off, len(piece)))
                sunk[off : off + len(piece)] = np.frombuffer(piece, np.uint8)

            wait_all([a.isend_copied(memoryview(x)), b.irecv(nbytes, sink)], Deadline.after(30))
            assert np.array_equal(sunk, x)
            assert sum(n for _, n in pieces) == nbytes
            if name == "shm":
                assert not reads
                assert len(pieces) > 1 and max(n for _, n in pieces) <= shm.PIECE_BYTES
        if name == "shm" and _cma.available():
            x = rng.integers(0, 256, below - 5, dtype=np.uint8)
            out = np.zeros_like(x)
            wait_all([a.isend(memoryview(x)), b.irecv_into(memoryview(out))], Deadline.after(30))
            assert np.array_equal(out, x) and reads == [below - 5]


def test_pieces_through_the_slots_move_in_compiled_loops(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """shm with its compiled ring: a message of several pieces through the slots
    is put and taken by ``transports._ring``'s loops and arrives whole; a
    receive of another length raises rather than end; pieces larger than a slot
    are refused; a receive of another tag raises with its buffer untouched;
    with the compiled pieces off, Python moves them."""
    if name != "shm":
        pytest.skip("the slots are shm's")
    from transports import shm

    if shm._ring is None:
        pytest.skip("transports._ring is not built")
    ring = shm._ring
    calls = {"put_pieces": 0, "take_pieces": 0}  # calls that moved bytes

    def counted(fn: str) -> Any:
        real = getattr(ring, fn)

        def call(*a: Any) -> Any:
            got = real(*a)
            calls[fn] += got[1] > a[3]  # calls that moved bytes
            return got

        return call

    for fn in calls:
        monkeypatch.setattr(ring, fn, counted(fn))
    rng = np.random.default_rng(11)
    with _pair(name, slot_bytes=64 << 10, nslots=4) as (a, b):
        nbytes = 9 * (64 << 10) + 7  # more pieces than slots, the last a short one
        x = rng.integers(0, 256, nbytes, dtype=np.uint8)
        out = np.zeros_like(x)
        wait_all([a.isend_copied(memoryview(x)), b.irecv_into(memoryview(out))], Deadline.after(30))
        assert np.array_equal(out, x)
        assert calls["put_pieces"] and calls["take_pieces"]
        short = np.zeros(nbytes - 1, np.uint8)
        with pytest.raises(TransportError, match="piece"):
            wait_all(
                [a.isend_copied(memoryview(x)), b.irecv_into(memoryview(short))],
                Deadline.after(30),
            )
        with pytest.raises(ValueError, match="larger than a slot"):
            ring.put_pieces(a._out.ring(a._mm), 0, x, 0, (64 << 10) + 1, 0, 0)  # type: ignore[attr-defined]
    # another tag: refused before any byte reaches the receive's buffer
    with _pair(name, slot_bytes=64 << 10, nslots=4) as (a, b):
        out = np.zeros_like(x)
        with pytest.raises(TagMismatchError):
            wait_all(
                [a.isend_copied(memoryview(x), 9), b.irecv_into(memoryview(out), 5)],
                Deadline.after(30),
            )
        assert not out.any()
    # compiled pieces off (PYCOLL_COMPILED=0): the same message, in Python
    calls.update(put_pieces=0, take_pieces=0)
    with _pair(name, slot_bytes=64 << 10, nslots=4) as (a, b):
        a.compiled = b.compiled = False
        out = np.zeros_like(x)
        wait_all([a.isend_copied(memoryview(x)), b.irecv_into(memoryview(out))], Deadline.after(30))
        assert np.array_equal(out, x)
        assert calls == {"put_pieces": 0, "take_pieces": 0}


def test_compiled_piece_loops_do_not_wait_before_their_first_piece(name: str) -> None:
    """A ``put_pieces`` that finds the ring full and a ``take_pieces`` that finds
    nothing return at once, however many spins they are given (a spin before
    the first piece would hold the caller for hours here): the waits between
    messages are the caller's waiting policy's, which backs off."""
    if name != "shm":
        pytest.skip("the slots are shm's")
    from transports import shm

    if shm._ring is None:
        pytest.skip("transports._ring is not built")
    forever = 1 << 40  # rounds of the CPU's pause: hours
    with _pair(name, slot_bytes=64 << 10, nslots=4) as (a, b):
        x = np.ones(4 << 16, np.uint8)  # four pieces: the ring full, none taken
        ring_out, ring_in = a._out.ring(a._mm), b._in.ring(b._mm)  # type: ignore[attr-defined]
        out = np.zeros(4 << 16, np.uint8)
        assert shm._ring.take_pieces(ring_in, 0, out, 0, 64 << 10, 5, forever) == (0, 0, 0)
        assert shm._ring.put_pieces(ring_out, 0, x, 0, 64 << 10, 5, forever) == (4, 4 << 16)
        more = np.ones(64 << 10, np.uint8)
        assert shm._ring.put_pieces(ring_out, 4, more, 0, 64 << 10, 5, forever) == (4, 0)
        got = shm._ring.take_pieces(ring_in, 0, out, 0, 64 << 10, 5, forever)
        assert got == (4, 4 << 16, 0) and (out == 1).all()


def test_a_copied_message_whose_sender_closes_midway_raises(name: str) -> None:
    """A receive that has taken some of a copied message's pieces when the sender
    closes raises PeerClosedError rather than wait for the rest, or end as if
    whole (shm: the pieces through the slots)."""
    if name != "shm":
        pytest.skip("pieces through slots are shm's")
    from transports import shm

    with _pair(name, slot_bytes=1 << 20, nslots=2) as (a, b):
        x = np.ones(shm.COPIED_CMA_MIN_BYTES - 5, np.uint8)  # (more than two pieces)
        send = a.isend_copied(memoryview(x))
        out = np.zeros_like(x)
        recv = b.irecv_into(memoryview(out))
        assert not send.test() and not recv.test()  # two pieces written, then taken
        assert 0 < recv.off < x.nbytes  # type: ignore[attr-defined]
        a.close()
        with pytest.raises(PeerClosedError):
            wait_all([recv], Deadline.after(10))


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


def test_close_because_names_the_rank_that_failed(name: str) -> None:
    """A side that closes because another rank failed says so on the connection:
    the peer's error names the side (``peer``) and that rank (``cause_rank``); a
    plain close names none."""
    with _pair(name) as (a, b):
        b.close_because(7)
        r = a.irecv_into(memoryview(bytearray(8)))
        with pytest.raises(PeerClosedError) as ei:
            wait_all([r], Deadline.after(10))
        assert ei.value.peer == 1 and ei.value.cause_rank == 7, ei.value
        assert "because rank 7 failed" in str(ei.value)
    with _pair(name) as (a, b):
        b.close()
        r = a.irecv_into(memoryview(bytearray(8)))
        with pytest.raises(PeerClosedError) as ei:
            wait_all([r], Deadline.after(10))
        assert ei.value.peer == 1 and ei.value.cause_rank is None, ei.value


def test_close_because_is_read_behind_untaken_messages_by_a_sender(name: str) -> None:
    """The reason reaches a peer that only sends, past messages it never received
    (tcp skips their frames to the goodbye)."""
    with _pair(name, slot_bytes=1 << 12, nslots=2) as (a, b):
        wait_all([b.isend(memoryview(np.arange(1000, dtype=np.uint8)))], Deadline.after(10))
        b.close_because(3)
        big = np.ones(8 << 20, np.uint8)
        with pytest.raises(PeerClosedError) as ei:
            wait_all([a.isend(memoryview(big))], Deadline.after(10))
        assert ei.value.peer == 1 and ei.value.cause_rank == 3, ei.value


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


def test_another_tag_is_refused_before_the_sink(name: str) -> None:
    with _pair(name, slot_bytes=4096, nslots=2) as (a, b):
        s = a.isend(memoryview(np.ones(5000, np.uint8)), 1)
        with pytest.raises(TagMismatchError) as ei:  # at post or while waiting
            r = b.irecv(5000, lambda off, v: pytest.fail("a piece reached the sink"), 2)
            wait_all([s, r], Deadline.after(30))
        assert (ei.value.got, ei.value.expected, ei.value.peer) == (1, 2, 0)


def test_another_tag_is_refused_before_a_buffer_is_written(name: str) -> None:
    """A small message already arrived (shm takes it when the receive is posted):
    a receive with another tag raises and leaves its buffer as it was."""
    with _pair(name) as (a, b):
        wait_all([a.isend(memoryview(np.ones(8, np.uint8)), 1)], Deadline.after(30))
        time.sleep(0.05)  # it has arrived
        out = np.zeros(8, np.uint8)
        with pytest.raises(TagMismatchError) as ei:  # at post or while waiting
            wait_all([b.irecv_into(memoryview(out), 2)], Deadline.after(30))
        assert (ei.value.got, ei.value.expected, ei.value.peer) == (1, 2, 0)
        assert not out.any(), "a refused message wrote into the buffer"


# --------------------------------------------------------------------------- probe
T1, T2 = 0x0123_4567_89AB_CDEF, (1 << 64) - 2


@contextmanager
def _probing_pair(name: str, **kw: object) -> Iterator[tuple[Connection, Connection]]:
    """A pair whose receiving end can probe (else the test is skipped)."""
    with _pair(name, **kw) as (a, b):
        if Cap.PROBE not in b.caps:
            pytest.skip(f"{name} connections cannot probe")
        yield a, b


def _probe_until(b: Connection, sends: list) -> int:
    """Progress ``sends`` and probe ``b`` until it tells a tag (within 10 s)."""
    end = time.monotonic() + 10
    while time.monotonic() < end:
        for s in sends:
            s.test()
        tag = b.probe()
        if tag is not None:
            return int(tag)
        time.sleep(1e-4)
    pytest.fail("probe never saw the message that was sent")


@pytest.mark.parametrize("nbytes", [1, 5000, 3 * 4096 + 5])
def test_probe_tells_the_next_tag_and_takes_nothing(name: str, nbytes: int) -> None:
    rng = np.random.default_rng(nbytes)
    x = rng.integers(0, 256, nbytes, dtype=np.uint8)
    y = rng.integers(0, 256, 300, dtype=np.uint8)
    with _probing_pair(name, slot_bytes=4096, nslots=2) as (a, b):
        assert b.probe() is None  # nothing sent yet
        s1 = a.isend(memoryview(x), T1)
        s2 = a.isend(memoryview(y), T2)
        assert _probe_until(b, [s1, s2]) == T1
        for _ in range(20):  # the same answer, and the second message stays behind it
            s1.test()
            s2.test()
            assert b.probe() == T1
        got = np.zeros_like(x)
        r1 = b.irecv_into(memoryview(got), T1)
        wait_all([s1, r1], Deadline.after(30))
        assert np.array_equal(got, x)  # whole, though probed first
        assert _probe_until(b, [s2]) == T2
        got2 = np.zeros_like(y)
        wait_all([s2, b.irecv_into(memoryview(got2), T2)], Deadline.after(30))
        assert np.array_equal(got2, y)
        assert b.probe() is None  # all taken


def test_probe_with_a_receive_pending_is_none(name: str) -> None:
    x = np.arange(3 * 4096 + 5, dtype=np.uint32).view(np.uint8)
    with _probing_pair(name, slot_bytes=4096, nslots=2) as (a, b):
        got = np.zeros_like(x)
        r = b.irecv_into(memoryview(got), T2)
        assert b.probe() is None
        s = a.isend(memoryview(x), T2)
        for _ in range(200):  # the message arrives for the pending receive
            s.test()
            assert b.probe() is None
        wait_all([s, r], Deadline.after(30))
        assert np.array_equal(got, x)
        assert b.probe() is None


def test_put_now_and_take_now_are_the_same_messages_as_isend_and_irecv(name: str) -> None:
    """With Cap.QUICK, put_now's message is isend's to an irecv and the reverse;
    take_now takes only the message it describes (size, tag, first bytes),
    leaving any other where it was; a full ring or a queued send makes put_now
    send nothing.  Without the cap both never move a byte."""
    with _pair(name, slot_bytes=1 << 12, nslots=2) as (a, b):
        head = b"HEAD" * 8
        body = np.arange(40, dtype=np.uint8)
        got = np.full(40, 0xA5, np.uint8)
        if Cap.QUICK not in a.caps:
            assert not a.put_now(head, body, 256, 1)
            assert b.take_now(head, got, 256, 1, 100) == 0
            assert b.probe() is None if Cap.PROBE in b.caps else True
            return
        assert b.take_now(head, got, 256, 1, 100) == 0  # nothing there yet
        assert a.put_now(head, body, 256, 1)
        whole = np.full(256, 0xA5, np.uint8)
        wait_all([b.irecv_into(memoryview(whole), tag=1)], Deadline.after(30))
        assert bytes(whole[:32]) == head and np.array_equal(whole[32:72], body)
        sent = np.frombuffer(head + bytes(range(100)), np.uint8)
        pad = np.concatenate([sent, np.zeros(256 - sent.size, np.uint8)])
        wait_all([a.isend(memoryview(pad), tag=2)], Deadline.after(30))
        got100 = np.full(100, 0xA5, np.uint8)
        assert b.take_now(head, got100, 256, 2, 1000) == 1
        assert bytes(got100) == bytes(range(100))
        # another message is left where it is: another tag, size or head
        assert a.put_now(b"X" * 32, body, 256, 3)
        for h, n, t in ((head, 256, 4), (head, 512, 3), (b"Y" * 32, 256, 3)):
            assert b.take_now(h, got, n, t, 1000) == -1
        assert (got == 0xA5).all() and b.probe() == 3
        assert b.take_now(b"X" * 32, got, 256, 3, 1000) == 1 and np.array_equal(got, body)
        # a full ring (two slots) and a queued send: put_now sends nothing
        assert a.put_now(head, body, 256, 5) and a.put_now(head, body, 256, 6)
        assert not a.put_now(head, body, 256, 7)
        for t in (5, 6):
            assert b.take_now(head, got, 256, t, 1000) == 1
        big = np.zeros(3 << 12, np.uint8)
        req = a.isend(memoryview(big), tag=8)  # more than the ring: part of it queued
        assert not a.put_now(head, body, 256, 9)
        out = np.empty_like(big)
        wait_all([req, b.irecv_into(memoryview(out), tag=8)], Deadline.after(30))
        assert a.put_now(head, body, 256, 9) and b.take_now(head, got, 256, 9, 1000) == 1
        with pytest.raises(ValueError):  # more bytes than the message holds
            a.put_now(head, np.zeros(300, np.uint8), 256, 10)
        assert b.take_now(head, got, 256, 10, 0) == 0  # (nothing was sent)


def _helps(name: str, a: Connection, b: Connection) -> None:
    """Skip unless ``a`` copies large messages from both ends (shm with
    cross-memory copies and the compiled claim); then one receive each way, at
    which each side finds it can read the other's memory."""
    if name != "shm" or not getattr(a, "_helps", False):
        pytest.skip(
            "copies from both ends are shm's, with cross-memory copies and transports._ring"
        )
    some = np.ones(1 << 16, np.uint8)  # (beyond the small messages' short way)
    _exchange(a, b, some, some)


def test_large_messages_read_in_place_are_copied_from_both_ends(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Back-to-back messages of isend_copied read in place, of odd sizes from
    1 MiB: each arrives whole, the sender writing some pieces and the receiver
    reading the others (here the sender progresses while the receiver reads
    its first piece of each, and takes every piece left); a sender that never
    progresses leaves them all to the receiver, which completes alone; isend's
    messages are the receiver's to copy alone."""
    from transports import _cma, shm

    writes: list[int] = []
    reads: list[int] = []
    write, read = _cma.write, _cma.read
    with _pair(name, slot_bytes=1 << 16, nslots=4) as (a, b):
        _helps(name, a, b)

        def counted_write(pid: int, remote: int, local: int, nbytes: int) -> None:
            writes.append(nbytes)
            write(pid, remote, local, nbytes)

        def counted_read(pid: int, remote: int, local: int, nbytes: int) -> None:
            reads.append(nbytes)
            read(pid, remote, local, nbytes)
            if sender_helps and b._recvs and b._recvs[0].help:  # type: ignore[attr-defined]
                a._progress_sends()  # type: ignore[attr-defined]

        monkeypatch.setattr(_cma, "write", counted_write)
        monkeypatch.setattr(_cma, "read", counted_read)
        rng = np.random.default_rng(5)
        sender_helps = True
        monkeypatch.setattr(shm, "COPIED_CMA_MIN_BYTES", shm.HELP_MIN_BYTES)
        sizes = [shm.HELP_MIN_BYTES, (3 << 20) + 7, (5 << 20) + 4093, (1 << 20) + 1]
        msgs = [rng.integers(0, 256, k, dtype=np.uint8) for k in sizes]
        outs = [np.zeros_like(m) for m in msgs]
        sends = [a.isend_copied(memoryview(m), tag=i) for i, m in enumerate(msgs)]
        recvs = [b.irecv_into(memoryview(o), tag=i) for i, o in enumerate(outs)]
        wait_all(recvs + sends, Deadline.after(30))
        for m, o in zip(msgs, outs, strict=True):
            assert np.array_equal(m, o)
        assert len(reads) == len(sizes)  # one piece each, the sender wrote the rest
        assert sum(reads) + sum(writes) == sum(sizes)
        writes.clear()
        reads.clear()
        sender_helps = False
        x = rng.integers(0, 256, 3 << 20, dtype=np.uint8)
        out = np.zeros_like(x)
        send = a.isend_copied(memoryview(x), tag=9)
        assert not send.test()  # the descriptor is out; the sender now stays away
        wait_all([b.irecv_into(memoryview(out), tag=9)], Deadline.after(30))
        assert np.array_equal(out, x) and not writes and sum(reads) == x.size
        wait_all([send], Deadline.after(30))
        reads.clear()
        sender_helps = True
        wait_all([a.isend(memoryview(x)), b.irecv_into(memoryview(out))], Deadline.after(30))
        assert np.array_equal(out, x) and not writes and reads == [x.size]


@contextmanager
def _copy_posted(name: str) -> Iterator[tuple[Connection, Connection, np.ndarray, int]]:
    """A pair whose first connection has posted a message of isend_copied that
    is copied from both ends: (sender, receiver, the message, the copy's id)."""
    from transports import shm

    with _pair(name, slot_bytes=1 << 16, nslots=2) as (a, b):
        _helps(name, a, b)
        x = np.ones(shm.COPIED_CMA_MIN_BYTES, np.uint8)
        send = a.isend_copied(memoryview(x))
        assert not send.test()
        yield a, b, x, send.need_tail & 0xFFFFFFFF  # type: ignore[attr-defined]


def _at_first_piece(monkeypatch: pytest.MonkeyPatch, then: Any) -> None:
    """Call ``then()`` at the receiver's first read of a piece of a copy from both
    ends (once, before the read itself)."""
    from transports import _cma, shm

    read = _cma.read

    def first_read(pid: int, remote: int, local: int, nbytes: int) -> None:
        if nbytes >= shm.HELP_PIECE_MIN:  # (not the probe of cross-memory reads)
            monkeypatch.setattr(_cma, "read", read)
            then()
        read(pid, remote, local, nbytes)

    monkeypatch.setattr(_cma, "read", first_read)


def test_a_copy_from_both_ends_whose_sender_closes_with_a_piece_taken_raises(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The sender took a piece and closed without writing it: the receive
    raises PeerClosedError rather than wait for it or end as if whole."""
    from transports import _ring

    with _copy_posted(name) as (a, b, x, ident):

        def sender_takes_one() -> None:  # the sender takes the next piece, then closes
            assert _ring.claim(a._mm, a._help_at[1], ident, 8) == 1  # type: ignore[attr-defined]
            a.close()

        _at_first_piece(monkeypatch, sender_takes_one)
        out = np.zeros_like(x)
        recv = b.irecv_into(memoryview(out))
        with pytest.raises(PeerClosedError):
            wait_all([recv], Deadline.after(10))
        assert recv.help is not None  # type: ignore[attr-defined]  # waited for piece 1


def test_a_receiver_that_closes_mid_copy_takes_the_pieces_left_and_keeps_its_buffer(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A receive whose connection closes during a copy from both ends takes
    every piece not yet taken (the sender can write no more), waits a while
    for the one the sender holds, and then keeps the buffer for good rather
    than let that piece land in reused memory."""
    from transports import _ring, shm

    monkeypatch.setattr(shm, "HELP_CLOSE_SECONDS", 0.2)
    monkeypatch.setattr(shm, "_KEPT", [])
    with _copy_posted(name) as (a, b, x, ident):

        def sender_takes_one() -> None:  # the sender takes piece 1 and never writes it
            assert _ring.claim(a._mm, a._help_at[1], ident, 4) == 1  # type: ignore[attr-defined]
            raise OSError(5, "stop here")  # (the receive fails with piece 0 taken)

        _at_first_piece(monkeypatch, sender_takes_one)
        out = np.zeros_like(x)
        recv = b.irecv_into(memoryview(out))
        with pytest.raises(TransportError):
            wait_all([recv], Deadline.after(10))
        start = time.monotonic()
        b.close()
        assert 0.15 < time.monotonic() - start < 5
        assert len(shm._KEPT) == 1 and np.shares_memory(shm._KEPT[0], out)
        assert _ring.claim(a._mm, a._help_at[1], ident, 4) == -1  # nothing left to take


def test_a_copy_from_both_ends_whose_sender_stops_with_a_piece_taken_times_out(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The sender took a piece and stopped (alive, open, never writing it):
    the receive raises TransportTimeout at its deadline, naming the peer,
    rather than wait on or end as if whole."""
    from transports import _ring
    from transports.base import TransportTimeout

    with _copy_posted(name) as (a, b, x, ident):

        def sender_takes_one() -> None:
            assert _ring.claim(a._mm, a._help_at[1], ident, 4) == 1  # type: ignore[attr-defined]

        _at_first_piece(monkeypatch, sender_takes_one)
        out = np.zeros_like(x)
        recv = b.irecv_into(memoryview(out))
        start = time.monotonic()
        with pytest.raises(TransportTimeout, match=r"\[0\]"):
            wait_all([recv], Deadline.after(0.5))
        assert time.monotonic() - start < 5
        assert recv.help is not None  # type: ignore[attr-defined]


@pytest.mark.parametrize("nbytes", [8, 5000])
def test_a_message_sent_before_the_peer_closed_is_still_delivered(name: str, nbytes: int) -> None:
    """The peer sends its last message and closes before this end looks: while
    the message waits with no receive posted, check_incoming (a wait's liveness
    check between a probe that saw nothing and the arrival) does not call the
    peer gone; the message is probed and received whole, and only then does
    check_incoming raise."""
    x = np.arange(nbytes, dtype=np.uint8)
    with _pair(name, slot_bytes=4096, nslots=2) as (a, b):
        wait_all([b.isend(memoryview(x), T1)], Deadline.after(10))
        b.close()
        time.sleep(0.2)  # the close is visible to a
        for _ in range(3):
            a.check_incoming()
        if Cap.PROBE in a.caps:
            assert a.probe() == T1
            a.check_incoming()
        got = np.zeros_like(x)
        wait_all([a.irecv_into(memoryview(got), T1)], Deadline.after(10))
        assert np.array_equal(got, x)
        end = time.monotonic() + 10
        with pytest.raises(PeerClosedError):
            while time.monotonic() < end:
                a.check_incoming()
                time.sleep(0.01)
