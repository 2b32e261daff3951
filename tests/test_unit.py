"""Tier 1: configuration, buffers, errors, reductions, tree shapes, cost model, exports."""

from __future__ import annotations

import contextlib
import subprocess
import sys
import typing
import warnings

import ml_dtypes
import numpy as np
import pytest

import pycoll
from pycoll.algorithms import cost, names
from pycoll.algorithms.direct import GROUP_ALGORITHMS
from pycoll.algorithms.ring import segments
from pycoll.algorithms.tree import btree, double_btree, rooted_btree
from pycoll.buffers import as_buffer, is_device_array
from pycoll.config import Config, parse_algo
from pycoll.errors import InvalidArgumentError, PycollError, UnsupportedError
from pycoll.reduce import DTYPES, ReduceOp, check_op_dtype, parse_op, reduce_rows, ufunc
from tests.reference import assert_close, data, ops_for, reference

pytestmark = pytest.mark.timeout(60)


def test_public_surface_is_pinned() -> None:
    assert sorted(pycoll.__all__) == sorted(
        [
            "DTYPES",
            "CollectiveMismatchError",
            "CollectiveTimeout",
            "Communicator",
            "CommunicatorClosedError",
            "ConcurrentCallError",
            "Config",
            "ConnectError",
            "InvalidArgumentError",
            "PeerAbortedError",
            "PycollError",
            "ReduceOp",
            "Request",
            "TransportError",
            "UnsupportedError",
            "__version__",
            "init",
        ]
    )
    for name in pycoll.__all__:
        assert hasattr(pycoll, name)


def test_import_has_no_side_effects_and_needs_no_gpu_or_mpi_launcher() -> None:
    code = (
        "import sys, os; before = dict(os.environ); import pycoll, transports; "
        "assert 'cupy' not in sys.modules and 'pyverbs' not in sys.modules; "
        "assert 'mpi4py.MPI' not in sys.modules; assert dict(os.environ) == before"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_layering_transports_never_import_pycoll_or_mpi() -> None:
    import pathlib

    root = pathlib.Path(__file__).resolve().parent.parent / "transports"
    import re

    bad = re.compile(r"^\s*(import|from)\s+(pycoll|mpi4py)\b", re.M)
    for f in root.rglob("*.py"):
        assert not bad.search(f.read_text()), f


def test_error_tree() -> None:
    assert issubclass(pycoll.InvalidArgumentError, ValueError)
    for e in (
        pycoll.InvalidArgumentError,
        pycoll.TransportError,
        pycoll.ConnectError,
        pycoll.CollectiveTimeout,
        pycoll.PeerAbortedError,
        pycoll.CollectiveMismatchError,
        pycoll.UnsupportedError,
        pycoll.CommunicatorClosedError,
        pycoll.ConcurrentCallError,
    ):
        assert issubclass(e, PycollError)
    assert issubclass(pycoll.ConnectError, pycoll.TransportError)
    assert issubclass(pycoll.CollectiveTimeout, pycoll.TransportError)
    e = pycoll.TransportError("x", rank=1, peer=2, transport="tcp", errno=5)
    assert (e.rank, e.peer, e.transport, e.errno) == (1, 2, "tcp", 5)
    # every system error carries rank, peer and transport (None where there is none)
    m = pycoll.CollectiveMismatchError("x", rank=0, ranks=[3, 1])
    assert (m.rank, m.ranks, m.peer, m.transport) == (0, (3, 1), 3, None)
    u = pycoll.UnsupportedError("x", rank=2)
    assert (u.rank, u.peer, u.transport) == (2, None, None)


def test_a_peer_that_closed_because_of_another_rank_is_not_blamed() -> None:
    """A transport's PeerClosedError with the rank the peer closed because of
    becomes a PeerAbortedError naming that rank (``peer``) and the peer (``via``);
    the rank this one closes because of follows the same rule (engine.blame)."""
    from pycoll.engine import blame
    from pycoll.errors import from_transport
    from transports.base import PeerClosedError, TransportTimeout

    told = PeerClosedError("tcp peer rank 3 closed", peer=3, transport="tcp", cause_rank=2)
    e = from_transport(told, 0, "allreduce #7", {3: "tcp"})
    assert isinstance(e, pycoll.PeerAbortedError)
    assert (e.rank, e.peer, e.via, e.transport) == (0, 2, 3, "tcp")
    assert str(e).startswith(
        "rank 0: allreduce #7: rank 3 closed its connections because rank 2 failed ("
    )
    assert blame(told, 0) == 2
    seen = PeerClosedError("tcp peer rank 2 closed", peer=2, transport="tcp")
    e = from_transport(seen, 1, "allreduce #7", {2: "tcp"})
    assert (e.peer, getattr(e, "via", "-")) == (2, None) and blame(seen, 1) == 2
    # a peer that closed because it saw this rank fail: it is named, nobody else
    mine = PeerClosedError("shm: peer 3 closed", peer=3, transport="shm", cause_rank=1)
    e = from_transport(mine, 1, "allreduce #7", {3: "shm"})
    assert (e.peer, getattr(e, "via", "-")) == (3, None) and blame(mine, 1) is None
    assert "because it saw this rank fail" in str(e)
    # sub-communicators: ``me`` is the rank the transports know this one by
    e = from_transport(mine, 0, "allreduce #7", {}, me=1)
    assert e.peer == 3 and "because it saw this rank fail" in str(e)
    assert blame(TransportTimeout("t", pending=[4, 5]), 0) == 4


def test_config_from_env() -> None:
    c = Config.from_env(
        {
            "PYCOLL_TRANSPORT": "tcp,shm",
            "PYCOLL_RDMA_MEMORY": "dmabuf",
            "PYCOLL_RDMA_PROVIDER": "soft",
            "PYCOLL_SOCKET_IFNAME": "^lo",
            "PYCOLL_ALGO": "allreduce:tree,ring",
            "PYCOLL_CHUNK_BYTES": "64K",
            "PYCOLL_TIMEOUT": "12.5",
            "PYCOLL_CHECK": "1",
            "PYCOLL_DEBUG": "info",
            "PYCOLL_TUNE": "0",
        }
    )
    assert c.transports == ("tcp", "shm") and c.rdma_memory == "dmabuf"
    assert c.rdma_provider == "soft" and c.socket_ifname == "^lo"
    assert c.algorithm_for("allreduce") == "tree" and c.algorithm_for("broadcast") == "ring"
    assert c.chunk_bytes == 65536 and c.timeout == 12.5 and c.check and c.debug == "INFO"
    assert not c.tune and Config.from_env({"PYCOLL_TUNE": "on"}).tune
    assert Config.from_env({"PYCOLL_TIMEOUT": "5"}, timeout=7).timeout == 7  # arguments win
    d = Config.from_env({})
    assert d.transports == ("shm", "rdma", "tcp") and d.timeout > 0 and not d.check and d.tune


@pytest.mark.parametrize(
    "var,val",
    [
        ("PYCOLL_TRANSPORT", "carrier-pigeon"),
        ("PYCOLL_RDMA_MEMORY", "magic"),
        ("PYCOLL_RDMA_PROVIDER", "x"),
        ("PYCOLL_CHUNK_BYTES", "lots"),
        ("PYCOLL_CHUNK_BYTES", "8"),
        ("PYCOLL_TIMEOUT", "-1"),
        ("PYCOLL_TIMEOUT", "soon"),
        ("PYCOLL_DEBUG", "LOUD"),
        ("PYCOLL_ALGO", "gather:ring"),
        ("PYCOLL_ALGO", "allgather:oneshot"),
        ("PYCOLL_ALGO", "rnig"),
        ("PYCOLL_TUNE", "maybe"),
        ("PYCOLL_CHECK", "perhaps"),
        ("PYCOLL_RDMA_SOFT_CAPS", "magic"),
        ("PYCOLL_DEVICE_TRANSPORT", "nvlink"),
        ("PYCOLL_GROUP_SLOT_BYTES", "-1"),
    ],
)
def test_config_rejects_bad_values_naming_the_variable(var: str, val: str) -> None:
    with pytest.raises(InvalidArgumentError, match=var):
        Config.from_env({var: val})


def test_parse_algo() -> None:
    assert parse_algo("tree") == {"*": "tree"}
    assert parse_algo("allreduce:ring, broadcast:tree") == {
        "allreduce": "ring",
        "broadcast": "tree",
    }
    # "*" forces the collectives that have the algorithm; the others stay on auto
    c = Config(algo=parse_algo("oneshot,broadcast:Tree"))
    assert c.algorithm_for("allreduce") == "oneshot" and c.algorithm_for("allgather") is None
    assert c.algorithm_for("broadcast") == "tree"
    assert Config(algo={"*": "auto"}).algorithm_for("reduce") is None


@pytest.mark.parametrize(
    "field,value,says",
    [
        ("timeout", -1, "positive"),
        ("timeout", "soon", "number of seconds"),
        ("timeout", float("inf"), "finite"),
        ("chunk_bytes", 8, "at least 64"),
        ("chunk_bytes", 1.5e6, "int"),
        ("transports", ("tcp", "carrier-pigeon"), "choose from"),
        ("transports", (), "choose from"),
        ("rdma_memory", "magic", "choose from"),
        ("algo", {"allgather": "oneshot"}, "not one of"),
        ("algo", {"gather": "ring"}, "unknown collective"),
        ("check", "perhaps", "choose from 1, true"),
        ("check", 1, "True or False"),
        ("debug", "loud", "choose from"),
        ("device_host_bytes", -1, "at least 0"),
        ("group_slot_bytes", None, "int"),
    ],
)
def test_config_checks_every_field(field: str, value: object, says: str) -> None:
    """What init's overrides set is checked as its environment variable would be."""
    with pytest.raises(InvalidArgumentError, match=says):
        Config(**{field: value})  # type: ignore[arg-type]


def test_config_normalises_and_names_unknown_settings() -> None:
    c = Config(transports=["TCP"], debug="warning", rdma_provider="Soft")  # type: ignore[arg-type]
    assert c.transports == ("tcp",) and c.debug == "WARN" and c.rdma_provider == "soft"
    assert Config(device_transports=()).device_transports == ()
    with pytest.raises(InvalidArgumentError, match=r"unknown setting\(s\) \['chunk'\]"):
        Config.from_env({}, chunk=4096)


def test_init_names_the_rank_of_a_bad_setting() -> None:
    class World:
        def Get_rank(self) -> int:
            return 3

    with pytest.raises(InvalidArgumentError, match="rank 3: config timeout=0"):
        pycoll.init(World(), timeout=0)
    with pytest.raises(InvalidArgumentError, match="rank 3: unknown setting"):
        pycoll.init(World(), chunk_size=1)


def test_buffers() -> None:
    a = np.arange(12, dtype=np.float32).reshape(3, 4)
    b = as_buffer(a, 0, "t", "sendbuf", writable=True)
    assert b.count == 12 and b.flat.shape == (12,) and not b.is_device
    assert np.shares_memory(b.flat, a)
    with pytest.raises(InvalidArgumentError, match="rank 3.*sendbuf.*C-contiguous"):
        as_buffer(a[:, ::2], 3, "t", "sendbuf", writable=False)
    ro = np.ones(3)
    ro.flags.writeable = False
    with pytest.raises(InvalidArgumentError, match="read-only"):
        as_buffer(ro, 0, "t", "recvbuf", writable=True)
    as_buffer(ro, 0, "t", "sendbuf", writable=False)
    with pytest.raises(InvalidArgumentError, match="clongdouble|complex256"):
        as_buffer(np.ones(3, np.clongdouble), 0, "t", "sendbuf", writable=False)
    with pytest.raises(InvalidArgumentError, match="list"):
        as_buffer([1, 2], 0, "t", "sendbuf", writable=False)
    assert not is_device_array(a)


def test_device_array_without_cupy_is_unsupported() -> None:
    class FakeCuda:
        __cuda_array_interface__: typing.ClassVar = {
            "shape": (2,),
            "typestr": "<f4",
            "data": (0, False),
            "version": 3,
        }

    assert is_device_array(FakeCuda())
    try:
        import cupy  # noqa: F401
    except ImportError:
        with pytest.raises(UnsupportedError, match="CuPy"):
            as_buffer(FakeCuda(), 0, "t", "sendbuf", writable=False)


def test_ops_and_dtypes() -> None:
    assert parse_op("SUM", 0, "t") is ReduceOp.SUM and parse_op(ReduceOp.AVG, 0, "t")
    with pytest.raises(InvalidArgumentError, match="op='xor'"):
        parse_op("xor", 0, "t")
    with pytest.raises(InvalidArgumentError, match="avg"):
        check_op_dtype(ReduceOp.AVG, np.dtype(np.int32), 0, "t")
    assert DTYPES["bfloat16"] == np.dtype(ml_dtypes.bfloat16) and len(DTYPES) == 15
    for name in ("bool", "int16", "uint16", "complex64", "complex128"):
        assert DTYPES[name] == np.dtype(name)
    assert parse_op("BXOR", 0, "t") is ReduceOp.BXOR and parse_op("band", 0, "t") is ReduceOp.BAND


@pytest.mark.parametrize("dtype", list(DTYPES.values()), ids=str)
def test_which_op_takes_which_dtype(dtype: np.dtype) -> None:
    """The table of pycoll.reduce, checked against the contract written out in
    tests/reference.py, and each op against NumPy on two operands."""
    for op in ReduceOp:
        if op.value in ops_for(dtype):
            check_op_dtype(op, dtype, 0, "t")
            a = data(0, 11, dtype, op.value)
            b = data(1, 11, dtype, op.value)
            out = np.empty_like(a)
            reduce_rows(ufunc(op), [a, b], out)  # avg: the sum, divided at the end
            want = reference([a, b], "sum" if op is ReduceOp.AVG else op.value)
            assert_close(out, want, dtype, 2, f"{op.value} {dtype}")
            continue
        with pytest.raises(InvalidArgumentError) as ei:
            check_op_dtype(op, dtype, 3, "allreduce")
        msg = str(ei.value)
        assert "rank 3" in msg and f"op={op.value!r}" in msg and f"dtype {dtype}" in msg, msg


def test_min_max_of_three_rows_warn_nothing() -> None:
    """maximum and minimum get their output by keyword (NumPy 2.4 deprecates it by
    position); the other ufuncs keep it by position."""
    rows = np.arange(12, dtype=np.float32).reshape(3, 4)[::-1].copy()
    for op, want in ((ReduceOp.MAX, rows.max(0)), (ReduceOp.MIN, rows.min(0))):
        out = np.empty(4, np.float32)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            reduce_rows(ufunc(op), rows, out)
        assert np.array_equal(out, want)


def test_segments_cover_exactly() -> None:
    for lo, hi, n in [(0, 1, 4), (0, 7, 3), (5, 1000, 4), (0, 0, 2)]:
        b = segments(lo, hi, n)
        assert b[0] == lo and b[-1] == hi and all(b[i] <= b[i + 1] for i in range(n))
        assert max(b[i + 1] - b[i] for i in range(n)) - min(b[i + 1] - b[i] for i in range(n)) <= 1


def _check_tree(n: int, tree_of) -> int:
    parents = {}
    for r in range(n):
        p, ch = tree_of(r)
        parents[r] = p
        for c in ch:
            assert tree_of(c)[0] == r, (n, r, c)
        assert len(ch) <= 2
    roots = [r for r, p in parents.items() if p is None]
    assert len(roots) == 1
    for r in range(n):  # every node reaches the root
        seen, x = set(), r
        while parents[x] is not None:
            assert x not in seen
            seen.add(x)
            x = parents[x]
    return roots[0]


@pytest.mark.parametrize("n", range(1, 33))
def test_trees_are_trees(n: int) -> None:
    assert _check_tree(n, lambda r: btree(n, r)) == 0
    for t in (0, 1):
        _check_tree(n, lambda r, t=t: double_btree(n, r)[t])
    for root in range(n):
        assert _check_tree(n, lambda r, root=root: rooted_btree(n, r, root)) == root


@pytest.mark.parametrize("n", [4, 8, 16, 6, 12])
def test_double_tree_interior_nodes_are_mostly_leaves_in_the_other(n: int) -> None:
    inner = [{r for r in range(n) if double_btree(n, r)[t][1]} for t in (0, 1)]
    assert len(inner[0] & inner[1]) <= 1


def point_to_point(coll: str) -> tuple[str, ...]:
    """The candidates when ranks do not all share one host (no ``direct``, ``cma``)."""
    return tuple(a for a in names(coll) if a not in GROUP_ALGORITHMS)


def test_cost_model_prefers_tree_small_ring_large_at_scale() -> None:
    ar = point_to_point("allreduce")
    assert set(ar) >= {"ring", "tree"}
    assert cost.choose("allreduce", ar, 16, 8, 1 << 20) in ("tree", "oneshot")
    assert cost.choose("allreduce", ar, 4, 1 << 28, 1 << 20) == "ring"
    assert cost.choose("reduce", point_to_point("reduce"), 2, 8, 1 << 20) == "tree"  # 1.8x
    assert cost.choose("allreduce", ar, 2, 8, 1 << 20) == "oneshot"
    assert cost.estimate("allreduce", "oneshot", 4, cost.ONESHOT_MAX_BYTES + 1, 1 << 20) == float(
        "inf"
    )
    for coll in ("allgather", "broadcast", "reduce_scatter", "reduce"):
        assert cost.choose(coll, names(coll), 4, 1 << 20, 1 << 20) in names(coll)


def test_cost_model_allgather_leaves_direct_for_the_ring_at_large_blocks() -> None:
    """By address, allgather leaves direct for the ring from DIRECT_ALLGATHER_BIG
    blocks, at every n; broadcast stays direct."""
    ag, bc = names("allgather"), names("broadcast")
    big = cost.DIRECT_ALLGATHER_BIG
    for n in (2, 3, 4):
        for size in (2 << 20, 5592404, 16 << 20, big - 4):
            assert cost.choose("allgather", ag, n, size, 1 << 20) == "direct", (n, size)
        assert cost.choose("allgather", ag, n, big, 1 << 20) == "ring"
        for size in (8, cost.DIRECT_SLOT_BYTES, 2 << 20, 1 << 28):
            assert cost.choose("broadcast", bc, n, size, 1 << 20) == "direct"


@pytest.mark.parametrize(
    "coll", ["allreduce", "allgather", "broadcast", "reduce_scatter", "reduce"]
)
def test_cost_model_prefers_direct_on_one_host(coll: str) -> None:
    """Measured at n = 2..4 on the 2-core machine: direct was the fastest at every
    size, except allgather of large blocks, where the pipelined ring won."""
    for n in (2, 3, 4):
        for size in (8, 4096, 1 << 16, (1 << 16) + 4, 1 << 18, (1 << 18) + 4, 1 << 20, 1 << 26):
            want = "ring" if coll == "allgather" and size >= 1 << 26 else "direct"
            assert cost.choose(coll, names(coll), n, size, 1 << 20) == want, (n, size)
    if coll == "allgather":  # per-rank blocks: direct below DIRECT_ALLGATHER_BIG
        assert cost.choose(coll, names(coll), 2, 2 << 20, 1 << 20) == "direct"
        assert cost.choose(coll, names(coll), 2, cost.DIRECT_ALLGATHER_BIG, 1 << 20) == "ring"
        assert cost.choose(coll, names(coll), 4, 1 << 20, 1 << 20) == "direct"
        assert cost.choose(coll, names(coll), 4, 8 << 20, 1 << 20) == "direct"


def test_group_segment_waits_time_out_and_notice_dead_or_closed_peers() -> None:
    """The group segment (direct algorithms): publish/wait, timeout, exited and closed peers."""
    import os
    import secrets
    import subprocess

    from transports.base import (
        Backoff,
        Deadline,
        PeerClosedError,
        TransportError,
        TransportTimeout,
    )
    from transports.shm_group import ShmGroup

    quick = Backoff(spins=1, yields=1, max_sleep=1e-4)
    token = secrets.token_bytes(8)
    a = ShmGroup.create(token, 0, 2, 4096)
    b = ShmGroup.attach(a.handle, 1, 2)
    try:
        a.release_handle()
        assert not [f for f in os.listdir("/dev/shm") if token.hex() in f]  # never named
        b.post(1)
        a.wait([1], 1, Deadline.after(5), quick)
        with pytest.raises(TransportTimeout) as ti:
            a.wait([1], 2, Deadline.after(0.05), quick)
        assert ti.value.pending == (1,)
        dead = subprocess.Popen(["true"])
        dead.wait()
        a._pids[1] = dead.pid  # as if rank 1 had been that process
        with pytest.raises(PeerClosedError, match="has exited"):
            a.wait([1], 2, Deadline.after(5), quick)
        a._pids[1] = os.getpid()
        b.close()
        with pytest.raises(PeerClosedError, match="closed"):
            a.wait([1], 2, Deadline.after(5), quick)
        with pytest.raises(TransportError, match="segment is closed"):
            b.claim(b.slots + 1, Deadline.after(5), quick)  # its own segment, closed
    finally:
        b.close()
        a.close()


def test_group_segment_close_because_names_the_rank_that_failed() -> None:
    """A rank that closes the group segment because another rank failed says so
    in its "closed" word: a rank waiting on it names both."""
    from transports.base import Backoff, Deadline, PeerClosedError

    quick = Backoff(spins=1, yields=1, max_sleep=1e-4)
    with _group_pair(2) as (a, b):
        b.close_because(5)
        with pytest.raises(
            PeerClosedError, match="rank 1 closed its connection because rank 5"
        ) as ei:
            a.wait([1], 1, Deadline.after(5), quick)
        assert (ei.value.peer, ei.value.cause_rank) == (1, 5)
    with _group_pair(2) as (a, b):
        b.close()
        with pytest.raises(PeerClosedError) as ei:
            a.wait([1], 1, Deadline.after(5), quick)
        assert ei.value.cause_rank is None


@contextlib.contextmanager
def _group_pair(k: int) -> typing.Iterator[tuple[typing.Any, typing.Any]]:
    """Ranks 0 and 1 of a two-rank group segment with K = ``k`` slots of 4 KiB."""
    import secrets

    from transports.shm_group import ShmGroup

    token = secrets.token_bytes(8)
    a = ShmGroup.create(token, 0, 2, 4096, slots=k)
    try:
        b = ShmGroup.attach(a.handle, 1, 2)
        try:
            a.release_handle()
            yield a, b
        finally:
            b.close()
    finally:
        a.close()


@pytest.mark.parametrize("k", [2, 8])
def test_group_segment_runs_k_steps_ahead_with_a_range_per_slot(k: int) -> None:
    """Step s uses slot s % K and posted range s % W: a rank claims K steps that
    fill whole slots without its peer, the next claim waits for the peer's done,
    and ranges of K steps coexist."""
    from transports.base import Backoff, Deadline, TransportError, TransportTimeout

    quick = Backoff(spins=1, yields=1, max_sleep=1e-4)
    with _group_pair(k) as (a, b):
        assert b.slots == k and len(b.views(np.uint8, 16)) == b.words == 64
        srcs = [np.full(8 * s, s, np.uint8) for s in range(1, k + 1)]
        for s in range(1, k + 1):
            a.claim(s, Deadline.after(5), quick)  # no wait: slots 1..K are fresh
            a.slot(0, s)[:4] = s
            a.post(s, int(srcs[s - 1].__array_interface__["data"][0]), srcs[s - 1].nbytes)
        with pytest.raises(TransportTimeout):
            a.claim(k + 1, Deadline.after(0.05), quick)  # slot of step 1: b still reads it
        for s in range(1, k + 1):
            b.wait([0], s, Deadline.after(5), quick)
            assert list(b.slot(0, s)[:4]) == [s] * 4
            got = np.zeros(8 * s, np.uint8)
            if b.probe()[0]:
                b.read(0, s, 0, got)
                assert (got == s).all()
            with pytest.raises(TransportError, match="posted"):
                b.read(0, s, 0, np.zeros(8 * s + 1, np.uint8))
        b.done(1)
        a.claim(k + 1, Deadline.after(5), quick)
        with pytest.raises(TransportTimeout):
            a.claim(k + 2, Deadline.after(0.05), quick)


@pytest.mark.parametrize("k", [2, 8])
def test_group_segment_runs_w_small_steps_ahead(k: int) -> None:
    """A small step (at most sub_bytes a rank) fills a part of its slot of its
    own: a rank claims W of them without its peer, each part keeps its bytes
    until the peer read them, and the next claim waits for the peer's done.  A
    step that fills a whole slot waits K steps back, and a small step in that
    slot afterwards waits until the peer is done with it."""
    from transports.base import Backoff, Deadline, TransportTimeout
    from transports.shm_group import SUB_BYTES

    quick = Backoff(spins=1, yields=1, max_sleep=1e-4)

    def late(g: typing.Any, s: int, small: bool) -> None:
        with pytest.raises(TransportTimeout):
            g.claim(s, Deadline.after(0.05), quick, small)

    with _group_pair(k) as (a, b):
        W, sub = a.words, a.sub_bytes
        assert W == 64 and sub == min(SUB_BYTES, a.slot_bytes // (W // k)) // 64 * 64
        assert a.small(sub)
        assert not a.small(sub + 1)
        parts = {a.addresses(0, i, True)[0] for i in range(W)}
        assert len(parts) == W  # a part of its own for each word index
        first = a.addresses(0, 0)[0]
        assert all(first <= p < first + k * a.slot_bytes for p in parts)
        for s in range(1, W + 1):
            a.claim(s, Deadline.after(5), quick, True)  # no wait: W fresh words
            a.views(np.uint16, sub // 2)[s % W][0][:] = s
            a.post(s)
        late(a, W + 1, True)  # the word and part of step 1: b has not read them
        for s in range(1, W + 1):
            b.wait([0], s, Deadline.after(5), quick)
            assert (b.views(np.uint16, sub // 2)[s % W][0] == s).all(), s
        b.done(1)
        a.claim(W + 1, Deadline.after(5), quick, True)
        a.post(W + 1)
        b.done(W + 1)
        big = W + 2
        a.claim(big, Deadline.after(5), quick)  # whole slot: step big - K is read
        assert a.last_big == big
        a.post(big)
        for s in range(big + 1, big + k):  # small, in the other slots
            a.claim(s, Deadline.after(5), quick, True)
            a.post(s)
        late(a, big + k, True)  # small, in the big step's slot: b has not read it
        b.done(big)
        a.claim(big + k, Deadline.after(5), quick, True)


@pytest.mark.parametrize("k", [2, 8])
def test_group_segment_steps_posted_ahead_are_not_taken_as_consumed(k: int) -> None:
    """A rank may post up to ``ahead`` steps before it reads them (``consumed=False``
    after the first): a peer that sees those steps still waits for its ``done``
    before rewriting a slot it has yet to read."""
    from transports.base import Backoff, Deadline, TransportTimeout
    from transports.shm_group import AHEAD

    quick = Backoff(spins=1, yields=1, max_sleep=1e-4)
    with _group_pair(k) as (a, b):
        assert a.ahead == b.ahead == min(AHEAD, k)
        for s in range(1, a.ahead + 1):
            a.claim(s, Deadline.after(5), quick)
            a.post(s, consumed=s == 1)
        b.wait([0], a.ahead, Deadline.after(5), quick)
        for s in range(1, k + 1):
            b.claim(s, Deadline.after(5), quick)  # fresh slots
        with pytest.raises(TransportTimeout):
            b.claim(k + 1, Deadline.after(0.05), quick)  # a has not read step 1 yet
        a.done(1)
        b.claim(k + 1, Deadline.after(5), quick)
        with pytest.raises(TransportTimeout):
            b.claim(k + 2, Deadline.after(0.05), quick)


def test_device_host_route_on_a_shared_gpu() -> None:
    """auto sends small device collectives through the host, except on a GPU every
    rank shares where a rank's copy back to the device would be under 28 KiB (such
    copies wait for the other processes' time slices), but for a broadcast between
    two ranks; explicit limits are obeyed as they are."""
    from types import SimpleNamespace

    from tests.inproc import communicators

    for explicit in (False, True):
        cfg = {"device_host_bytes": 128 << 10} if explicit else {}
        with communicators(1, **cfg) as (c,):
            c._policy.size = 4  # the rule reads only the size, the limits and the GPU context
            via = c._policy.via_host
            c._policy.gpu = None  # type: ignore[assignment]
            assert via("allreduce", "auto", 8) and not via("allreduce", "ring", 8)
            assert not via("allreduce", "auto", (128 << 10) + 1)
            for shared in (False, True):
                c._policy.gpu = SimpleNamespace(shared_device=shared)  # type: ignore[assignment]
                skip = shared and not explicit
                assert via("allreduce", "auto", 16 << 10) != skip
                assert via("allreduce", "auto", 28 << 10)
                assert via("allreduce", "auto", (28 << 10) - 4) != skip
                assert via("reduce", "auto", 16 << 10) != skip
                assert via("reduce_scatter", "auto", 64 << 10) != skip  # 16 KiB back a rank
                assert via("reduce_scatter", "auto", 128 << 10)
                assert via("allgather", "auto", 4 << 10) != skip  # 16 KiB back
                assert via("allgather", "auto", 8 << 10)
                assert via("broadcast", "auto", 16 << 10) != skip
                assert via("broadcast", "auto", 32 << 10)
                c._policy.size = 2  # one receiver: its copy back is queued, nothing waits for it
                assert via("broadcast", "auto", 8)
                c._policy.size = 4
            c._policy.size, c._policy.gpu = 1, None  # as they were, for close()


def test_async_allreduces_through_host_mirrors_on_a_shared_gpu() -> None:
    """The torch backend's asynchronous allreduces on CUDA tensors go through pinned
    host mirrors only where every rank shares one GPU, up to the limit (0: never),
    and no other collective does; the limit is read from its variable."""
    from types import SimpleNamespace

    from tests.inproc import communicators

    assert Config.from_env({"PYCOLL_DEVICE_ASYNC_HOST_BYTES": "2M"}).device_async_host_bytes == (
        2 << 20
    )
    with pytest.raises(InvalidArgumentError, match="PYCOLL_DEVICE_ASYNC_HOST_BYTES"):
        Config.from_env({"PYCOLL_DEVICE_ASYNC_HOST_BYTES": "-1"})
    for limit in (None, 1 << 20, 0):
        cfg = {} if limit is None else {"device_async_host_bytes": limit}
        with communicators(1, **cfg) as (c,):
            most = c.config.device_async_host_bytes
            assert most == (4 << 20 if limit is None else limit)
            via = c.async_via_host
            assert not via("allreduce", 8)  # n = 1: no GPU context, no peers
            c._policy.size = 2
            for shared in (False, True):
                c._policy.gpu = SimpleNamespace(shared_device=shared)  # type: ignore[assignment]
                assert via("allreduce", 8) == (shared and most >= 8)
                assert via("allreduce", most) == (shared and most > 0)
                assert not via("allreduce", most + 1)
                assert not via("broadcast", 8) and not via("reduce_scatter", 8)
            c._policy.size, c._policy.gpu = 1, None  # as they were, for close()


def test_a_wait_for_queued_device_work_is_bounded() -> None:
    """The poll that waits for work queued on a stream (a device collective's
    copy to the host, the torch backend's mirrors) returns once it is done and
    raises the caller's error once the timeout has passed, never hanging."""
    import time

    from pycoll.errors import CollectiveTimeout
    from pycoll.gpu.jobs import poll

    polls = []

    def later() -> bool:
        polls.append(1)
        return len(polls) > 50

    poll(later, 5.0, lambda: CollectiveTimeout("unused"))
    assert len(polls) == 51
    start = time.monotonic()
    with pytest.raises(CollectiveTimeout, match="stuck stream"):
        poll(lambda: False, 0.05, lambda: CollectiveTimeout("rank 0: stuck stream", rank=0))
    assert 0.05 <= time.monotonic() - start < 2


def test_pycoll_deprecation_warnings_fail_the_tests() -> None:
    """pyproject's filterwarnings: a DeprecationWarning raised from pycoll's or
    transports' code is an error under pytest; another library's is not."""
    for module in ("pycoll.reduce", "transports.shm"):
        with pytest.raises(DeprecationWarning):
            warnings.warn_explicit("old", DeprecationWarning, f"{module}.py", 1, module=module)
    with pytest.warns(DeprecationWarning):
        warnings.warn_explicit("old", DeprecationWarning, "numpy/x.py", 1, module="numpy.x")


def test_buffer_protocol_and_tensors_are_viewed_without_a_copy() -> None:
    import array

    a = np.arange(6, dtype=np.float64)
    for obj, dtype in (
        (memoryview(a), np.float64),
        (bytearray(b"abc"), np.uint8),
        (array.array("h", [1, -2, 3]), np.int16),
        (memoryview(bytearray(4)).cast("?"), np.bool_),
    ):
        b = as_buffer(obj, 0, "t", "recvbuf", writable=True)
        assert b.dtype == np.dtype(dtype) and not b.is_device, obj
        assert np.shares_memory(b.flat, np.asarray(memoryview(obj))), obj
        assert b.shape == memoryview(obj).shape
    b = as_buffer(memoryview(a.reshape(2, 3)), 0, "t", "sendbuf", writable=False)
    assert b.shape == (2, 3) and b.count == 6 and np.shares_memory(b.flat, a)
    b = as_buffer(b"xyz", 0, "t", "sendbuf", writable=False)  # an input may be read-only
    assert b.count == 3 and b.dtype == np.uint8
    with pytest.raises(InvalidArgumentError, match="rank 2: t: recvbuf is read-only \\(bytes\\)"):
        as_buffer(b"xyz", 2, "t", "recvbuf", writable=True)
    with pytest.raises(InvalidArgumentError, match="rank 1: t: sendbuf .*not C-contiguous"):
        as_buffer(memoryview(a)[::2], 1, "t", "sendbuf", writable=False)
    with pytest.raises(InvalidArgumentError, match="rank 0: t: sendbuf has dtype float128"):
        as_buffer(memoryview(np.ones(2, np.longdouble)), 0, "t", "sendbuf", writable=False)


def test_torch_cpu_tensors_are_viewed_without_a_copy() -> None:
    torch = pytest.importorskip("torch")
    for dt in (torch.float32, torch.bool, torch.int16, torch.uint16, torch.complex128):
        t = torch.zeros(5, dtype=dt)
        b = as_buffer(t, 0, "t", "recvbuf", writable=True)
        assert b.flat.__array_interface__["data"][0] == t.data_ptr() and b.count == 5
        assert b.flat.flags.writeable and str(b.dtype) == str(dt).removeprefix("torch.")
        t.resize_(1 << 16)  # the view leaves the storage resizable (tensor.numpy() does not)
    t = torch.arange(4, dtype=torch.bfloat16)
    b = as_buffer(t, 0, "t", "sendbuf", writable=False)
    assert b.dtype == DTYPES["bfloat16"] and list(b.flat.astype(np.float32)) == [0, 1, 2, 3]
    g = torch.ones(3, requires_grad=True)
    assert as_buffer(g, 0, "t", "sendbuf", writable=False).count == 3
    assert as_buffer(torch.ones(2, 3), 0, "t", "sendbuf", writable=False).shape == (2, 3)
    assert as_buffer(torch.ones(0), 0, "t", "sendbuf", writable=False).count == 0
    with pytest.raises(InvalidArgumentError, match=r"rank 1: t: sendbuf .*\.contiguous\(\)"):
        as_buffer(torch.ones(4, 4).t(), 1, "t", "sendbuf", writable=False)
    with pytest.raises(InvalidArgumentError, match="resolve_conj"):
        as_buffer(torch.ones(3, dtype=torch.complex64).conj(), 0, "t", "sendbuf", writable=False)
    with pytest.raises(InvalidArgumentError, match="rank 0: t: sendbuf has dtype torch.float8"):
        as_buffer(torch.ones(3).to(torch.float8_e4m3fn), 0, "t", "sendbuf", writable=False)


# ----------------------------------------------------------------------------- bootstrap seam
def test_store_bootstrap_names_the_rank_that_never_arrives(tmp_path) -> None:
    import time

    from pycoll.rendezvous import StoreBootstrap
    from pycoll.stores import FileStore, HashStore
    from tests.inproc import run_ranks

    for store in (HashStore(), FileStore(tmp_path / "s")):
        t0 = time.monotonic()

        def go(r: int, store: object = store) -> str:
            b = StoreBootstrap(store, r, 3)
            try:
                b.arrive(0.5)
            except pycoll.ConnectError as exc:
                assert exc.peer == 2
                return str(exc)
            return "arrived"

        said = run_ranks(2, go)  # rank 2 of 3 never comes
        assert time.monotonic() - t0 < 5
        for r in (0, 1):
            assert said[r].startswith(
                f"rank {r}: pycoll.init: rank(s) [2] of the 3 did not call"
            ), said


def test_store_bootstrap_exchanges_plain_data_only() -> None:
    import pickle

    from pycoll.rendezvous import StoreBootstrap, decode, encode
    from pycoll.stores import HashStore
    from tests.inproc import run_ranks

    store = HashStore()

    def go(r: int) -> tuple[object, ...]:
        b = StoreBootstrap(store, r, 2)
        b.arrive(5)
        got = b.allgather({"rank": r, "blob": bytes([r])}, 5, "t")
        root = b.bcast(("from", r), 1, 5, "t")
        b.barrier(5, "t")
        return got, root

    for got, root in run_ranks(2, go):
        assert got == [{"rank": 0, "blob": b"\0"}, {"rank": 1, "blob": b"\1"}]
        assert root == ("from", 1)
    assert decode(encode((1, [b"x", {2: (True, None)}]))) == (1, [b"x", {2: (True, None)}])
    with pytest.raises(pickle.UnpicklingError, match="may not name"):
        decode(pickle.dumps(InvalidArgumentError("x")))


def test_init_over_a_store_checks_its_arguments() -> None:
    from pycoll.stores import HashStore

    with pytest.raises(InvalidArgumentError, match="needs rank= and size="):
        pycoll.init(store=HashStore(), rank=0)
    with pytest.raises(InvalidArgumentError, match=r"rank=2 must be an int in \[0, 2\)"):
        pycoll.init(store=HashStore(), rank=2, size=2)
    with pytest.raises(InvalidArgumentError, match="has no set, get, wait"):
        pycoll.init(store=object(), rank=0, size=1)


def test_a_failed_shm_connection_falls_back_to_tcp(monkeypatch) -> None:
    """A segment that cannot be created at connect time (after listen's probe
    passed): the pairs move to tcp together, with a warning, and the message
    names the rank once."""
    import transports._segment as seg
    from tests.inproc import communicators

    real = seg.create

    def create(size: int, **kw: object) -> object:
        if kw.get("ident") != b"probe" and kw.get("peer", -1) != -1:  # a pair segment
            raise seg.ConnectError("injected: no room", peer=kw.get("peer"), transport="shm")
        return real(size, **kw)  # type: ignore[arg-type]

    import logging

    monkeypatch.setattr(seg, "create", create)
    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = records.append  # type: ignore[method-assign]
    logging.getLogger("pycoll.bootstrap").addHandler(handler)
    try:
        with communicators(3, transports=("shm", "tcp"), timeout=2, group_slot_bytes=0) as comms:
            for c in comms:
                assert all(c.transport_of(p) == "tcp" for p in range(3) if p != c.rank)
    finally:
        logging.getLogger("pycoll.bootstrap").removeHandler(handler)
    said = [r.getMessage() for r in records if "falling back to tcp" in r.getMessage()]
    assert said and all("rank 0: rank 0:" not in m for m in said), said


def test_check_alive_looks_a_pid_up_at_most_every_few_ms_and_still_sees_an_exit(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The pid lookup behind every shared-memory liveness check is rate-limited
    (it costs tens of microseconds); a closed word is read every time, and a
    peer that exits is still reported within PID_CHECK_SECONDS."""
    import time

    from transports import _atomic, _segment
    from transports.base import PeerClosedError

    lookups: list[int] = []
    real = _segment.process_gone

    def counted(pid: int) -> bool:
        lookups.append(pid)
        return real(pid)

    monkeypatch.setattr(_segment, "process_gone", counted)
    closed = _atomic.Counter(bytearray(8), 0)
    child = subprocess.Popen(
        [sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE
    )
    try:
        t0 = time.monotonic()
        for _ in range(100):
            _segment.check_alive(closed, child.pid, "peer", peer=1, transport="shm")
        most = 2 + (time.monotonic() - t0) / _segment.PID_CHECK_SECONDS
        assert 1 <= len(lookups) <= most < 50
        closed.store(_segment.CLOSED)
        with pytest.raises(PeerClosedError, match="closed its connection"):
            _segment.check_alive(closed, child.pid, "peer", peer=1, transport="shm")
        closed.store(0)
    finally:
        assert child.stdin is not None
        child.stdin.close()
        child.wait(10)  # reaped: the pid is gone
    end = time.monotonic() + 2
    with pytest.raises(PeerClosedError, match="has exited"):
        while time.monotonic() < end:
            _segment.check_alive(closed, child.pid, "peer", peer=1, transport="shm")


def test_a_driver_call_on_a_thread_without_a_context_binds_one_and_retries(monkeypatch):
    """A progress thread that made no CUDA runtime call has no current context: a
    driver call answering CUDA_ERROR_INVALID_CONTEXT binds the primary context
    (cudaFree(NULL)) and runs again, once."""
    from types import SimpleNamespace

    from transports import cuda_driver

    calls: list[tuple] = []
    monkeypatch.setattr(
        cuda_driver, "runtime", lambda: SimpleNamespace(free=lambda p: calls.append(("free", p)))
    )
    answers = iter([201, 0, 201, 201])

    def fn(*args):
        calls.append(("fn", args))
        return next(answers)

    assert cuda_driver._call(fn, 1, 2) == 0
    assert calls == [("fn", (1, 2)), ("free", 0), ("fn", (1, 2))]
    assert cuda_driver._call(fn, 3) == 201  # still no context: the error is the caller's


def test_queuer_binds_the_devices_context_once_and_names_a_failed_call(monkeypatch):
    """The driver calls made with the GIL held (torch's mirrored allreduces): one
    answering CUDA_ERROR_INVALID_CONTEXT makes the device's primary context
    current and runs again; a query's CUDA_ERROR_NOT_READY is an answer, not an
    error; any other error raises, naming the call and the error."""
    from transports import cuda_driver
    from transports.base import TransportError

    calls: list[tuple] = []
    answers = {"cuEventRecord": [201, 0, 700], "cuEventQuery": [600, 0]}

    class Fn:
        def __init__(self, name):
            self.name = name

        def __call__(self, *args):
            calls.append((self.name, *args))
            todo = answers.get(self.name)
            return todo.pop(0) if todo else 0

    class Lib:
        def __getattr__(self, name):
            return Fn(name)

    monkeypatch.setattr(cuda_driver.Queuer, "_lib", Lib())
    cu = cuda_driver.Queuer(3)
    cu.record(11, 22)
    names = [c[0] for c in calls]
    assert names == [
        "cuEventRecord",
        "cuDeviceGet",
        "cuDevicePrimaryCtxRetain",
        "cuCtxSetCurrent",
        "cuEventRecord",
    ]
    assert calls[1][2] == 3 and calls[-1][1:] == (11, 22)
    with pytest.raises(TransportError, match="cuEventRecord failed with CUDA error 700"):
        cu.record(11, 22)
    assert cu.done(5) is False
    assert cu.done(5) is True


@pytest.mark.parametrize("compiled", [True, False], ids=["vm_copy", "ctypes"])
def test_cross_memory_copies_move_the_bytes_and_name_the_errno(
    compiled: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``_cma.read`` and ``write`` (compiled ``_ring.vm_copy``, else ctypes) move
    exactly the bytes asked for, and raise OSError with the errno: ESRCH for a
    process that is gone, EFAULT for an address that is not mapped."""
    import errno
    import os

    from transports import _cma

    if not _cma.available():
        pytest.skip("no process_vm_readv")
    if compiled and _cma._vm_copy is None:
        pytest.skip("transports._ring was not built")
    if not compiled:
        monkeypatch.setattr(_cma, "_vm_copy", None)
    pid = os.getpid()
    src = np.arange(1000, dtype=np.uint8)
    dst = np.zeros(1000, np.uint8)
    try:
        _cma.read(pid, src.ctypes.data + 3, dst.ctypes.data + 5, 991)
    except OSError as exc:  # a policy against ptrace of oneself: nothing to check here
        pytest.skip(f"cross-memory attach refused: {exc}")
    assert dst[:5].tolist() == [0] * 5 and dst[996:].tolist() == [0] * 4
    assert np.array_equal(dst[5:996], src[3:994])
    back = np.zeros(10, np.uint8)
    _cma.write(pid, back.ctypes.data + 2, src.ctypes.data + 100, 6)
    assert back.tolist() == [0, 0, 100, 101, 102, 103, 104, 105, 0, 0]
    with pytest.raises(OSError) as ei:
        _cma.read(pid, 16, dst.ctypes.data, 8)  # page 0 is never mapped
    assert ei.value.errno == errno.EFAULT
    gone = os.fork()
    if gone == 0:
        os._exit(0)
    os.waitpid(gone, 0)
    with pytest.raises(OSError) as ei:
        _cma.read(gone, src.ctypes.data, dst.ctypes.data, 8)
    assert ei.value.errno == errno.ESRCH


def test_skewed_cross_memory_copies_go_through_a_buffer_of_the_thread() -> None:
    """A read or write whose destination starts 1-63 bytes after its source
    modulo the page goes through the calling thread's buffer in parts
    (transports/_copies.h): every byte arrives, in parts and past them, from
    several threads at once, and a range that is not mapped still raises EFAULT."""
    import errno
    import mmap
    import os
    import threading

    from transports import _cma

    if not _cma.available() or _cma._vm_copy is None:
        pytest.skip("no process_vm_readv, or transports._ring was not built")
    pid = os.getpid()
    page = mmap.PAGESIZE

    def at(off: int, n: int) -> np.ndarray:
        raw = np.zeros(n + 2 * page, np.uint8)
        base = -raw.ctypes.data % page
        return raw[base + off : base + off + n]

    try:
        _cma.read(pid, at(0, 8).ctypes.data, at(0, 8).ctypes.data, 8)
    except OSError as exc:
        pytest.skip(f"cross-memory attach refused: {exc}")
    bad: list[tuple[int, int, str]] = []

    def copies(seed: int) -> None:
        rng = np.random.default_rng(seed)
        for n in (4095, 4096, 5001, (256 << 10) + 17, (1 << 20) + 3):
            src = at(0, n)
            src[:] = rng.integers(0, 256, n, dtype=np.uint8)
            for off in (1, 16, 33, 63, 64):
                dst = at(off, n)
                _cma.read(pid, src.ctypes.data, dst.ctypes.data, n)
                if dst.tobytes() != src.tobytes():
                    bad.append((n, off, "read"))
                dst[:] = 0
                _cma.write(pid, dst.ctypes.data, src.ctypes.data, n)
                if dst.tobytes() != src.tobytes():
                    bad.append((n, off, "write"))

    threads = [threading.Thread(target=copies, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not bad
    dst = at(16, 8192)
    with pytest.raises(OSError) as ei:
        _cma.read(pid, page, dst.ctypes.data, 8192)  # page 1 is never mapped either
    assert ei.value.errno == errno.EFAULT


def test_shm_takes_a_small_message_at_once_whatever_its_page_offset() -> None:
    """A small send queued behind a full ring goes out through the pieces'
    path, which writes it at its source's page offset; a receive posted after
    it arrived takes it at once all the same (a completed request, nothing
    queued), as it takes one written at offset 0: a declined one queued the
    receive, which kept the ring full and every later call slow."""
    from tests.transport_pairs import connected_pair
    from transports.base import Deadline, DoneRequest, wait_all

    with connected_pair("shm", slot_bytes=1 << 12, nslots=2) as (a, b):
        raw = np.arange(3000, dtype=np.uint8)
        msgs = [raw[100 + 7 * i : 1124 + 7 * i] for i in range(4)]  # 1 KiB, unaligned
        sends = [a.isend(memoryview(m), tag=1) for m in msgs]
        assert isinstance(sends[0], DoneRequest) and not isinstance(sends[2], DoneRequest)
        got = [np.full(1024, 0xA5, np.uint8) for _ in msgs]
        for i in range(2):  # two slots freed: the queued two go out at their offsets
            assert isinstance(b.irecv_into(memoryview(got[i]), tag=1), DoneRequest)
        wait_all(sends, Deadline.after(30))
        for i in (2, 3):
            assert isinstance(b.irecv_into(memoryview(got[i]), tag=1), DoneRequest)
        for m, g in zip(msgs, got, strict=True):
            assert np.array_equal(m, g)


def test_shm_peer_that_sent_then_closed_is_not_gone_while_its_bytes_wait() -> None:
    """A peer that puts its last message and closes between a receiver's look at
    its inbound ring and its liveness check is not reported gone: having seen
    the "closed" word, the receiver looks at its ring and finds the bytes."""
    from tests.transport_pairs import connected_pair
    from transports.base import Deadline, PeerClosedError, wait_all

    with connected_pair("shm") as (a, b):
        got = bytearray(8)
        r = a.irecv_into(memoryview(got), tag=5)
        head, closed = a._in.head, a._closed_peer
        old = head.load()  # the ring as the receiver saw it before the peer's send
        seen = [False]

        class Late:
            """The inbound head as the receiver saw it until it read the closed word."""

            def load(self) -> int:
                return head.load() if seen[0] else old

        class Closed:
            """The peer's closed word: reading it makes the ring's later stores visible."""

            def load(self) -> int:
                seen[0] = True
                return closed.load()

        a._in.head, a._closed_peer = Late(), Closed()
        try:
            wait_all([b.isend(memoryview(b"12345678"), tag=5)], Deadline.after(10))
            b.close()
            a.check_peer()  # no PeerClosedError: the message waits
        finally:
            a._in.head, a._closed_peer = head, closed
        wait_all([r], Deadline.after(10))
        assert bytes(got) == b"12345678"
        with pytest.raises(PeerClosedError):
            a.check_peer()  # nothing left to receive: now it is gone


def test_group_rank_that_posted_then_closed_is_not_gone_for_that_wait(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A rank that posts its step (or says it is done) and closes between a
    waiter's look at its word and the waiter's liveness check is not gone for
    that wait: once the waiter has seen it closed it finds the word; a step it
    never posted still fails."""
    from transports import _segment, shm_group
    from transports.base import Backoff, Deadline, PeerClosedError

    quick = Backoff(spins=1, yields=1, max_sleep=1e-4)
    real_check = _segment.check_alive
    seen = [False]

    def check_alive(*a: typing.Any, **kw: typing.Any) -> None:
        seen[0] = True  # from here on the waiter sees what was stored before the close
        real_check(*a, **kw)

    monkeypatch.setattr(shm_group._segment, "check_alive", check_alive)

    class Late:
        """A word as the waiter saw it before the peer stored it (until the check)."""

        def __init__(self, real: typing.Any, old: int) -> None:
            self.real, self.old = real, old

        def load(self) -> int:
            return self.real.load() if seen[0] else self.old

    with _group_pair(2) as (a, b):
        word, done = a._posted[1][1], a._done[1]
        try:
            a._posted[1][1] = Late(word, word.load())
            b.claim(1, Deadline.after(5), quick)
            b.post(1)
            b.done(1)
            b.close()
            a.wait([1], 1, Deadline.after(5), quick)  # posted, then closed: no error
            seen[0] = False
            a._done[1] = Late(done, 0)
            a.wait_done([1], 1, Deadline.after(5), quick)  # done, then closed
        finally:
            a._posted[1][1], a._done[1] = word, done
        with pytest.raises(PeerClosedError):
            a.wait([1], 3, Deadline.after(5), quick)  # never posted: gone


def test_a_large_host_allgather_block_is_the_algorithms_to_place() -> None:
    """pycoll.buffers.own_block: from OWN_PLACED_MIN bytes, block ``rank`` of a
    NumPy output (its algorithm copies it); never in place, under the bound, or
    for device arrays (their envelope copies it on the collective's stream)."""
    from pycoll.buffers import OWN_PLACED_MIN, own_block, place_own

    k = OWN_PLACED_MIN // 4
    x = np.arange(k, dtype=np.float32)
    out = np.full(3 * k, np.nan, np.float32)
    own = own_block(1, x, out)
    assert own is not None and own.ctypes.data == out[k:].ctypes.data and own.size == k
    assert own_block(1, out[k : 2 * k], out) is None  # in place
    assert own_block(1, x[:-1], out[: 3 * (k - 1)]) is None  # under the bound
    place_own(1, x, out)
    assert (
        np.array_equal(out[k : 2 * k], x)
        and np.isnan(out[:k]).all()
        and np.isnan(out[2 * k :]).all()
    )

    class DeviceLike:  # what a CuPy array offers here
        def __init__(self, n: int) -> None:
            self.nbytes, self.size = 4 * n, n

    assert own_block(0, DeviceLike(k), DeviceLike(3 * k)) is None
