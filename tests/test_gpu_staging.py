"""The host-staging pipeline of device bytes, on CPU: a fake CUDA runtime whose
"device" memory is host memory, over a real shm connection pair.

Checks that pieces of several requests to one peer never interleave (lanes),
that a later request progresses the earlier ones of its lane, and that every
byte arrives; the GPU suite (tests/gpu) covers the same paths on a device.
"""

from __future__ import annotations

import ctypes
import itertools
from types import SimpleNamespace

import numpy as np
import pytest

from pycoll.gpu.staging import Pinned, StagedRecv, StagedSend, piece_bytes
from tests.transport_pairs import connected_pair
from transports.base import Deadline, wait_all

pytestmark = pytest.mark.timeout(60)


class _FakeRuntime:
    """memcpyAsync is a memmove; an event reports 'not ready' once, then done."""

    def __init__(self) -> None:
        self._ids = itertools.count(1)
        self._polled: set[int] = set()
        self.registered: list[tuple[int, int]] = []
        self.waits: list[tuple[int, int]] = []

    def memcpyAsync(self, dst, src, n, kind, stream):
        ctypes.memmove(dst, src, n)

    def eventCreateWithFlags(self, flags):
        return next(self._ids)

    def eventRecord(self, ev, stream):
        self._polled.discard(ev)

    def eventQuery(self, ev):
        if ev in self._polled:
            return 0
        self._polled.add(ev)
        return 600

    def streamWaitEvent(self, stream, ev, flags):
        self.waits.append((stream, ev))

    def eventSynchronize(self, ev):
        self._polled.add(ev)

    def eventDestroy(self, ev):
        pass

    def hostRegister(self, ptr, n, flags):
        self.registered.append((ptr, n))

    def hostUnregister(self, ptr):
        self.registered.remove(next(r for r in self.registered if r[0] == ptr))


def _pool() -> Pinned:
    p = Pinned.__new__(Pinned)
    p._rt = _FakeRuntime()
    p._cp = SimpleNamespace(cuda=SimpleNamespace(alloc_pinned_memory=bytearray))
    p._bufs, p._events, p._lanes = {}, [], {}
    p._shared, p._peer_bufs, p._registered = {}, {}, []
    p._device, p._side, p._reading = 0, SimpleNamespace(ptr=7), {}
    p.legs = None
    return p


class _Dev:
    """A host array posing as a CuPy array (``.data.ptr``)."""

    def __init__(self, a: np.ndarray) -> None:
        self.a = a
        self.nbytes = a.nbytes
        self.dtype = a.dtype
        self.data = SimpleNamespace(ptr=a.ctypes.data)


def test_piece_bytes() -> None:
    assert piece_bytes(4 << 20) == 1 << 20
    assert piece_bytes(16 << 20) == 4 << 20  # the default device chunk
    assert piece_bytes(1 << 30) == 4 << 20
    assert piece_bytes(4096) == 64 << 10
    assert piece_bytes(1 << 20) % 64 == 0


@pytest.mark.parametrize("name", ["shm", "shm-copy", "tcp"])
@pytest.mark.parametrize("order", ["all", "later_first"])
def test_staged_messages_do_not_interleave(name: str, order: str) -> None:
    """shm: pieces go through the sender's shared send buffer, read in place by
    the receiver; shm-copy: the sender has none (no room), so the receiver's
    in-place sink meets slots and cross-memory reads instead; tcp: pinned copies."""
    rng = np.random.default_rng(1)
    sizes = [200_003, 150_001, 64 << 10, 7]
    srcs = [rng.integers(0, 256, n, dtype=np.uint8) for n in sizes]
    outs = [_Dev(np.zeros(n, np.uint8)) for n in sizes]
    piece = 64 << 10
    stream = SimpleNamespace(ptr=0)
    with connected_pair(name.removesuffix("-copy"), slot_bytes=4096, nslots=2) as (a, b):
        if name == "shm-copy":
            a.send_buffer = lambda nbytes: None  # type: ignore[method-assign]
        pa, pb = _pool(), _pool()
        sends = [StagedSend(a, s.ctypes.data, s.nbytes, piece, 0, pa) for s in srcs]
        recvs = [StagedRecv(b, o, None, None, piece, stream, pb) for o in outs]
        if order == "all":
            wait_all(sends + recvs, Deadline.after(30))
        else:  # wait on the last receive first: it must drive the earlier ones
            wait_all([*sends, recvs[-1]], Deadline.after(30))
            wait_all(recvs, Deadline.after(30))
        regs = [p._rt.registered[:] for p in (pa, pb)]  # type: ignore[attr-defined]
        if name == "shm":
            # no pinned buffer anywhere: every byte went through the shared buffer,
            # registered once by each side
            assert not pa._bufs and not pb._bufs
            assert [len(r) for r in regs] == [1, 1]
            assert regs[0][0][1] >= 2 * piece
        else:
            assert pa._bufs and pb._bufs and regs == [[], []]
        for p in (pa, pb):
            p.close()
            assert not p._rt.registered  # type: ignore[attr-defined]
    for s, o in zip(srcs, outs, strict=True):
        assert np.array_equal(s, o.a)
    assert not any(pa._lanes.values()) and not any(pb._lanes.values())


def test_d2h_stream_ordering() -> None:
    """A D2H copy runs on its own stream after the collective's stream, and a write
    on the collective's stream waits for the D2H copies still reading its bytes."""
    p = _pool()
    rt = p._rt  # type: ignore[attr-defined]
    dev, host = np.arange(100, dtype=np.uint8), np.zeros(100, np.uint8)
    lo = dev.ctypes.data
    ev = p.d2h(host.ctypes.data, lo + 10, 50, stream=5)
    assert np.array_equal(host[:50], dev[10:60])
    assert [w[0] for w in rt.waits] == [7]  # the D2H stream waited for stream 5
    rt.waits.clear()
    p.before_write(lo + 59, 1, 5)  # the last byte it reads
    p.before_write(lo + 60, 40, 5)  # just past it
    p.before_write(lo, 10, 5)  # just before it
    assert rt.waits == [(5, ev)]
    p.read_done(ev)
    rt.waits.clear()
    p.before_write(lo, 100, 5)
    assert rt.waits == []


@pytest.mark.parametrize("name", ["shm", "shm-copy", "tcp"])
def test_staged_pieces_carry_the_call_tag(name: str) -> None:
    """Every staged piece carries its call's tag: pieces of the same call arrive;
    a receive posted by another call raises TagMismatchError at the first
    piece, and no byte reaches its output."""
    from transports.base import TagMismatchError

    src = np.arange(200_003, dtype=np.uint32).view(np.uint8)[:200_003]
    piece, stream = 64 << 10, SimpleNamespace(ptr=0)
    for mine, theirs in [((5 << 32) | 9, (5 << 32) | 9), ((5 << 32) | 9, (6 << 32) | 9)]:
        out = _Dev(np.zeros(src.nbytes, np.uint8))
        with connected_pair(name.removesuffix("-copy"), slot_bytes=4096, nslots=2) as (a, b):
            if name == "shm-copy":
                a.send_buffer = lambda nbytes: None  # type: ignore[method-assign]
            pa, pb = _pool(), _pool()
            send = StagedSend(a, src.ctypes.data, src.nbytes, piece, 0, pa, theirs)
            recv = StagedRecv(b, out, None, None, piece, stream, pb, tag=mine)
            if mine == theirs:
                wait_all([send, recv], Deadline.after(30))
                assert np.array_equal(src, out.a)
            else:
                with pytest.raises(TagMismatchError):
                    wait_all([recv, send], Deadline.after(10))
                assert not out.a.any()
            for p in (pa, pb):
                p.close()
