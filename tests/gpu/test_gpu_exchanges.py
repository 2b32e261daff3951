"""Device point-to-point calls and exchange collectives against NumPy, on every rank.

send/recv (a ring shift in ``group()``, any source, ``sendrecv``, host and
device buffers mixed, ``async_op``), then alltoall, alltoallv, gather, scatter,
allgatherv and reduce_scatterv on CuPy arrays, on three communicators: the
default one, one that takes small messages through pinned host memory
(``device_host_bytes``) and one whose device links are staged through host
memory (``device_transports=()``); a sub-communicator; nothing left in
/dev/shm.  Inputs come from seeds, so every rank computes the reference itself
and checks its own output; outputs are poisoned before each call; zero counts
appear in the point-to-point sizes and the v-variants.

Run: ``python -m pytest tests/gpu/test_gpu_exchanges.py`` (n = 1) and
``mpiexec -n N python -m mpi4py -m pytest -q -x -m mpi tests/gpu/test_gpu_exchanges.py``
(N = 2, 3, 4; the ranks may share one GPU).
"""

from __future__ import annotations

import glob
import itertools

import numpy as np
import pytest

cp = pytest.importorskip("cupy", reason="GPU tests need CuPy")
from mpi4py import MPI  # noqa: E402

from pycoll.gpu import present  # noqa: E402
from tests.reference import assert_close, data, reference  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.mpi,
    pytest.mark.timeout(600),
    pytest.mark.skipif(not present(), reason="no CUDA device"),
]

WORLD = MPI.COMM_WORLD
RANK, SIZE = WORLD.Get_rank(), WORLD.Get_size()
RIGHT, LEFT = (RANK + 1) % SIZE, (RANK - 1) % SIZE
PRIME = 65537 + 34
DTYPES = [np.dtype(t) for t in (np.float32, np.float64, np.int32, np.uint8)]
COMMS = ["comm", "comm_host", "comm_staged"]
ZEROS = list(dict.fromkeys([None, 0, SIZE - 1]))  # which rank's v-count is zero
SEGMENTS: set[str] = set()  # /dev/shm/pycoll-* before this module's communicators


@pytest.fixture(scope="module", autouse=True)
def _device():
    cp.cuda.Device(RANK % cp.cuda.runtime.getDeviceCount()).use()
    SEGMENTS.update(glob.glob("/dev/shm/pycoll-*"))
    WORLD.Barrier()  # every rank looked before any communicator is made


# ----------------------------------------------------------------------------- helpers


def to_dev(a: np.ndarray):
    return cp.asarray(a)


def empty_dev(shape, dtype: np.dtype):
    """Poisoned device output."""
    host = np.empty(shape, dtype)
    host.view(np.uint8)[...] = 0xA5
    return cp.asarray(host)


def check(got, want: np.ndarray, what: str) -> None:
    """``got``, a device array of this rank's device, holds ``want`` bit for bit."""
    assert isinstance(got, cp.ndarray), f"{what}: got a {type(got).__name__}"
    assert got.device.id == cp.cuda.Device().id, f"{what}: on device {got.device.id}"
    h = cp.asnumpy(got).reshape(-1)
    w = np.ascontiguousarray(want).reshape(-1)
    assert (h.dtype, h.size) == (w.dtype, w.size), f"{what}: {h.size} x {h.dtype}"
    assert np.array_equal(h.view(np.uint8), w.view(np.uint8)), what


def vcounts(zero_at: int | None) -> list[int]:
    """Per-rank counts: small and odd, the last rank's a prime, rank ``zero_at``'s 0."""
    cs = [2 * j + 3 for j in range(SIZE)]
    cs[-1] = PRIME
    if zero_at is not None:
        cs[zero_at] = 0
    return cs


# ----------------------------------------------------------------------------- point-to-point
@pytest.mark.parametrize("which", COMMS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_ring_shift_in_a_group(request, which, dtype):
    """Every rank sends right and receives left, posted together (device buffers
    go through host memory in pycoll/p2p.py)."""
    c = request.getfixturevalue(which)
    for count in (1, 7, PRIME, 0):
        what = f"ring shift {which} {dtype} count={count}"
        y = empty_dev(count, dtype)
        with c.group():
            sent = c.send(to_dev(data(RANK, count, dtype, "sum")), RIGHT, tag=count)
            req = c.recv(y, LEFT, tag=count)
        assert req.wait() is y and sent.wait() is None, what
        assert req.source == LEFT and c.last_source == LEFT, what
        check(y, data(LEFT, count, dtype, "sum"), what)


def test_recv_from_any_source(comm):
    if SIZE < 2:
        pytest.skip("needs two ranks")
    f64 = np.dtype(np.float64)
    want = data(1, PRIME, f64, "sum", salt=5)
    if RANK == 1:
        comm.send(to_dev(want), 0, tag=21)
        assert comm.send(to_dev(want[:7]), 0, tag=22, async_op=True).wait(60) is None
    elif RANK == 0:
        y = empty_dev(PRIME, f64)
        assert comm.recv(y, None, tag=21) is y
        assert comm.last_source == 1
        check(y, want, "recv from any source")
        z = empty_dev(7, f64)
        req = comm.recv(z, None, tag=22, async_op=True)
        assert req.wait(60) is z and req.source == 1
        check(z, want[:7], "async recv from any source")
    comm.barrier()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_sendrecv_and_mixed_buffers(comm, dtype):
    for count in (7, PRIME):
        mine = data(RANK, count, dtype, "sum", salt=1)
        theirs = data(LEFT, count, dtype, "sum", salt=1)
        what = f"sendrecv {dtype} count={count}"
        y = empty_dev(count, dtype)
        assert comm.sendrecv(to_dev(mine), RIGHT, y, LEFT, tag=1) is y
        check(y, theirs, what)
        y = empty_dev(count, dtype)
        assert comm.sendrecv(to_dev(mine), RIGHT, y, None, tag=2) is y
        assert comm.last_source == LEFT
        check(y, theirs, what + " from any source")
        y = empty_dev(count, dtype)  # a host buffer sent, a device buffer received
        comm.sendrecv(mine, RIGHT, y, LEFT, tag=3)
        check(y, theirs, what + " host to device")
        h = np.empty(count, dtype)  # and the reverse
        h.view(np.uint8)[...] = 0xA5
        assert comm.sendrecv(to_dev(mine), RIGHT, h, LEFT, tag=4) is h
        assert np.array_equal(h.view(np.uint8), theirs.view(np.uint8)), what + " device to host"


@pytest.mark.parametrize("count", [0, 7, PRIME])
def test_async_send_recv(comm, count):
    """The receive posted before the send, on every rank; both completed by wait()."""
    f32 = np.dtype(np.float32)
    y = empty_dev(count, f32)
    r = comm.recv(y, LEFT, tag=5, async_op=True)
    s = comm.send(to_dev(data(RANK, count, f32, "sum", salt=2)), RIGHT, tag=5, async_op=True)
    assert r.wait(60) is y and s.wait(60) is None
    assert r.source == LEFT
    check(y, data(LEFT, count, f32, "sum", salt=2), f"async count={count}")


# ----------------------------------------------------------------------------- exchanges
@pytest.mark.parametrize("algo", ["auto", "pairwise"])
@pytest.mark.parametrize("which", COMMS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_alltoall(request, which, dtype, algo):
    c = request.getfixturevalue(which)
    for k in (1, 7, PRIME):
        xs = [data(r, SIZE * k, dtype, "sum") for r in range(SIZE)]
        want = np.concatenate([xs[j][RANK * k : (RANK + 1) * k] for j in range(SIZE)])
        what = f"alltoall {which} {algo} {dtype} k={k}"
        out = empty_dev(SIZE * k, dtype)
        assert c.alltoall(to_dev(xs[RANK]), out, algorithm=algo) is out, what
        check(out, want, what)
        new = c.alltoall(to_dev(xs[RANK]).reshape(SIZE, k), algorithm=algo)
        assert new.shape == (SIZE, k), what
        check(new, want, what + " recvbuf=None")


def _alltoallv(c, dtype: np.dtype, sent, what: str) -> None:
    """alltoallv where rank i sends ``sent(i, j)`` elements to rank j."""
    sc = [sent(RANK, j) for j in range(SIZE)]
    rc = [sent(j, RANK) for j in range(SIZE)]
    xs = [data(i, sum(sent(i, j) for j in range(SIZE)), dtype, "sum", salt=3) for i in range(SIZE)]
    want = []
    for j in range(SIZE):
        lo = sum(sent(j, q) for q in range(RANK))
        want.append(xs[j][lo : lo + sent(j, RANK)])
    out = empty_dev(sum(rc), dtype)
    assert c.alltoallv(to_dev(xs[RANK]), sc, out, rc) is out, what
    check(out, np.concatenate(want), f"{what} sendcounts={sc} recvcounts={rc}")


@pytest.mark.parametrize("which", COMMS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_alltoallv(request, which, dtype):
    c = request.getfixturevalue(which)
    for salt in range(3):  # uneven, zeros among them
        _alltoallv(c, dtype, lambda i, j: (i + j + salt) % 3, f"alltoallv {which} {dtype}")
    big = lambda i, j: PRIME if (i, j) == (SIZE - 1, 0) else (i + j) % 3
    _alltoallv(c, dtype, big, f"alltoallv {which} {dtype} with a prime")


@pytest.mark.parametrize("algo", ["auto", "linear", "tree"])
@pytest.mark.parametrize("which", COMMS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_gather(request, which, dtype, algo):
    c = request.getfixturevalue(which)
    for k, root, inplace in itertools.product((1, PRIME), range(SIZE), (False, True)):
        xs = [data(r, k, dtype, "sum", salt=root) for r in range(SIZE)]
        what = f"gather {which} {algo} {dtype} k={k} root={root} inplace={inplace}"
        out = empty_dev((SIZE, k), dtype)
        if inplace and RANK == root:
            out[RANK] = to_dev(xs[RANK])
            got = c.gather(out[RANK], out, root=root, algorithm=algo)
        else:  # other ranks than the root pass no recvbuf
            got = c.gather(
                to_dev(xs[RANK]), out if RANK == root else None, root=root, algorithm=algo
            )
        if RANK == root:
            assert got is out, what
            check(out, np.stack(xs), what)
        else:
            assert got is None, what
    xs = [data(r, 7, dtype, "sum", salt=9) for r in range(SIZE)]
    fresh = c.gather(to_dev(xs[RANK]), root=SIZE - 1, algorithm=algo)  # a new array on the root
    if RANK == SIZE - 1:
        assert fresh.shape == (SIZE, 7)
        check(fresh, np.stack(xs), f"gather {which} {algo} {dtype} recvbuf=None")
    else:
        assert fresh is None


@pytest.mark.parametrize("algo", ["auto", "linear", "tree"])
@pytest.mark.parametrize("which", COMMS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_scatter(request, which, dtype, algo):
    c = request.getfixturevalue(which)
    for k, root, inplace in itertools.product((1, PRIME), range(SIZE), (False, True)):
        src = data(root, SIZE * k, dtype, "sum", salt=3)
        what = f"scatter {which} {algo} {dtype} k={k} root={root} inplace={inplace}"
        if inplace and RANK == root:  # recvbuf is block root of sendbuf
            buf = to_dev(src)
            out = buf[RANK * k : (RANK + 1) * k]
            assert c.scatter(buf, out, root=root, algorithm=algo) is out, what
            check(buf, src, what + " sendbuf")
        else:  # other ranks than the root pass no sendbuf
            out = empty_dev(k, dtype)
            sendbuf = to_dev(src) if RANK == root else None
            assert c.scatter(sendbuf, out, root=root, algorithm=algo) is out, what
        check(out, src[RANK * k : (RANK + 1) * k], what)


@pytest.mark.parametrize("which", COMMS)
@pytest.mark.parametrize("dtype", [np.dtype(np.int64), np.dtype(np.float32)], ids=str)
def test_reduce_scatterv(request, which, dtype):
    c = request.getfixturevalue(which)
    for zero_at, op in itertools.product(ZEROS, ("sum", "max")):
        cs = vcounts(zero_at)
        xs = [data(r, sum(cs), dtype, op, salt=4) for r in range(SIZE)]
        lo = sum(cs[:RANK])
        ref = reference(xs, op)[lo : lo + cs[RANK]]
        what = f"reduce_scatterv {which} {dtype} {op} counts={cs}"
        out = empty_dev(cs[RANK], dtype)
        assert c.reduce_scatterv(to_dev(xs[RANK]), out, cs, op=op) is out, what
        assert_close(cp.asnumpy(out), ref, dtype, SIZE, what)


# A rank with no element to send still takes part: the device path must not skip it.
@pytest.mark.parametrize("which", COMMS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_allgatherv(request, which, dtype):
    c = request.getfixturevalue(which)
    for zero_at, inplace in itertools.product(ZEROS, (False, True)):
        cs = vcounts(zero_at)
        xs = [data(r, cs[r], dtype, "sum", salt=5) for r in range(SIZE)]
        what = f"allgatherv {which} {dtype} counts={cs} inplace={inplace}"
        out = empty_dev(sum(cs), dtype)
        lo = sum(cs[:RANK])
        if inplace:  # sendbuf is this rank's block of recvbuf
            mine = out[lo : lo + cs[RANK]]
            mine[...] = to_dev(xs[RANK])
            assert c.allgatherv(mine, out, cs) is out, what
        else:
            assert c.allgatherv(to_dev(xs[RANK]), out, cs) is out, what
        check(out, np.concatenate(xs), what)


@pytest.mark.parametrize("which", COMMS)
def test_alltoallv_from_a_rank_with_nothing_to_send(request, which):
    c = request.getfixturevalue(which)
    sent = lambda i, j: 0 if i == 0 else (i + 2 * j + 1) % 4  # rank 0 only receives
    _alltoallv(c, np.dtype(np.float32), sent, f"alltoallv {which}, rank 0 sends nothing")


# ----------------------------------------------------------------------------- sub-communicator
def test_sub_communicator(comm):
    """Device buffers in a split (through pinned host memory), its ranks in reverse order."""
    sub = comm.split(RANK % 2, key=-RANK)
    try:
        members = sorted((r for r in range(SIZE) if r % 2 == RANK % 2), reverse=True)
        m, me = len(members), members.index(RANK)
        assert (sub.size, sub.rank) == (m, me)
        i32, k = np.dtype(np.int32), 7
        xs = {r: data(r, m * k, i32, "sum", salt=6) for r in members}
        out = empty_dev(m * k, i32)
        assert sub.alltoall(to_dev(xs[RANK]), out) is out
        check(out, np.concatenate([xs[r][me * k : (me + 1) * k] for r in members]), "sub alltoall")
        y = empty_dev(k, i32)
        sub.sendrecv(to_dev(xs[RANK][:k]), (me + 1) % m, y, None, tag=7)
        assert sub.last_source == (me - 1) % m
        check(y, xs[members[(me - 1) % m]][:k], "sub sendrecv")
    finally:
        sub.close()


def test_point_to_point_follows_the_torch_stream(comm):
    """A torch tensor written on a side stream behind a long kernel is sent as
    written, and work queued on that stream after the receive sees what came:
    the copies through host memory are ordered on torch's current stream."""
    torch = pytest.importorskip("torch")
    if SIZE < 2:
        pytest.skip("needs a peer")
    dev = torch.device("cuda", cp.cuda.Device().id)
    s = torch.cuda.Stream(dev)
    n = 1 << 20
    with torch.cuda.stream(s):
        x = torch.zeros(n, device=dev)
        y = torch.full((n,), -1.0, device=dev)
        torch.cuda._sleep(200_000_000)  # about 0.1 s of spinning before the write
        x.fill_(float(RANK + 1))
        with comm.group():
            comm.send(x, RIGHT)
            comm.recv(y, LEFT)
        z = y * 2  # queued after the receive
    s.synchronize()
    got = z.cpu().numpy()
    assert np.all(got == 2.0 * (LEFT + 1)), f"rank {RANK}: got {np.unique(got)[:4]}"


# ----------------------------------------------------------------------------- cleanup
def test_nothing_left_in_dev_shm(comm, comm_host, comm_staged):
    """After every communicator of this module is closed (the last test)."""
    for c in (comm, comm_host, comm_staged):
        c.close()
    WORLD.Barrier()
    left = set(glob.glob("/dev/shm/pycoll-*")) - SEGMENTS
    assert not left, f"rank {RANK}: left in /dev/shm: {sorted(left)}"
