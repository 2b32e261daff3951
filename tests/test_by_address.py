"""The compiled allreduce and reduce_scatter by address
(``pycoll._step.reduction_by_address``): the same steps, words and bytes as
the Python ones of pycoll.algorithms.direct,
run without the GIL, handing slow waits, mismatches and failed copies to the
group.  4 KiB group slots: direct goes by address from 4 KiB a rank."""

from __future__ import annotations

import itertools
import threading
import time
from typing import Any

import numpy as np
import pytest

import pycoll
from pycoll.algorithms import direct
from tests.inproc import communicators, run_ranks
from tests.reference import _UFUNCS, data

pytestmark = pytest.mark.skipif(
    direct.compiled is None or not hasattr(direct.compiled, "reduction_by_address"),
    reason="pycoll._step was not built",
)

TIMEOUT = 10.0
SLOTS = {"transports": ("shm",), "group_slot_bytes": 4096, "tune": False}
#: dtypes and the ops C reduces for each (float min and max go by Python)
CASES = [
    (np.float32, ("sum", "prod")),
    (np.float64, ("sum",)),
    (np.int8, ("sum", "prod", "min", "max", "band", "bor", "bxor")),
    (np.uint16, ("sum", "max")),
    (np.int32, ("sum", "min")),
    (np.uint64, ("sum", "bxor")),
    (np.float32, ("min", "max")),
]
#: elements: primes past a 4 KiB slot for every dtype
COUNTS = [4099, 8209]


def _reference(xs: list[np.ndarray], op: str) -> np.ndarray:
    """The rank-order reduction in the inputs' own dtype (what every rank must hold)."""
    acc = xs[0]
    for a in xs[1:]:
        acc = _UFUNCS[op](acc, a)
    return acc


def _inputs(dtype: Any, count: int, n: int, op: str) -> list[np.ndarray]:
    return [data(q, count, np.dtype(dtype), op) for q in range(n)]


def _count_compiled(
    monkeypatch: pytest.MonkeyPatch, python_ranks: set[int], name: str = "_compiled"
) -> dict[int, int]:
    """Count each rank's compiled calls (of ``direct.<name>``: ``_compiled`` for
    the reductions, ``_compiled_broadcast``); ranks in ``python_ranks`` take the
    Python steps."""
    real = getattr(direct, name)
    used: dict[int, int] = {}

    def counted(L: Any, G: Any, *args: Any, **kw: Any) -> bool:
        if L.rank in python_ranks:
            return False
        ran = real(L, G, *args, **kw)
        used[L.rank] = used.get(L.rank, 0) + ran
        return ran

    monkeypatch.setattr(direct, name, counted)
    return used


@pytest.mark.parametrize("n", [2, 3, 4])
def test_compiled_and_python_ranks_agree_bit_for_bit(
    n: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Allreduce (in place and out of place) and reduce_scatter, every dtype and
    op, at primes of elements: the odd ranks take the Python steps and the
    even ones the compiled call (they pair, step for step), and every rank
    holds the rank-order reduction (its block of it)."""
    used = _count_compiled(monkeypatch, python_ranks={1, 3})
    with communicators(n, timeout=TIMEOUT, **SLOTS) as comms:
        for c in comms:  # by address also where ranks outnumber cores
            c._engine.crowded = False
            c._engine.links_cache.clear()

        def body(r: int) -> None:
            c = comms[r]
            for (dtype, ops), count in itertools.product(CASES, COUNTS):
                for op, inplace in itertools.product(ops, (False, True)):
                    xs = _inputs(dtype, count, n, op)
                    ref = _reference(xs, op)
                    what = (np.dtype(dtype).name, op, count, inplace, r)
                    if inplace:
                        y = xs[r].copy()
                        c.allreduce(y, op=op, algorithm="direct")
                    else:
                        y = np.full(count, 7, dtype)  # poisoned
                        c.allreduce(xs[r], y, op=op, algorithm="direct")
                        assert xs[r].tobytes() == _inputs(dtype, count, n, op)[r].tobytes(), what
                    assert y.tobytes() == ref.tobytes(), what
                    if inplace:  # reduce_scatter has no in-place form
                        continue
                    # reduce_scatter of blocks of count elements: block r
                    xs = _inputs(dtype, n * count, n, op)
                    ref = _reference(xs, op)[r * count : (r + 1) * count]
                    y = np.full(count, 7, dtype)
                    c.reduce_scatter(xs[r], y, op=op, algorithm="direct")
                    assert y.tobytes() == ref.tobytes(), ("reduce_scatter", *what)

        run_ranks(n, body, timeout=120)
    compiled_ops = sum(
        sum(np.dtype(d).kind != "f" or op in ("sum", "prod") for op in ops) for d, ops in CASES
    )  # float min and max go by Python on every rank
    calls = compiled_ops * 3 * len(COUNTS)  # allreduces twice, reduce_scatters once
    assert used == {r: calls for r in range(0, n, 2)}, used


def test_a_peer_slower_than_the_patience_is_waited_for_by_the_group(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With 1 ms of patience, a peer 200 ms late: the compiled call hands the
    wait to the group's (which checks the deadline and the peer's life), then
    goes on from where it stopped; the result is right."""
    monkeypatch.setattr(direct, "BY_ADDRESS_PATIENCE_NS", 1_000_000)
    used = _count_compiled(monkeypatch, python_ranks=set())
    with communicators(2, timeout=TIMEOUT, **SLOTS) as comms:
        handed = [0, 0]
        for r, c in enumerate(comms):
            G = c._engine.group
            for name in ("wait_word", "wait_done"):
                real = getattr(G, name)

                def counted(*a: Any, _real: Any = real, _r: int = r) -> Any:
                    handed[_r] += 1
                    return _real(*a)

                setattr(G, name, counted)

        def body(r: int) -> np.ndarray:
            x = np.arange(4099, dtype=np.float32) * (r + 1)
            for late in (0.2, 0.0, 0.2):
                if r == 1:
                    time.sleep(late)
                comms[r].allreduce(x, algorithm="direct")
            return x

        outs = run_ranks(2, body, timeout=60)
    ref = np.arange(4099, dtype=np.float32) * 12  # 1 + 2, then doubled twice
    for out in outs:
        assert out.tobytes() == ref.tobytes()
    assert used == {0: 3, 1: 3}, used
    assert handed[0] >= 2, handed  # rank 0 waited for rank 1 twice past the patience


@pytest.mark.parametrize("entry", ["reduction", "broadcast", "allgather"])
def test_the_call_releases_the_gil_and_hands_back_a_wait(entry: str) -> None:
    """Waiting for a word no peer posts (the peers' inputs; a reader: the
    root's), the call returns after its patience with the wait to finish (code
    2, the peer, the word), and meanwhile another Python thread runs; a peer
    whose group closes ends the wait at once."""
    from pycoll import _step

    with communicators(2, timeout=TIMEOUT, **SLOTS) as comms:
        G = comms[0]._engine.group
        lay = G.control()
        x = np.ones(4096, np.float32)
        out = np.empty_like(x)
        ag = np.empty(2 * x.size, np.float32)
        s = G.seq + 1
        w = G.chains[s % G.words] | s  # never posted: rank 1 makes no call

        def wait(budget_ns: int) -> tuple[Any, float]:
            t0 = time.monotonic()
            if entry == "allgather":  # rank 0 waits for rank 1's output
                got = _step.allgather_by_address(
                    lay, G.words, 0, x.ctypes.data, x.nbytes, 0, ag.ctypes.data, ag.nbytes,
                    1 << 16, s, w, 2, 0, 0, 16, 200_000, budget_ns,
                )  # fmt: skip
            elif entry == "broadcast":  # rank 0 reads all of root 1's buffer
                got = _step.broadcast_by_address(
                    lay, G.words, 0, x.ctypes.data, x.nbytes, x.nbytes, 1,
                    s, w, 2, 0, 0, 16, 200_000, budget_ns,
                )  # fmt: skip
            else:
                got = _step.reduction_by_address(
                    lay, G.words, 0, x, out, 0, 2048, ord("f"), 0, 1 << 16,
                    s, w, s + 1, w, 1, 2, 0, 0, 16, 200_000, budget_ns,
                )  # fmt: skip
            return got, time.monotonic() - t0

        ticks = [0]
        stop = threading.Event()

        def count() -> None:
            while not stop.is_set():
                ticks[0] += 1

        t = threading.Thread(target=count)
        t.start()
        try:
            time.sleep(0.01)
            before = ticks[0]
            got, took = wait(300_000_000)
            during = ticks[0] - before
        finally:
            stop.set()
            t.join()
        assert got == (2, 2, 0, 1, w), got
        assert 0.25 < took < 5, took
        assert during > 1000, f"another thread ran {during} rounds in the call's {took:.3f} s"

        closer = threading.Timer(0.1, comms[1]._engine.group.close)
        closer.start()
        got, took = wait(30_000_000_000)
        closer.join()
        assert got[0] == 2 and took < 5, (got, took)


@pytest.mark.parametrize("coll", ["allreduce", "allgather"])
def test_a_peer_that_closes_mid_call_raises_and_returns_nothing_wrong(coll: str) -> None:
    """Rank 1 closes after a few calls; rank 0's next allreduce or allgather by
    address, which waits for rank 1's posted range without the GIL, raises
    within the timeout and never returns as if all were well."""
    with communicators(2, timeout=TIMEOUT, **SLOTS) as comms:

        def body(r: int) -> Any:
            c = comms[r]
            x = np.full(4099, r + 1, np.int32)
            out = np.empty(2 * x.size, np.int32)

            def call() -> None:
                if coll == "allreduce":
                    c.allreduce(x.copy(), algorithm="direct")
                else:
                    c.allgather(x, out, algorithm="cma")

            for _ in range(3):
                call()
            if r == 1:
                c.close()
                return None
            time.sleep(0.2)
            t0 = time.monotonic()
            with pytest.raises(pycoll.PycollError) as ei:
                call()
            return type(ei.value).__name__, time.monotonic() - t0

        res = run_ranks(2, body, timeout=TIMEOUT + 30)
    name, waited = res[0]
    assert name in ("PeerAbortedError", "CollectiveTimeout"), res
    assert waited < TIMEOUT + 3, res


@pytest.mark.parametrize(
    ("first", "other"),
    [
        ("allreduce", "another op"),
        ("allreduce", "another count"),
        ("allreduce", "an allgather"),
        ("allreduce", "a reduce_scatter"),
        ("broadcast", "another root"),
        ("broadcast", "another count"),
        ("broadcast", "an allgather"),
        ("allgather", "another count"),
        ("allgather", "an allreduce"),
    ],
)
def test_mismatched_calls_by_address_raise(first: str, other: str) -> None:
    """Rank 1 runs another call than rank 0's compiled allreduce, broadcast or
    allgather by address: the mismatch surfaces at once on some rank, and no
    rank returns twice."""
    from tests.test_mismatch import _run_case

    k = 4099

    def run(c: Any, a: str, x: Any, op: str = "sum", root: int = 0) -> Any:
        if first == "allreduce":
            return c.allreduce(x, op=op, algorithm=a)
        if first == "allgather":
            return c.allgather(x, np.empty(2 * x.size, x.dtype), algorithm=a)
        return c.broadcast(x, root=root, algorithm=a)

    def make(r: int) -> tuple[Any, Any]:
        x = np.full(k, r + 1, np.int32)
        if r == 0:
            return (lambda c, a: run(c, a, x)), None
        if other == "an allreduce":
            return (lambda c, a: c.allreduce(x, algorithm=a)), None
        if other in ("another op", "another root"):
            return (lambda c, a: run(c, a, x, op="max", root=1)), None
        if other == "another count":
            y = np.full(k + 1, r + 1, np.int32)
            return (lambda c, a: run(c, a, y)), None
        if other == "a reduce_scatter":
            half = np.empty(k // 2, np.int32)
            z = x[: 2 * (k // 2)]
            return (lambda c, a: c.reduce_scatter(z, half, algorithm=a)), None
        out = np.empty(2 * k, np.int32)
        return (lambda c, a: c.allgather(x, out, algorithm=a)), None

    _run_case({"transports": ("shm",), "group_slot_bytes": 4096}, "direct", make)


def test_compiled_off_takes_the_python_steps(monkeypatch: pytest.MonkeyPatch) -> None:
    """``PYCOLL_COMPILED=0`` (``compiled=False``): the allreduce by address runs
    the Python steps, with the same result."""
    used = _count_compiled(monkeypatch, python_ranks=set())
    with communicators(2, timeout=TIMEOUT, compiled=False, **SLOTS) as comms:

        def body(r: int) -> bytes:
            x = np.arange(4099, dtype=np.int32) * (r + 1)
            comms[r].allreduce(x, algorithm="direct")
            return x.tobytes()

        outs = run_ranks(2, body, timeout=60)
    assert outs == [(np.arange(4099, dtype=np.int32) * 3).tobytes()] * 2
    assert used == {0: 0, 1: 0}, used


# ---------------------------------------------------------------- broadcast
#: dtypes a broadcast moves as bytes, whatever they are
BCAST_DTYPES = [np.float32, np.float64, np.int8, np.uint16, np.complex128, np.bool_]


def _count_broadcasts(monkeypatch: pytest.MonkeyPatch, python_ranks: set[int]) -> dict[int, int]:
    return _count_compiled(monkeypatch, python_ranks, "_compiled_broadcast")


@pytest.mark.parametrize("n", [2, 3, 4])
def test_compiled_and_python_broadcasts_agree_bit_for_bit(
    n: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A broadcast by address from every root, every dtype, at primes of
    elements: odd ranks take the Python steps, even ones the compiled call (the
    root writes the tail of the readers' buffers while they read the rest);
    every poisoned buffer ends with the root's bytes, and the root's is untouched."""
    used = _count_broadcasts(monkeypatch, python_ranks={1, 3})
    with communicators(n, timeout=TIMEOUT, **SLOTS) as comms:

        def body(r: int) -> None:
            c = comms[r]
            for dtype, count in itertools.product(BCAST_DTYPES, COUNTS):
                for root in range(n):
                    src = data(root, count, np.dtype(dtype), "sum")
                    buf = src.copy() if r == root else np.full(count, 7, dtype)
                    c.broadcast(buf, root=root, algorithm="direct")
                    assert buf.tobytes() == src.tobytes(), (np.dtype(dtype).name, count, root, r)

        run_ranks(n, body, timeout=120)
    calls = len(BCAST_DTYPES) * len(COUNTS) * n
    assert used == {r: calls for r in range(0, n, 2)}, used


def test_a_broadcast_peer_slower_than_the_patience_is_waited_for_by_the_group(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With 1 ms of patience, a reader 200 ms late and then a root 200 ms late:
    the compiled broadcast hands the waits to the group's and goes on; every
    buffer ends right."""
    monkeypatch.setattr(direct, "BY_ADDRESS_PATIENCE_NS", 1_000_000)
    used = _count_broadcasts(monkeypatch, python_ranks=set())
    with communicators(2, timeout=TIMEOUT, **SLOTS) as comms:

        def body(r: int) -> bytes:
            buf = np.arange(4099, dtype=np.float64) if r == 0 else np.zeros(4099)
            for late in (1, 0, 1):
                if r == late:
                    time.sleep(0.2)
                comms[r].broadcast(buf, root=0, algorithm="direct")
            return buf.tobytes()

        outs = run_ranks(2, body, timeout=60)
    assert outs == [np.arange(4099, dtype=np.float64).tobytes()] * 2
    assert used == {0: 3, 1: 3}, used


@pytest.mark.parametrize("closer", [0, 1], ids=["root closes", "reader closes"])
def test_a_broadcast_peer_that_closes_mid_call_raises(closer: int) -> None:
    """The root or the reader closes after a few broadcasts; the other's next
    one, waiting without the GIL, raises within the timeout."""
    with communicators(2, timeout=TIMEOUT, **SLOTS) as comms:

        def body(r: int) -> Any:
            c = comms[r]
            buf = np.full(4099, r + 1, np.int32)
            for _ in range(3):
                c.broadcast(buf, root=0, algorithm="direct")
            if r == closer:
                c.close()
                return None
            time.sleep(0.2)
            t0 = time.monotonic()
            with pytest.raises(pycoll.PycollError) as ei:
                c.broadcast(buf, root=0, algorithm="direct")
            return type(ei.value).__name__, time.monotonic() - t0

        res = run_ranks(2, body, timeout=TIMEOUT + 30)
    name, waited = res[1 - closer]
    assert name in ("PeerAbortedError", "CollectiveTimeout"), res
    assert waited < TIMEOUT + 3, res


def test_a_broadcast_goes_by_address_from_64_kib_where_ranks_have_cores(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With the default 256 KiB slots: 64 KiB and less go through a slot, more
    by address (compiled) where ranks have a core each, and through the slots
    up to a slot where they outnumber the cores; the second call of each
    (replayed) takes the same route."""
    used = _count_broadcasts(monkeypatch, python_ranks=set())
    for crowded in (False, True):
        with communicators(2, timeout=TIMEOUT, transports=("shm",), tune=False) as comms:
            for c in comms:
                c._engine.crowded = crowded
                c._engine.links_cache.clear()

            def body(r: int) -> list[int]:
                counts = []
                for nbytes in (64 << 10, (64 << 10) + 8, 256 << 10):
                    buf = np.full(nbytes // 8, 1.5) if r == 0 else np.zeros(nbytes // 8)
                    before = used.get(r, 0)
                    for _ in range(2):
                        comms[r].broadcast(buf, root=0, algorithm="direct")
                        assert (buf == 1.5).all()
                    counts.append(used.get(r, 0) - before)
                return counts

            got = run_ranks(2, body, timeout=60)
            want = [0, 0, 0] if crowded else [0, 2, 2]
            assert got == [want, want], (crowded, got)


def test_compiled_off_broadcasts_by_the_python_steps(monkeypatch: pytest.MonkeyPatch) -> None:
    """``PYCOLL_COMPILED=0``: the broadcast by address runs the Python steps."""
    used = _count_broadcasts(monkeypatch, python_ranks=set())
    with communicators(2, timeout=TIMEOUT, compiled=False, **SLOTS) as comms:

        def body(r: int) -> bytes:
            buf = np.arange(4099, dtype=np.int32) if r == 1 else np.zeros(4099, np.int32)
            comms[r].broadcast(buf, root=1, algorithm="direct")
            return buf.tobytes()

        outs = run_ranks(2, body, timeout=60)
    assert outs == [np.arange(4099, dtype=np.int32).tobytes()] * 2
    assert used == {0: 0, 1: 0}, used


# ---------------------------------------------------------------- allgather
def _count_allgathers(monkeypatch: pytest.MonkeyPatch, python_ranks: set[int]) -> dict[int, int]:
    return _count_compiled(monkeypatch, python_ranks, "_compiled_allgather")


#: blocks by address ("cma": from one 4 KiB slot up), one of them large enough
#: that the algorithm copies its own block, in pieces beside its writes
AG_CASES = [(np.float32, 4099), (np.int8, 8209), (np.complex128, 1031), (np.float32, 524309)]


@pytest.mark.parametrize("n", [2, 3, 4])
def test_compiled_and_python_allgathers_agree_bit_for_bit(
    n: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An allgather by address, out of place (poisoned) and in place, every
    rank's block a prime of elements: odd ranks take the Python steps, even
    ones the compiled call (they pair, step for step); every output holds
    every rank's block in rank order and no input changes."""
    used = _count_allgathers(monkeypatch, python_ranks={1, 3})
    with communicators(n, timeout=TIMEOUT, **SLOTS) as comms:

        def body(r: int) -> None:
            c = comms[r]
            for dtype, count in AG_CASES:
                xs = [data(q, count, np.dtype(dtype), "sum") for q in range(n)]
                ref = np.concatenate(xs)
                what = (np.dtype(dtype).name, count, r)
                out = np.full(n * count, 7, dtype)
                x = xs[r].copy()
                c.allgather(x, out, algorithm="cma")
                assert out.tobytes() == ref.tobytes(), ("out of place", *what)
                assert x.tobytes() == xs[r].tobytes(), what
                inplace = np.full(n * count, 7, dtype)
                inplace[r * count : (r + 1) * count] = xs[r]
                c.allgather(inplace[r * count : (r + 1) * count], inplace, algorithm="cma")
                assert inplace.tobytes() == ref.tobytes(), ("in place", *what)

        run_ranks(n, body, timeout=120)
    assert used == {r: 2 * len(AG_CASES) for r in range(0, n, 2)}, used


def test_an_allgather_peer_slower_than_the_patience_is_waited_for_by_the_group(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With 1 ms of patience, each rank in turn 200 ms late: the compiled
    allgather hands the waits (for a posted output, for the peers' writes) to
    the group's and goes on; every output ends right."""
    monkeypatch.setattr(direct, "BY_ADDRESS_PATIENCE_NS", 1_000_000)
    used = _count_allgathers(monkeypatch, python_ranks=set())
    with communicators(2, timeout=TIMEOUT, **SLOTS) as comms:

        def body(r: int) -> bytes:
            x = np.arange(4099, dtype=np.float64) + r
            out = np.zeros(2 * 4099)
            for late in (1, 0, 1):
                if r == late:
                    time.sleep(0.2)
                comms[r].allgather(x, out, algorithm="cma")
            return out.tobytes()

        outs = run_ranks(2, body, timeout=60)
    want = np.concatenate([np.arange(4099.0), np.arange(4099.0) + 1]).tobytes()
    assert outs == [want, want]
    assert used == {0: 3, 1: 3}, used


def test_compiled_off_allgathers_by_the_python_steps(monkeypatch: pytest.MonkeyPatch) -> None:
    """``PYCOLL_COMPILED=0``: the allgather by address runs the Python steps."""
    used = _count_allgathers(monkeypatch, python_ranks=set())
    with communicators(2, timeout=TIMEOUT, compiled=False, **SLOTS) as comms:

        def body(r: int) -> bytes:
            out = np.zeros(2 * 4099, np.int32)
            comms[r].allgather(np.arange(4099, dtype=np.int32) * (r + 1), out, algorithm="cma")
            return out.tobytes()

        outs = run_ranks(2, body, timeout=60)
    a = np.arange(4099, dtype=np.int32)
    assert outs == [np.concatenate([a, 2 * a]).tobytes()] * 2
    assert used == {0: 0, 1: 0}, used
