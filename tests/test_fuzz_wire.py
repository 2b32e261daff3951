"""Fuzzing of what crosses a process boundary: endpoint blobs and wire formats.

* Endpoint blobs of shm, tcp and rdma (truncated, corrupted, oversized, other
  versions, well-formed but lying): parsing raises BlobError and nothing else;
  ``can_connect``/``connect`` answer with a verdict or a ConnectError.
* The tcp frame stream, fed raw through a socketpair: a clear TransportError on
  the receiving side (or the right bytes), never another exception, never a
  write outside the posted range, never a hang.
* The soft RDMA provider's request stream, fed raw to a context's listener
  after a valid hello: registered memory outside the checked target stays
  untouched and the progress thread survives.

Examples are bounded and derandomized so CI stays quick and repeatable.
"""

from __future__ import annotations

import logging
import socket
import struct
import time
import zlib

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from transports.base import (
    BlobError,
    ConnectError,
    Deadline,
    TransportError,
    TransportOptions,
    wait_all,
)
from transports.rdma.transport import BLOB_CRC, BLOB_HEADER, Endpoint
from transports.shm import ShmTransport, _Identity
from transports.tcp import _FRAME, TcpConnection, TcpTransport, decode_blob, frame_header

pytestmark = pytest.mark.timeout(180)

FUZZ = settings(
    max_examples=150,
    deadline=3000,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


def _opts(rank: int, **kw: object) -> TransportOptions:
    return TransportOptions(rank=rank, size=2, timeout=5.0, secret=b"k", socket_ifname="lo", **kw)  # type: ignore[arg-type]


@st.composite
def mangled(draw: st.DrawFn, blob: bytes) -> bytes:
    """A blob truncated, extended, bit-flipped, overwritten or replaced."""
    how = draw(st.sampled_from(["truncate", "extend", "flip", "overwrite", "random", "empty"]))
    b = bytearray(blob)
    if how == "truncate":
        return bytes(b[: draw(st.integers(0, max(0, len(b) - 1)))])
    if how == "extend":
        return bytes(b + draw(st.binary(min_size=1, max_size=4096)))
    if how == "flip":
        for _ in range(draw(st.integers(1, 8))):
            i = draw(st.integers(0, len(b) - 1))
            b[i] ^= 1 << draw(st.integers(0, 7))
        return bytes(b)
    if how == "overwrite":
        i = draw(st.integers(0, len(b) - 1))
        patch = draw(st.binary(min_size=1, max_size=16))
        b[i : i + len(patch)] = patch
        return bytes(b[: len(blob)])
    if how == "empty":
        return b""
    return draw(st.binary(max_size=2048))


# --------------------------------------------------------------------------- blobs
@pytest.fixture(scope="module")
def shm_blob():
    t = ShmTransport(_opts(0))
    yield t, t.listen()
    t.close()


@FUZZ
@given(data=st.data())
def test_shm_blob_fuzz(shm_blob, data):
    t, good = shm_blob
    bad = data.draw(mangled(good))
    try:
        _Identity.unpack(bad)
    except BlobError:
        pass
    try:
        t.can_connect(good, bad)
    except BlobError:
        pass
    if bad != good:
        with pytest.raises(ConnectError):
            t.connect(1, bad if len(bad) != len(good) else bad[:-1])


def test_shm_blob_other_version_and_type():
    good = _Identity(0, b"\1" * 8).pack()
    other = bytearray(good)
    other[4:6] = struct.pack("<H", 99)
    for bad in (bytes(other), b"XXXX" + good[4:], None, 42, "text"):
        with pytest.raises(BlobError):
            _Identity.unpack(bad)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def tcp_blob():
    t = TcpTransport(_opts(1))
    yield t, t.listen()
    t.close()


@FUZZ
@given(data=st.data())
def test_tcp_blob_fuzz(tcp_blob, data):
    t, good = tcp_blob
    bad = data.draw(mangled(good))
    if bad == good:
        return
    try:
        decode_blob(bad)
    except BlobError:
        pass
    try:
        t.can_connect(good, bad)
    except BlobError:
        pass


@FUZZ
@given(
    fields=st.tuples(
        st.integers(0, 255),  # version
        st.integers(0, 255),  # flags
        st.integers(0, 255),  # naddr
        st.integers(0, 255),  # zero
        st.integers(0, 2**32 - 1),  # rank
    ),
    addr=st.tuples(st.integers(0, 255), st.integers(0, 255), st.integers(0, 65535)),
)
def test_tcp_blob_well_formed_lies(tcp_blob, fields, addr):
    """Right CRC, wrong contents: still BlobError or a clean answer."""
    t, good = tcp_blob
    version, flags, naddr, zero, rank = fields
    head = struct.pack("<4sBBBBI8s", b"PCTC", version, flags, naddr, zero, rank, b"h" * 8)
    body = head + struct.pack("<BBHI16s", *addr, 0, b"\x7f\0\0\1".ljust(16, b"\0")) * max(
        1, min(naddr, 20)
    )
    blob = body + struct.pack("<I", zlib.crc32(body))
    try:
        ep = decode_blob(blob)
    except BlobError:
        return
    ok, why = t.can_connect(good, blob)
    assert isinstance(ok, bool) and why
    if ep.rank != 0:
        with pytest.raises(ConnectError):
            t.connect(0, blob)


def _rdma_blob(**kw: object) -> bytes:
    ep = Endpoint(
        provider=1, port=1, mtu=3, lid=4242, rank=0, size=2, nslots=4, slot_bytes=4096,
        rkey=7, slots_addr=1 << 20, gid=b"g" * 16, fabric=b"f" * 16, qps=[(0, 0), (17, 5)],
    )  # fmt: skip
    for k, v in kw.items():
        setattr(ep, k, v)
    return ep.pack()


@FUZZ
@given(data=st.data())
def test_rdma_blob_fuzz(data):
    good = _rdma_blob()
    bad = data.draw(mangled(good))
    if bad == good:
        return
    with pytest.raises(BlobError):
        Endpoint.unpack(bad)


@FUZZ
@given(
    version=st.integers(0, 255),
    provider=st.integers(0, 255),
    mtu=st.integers(0, 255),
    rank=st.integers(0, 2**32 - 1),
    size=st.integers(0, 70),
    nslots=st.integers(0, 2**32 - 1),
    slot_bytes=st.integers(0, 2**32 - 1),
)
def test_rdma_blob_well_formed_lies(version, provider, mtu, rank, size, nslots, slot_bytes):
    head = BLOB_HEADER.pack(
        b"PCRD",
        version,
        provider,
        1,
        mtu,
        1,
        rank,
        size,
        nslots,
        slot_bytes,
        7,
        0,
        b"g" * 16,
        b"f" * 16,
        0,
        0,
    )
    body = head + b"\0" * 8 * size
    blob = body + BLOB_CRC.pack(zlib.crc32(body))
    try:
        ep = Endpoint.unpack(blob)
    except BlobError:
        return
    assert ep.rank < ep.size and ep.nslots >= 1 and ep.slot_bytes % 64 == 0


# --------------------------------------------------------------------------- tcp frames
CHUNK = 256


def _frames(nbytes: int, seq: int = 0) -> list[bytes]:
    out = []
    payload = bytes((i * 7 + 3) & 0xFF for i in range(nbytes))
    for off in range(0, nbytes, CHUNK):
        n = min(CHUNK, nbytes - off)
        out.append(frame_header(seq, nbytes, off, n, 0) + payload[off : off + n])
    return out


@st.composite
def frame_stream(draw: st.DrawFn) -> tuple[int, bytes, bool]:
    """(posted receive size, raw bytes the peer sends, whether they are valid)."""
    nbytes = draw(st.integers(1, 4 * CHUNK))
    frames = _frames(nbytes)
    how = draw(
        st.sampled_from(["valid", "truncate", "flip", "field", "garbage", "extra", "reorder"])
    )
    raw = bytearray(b"".join(frames))
    if how == "valid":
        return nbytes, bytes(raw), True
    if how == "truncate":
        return nbytes, bytes(raw[: draw(st.integers(0, len(raw) - 1))]), False
    if how == "flip":
        # headers only: a flip inside a payload is valid framing of other bytes
        j = draw(st.integers(0, len(frames) - 1))
        f = bytearray(frames[j])
        f[draw(st.integers(0, _FRAME.size - 1))] ^= 1 << draw(st.integers(0, 7))
        frames[j] = bytes(f)
        return nbytes, b"".join(frames), False
    if how == "field":
        j = draw(st.integers(0, len(frames) - 1))
        f = bytearray(frames[j])
        fields = list(_FRAME.unpack(bytes(f[: _FRAME.size])))
        k = draw(st.sampled_from([1, 2, 3, 4, 5, 6]))
        v = draw(st.sampled_from([0, 1, 2**16 - 1, 2**31, 2**32 - 1, 2**63, 2**64 - 1, CHUNK + 1]))
        limit = [0xFFFF, 0xFFFF, 2**32 - 1, 2**64 - 1, 2**64 - 1, 2**32 - 1, 2**64 - 1][k]
        fields[k] = min(v, limit)
        if fields == list(_FRAME.unpack(bytes(f[: _FRAME.size]))):
            fields[k] ^= 1
        head = struct.pack("<HHIQQIQ", *fields[:7])
        frames[j] = head + struct.pack("<I", zlib.crc32(head)) + bytes(f[_FRAME.size :])
        valid = k == 1  # the flags field is not interpreted
        return nbytes, b"".join(frames), valid
    if how == "garbage":
        return nbytes, draw(st.binary(min_size=1, max_size=2048)), False
    if how == "extra":
        return nbytes, bytes(raw) + draw(st.binary(min_size=1, max_size=64)), True
    if len(frames) < 2:
        return nbytes, bytes(raw[:-1]), False
    frames[0], frames[1] = frames[1], frames[0]
    return nbytes, b"".join(frames), False


@FUZZ
@given(case=frame_stream())
def test_tcp_frames_fuzz(case):
    nbytes, raw, valid = case
    a, b = socket.socketpair()
    a.setblocking(False)
    conn = TcpConnection(1, [a], CHUNK)
    guard = 64
    buf = np.full(nbytes + 2 * guard, 0xA5, np.uint8)
    seen: list[tuple[int, int]] = []

    def sink(off: int, piece: memoryview) -> None:
        assert 0 <= off and off + len(piece) <= nbytes, (off, len(piece), nbytes)
        seen.append((off, len(piece)))
        buf[guard + off : guard + off + len(piece)] = np.frombuffer(piece, np.uint8)

    try:
        req = conn.irecv(nbytes, sink)
        b.sendall(raw)
        b.shutdown(socket.SHUT_WR)
        start = time.monotonic()
        try:
            wait_all([req], Deadline.after(10))
            ok = True
        except TransportError as exc:
            ok = False
            assert str(exc) and exc.peer == 1
        assert time.monotonic() - start < 5, "the receiver hung"
        assert (buf[:guard] == 0xA5).all() and (buf[-guard:] == 0xA5).all(), "write out of bounds"
        if ok:
            want = bytes((i * 7 + 3) & 0xFF for i in range(nbytes))
            assert bytes(buf[guard:-guard]) == want
        elif valid:
            pytest.fail("a valid stream was refused")
    finally:
        conn.close()
        b.close()


# --------------------------------------------------------------------------- soft RDMA
class _EngineErrors(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@st.composite
def rdma_requests(draw: st.DrawFn) -> list[tuple[int, int, int, int, int, int]]:
    """(op, psn delta, rkey choice, raddr offset, length, payload bytes) per request."""
    n = draw(st.integers(1, 4))
    return [
        (
            draw(st.integers(0, 8)),
            draw(st.sampled_from([0, 0, 0, 1, -1, 2**23])),
            draw(st.sampled_from([0, 0, 1, 2])),
            draw(st.sampled_from([0, 1, 4095, 4096, -1, -4096, 2**40])) + draw(st.integers(0, 64)),
            draw(st.sampled_from([0, 1, 64, 4096, 4097, 2**20, 2**32 - 1])),
            draw(st.integers(0, 512)),
        )
        for _ in range(n)
    ]


@settings(FUZZ, max_examples=40)
@given(reqs=rdma_requests())
def test_soft_rdma_requests_fuzz(reqs):
    from tests.test_security import soft_handshake
    from tests.test_soft_verbs import RW, Node, v
    from transports.rdma.soft import rc

    errors = _EngineErrors()
    lg = logging.getLogger("transports.rdma.soft.engine")
    lg.addHandler(errors)
    a, b = Node(), Node()
    try:
        b.qp.to_rts(b.attr_for(a))
        page = 4096
        mem = np.zeros(3 * page, np.uint8)
        target = mem[page : 2 * page]
        mr = v.MR(b.pd, page, RW, address=target)
        for _ in range(4):
            b.qp.post_recv(v.RecvWR(wr_id=1))
        s = socket.create_connection(("127.0.0.1", b.ctx.query_port(1).lid), timeout=5)
        soft_handshake(
            s,
            b.ctx.secret,
            b.qp.qp_num,
            a.qp.qp_num,
            bytes(a.ctx.query_gid(1, 0)),
            a.ctx.query_port(1).lid,
        )
        psn = 7
        for op, dpsn, key, off, length, nsend in reqs:
            rkey = [mr.rkey, mr.rkey ^ 0x5A5A, 0][key]
            raddr = (mr.buf + off) % 2**64
            hdr = rc.REQ.pack(op, (psn + dpsn) % 2**24, rkey, 0, raddr, length)
            payload = b"\xee" * (0 if op == rc.OP_READ else min(length, nsend))
            try:
                s.sendall(hdr + payload)
            except OSError:
                break
            psn += 1
        time.sleep(0.05)
        s.close()
        time.sleep(0.05)
        assert not mem[:page].any() and not mem[2 * page :].any(), "write outside the MR"
        assert b.ctx.engine._thread.is_alive(), "the progress thread died"
        assert not errors.records, [r.getMessage() for r in errors.records]
        # the context still works for a real peer
        b2 = Node()
        b2.close()
    finally:
        lg.removeHandler(errors)
        a.close()
        b.close()
