"""Device collectives: every collective x algorithm x dtype x op on GPU buffers.

Runs at any world size: ``python -m pytest tests/gpu`` (n = 1) and
``mpiexec -n N python -m mpi4py -m pytest -m mpi tests/gpu`` (several ranks on
one GPU or one each).  Inputs are generated from seeds, so each rank computes
the NumPy reference itself; outputs are poisoned before each call; results must
be bitwise identical on every rank.  bfloat16 goes in as torch tensors (CuPy has
no bfloat16), everything else as CuPy arrays (plus torch float32 checks).
"""

from __future__ import annotations

import itertools

import ml_dtypes
import numpy as np
import pytest

cp = pytest.importorskip("cupy", reason="GPU tests need CuPy")
from mpi4py import MPI  # noqa: E402

import pycoll  # noqa: E402
from pycoll.gpu import present  # noqa: E402
from tests.reference import (  # noqa: E402
    OPS,
    assert_close,
    assert_identical_everywhere,
    data,
    ops_for,
    reference,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.mpi,
    pytest.mark.timeout(900),
    pytest.mark.skipif(not present(), reason="no CUDA device"),
]

WORLD = MPI.COMM_WORLD
RANK, SIZE = WORLD.Get_rank(), WORLD.Get_size()
PRIME = 65537 + 34
BF16 = np.dtype(ml_dtypes.bfloat16)
DTYPES = list(pycoll.DTYPES.values())  # every dtype pycoll supports
ALGOS = ["ring", "tree", "direct"]
STAGED_ALGOS = ["ring", "tree"]  # direct needs one-sided windows between every pair
SIZES = [1, 7, PRIME]


def _torch():
    try:
        import torch
    except ImportError:
        return None
    return torch if torch.cuda.is_available() else None


@pytest.fixture(scope="module", autouse=True)
def _device():
    cp.cuda.Device(RANK % cp.cuda.runtime.getDeviceCount()).use()


@pytest.fixture(scope="module")
def comm_small(_device):
    """Small chunks for ring/tree; for direct, the split of the work between the
    ranks that runs on separate GPUs (on one GPU rank 0 would do it all)."""
    c = pycoll.init(timeout=120, chunk_bytes=4096, device_chunk_bytes=4096)
    if c._gpu is not None:
        c._gpu.shared_device = False
    yield c
    c.close()


# ----------------------------------------------------------------------------- helpers


def to_dev(a: np.ndarray, torch_too: bool = False):
    """Host array -> device array: torch for bfloat16 (or when asked), else CuPy."""
    if a.dtype == BF16 or torch_too:
        torch = _torch()
        if torch is None:
            pytest.skip("bfloat16 device buffers need torch with CUDA")
        dev = cp.cuda.Device().id
        if a.dtype == BF16:
            t = torch.from_numpy(a.view(np.int16).copy()).to(f"cuda:{dev}")
            return t.view(torch.bfloat16)
        return torch.from_numpy(a.copy()).to(f"cuda:{dev}")
    return cp.asarray(a)


def to_host(d, dtype: np.dtype) -> np.ndarray:
    if type(d).__module__.startswith("torch"):
        torch = _torch()
        if dtype == BF16:
            return d.view(torch.int16).cpu().numpy().view(BF16)
        return d.cpu().numpy()
    return cp.asnumpy(d)


def empty_dev(shape, dtype: np.dtype, like_torch: bool = False):
    """Poisoned device output."""
    host = np.empty(shape, dtype)
    host.view(np.uint8)[...] = 0xA5
    return to_dev(host, torch_too=like_torch)


def _cases(dtype, op):
    return op in ops_for(dtype)


# ----------------------------------------------------------------------------- routing
def test_device_routes(comm, comm_staged, comm_tcp):
    for p in range(SIZE):
        if p == RANK:
            assert comm.transport_of(p, device=True) == "self"
            continue
        assert comm.transport_of(p, device=True) == "cuda_ipc"
        assert comm.transport_of(p) == "shm"  # host buffers keep using shm
        assert comm_staged.transport_of(p, device=True) == "staged:shm"
        assert comm_tcp.transport_of(p, device=True) == "staged:tcp"


# ----------------------------------------------------------------------------- collectives
@pytest.mark.parametrize("algo", ALGOS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_allreduce(comm, comm_small, algo, dtype):
    for count, op, inplace, c in itertools.product(SIZES, OPS, (False, True), (comm, comm_small)):
        if not _cases(dtype, op):
            continue
        xs = [data(r, count, dtype, op) for r in range(SIZE)]
        ref = reference(xs, op)
        what = f"allreduce {algo} {dtype} {op} n={SIZE} count={count} inplace={inplace}"
        if inplace:
            buf = to_dev(xs[RANK])
            got = c.allreduce(buf, op=op, algorithm=algo)
            assert got is buf
        else:
            out = empty_dev(count, dtype)
            got = c.allreduce(to_dev(xs[RANK]), out, op=op, algorithm=algo)
            assert got is out
        h = to_host(got, dtype)
        assert_close(h, ref, dtype, SIZE, what)
        assert_identical_everywhere(h, what)


@pytest.mark.parametrize("algo", ALGOS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_reduce_scatter(comm, comm_small, algo, dtype):
    for k, op, c in itertools.product(SIZES, OPS, (comm, comm_small)):
        if not _cases(dtype, op):
            continue
        xs = [data(r, k * SIZE, dtype, op) for r in range(SIZE)]
        ref = reference(xs, op)[RANK * k : (RANK + 1) * k]
        out = empty_dev(k, dtype)
        got = c.reduce_scatter(to_dev(xs[RANK]), out, op=op, algorithm=algo)
        assert got is out
        h = to_host(got, dtype)
        assert_close(h, ref, dtype, SIZE, f"reduce_scatter {algo} {dtype} {op} k={k}")
        new = c.reduce_scatter(to_dev(xs[RANK]), op=op, algorithm=algo)
        assert tuple(new.shape) == (k,)
        assert np.array_equal(to_host(new, dtype).view(np.uint8), h.view(np.uint8))


@pytest.mark.parametrize("algo", ALGOS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_reduce(comm, comm_small, algo, dtype):
    for count, op, root, c in itertools.product(
        SIZES, OPS, sorted({0, SIZE - 1}), (comm, comm_small)
    ):
        if not _cases(dtype, op):
            continue
        xs = [data(r, count, dtype, op) for r in range(SIZE)]
        out = empty_dev(count, dtype)
        got = c.reduce(to_dev(xs[RANK]), out, root=root, op=op, algorithm=algo)
        if RANK == root:
            assert got is out
            what = f"reduce {algo} {dtype} {op} root={root}"
            assert_close(to_host(got, dtype), reference(xs, op), dtype, SIZE, what)
        else:
            assert got is None


@pytest.mark.parametrize("algo", ALGOS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_allgather(comm, comm_small, algo, dtype):
    for count, c, inplace in itertools.product(SIZES, (comm, comm_small), (False, True)):
        xs = [data(r, count, dtype, "sum") for r in range(SIZE)]
        want = np.stack(xs)
        if inplace:
            out = empty_dev((SIZE, count), dtype)
            out[RANK] = to_dev(xs[RANK])
            got = c.allgather(out[RANK], out, algorithm=algo)
        else:
            out = empty_dev(SIZE * count, dtype)
            got = c.allgather(to_dev(xs[RANK]), out, algorithm=algo)
        assert got is out
        h = to_host(got, dtype).reshape(SIZE, count)
        assert np.array_equal(h.view(np.uint8), want.view(np.uint8))
        new = c.allgather(to_dev(xs[RANK]).reshape(1, count), algorithm=algo)
        assert tuple(new.shape) == (SIZE, 1, count)


@pytest.mark.parametrize("algo", ALGOS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_broadcast(comm, comm_small, algo, dtype):
    for count, root, c in itertools.product(SIZES, range(SIZE), (comm, comm_small)):
        want = data(root, count, dtype, "sum", salt=7)
        buf = to_dev(want) if RANK == root else empty_dev(count, dtype)
        got = c.broadcast(buf, root=root, algorithm=algo)
        assert got is buf
        assert np.array_equal(to_host(buf, dtype).view(np.uint8), want.view(np.uint8))


@pytest.mark.parametrize("dtype", [np.dtype(np.uint8), np.dtype(np.float16)], ids=str)
@pytest.mark.parametrize("shift", [1, 3])
def test_unaligned_views(comm, comm_small, dtype, shift):
    """Views that start off any word boundary: the one-kernel copies and reductions
    of a shared GPU move them in narrower words, the split path as they come."""
    count = 1001
    for c in (comm, comm_small):
        xs = [data(r, count, dtype, "sum") for r in range(SIZE)]
        src = cp.zeros(count + 8, dtype)
        src[shift : shift + count] = cp.asarray(xs[RANK])
        out = cp.full((SIZE * count + 8) * dtype.itemsize, 0xA5, cp.uint8).view(dtype)
        c.allgather(
            src[shift : shift + count], out[shift : shift + SIZE * count], algorithm="direct"
        )
        got = cp.asnumpy(out[shift : shift + SIZE * count]).reshape(SIZE, count)
        assert np.array_equal(got.view(np.uint8), np.stack(xs).view(np.uint8))
        assert (cp.asnumpy(out[:shift]).view(np.uint8) == 0xA5).all()
        assert (cp.asnumpy(out[shift + SIZE * count :]).view(np.uint8) == 0xA5).all()

        buf = src[shift : shift + count]
        if RANK != 0:
            buf[...] = 0
        c.broadcast(buf, root=0, algorithm="direct")
        assert np.array_equal(cp.asnumpy(buf).view(np.uint8), xs[0].view(np.uint8))

        big = [data(r, SIZE * count, dtype, "sum") for r in range(SIZE)]
        x = cp.zeros(SIZE * count + 8, dtype)
        x[shift : shift + SIZE * count] = cp.asarray(big[RANK])
        o = cp.full((count + 8) * dtype.itemsize, 0xA5, cp.uint8).view(dtype)
        c.reduce_scatter(
            x[shift : shift + SIZE * count], o[shift : shift + count], algorithm="direct"
        )
        want = reference([b.reshape(SIZE, count)[RANK] for b in big], "sum")
        assert_close(cp.asnumpy(o[shift : shift + count]), want, dtype, SIZE, "rs unaligned")
        assert (cp.asnumpy(o[:shift]).view(np.uint8) == 0xA5).all()


def test_auto_algorithm(comm):
    for count in (1, 1000, 1 << 20):
        xs = [data(r, count, np.dtype(np.float32), "sum") for r in range(SIZE)]
        got = comm.allreduce(to_dev(xs[RANK]))
        assert_close(cp.asnumpy(got), reference(xs, "sum"), np.dtype(np.float32), SIZE, "auto")


def test_direct_is_the_default_between_ipc_peers(comm):
    """Above device_host_bytes, auto takes the one-sided path; below, the host."""
    x = cp.ones(1 << 20, cp.float32)
    comm.allreduce(x)
    assert ("algo=direct" in comm.recent()[-1]) == (SIZE > 1), comm.recent()[-1]
    if SIZE > 1:  # rank r uses GPU r % count: all on one only when there is one
        assert comm._gpu.shared_device == (cp.cuda.runtime.getDeviceCount() == 1)
    assert float(x[0]) == SIZE and float(x[-1]) == SIZE
    small = cp.ones(1000, cp.float32)
    comm.allreduce(small, algorithm="ring")  # an explicit algorithm stays on the device
    assert "algo=ring" in comm.recent()[-1]
    assert float(small[0]) == SIZE


@pytest.mark.parametrize("op", ["sum", "max"])
def test_direct_with_unshareable_memory(comm, op):
    """Buffers from a stream-ordered pool cannot be exposed through CUDA IPC: the
    one-sided path goes through its own scratch memory, in place and out of place."""
    pool = cp.cuda.MemoryAsyncPool()
    count = PRIME
    xs = [data(r, count, np.dtype(np.float32), op) for r in range(SIZE)]
    ref = reference(xs, op)
    with cp.cuda.using_allocator(pool.malloc):
        x = cp.asarray(xs[RANK])
        out = cp.full(count, np.nan, cp.float32)
        comm.allreduce(x, out, op=op)
        comm.allreduce(x, op=op)
        ag = comm.allgather(cp.asarray(xs[RANK]))
        rs = comm.reduce_scatter(cp.asarray(xs[RANK][: count // SIZE * SIZE]), op=op)
    for got, what in ((out, "out of place"), (x, "in place")):
        h = cp.asnumpy(got)
        assert_close(h, ref, np.dtype(np.float32), SIZE, f"unshareable allreduce {what}")
        assert_identical_everywhere(h, what)
    assert np.array_equal(cp.asnumpy(ag), np.stack(xs))
    k = count // SIZE
    rs_ref = reference([v[: k * SIZE] for v in xs], op)[RANK * k : (RANK + 1) * k]
    assert_close(cp.asnumpy(rs), rs_ref, np.dtype(np.float32), SIZE, "unshareable reduce_scatter")


@pytest.mark.parametrize(
    "dtype", [BF16, np.dtype(np.float16), np.dtype(np.int8), np.dtype(np.float64)], ids=str
)
@pytest.mark.parametrize("which", ["comm", "comm_host"])
def test_auto_small_messages_through_the_host(request, which, dtype):
    """auto below device_host_bytes: pinned copies and the host algorithms, every
    collective (with the default limits on a shared GPU, the device path for those
    whose copy back would be under 28 KiB)."""
    comm = request.getfixturevalue(which)
    count = 16381  # a prime; 8-byte elements stay within the 128 KiB default
    for op in ("sum", "max"):
        xs = [data(r, count, dtype, op) for r in range(SIZE)]
        got = to_host(comm.allreduce(to_dev(xs[RANK])), dtype) if op == "sum" else None
        if got is not None:
            assert_close(got, reference(xs, op), dtype, SIZE, f"auto allreduce {dtype}")
            assert_identical_everywhere(got, "auto allreduce")
        out = empty_dev(count, dtype)
        comm.allreduce(to_dev(xs[RANK]), out, op=op)
        assert_close(to_host(out, dtype), reference(xs, op), dtype, SIZE, f"auto allreduce {op}")
        k = count // SIZE
        rs = comm.reduce_scatter(to_dev(xs[RANK][: k * SIZE]), op=op)
        ref = reference([x[: k * SIZE] for x in xs], op)[RANK * k : (RANK + 1) * k]
        assert_close(to_host(rs, dtype), ref, dtype, SIZE, f"auto reduce_scatter {op}")
        red = comm.reduce(to_dev(xs[RANK]), root=SIZE - 1, op=op)
        if RANK == SIZE - 1:
            assert_close(to_host(red, dtype), reference(xs, op), dtype, SIZE, f"auto reduce {op}")
    ag = comm.allgather(to_dev(xs[RANK]))
    assert np.array_equal(to_host(ag, dtype).view(np.uint8), np.stack(xs).view(np.uint8))
    b = to_dev(xs[0]) if RANK == 0 else empty_dev(count, dtype)
    comm.broadcast(b, root=0)
    assert np.array_equal(to_host(b, dtype).view(np.uint8), xs[0].view(np.uint8))


def test_fast_path_through_the_host(comm_host):
    """Repeated calls on the same device arrays through the host: fresh data each
    time, a new current stream each time (the copies must follow it), every
    collective; a torch tensor whose storage is swapped between calls."""
    comm = comm_host
    count = 4099
    f32 = np.dtype(np.float32)
    k = count // SIZE
    x, out, red = cp.empty(count, cp.float32), empty_dev(count, f32), empty_dev(count, f32)
    xr, rs = cp.empty(k * SIZE, cp.float32), empty_dev(k, f32)
    ag, b = empty_dev(SIZE * count, f32), cp.empty(count, cp.float32)
    for rep in range(4):
        xs = [data(r + 10 * rep, count, f32, "sum") for r in range(SIZE)]
        s = cp.cuda.Stream(non_blocking=True)
        _spin_fill(x, 0.0, s, ms=5.0)  # late writes on the new stream, then the data
        with s:
            x[...] = cp.asarray(xs[RANK])
            xr[...] = x[: k * SIZE]
            b[...] = x if RANK == 0 else cp.float32(-1)
            comm.allreduce(x, out)
            comm.reduce_scatter(xr, rs)
            comm.allgather(x, ag)
            comm.broadcast(b, root=0)
            comm.reduce(x, red, root=SIZE - 1)
            comm.allreduce(x)  # in place, last: the others read x
            got = [a * 1 for a in (out, rs, ag, b, red, x)]  # queued after, on s
        s.synchronize()
        what = f"fast path rep {rep}"
        ref = reference(xs, "sum")
        assert_close(cp.asnumpy(got[0]), ref, f32, SIZE, what)
        assert_close(cp.asnumpy(got[5]), ref, f32, SIZE, what + " in place")
        rref = reference([a[: k * SIZE] for a in xs], "sum")[RANK * k : (RANK + 1) * k]
        assert_close(cp.asnumpy(got[1]), rref, f32, SIZE, what + " reduce_scatter")
        assert np.array_equal(cp.asnumpy(got[2]), np.concatenate(xs)), what + " allgather"
        assert np.array_equal(cp.asnumpy(got[3]), xs[0]), what + " broadcast"
        if RANK == SIZE - 1:
            assert_close(cp.asnumpy(got[4]), ref, f32, SIZE, what + " reduce")
    torch = _torch()
    if torch is None:
        return
    t = to_dev(data(RANK, count, f32, "sum"), torch_too=True)
    for rep in range(3):
        xs = [data(r + 10 * rep, count, f32, "sum") for r in range(SIZE)]
        if rep == 2:  # the same tensor object on new storage
            t.set_(torch.from_numpy(xs[RANK].copy()).to(t.device))
        else:
            t.copy_(torch.from_numpy(xs[RANK]))
        got = comm.allreduce(t)
        assert got is t
        assert_close(t.cpu().numpy(), reference(xs, "sum"), f32, SIZE, f"torch rep {rep}")


@pytest.mark.parametrize("which", ["comm", "large_host", "comm_staged"])
def test_large_allgather_blocks(request, which):
    """Blocks of OWN_PLACED_MIN bytes and more, whose own block a host algorithm
    places itself where the arrays are NumPy ones: on device arrays every
    algorithm (the device envelope copies the own block on the collective's
    stream), through pinned host memory, and staged; in place and not,
    outputs poisoned, on every rank alike."""
    from pycoll.buffers import OWN_PLACED_MIN

    if which == "large_host":
        c = pycoll.init(timeout=120, device_host_bytes=64 << 20)
        request.addfinalizer(c.close)
    else:
        c = request.getfixturevalue(which)
    f32 = np.dtype(np.float32)
    k = OWN_PLACED_MIN // 4 + 5
    xs = [data(r, k, f32, "sum") for r in range(SIZE)]
    want = np.concatenate(xs)
    for algo in [*ALGOS, "auto"] if which == "comm" else ["auto"]:
        for inplace in (False, True):
            out = cp.full(SIZE * k, cp.nan, cp.float32)
            if inplace:
                out[RANK * k : (RANK + 1) * k] = cp.asarray(xs[RANK])
                c.allgather(out[RANK * k : (RANK + 1) * k], out, algorithm=algo)
            else:
                c.allgather(cp.asarray(xs[RANK]), out, algorithm=algo)
            got = cp.asnumpy(out)
            assert np.array_equal(got, want), (which, algo, inplace)
            assert_identical_everywhere(got, f"large allgather {which} {algo} {inplace}")


def test_in_place_allgather_through_the_host(comm_host):
    """sendbuf is this rank's block of recvbuf (rank 0: the same address)."""
    comm = comm_host
    k = 1021
    f32 = np.dtype(np.float32)
    xs = [data(r, k, f32, "sum") for r in range(SIZE)]
    ag = empty_dev(SIZE * k, f32)
    mine = ag[RANK * k : (RANK + 1) * k]
    mine[...] = cp.asarray(xs[RANK])
    comm.allgather(mine, ag)
    assert np.array_equal(cp.asnumpy(ag), np.concatenate(xs))


# ----------------------------------------------------------------------------- staging
@pytest.mark.parametrize("which", ["comm_staged", "comm_tcp"])
@pytest.mark.parametrize("dtype", [np.dtype(np.float32), BF16, np.dtype(np.int64)], ids=str)
def test_staged_paths(request, which, dtype):
    c = request.getfixturevalue(which)
    count = 300_007  # several staging pieces per message
    for algo, op in itertools.product(STAGED_ALGOS, ("sum", "max", "avg")):
        if not _cases(dtype, op):
            continue
        xs = [data(r, count, dtype, op) for r in range(SIZE)]
        what = f"{which} allreduce {algo} {dtype} {op}"
        got = c.allreduce(to_dev(xs[RANK]), op=op, algorithm=algo)
        h = to_host(got, dtype)
        assert_close(h, reference(xs, op), dtype, SIZE, what)
        assert_identical_everywhere(h, what)
        k = count // 7
        rs = c.reduce_scatter(to_dev(xs[RANK][: k * SIZE]), op=op, algorithm=algo)
        ref = reference([x[: k * SIZE] for x in xs], op)[RANK * k : (RANK + 1) * k]
        assert_close(to_host(rs, dtype), ref, dtype, SIZE, f"{which} reduce_scatter {algo}")
        ag = c.allgather(to_dev(xs[RANK]), algorithm=algo)
        assert np.array_equal(to_host(ag, dtype).view(np.uint8), np.stack(xs).view(np.uint8))
        b = to_dev(xs[0]) if RANK == 0 else empty_dev(count, dtype)
        c.broadcast(b, root=0, algorithm=algo)
        assert np.array_equal(to_host(b, dtype).view(np.uint8), xs[0].view(np.uint8))


# ----------------------------------------------------------------------------- streams
_SPIN = r"""
extern "C" __global__ void spin_fill(float* x, long long n, float v, long long cycles) {
    long long t0 = clock64();
    while (clock64() - t0 < cycles) { }
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] = v;
}
"""


def _spin_fill(x, value: float, stream, ms: float = 30.0) -> None:
    """Fill ``x`` on ``stream`` after spinning for about ``ms`` ms (late writes)."""
    k = cp.RawKernel(_SPIN, "spin_fill")
    cycles = int(ms * 1e-3 * 2.0e9)
    n = x.size
    with stream:
        k(((n + 255) // 256,), (256,), (x, np.int64(n), np.float32(value), np.int64(cycles)))


@pytest.mark.parametrize("n", [1 << 14, 1 << 19], ids=["via-host", "on-device"])
@pytest.mark.parametrize("form", ["cupy", "int", "current", "torch"])
def test_stream_ordering(comm, form, n):
    """The collective sees work queued before it on the stream; work after sees its result."""
    s = cp.cuda.Stream(non_blocking=True)
    with s:  # on s: a zeroing on the legacy stream could land after the fill
        x = cp.zeros(n, cp.float32)
    torch = _torch()
    if form == "torch" and torch is None:
        pytest.skip("torch with CUDA is not available")
    _spin_fill(x, float(RANK + 1), s)
    if form == "cupy":
        comm.allreduce(x, stream=s)
    elif form == "int":
        comm.allreduce(x, stream=s.ptr)
    elif form == "torch":
        ts = torch.cuda.ExternalStream(s.ptr)
        comm.allreduce(x, stream=ts)
    else:
        with s:
            comm.allreduce(x)
    with s:
        y = x * 2  # queued after the collective on the same stream
    s.synchronize()
    want = 2.0 * SIZE * (SIZE + 1) / 2
    assert float(y.min()) == want and float(y.max()) == want


def test_torch_tensors_and_stream(comm):
    torch = _torch()
    if torch is None:
        pytest.skip("torch with CUDA is not available")
    count = 4099
    xs = [data(r, count, np.dtype(np.float32), "sum") for r in range(SIZE)]
    t = to_dev(xs[RANK], torch_too=True)
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        t.mul_(1.0)  # queued on s; pycoll must order after it (current torch stream)
        got = comm.allreduce(t, op="sum")
        u = got + 0
    s.synchronize()
    assert got is t
    assert_close(u.cpu().numpy(), reference(xs, "sum"), np.dtype(np.float32), SIZE, "torch")
    ag = comm.allgather(t)
    assert type(ag).__module__.startswith("torch") and tuple(ag.shape) == (SIZE, count)


def test_async_op(comm):
    count = 1 << 18
    xs = [data(r, count, np.dtype(np.float32), "sum") for r in range(SIZE)]
    x = to_dev(xs[RANK])
    req = comm.allreduce(x, op="sum", async_op=True)
    got = req.wait(timeout=120)
    assert got is x
    assert_close(cp.asnumpy(x), reference(xs, "sum"), np.dtype(np.float32), SIZE, "async")


def test_bad_stream_is_a_user_error(comm):
    x = cp.zeros(4, cp.float32)
    with pytest.raises(pycoll.InvalidArgumentError, match="stream"):
        comm.allreduce(x, stream="not a stream")


# ----------------------------------------------------------------------------- kernels
_LAST_BIT = pytest.mark.xfail(
    reason="seen on an H200: some sum/prod results differ from ml_dtypes in the last bit "
    "(suspected float32 subnormal flushing in the kernel); ranks still agree bitwise",
    strict=False,
)


@pytest.mark.parametrize(
    "op",
    [pytest.param("sum", marks=_LAST_BIT), pytest.param("prod", marks=_LAST_BIT), "min", "max"],
)
def test_bf16_kernel_matches_host_bitwise(op):
    """The device bfloat16 reduction rounds exactly as ml_dtypes does (ties, NaN, inf)."""
    from pycoll.gpu.reduce import reducer
    from pycoll.reduce import ReduceOp, ufunc

    rng = np.random.default_rng(5)
    a = rng.integers(0, 1 << 16, 1 << 16, dtype=np.uint16)
    b = rng.integers(0, 1 << 16, 1 << 16, dtype=np.uint16)
    # plus exact ties: 1 + 2^-8 lies halfway between two bfloat16 values
    a[:4] = np.array([1.0, 1.0, -1.0, np.inf], ml_dtypes.bfloat16).view(np.uint16)
    b[:4] = np.array([2**-8, 3 * 2**-8, -(2**-8), -np.inf], ml_dtypes.bfloat16).view(np.uint16)
    rop = ReduceOp(op)
    want = ufunc(rop)(a.view(BF16), b.view(BF16)).view(np.uint16)
    out = cp.empty(a.size, cp.uint16)
    reducer(rop, BF16)(cp.asarray(a), cp.asarray(b), out=out)
    got = cp.asnumpy(out)
    nan = np.isnan(want.view(BF16).astype(np.float32))
    assert np.array_equal(np.isnan(got.view(BF16).astype(np.float32)), nan)
    bad = np.nonzero(got[~nan] != want[~nan])[0]
    assert bad.size == 0, (
        f"{bad.size} differ, e.g. a={a[~nan][bad[:4]]} b={b[~nan][bad[:4]]} "
        f"got={got[~nan][bad[:4]]} want={want[~nan][bad[:4]]}"
    )
