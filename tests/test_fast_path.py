"""The communicator's fast path (replayed plans) is exactly as strict as the slow one.

A blocking host collective called again on the same arrays with the same
arguments skips validation; these tests change the arrays in place between
calls (flags, dtype, shape) and check that the change is noticed, with the
same error as on a first call, before any byte moves; and that results, the
flight recorder and closing behave as without the fast path.  Ranks are
threads (:mod:`tests.inproc`).
"""

from __future__ import annotations

import gc
import threading
import time
import weakref
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import pytest

import pycoll
from pycoll.plans import PLAN_MAX, PLAN_MAX_BYTES, STEPS_MAX
from tests.inproc import communicators, run_ranks

pytestmark = pytest.mark.timeout(120)


def _on_all(comms: Any, fn: Any) -> list[Any]:
    return run_ranks(len(comms), lambda r: fn(comms[r]))


@pytest.mark.parametrize("n", [1, 2, 3])
def test_repeated_calls_give_the_slow_paths_results(n: int) -> None:
    with communicators(n) as comms:

        def body(c: pycoll.Communicator) -> None:
            r = c.rank
            for it in range(4):  # the first call makes the plan, the others replay it
                x = np.arange(6, dtype=np.float32) + r + it  # fresh contents, same arrays below
                a = np.empty(6, np.float32)
                a[...] = x
                out = np.full(6, -1, np.float32)
                exp = sum(np.arange(6, dtype=np.float32) + q + it for q in range(n))
                for _ in range(3):
                    a[...] = x
                    assert c.allreduce(a, out) is out
                    np.testing.assert_array_equal(out, exp)
                    assert c.allreduce(a) is a  # in place
                    np.testing.assert_array_equal(a, exp)
                    avg = c.allreduce(x.copy(), op="avg")
                    np.testing.assert_allclose(avg, exp / n, rtol=1e-6)
                blk = np.full(3, r + it, np.int64)
                g = np.full(3 * n, -1, np.int64)
                for _ in range(3):
                    assert c.allgather(blk, g) is g
                    np.testing.assert_array_equal(g, np.repeat(np.arange(n) + it, 3))
                    fresh = c.allgather(blk)
                    assert fresh.shape == (n, 3)
                    np.testing.assert_array_equal(fresh.reshape(-1), g)
                b = np.full(5, r * 10 + it, np.int32)
                for root in range(n):
                    for _ in range(2):
                        b[...] = r * 10 + it
                        assert c.broadcast(b, root=root) is b
                        np.testing.assert_array_equal(b, np.full(5, root * 10 + it))
                src = np.arange(2 * n, dtype=np.float64) * (r + 1) + it
                rs = np.empty(2, np.float64)
                tot = sum(np.arange(2 * n, dtype=np.float64) * (q + 1) + it for q in range(n))
                for _ in range(3):
                    assert c.reduce_scatter(src, rs, op="max") is rs
                    np.testing.assert_array_equal(
                        rs, src[2 * r : 2 * r + 2] * 0 + _max_blk(n, r, it)
                    )
                    np.testing.assert_array_equal(c.reduce_scatter(src), tot[2 * r : 2 * r + 2])
                red = np.empty(6, np.float32)
                for root in range(n):
                    for _ in range(2):
                        got = c.reduce(x, red if r == root else None, root=root)
                        if r == root:
                            assert got is red
                            np.testing.assert_array_equal(red, exp)
                        else:
                            assert got is None
            assert c._engine.plans.plans  # the calls above went through plans
            c.barrier()

        _on_all(comms, body)


@pytest.mark.parametrize("n", [2, 3])
def test_scatter_is_replayed_on_the_receiving_ranks(n: int) -> None:
    """A receiving rank's scatter has only ``recvbuf``: its plan holds that, so
    its calls replay (they went by the slow path each time: 46 us a 1 KiB call
    at n = 2 on the 2-core machine, 5.7 replayed), whatever ``sendbuf`` it
    passes, which it ignores; every root's blocks land, poisoned before."""
    k = 5
    with communicators(n) as comms:

        def body(c: pycoll.Communicator) -> None:
            r = c.rank
            out = np.empty(k, np.float64)
            junk = np.full(3, -7.0)  # ignored off the root, whatever its size
            for it in range(4):
                for root in range(n):
                    src = np.arange(n * k, dtype=np.float64) * (root + 1) + it
                    out[:] = np.nan
                    send = src if r == root else (None, junk)[it % 2]
                    assert c.scatter(send, out, root=root) is out
                    np.testing.assert_array_equal(out, src[r * k : (r + 1) * k])
                    assert junk.tolist() == [-7.0] * 3
            keys = {key[1:5] for key in c._engine.plans.plans if key[0].name == "scatter"}
            for root in range(n):  # off the root: one plan, found by recvbuf alone
                assert ((id(out), id(out), None, root) in keys) == (root != r), keys
            c.barrier()

        _on_all(comms, body)


def _max_blk(n: int, r: int, it: int) -> np.ndarray:
    return np.arange(2 * r, 2 * r + 2, dtype=np.float64) * n + it


def test_changed_arrays_are_validated_again() -> None:
    with communicators(2) as comms:

        def body(c: pycoll.Communicator) -> None:
            x = np.ones(4, np.float32)
            out = np.empty(4, np.float32)
            for _ in range(3):
                c.allreduce(x, out)
                c.allreduce(x)
            seq = c._engine.seq
            # a buffer made read-only: the same error as on a first call
            x.flags.writeable = False
            with pytest.raises(pycoll.InvalidArgumentError, match="sendbuf is read-only"):
                c.allreduce(x)
            c.allreduce(x, out)  # reading it is still fine
            out.flags.writeable = False
            with pytest.raises(pycoll.InvalidArgumentError, match="recvbuf is read-only"):
                c.allreduce(x, out)
            assert c._engine.seq == seq + 3  # rejected calls count too, on both ranks alike
            out.flags.writeable = True
            x.flags.writeable = True
            # another dtype under the same array object
            y = np.ones(4, np.float64)
            for _ in range(2):
                c.allreduce(y, op="avg")
            y.dtype = np.clongdouble  # not a dtype pycoll supports
            with pytest.raises(pycoll.InvalidArgumentError, match="complex256"):
                c.allreduce(y, op="avg")
            z = np.ones(4, np.int64)
            for _ in range(2):
                c.allreduce(z, op="sum")
            z.dtype = np.uint64
            z[...] = 1
            np.testing.assert_array_equal(c.allreduce(z, op="sum"), 2 * np.ones(4))
            z.dtype = np.float64  # 2 as int64 bits: a tiny float; avg is fine on floats
            c.allreduce(z, op="avg")
            z.dtype = np.int64
            with pytest.raises(pycoll.InvalidArgumentError, match="op='avg'"):
                c.allreduce(z, op="avg")
            # a new shape: the count of recvbuf no longer matches
            w = np.ones(4, np.float32)
            o = np.empty(4, np.float32)
            for _ in range(2):
                c.allreduce(w, o)
            o.shape = (2, 2)
            c.allreduce(w, o)  # same count: fine
            g = np.empty(8, np.float32)
            for _ in range(2):
                c.allgather(w, g)
            w.shape = (2, 2)
            np.testing.assert_array_equal(c.allgather(w, g), np.ones(8))
            w.shape = (4,)
            # bool is not a root, even where the int of the same value has a plan
            b = np.zeros(3, np.int32)
            for _ in range(2):
                c.broadcast(b, root=1)
            with pytest.raises(pycoll.InvalidArgumentError, match="root=True"):
                c.broadcast(b, root=True)
            with pytest.raises(pycoll.InvalidArgumentError, match="root=True"):
                c.reduce(b, root=True)
            c.broadcast(b, root=np.int64(1))
            # an unhashable op or algorithm takes the slow path and its error
            with pytest.raises(pycoll.InvalidArgumentError, match="op="):
                c.allreduce(x, out, op=["sum"])  # type: ignore[arg-type]
            with pytest.raises(pycoll.InvalidArgumentError, match="algorithm="):
                c.allgather(x, g, algorithm=["ring"])  # type: ignore[arg-type]
            c.barrier()

        _on_all(comms, body)


def test_recorder_closing_and_plan_bounds() -> None:
    with communicators(2) as comms:

        def body(c: pycoll.Communicator) -> list[str]:
            x = np.ones(2, np.float32)
            for _ in range(5):
                c.allreduce(x, op="max")
            recent = c.recent()
            assert len(recent) == 5
            assert all(
                "allreduce(count=2, dtype=float32, op=max" in s and " ok " in s for s in recent
            )
            assert [int(s.split()[0][1:]) for s in recent] == list(range(1, 6))
            # many distinct arrays: the plans stay bounded
            arrays = [np.ones(2, np.float32) for _ in range(PLAN_MAX + 8)]
            for a in arrays:
                c.allreduce(a)
            assert len(c._engine.plans.plans) <= PLAN_MAX
            # large arrays are not kept (see test_large_arrays_replay_weak_plans)
            big = np.ones(PLAN_MAX_BYTES // 4 + 1, np.float32)
            c.allreduce(big, op="max")
            c.allreduce(big, op="max")
            assert all(
                p.x is not big
                for p in (*c._engine.plans.plans.values(), *c._engine.plans.weak_plans.values())
            )
            c.barrier()
            return recent

        _on_all(comms, body)
        for c in comms:
            c.close()
            x = np.ones(2, np.float32)
            with pytest.raises(pycoll.CommunicatorClosedError):
                c.allreduce(x, op="max")
            assert (
                not c._engine.plans.plans
                and not c._engine.plans.weak_plans
                and not c._engine.plans.steps
            )


@pytest.mark.parametrize("n", [2, 3])
def test_calls_on_new_arrays_share_the_step_of_their_kind(n: int) -> None:
    made: dict[int, list[tuple[Any, ...]]] = {r: [] for r in range(n)}
    with communicators(n) as comms:
        for c in comms:
            make = c._engine.make_step

            def counted(key: Any, _make: Any = make, _made: Any = made[c.rank]) -> Any:
                _made.append(key[:2])
                return _make(key)

            c._engine.make_step = counted  # type: ignore[method-assign]

        def body(c: pycoll.Communicator) -> None:
            r = c.rank
            x = np.arange(7, dtype=np.float32) + r
            exp = sum(np.arange(7, dtype=np.float32) + q for q in range(n))
            for it in range(4):  # a fresh view each call: no plan to replay
                out = np.full(7, -1, np.float32)
                c.allreduce(x[:], out, algorithm="direct")
                np.testing.assert_array_equal(out, exp)
                b = np.full(3, r + it, np.int64) if r else np.arange(3) + it
                c.broadcast(b[:], root=0, algorithm="ring")
                np.testing.assert_array_equal(b, np.arange(3) + it)
            # another count, dtype or op is another kind
            y = np.arange(5, dtype=np.float64) + r
            o = np.empty(5)
            assert c.allreduce(y[:], o, op="max", algorithm="direct")[0] == n - 1
            assert c.allreduce(y[:], o, algorithm="direct")[0] == sum(range(n))
            for k in range(STEPS_MAX + 3):  # bounded, the oldest going first
                c.allreduce(np.ones(k + 1, np.int32), algorithm="direct")
            assert len(c._engine.plans.steps) == STEPS_MAX

        _on_all(comms, body)
    for r in range(n):  # once for the four calls of each kind, once for each kind after
        assert made[r] == [("allreduce", "direct"), ("broadcast", "ring")] + [
            ("allreduce", "direct")
        ] * (2 + STEPS_MAX + 3), made[r]


@pytest.mark.parametrize("n", [1, 2, 3])
def test_calls_on_new_arrays_run_by_their_kind(n: int) -> None:
    """A call on arrays with no plan (a fresh view, a new array each call) runs by
    the kind of call made by the first such call (_Kind): slow-path results and
    returned objects, no new plan; read-only or overlapping arrays still take the
    slow path and its error; the same arrays twice in a row make a plan, a new
    output for the same input does not; another thread makes its own kinds."""
    with communicators(n) as comms:

        def body(c: pycoll.Communicator) -> None:
            r = c.rank
            plans = None
            for it in range(5):
                if it == 2:  # the first call of each kind made a plan; no more from now
                    plans = len(c._engine.plans.plans)
                x = np.arange(7, dtype=np.float32) * (r + 1) + it
                exp = sum(np.arange(7, dtype=np.float32) * (q + 1) + it for q in range(n))
                out = np.full(7, np.nan, np.float32)
                assert c.allreduce(x[:], out) is out
                np.testing.assert_array_equal(out, exp)
                y = x.copy()
                assert c.allreduce(y, op="avg") is y
                np.testing.assert_allclose(y, exp / n, rtol=1e-6)
                blocks = [np.arange(6, dtype=np.int8).reshape(2, 3) + 10 * q + it for q in range(n)]
                g = c.allgather(blocks[r].copy()[:])
                assert g.shape == (n, 2, 3)
                np.testing.assert_array_equal(g, np.stack(blocks))
                go = np.full(6 * n, -1, np.int8)
                assert c.allgather(blocks[r].reshape(-1).copy(), go) is go
                np.testing.assert_array_equal(go, np.stack(blocks).reshape(-1))
                b = np.arange(5, dtype=np.int32) + r * 10 + it
                bv = b[:]
                assert c.broadcast(bv, root=n - 1) is bv
                np.testing.assert_array_equal(b, np.arange(5) + (n - 1) * 10 + it)
                src = np.arange(3 * n, dtype=np.float64) * (r + 1) + it
                tot = sum(np.arange(3 * n, dtype=np.float64) * (q + 1) + it for q in range(n))
                rs = c.reduce_scatter(src[:], op="max")
                assert rs.shape == (3,)
                np.testing.assert_array_equal(rs, np.arange(3 * r, 3 * r + 3) * n + it)
                ro = np.full(3, np.nan)
                assert c.reduce_scatter(src.copy(), ro) is ro
                np.testing.assert_array_equal(ro, tot[3 * r : 3 * r + 3])
                red = np.full(7, np.nan, np.float32)
                got = c.reduce(x[:], red if r == 0 else None, root=0, op="min")
                if r == 0:
                    assert got is red
                    np.testing.assert_array_equal(red, x)  # rank 0 holds the least
                else:
                    assert got is None
            assert plans is not None and len(c._engine.plans.plans) == plans
            assert c._engine.plans.kinds
            # what the kind does not cover goes the slow path, with its errors
            ro_x = np.ones(7, np.float32)
            ro_x.flags.writeable = False
            with pytest.raises(pycoll.InvalidArgumentError, match="sendbuf is read-only"):
                c.allreduce(ro_x, op="avg")
            ro_out = np.empty(7, np.float32)
            ro_out.flags.writeable = False
            with pytest.raises(pycoll.InvalidArgumentError, match="recvbuf is read-only"):
                c.allreduce(np.ones(7, np.float32), ro_out)
            both = np.ones(6 * n + 3, np.float64)
            with pytest.raises(pycoll.InvalidArgumentError, match="overlaps"):
                c.reduce_scatter(both[: 3 * n], both[3 * n - 1 : 3 * n + 2])
            # in place by the same array: the slow path allows it
            z = np.full(7, 1, np.float32)
            assert c.allreduce(z, z) is z
            np.testing.assert_array_equal(z, np.full(7, n, np.float32))
            # the same array twice in a row: a plan, then replays
            keep = np.ones(7, np.float32)
            before = len(c._engine.plans.plans)
            for _ in range(3):
                c.allreduce(keep, out)
            assert len(c._engine.plans.plans) == before + 1
            np.testing.assert_array_equal(out, np.full(7, n, np.float32))
            # the same sendbuf into a new recvbuf each call: the kind still
            before = len(c._engine.plans.plans)
            for _ in range(3):
                o2 = np.full(7, np.nan, np.float32)
                assert c.allreduce(keep, o2) is o2
                np.testing.assert_array_equal(o2, np.full(7, n, np.float32))
            assert len(c._engine.plans.plans) == before
            # another thread: its own kinds (as its own plans and steps)
            kinds = len(c._engine.plans.kinds)
            other = ThreadPoolExecutor(1)
            for _ in range(3):
                other.submit(c.allreduce, x[:], out).result()
                np.testing.assert_array_equal(out, exp)
            other.shutdown()
            assert len(c._engine.plans.kinds) == kinds + 1
            c.barrier()

        _on_all(comms, body)
        for c in comms:
            c.close()
            assert not c._engine.plans.kinds


def test_a_failed_collective_drops_plans_and_steps() -> None:
    with communicators(2, timeout=0.5) as comms:
        x = [np.ones(3, np.float32) for _ in comms]
        _on_all(comms, lambda c: [c.allreduce(x[c.rank]) for _ in range(2)])
        c = comms[0]
        assert c._engine.plans.plans and c._engine.plans.steps and c._engine.plans.kinds
        with pytest.raises(pycoll.CollectiveTimeout):
            c.allreduce(x[0])  # alone: rank 1 never joins
        assert (
            not c._engine.plans.plans
            and not c._engine.plans.weak_plans
            and not c._engine.plans.steps
            and not c._engine.plans.kinds
        )
        with pytest.raises(pycoll.CommunicatorClosedError, match="earlier failure"):
            c.allreduce(x[0])  # unusable from now on, not replayed


@pytest.mark.parametrize("n", [1, 2, 3])
def test_large_arrays_replay_weak_plans(n: int) -> None:
    """Arrays over PLAN_MAX_BYTES get plans that hold them by weak references:
    the replays give the slow path's results and objects, a dropped array takes
    its plan with it (and is freed), and an array's memory cannot move while its
    plan lives."""
    k = PLAN_MAX_BYTES // 4 + 7  # float32 elements: just over the size of held plans
    with communicators(n) as comms:

        def body(c: pycoll.Communicator) -> None:
            r = c.rank
            x = np.empty(k, np.float32)
            out = np.full(k, np.nan, np.float32)
            g = np.full(n * k, np.nan, np.float32)
            b = np.empty(k, np.float32)
            rs = np.full(k, np.nan, np.float32)
            src = np.empty(n * k, np.float32)
            red = np.full(k, np.nan, np.float32)
            base = np.arange(k, dtype=np.float32)
            for it in range(3):  # the first call makes each plan, the others replay it
                x[...] = base + r + it
                exp = sum(base + q + it for q in range(n))
                assert c.allreduce(x, out) is out
                np.testing.assert_array_equal(out, exp)
                assert c.allreduce(x) is x  # in place
                np.testing.assert_array_equal(x, exp)
                x[...] = base + r + it
                assert c.allgather(x, g) is g
                np.testing.assert_array_equal(g, np.concatenate([base + q + it for q in range(n)]))
                fresh = c.allgather(x)
                assert fresh.shape == (n, k) and fresh is not g
                np.testing.assert_array_equal(fresh.reshape(-1), g)
                for root in range(n):
                    b[...] = base * (r + 1) + it
                    assert c.broadcast(b, root=root) is b
                    np.testing.assert_array_equal(b, base * (root + 1) + it)
                src[...] = np.arange(n * k, dtype=np.float32) + r + it
                assert c.reduce_scatter(src, rs, op="max") is rs
                np.testing.assert_array_equal(rs, src[r * k : (r + 1) * k] - r + n - 1)
                got = c.reduce(x, red if r == 0 else None, op="min")
                assert got is (red if r == 0 else None)
                if r == 0:
                    np.testing.assert_array_equal(red, x - r)
            plans = list(c._engine.plans.weak_plans.values())
            assert plans and all(p.weak and isinstance(p.x, weakref.ref) for p in plans)
            # a dropped array takes its plan with it, and nothing holds it
            gone = weakref.ref(out)
            held = len(c._engine.plans.weak_plans)
            del out, plans
            gc.collect()
            assert gone() is None and len(c._engine.plans.weak_plans) == held - 1
            # NumPy will not move an array's memory while a weak reference to it
            # lives (resize refuses; .data cannot be set), and the plan checks the
            # address before each replay besides
            a = np.zeros(k, np.float32)
            for _ in range(2):
                c.allreduce(a, op="max")
            with pytest.raises(ValueError, match="resize"):
                a.resize(4 * k, refcheck=False)
            a[...] = r + 1
            assert c.allreduce(a, op="max") is a
            np.testing.assert_array_equal(a, np.full(k, n, np.float32))
            c.barrier()

        _on_all(comms, body)


def test_async_calls_and_queued_blocking_ones_bypass_plans() -> None:
    with communicators(2) as comms:

        def body(c: pycoll.Communicator) -> None:
            x = np.ones(3, np.float32)
            out = np.empty(3, np.float32)
            for _ in range(2):
                c.allreduce(x, out)
            reqs = [c.allreduce(x, out, async_op=True) for _ in range(3)]
            c.allreduce(x, out)  # queued behind them, on the worker thread
            for q in reqs:
                q.wait(30)
            np.testing.assert_array_equal(out, 2 * x)
            c.allreduce(x, out)  # the plan again
            np.testing.assert_array_equal(out, 2 * x)

        _on_all(comms, body)


def test_request_wait_timeout_names_the_rank_and_the_call_goes_on() -> None:
    with communicators(2) as comms:
        late = threading.Event()

        def body(c: pycoll.Communicator) -> None:
            x = np.full(5, c.rank + 1, np.float32)
            if c.rank == 1:
                late.wait(30)  # rank 0's wait(timeout) runs out first
            req = c.allreduce(x, async_op=True)
            if c.rank == 0:
                with pytest.raises(
                    pycoll.CollectiveTimeout, match="rank 0: allreduce still running"
                ):
                    req.wait(0.05)
                late.set()
            req.wait(30)
            np.testing.assert_array_equal(x, np.full(5, 3, np.float32))

        _on_all(comms, body)


@pytest.mark.parametrize("n", [3, 4])
def test_split_slot_allreduce_on_both_paths(n: int) -> None:
    """From DIRECT_SPLIT_BYTES up, a slot allreduce at n >= 3 ranks on as many
    cores splits the reduction; the plan (one call after another) and the slow path (async) give
    the rank-order reduction, bit for bit, on every rank, whatever the size."""
    from pycoll.algorithms.cost import DIRECT_SPLIT_BYTES

    split = DIRECT_SPLIT_BYTES // 4
    counts = [1, split - 1, split, split + 7, 50021]  # 50021 (prime) floats fill most of a slot
    with communicators(n) as comms:

        def body(c: pycoll.Communicator) -> list[np.ndarray]:
            assert c._engine.group is not None
            c._engine.crowded = False  # as with a core per rank (it never splits otherwise)
            c._engine.links_cache.clear()
            got = []
            for count in counts:
                xs = [
                    np.random.default_rng(100 * q + count).standard_normal(count) for q in range(n)
                ]
                xs = [a.astype(np.float32) for a in xs]
                ref = xs[0] + xs[1]
                for a in xs[2:]:
                    ref = ref + a
                x = xs[c.rank].copy()
                for _ in range(2):  # the plan, then its replay
                    out = np.full(count, np.nan, np.float32)
                    c.allreduce(x, out, algorithm="direct")
                    np.testing.assert_array_equal(out, ref)
                slow = np.full(count, np.nan, np.float32)
                c.allreduce(x, slow, algorithm="direct", async_op=True).wait(30)
                np.testing.assert_array_equal(slow, ref)
                y = x.copy()
                c.allreduce(y, algorithm="direct")  # in place
                np.testing.assert_array_equal(y, ref)
                got.append(out)
            return got

        results = _on_all(comms, body)
        for r in range(1, n):
            for a, b in zip(results[0], results[r]):
                assert a.tobytes() == b.tobytes()


@pytest.mark.parametrize("n", [2, 3, 4])
def test_direct_slot_reduce_gives_the_rank_order_bits_at_every_root(n: int) -> None:
    """A root of rank 0 or 1 reduces its own input where it lies (not from its
    slot); every root, in place or not, on the plan and its replays (fresh
    contents each call), gets ``((x0 OP x1) OP x2) ...`` bit for bit."""
    with communicators(n) as comms:

        def body(c: pycoll.Communicator) -> None:
            r = c.rank
            for root, inplace, op, count in [
                (root, inplace, op, count)
                for root in range(n)
                for inplace in (False, True)
                for op in ("sum", "prod", "max")
                for count in (1, 7, 1000)
            ]:
                x = np.empty(count, np.float32)
                out = np.empty(count, np.float32)
                for it in range(3):  # the plan, then replays
                    xs = [
                        np.random.default_rng([q, root, count, it]).standard_normal(count)
                        for q in range(n)
                    ]
                    xs = [a.astype(np.float32) for a in xs]
                    f = {"sum": np.add, "prod": np.multiply, "max": np.maximum}[op]
                    ref = f(xs[0], xs[1])
                    for a in xs[2:]:
                        ref = f(ref, a)
                    x[...] = xs[r]
                    out[...] = np.nan
                    got = c.reduce(x, None if inplace else out, root=root, op=op)
                    if r != root:
                        assert got is None
                        np.testing.assert_array_equal(x, xs[r])  # a leaf's input is untouched
                        continue
                    assert got is (x if inplace else out)
                    what = f"root {root} {op} count {count} inplace {inplace} call {it}"
                    assert got.tobytes() == ref.tobytes(), what
                    if not inplace:
                        np.testing.assert_array_equal(x, xs[r], err_msg=what)

        _on_all(comms, body)


@pytest.mark.parametrize(
    ("cpus", "crowded"),
    [
        ([{0}, {1}, {2}], False),  # a core each (mpirun --bind-to core)
        ([{0, 1}, {0, 1}, {0, 1}], True),  # three ranks on two cores
        ([{0, 1, 2}, {0}, {0}], False),  # together they may use three
        ([{0}, {0}, {1}], True),
    ],
)
def test_crowded_is_one_verdict_for_all_ranks(
    monkeypatch: pytest.MonkeyPatch, cpus: list[set[int]], crowded: bool
) -> None:
    """Whether ranks outnumber the cores they may run on changes the algorithms'
    steps, so every rank must reach the same verdict: the union of the host's
    ranks' CPU sets against their number."""
    import threading

    import pycoll.family as cm

    monkeypatch.setattr(cm, "_cpus", lambda: set(cpus[int(threading.current_thread().name[4:])]))
    with communicators(3) as comms:
        assert [c._engine.crowded for c in comms] == [crowded] * 3
        got = _on_all(comms, lambda c: c.allreduce(np.arange(4, dtype=np.float32)))
        for c, out in zip(comms, got):
            np.testing.assert_array_equal(out, 3 * np.arange(4, dtype=np.float32))
            assert c._engine.links_cache and all(
                L.crowded is crowded for L in c._engine.links_cache.values()
            )


@pytest.mark.parametrize("then", ["reduce to rank 1", "barrier"])
def test_a_rank_steps_ahead_never_rewrites_a_posted_word_its_peer_has_not_seen(then: str) -> None:
    """The leaves of a reduce wait on no peer, so rank 1 runs W small steps
    ahead of a root that is off its core.  Its next step, one that fills no
    slot (a root of rank 0 or 1 reduces its own input in place; a barrier),
    must still wait until the root saw the word it posted W steps before, which
    that step's word replaces: else the root meets a later step and raises a
    mismatch between calls that matched."""
    with communicators(2) as comms:
        G0 = comms[0]._engine.group
        assert G0 is not None
        K = G0.words
        for name in ("wait", "wait_word"):  # rank 0's first wait starts late
            real = getattr(G0, name)

            def late(*args: Any, _real: Any = real) -> None:
                if not slept:
                    slept.append(1)
                    time.sleep(0.3)
                _real(*args)

            setattr(G0, name, late)
        slept: list[int] = []

        def body(c: pycoll.Communicator) -> None:
            x = np.full(3, c.rank + 1, np.float32)
            for _ in range(K):
                got = c.reduce(x, root=0)
                if c.rank == 0:
                    np.testing.assert_array_equal(got, 3.0)  # in place: x holds the sum
                    x[...] = 1
            if then == "barrier":
                c.barrier()
            else:
                y = np.full(3, c.rank + 1, np.float32)
                got = c.reduce(y, root=1)
                if c.rank == 1:
                    np.testing.assert_array_equal(got, 3.0)

        _on_all(comms, body)
        assert slept


def _count_calls(c: pycoll.Communicator, name: str, tally: list[int]) -> None:
    """Count this rank's cross-memory ``read``s or ``write``s in ``tally[rank]``."""
    assert c._engine.group is not None and c._engine.group.cma
    real = getattr(c._engine.group, name)

    def counted(*args: Any) -> Any:
        tally[c.rank] += 1
        return real(*args)

    setattr(c._engine.group, name, counted)


def _set_crowded(comms: Any, crowded: bool) -> None:
    """Every rank's verdict on ranks outnumbering cores, before any rank starts
    (they must agree); the links made with the old one are dropped."""
    for c in comms:
        c._engine.crowded = crowded
        c._engine.links_cache.clear()


@pytest.mark.parametrize("n", [2, 3, 4])
@pytest.mark.parametrize("crowded", [False, True])
@pytest.mark.parametrize("compiled", [True, False])
def test_direct_broadcast_by_address_shares_the_copy(
    n: int, crowded: bool, compiled: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Above the slot size, a direct broadcast has the root write the last 1/n
    of every reader's buffer while the readers read the rest; every rank
    ends with the root's bytes, for odd sizes and every root.  The compiled
    broadcast by address reads and writes on its own: counted as one call of
    ``control`` a rank."""
    from pycoll.algorithms import direct

    if not compiled:
        monkeypatch.setattr(direct, "compiled", None)
    elif direct.compiled is None:
        pytest.skip("pycoll._step was not built")
    with communicators(n) as comms:
        slot = comms[0]._engine.group.slot_bytes
        writes = [0] * n
        _set_crowded(comms, crowded)

        def body(c: pycoll.Communicator) -> None:
            _count_calls(c, "write", writes)
            _count_calls(c, "control", writes)
            for count, dtype in [
                (slot // 8 + 3, np.float64),
                (3 * slot + 7, np.int8),
                (slot, np.float16),
            ]:
                for root in range(n):
                    want = np.random.default_rng(count + root).integers(0, 100, count).astype(dtype)
                    buf = want.copy() if c.rank == root else np.full(count, 101, dtype)
                    c.broadcast(buf, root=root, algorithm="direct")
                    assert buf.tobytes() == want.tobytes(), (c.rank, root, count, dtype)

        _on_all(comms, body)
    # three sizes, each root once: (n - 1) writes a time at the root, or one
    # control on every rank
    assert sum(writes) == 3 * n * (n if compiled else n - 1)


@pytest.mark.parametrize("n", [3, 4])
@pytest.mark.parametrize("crowded", [False, True])
@pytest.mark.parametrize("compiled", [True, False])
def test_direct_reductions_where_ranks_outnumber_cores_go_by_slots_up_to_their_limit(
    n: int, crowded: bool, compiled: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Above the slot size a direct allreduce or reduce reads the peers' buffers
    by address (and writes the finished segments into the outputs); where ranks
    outnumber cores it goes through the slots in rounds
    while a rank's (n - 1) N stays within ROUNDS_CROWDED_*.  Either way every
    rank (the root, for reduce) gets the rank-order reduction, bit for bit, in
    place and out of place, from the Python steps and from the compiled
    allreduce by address (which reads and writes on its own: counted once a
    call, as one read and one write)."""
    from pycoll.algorithms import direct

    if not compiled:
        monkeypatch.setattr(direct, "compiled", None)
    elif direct.compiled is None:
        pytest.skip("pycoll._step was not built")
    with communicators(n) as comms:
        slot = comms[0]._engine.group.slot_bytes
        reads = [0] * n
        writes = [0] * n
        _set_crowded(comms, crowded)

        def body(c: pycoll.Communicator) -> None:
            _count_calls(c, "read", reads)
            _count_calls(c, "write", writes)
            _count_calls(c, "control", reads)  # the compiled allreduce reads
            _count_calls(c, "control", writes)  # ... and writes
            r = c.rank
            for coll, limit in [
                ("allreduce", direct.ROUNDS_CROWDED_ALLREDUCE),
                ("reduce", direct.ROUNDS_CROWDED_REDUCE),
            ]:
                top = limit // (n - 1) // 4  # float32 elements at the limit
                for count in [slot // 4 + 1, top, top + 1]:
                    nbytes = 4 * count
                    by_address = not (crowded and (n - 1) * nbytes <= limit)
                    rng = [np.random.default_rng([count, q]) for q in range(n)]
                    xs = [g.standard_normal(count).astype(np.float32) for g in rng]
                    ref = xs[0] + xs[1]
                    for a in xs[2:]:
                        ref = ref + a
                    root = count % n
                    before, wrote = reads[r], writes[r]
                    out = np.full(count, np.nan, np.float32)
                    if coll == "allreduce":
                        c.allreduce(xs[r], out, algorithm="direct")
                        y = xs[r].copy()
                        c.allreduce(y, algorithm="direct")  # in place
                        assert y.tobytes() == ref.tobytes(), (r, count, "in place")
                    else:
                        c.reduce(xs[r], out, root=root, algorithm="direct")
                        y = xs[r].copy()
                        c.reduce(y, root=root, algorithm="direct")  # in place on the root
                        assert r != root or y.tobytes() == ref.tobytes(), (r, count, "in place")
                        assert r == root or y.tobytes() == xs[r].tobytes(), (r, count)
                    if coll == "allreduce" or r == root:
                        assert out.tobytes() == ref.tobytes(), (coll, r, count)
                    assert (reads[r] > before) == by_address, (coll, r, count)
                    # by address the finished segments are written (reduce: by the leaves)
                    writer = coll == "allreduce" or r != root
                    assert (writes[r] > wrote) == (by_address and writer), (coll, r, count)

        _on_all(comms, body)


@pytest.mark.parametrize("cma", [True, False])
@pytest.mark.parametrize("n", [2, 3])
def test_direct_allgather_rounds_written_ahead_then_a_burst_of_broadcasts(
    n: int, cma: bool
) -> None:
    """Up to ``ahead`` rounds of slots are all written before any is read (more
    go round by round, here without direct reads): a root's broadcasts straight
    after, which wait for no reader, must not rewrite a slot a slow peer has
    still to read."""
    with communicators(n) as comms:
        G = comms[0]._engine.group
        slot, ahead, K = G.slot_bytes, G.ahead, G.words
        for c in comms:
            c._engine.group.cma = cma

        def body(c: pycoll.Communicator) -> None:
            r = c.rank
            sizes = [2 * slot, ahead * slot] + ([] if cma else [(ahead + 2) * slot])
            for it, nbytes in enumerate(sizes):
                k = nbytes // 8
                xs = [np.random.default_rng([k, q, it]).random(k) for q in range(n)]
                out = c.allgather(xs[r], np.full(n * k, np.nan), algorithm="direct")
                assert np.array_equal(out, np.concatenate(xs)), (r, nbytes)
                for b in range(K + 2):  # each a step of the slots
                    buf = np.full(64, float(b) if r == 0 else np.nan)
                    c.broadcast(buf, root=0, algorithm="direct")
                    assert (buf == b).all(), (r, nbytes, b)

        _on_all(comms, body)


@pytest.mark.parametrize("slot_bytes", [None, 4 << 20])
@pytest.mark.parametrize("n", [2, 3])
def test_allgather_algorithms_place_a_large_own_block(n: int, slot_bytes: int | None) -> None:
    """From OWN_PLACED_MIN bytes a block, the envelope leaves a rank's own block
    to the allgather algorithm: every algorithm places it, out of place (a
    plan, and fresh arrays) and in place, outputs poisoned, a ragged last piece;
    ``direct`` by address copies it and writes it to every peer piece by piece
    (its Python steps here, whose writes can be counted; the compiled call's are
    tests/test_by_address.py's).  With 4 MiB slots such a block would fit a
    prepared slot step, which never copies the own block: none is made, so the
    blocks still arrive whole."""
    from pycoll.algorithms.direct import OWN_PIECE_BYTES
    from pycoll.buffers import OWN_PLACED_MIN

    cfg: dict[str, Any] = {"compiled": False}
    if slot_bytes is not None:
        cfg = {"group_slot_bytes": slot_bytes}
    with communicators(n, **cfg) as comms:
        writes = [0] * n
        _on_all(comms, lambda c: _count_calls(c, "write", writes))

        def body(c: pycoll.Communicator) -> None:
            r = c.rank
            for dtype in (np.float32, np.int64):
                size = np.dtype(dtype).itemsize
                k = OWN_PLACED_MIN // size + 3
                xs = [
                    (np.random.default_rng([k, q]).random(k) * 1e6).astype(dtype) for q in range(n)
                ]
                want = np.concatenate(xs)
                for algo in ("direct", "cma", "ring", "tree", "auto"):
                    poison = np.iinfo(dtype).min if dtype is np.int64 else np.nan
                    out = np.full(n * k, poison, dtype)
                    for it in range(3):  # the slow path, then its plan twice
                        out[:] = poison
                        c.allgather(xs[r], out, algorithm=algo)
                        assert np.array_equal(out, want), (r, dtype, algo, it)
                    got = c.allgather(xs[r].copy(), np.full(n * k, poison, dtype), algorithm=algo)
                    assert np.array_equal(got, want), (r, dtype, algo, "fresh")
                    buf = np.full(n * k, poison, dtype)
                    buf[r * k : (r + 1) * k] = xs[r]
                    c.allgather(buf[r * k : (r + 1) * k], buf, algorithm=algo)
                    assert np.array_equal(buf, want), (r, dtype, algo, "in place")

        _on_all(comms, body)
        if slot_bytes is None:  # every out-of-place direct call went by address in pieces
            pieces = -(-(OWN_PLACED_MIN + 3 * 8) // OWN_PIECE_BYTES)
            assert all(w >= 4 * (n - 1) * pieces for w in writes), writes


@pytest.mark.parametrize("n", [2, 3])
def test_direct_allgather_slot_rounds_then_by_address(n: int) -> None:
    """Blocks of up to three slots go through the slots in rounds; larger ones by
    address: each rank writes its block into its place in every peer's output,
    and reads nothing.  Every rank gets every block, on both sides of the
    threshold, in place and out of place, crowded or not.  (The Python steps,
    whose writes can be counted; the compiled call makes the same ones:
    tests/test_by_address.py.)"""
    from pycoll.algorithms.direct import ALLGATHER_SLOT_ROUNDS

    with communicators(n, compiled=False) as comms:
        slot = comms[0]._engine.group.slot_bytes
        top = ALLGATHER_SLOT_ROUNDS * slot
        reads = [0] * n
        writes: list[list[tuple[int, int, int]]] = [[] for _ in range(n)]

        def spy_on(c: pycoll.Communicator) -> None:
            _count_calls(c, "read", reads)
            G = c._engine.group
            assert G is not None
            write = G.write

            def spy(j: int, seq: int, offset: int, src: Any) -> None:
                writes[c.rank].append((j, offset, src.nbytes))
                write(j, seq, offset, src)

            setattr(G, "write", spy)

        def body(c: pycoll.Communicator) -> None:
            for nbytes, by_address in [(slot + 8, False), (top, False), (top + 8, True)]:
                k = nbytes // 8
                xs = [np.random.default_rng([k, r]).random(k) for r in range(n)]
                want = np.concatenate(xs)
                del writes[c.rank][:]
                out = c.allgather(xs[c.rank], np.full(n * k, np.nan), algorithm="direct")
                assert np.array_equal(out, want), (c.rank, nbytes)
                buf = np.full(n * k, np.nan)
                buf[c.rank * k : (c.rank + 1) * k] = xs[c.rank]
                c.allgather(buf[c.rank * k : (c.rank + 1) * k], buf, algorithm="direct")
                assert np.array_equal(buf, want), (c.rank, nbytes, "in place")
                peers = [(c.rank + d) % n for d in range(1, n)]
                mine = [(j, c.rank * k * 8, k * 8) for j in peers]
                assert writes[c.rank] == (2 * mine if by_address else []), (c.rank, nbytes)
            assert reads[c.rank] == 0, c.rank

        _on_all(comms, spy_on)
        for crowded in (False, True):
            _set_crowded(comms, crowded)
            _on_all(comms, body)


@pytest.mark.parametrize("n", [2, 3])
def test_alltoall_by_address_replays_read_fresh_data(n: int) -> None:
    """alltoall by address (``cma`` above one slot) runs a prepared step
    (``direct._prepare_alltoall``): the same arrays again with new contents, a
    new output at another address, and new arrays of the same kind, each
    against NumPy with the output poisoned."""
    with communicators(n, group_slot_bytes=4096, tune=False) as comms:

        def body(c: pycoll.Communicator) -> None:
            r, k = c.rank, 2053  # elements a block: 8 KiB and more, over a 4 KiB slot
            x = np.empty(n * k, np.float32)
            out = np.empty(n * k, np.float32)

            def want(it: int) -> np.ndarray:
                return np.concatenate(
                    [
                        (np.arange(n * k, dtype=np.float32) + 1000 * j + it)[r * k : (r + 1) * k]
                        for j in range(n)
                    ]
                )

            for it in range(4):
                x[...] = np.arange(n * k, dtype=np.float32) + 1000 * r + it
                out.fill(-1.0)
                assert c.alltoall(x, out, algorithm="cma") is out
                np.testing.assert_array_equal(out, want(it))
            other = np.full(n * k, -1.0, np.float32)  # another output: another address
            assert c.alltoall(x, other, algorithm="cma") is other
            np.testing.assert_array_equal(other, want(3))
            for it in range(4, 6):  # new arrays each call
                y = np.arange(n * k, dtype=np.float32) + 1000 * r + it
                got = c.alltoall(y, np.full(n * k, -1.0, np.float32), algorithm="cma")
                np.testing.assert_array_equal(got, want(it))
            steps = [s for key, s in c._engine.plans.steps.items() if key[0] == "alltoall"]
            assert steps and all("_prepare_alltoall" in s.__qualname__ for s in steps), steps

        _on_all(comms, body)


@pytest.mark.parametrize("n", [3, 4])
@pytest.mark.parametrize("compiled", [True, False])
def test_small_and_whole_slot_steps_mixed_with_ranks_running_ahead(n: int, compiled: bool) -> None:
    """Small steps run W ahead, whole-slot ones K: a seeded mix of broadcasts and
    reduces (whose roots wait for nobody, so run ahead of a late reader), of
    small (a part of a slot), whole-slot and several-slot sizes, with ranks
    late in turn, the arrays of each size replayed; every result is the
    reference's, so no step rewrote a slot part or word a peer had still to read."""
    rng = np.random.default_rng(7)
    with communicators(n, compiled=compiled, tune=False) as comms:
        sub, slot = comms[0]._engine.group.sub_bytes, comms[0]._engine.group.slot_bytes
        sizes = [8, sub // 8, sub // 8 + 1, slot // 8, 3 * slot // 8 + 5]  # float64 elements
        plan = [
            (str(rng.choice(["broadcast", "reduce"])), int(rng.choice(sizes)), int(rng.integers(n)))
            for _ in range(160)
        ]
        late = {int(i): int(rng.integers(n)) for i in rng.choice(len(plan), 12, replace=False)}

        def body(c: pycoll.Communicator) -> None:
            r = c.rank
            bufs = {k: np.empty(k) for k in sizes}
            for it, (coll, k, root) in enumerate(plan):
                if late.get(it) == r:
                    time.sleep(0.02)
                want = [np.full(k, float(q * 1000 + it)) for q in range(n)]
                x = bufs[k]
                if coll == "broadcast":
                    x[...] = want[root] if r == root else np.nan
                    c.broadcast(x, root=root, algorithm="direct")
                    assert np.array_equal(x, want[root]), (it, coll, k, root, r)
                else:
                    x[...] = want[r]
                    got = c.reduce(x, root=root, algorithm="direct")
                    if r == root:
                        assert np.array_equal(got, sum(want)), (it, coll, k, root, r)

        _on_all(comms, body)


def test_a_root_running_ahead_of_a_reader_that_closed_raises_within_w_calls() -> None:
    """Small broadcasts let the root run up to W steps ahead of its readers: with
    the reader closed, the root's calls go on returning (each only publishes
    its bytes) until the step whose word the reader never released, which
    raises within the timeout instead of waiting for ever."""
    with communicators(2, timeout=10.0, tune=False) as comms:
        W = comms[0]._engine.group.words
        buf = np.ones(2)
        for _ in range(3):  # both ranks, the step prepared
            _on_all(comms, lambda c: c.broadcast(buf.copy(), root=0, algorithm="direct"))
        comms[1].close()
        returned = 0
        t0 = time.monotonic()
        with pytest.raises(pycoll.PycollError) as ei:
            for _ in range(W + 2):
                comms[0].broadcast(buf, root=0, algorithm="direct")
                returned += 1
        assert type(ei.value).__name__ in ("PeerAbortedError", "CollectiveTimeout"), ei.value
        assert returned <= W and time.monotonic() - t0 < 13, (returned, time.monotonic() - t0)
