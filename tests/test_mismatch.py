"""Mismatched calls with PYCOLL_CHECK off: the always-on guard (issue 33, items 6 and 7).

Every message carries its call's tag (sequence number and fingerprint) and every
step of the group segment a chain of fingerprints, so two ranks that disagree
on a call never pair their bytes.  For each kind of mismatch, on shm (the
group's ``direct`` algorithms and point-to-point rings and trees) and tcp: at
least one rank raises :class:`CollectiveMismatchError`; a rank that returns
holds exactly what its own call means (outputs are poisoned first); and a rank
that returned finds out at its next collective, which raises.  Ranks are
threads (:mod:`tests.inproc`); each case takes well under a second.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

import pycoll
from tests.inproc import communicators, run_ranks

pytestmark = pytest.mark.timeout(120)

TIMEOUT = 6.0  # PYCOLL_TIMEOUT: a guard that worked answers long before it

#: (name, Config overrides, algorithm): the host paths the guard covers
PATHS = [
    ("shm-auto", {"transports": ("shm",)}, "auto"),
    ("shm-direct", {"transports": ("shm",)}, "direct"),  # small steps: pycoll._step if built
    ("shm-direct-python", {"transports": ("shm",), "compiled": False}, "direct"),
    ("shm-ring", {"transports": ("shm",)}, "ring"),
    ("shm-tree", {"transports": ("shm",)}, "tree"),
    ("tcp-ring", {"transports": ("tcp",)}, "ring"),
    ("tcp-auto", {"transports": ("tcp",)}, "auto"),
]


def _data(r: int, count: int, dtype: Any) -> np.ndarray:
    return (np.arange(count) % 97 + 10 * r + 1).astype(dtype)


def _poison(shape: Any, dtype: Any) -> np.ndarray:
    return np.full(shape, 77, dtype)


# Each case: rank -> (the call, what that call means if every rank made it).
Call = tuple[Callable[[pycoll.Communicator, str], Any], np.ndarray | None]


def _allreduce(count: int, dtype: Any = np.float32, op: str = "sum") -> Callable[[int, int], Call]:
    def make(r: int, n: int) -> Call:
        x = _data(r, count, dtype)
        f = {"sum": np.add, "max": np.maximum}[op]
        ref = _data(0, count, dtype)
        for q in range(1, n):
            ref = f(ref, _data(q, count, dtype))
        out = _poison(count, dtype)
        return (lambda c, a: c.allreduce(x, out, op=op, algorithm=a)), ref

    return make


def _allgather(count: int) -> Callable[[int, int], Call]:
    def make(r: int, n: int) -> Call:
        x = _data(r, count, np.float32)
        out = _poison(n * count, np.float32)
        ref = np.concatenate([_data(q, count, np.float32) for q in range(n)])
        return (lambda c, a: c.allgather(x, out, algorithm=a)), ref

    return make


def _broadcast(root: int) -> Callable[[int, int], Call]:
    def make(r: int, n: int) -> Call:
        buf = _data(r, 100, np.float32) if r == root else _poison(100, np.float32)
        return (lambda c, a: c.broadcast(buf, root=root, algorithm=a)), _data(root, 100, np.float32)

    return make


def _reduce(root: int) -> Callable[[int, int], Call]:
    def make(r: int, n: int) -> Call:
        x = _data(r, 100, np.float32)
        out = _poison(100, np.float32)
        ref = sum(_data(q, 100, np.float32) for q in range(n))
        mine = ref if r == root else None
        return (lambda c, a: c.reduce(x, out, root=root, algorithm=a)), mine

    return make


#: name -> (rank 0's call, the other ranks' call)
CASES: dict[str, tuple[Callable[[int, int], Call], Callable[[int, int], Call]]] = {
    "count 1000 vs 1001": (_allreduce(1000), _allreduce(1001)),
    "allreduce vs allgather": (_allreduce(8), _allgather(8)),
    "float32 vs int32": (_allreduce(64, np.float32), _allreduce(64, np.int32)),
    "sum vs max": (_allreduce(64, op="sum"), _allreduce(64, op="max")),
    "reduce root 0 vs 1": (_reduce(0), _reduce(1)),
    "broadcast root 0 vs 1": (_broadcast(0), _broadcast(1)),
    "allgather count per rank": (_allgather(4), _allgather(5)),
}


def _applies(algo: str, name: str) -> bool:
    # no tree allgather; tree reduces of two roots are test_tree_reduce_of_two_roots
    if algo == "tree":
        return "allgather" not in name and "reduce root" not in name
    return not (algo == "auto" and "tcp" in name and "reduce root" in name)  # auto: tree


def _run_case(cfg: dict[str, Any], algo: str, calls: Callable[[int], Call], n: int = 2) -> None:
    with communicators(n, timeout=TIMEOUT, check=False, tune=False, **cfg) as comms:

        def body(r: int) -> tuple[str, Any]:
            c = comms[r]
            fn, ref = calls(r)
            t0 = time.monotonic()
            try:
                got = fn(c, algo)
            except pycoll.PycollError as exc:
                return type(exc).__name__, time.monotonic() - t0
            # it returned: what it holds must be what its own call means ...
            if ref is not None:
                np.testing.assert_array_equal(np.asarray(got).reshape(-1), ref)
            # ... and its next collective must not return as if all were well
            try:
                c.allreduce(np.ones(4, np.float32), algorithm=algo if algo != "tree" else "ring")
            except pycoll.PycollError as exc:
                return "next:" + type(exc).__name__, time.monotonic() - t0
            return "returned twice", time.monotonic() - t0

        res = run_ranks(n, body, timeout=TIMEOUT + 30)
    kinds = [k for k, _ in res]
    assert "returned twice" not in kinds, res
    assert any(k.endswith("CollectiveMismatchError") for k in kinds), res
    assert all(dt < TIMEOUT / 2 for _, dt in res), f"a rank waited for the timeout: {res}"


@pytest.mark.parametrize(("path", "cfg", "algo"), PATHS, ids=[p[0] for p in PATHS])
@pytest.mark.parametrize("case", list(CASES))
def test_mismatched_calls_raise_and_return_nothing_wrong(
    path: str, cfg: dict[str, Any], algo: str, case: str
) -> None:
    if not _applies(algo, f"{case} {path}"):
        pytest.skip(f"{algo} has no {case.split(maxsplit=1)[0]}")
    first, rest = CASES[case]
    _run_case(cfg, algo, lambda r: (first if r == 0 else rest)(r, 2))


def _alltoall(k: int) -> Callable[[int, int], Call]:
    def make(r: int, n: int) -> Call:
        x = _data(r, n * k, np.float32)
        out = _poison(n * k, np.float32)
        ref = np.concatenate([_data(q, n * k, np.float32)[r * k : (r + 1) * k] for q in range(n)])
        return (lambda c, a: c.alltoall(x, out, algorithm=a)), ref

    return make


#: alltoall blocks (float32 elements) through direct's slots in rounds written
#: ahead (1 MiB a rank at n = 2), and by address (from 4 MiB a rank)
ALLTOALL_BLOCKS = {"slot rounds": 1 << 17, "by address": (1 << 19) + 8}


@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.parametrize("way", list(ALLTOALL_BLOCKS))
def test_mismatched_direct_alltoalls_raise(way: str, n: int) -> None:
    """alltoall through direct's slot rounds (all written before any is read) and
    by address, against another count a block and against an allgather of the
    same bytes on the last rank: the mismatch surfaces at once, and a rank that
    returned holds what its own call means."""
    k = ALLTOALL_BLOCKS[way]
    cfg = {"transports": ("shm",)}
    for other in (_alltoall(k + 1), _allgather(k)):
        _run_case(cfg, "direct", lambda r, o=other: (o if r == n - 1 else _alltoall(k))(r, n), n=n)


def _gather(k: int, root: int) -> Callable[[int, int], Call]:
    def make(r: int, n: int) -> Call:
        x = _data(r, k, np.float32)
        out = _poison(n * k, np.float32) if r == root else None
        ref = np.concatenate([_data(q, k, np.float32) for q in range(n)]) if r == root else None
        return (lambda c, a: c.gather(x, out, root=root, algorithm=a)), ref

    return make


def _scatter(k: int, root: int) -> Callable[[int, int], Call]:
    def make(r: int, n: int) -> Call:
        src = _data(root, n * k, np.float32)
        out = _poison(k, np.float32)
        ref = src[r * k : (r + 1) * k]
        return (
            lambda c, a: c.scatter(src if r == root else None, out, root=root, algorithm=a)
        ), ref

    return make


#: gather and scatter blocks (float32 elements) through direct's slots and by address
GATHER_BLOCKS = {"slots": 100, "by address": (1 << 16) + 3}


@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.parametrize("way", list(GATHER_BLOCKS))
def test_mismatched_direct_gathers_and_scatters_raise(way: str, n: int) -> None:
    """direct's gather and scatter, through the slots and by address, against
    another count, another root (two ranks that each think themselves the
    gather's root both post a word, so each sees the other's), and each other
    on the last rank: the mismatch surfaces at once, and a rank that returned
    holds what its own call means.  By address every rank of a gather posts a
    word, so ranks that each think another the root raise too."""
    k = GATHER_BLOCKS[way]
    cfg = {"transports": ("shm",)}
    cases = [
        (_gather(k, 0), _gather(k + 1, 0)),
        (_gather(k, 0), _gather(k, n - 1)),
        (_gather(k, 0), _scatter(k, 0)),
        (_scatter(k, 0), _scatter(k + 1, 0)),
        (_scatter(k, 0), _scatter(k, n - 1)),
    ]
    if way == "by address":
        cases.append((_gather(k, n - 1), _gather(k, 0)))
    for mine, other in cases:
        _run_case(cfg, "direct", lambda r, m=mine, o=other: (o if r == n - 1 else m)(r, n), n=n)


def _routed(make: Callable[[int, int], Call], last: str) -> Callable[[int, int], Call]:
    """``make``'s call with ``algorithm=last`` on the last rank, ``direct`` elsewhere."""

    def routed(r: int, n: int) -> Call:
        fn, ref = make(r, n)
        algo = last if r == n - 1 else "direct"
        return (lambda c, _a: fn(c, algo)), ref

    return routed


@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.parametrize("coll", ["allgather", "alltoall"])
def test_the_two_routes_of_direct_do_not_pair(coll: str, n: int) -> None:
    """``direct`` goes through the slots where ``cma`` goes by address (1 MiB
    a rank): one rank's ``cma`` against the others' ``direct`` raises a
    mismatch at once, instead of one rank reading a range the other never
    posted (their fingerprints name the route: pycoll.guard.ROUTED)."""
    make = _allgather(1 << 17) if coll == "allgather" else _alltoall((1 << 18) // n)
    routed = _routed(make, "cma")
    _run_case({"transports": ("shm",)}, "direct", lambda r: routed(r, n), n=n)


@pytest.mark.parametrize("n", [2, 3])
def test_mismatched_large_allgathers_in_one_pass_raise(n: int) -> None:
    """Blocks of OWN_PLACED_MIN bytes and more go by address in pieces, the own
    block copied in the same pass: against another count a block, and against
    an alltoall into an output as long, on the last rank, the mismatch surfaces at
    the first piece, and a rank that returned holds what its own call means."""
    from pycoll.buffers import OWN_PLACED_MIN

    k = OWN_PLACED_MIN // 4 + 3
    cfg = {"transports": ("shm",)}
    for other in (_allgather(k + 1), _alltoall(k)):
        _run_case(cfg, "direct", lambda r, o=other: (o if r == n - 1 else _allgather(k))(r, n), n=n)


@pytest.mark.parametrize(
    ("coll", "k", "algo", "slot"),
    [
        ("allgather", 2048, "cma", 4096),
        ("alltoall", 2048, "cma", 4096),
        ("allgather", (1 << 19) + 3, "direct", None),  # in one pass (OWN_PLACED_MIN)
    ],
)
def test_a_peer_gone_under_cma_raises_and_writes_nothing_wrong(
    coll: str, k: int, algo: str, slot: int | None
) -> None:
    """4 KiB slots, 8 KiB a rank: ``cma`` goes by address; and a 2 MiB block,
    which ``direct`` copies and writes piece by piece.  Rank 1 closes after a
    few calls; rank 0's next call, which waits for rank 1's posted range, raises
    within the timeout, and its poisoned output holds no half of a result."""
    cfg: dict[str, Any] = {} if slot is None else {"group_slot_bytes": slot}
    with communicators(2, timeout=TIMEOUT, tune=False, **cfg) as comms:

        def body(r: int) -> Any:
            c = comms[r]
            x = np.full(2 * k, r + 1, np.float32)
            out = np.empty(2 * k, np.float32)
            run = getattr(c, coll)
            for _ in range(3):
                run(x[:k] if coll == "allgather" else x, out, algorithm=algo)
            assert set(np.unique(out)) == {1.0, 2.0}
            if r == 1:
                c.close()
                return None
            time.sleep(0.2)  # rank 1 is gone
            out.fill(-1.0)
            t0 = time.monotonic()
            with pytest.raises(pycoll.PycollError) as ei:
                run(x[:k] if coll == "allgather" else x, out, algorithm=algo)
            # rank 0's own block may be in place by now; the dead peer's may not
            return type(ei.value).__name__, time.monotonic() - t0, bool((out[k:] == -1).all())

        res = run_ranks(2, body, timeout=TIMEOUT + 30)
    name, waited, untouched = res[0]
    assert name in ("PeerAbortedError", "CollectiveTimeout"), res
    assert waited < TIMEOUT + 3, res
    assert untouched, "the dead peer's block changed under a call that raised"


THREE = [p for p in PATHS if p[0] not in ("shm-tree", "tcp-auto")]


@pytest.mark.parametrize(("path", "cfg", "algo"), THREE, ids=[p[0] for p in THREE])
def test_three_ranks_one_of_them_differs(path: str, cfg: dict[str, Any], algo: str) -> None:
    """Rank 2 alone passes another count: the mismatch still surfaces."""
    _run_case(cfg, algo, lambda r: _allreduce(1001 if r == 2 else 1000)(r, 3), n=3)


@pytest.mark.parametrize(("path", "cfg", "algo"), PATHS, ids=[p[0] for p in PATHS])
def test_a_rank_that_skipped_a_call_is_not_paired_off_by_one(
    path: str, cfg: dict[str, Any], algo: str
) -> None:
    """Rank 1's call is rejected (a bad recvbuf) and it goes on; rank 0's ran.
    Rank 1's next call must not pair with rank 0's rejected-elsewhere one."""
    with communicators(2, timeout=TIMEOUT, check=False, tune=False, **cfg) as comms:

        def body(r: int) -> list[str]:
            c = comms[r]
            seen = []
            a = _data(r, 16, np.float32)
            b = _data(r + 5, 16, np.float32)
            for i, x in enumerate((a, b)):
                out = _poison(16, np.float32)
                bad = r == 1 and i == 0
                try:
                    got = c.allreduce(x, _poison(15, np.float32) if bad else out, algorithm=algo)
                except pycoll.InvalidArgumentError:
                    seen.append("rejected")
                    continue
                except pycoll.PycollError as exc:
                    seen.append(type(exc).__name__)
                    break
                ref = _data(0, 16, np.float32) + _data(1, 16, np.float32)
                if i == 1:
                    ref = _data(5, 16, np.float32) + _data(6, 16, np.float32)
                assert (got == ref).all(), (r, i, got, ref)  # never a mix of two calls
                seen.append("ok")
            return seen

        res = run_ranks(2, body, timeout=TIMEOUT + 30)
    assert res[1][0] == "rejected", res
    assert "CollectiveMismatchError" in res[0] + res[1], res


@pytest.mark.parametrize("path", ["shm", "tcp"])
def test_ranks_that_all_reject_a_call_stay_in_step(path: str) -> None:
    """Every rank rejects the same call: they stay aligned and go on."""
    with communicators(2, timeout=TIMEOUT, transports=(path,)) as comms:

        def body(r: int) -> None:
            c = comms[r]
            with pytest.raises(pycoll.InvalidArgumentError):
                c.allreduce(np.ones(4, np.float32), np.ones(3, np.float32))
            for algo in ("auto", "ring"):
                got = c.allreduce(np.full(4, r + 1, np.float32), algorithm=algo)
                np.testing.assert_array_equal(got, np.full(4, 3, np.float32))

        run_ranks(2, body, timeout=TIMEOUT + 30)


def test_check_names_the_sequence_number_of_a_rank_that_skipped() -> None:
    """PYCOLL_CHECK=1 compares the sequence numbers too (item 6)."""
    with communicators(2, timeout=TIMEOUT, check=True) as comms:

        def body(r: int) -> str:
            c = comms[r]
            try:
                if r == 1:
                    with pytest.raises(pycoll.InvalidArgumentError):
                        c.allreduce(np.ones(4, np.float32), np.ones(3, np.float32))
                else:
                    c.allreduce(np.ones(4, np.float32))  # rank 1 never joins this one
                c.allreduce(np.ones(4, np.float32))
            except pycoll.CollectiveMismatchError as exc:
                return str(exc)
            return "returned"

        res = run_ranks(2, body, timeout=TIMEOUT + 30)
    assert all("sequence number" in m for m in res), res


@pytest.mark.parametrize("path", ["shm", "tcp"])
def test_tree_reduce_of_two_roots_ends_in_a_timeout(path: str) -> None:
    """A known limit: in a tree reduce where each of two ranks names itself root,
    both wait to receive and no byte moves, so no tag can disagree; both raise
    CollectiveTimeout at PYCOLL_TIMEOUT, and neither returns a result."""
    with communicators(2, timeout=1.0, check=False, tune=False, transports=(path,)) as comms:

        def body(r: int) -> str:
            fn, _ = _reduce(r)(r, 2)
            try:
                fn(comms[r], "tree")
            except pycoll.PycollError as exc:
                return type(exc).__name__
            return "returned"

        assert run_ranks(2, body, timeout=30) == ["CollectiveTimeout"] * 2
