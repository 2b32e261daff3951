"""The host and the streams around device collectives, per path (docs/gpu.md).

Each path (one-sided ``direct`` windows over cuda_ipc, the chunked ``ring``
over cuda_ipc, small messages through pinned host memory, staging over shm and
tcp) is checked the same way: a long kernel is queued on the stream before a
256 MiB allreduce (4 MiB where it goes through the host), and whether the call
returns while that kernel still runs (its end event not complete) must be what
the table in docs/gpu.md says; the result must be right for work queued after
it on the stream.  Also: two streams, ``async_op`` requests (a stream wait and a
host wait), a host collective behind a device one, a failure, buffers dropped by
the caller, and nothing left in /dev/shm.  Runs at n = 1 and under mpiexec.
"""

from __future__ import annotations

import glob
import time

import numpy as np
import pytest

cp = pytest.importorskip("cupy", reason="GPU tests need CuPy")
from mpi4py import MPI  # noqa: E402

import pycoll  # noqa: E402
from pycoll.gpu import present  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.mpi,
    pytest.mark.timeout(600),
    pytest.mark.skipif(not present(), reason="no CUDA device"),
]

WORLD = MPI.COMM_WORLD
RANK, SIZE = WORLD.Get_rank(), WORLD.Get_size()
BIG = 64 << 20  # float32 elements: 256 MiB
STAGED = 1 << 20  # 4 MiB: through the host, 256 MiB would only make the run long
SPIN_MS = 400.0  # per rank; ranks sharing the GPU make it longer, never shorter
SEGMENTS = set(glob.glob("/dev/shm/pycoll-*"))

_KERNELS = r"""
extern "C" __global__ void spin(long long cycles) {
    long long t0 = clock64();
    while (clock64() - t0 < cycles) { }
}
extern "C" __global__ void fill(float* x, long long n, float v) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] = v;
}
"""


@pytest.fixture(scope="module", autouse=True)
def _device():
    cp.cuda.Device(RANK % cp.cuda.runtime.getDeviceCount()).use()


def _comm(**kw):
    return pycoll.init(timeout=120, **kw)


@pytest.fixture(scope="module")
def comms(_device):
    """One communicator per path, made in the same order on every rank."""
    made = {
        "direct": _comm(),
        "host": _comm(device_host_bytes=8 << 20),
        "staged-shm": _comm(device_transports=()),
        "staged-tcp": _comm(transports=("tcp",), device_transports=()),
    }
    yield made
    for c in made.values():
        c.close()


# (path, communicator, algorithm, elements)
PATHS = [
    ("direct", "direct", "auto", BIG),
    ("ring-cuda_ipc", "direct", "ring", BIG),
    ("pinned-host", "host", "auto", STAGED),
    ("staged-shm", "staged-shm", "ring", STAGED),
    ("staged-tcp", "staged-tcp", "ring", STAGED),
]


def _spin(stream, ms: float = SPIN_MS) -> cp.cuda.Event:
    """Queue a kernel that spins for about ``ms`` on ``stream``; returns the event
    recorded after it."""
    k = cp.RawKernel(_KERNELS, "spin")
    with stream:
        k((1,), (1,), (np.int64(ms * 2e6),))  # about 2 GHz
        return stream.record()


def _fill(x, value: float, stream) -> None:
    k = cp.RawKernel(_KERNELS, "fill")
    n = x.size
    with stream:
        k(((n + 255) // 256,), (256,), (x, np.int64(n), np.float32(value)))


def _check(x, want: float, what: str) -> None:
    lo, hi = float(x.min()), float(x.max())
    assert lo == want and hi == want, f"rank {RANK}: {what}: [{lo}, {hi}], want {want}"


def _route(c, name: str) -> None:
    if SIZE == 1:
        return
    routes = {c.transport_of(p, device=True) for p in range(SIZE) if p != RANK}
    if name in ("direct", "ring-cuda_ipc"):
        if routes != {"cuda_ipc"}:
            pytest.skip(f"no cuda_ipc between the ranks: {routes}")
    elif name == "staged-shm":
        assert routes == {"staged:shm"}, routes
    elif name == "staged-tcp":
        assert routes == {"staged:tcp"}, routes


@pytest.mark.parametrize("name,which,algo,n", PATHS, ids=[p[0] for p in PATHS])
def test_call_returns_before_the_gpu_is_done(comms, name, which, algo, n):
    """The call returns while the kernel queued before it still runs; work queued
    after it on the stream sees the sum of every rank's (late) input."""
    c = comms[which]
    _route(c, name)
    s = cp.cuda.Stream(non_blocking=True)
    with s:
        x = cp.zeros(n, cp.float32)
    c.allreduce(x, algorithm=algo, stream=s)  # loads its kernels (see below)
    s.synchronize()
    WORLD.Barrier()
    spun = _spin(s)
    _fill(x, float(RANK + 1), s)  # the input is written only after the spin
    t0 = time.perf_counter()
    got = c.allreduce(x, algorithm=algo, stream=s)
    dt = time.perf_counter() - t0
    running = not spun.done
    with s:
        y = x * 2  # queued after the collective
    s.synchronize()
    print(
        f"rank {RANK} n={SIZE} {name}: call returned in {dt * 1e6:.0f} us, "
        f"kernel before it still running: {running} (gated: {c._gpu.gated})"
    )
    assert got is x
    # ungated (docs/gpu.md) the host part runs before the call returns: then only
    # direct, and one rank, return before the GPU is done; a kernel's first use
    # loads a module, which synchronizes the context: the warm-up call above
    expect = c._gpu.gated or name == "direct" or SIZE == 1
    assert running == expect, (
        f"rank {RANK}: {name}: kernel before it still running: {running} (gated: "
        f"{c._gpu.gated}), after {dt * 1e3:.1f} ms"
    )
    _check(y, 2.0 * SIZE * (SIZE + 1) / 2, name)


@pytest.mark.parametrize("name,which,algo,n", PATHS, ids=[p[0] for p in PATHS])
def test_two_streams(comms, name, which, algo, n):
    """Collectives on two streams: each is ordered after its own stream's work
    and before its own stream's later work; a third stream ordered after both
    by events sees both results."""
    c = comms[which]
    _route(c, name)
    n = min(n, 1 << 22)
    s1, s2, s3 = (cp.cuda.Stream(non_blocking=True) for _ in range(3))
    with s1:
        a = cp.zeros(n, cp.float32)
    with s2:
        b = cp.zeros(n, cp.float32)
    s1.synchronize()
    s2.synchronize()
    _spin(s1, 50.0)
    _fill(a, float(RANK + 1), s1)
    _spin(s2, 100.0)
    _fill(b, float(10 * (RANK + 1)), s2)
    c.allreduce(a, algorithm=algo, stream=s1)
    c.allreduce(b, algorithm=algo, stream=s2)
    with s1:
        a2 = a + 1
    with s2:
        b2 = b + 1
    s3.wait_event(s1.record())
    s3.wait_event(s2.record())
    with s3:
        ab = a + b
    s3.synchronize()
    s1.synchronize()
    s2.synchronize()
    total = SIZE * (SIZE + 1) / 2
    _check(a2, total + 1, f"{name} stream 1")
    _check(b2, 10 * total + 1, f"{name} stream 2")
    _check(ab, 11 * total, f"{name} stream 3 after both")


@pytest.mark.parametrize("name,which,algo,n", PATHS, ids=[p[0] for p in PATHS])
def test_async_request(comms, name, which, algo, n):
    """async_op=True: wait() makes the current stream wait; wait(host=True)
    blocks the host until the output can be read from another stream."""
    c = comms[which]
    _route(c, name)
    n = min(n, 1 << 22)
    s = cp.cuda.Stream(non_blocking=True)
    total = SIZE * (SIZE + 1) / 2
    with s:
        x = cp.zeros(n, cp.float32)
        _spin(s, 50.0)
        _fill(x, float(RANK + 1), s)
        req = c.allreduce(x, algorithm=algo, async_op=True)
        assert req.wait() is x  # the stream waits, the host does not
        y = x * 3
    s.synchronize()
    _check(y, 3 * total, f"{name} wait()")
    with s:
        _spin(s, 50.0)
        _fill(x, float(RANK + 1), s)
        req = c.allreduce(x, algorithm=algo, async_op=True)
    assert req.wait(timeout=60, host=True) is x
    assert req.test()
    other = cp.cuda.Stream(non_blocking=True)  # ordered after nothing
    _check(cp.asarray(x.get(stream=other)), total, f"{name} wait(host=True)")


@pytest.mark.parametrize("name,which,algo,n", PATHS, ids=[p[0] for p in PATHS])
def test_host_collective_after_device_ones(comms, name, which, algo, n):
    """Where the host still waits: a host-array collective queued behind a device
    collective waits for the device one's host part.  That is the enqueueing
    alone for ``direct`` (the kernel before it still runs when the host call
    returns), and every byte moved for the others (so the kernel is over)."""
    if SIZE == 1:
        pytest.skip("one rank moves no bytes")
    c = comms[which]
    _route(c, name)
    s = cp.cuda.Stream(non_blocking=True)
    with s:
        x = cp.zeros(min(n, 1 << 22), cp.float32)
    s.synchronize()
    WORLD.Barrier()
    spun = _spin(s)
    _fill(x, float(RANK + 1), s)
    c.allreduce(x, algorithm=algo, stream=s)
    h = np.full(3, RANK + 1.0, np.float32)
    c.allreduce(h)
    running = not spun.done
    s.synchronize()
    print(
        f"rank {RANK} n={SIZE} {name}: host allreduce behind it returned with the "
        f"kernel still running: {running}"
    )
    assert float(h[0]) == SIZE * (SIZE + 1) / 2
    if name == "direct":
        assert running, "the host collective waited for the GPU behind direct"
    else:
        assert not running, f"{name}: the host collective returned before the bytes moved"


def test_failure_on_the_progress_thread(comms, monkeypatch):
    """A failure after the call returned: the stream is not left waiting, the next
    call raises it, and so does close() when nothing else did."""
    from pycoll.gpu import context

    def boom(*a, **kw):
        raise RuntimeError("injected device failure")

    # every device body, on every rank alike (so no peer waits for another)
    monkeypatch.setattr(context.DeviceCall, "windows", boom)
    monkeypatch.setattr(context.DeviceCall, "links", boom)
    monkeypatch.setattr(context.dreduce, "finish_avg", boom)  # one rank: its only step
    for raise_at in ("call", "close"):
        c = _comm()
        x = cp.ones(1 << 20, cp.float32)
        s = cp.cuda.Stream(non_blocking=True)
        if not c._gpu.gated:  # lazy module loading: the call runs the host part itself
            with pytest.raises(RuntimeError, match="injected"):
                c.allreduce(x, op="avg", stream=s)
            with pytest.raises(pycoll.CommunicatorClosedError, match="injected"):
                c.allreduce(x, stream=s)
            c.close()
            WORLD.Barrier()
            continue
        assert c.allreduce(x, op="avg", stream=s) is x  # returns; fails on the progress thread
        done = s.record()
        t0 = time.monotonic()
        while not done.done:  # the gate opened: the stream does not hang
            assert time.monotonic() - t0 < 60, "the stream still waits for a failed collective"
            time.sleep(0.01)
        while c._engine.failed is None:
            assert time.monotonic() - t0 < 60
            time.sleep(0.01)
        if raise_at == "call":
            with pytest.raises(pycoll.CommunicatorClosedError, match="injected") as ei:
                c.allreduce(x, stream=s)
            assert isinstance(ei.value.__cause__, RuntimeError)
            c.close()
        else:
            with pytest.raises(pycoll.CommunicatorClosedError, match="injected"):
                c.close()
            c.close()  # idempotent once reported
        WORLD.Barrier()


def _ready_signals(c) -> tuple[int, int]:
    """How this rank's cuda_ipc windows signaled their exposures: (host, stream)."""
    wins = [conn._win for conn in c._gpu.dconns.values() if hasattr(conn, "_win")]
    return sum(w.ready_by_host for w in wins), sum(w.ready_by_stream for w in wins)


def _openings(c) -> tuple[int, int]:
    """How this rank opened its peers' windows: (found ready, stream waited)."""
    wins = [conn._win for conn in c._gpu.dconns.values() if hasattr(conn, "_win")]
    return sum(w.opened_ready for w in wins), sum(w.opened_waiting for w in wins)


def test_direct_signals_ready_from_the_host_when_nothing_is_queued(comms):
    """A window's "ready" word is stored by the host when nothing was queued on
    the caller's stream before the call (so the peer's stream needs no time
    slice of this rank's context), and written by the stream after the work
    queued there otherwise; the result is right both ways.  A rank that opens
    a window whose word already says ready enqueues no stream wait for it."""
    if SIZE == 1:
        pytest.skip("no peers")
    c = comms["direct"]
    _route(c, "direct")
    s = cp.cuda.Stream(non_blocking=True)
    n = 1 << 20
    total = SIZE * (SIZE + 1) / 2
    with s:
        x = cp.full(n, float(RANK + 1), cp.float32)
    s.synchronize()
    WORLD.Barrier()
    h0, d0 = _ready_signals(c)
    o0 = _openings(c)
    with s:
        y = c.allreduce(x, algorithm="direct", stream=s) * 1
    s.synchronize()
    h1, d1 = _ready_signals(c)
    o1 = _openings(c)
    _check(y, total, "idle stream")
    WORLD.Barrier()
    _spin(s, 50.0)
    _fill(x, float(RANK + 1), s)  # written only after the spin
    with s:
        y = c.allreduce(x, algorithm="direct", stream=s) * 1
    s.synchronize()
    h2, d2 = _ready_signals(c)
    o2 = _openings(c)
    _check(y, total, "busy stream")
    # on a shared GPU only the followers expose, and rank 0 opens; on separate
    # GPUs every rank does both
    if RANK != 0 or not c._gpu.shared_device:
        assert h1 > h0 and d1 == d0, f"rank {RANK}: idle: host {h1 - h0}, stream {d1 - d0}"
        assert d2 > d1 and h2 == h1, f"rank {RANK}: busy: host {h2 - h1}, stream {d2 - d1}"
    if RANK == 0 or not c._gpu.shared_device:
        idle = (o1[0] - o0[0], o1[1] - o0[1])
        busy = (o2[0] - o1[0], o2[1] - o1[1])
        assert idle[0] > 0 and idle[1] == 0, f"rank {RANK}: idle: opened {idle}"
        assert busy[1] > 0 and busy[0] == 0, f"rank {RANK}: busy: opened {busy}"
    WORLD.Barrier()


def test_buffers_live_until_their_work_is_done(comms):
    """An asynchronous call's input dropped at once, and its memory asked for again
    on the same stream (CuPy's pool hands it back) and overwritten while the
    collective may still read it: pycoll holds the array until its work is over."""
    c = comms["direct"]
    n = 1 << 22
    s = cp.cuda.Stream(non_blocking=True)
    total = SIZE * (SIZE + 1) / 2
    for rep in range(3):
        with s:
            x = cp.empty(n, cp.float32)
            out = cp.empty(n, cp.float32)
        _fill(x, float(RANK + 1), s)
        _spin(s, 30.0)  # the collective starts after this
        with s:
            req = c.allreduce(x, out, async_op=True)
            del x
            junk = cp.empty(n, cp.float32)
        _fill(junk, -7.0, s)  # not ordered after the collective (async_op)
        with s:
            req.wait()
            y = out * 1
        s.synchronize()
        _check(y, total, f"rep {rep}")
        del junk


def test_nothing_left_in_dev_shm(comms):
    """After every communicator of this module is closed (the last test)."""
    for c in comms.values():
        c.close()
    WORLD.Barrier()
    left = set(glob.glob("/dev/shm/pycoll-*")) - SEGMENTS
    assert not left, f"rank {RANK}: left in /dev/shm: {sorted(left)}"
