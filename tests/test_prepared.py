"""Prepared calls (``comm.prepare``): each run does what the plain call does.

Every collective the replay cache plans, at n = 1, 2 and 3 (ranks are threads,
:mod:`tests.inproc`), prepared once and run several times with fresh input
contents and poisoned outputs, against NumPy; the runs after the first take
the held plan (checked); a bound array changed in place is checked again as a
plain call would be; a closed communicator raises; bad arguments are refused
at ``prepare``.
"""

from __future__ import annotations

from _thread import get_ident
from typing import Any

import numpy as np
import pytest

import pycoll
from tests.inproc import communicators, run_ranks

pytestmark = pytest.mark.timeout(120)

RUNS = 4


def _on_all(comms: Any, fn: Any) -> list[Any]:
    return run_ranks(len(comms), lambda r: fn(comms[r]))


def _held(h: Any) -> bool:
    """Whether the prepared call holds a plan (its runs skip the lookup)."""
    return h._plan is not None


@pytest.mark.parametrize("n", [1, 2, 3])
def test_prepared_runs_match_numpy(n: int) -> None:
    rng = np.random.default_rng(7)
    k = 5  # elements per block: odd
    # per run and rank: inputs every rank can recompute
    base = rng.standard_normal((RUNS, n, n * k)).astype(np.float32)
    ints = rng.integers(-50, 50, (RUNS, n, n * k)).astype(np.int64)

    def body(c: pycoll.Communicator) -> None:
        r = c.rank
        x = np.empty(n * k, np.float32)
        out = np.empty(n * k, np.float32)
        xi = np.empty(n * k, np.int64)
        blk = np.empty(k, np.float32)
        gat = np.empty(n * k, np.float32)
        bc = np.empty(n * k, np.int64)
        rs = np.empty(k, np.int64)
        a2a = np.empty(n * k, np.float32)
        red = np.empty(n * k, np.float32)
        sc = np.empty(k, np.float32)
        h = {
            "allreduce": c.prepare("allreduce", x, out),
            "allreduce max in place": c.prepare("allreduce", xi, op="max"),
            "allgather": c.prepare("allgather", blk, gat),
            "broadcast": c.prepare("broadcast", bc, root=n - 1),
            "reduce_scatter": c.prepare("reduce_scatter", xi, rs, op="min"),
            "reduce": c.prepare("reduce", x, red if r == 0 else None, root=0),
            "alltoall": c.prepare("alltoall", x, a2a),
            "gather": c.prepare("gather", blk, gat if r == n - 1 else None, root=n - 1),
            "scatter": c.prepare("scatter", gat if r == 0 else None, sc, root=0),
            "barrier": c.prepare("barrier"),
        }
        unheld: set[str] = set()
        for run in range(RUNS):
            mine, allx = base[run, r], base[run]
            for name, call in h.items():
                x[...] = mine
                xi[...] = ints[run, r]
                blk[...] = mine[:k]
                bc[...] = ints[run, r]
                for o in (out, gat, a2a, red, sc):
                    o.fill(np.nan)  # poisoned
                rs.fill(-(1 << 60))
                if name == "scatter" and r == 0:
                    gat[...] = allx[0]
                got = call()
                if name == "allreduce":
                    assert got is out
                    np.testing.assert_allclose(out, allx.sum(0), rtol=1e-5)
                elif name == "allreduce max in place":
                    assert got is xi
                    np.testing.assert_array_equal(xi, ints[run].max(0))
                elif name == "allgather":
                    assert got is gat
                    np.testing.assert_array_equal(gat, allx[:, :k].reshape(-1))
                elif name == "broadcast":
                    np.testing.assert_array_equal(bc, ints[run, n - 1])
                elif name == "reduce_scatter":
                    np.testing.assert_array_equal(rs, ints[run].min(0)[r * k : (r + 1) * k])
                elif name == "reduce" and r == 0:
                    np.testing.assert_allclose(red, allx.sum(0), rtol=1e-5)
                elif name == "alltoall":
                    want = np.concatenate([allx[j, r * k : (r + 1) * k] for j in range(n)])
                    np.testing.assert_array_equal(a2a, want)
                elif name == "gather" and r == n - 1:
                    np.testing.assert_array_equal(gat, allx[:, :k].reshape(-1))
                elif name == "scatter":
                    np.testing.assert_array_equal(sc, allx[0, r * k : (r + 1) * k])
                # the first run made the plan; a barrier has none and runs plain
                # calls (a scatter's receiving ranks have one, found by recvbuf)
                plain = name == "barrier"
                if run and not plain and not _held(call):
                    unheld.add(name)
        # checked once every run is over: a rank that raised midway would hang the others
        assert not unheld, f"rank {r}: no plan held by {sorted(unheld)}"

    with communicators(n) as comms:
        _on_all(comms, body)


def test_a_bound_array_changed_in_place_is_checked_again() -> None:
    """A read-only output or a new dtype of the same size: the next run is a plain
    call, which raises the plain call's error on every rank, and writes nothing."""
    with communicators(2) as comms:

        def body(c: pycoll.Communicator) -> None:
            x = np.full(4, c.rank + 1, np.float32)
            out = np.zeros(4, np.float32)
            h = c.prepare("allreduce", x, out)
            for _ in range(2):
                h()
            np.testing.assert_array_equal(out, 3)
            out.fill(-1)
            out.flags.writeable = False
            with pytest.raises(pycoll.InvalidArgumentError, match="recvbuf"):
                h()
            np.testing.assert_array_equal(out, -1)
            out.flags.writeable = True
            out.dtype = np.int32  # the same bytes, another dtype: a mismatch with x
            with pytest.raises(pycoll.InvalidArgumentError):
                h()
            out.dtype = np.float32
            x.fill(c.rank + 10)
            assert h() is out
            np.testing.assert_array_equal(out, 21)

        _on_all(comms, body)


def test_a_prepared_call_on_a_closed_communicator_raises() -> None:
    with communicators(2) as comms:
        hs = _on_all(comms, lambda c: c.prepare("allreduce", np.ones(3, np.float32)))
        _on_all(comms, lambda c: [hs[c.rank]() for _ in range(2)])
        assert all(_held(h) for h in hs)
        _on_all(comms, lambda c: c.close())
        for h in hs:
            with pytest.raises(pycoll.CommunicatorClosedError):
                h()


def test_prepare_refuses_bad_arguments() -> None:
    with communicators(1) as comms:
        c = comms[0]
        x = np.ones(3, np.float32)
        for kw, match in (
            ({"collective": "allgatherv"}, "not one of"),
            ({"collective": 3}, "not one of"),
            ({"collective": "allgather", "op": "max"}, "takes no op"),
            ({"collective": "allreduce", "root": 1}, "takes no root"),
            ({"collective": "broadcast", "recvbuf": x.copy()}, "in place"),
        ):
            name = kw.pop("collective")
            with pytest.raises(pycoll.InvalidArgumentError, match=match):
                c.prepare(name, x, **kw)


def _run_mismatched(c: pycoll.Communicator, h: Any, out: Any, want: Any) -> str:
    """Run the held plan ``h`` on a poisoned ``out``: the name of the error it
    raises; else, ``out`` checked to start with ``want`` (what its own call
    means), that of the next collective's error, or "returned twice"."""
    out.fill(77)  # poisoned
    try:
        h()
    except pycoll.PycollError as exc:
        return type(exc).__name__
    np.testing.assert_array_equal(out[: want.size], want)
    try:
        c.allreduce(np.ones(4, np.float32))
    except pycoll.PycollError as exc:
        return "next:" + type(exc).__name__
    return "returned twice"


def _check_mismatched(kinds: list[str]) -> None:
    """At least one rank raised a mismatch; none returned twice."""
    assert "returned twice" not in kinds, kinds
    assert any(k.endswith("CollectiveMismatchError") for k in kinds), kinds


def test_mismatched_prepared_runs_raise_and_return_nothing_wrong() -> None:
    """Each rank holds the plans of two prepared calls (an allreduce and an
    allgather, run by both ranks alike first); then rank 0 runs one and rank 1
    the other, both by their held plans.  At least one raises
    CollectiveMismatchError; a rank that returns holds what its own call means,
    and its next collective raises."""
    with communicators(2, timeout=6.0, check=False, tune=False) as comms:

        def body(c: pycoll.Communicator) -> str:
            r = c.rank
            x, out = np.full(8, r + 1, np.float32), np.empty(16, np.float32)
            pair = (c.prepare("allreduce", x, out[:8]), c.prepare("allgather", x, out))
            for _ in range(2):  # the first run makes each plan, the second takes it
                for h in pair:
                    h()
            h = pair[r]  # rank 0: the allreduce, rank 1: the allgather
            p = h._plan
            # this run takes the held plan (same thread, cache not cleared)
            assert p is not None and p.tid == get_ident()
            assert h._epoch == c._engine.plans.epoch
            want = np.full(8, 3) if r == 0 else np.repeat([1, 2], 8)
            return _run_mismatched(c, h, out, want)

        _check_mismatched(_on_all(comms, body))


@pytest.mark.parametrize(
    "pair", [("gather", "scatter"), ("alltoall", "gather"), ("scatter", "alltoall")]
)
def test_mismatched_prepared_exchanges_raise_and_return_nothing_wrong(
    pair: tuple[str, str],
) -> None:
    """As above for the exchanges' compiled steps of one round: rank 0 runs
    the first call of ``pair`` by its held plan, rank 1 the second.  At least
    one raises CollectiveMismatchError; a rank that returns holds what its own
    call means, and its next collective raises."""
    with communicators(2, timeout=6.0, check=False, tune=False) as comms:

        def body(c: pycoll.Communicator) -> str:
            r = c.rank
            x, blk = np.full(8, r + 1, np.float32), np.empty(8, np.float32)
            src = np.arange(16, dtype=np.float32)  # scatter's input on root 0
            xs, out = np.full(16, r + 1, np.float32), np.empty(16, np.float32)
            made = {
                "gather": (c.prepare("gather", x, out if r == 0 else None, root=0), out),
                "scatter": (c.prepare("scatter", src if r == 0 else None, blk, root=0), blk),
                "alltoall": (c.prepare("alltoall", xs, out), out),
            }
            for _ in range(2):  # the first run makes each plan, the second takes it
                for h, _o in made.values():
                    h()
            name = pair[r]
            h, o = made[name]
            assert h._plan is not None
            want = {
                "gather": np.repeat([1, 2], 8) if r == 0 else np.full(16, 77),
                "scatter": src[8 * r : 8 * (r + 1)],
                "alltoall": np.repeat([1, 2], 8),
            }[name]
            return _run_mismatched(c, h, o, want)

        _check_mismatched(_on_all(comms, body))
