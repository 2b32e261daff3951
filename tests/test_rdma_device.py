"""The RDMA transport's device paths (dmabuf, gdr) on a machine without a GPU.

:class:`FakeCuda` stands in for :class:`transports.rdma.cuda.CudaDriver`: its
"device memory" is host pages of a memfd, its dma-buf export hands out a
duplicate of that memfd (which the soft provider maps, as it does for any
host dma-buf), its copies are ``memmove`` and its events complete when told.
Everything above CUDA runs for real: device slots, dma-buf registration with
a sub-page offset, the fd closed after registration, the gdr flush READ,
DeviceSpan sinks, and credits held until a sink's GPU work is done.  The same
paths with real CUDA run in ``tests/gpu/test_rdma_gpu.py``.
"""

from __future__ import annotations

import ctypes
import mmap
import os

import numpy as np
import pytest

from transports.base import (
    Cap,
    Deadline,
    DeviceSpan,
    TransportError,
    TransportOptions,
    wait_all,
)
from transports.rdma import RdmaTransport
from transports.rdma.caps import GpuInfo

SKEW = 256  # allocations start this far into a page: dma-buf MRs get an offset


class FakeCuda:
    name = "fake"

    def __init__(self) -> None:
        self.allocs: dict[int, tuple[int, mmap.mmap, int]] = {}  # ptr -> (fd, map, base)
        self.exported: list[int] = []
        self.hold_events = False
        self.queries = 0
        self.syncs = 0

    def gpus(self) -> tuple[list[GpuInfo], str]:
        return [GpuInfo(0, "fake GPU", "0000:00:00.0", True)], ""

    def alloc(self, nbytes: int) -> int:
        size = (nbytes + SKEW + mmap.PAGESIZE - 1) // mmap.PAGESIZE * mmap.PAGESIZE
        fd = os.memfd_create("pycoll-fake-gpu")
        os.ftruncate(fd, size)
        m = mmap.mmap(fd, size)
        base = ctypes.addressof(ctypes.c_char.from_buffer(m))
        self.allocs[base + SKEW] = (fd, m, base)
        return base + SKEW

    def free(self, ptr: int) -> None:
        fd, m, _ = self.allocs.pop(ptr)
        os.close(fd)
        try:
            m.close()
        except BufferError:  # still mapped by a live MR view; goes with it
            pass

    def copy_dtod(self, dst: int, src: int, n: int, stream: int) -> None:
        ctypes.memmove(dst, src, n)

    copy_dtoh = copy_htod = copy_dtod

    def synchronize(self, stream: int) -> None:
        self.syncs += 1

    def record(self, stream: int) -> list[bool]:
        return [False]

    def done(self, ev: list[bool]) -> bool:
        self.queries += 1
        return not self.hold_events

    def export_dmabuf(self, base: int, length: int) -> int:
        for fd, _m, b in self.allocs.values():
            if b == base:
                dup = os.dup(fd)
                self.exported.append(dup)
                return dup
        raise AssertionError(f"export of {base:#x} is not the start of an allocation")

    def soft_dma_ptr(self, base: int) -> None:
        return None  # the soft provider maps the memfd

    def close(self) -> None:
        for ptr in list(self.allocs):
            self.free(ptr)


def options(rank: int, memory: str, slot_bytes: int = 4096, nslots: int = 4) -> TransportOptions:
    return TransportOptions(
        rank=rank,
        size=2,
        timeout=30.0,
        slot_bytes=slot_bytes,
        nslots=nslots,
        extra=(
            ("rdma_provider", "soft"),
            ("rdma_memory", memory),
            ("soft_caps", "dmabuf,peermem"),
        ),
    )


@pytest.fixture
def make_pair():
    made = []

    def make(mem0: str, mem1: str | None = None, **kw):
        cudas = [FakeCuda(), FakeCuda()]
        ts = [
            RdmaTransport(options(r, m, **kw), cuda=cudas[r])
            for r, m in enumerate((mem0, mem1 or mem0))
        ]
        made.append((ts, cudas))
        blobs = [t.listen() for t in ts]
        return ts, cudas, [ts[0].connect(1, blobs[1]), ts[1].connect(0, blobs[0])]

    yield make
    for ts, cudas in made:
        for t in ts:
            t.close()
        for c in cudas:
            c.close()


def device_array(cuda: FakeCuda, data: np.ndarray) -> DeviceSpan:
    ptr = cuda.alloc(data.nbytes)
    ctypes.memmove(ptr, data.ctypes.data, data.nbytes)
    return DeviceSpan(ptr, data.nbytes, 0, stream=0)


def device_sink(out: np.ndarray, spans: list[DeviceSpan]):
    def sink(off: int, span: DeviceSpan) -> None:
        assert isinstance(span, DeviceSpan) and span.device == 0
        spans.append(span)
        ctypes.memmove(out.ctypes.data + off, span.ptr, span.nbytes)

    return sink


@pytest.mark.timeout(60)
@pytest.mark.parametrize("path", ["dmabuf", "gdr"])
@pytest.mark.parametrize("nbytes", [1, 4097, 3 * 4096 + 5, 1 << 18])
def test_device_to_device_both_ways(make_pair, path, nbytes):
    ts, cudas, (c0, c1) = make_pair(path)
    assert c0.transport == c1.transport == f"rdma:{path}"
    assert Cap.DEVICE in c0.caps and Cap.DEVICE in c1.caps
    rng = np.random.default_rng(nbytes)
    a = rng.integers(0, 256, nbytes, dtype=np.uint8)
    b = rng.integers(0, 256, nbytes, dtype=np.uint8)
    ra, rb = np.zeros_like(a), np.zeros_like(b)
    spans: list[DeviceSpan] = []
    reqs = [
        c0.isend_device(device_array(cudas[0], a)),
        c1.isend_device(device_array(cudas[1], b)),
        c0.irecv_device(nbytes, device_sink(rb, spans), 0),
        c1.irecv_device(nbytes, device_sink(ra, spans), 0),
    ]
    wait_all(reqs, Deadline.after(30))
    np.testing.assert_array_equal(ra, a)
    np.testing.assert_array_equal(rb, b)
    assert all(c.syncs > 0 for c in cudas)  # no sink stream named: each piece waited for
    # sinks see this side's device slots, 64-byte aligned pieces
    lo = {t.dev_recv_ptr for t in ts}
    for s in spans:
        assert any(p <= s.ptr < p + 4 * 4096 for p in lo)
        assert s.ptr % 64 == (SKEW % 64)


@pytest.mark.timeout(30)
def test_dmabuf_registration_offset_and_fd_closed(make_pair, monkeypatch):
    closed: list[int] = []
    real_close = os.close

    def close(fd: int) -> None:
        closed.append(fd)
        real_close(fd)

    monkeypatch.setattr(os, "close", close)
    ts, cudas, _ = make_pair("dmabuf")
    monkeypatch.setattr(os, "close", real_close)
    for t, cuda in zip(ts, cudas, strict=True):
        reg = t.dev_recv_reg
        assert reg is not None and reg.path == "dmabuf"
        assert reg.addr == SKEW  # iova = offset inside the exported page-aligned range
        assert len(cuda.exported) == 2  # device slots and the connection's staging
        for fd in cuda.exported:  # each closed once the MR held the dma-buf
            assert fd in closed


@pytest.mark.timeout(30)
def test_gdr_flushes_before_the_sink(make_pair, monkeypatch):
    ts, cudas, (c0, c1) = make_pair("gdr")
    calls = []
    flusher = ts[1].flusher
    assert flusher is not None
    orig = flusher.flush
    monkeypatch.setattr(flusher, "flush", lambda reg: (calls.append(reg), orig(reg))[1])
    out = np.zeros(10_000, np.uint8)
    sink = device_sink(out, [])
    data = np.arange(10_000, dtype=np.uint8)

    def checked(off, span):
        assert calls, "the sink ran before the flush READ"
        sink(off, span)

    wait_all(
        [c0.isend_device(device_array(cudas[0], data)), c1.irecv_device(len(out), checked, 0)],
        Deadline.after(10),
    )
    np.testing.assert_array_equal(out, data)


@pytest.mark.timeout(30)
def test_host_and_device_messages_mix(make_pair):
    """A device send may meet a host receive and the other way round."""
    _, cudas, (c0, c1) = make_pair("dmabuf")
    a = np.arange(9000, dtype=np.uint8)
    host_out = np.zeros_like(a)
    dev_out = np.zeros_like(a)
    reqs = [
        c0.isend_device(device_array(cudas[0], a)),  # device -> host receive
        c1.irecv_into(memoryview(host_out)),
        c0.isend(memoryview(a)),  # host -> device receive
        c1.irecv_device(len(a), device_sink(dev_out, []), 0),
    ]
    wait_all(reqs, Deadline.after(10))
    np.testing.assert_array_equal(host_out, a)
    np.testing.assert_array_equal(dev_out, a)


@pytest.mark.timeout(30)
def test_peer_on_the_host_path(make_pair):
    """Rank 0 has device slots (dmabuf), rank 1 only host slots (host path)."""
    _, cudas, (c0, c1) = make_pair("dmabuf", "host")
    assert Cap.DEVICE in c0.caps and Cap.DEVICE not in c1.caps
    with pytest.raises(TransportError, match="cannot"):
        c1.isend_device(DeviceSpan(0, 8, 0))
    a = np.arange(20_000, dtype=np.uint8)
    got_host = np.zeros_like(a)
    got_dev = np.zeros_like(a)
    reqs = [
        c0.isend_device(device_array(cudas[0], a)),  # staged through rank 0's host staging
        c1.irecv_into(memoryview(got_host)),
        c1.isend(memoryview(a)),  # lands in rank 0's host slot, copied to its device slot
        c0.irecv_device(len(a), device_sink(got_dev, []), 0),
    ]
    wait_all(reqs, Deadline.after(10))
    np.testing.assert_array_equal(got_host, a)
    np.testing.assert_array_equal(got_dev, a)


@pytest.mark.timeout(30)
def test_slots_wait_for_the_sinks_gpu_work(make_pair):
    """A device slot goes back to the sender only once the sink's work finished."""
    _, cudas, (c0, c1) = make_pair("dmabuf", nslots=2)
    c1.set_sink_stream(7)  # the layer above names its stream: slots wait on events
    cudas[1].hold_events = True
    a = np.arange(6 * 4096, dtype=np.uint8)
    out = np.zeros_like(a)
    s = c0.isend_device(device_array(cudas[0], a))
    r = c1.irecv_device(len(a), device_sink(out, []), 0)
    for _ in range(2000):
        s.test()
        r.test()
    assert not r.test(), "the sender reused slots whose GPU work was still pending"
    assert cudas[1].syncs == 0 and cudas[1].queries > 0
    assert out[: 2 * 4096].any() and not out[2 * 4096 :].any()
    cudas[1].hold_events = False
    wait_all([s, r], Deadline.after(10))
    np.testing.assert_array_equal(out, a)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("path", ["dmabuf", "gdr"])
def test_device_pieces_carry_their_tag(make_pair, path):
    """A device piece's tag goes ahead of it into the head of the same slot's host
    side: a receive of the same tag gets the bytes (four pieces); one of
    another tag raises TagMismatchError before its sink sees a byte."""
    from transports.base import TagMismatchError

    _, cudas, (c0, c1) = make_pair(path)
    a = np.arange(3 * 4096 + 5, dtype=np.uint32).view(np.uint8)[: 3 * 4096 + 5].copy()
    out = np.zeros_like(a)
    t = (11 << 32) | 4
    wait_all(
        [
            c0.isend_device(device_array(cudas[0], a), t),
            c1.irecv_device(len(a), device_sink(out, []), 0, t),
        ],
        Deadline.after(10),
    )
    np.testing.assert_array_equal(out, a)
    spans: list[DeviceSpan] = []
    send = c1.isend_device(device_array(cudas[1], a), (12 << 32) | 5)
    with pytest.raises(TagMismatchError, match="disagree on the call"):  # posting may see it
        recv = c0.irecv_device(len(a), device_sink(out, spans), 0, t | 1)
        wait_all([recv, send], Deadline.after(10))
    assert spans == []
