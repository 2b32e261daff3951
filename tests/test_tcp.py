"""Unit tests of the TCP transport, both ends in one process."""

from __future__ import annotations

import os
import socket
import struct
import threading
import time
import zlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import pytest

from transports.base import (
    BlobError,
    ConnectError,
    Deadline,
    PeerClosedError,
    TagMismatchError,
    TransportError,
    TransportOptions,
    wait_all,
)
from transports.tcp import (
    Address,
    Endpoint,
    TcpConnection,
    TcpTransport,
    decode_blob,
    encode_blob,
    frame_header,
    goodbye_header,
    select_interfaces,
)

pytestmark = pytest.mark.timeout(60)

SECRET = b"job-secret"
HDR_BYTES = 40  # a frame header


def _opts(rank: int, size: int = 2, **kw: Any) -> TransportOptions:
    extra = tuple((k, str(v)) for k, v in kw.pop("extra", {}).items())
    kw.setdefault("timeout", 20.0)
    kw.setdefault("secret", SECRET)
    return TransportOptions(rank=rank, size=size, extra=extra, **kw)


def _run_threads(fns: list[Callable[[], object]], timeout: float = 30.0) -> list[object]:
    """Run each function in a thread; return results, re-raising the first error."""
    results: list[object] = [None] * len(fns)
    errors: list[BaseException] = []

    def go(i: int) -> None:
        try:
            results[i] = fns[i]()
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=go, args=(i,)) for i in range(len(fns))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    assert not any(t.is_alive() for t in threads), "a connect thread hung"
    if errors:
        raise errors[0]
    return results


@contextmanager
def tcp_pair(**kw: Any) -> Iterator[tuple[TcpConnection, TcpConnection]]:
    """Yield (rank 0's connection to 1, rank 1's connection to 0)."""
    ts = [TcpTransport(_opts(r, **dict(kw))) for r in (0, 1)]
    try:
        blobs = [t.listen() for t in ts]
        a, b = _run_threads(
            [lambda: ts[0].connect(1, blobs[1]), lambda: ts[1].connect(0, blobs[0])]
        )
        assert isinstance(a, TcpConnection) and isinstance(b, TcpConnection)
        yield a, b
    finally:
        for t in ts:
            t.close()


def _exchange(a: TcpConnection, b: TcpConnection, x: np.ndarray, y: np.ndarray) -> None:
    """Both sides post their sends first, then their receives: a -> b gets x, b -> a y."""
    gx, gy = np.empty_like(x), np.empty_like(y)
    reqs = [
        a.isend(memoryview(x).cast("B")),
        b.isend(memoryview(y).cast("B")),
        a.irecv_into(memoryview(gy).cast("B")),
        b.irecv_into(memoryview(gx).cast("B")),
    ]
    wait_all(reqs, Deadline.after(30))
    assert np.array_equal(gx, x) and np.array_equal(gy, y)


def _fds() -> set[str]:
    return set(os.listdir("/proc/self/fd"))


# --------------------------------------------------------------------------- blob
def _endpoint(rank: int = 3, **kw: Any) -> Endpoint:
    kw.setdefault("host_id", b"h" * 8)
    kw.setdefault("loopback_only", False)
    kw.setdefault("addrs", (Address(4, "198.18.0.1", 24, 4000), Address(6, "fd00::1", 64, 4001)))
    return Endpoint(rank=rank, **kw)


def test_blob_round_trip() -> None:
    ep = _endpoint()
    assert decode_blob(encode_blob(ep)) == ep


@pytest.mark.parametrize(
    "mangle",
    [
        pytest.param(lambda b: b[:-1], id="truncated"),
        pytest.param(lambda b: b[:10], id="header-only"),
        pytest.param(lambda b: b"", id="empty"),
        pytest.param(lambda b: b + b"\0" * 4096, id="oversized"),
        pytest.param(lambda b: b + b"\0" * 24, id="trailing"),
        pytest.param(lambda b: b[:20] + bytes([b[20] ^ 1]) + b[21:], id="bit-flip"),
        pytest.param(lambda b: b"XXXX" + b[4:], id="magic"),
    ],
)
def test_bad_blob_raises(mangle: Callable[[bytes], bytes]) -> None:
    with pytest.raises(BlobError):
        decode_blob(mangle(encode_blob(_endpoint())))


def test_blob_other_version_raises() -> None:
    blob = bytearray(encode_blob(_endpoint()))
    blob[4] = 99
    blob[-4:] = struct.pack("<I", zlib.crc32(bytes(blob[:-4])))
    with pytest.raises(BlobError, match="version"):
        decode_blob(bytes(blob))


def test_blob_carries_no_secret() -> None:
    t = TcpTransport(_opts(0, secret=b"very-secret-value", socket_ifname="lo"))
    with t:
        assert b"very-secret-value" not in t.listen()


def test_connect_rejects_bad_blob() -> None:
    with TcpTransport(_opts(1)) as t:
        t.listen()
        with pytest.raises(BlobError):
            t.connect(0, b"garbage")


# --------------------------------------------------------------------------- routes
def test_can_connect_refuses_loopback_peer_on_other_host() -> None:
    t = TcpTransport(_opts(0))
    here = encode_blob(_endpoint(0, host_id=b"a" * 8))
    there = encode_blob(
        _endpoint(
            1,
            host_id=b"b" * 8,
            loopback_only=True,
            addrs=(Address(4, "127.0.0.1", 8, 9),),
        )
    )
    ok, why = t.can_connect(here, there)
    assert not ok and "loopback" in why
    ok, why = t.can_connect(there, here)
    assert not ok and "loopback" in why


def test_can_connect_prefers_shared_subnet() -> None:
    t = TcpTransport(_opts(0))
    here = encode_blob(_endpoint(0, host_id=b"a" * 8, addrs=(Address(4, "198.18.0.2", 24, 9),)))
    peer = _endpoint(
        1,
        host_id=b"b" * 8,
        addrs=(Address(4, "198.19.5.5", 24, 7), Address(4, "198.18.0.7", 24, 8)),
    )
    ok, why = t.can_connect(here, encode_blob(peer))
    assert ok and "198.18.0.7:8" in why


def test_can_connect_same_namespace_uses_loopback() -> None:
    ts = [TcpTransport(_opts(r, socket_ifname="lo")) for r in (0, 1)]
    blobs = [t.listen() for t in ts]
    ok, why = ts[0].can_connect(blobs[0], blobs[1])
    assert ok and "same network namespace" in why
    assert decode_blob(blobs[0]).loopback_only
    for t in ts:
        t.close()


def test_ifname_selection() -> None:
    addrs, loop_only, desc = select_interfaces("=lo")
    assert loop_only and desc == "lo" and all(a.is_loopback for a in addrs)
    with pytest.raises(ConnectError, match="matches no"):
        select_interfaces("=no-such-interface0")
    addrs, _, _ = select_interfaces("^lo")
    assert all(a.ifname != "lo" for a in addrs)
    addrs, _, _ = select_interfaces(None)
    assert addrs and [a.family for a in addrs] == sorted(a.family for a in addrs)


# --------------------------------------------------------------------------- data
@pytest.mark.parametrize("nsocks", [1, 3])
@pytest.mark.parametrize("nbytes", [0, 1, 63, 64, 4097, 65537, (1 << 20) + 3, 9 << 20])
def test_bidirectional_sizes(nbytes: int, nsocks: int) -> None:
    rng = np.random.default_rng(nbytes)
    x = rng.integers(0, 256, nbytes, dtype=np.uint8)
    y = rng.integers(0, 256, nbytes, dtype=np.uint8)
    with tcp_pair(slot_bytes=1 << 16, extra={"tcp_nsocks": nsocks}) as (a, b):
        _exchange(a, b, x, y)


def test_large_bidirectional_no_deadlock() -> None:
    """Both post 48 MiB sends before any receive: far beyond the socket buffers."""
    x = np.arange(12 << 20, dtype=np.float32)
    y = -x
    with tcp_pair() as (a, b):
        _exchange(a, b, x, y)


def test_send_wait_progresses_receives() -> None:
    """Waiting on a send alone must also drain the receive posted beside it."""
    n = 16 << 20
    x, y = np.ones(n, np.uint8), np.full(n, 2, np.uint8)
    gx, gy = np.empty_like(x), np.empty_like(y)
    with tcp_pair() as (a, b):
        sa, sb = a.isend(memoryview(x)), b.isend(memoryview(y))
        ra, rb = a.irecv_into(memoryview(gy)), b.irecv_into(memoryview(gx))
        deadline = Deadline.after(30)
        while not all([sa.test(), sb.test()]):  # only the sends are tested
            assert not deadline.expired()
        wait_all([ra, rb], Deadline.after(30))
    assert np.array_equal(gx, x) and np.array_equal(gy, y)


def test_many_messages_in_order() -> None:
    with tcp_pair(slot_bytes=1 << 12, extra={"tcp_nsocks": 2}) as (a, b):
        msgs = [np.full(k * 37 + 1, k, dtype=np.uint8) for k in range(200)]
        outs = [np.empty_like(m) for m in msgs]
        sends = [a.isend(memoryview(m)) for m in msgs]
        recvs = [b.irecv_into(memoryview(o)) for o in outs]
        wait_all(sends + recvs, Deadline.after(30))
        for m, o in zip(msgs, outs, strict=True):
            assert np.array_equal(m, o)


def test_zero_bytes_complete_at_once() -> None:
    with tcp_pair() as (a, b):
        assert a.isend(memoryview(b"")).test()
        assert b.irecv(0, lambda off, view: None).test()
        # the stream stays in step after zero-byte messages
        out = bytearray(3)
        wait_all(
            [a.isend(memoryview(b"abc")), b.irecv_into(memoryview(out))],
            Deadline.after(10),
        )
        assert out == b"abc"


@pytest.mark.parametrize("nsocks", [1, 4])
def test_sink_pieces_aligned_and_ordered(nsocks: int) -> None:
    x = np.arange(((1 << 18) + 12) // 4, dtype=np.float32)
    out = np.zeros_like(x)
    seen: list[tuple[int, int]] = []

    def sink(off: int, piece: memoryview) -> None:
        seen.append((off, len(piece)))
        out[off // 4 : (off + len(piece)) // 4] += np.frombuffer(piece, np.float32)

    with tcp_pair(slot_bytes=1000, extra={"tcp_nsocks": nsocks}) as (a, b):
        wait_all(
            [a.isend(memoryview(x).cast("B")), b.irecv(x.nbytes, sink)],
            Deadline.after(30),
        )
    assert np.array_equal(out, x)
    offs = [o for o, _ in seen]
    assert offs == sorted(offs) and offs[0] == 0
    assert all(o % 64 == 0 and (o + n) % 64 == 0 for o, n in seen[:-1])
    assert sum(n for _, n in seen) == x.nbytes


def test_size_mismatch_is_detected() -> None:
    with tcp_pair() as (a, b):
        s = a.isend(memoryview(bytes(100)))
        r = b.irecv_into(memoryview(bytearray(200)))
        with pytest.raises(TransportError, match="out of step") as ei:
            wait_all([s, r], Deadline.after(10))
        assert ei.value.peer == 0


def _probe_until(b: TcpConnection, sends: list[Any]) -> int:
    """Progress ``sends`` and probe ``b`` until it tells a tag (within 10 s)."""
    end = time.monotonic() + 10
    while time.monotonic() < end:
        for s in sends:
            s.test()
        tag = b.probe()
        if tag is not None:
            return tag
        time.sleep(1e-4)
    pytest.fail("probe never saw the message that was sent")


@pytest.mark.parametrize("nsocks", [1, 3])
def test_probe_a_message_of_many_chunks_over_several_sockets(nsocks: int) -> None:
    """Chunk 0 travels on socket 0: a probe reads its header there, and the
    receive posted next takes the whole message from every socket."""
    rng = np.random.default_rng(nsocks)
    x = rng.integers(0, 256, 5 * 4096 + 7, dtype=np.uint8)
    y = rng.integers(0, 256, 2 * 4096, dtype=np.uint8)
    with tcp_pair(slot_bytes=4096, extra={"tcp_nsocks": nsocks}) as (a, b):
        assert len(b._socks) == nsocks
        assert b.probe() is None
        s1, s2 = a.isend(memoryview(x), 7), a.isend(memoryview(y), 9)
        assert _probe_until(b, [s1, s2]) == 7
        assert b.probe() == 7
        got = np.zeros_like(x)
        wait_all([s1, b.irecv_into(memoryview(got), 7)], Deadline.after(30))
        assert np.array_equal(got, x)
        assert _probe_until(b, [s2]) == 9
        got2 = np.zeros_like(y)
        wait_all([s2, b.irecv_into(memoryview(got2), 9)], Deadline.after(30))
        assert np.array_equal(got2, y)
        assert b.probe() is None


@contextmanager
def _raw_peer(chunk: int = 256) -> Iterator[tuple[TcpConnection, socket.socket]]:
    """A connection over one socket of a socketpair, and the raw other end."""
    mine, peer = socket.socketpair()
    mine.setblocking(False)
    conn = TcpConnection(1, [mine], chunk)
    try:
        yield conn, peer
    finally:
        conn.close()
        peer.close()


def _wait_none(conn: TcpConnection) -> bool:
    """Probe for a while; True if it never told a tag."""
    end = time.monotonic() + 0.2
    while time.monotonic() < end:
        if conn.probe() is not None:
            return False
    return True


def test_probe_keeps_a_partial_header() -> None:
    """Half a frame header: no tag yet, and the half is kept; once the rest is in,
    the tag, and the receive posted next goes on from the header probe read."""
    payload = bytes(range(100))
    frame = frame_header(0, 100, 0, 100, 0xABCDEF) + payload
    with _raw_peer() as (conn, peer):
        assert conn.probe() is None
        peer.sendall(frame[:20])
        assert _wait_none(conn)
        peer.sendall(frame[20:])
        assert _probe_until(conn, []) == 0xABCDEF
        out = bytearray(100)
        wait_all([conn.irecv_into(memoryview(out), 0xABCDEF)], Deadline.after(10))
        assert bytes(out) == payload


def test_probe_refuses_a_corrupted_header() -> None:
    frame = bytearray(frame_header(0, 100, 0, 100, 5) + bytes(100))
    frame[3] ^= 0x10
    with _raw_peer() as (conn, peer):
        peer.sendall(frame)
        with pytest.raises(TransportError, match="corrupted"):
            _probe_until(conn, [])
        with pytest.raises(TransportError):  # the connection stays failed
            conn.irecv_into(memoryview(bytearray(100)), 5)


def test_probed_header_is_still_checked_against_the_receive() -> None:
    with _raw_peer() as (conn, peer):
        peer.sendall(frame_header(0, 100, 0, 100, 5) + bytes(100))
        assert _probe_until(conn, []) == 5
        with pytest.raises(TagMismatchError):
            wait_all([conn.irecv_into(memoryview(bytearray(100)), 6)], Deadline.after(10))


def test_goodbye_where_a_header_is_due_names_the_rank_that_failed() -> None:
    """A goodbye read where the next frame header is due: the receive raises
    PeerClosedError with the rank it names, before any byte reaches the sink."""
    with _raw_peer() as (conn, peer):
        peer.sendall(frame_header(0, 100, 0, 100, 5) + bytes(range(100)) + goodbye_header(4))
        out = bytearray(100)
        wait_all([conn.irecv_into(memoryview(out), 5)], Deadline.after(10))
        assert bytes(out) == bytes(range(100))
        with pytest.raises(PeerClosedError, match="closed the connection because rank 4") as ei:
            wait_all([conn.irecv_into(memoryview(bytearray(100)), 5)], Deadline.after(10))
        assert (ei.value.peer, ei.value.cause_rank) == (1, 4)


@pytest.mark.parametrize("cut", [0, 20, 190])  # at a header, inside one, inside a payload
def test_goodbye_behind_untaken_frames_is_found_when_the_peer_is_gone(cut: int) -> None:
    """A peer seen gone (here: its hang-up) is read to its goodbye, past frames no
    receive took, from wherever the receive had stopped (the first ``cut`` bytes
    of the stream arrived while a receive was posted; chunks of 256 bytes)."""
    msg = bytes(range(256)) + bytes(44)
    stream = frame_header(0, 300, 0, 256, 5) + msg[:256] + frame_header(0, 300, 256, 44, 5)
    stream += msg[256:] + frame_header(1, 10, 0, 10, 5) + bytes(10) + goodbye_header(2)
    with _raw_peer() as (conn, peer):
        r = conn.irecv_into(memoryview(bytearray(300)), 5)
        peer.sendall(stream[:cut])
        end = time.monotonic() + 5
        while conn._rx[0].hdr_got < min(cut, HDR_BYTES) and time.monotonic() < end:
            r.test()
        r.test()
        peer.sendall(stream[cut:])
        peer.shutdown(socket.SHUT_WR)
        with pytest.raises(PeerClosedError) as ei:
            conn.check_peer()
        assert (ei.value.peer, ei.value.cause_rank) == (1, 2), ei.value
        assert "because rank 2 failed" in str(ei.value)


def test_close_because_finishes_the_frame_under_way() -> None:
    """A send part-way out when the connection closes with a reason: the rest of
    its frame goes first, then the goodbye, then the end of the stream."""
    chunk = 1 << 18
    mine, peer = socket.socketpair()
    mine.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    mine.setblocking(False)
    conn = TcpConnection(1, [mine], chunk)
    payload = np.arange(2 * chunk, dtype=np.uint8)
    conn.isend(memoryview(payload), 9).test()
    assert 0 < conn._sendq[0][0].sent < HDR_BYTES + chunk  # part of frame 0 is out
    got = bytearray()

    def drain() -> None:
        while data := peer.recv(1 << 16):
            got.extend(data)

    th = threading.Thread(target=drain)
    th.start()
    conn.close_because(6)
    th.join(10)
    peer.close()
    want = frame_header(0, 2 * chunk, 0, chunk, 9) + payload[:chunk].tobytes() + goodbye_header(6)
    assert bytes(got) == want


def test_close_because_does_not_wait_for_a_peer_that_is_gone() -> None:
    """No goodbye waits on a peer that already closed: closing after a failure
    stays quick however many such peers there are."""
    with tcp_pair(extra={"tcp_nsocks": 2}) as (a, b):
        b.close()
        time.sleep(0.05)
        t = time.monotonic()
        a.close_because(5)
        assert time.monotonic() - t < 0.05


def test_wait_times_out_naming_peer() -> None:
    with tcp_pair() as (a, _b):
        r = a.irecv_into(memoryview(bytearray(8)))
        with pytest.raises(TransportError, match="1"):
            wait_all([r], Deadline.after(0.3))


# --------------------------------------------------------------------------- failures
def test_peer_closed_mid_receive() -> None:
    """The sender dies with part of a message on the wire."""
    x = np.ones(32 << 20, np.uint8)
    with tcp_pair() as (a, b):
        s = a.isend(memoryview(x))
        for _ in range(20):
            s.test()
        a.close()
        r = b.irecv_into(memoryview(np.empty_like(x)))
        with pytest.raises(PeerClosedError) as ei:
            wait_all([r], Deadline.after(20))
        assert ei.value.peer == 0 and "rank 0" in str(ei.value)


def test_peer_closed_mid_send() -> None:
    """The receiver goes away while a large send is still going out."""
    x = np.ones(64 << 20, np.uint8)
    with tcp_pair() as (a, b):
        s = a.isend(memoryview(x))
        r = b.irecv_into(memoryview(np.empty_like(x)))
        for _ in range(5):
            s.test()
            r.test()
        b.close()
        with pytest.raises(PeerClosedError) as ei:
            wait_all([s], Deadline.after(20))
        assert ei.value.peer == 1


def test_check_peer_sees_close() -> None:
    with tcp_pair() as (a, b):
        a.check_peer()
        b.close()
        deadline = Deadline.after(5)
        with pytest.raises(PeerClosedError):
            while not deadline.expired():
                a.check_peer()
                time.sleep(0.01)


def test_closed_connection_fails_pending_requests() -> None:
    with tcp_pair() as (a, _b):
        r = a.irecv_into(memoryview(bytearray(8)))
        a.close()
        a.close()
        with pytest.raises(TransportError):
            r.wait(5)
        with pytest.raises(TransportError):
            a.isend(memoryview(b"x"))


# --------------------------------------------------------------------------- setup
def test_bad_secret_and_strangers_are_dropped() -> None:
    """Strangers on the port and a peer with the wrong secret do not stop rank 0."""
    t0 = TcpTransport(_opts(0, size=2))
    good = TcpTransport(_opts(1, size=2))
    evil = TcpTransport(_opts(1, size=2, secret=b"wrong", timeout=5.0))
    try:
        blob0 = t0.listen()
        good.listen()
        port = decode_blob(blob0).addrs[0]
        idle = socket.create_connection(port.sockaddr()[:2])  # says nothing
        noisy = socket.create_connection(port.sockaddr()[:2])
        noisy.sendall(os.urandom(200))
        result: dict[str, Any] = {}

        def accept() -> None:
            try:
                result["conn"] = t0.connect(1, good.listen())
            except BaseException as exc:
                result["error"] = exc

        th = threading.Thread(target=accept)  # rank 0 keeps accepting meanwhile
        th.start()
        with pytest.raises(ConnectError, match="secret"):
            evil.connect(0, blob0)
        conn = good.connect(0, blob0)
        th.join(30)
        assert "error" not in result, result.get("error")
        assert isinstance(result["conn"], TcpConnection)
        out = bytearray(4)
        wait_all(
            [
                conn.isend(memoryview(b"ping")),
                result["conn"].irecv_into(memoryview(out)),
            ],
            Deadline.after(10),
        )
        assert out == b"ping"
        idle.close()
        noisy.close()
    finally:
        for t in (evil, good, t0):
            t.close()


def test_out_of_order_sockets_are_stashed() -> None:
    """Rank 0 waits for rank 2 first while rank 1 dials it first."""
    ts = [TcpTransport(_opts(r, size=3, extra={"tcp_nsocks": 2})) for r in range(3)]
    try:
        blobs = [t.listen() for t in ts]
        order = {0: [2, 1], 1: [0, 2], 2: [1, 0]}

        def run(r: int) -> dict[int, TcpConnection]:
            if r == 2:
                time.sleep(0.3)  # make rank 1's hello reach rank 0 first
            return {p: ts[r].connect(p, blobs[p]) for p in order[r]}

        conns = _run_threads([lambda r=r: run(r) for r in range(3)])  # type: ignore[misc]
        reqs, outs = [], {}
        for r in range(3):
            for p, c in conns[r].items():  # type: ignore[union-attr]
                reqs.append(c.isend(memoryview(bytes([r * 10 + p]) * 5)))
                outs[(p, r)] = bytearray(5)
                reqs.append(c.irecv_into(memoryview(outs[(p, r)])))
        wait_all(reqs, Deadline.after(10))
        for (src, dst), got in outs.items():
            assert got == bytes([src * 10 + dst]) * 5
    finally:
        for t in ts:
            t.close()


def test_connect_times_out_when_peer_never_accepts() -> None:
    t0 = TcpTransport(_opts(0))
    t1 = TcpTransport(_opts(1, timeout=1.0))
    try:
        blob0 = t0.listen()
        start = time.monotonic()
        with pytest.raises(ConnectError) as ei:
            t1.connect(0, blob0)
        assert time.monotonic() - start < 10 and ei.value.peer == 0
    finally:
        t1.close()
        t0.close()


def test_connect_to_self_is_refused() -> None:
    with TcpTransport(_opts(0)) as t, pytest.raises(ConnectError):
        t.connect(0, t.listen())


def test_bad_option_value() -> None:
    with pytest.raises(ValueError, match="tcp_nsocks"):
        TcpTransport(_opts(0, extra={"tcp_nsocks": "zero"}))


def test_no_leaked_fds() -> None:
    before = _fds()
    for nsocks in (1, 3):
        with tcp_pair(extra={"tcp_nsocks": nsocks}) as (a, b):
            out = bytearray(5)
            wait_all(
                [a.isend(memoryview(b"hello")), b.irecv_into(memoryview(out))],
                Deadline.after(10),
            )
            a.close()
            a.close()
    t = TcpTransport(_opts(0))
    t.listen()
    t.close()
    t.close()
    assert _fds() <= before, f"leaked fds: {_fds() - before}"
    assert threading.active_count() == 1


# ----------------------------------------------------------------------------- issue 33, 8 and 11
def test_listeners_close_once_every_peer_is_connected() -> None:
    """After init nobody serves the listeners: they must refuse, not queue strangers."""
    from tests.inproc import communicators

    with communicators(3, transports=("tcp",), timeout=20) as comms:
        for c in comms:
            assert all(c.transport_of(p) == "tcp" for p in range(3) if p != c.rank)
            tr = c._engine.wiring.transports[0]
            assert isinstance(tr, TcpTransport)
            assert tr._endpoint is not None
            for a in tr._endpoint.addrs:
                with (
                    socket.socket(socket.AF_INET if a.family == 4 else socket.AF_INET6) as s,
                    pytest.raises(ConnectionRefusedError),
                ):
                    s.settimeout(5)
                    s.connect(a.sockaddr())
        out = _run_threads([lambda c=c: c.allreduce(np.full(5, c.rank + 1.0)) for c in comms])
        for o in out:
            assert np.array_equal(o, np.full(5, 6.0))


EMFILE_SCRIPT = r"""
import logging, resource, socket, sys, time
from transports.base import TransportOptions
from transports.tcp import TcpTransport, decode_blob
logging.basicConfig(level=logging.WARNING, stream=sys.stdout, format="LOG %(message)s")
t0 = TcpTransport(TransportOptions(rank=0, size=2, timeout=1.5, secret=b"s"))
ep = decode_blob(t0.listen())
t1 = TcpTransport(TransportOptions(rank=1, size=2, timeout=1.5, secret=b"s"))
blob1 = t1.listen()
a = ep.addrs[0]
stranger = socket.create_connection((a.host, a.port))  # waits in the backlog
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (64, hard))
hog = []
try:
    while True:
        hog.append(open("/dev/null"))
except OSError:
    hog.pop().close()  # room for the selector's own descriptor, none for accept()
cpu = time.process_time()
try:
    t0.connect(1, blob1)  # rank 1 never dials; every accept() meets EMFILE
except Exception as exc:
    print("RAISED", type(exc).__name__)
print("CPU", time.process_time() - cpu)
"""


@pytest.mark.timeout(60)
def test_accept_backs_off_when_out_of_descriptors() -> None:
    """EMFILE in accept(): no busy loop, and a warning at most about once a second."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    proc = subprocess.run(
        [sys.executable, "-c", EMFILE_SCRIPT],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=50,
        env={**os.environ, "PYTHONPATH": str(root)},
    )
    out = proc.stdout
    assert "RAISED ConnectError" in out, out + proc.stderr
    warnings = [line for line in out.splitlines() if line.startswith("LOG tcp: accept failed")]
    assert 1 <= len(warnings) <= 4, f"{len(warnings)} warnings in 1.5 s:\n{out[-2000:]}"
    cpu = float(out.split("CPU ")[1].split()[0])
    assert cpu < 0.5, f"{cpu:.2f} s of CPU in a 1.5 s wait: a busy loop"
