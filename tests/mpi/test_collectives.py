"""Every collective x algorithm x dtype x op against a NumPy reference.

Runs on every rank under ``mpiexec -n N python -m mpi4py -m pytest tests/mpi``
(tests/test_mpirun.py launches it for N = 1..4).  Every rank generates every
rank's input from a seed, so each can compute the reference locally; outputs are
poisoned before each call; and results must be bitwise identical on all ranks.
"""

from __future__ import annotations

import itertools
import os

import ml_dtypes
import numpy as np
import pytest
from mpi4py import MPI

import pycoll
from pycoll.algorithms import names
from pycoll.algorithms.direct import GROUP_ALGORITHMS
from tests.reference import (
    assert_close,
    assert_identical_everywhere,
    data,
    ops_for,
    reference,
)

pytestmark = [pytest.mark.mpi, pytest.mark.timeout(600)]

WORLD = MPI.COMM_WORLD
RANK, SIZE = WORLD.Get_rank(), WORLD.Get_size()
PRIME = 65537 + 34  # 65571 is prime
#: Every dtype pycoll supports; with PYCOLL_TEST_DTYPES=few (the transport
#: variants of tests/test_mpirun.py, whose point is the wire, not the
#: reductions) one of each family: the full matrix runs over shm at n = 1..4.
FEW = ("float32", "float16", "bfloat16", "int64", "uint8", "bool", "complex128")
DTYPES = [
    d
    for name, d in pycoll.DTYPES.items()
    if os.environ.get("PYCOLL_TEST_DTYPES", "all") == "all" or name in FEW
]
ALGOS = {
    c: list(names(c)) for c in ("allreduce", "allgather", "broadcast", "reduce_scatter", "reduce")
}


@pytest.fixture(scope="module")
def comm():
    c = pycoll.init(timeout=120)
    yield c
    c.close()


@pytest.fixture(scope="module")
def comm_small_chunks():
    # small group slots too: direct goes by address from 4 KiB
    c = pycoll.init(timeout=120, chunk_bytes=4096, group_slot_bytes=4096)
    yield c
    c.close()


@pytest.fixture(scope="module")
def comm_slots():
    """Direct algorithms without direct reads: every size goes through 4 KiB slots."""
    c = pycoll.init(timeout=120, group_slot_bytes=4096)
    if c._engine.group is not None:
        c._engine.group.cma = False  # as when the kernel forbids cross-memory attach
    yield c
    c.close()


def skip_unavailable(c, algo: str) -> None:
    """``direct`` and ``cma`` need every rank on one host sharing memory (not so
    over rdma-only)."""
    if algo in GROUP_ALGORITHMS and SIZE > 1 and c._engine.group is None:
        pytest.skip(f"no group segment: {algo} is not available")


def poison(a: np.ndarray) -> np.ndarray:
    a.view(np.uint8)[...] = 0xA5
    return a


SIZES = [1, 7, PRIME]
#: The transport variants (PYCOLL_TEST_DTYPES=few) send the largest size with one
#: op of each dtype: which op reduces the bytes does not change what crosses the
#: wire, and every op runs at every size over shm.  (All ops at PRIME took 227 of
#: CI's 1135 s over the software RDMA provider at n = 4.)
WIRE = os.environ.get("PYCOLL_TEST_DTYPES", "all") != "all"


def sizes_ops(dtype: np.dtype) -> list[tuple[int, str]]:
    """The (count, op) pairs a reducing collective runs with ``dtype``."""
    ops = ops_for(dtype)
    return [(k, op) for k in SIZES for op in (ops[:1] if WIRE and k == PRIME else ops)]


@pytest.mark.parametrize("algo", ALGOS["allreduce"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_allreduce(comm, comm_small_chunks, algo, dtype):
    skip_unavailable(comm, algo)
    for (count, op), inplace, c in itertools.product(
        sizes_ops(dtype), (False, True), (comm, comm_small_chunks)
    ):
        xs = [data(r, count, dtype, op) for r in range(SIZE)]
        ref = reference(xs, op)
        what = f"allreduce {algo} {dtype} {op} n={SIZE} count={count} inplace={inplace}"
        if inplace:
            buf = xs[RANK].copy()
            got = c.allreduce(buf, op=op, algorithm=algo)
            assert got is buf
        else:
            out = poison(np.empty(count, dtype))
            got = c.allreduce(xs[RANK], out, op=op, algorithm=algo)
            assert got is out
        assert_close(got, ref, dtype, SIZE, what)
        assert_identical_everywhere(got, what)


@pytest.mark.parametrize("algo", ALGOS["reduce_scatter"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_reduce_scatter(comm, comm_small_chunks, algo, dtype):
    skip_unavailable(comm, algo)
    for (k, op), c in itertools.product(sizes_ops(dtype), (comm, comm_small_chunks)):
        xs = [data(r, k * SIZE, dtype, op) for r in range(SIZE)]
        ref = reference(xs, op)[RANK * k : (RANK + 1) * k]
        out = poison(np.empty(k, dtype))
        got = c.reduce_scatter(xs[RANK], out, op=op, algorithm=algo)
        assert got is out
        assert_close(got, ref, dtype, SIZE, f"reduce_scatter {algo} {dtype} {op} k={k}")
        new = c.reduce_scatter(xs[RANK], op=op, algorithm=algo)
        assert new.shape == (k,) and np.array_equal(new.view(np.uint8), got.view(np.uint8))


@pytest.mark.parametrize("algo", ALGOS["reduce"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_reduce(comm, comm_small_chunks, algo, dtype):
    skip_unavailable(comm, algo)
    for (count, op), root, c in itertools.product(
        sizes_ops(dtype), sorted({0, SIZE - 1}), (comm, comm_small_chunks)
    ):
        xs = [data(r, count, dtype, op) for r in range(SIZE)]
        out = poison(np.empty(count, dtype))
        got = c.reduce(xs[RANK], out, root=root, op=op, algorithm=algo)
        if RANK == root:
            assert got is out
            assert_close(got, reference(xs, op), dtype, SIZE, f"reduce {algo} {dtype} {op}")
        else:
            assert got is None


@pytest.mark.parametrize("algo", ALGOS["allgather"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_allgather(comm, comm_small_chunks, algo, dtype):
    skip_unavailable(comm, algo)
    for count, c, inplace in itertools.product(SIZES, (comm, comm_small_chunks), (False, True)):
        xs = [data(r, count, dtype, "sum") for r in range(SIZE)]
        want = np.stack(xs)
        if inplace:
            out = poison(np.empty((SIZE, count), dtype))
            out[RANK] = xs[RANK]
            got = c.allgather(out[RANK], out, algorithm=algo)
        else:
            out = poison(np.empty(SIZE * count, dtype))
            got = c.allgather(xs[RANK], out, algorithm=algo)
        assert got is out
        assert np.array_equal(got.reshape(SIZE, count).view(np.uint8), want.view(np.uint8))
        new = c.allgather(xs[RANK].reshape(1, count), algorithm=algo)
        assert new.shape == (SIZE, 1, count)


@pytest.mark.parametrize("algo", ALGOS["broadcast"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_broadcast(comm, comm_small_chunks, algo, dtype):
    skip_unavailable(comm, algo)
    for count, root, c in itertools.product(SIZES, range(SIZE), (comm, comm_small_chunks)):
        want = data(root, count, dtype, "sum", salt=7)
        buf = want.copy() if RANK == root else poison(np.empty(count, dtype))
        got = c.broadcast(buf, root=root, algorithm=algo)
        assert got is buf
        assert np.array_equal(buf.view(np.uint8), want.view(np.uint8))


@pytest.mark.parametrize("algo", ["ring", "tree", "direct"])
def test_large_multichunk(comm, algo):
    """A few MiB through every collective (several pipeline chunks per rank)."""
    skip_unavailable(comm, algo)
    count = (3 << 20) // 4 + 5
    for dtype in (np.dtype(np.float32), np.dtype(np.int32), np.dtype(ml_dtypes.bfloat16)):
        xs = [data(r, count, dtype, "sum") for r in range(SIZE)]
        out = poison(np.empty(count, dtype))
        comm.allreduce(xs[RANK], out, algorithm=algo)
        assert_close(out, reference(xs, "sum"), dtype, SIZE, f"allreduce large {dtype}")
        assert_identical_everywhere(out, "allreduce large")
        rs_in = [data(r, count * SIZE, dtype, "max") for r in range(SIZE)]
        rs = comm.reduce_scatter(rs_in[RANK], op="max", algorithm=algo)
        assert_close(
            rs,
            reference(rs_in, "max")[RANK * count : (RANK + 1) * count],
            dtype,
            SIZE,
            "reduce_scatter large",
        )
        g = comm.allgather(xs[RANK], algorithm=algo)
        assert np.array_equal(g.view(np.uint8), np.stack(xs).view(np.uint8))
        b = xs[0].copy() if RANK == 0 else poison(np.empty(count, dtype))
        comm.broadcast(b, root=0, algorithm=algo)
        assert np.array_equal(b.view(np.uint8), xs[0].view(np.uint8))
        red = poison(np.empty(count, dtype))
        comm.reduce(xs[RANK], red, root=SIZE - 1, algorithm=algo)
        if RANK == SIZE - 1:
            assert_close(red, reference(xs, "sum"), dtype, SIZE, "reduce large")


def test_deterministic_across_calls(comm):
    x = data(RANK, 100_003, np.dtype(np.float32), "sum")
    for algo in ALGOS["allreduce"]:
        if algo == "direct" and SIZE > 1 and comm._engine.group is None:
            continue
        a = comm.allreduce(x, np.empty_like(x), algorithm=algo)
        b = comm.allreduce(x, np.empty_like(x), algorithm=algo)
        assert np.array_equal(a.view(np.uint32), b.view(np.uint32))


def test_shapes_and_auto(comm):
    x = np.arange(24, dtype=np.float64).reshape(2, 3, 4) + RANK
    out = comm.allreduce(x, np.empty_like(x))
    assert out.shape == (2, 3, 4)
    assert np.allclose(out, sum(np.arange(24).reshape(2, 3, 4) + r for r in range(SIZE)))


def test_async_overlaps_and_orders(comm):
    xs = [np.full(1000, RANK + i, np.float32) for i in range(5)]
    reqs = [comm.allreduce(x, async_op=True) for x in xs]
    blocking = comm.allreduce(np.ones(3, np.float32))  # queued after the async ones
    for i, (x, rq) in enumerate(zip(xs, reqs, strict=True)):
        assert rq.wait(60) is x
        assert rq.test() and rq.exception() is None
        assert np.all(x == sum(r + i for r in range(SIZE)))
    assert np.all(blocking == SIZE)


def test_barrier_and_transport_of(comm):
    comm.barrier()
    assert comm.transport_of(RANK) == "self"
    for p in range(SIZE):
        if p != RANK:
            assert comm.transport_of(p) in ("shm", "tcp", "rdma:host", "rdma:dmabuf", "rdma:gdr")


def test_zero_elements(comm):
    e = np.empty(0, np.float32)
    assert comm.allreduce(e).size == 0
    assert comm.allgather(e).shape == (SIZE, 0)
    assert comm.broadcast(e) is e
    assert comm.reduce_scatter(e).size == 0


@pytest.mark.parametrize(
    "dtype",
    [
        np.dtype(t)
        for t in (np.float32, np.int8, ml_dtypes.bfloat16, np.bool_, np.uint16, np.complex128)
    ],
    ids=str,
)
def test_direct_through_slots(comm_slots, dtype):
    """Direct without direct reads: several rounds of 4 KiB slots, every collective."""
    c = comm_slots
    skip_unavailable(c, "direct")
    for count, op, inplace in itertools.product([1, 7, 1021, PRIME], ops_for(dtype), (False, True)):
        what = f"direct slots {dtype} {op} count={count} inplace={inplace}"
        xs = [data(r, count, dtype, op) for r in range(SIZE)]
        ref = reference(xs, op)
        if inplace:
            got = c.allreduce(xs[RANK].copy(), op=op, algorithm="direct")
        else:
            got = c.allreduce(xs[RANK], poison(np.empty(count, dtype)), op=op, algorithm="direct")
        assert_close(got, ref, dtype, SIZE, f"allreduce {what}")
        assert_identical_everywhere(got, f"allreduce {what}")
        root = SIZE - 1
        red = c.reduce(
            xs[RANK].copy() if inplace else xs[RANK],
            None if inplace else poison(np.empty(count, dtype)),
            root=root,
            op=op,
            algorithm="direct",
        )
        if RANK == root:
            assert_close(red, ref, dtype, SIZE, f"reduce {what}")
        rs_in = [data(r, count * SIZE, dtype, op, salt=3) for r in range(SIZE)]
        rs = c.reduce_scatter(
            rs_in[RANK], poison(np.empty(count, dtype)), op=op, algorithm="direct"
        )
        want = reference(rs_in, op)[RANK * count : (RANK + 1) * count]
        assert_close(rs, want, dtype, SIZE, f"reduce_scatter {what}")
        if op != ops_for(dtype)[0]:  # the moves once per dtype
            continue
        out = poison(np.empty((SIZE, count), dtype))
        if inplace:
            out[RANK] = xs[RANK]
            c.allgather(out[RANK], out, algorithm="direct")
        else:
            c.allgather(xs[RANK], out, algorithm="direct")
        assert np.array_equal(out.view(np.uint8), np.stack(xs).view(np.uint8)), what
        buf = xs[0].copy() if RANK == 0 else poison(np.empty(count, dtype))
        c.broadcast(buf, root=0, algorithm="direct")
        assert np.array_equal(buf.view(np.uint8), xs[0].view(np.uint8)), what
    c.barrier()


def test_direct_is_offered_exactly_when_ranks_share_memory(comm):
    for coll in ("allreduce", "allgather", "broadcast", "reduce_scatter", "reduce", "gather"):
        assert "direct" in names(coll)
    assert "direct" in names("scatter")
    x = np.ones(4, np.float32)
    if SIZE > 1 and os.environ.get("PYCOLL_TRANSPORT", "auto") not in ("auto", "shm"):
        assert comm._engine.group is None
        with pytest.raises(
            pycoll.InvalidArgumentError, match="direct needs every rank on one host"
        ):
            comm.allreduce(x, algorithm="direct")
    elif SIZE > 1:
        assert comm._engine.group is not None


def test_group_segment_leaves_no_name_behind(comm):
    """The group segment is unlinked once every rank attached: nothing outlives the job."""
    if comm._engine.group is None:
        pytest.skip("no group segment")
    WORLD.Barrier()
    assert not os.path.exists(os.path.join("/dev/shm", comm._engine.group.name))
    c = pycoll.init(timeout=60)
    name = c._engine.group.name
    assert not os.path.exists(os.path.join("/dev/shm", name))
    c.allreduce(np.ones(3, np.float32), algorithm="direct")
    c.close()
    c.close()  # idempotent
    assert not os.path.exists(os.path.join("/dev/shm", name))
