"""Device plans (pycoll/gpu/replay.py): a blocking ``direct`` call made again on
the same CuPy arrays and stream replays without its checks.

Every collective a plan replays, in place and out of place, is called again and
again on the same arrays with new contents each time (written on the stream
right before the call, so that pycoll's stream must wait for it), and each
result is checked against NumPy on every rank.  Also: the replays happen; a
call on another stream, or on arrays of another shape, is an ordinary call
and right; a plan holds its arrays until ``close()`` and none after it.  Runs
at n = 1 and under mpiexec.
"""

from __future__ import annotations

import gc
import weakref

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
K = 65537 + 34  # elements a rank (a prime count, not a multiple of anything)
ROUNDS = 5


@pytest.fixture(scope="module", autouse=True)
def _device():
    cp.cuda.Device(RANK % cp.cuda.runtime.getDeviceCount()).use()


def _shared(c) -> bool:
    return SIZE == 1 or (c._gpu is not None and c._gpu.shared_device and c._gpu.one_sided)


def _value(rank: int, rnd: int) -> np.ndarray:
    """Rank ``rank``'s input at round ``rnd``: small integers, exact in float32."""
    return (np.arange(SIZE * K, dtype=np.float32) % 97) + 3 * rank + rnd


CASES = [
    ("allreduce", False),
    ("allreduce", True),
    ("allgather", False),
    ("reduce_scatter", False),
    ("broadcast", True),
    ("reduce", False),
]


@pytest.mark.parametrize(
    "what,in_place", CASES, ids=[f"{w}-{'in' if i else 'out'}" for w, i in CASES]
)
def test_replays_read_fresh_data_and_are_right(comm, replays, what, in_place):
    if not _shared(comm):
        pytest.skip("plans are made where every rank uses one GPU")
    s = cp.cuda.Stream(non_blocking=True)
    n_in = K if what in ("allgather",) else SIZE * K
    with s:
        x = cp.empty(n_in, cp.float32)
        out = {
            "allreduce": None if in_place else cp.empty(n_in, cp.float32),
            "allgather": cp.empty(SIZE * K, cp.float32),
            "reduce_scatter": cp.empty(K, cp.float32),
            "broadcast": None,
            "reduce": cp.empty(n_in, cp.float32) if RANK == 0 else None,
        }[what]
    for rnd in range(ROUNDS):
        mine = _value(RANK, rnd)[:n_in]
        every = [_value(r, rnd)[:n_in] for r in range(SIZE)]
        with s:  # new contents, queued on the stream right before the call
            x.set(mine, stream=s)
            if out is not None:
                out.fill(-1.0)
        if what == "allreduce":
            got = comm.allreduce(x, out, stream=s)
            want = np.sum(every, axis=0)
        elif what == "allgather":
            got = comm.allgather(x, out, stream=s)
            want = np.concatenate(every)
        elif what == "reduce_scatter":
            got = comm.reduce_scatter(x, out, stream=s)
            want = np.sum(every, axis=0)[RANK * K : (RANK + 1) * K]
        elif what == "broadcast":
            got = comm.broadcast(x, root=0, stream=s)
            want = every[0]
        else:
            got = comm.reduce(x, out, root=0, stream=s)
            want = np.sum(every, axis=0) if RANK == 0 else None
        if want is not None:
            h = cp.asnumpy(got, stream=s)
            s.synchronize()
            np.testing.assert_array_equal(h, want, err_msg=f"rank {RANK}: {what} round {rnd}")
        else:
            s.synchronize()
    if SIZE > 1:
        assert replays[0] == ROUNDS - 1, f"rank {RANK}: {replays[0]} replays of {ROUNDS} calls"
    WORLD.Barrier()


def test_another_stream_or_shape_is_an_ordinary_call(comm, replays):
    if SIZE == 1 or not _shared(comm):
        pytest.skip("plans are made where every rank uses one GPU")
    a, b = cp.cuda.Stream(non_blocking=True), cp.cuda.Stream(non_blocking=True)
    x = cp.full(1 << 18, float(RANK + 1), cp.float32)
    total = SIZE * (SIZE + 1) / 2

    def refill(s: cp.cuda.Stream) -> None:
        # on the stream of the call that follows: a call is ordered after its
        # stream's work, and these streams do not wait for the default one
        with s:
            x.fill(float(RANK + 1))

    cp.cuda.Device().synchronize()
    comm.allreduce(x, stream=a)  # makes the plan
    a.synchronize()
    refill(b)
    comm.allreduce(x, stream=b)  # another stream: not the plan's
    b.synchronize()
    assert float(x.min()) == float(x.max()) == total
    assert replays[0] == 0
    x.shape = (2, 1 << 17)  # another shape: not the plan's either
    refill(a)
    comm.allreduce(x, stream=a)
    a.synchronize()
    assert float(x.min()) == float(x.max()) == total
    assert replays[0] == 0
    x.shape = (1 << 18,)
    for _ in range(2):  # a plan again (the latest call's), then its replay
        refill(a)
        comm.allreduce(x, stream=a)
        a.synchronize()
        assert float(x.min()) == float(x.max()) == total
    assert replays[0] == 1
    WORLD.Barrier()


def test_plans_hold_their_arrays_until_close():
    c = pycoll.init(timeout=120)
    x = cp.ones(1 << 18, cp.float32)
    s = cp.cuda.Stream(non_blocking=True)
    c.allreduce(x, stream=s)
    c.allreduce(x, stream=s)
    s.synchronize()
    held = weakref.ref(x)
    del x
    gc.collect()
    if SIZE > 1 and _shared(c):
        assert held() is not None, "the plan no longer holds its array"
        assert len(c._engine.plans.device_plans) == 1
    c.close()
    gc.collect()
    assert held() is None, "an array outlived close()"
    WORLD.Barrier()


@pytest.mark.parametrize("dtype", ["float32", "float64", "int8", "uint16", "int32", "int64"])
@pytest.mark.parametrize("op", ["sum", "prod", "band"])
def test_a_packed_launch_gives_the_bits_of_the_kernel_it_replaces(dtype, op):
    """A plan's reduction (``nary_launch``) against ``nary``, on random data with
    subnormals and signed zeros, out of place and with an output that is the
    first input; launched twice (the second one reads what the first wrote)."""
    from pycoll.gpu import reduce as dreduce
    from pycoll.reduce import ReduceOp

    dt, rop = np.dtype(dtype), ReduceOp(op)
    if rop is ReduceOp.BAND and dt.kind == "f":
        pytest.skip("bitwise ops are for integers")
    rng = np.random.default_rng(7)
    count = 65537
    if dt.kind == "f":
        host = [rng.standard_normal(count).astype(dt) for _ in range(3)]
        host[1][:64] = np.finfo(dt).smallest_subnormal * np.arange(64)
        host[2][64:128] = -0.0
    else:
        info = np.iinfo(dt)
        host = [rng.integers(info.min, info.max, count, dtype=dt, endpoint=True) for _ in range(3)]
    s = cp.cuda.Stream(non_blocking=True)
    fused = dreduce.nary(rop, dt, 3, 2)
    with s:
        xs = [cp.asarray(h) for h in host]
        a, b = xs[0].copy(), xs[0].copy()  # the first input, reduced into twice
        want = [cp.empty(count, dt) for _ in range(2)]
        got = [cp.empty(count, dt) for _ in range(2)]
        launch = dreduce.nary_launch(rop, dt, [a, xs[1], xs[2]], [a, got[0]], int(s.ptr))
        assert launch is not None
        for _ in range(2):
            fused([b, xs[1], xs[2]], [b, want[0]])
            launch()
        fused(xs, want)
        out = dreduce.nary_launch(rop, dt, xs, got, int(s.ptr))
        out()
    s.synchronize()
    for g, w in ((a, b), (got[0], want[0]), (got[1], want[1])):
        np.testing.assert_array_equal(cp.asnumpy(g).view(np.uint8), cp.asnumpy(w).view(np.uint8))
