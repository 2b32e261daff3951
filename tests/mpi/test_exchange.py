"""alltoall(v), gather, scatter, allgatherv, reduce_scatterv, point-to-point and
sub-communicators against NumPy, on every rank under mpiexec (n = 1..4).

As in test_collectives.py: every rank derives every rank's input from seeds,
outputs are poisoned before each call, and results are compared with NumPy.
Zero counts appear in every v-variant.
"""

from __future__ import annotations

import itertools
import time

import numpy as np
import pytest
from mpi4py import MPI

import pycoll
from pycoll.algorithms import names
from tests.mpi.test_collectives import DTYPES, PRIME, poison, skip_unavailable
from tests.reference import assert_close, assert_identical_everywhere, data, ops_for, reference

pytestmark = [pytest.mark.mpi, pytest.mark.timeout(600)]

WORLD = MPI.COMM_WORLD
RANK, SIZE = WORLD.Get_rank(), WORLD.Get_size()
#: Elements per block (alltoall, gather, scatter): none, one, odd, a prime
#: that needs several slot rounds and pipeline chunks.
BLOCKS = [0, 1, 7, PRIME // 4 + 2]


@pytest.fixture(scope="module")
def comms():
    """The default communicator, one with 4 KiB slots and chunks (by address and
    multi-chunk paths from 4 KiB), and one without cross-memory copies."""
    a = pycoll.init(timeout=120)
    b = pycoll.init(timeout=120, chunk_bytes=4096, group_slot_bytes=4096)
    c = pycoll.init(timeout=120, group_slot_bytes=4096)
    if c._engine.group is not None:
        c._engine.group.cma = False
    yield a, b, c
    for x in (a, b, c):
        x.close()


def counts_with_zeros(salt: int) -> list[int]:
    """Per-rank counts, some zero (rank 0's always), others odd."""
    rng = np.random.default_rng([SIZE, salt])
    c = [int(v) for v in rng.integers(0, 9, SIZE)]
    c[0] = 0
    if SIZE > 1:
        c[-1] = 5 + salt % 3
    return c


# ------------------------------------------------------------------ alltoall
@pytest.mark.parametrize("algo", names("alltoall"))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_alltoall(comms, algo, dtype):
    skip_unavailable(comms[0], algo)
    for k, c in itertools.product(BLOCKS, comms):
        xs = [data(r, SIZE * k, dtype, "sum") for r in range(SIZE)]
        want = np.concatenate([xs[j][RANK * k : (RANK + 1) * k] for j in range(SIZE)])
        out = poison(np.empty(SIZE * k, dtype))
        got = c.alltoall(xs[RANK], out, algorithm=algo)
        assert got is out
        assert np.array_equal(got.view(np.uint8), want.view(np.uint8)), (algo, dtype, k)
        new = c.alltoall(xs[RANK].reshape(SIZE, k), algorithm=algo)
        assert new.shape == (SIZE, k)
        assert np.array_equal(new.reshape(-1).view(np.uint8), want.view(np.uint8))


def test_alltoall_by_address_and_through_the_slots_around_the_threshold(comms):
    """alltoall of just under and just over direct's by-address threshold (4
    MiB: slots below, cross-memory reads from there), odd blocks, against
    NumPy, output poisoned."""
    from pycoll.algorithms.direct import ALLTOALL_BY_ADDRESS_MIN

    c = comms[0]
    skip_unavailable(c, "direct")
    dt = np.dtype(np.float32)
    for total in (ALLTOALL_BY_ADDRESS_MIN - 4 * SIZE, ALLTOALL_BY_ADDRESS_MIN + 4 * SIZE):
        k = total // dt.itemsize // SIZE
        x = data(RANK, SIZE * k, dt, "sum", k)
        out = poison(np.empty(SIZE * k, dt))
        assert c.alltoall(x, out, algorithm="direct" if SIZE > 1 else "auto") is out
        want = np.concatenate(
            [data(j, SIZE * k, dt, "sum", k)[RANK * k : (RANK + 1) * k] for j in range(SIZE)]
        )
        np.testing.assert_array_equal(out, want)


def test_alltoall_async_and_odd_inputs(comms):
    c = comms[0]
    x = np.arange(SIZE * 3, dtype=np.int64) + 1000 * RANK
    req = c.alltoall(x, async_op=True)
    got = req.wait(60)
    want = np.concatenate([np.arange(RANK * 3, RANK * 3 + 3) + 1000 * j for j in range(SIZE)])
    assert np.array_equal(got, want)
    if SIZE > 1:
        with pytest.raises(pycoll.InvalidArgumentError, match="not a multiple"):
            c.alltoall(np.zeros(SIZE + 1, np.int8))
        with pytest.raises(pycoll.InvalidArgumentError, match="overlaps"):
            c.alltoall(x, x)


# ------------------------------------------------------------------ gather / scatter
@pytest.mark.parametrize("algo", names("gather"))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_gather(comms, algo, dtype):
    skip_unavailable(comms[0], algo)
    for k, root, c, inplace in itertools.product(BLOCKS, range(SIZE), comms, (False, True)):
        xs = [data(r, k, dtype, "sum", salt=root) for r in range(SIZE)]
        what = f"gather {algo} {dtype} k={k} root={root} inplace={inplace}"
        out = poison(np.empty((SIZE, k), dtype))
        if inplace and RANK == root:
            out[RANK] = xs[RANK]
            got = c.gather(out[RANK], out, root=root, algorithm=algo)
        else:
            got = c.gather(xs[RANK], out if RANK == root else None, root=root, algorithm=algo)
        if RANK == root:
            assert got is out, what
            assert np.array_equal(got.view(np.uint8), np.stack(xs).view(np.uint8)), what
        else:
            assert got is None, what
    fresh = comms[0].gather(np.full((2, 2), RANK, np.int16), root=SIZE - 1, algorithm=algo)
    if RANK == SIZE - 1:
        assert fresh.shape == (SIZE, 2, 2) and (fresh == np.arange(SIZE)[:, None, None]).all()


@pytest.mark.parametrize("algo", names("scatter"))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_scatter(comms, algo, dtype):
    skip_unavailable(comms[0], algo)
    for k, root, c, inplace in itertools.product(BLOCKS, range(SIZE), comms, (False, True)):
        src = data(root, SIZE * k, dtype, "sum", salt=3)
        what = f"scatter {algo} {dtype} k={k} root={root} inplace={inplace}"
        if RANK == root and inplace:
            buf = src.copy()
            out = buf[RANK * k : (RANK + 1) * k]
            got = c.scatter(buf, out, root=root, algorithm=algo)
        else:
            out = poison(np.empty(k, dtype))
            got = c.scatter(src if RANK == root else None, out, root=root, algorithm=algo)
        assert got is out, what
        want = src[RANK * k : (RANK + 1) * k]
        assert np.array_equal(got.view(np.uint8), want.view(np.uint8)), what


# ------------------------------------------------------------------ v-variants
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_allgatherv(comms, dtype):
    for salt, c, inplace in itertools.product(range(3), comms[:2], (False, True)):
        cs = counts_with_zeros(salt)
        xs = [data(r, cs[r], dtype, "sum", salt=salt) for r in range(SIZE)]
        want = np.concatenate(xs)
        out = poison(np.empty(sum(cs), dtype))
        lo = sum(cs[:RANK])
        if inplace:
            out[lo : lo + cs[RANK]] = xs[RANK]
            got = c.allgatherv(out[lo : lo + cs[RANK]], out, cs)
        else:
            got = c.allgatherv(xs[RANK], out, cs)
        assert got is out
        assert np.array_equal(got.view(np.uint8), want.view(np.uint8)), (dtype, cs, inplace)
        assert_identical_everywhere(got, f"allgatherv {dtype} {cs}")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_reduce_scatterv(comms, dtype):
    for salt, op, c in itertools.product(range(2), ops_for(dtype), comms[:2]):
        cs = counts_with_zeros(salt)
        xs = [data(r, sum(cs), dtype, op, salt=salt) for r in range(SIZE)]
        lo = sum(cs[:RANK])
        ref = reference(xs, op)[lo : lo + cs[RANK]]
        out = poison(np.empty(cs[RANK], dtype))
        got = c.reduce_scatterv(xs[RANK], out, cs, op=op)
        assert got is out
        assert_close(got, ref, dtype, SIZE, f"reduce_scatterv {dtype} {op} {cs}")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_alltoallv(comms, dtype):
    for salt in range(3):
        # rank i sends rank j ((i + 2 j + salt) mod 4) elements: zeros and unevenness
        def sent(i: int, j: int) -> int:
            return (i + 2 * j + salt) % 4

        sc = [sent(RANK, j) for j in range(SIZE)]
        rc = [sent(j, RANK) for j in range(SIZE)]
        xs = [
            data(i, sum(sent(i, j) for j in range(SIZE)), dtype, "sum", salt) for i in range(SIZE)
        ]
        want = []
        for j in range(SIZE):
            lo = sum(sent(j, q) for q in range(RANK))
            want.append(xs[j][lo : lo + sent(j, RANK)])
        out = poison(np.empty(sum(rc), dtype))
        got = comms[0].alltoallv(xs[RANK], sc, out, rc)
        assert got is out
        assert np.array_equal(got.view(np.uint8), np.concatenate(want).view(np.uint8))


# ------------------------------------------------------------------ point-to-point
def test_point_to_point(comms):
    c = comms[0]
    right, left = (RANK + 1) % SIZE, (RANK - 1) % SIZE
    # a ring shift in a group, from one element to several slots and chunks
    for count in (0, 1, 7, PRIME, 3 << 20):
        x = np.full(count, RANK, np.float32)
        y = poison(np.empty(count, np.float32))
        with c.group():
            c.send(x, right, tag=count)
            req = c.recv(y, left, tag=count)
        assert (y == left).all() and req.source == left, count
    # sendrecv, and a receive from any source
    z = poison(np.empty(5, np.int64))
    c.sendrecv(np.full(5, RANK), right, z, None, tag=3)
    assert (z == left).all() and c.last_source == left
    # messages match per (source, tag): sent 1, 2, 3 with tags a, b, a; taken b first
    if SIZE > 1:
        if RANK == 0:
            for v, tag in ((1, 11), (2, 22), (3, 11)):
                c.send(np.array([v], np.int32), 1, tag=tag)
        elif RANK == 1:
            got = [c.recv(np.empty(1, np.int32), 0, tag=t)[0] for t in (22, 11, 11)]
            assert got == [2, 1, 3], got
    # to itself
    own = np.empty(3)
    with c.group():
        c.send(np.arange(3.0), RANK, tag=9)
        c.recv(own, RANK, tag=9)
    assert (own == np.arange(3.0)).all()
    # isend/irecv: posted in either order, completed by wait
    if SIZE > 1:
        p = RANK ^ 1
        if p < SIZE:
            a = np.empty(4)
            r1 = c.recv(a, p, tag=5, async_op=True)
            s1 = c.send(np.full(4, float(RANK)), p, tag=5, async_op=True)
            assert r1.wait(60) is a and s1.wait(60) is None
            assert (a == p).all()
    c.barrier()


def _ping_pong(c: pycoll.Communicator, p: int, x: np.ndarray, y: np.ndarray, tag: int) -> None:
    """One round trip with rank ``p``, the lower rank sending first: ``x`` goes,
    ``y`` gets p's."""
    if RANK < p:
        c.send(x, p, tag=tag)
        c.recv(y, p, tag=tag)
    else:
        c.recv(y, p, tag=tag)
        c.send(x, p, tag=tag)


@pytest.mark.parametrize("dtype", [np.uint8, np.float32, np.complex128], ids=str)
def test_replayed_ping_pong_between_processes(comms, dtype):
    """Blocking calls replayed on the same arrays (shm: the compiled ring step,
    ShmConnection.put_now and take_now, with a spin between processes): pairs
    of ranks ping-pong fresh random data of 1 element to a whole eager message,
    then the receiving rank gets another tag first, and a message of another
    count, which it refuses having written nothing."""
    c = comms[0]
    p = RANK ^ 1
    if p >= SIZE:
        c.barrier()
        return
    dt = np.dtype(dtype)
    for count in (1, 13, (32768 - 32) // dt.itemsize):
        x = np.empty(count, dt)
        y = np.empty(count, dt)
        for i in range(50):
            x[:] = data(RANK, count, dt, "sum", i)
            poison(y)
            _ping_pong(c, p, x, y, count)
            np.testing.assert_array_equal(y, data(p, count, dt, "sum", i), err_msg=f"{i=}")
        if RANK < p:
            c.send(np.full(count, 1, dt), p, tag=99)
            c.send(x, p, tag=count)
            c.send(np.zeros(count + 1, dt), p, tag=count)
        else:
            poison(y)
            c.recv(y, p, tag=count)  # the tag-99 message waits, unexpected
            np.testing.assert_array_equal(y, data(p, count, dt, "sum", 49))
            z = np.empty(count, dt)
            assert (c.recv(z, p, tag=99) == 1).all()
            poison(y)
            before = y.copy()
            with pytest.raises(pycoll.CollectiveMismatchError, match=f"{count + 1} x"):
                c.recv(y, p, tag=count)
            np.testing.assert_array_equal(y.view(np.uint8), before.view(np.uint8))
    c.barrier()


def test_large_messages_between_processes(comms):
    """Point-to-point messages of 4-9 MiB (shm: read in place and copied from
    both ends, the sender writing pieces into the receiver's buffer) between
    pairs of processes: ping-pong, both ways at once in a group, a send whose
    receive is posted late and one whose sender does other work first; fresh
    data each time, poisoned outputs."""
    c = comms[0]
    p = RANK ^ 1
    if p >= SIZE:
        c.barrier()
        return
    for i, count in enumerate(((1 << 20) + 3, (9 << 18) + 1, 2 << 20)):
        mine = data(RANK, count, np.dtype(np.float32), "sum", i)
        theirs = data(p, count, np.dtype(np.float32), "sum", i)
        got = poison(np.empty(count, np.float32))
        for _ in range(3):  # ping-pong (replayed blocking calls after the first)
            poison(got)
            _ping_pong(c, p, mine, got, i)
            np.testing.assert_array_equal(got, theirs)
        poison(got)
        with c.group():  # both ways at once
            c.send(mine, p, tag=i)
            c.recv(got, p, tag=i)
        np.testing.assert_array_equal(got, theirs)
        poison(got)
        if RANK < p:  # the receive is posted late; then the sender is away a while
            c.send(mine, p, tag=i)
            req = c.send(mine, p, tag=i + 100, async_op=True)
            time.sleep(0.01)
            assert req.wait(60) is None
        else:
            time.sleep(0.01)
            c.recv(got, p, tag=i)
            np.testing.assert_array_equal(got, theirs)
            poison(got)
            c.recv(got, p, tag=i + 100)
            np.testing.assert_array_equal(got, theirs)
    c.barrier()


def test_collectives_complete_earlier_point_to_point(comms):
    """A pending irecv completes before the next collective starts, as in NCCL."""
    c = comms[0]
    if SIZE < 2:
        return
    if RANK == 1:
        got = np.empty(2, np.int64)
        req = c.recv(got, 0, tag=1, async_op=True)
        total = c.allreduce(np.ones(1, np.int64))  # completes the recv first
        assert req.test() and (got == 7).all()
    else:
        if RANK == 0:
            c.send(np.full(2, 7), 1, tag=1)
        total = c.allreduce(np.ones(1, np.int64))
    assert total[0] == SIZE


# ------------------------------------------------------------------ sub-communicators
def test_split_and_dup(comms):
    c = comms[0]
    sub = c.split(RANK % 2, key=-RANK)
    members = [r for r in range(SIZE) if r % 2 == RANK % 2]
    members.sort(key=lambda r: -r)
    assert sub.size == len(members) and sub.rank == members.index(RANK)
    none = c.split(None if RANK == 0 else 1)
    assert (none is None) == (RANK == 0)
    dup = c.dup()
    assert dup.size == SIZE and dup.rank == RANK
    for it in range(3):  # interleaved from one thread: never paired across communicators
        a = c.allreduce(np.full(3, RANK + it, np.int64))
        b = sub.allreduce(np.full(3, RANK, np.int64))
        d = dup.allgather(np.array([RANK * 10 + it]))
        assert (a == sum(range(SIZE)) + SIZE * it).all()
        assert (b == sum(members)).all()
        assert (d.ravel() == np.arange(SIZE) * 10 + it).all()
        if none is not None:
            e = none.broadcast(np.full(2, RANK), root=0)
            assert (e == 1).all()
    if sub.size > 1:  # point-to-point inside the sub-communicator, by its ranks
        v = np.empty(1, np.int64)
        sub.sendrecv(np.array([RANK]), (sub.rank + 1) % sub.size, v, (sub.rank - 1) % sub.size)
        assert v[0] == members[(sub.rank - 1) % sub.size]
    twice = sub.split(0)
    assert twice.allreduce(np.ones(1))[0] == sub.size
    for x in (twice, sub, dup, none):
        if x is not None:
            x.close()
    assert c.allreduce(np.ones(1))[0] == SIZE  # the parent goes on
    with pytest.raises(pycoll.CommunicatorClosedError):
        sub.allreduce(np.ones(1))
