"""Bad input to the public API, generated: every case raises InvalidArgumentError
naming the argument and the rank, before any byte moves.

"Before any byte moves" is checked on a real two-rank communicator (ranks as
threads): only rank 0 is called, with bad arguments; no send or receive may be
posted on any of its connections and the communicator must not fail.  Each
rejected call still takes a sequence number (a rejected call counts as a call,
so that a rank that alone rejects one is seen to be out of step): after all
that, a good collective on both ranks raises CollectiveMismatchError on both,
naming how many calls apart they are.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import pycoll
from pycoll.communicator import Communicator
from tests.inproc import communicators, run_ranks
from tests.reference import OPS as OPS_ALL
from tests.reference import ops_for

pytestmark = pytest.mark.timeout(120)

GOOD = list(pycoll.DTYPES.values())  # every dtype pycoll supports
BAD_DTYPES = [
    np.dtype(t)
    for t in (
        np.longdouble,
        np.clongdouble,
        ">f4",
        ">i8",
        ">i2",
        ">c8",
        "S4",
        "U2",
        object,
        "V8",
        "datetime64[s]",
        "timedelta64[ms]",
        [("a", np.int32), ("b", np.float32)],
    )
]
COLLS = ("allreduce", "allgather", "broadcast", "reduce_scatter", "reduce")
SETTINGS = settings(
    max_examples=120,
    deadline=2000,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


class CountingConn:
    """A connection that counts the transfers posted on it."""

    def __init__(self, conn: Any, counter: list[int]) -> None:
        self._conn = conn
        self._counter = counter

    def isend(self, *a: Any, **k: Any) -> Any:
        self._counter[0] += 1
        return self._conn.isend(*a, **k)

    def irecv(self, *a: Any, **k: Any) -> Any:
        self._counter[0] += 1
        return self._conn.irecv(*a, **k)

    def irecv_into(self, *a: Any, **k: Any) -> Any:
        self._counter[0] += 1
        return self._conn.irecv_into(*a, **k)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._conn, name)


@pytest.fixture(scope="module")
def pair():
    # no group segment: every byte goes through the counted connections (the direct
    # algorithms' steps are covered by the unchanged collective sequence number)
    with communicators(2, timeout=20, group_slot_bytes=0) as comms:
        counter = [0]
        for c in comms:
            for p, conn in list(c._engine.conns.items()):
                c._engine.conns[p] = CountingConn(conn, counter)  # type: ignore[assignment]
        yield comms, counter

        # rank 0 alone made (rejected) calls: a good collective on both ranks finds
        # them out of step, rather than pairing rank 1's call with one of those
        def good(r: int) -> str:
            with pytest.raises(pycoll.CollectiveMismatchError, match="call.s. apart") as ei:
                comms[r].allreduce(np.full(5, r + 1, np.int64))
            return str(ei.value)

        run_ranks(2, good)
        assert counter[0] > 0


def _check(comm: Communicator, counter: list[int], call: Callable[[], Any], *names: str) -> str:
    seq, moved = comm._engine.seq, counter[0]
    with pytest.raises(pycoll.InvalidArgumentError) as ei:
        call()
    msg = str(ei.value)
    assert isinstance(ei.value, ValueError)
    assert f"rank {comm.rank}" in msg, msg
    assert any(n in msg for n in names), (names, msg)
    assert comm._engine.seq == seq + 1, "a rejected call took no sequence number"
    assert counter[0] == moved, "bytes were posted before the error"
    assert comm._engine.failed is None
    return msg


def _arr(dtype: np.dtype, n: int) -> np.ndarray:
    if dtype.kind in "SUOV" or dtype.fields:
        return np.zeros(n, dtype)
    return np.arange(n).astype(dtype)


def _call(comm: Communicator, coll: str, sendbuf: Any, **kw: Any) -> Callable[[], Any]:
    fn = getattr(comm, coll)
    if coll == "broadcast":
        kw.pop("recvbuf", None)
        kw.pop("op", None)
        return lambda: fn(sendbuf, **kw)
    if coll == "allgather":
        kw.pop("op", None)
        kw.pop("root", None)
    if coll in ("allreduce", "reduce_scatter"):
        kw.pop("root", None)
    if coll == "reduce":
        pass
    return lambda: fn(sendbuf, **kw)


@SETTINGS
@given(
    coll=st.sampled_from(COLLS),
    dtype=st.sampled_from(BAD_DTYPES),
    n=st.integers(0, 9).map(lambda k: 2 * k),
    where=st.sampled_from(["sendbuf", "recvbuf"]),
)
def test_unsupported_dtypes(pair, coll, dtype, n, where):
    (c, _), counter = pair
    good = _arr(np.dtype(np.float32), n)
    bad = _arr(dtype, n)
    if where == "sendbuf" or coll == "broadcast":
        _check(c, counter, _call(c, coll, bad), "sendbuf", " buf ", "buf has dtype")
    else:
        k = {"allgather": 2 * n, "reduce_scatter": n // 2}.get(coll, n)
        rb = _arr(dtype, k)
        _check(c, counter, _call(c, coll, good, recvbuf=rb), "recvbuf")


@SETTINGS
@given(
    coll=st.sampled_from(COLLS),
    dtype=st.sampled_from(GOOD),
    rows=st.integers(2, 6),
    cols=st.integers(2, 6),
    how=st.sampled_from(["step", "transpose", "fortran", "column"]),
)
def test_non_contiguous(pair, coll, dtype, rows, cols, how):
    (c, _), counter = pair
    base = _arr(dtype, 2 * rows * cols).reshape(2 * rows, cols)
    if how == "step":
        a = base[::2]
    elif how == "transpose":
        a = base.T
    elif how == "fortran":
        a = np.asfortranarray(base)
    else:
        a = base[:, 1:]
    assert not a.flags.c_contiguous
    _check(c, counter, _call(c, coll, a), "not C-contiguous")
    if coll in ("allreduce", "allgather", "reduce_scatter"):
        good = np.ascontiguousarray(base)
        k = {"allgather": 2 * good.size, "reduce_scatter": good.size // 2}.get(coll, good.size)
        rb = np.zeros(2 * k, dtype)[::2]
        _check(c, counter, _call(c, coll, good, recvbuf=rb), "recvbuf")


@pytest.mark.parametrize("dtype", GOOD, ids=str)
def test_ops_that_do_not_apply(pair, dtype):
    """Every op a dtype does not take (tests/reference.py's contract) is refused by
    name, with the dtype and the rank, before any byte moves."""
    (c, _), counter = pair
    for coll in ("allreduce", "reduce_scatter", "reduce"):
        for op in OPS_ALL:
            if op in ops_for(dtype):
                continue
            msg = _check(c, counter, _call(c, coll, _arr(dtype, 4), op=op, root=0), f"op={op!r}")
            assert f"dtype {dtype}" in msg, msg
            rop = pycoll.ReduceOp(op)  # the enum member too
            _check(c, counter, _call(c, coll, _arr(dtype, 4), op=rop, root=0), f"op={op!r}")


@SETTINGS
@given(
    dtype=st.sampled_from(GOOD),
    n=st.integers(1, 40),
    case=st.sampled_from(
        [
            "allreduce_inplace",
            "allreduce_recv",
            "reduce_root_inplace",
            "broadcast_nonroot",
            "allgather_recv",
            "reduce_scatter_recv",
        ]
    ),
)
def test_read_only(pair, dtype, n, case):
    (c, _), counter = pair
    a = _arr(dtype, 2 * n)
    ro = a.copy()
    ro.flags.writeable = False
    if case == "allreduce_inplace":
        _check(c, counter, lambda: c.allreduce(ro), "sendbuf is read-only")
    elif case == "allreduce_recv":
        _check(c, counter, lambda: c.allreduce(a, ro), "recvbuf is read-only")
    elif case == "reduce_root_inplace":
        _check(c, counter, lambda: c.reduce(ro, root=0), "sendbuf is read-only")
    elif case == "broadcast_nonroot":
        _check(c, counter, lambda: c.broadcast(ro, root=1), "buf is read-only")
    elif case == "allgather_recv":
        r = np.zeros(4 * n, dtype)
        r.flags.writeable = False
        _check(c, counter, lambda: c.allgather(a, r), "recvbuf is read-only")
    else:
        r = np.zeros(n, dtype)
        r.flags.writeable = False
        _check(c, counter, lambda: c.reduce_scatter(a, r), "recvbuf is read-only")


@SETTINGS
@given(
    coll=st.sampled_from(["allreduce", "allgather", "reduce_scatter", "reduce"]),
    dtype=st.sampled_from(GOOD),
    n=st.integers(1, 30),
    delta=st.integers(-5, 5).filter(bool),
    other_dtype=st.sampled_from(GOOD),
)
def test_wrong_sizes_and_dtypes(pair, coll, dtype, n, delta, other_dtype):
    (c, _), counter = pair
    x = _arr(dtype, 2 * n)
    want = {"allgather": 4 * n, "reduce_scatter": n}.get(coll, 2 * n)
    if want + delta >= 0:
        r = np.zeros(want + delta, dtype)
        _check(c, counter, _call(c, coll, x, recvbuf=r, root=0), "recvbuf has")
    if other_dtype != dtype:
        r = np.zeros(want, other_dtype)
        _check(c, counter, _call(c, coll, x, recvbuf=r, root=0), "recvbuf dtype")
    if coll == "reduce_scatter":
        odd = _arr(dtype, 2 * n + 1)
        _check(c, counter, lambda: c.reduce_scatter(odd), "not a multiple")


ROOTS = st.one_of(
    st.integers(max_value=-1),
    st.integers(min_value=2),
    st.booleans(),
    st.floats(allow_nan=True),
    st.text(max_size=3),
    st.none(),
    st.just([0]),
)


@SETTINGS
@given(coll=st.sampled_from(["broadcast", "reduce"]), root=ROOTS, dtype=st.sampled_from(GOOD))
def test_wrong_roots(pair, coll, root, dtype):
    (c, _), counter = pair
    x = _arr(dtype, 6)
    _check(c, counter, lambda: getattr(c, coll)(x, root=root), "root=")


OPS = st.one_of(
    st.text(max_size=8).filter(lambda s: s.lower() not in OPS_ALL),
    st.integers(),
    st.none(),
    st.just(np.add),
    st.just(["sum"]),
)


@SETTINGS
@given(coll=st.sampled_from(["allreduce", "reduce_scatter", "reduce"]), op=OPS)
def test_bad_ops(pair, coll, op):
    (c, _), counter = pair
    x = _arr(np.dtype(np.float32), 4)
    _check(c, counter, _call(c, coll, x, op=op, root=0), "op=")


@SETTINGS
@given(
    coll=st.sampled_from(["allreduce", "reduce_scatter", "reduce"]),
    dtype=st.sampled_from([d for d in GOOD if d.kind in "iu"]),
)
def test_avg_needs_floats(pair, coll, dtype):
    (c, _), counter = pair
    _check(c, counter, _call(c, coll, _arr(dtype, 4), op="avg", root=0), "op='avg'")


ALGOS = st.one_of(
    st.text(max_size=10).filter(
        lambda s: s.lower() not in ("auto", "ring", "tree", "oneshot", "rhd", "direct")
    ),
    st.integers(),
    st.none(),
    st.just(b"ring"),
)


@SETTINGS
@given(coll=st.sampled_from(COLLS), algo=ALGOS)
def test_bad_algorithms(pair, coll, algo):
    (c, _), counter = pair
    from pycoll import algorithms

    if isinstance(algo, str) and algo.lower() in algorithms.names(coll):
        return
    x = _arr(np.dtype(np.float64), 4)
    _check(c, counter, _call(c, coll, x, algorithm=algo, root=0), "algorithm=")


# (bytes, bytearray, memoryview and NumPy scalars have the buffer protocol: buffers)
NOT_ARRAYS = st.one_of(
    st.none(),
    st.integers(),
    st.floats(),
    st.text(max_size=8),
    st.lists(st.integers(), max_size=4),
    st.builds(object),
    st.builds(dict),
)


@SETTINGS
@given(coll=st.sampled_from(COLLS), obj=NOT_ARRAYS, where=st.sampled_from(["sendbuf", "recvbuf"]))
def test_not_arrays(pair, coll, obj, where):
    (c, _), counter = pair
    if where == "sendbuf" or coll == "broadcast":
        _check(c, counter, _call(c, coll, obj), "must be a NumPy array")
    elif obj is not None:
        x = _arr(np.dtype(np.float32), 4)
        _check(c, counter, _call(c, coll, x, recvbuf=obj, root=0), "recvbuf must be")


def test_partly_overlapping_buffers(pair):
    (c, _), counter = pair
    base = np.arange(16, dtype=np.float32)
    for coll, x, out in [
        ("allreduce", base[:8], base[4:12]),
        ("reduce", base[:8], base[1:9]),
        ("allgather", base[2:6], base[:8]),  # rank 0's block is base[0:4]
        ("allgather", base[4:8], base[:8]),  # rank 1's block, not rank 0's
        ("reduce_scatter", base[:8], base[4:8]),
    ]:
        _check(c, counter, _call(c, coll, x, recvbuf=out, root=0), "overlaps sendbuf")
    # the in-place forms stay allowed (on a pair in step: rank 0 of ``pair`` is not)
    with communicators(2, timeout=20) as comms:
        bufs = [np.arange(8, dtype=np.float32) + 10 * r for r in range(2)]
        run_ranks(2, lambda r: comms[r].allgather(bufs[r][r * 4 : (r + 1) * 4], recvbuf=bufs[r]))
        for b in bufs:
            assert (b == np.r_[np.arange(4), np.arange(4, 8) + 10]).all()
        run_ranks(2, lambda r: comms[r].allreduce(bufs[r], recvbuf=bufs[r]))
        for b in bufs:
            assert (b == 2 * np.r_[np.arange(4), np.arange(4, 8) + 10]).all()


def test_transport_of_bad_peer(pair):
    (c, _), _ = pair
    for peer in (-1, 2, "0", None, 1.0):
        with pytest.raises(pycoll.InvalidArgumentError, match="rank 0"):
            c.transport_of(peer)  # type: ignore[arg-type]


def test_closed_communicator_refuses_everything():
    with communicators(1) as (c,):
        c.close()
        c.close()
        x = np.ones(4, np.float32)
        for name, call in [
            ("allreduce", lambda: c.allreduce(x)),
            ("allgather", lambda: c.allgather(x)),
            ("broadcast", lambda: c.broadcast(x)),
            ("reduce_scatter", lambda: c.reduce_scatter(x)),
            ("reduce", lambda: c.reduce(x)),
            ("barrier", lambda: c.barrier()),
        ]:
            with pytest.raises(
                pycoll.CommunicatorClosedError, match=f"rank 0: {name}: communicator is closed"
            ):
                call()
        assert c._engine.seq == 0


def test_size_one_rejects_before_running():
    with communicators(1) as (c,):
        seq = c._engine.seq
        for call in (
            lambda: c.allreduce(np.ones(3, np.clongdouble)),
            lambda: c.allreduce(np.ones(3, np.bool_)),  # sum of bools
            lambda: c.reduce(np.ones(3), root=1),
            lambda: c.allreduce(np.ones(3), op="mean"),
            lambda: c.broadcast(np.ones((3, 3))[:, 0]),
        ):
            with pytest.raises(pycoll.InvalidArgumentError, match="rank 0"):
                call()
        assert c._engine.seq == seq + 5  # each took its number, as on every rank of a larger group
        assert (c.allreduce(np.ones(3)) == 1).all()


def test_read_only_buffers_are_not_outputs(pair):
    """bytes and read-only memoryviews are refused wherever they would be written,
    naming the argument, its type and the rank, before any byte moves."""
    (c, _), counter = pair
    x = np.arange(8, dtype=np.uint8)
    for ro in (bytes(8), memoryview(bytearray(8)).toreadonly()):
        name = type(ro).__name__
        for call, arg in (
            (lambda: c.allreduce(ro), "sendbuf"),
            (lambda: c.allreduce(x, ro), "recvbuf"),
            (lambda: c.allgather(x[:4], ro), "recvbuf"),
            (lambda: c.reduce_scatter(x, memoryview(bytes(4)).toreadonly()), "recvbuf"),
            (lambda: c.broadcast(ro, root=1), "buf"),
            (lambda: c.reduce(ro, root=0), "sendbuf"),
        ):
            msg = _check(c, counter, call, f"{arg} is read-only")
            assert name in msg or "memoryview" in msg, msg


def test_other_objects_are_refused(pair):
    (c, _), counter = pair
    for bad in ([1, 2, 3], "abc", 3.0, {"a": 1}):
        msg = _check(c, counter, lambda: c.allreduce(bad), "sendbuf must be")
        assert "buffer" in msg and type(bad).__name__ in msg, msg
