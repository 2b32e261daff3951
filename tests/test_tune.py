"""``auto``'s online choice (pycoll.tune): the schedule, the agreement of the
ranks, and the claim it rests on, that the collectives it tunes give the same
bits whichever algorithm runs.  Ranks are threads (:mod:`tests.inproc`)."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import ml_dtypes
import numpy as np
import pytest

import pycoll
from pycoll.algorithms import cost, names
from pycoll.tune import (
    BUDGET,
    FIRST,
    MARGIN,
    PERIOD_MAX,
    PERIOD_MIN,
    POOLED,
    TRIALS,
    WINDOW,
    Tuner,
    tunable,
    window,
)
from tests.inproc import communicators, run_ranks

pytestmark = pytest.mark.timeout(120)


class FakeClock:
    """A clock that the contenders advance by their (changeable) costs."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def contenders(
    clock: FakeClock, costs: dict[str, float]
) -> tuple[list[Callable[[], None]], list[str]]:
    ran: list[str] = []

    def fn(name: str) -> Callable[[], None]:
        def run() -> None:
            ran.append(name)
            clock.now += costs[name]

        return run

    return [fn(a) for a in costs], ran


def tuner(
    costs: dict[str, float], label: str = "allgather"
) -> tuple[Tuner, FakeClock, list[Callable[[], None]], list[str]]:
    """A tuner over fake contenders of these costs, its clock, the contenders, and
    the list of the names that ran."""
    clock = FakeClock()
    fns, ran = contenders(clock, costs)
    return Tuner(label, list(costs), lambda v: v, clock), clock, fns, ran


def until_decided(contenders: int) -> int:
    """Calls of one kind up to the first decision among ``contenders``."""
    return window(contenders) + POOLED * TRIALS * contenders


def decide(t: Tuner, fns: list[Callable[[], None]]) -> int:
    """Calls until the tuner's next decision; how many."""
    rounds, calls = t.rounds, 0
    while t.rounds == rounds:
        t.run(fns)
        calls += 1
    return calls


def test_the_incumbent_runs_first_then_a_round_times_the_challengers_in_a_row() -> None:
    clock, sums = FakeClock(), []
    costs = {"direct": 3e-3, "ring": 2e-3, "oneshot": 5e-3}
    fns, ran = contenders(clock, costs)

    def agree(v: np.ndarray) -> np.ndarray:
        sums.append(v.copy())
        return v * 2  # two ranks that timed the same

    t = Tuner("allreduce 2 MiB", list(costs), agree, clock)
    assert t.choice == "direct"  # the model's choice runs until a round says otherwise
    assert POOLED == 2
    first = window(3)
    for _ in range(first + 3 * TRIALS):
        t.run(fns)
    # the challengers, then the incumbent again: each timed after a switch alike
    one = ["ring"] * TRIALS + ["oneshot"] * TRIALS + ["direct"] * TRIALS
    assert ran == ["direct"] * first + one
    # the first decision pools two rounds: the second follows at once
    assert not sums and t.choice == "direct"
    for _ in range(3 * TRIALS):
        t.run(fns)
    assert ran == ["direct"] * first + one + one
    assert len(sums) == 1 and sums[0].tolist() == pytest.approx(list(costs.values()))
    # the next round when ring's calls will have taken 1/BUDGET of what the round cost
    wait = math.ceil(TRIALS * (3 + 5) / 2 / BUDGET)
    assert t.choice == "ring" and t.left == wait
    ran.clear()
    for _ in range(wait):
        t.run(fns)
    assert ran == ["ring"] * wait and len(sums) == 1  # no round, no exchange
    assert t.calls == [first + 2 * TRIALS, 2 * TRIALS + wait, 2 * TRIALS]
    t.run(fns)  # the next round: direct and oneshot challenge
    assert ran[-1] == "direct"


def test_the_wait_between_rounds_doubles_while_the_incumbent_stays_and_resets_on_a_change() -> None:
    costs = {"direct": 1e-3, "ring": 2e-3}
    t, _, fns, _ = tuner(costs)
    periods = []
    for _ in range(6):
        decide(t, fns)
        periods.append(t.left)
    first = math.ceil(TRIALS * 2 / BUDGET)  # a round of ring costs 2 TRIALS calls of direct
    assert periods == [min(first << i, PERIOD_MAX) for i in range(6)]
    assert periods[-1] == PERIOD_MAX and t.choice == "direct"
    # the machine changes: ring becomes faster; the next round switches
    costs["direct"], costs["ring"] = 3e-3, 1e-3
    decide(t, fns)  # pooled with the last round: ring 1.5 against 2 ms, a win
    assert t.choice == "ring"
    assert t.left == max(PERIOD_MIN, math.ceil(TRIALS * 2e-3 / 1.5e-3 / BUDGET))


def test_one_round_that_favours_a_challenger_does_not_switch_alone() -> None:
    costs = {"direct": 1e-3, "ring": 2e-3}
    t, _, fns, _ = tuner(costs)
    decide(t, fns)
    assert t.choice == "direct"
    costs["ring"] = 0.5e-3  # a spell of one round: pooled, ring's median is 1.25 ms
    decide(t, fns)
    assert t.choice == "direct"
    decide(t, fns)  # it lasts: two rounds of it
    assert t.choice == "ring"


def test_what_a_call_leaves_to_pay_after_it_returns_counts_as_its_own() -> None:
    costs = {"direct": 2e-3, "ring": 1e-3}
    t, clock, fns, ran = tuner(costs)
    while t.rounds == 0:
        t.run(fns)
        if ran[-1] == "ring":  # returns early, the rest is paid before the next call
            clock.now += 3e-3
    assert t.choice == "direct"


def test_close_challengers_are_tried_no_sooner_than_period_min() -> None:
    costs = {"direct": 1e-3, "ring": 1e-3}
    t, _, fns, _ = tuner(costs)
    decide(t, fns)
    assert t.left == max(PERIOD_MIN, math.ceil(TRIALS / BUDGET))


def test_a_challenger_must_win_by_the_margin() -> None:
    costs = {"direct": 1.00e-3, "ring": (1 - MARGIN / 2) * 1e-3}  # noise, not a reason
    t, _, fns, _ = tuner(costs, "broadcast")
    assert decide(t, fns) == window(2) + POOLED * 2 * TRIALS
    assert t.choice == "direct" and t.rounds == 1


def test_the_models_choice_comes_back_without_the_margin() -> None:
    costs = {"direct": 2e-3, "ring": 1e-3}
    t, _, fns, _ = tuner(costs, "broadcast")
    decide(t, fns)
    assert t.choice == "ring"
    costs["direct"] = (1 - MARGIN / 2) * 1e-3  # faster again, by less than the margin
    decide(t, fns)  # pooled with a round of direct at 2 ms
    assert t.choice == "ring"
    decide(t, fns)
    assert t.choice == "direct"
    costs["ring"] = (1 - MARGIN / 2) * costs["direct"]  # a challenger still needs the margin
    for _ in range(3):
        decide(t, fns)
        assert t.choice == "direct"
    costs["ring"] = (1 - 2 * MARGIN) * costs["direct"]
    decide(t, fns)
    decide(t, fns)
    assert t.choice == "ring"


def test_medians_and_an_untimed_first_call_keep_hiccups_out() -> None:
    clock = FakeClock()
    seen = []
    costs = {"direct": 1e-3, "ring": 2e-3}
    fns, _ = contenders(clock, costs)

    def slow() -> None:  # a preempted call, or the first after a switch
        clock.now += 50e-3

    t = Tuner("allgather", list(costs), lambda v: seen.append(v) or v, clock)
    for _ in range(window(2)):
        t.run([slow, slow])  # not timed
    for c in range(POOLED * 2 * TRIALS):  # runs of ring, direct, ring, direct: two slow calls
        t.run([slow, slow] if c % TRIALS < 2 else fns)  # in each, the first and the next
    assert TRIALS >= 4 and POOLED >= 2  # so two slow timed calls of six are outvoted
    assert seen[0].tolist() == pytest.approx([1e-3, 2e-3]) and t.choice == "direct"


def test_a_kind_of_call_made_a_few_times_is_left_to_the_model() -> None:
    for k in (2, 3, 4, 5):
        costs = {
            a: 1e-3 * (i + 1) for i, a in enumerate(("direct", "ring", "oneshot", "tree", "x")[:k])
        }
        t, _, fns, ran = tuner(costs)
        upto = decide(t, fns)
        assert upto == until_decided(k) and window(k) >= WINDOW
        challengers = sum(a != "direct" for a in ran)
        assert challengers == POOLED * TRIALS * (k - 1)
        assert challengers <= FIRST * upto  # their share of the calls up to the decision
        assert window(k) == WINDOW or challengers > FIRST * (upto - 1)  # and no later
        assert ran[: window(k)] == ["direct"] * window(k)


def test_the_function_over_the_contenders_keeps_the_schedule_of_run() -> None:
    costs = {"direct": 2e-3, "ring": 1e-3, "oneshot": 3e-3}
    a, _, fns_a, ran_a = tuner(costs)
    b, _, fns_b, ran_b = tuner(costs)
    tuned = b.over(fns_b)
    for i in range(3000):  # through several rounds and a change of choice
        if i == 1500:
            costs["direct"] = 0.5e-3
        a.run(fns_a)
        tuned()
    assert ran_a == ran_b and a.calls == b.calls and a.rounds == b.rounds > 3
    assert a.choice == b.choice == "direct" and "ring" in ran_a[:1500][-200:]


def test_a_tuner_needs_contenders() -> None:
    with pytest.raises(ValueError):
        Tuner("x", ["ring"], lambda v: v)


def test_which_collectives_are_tuned() -> None:
    for n in (2, 3, 4, 8):
        assert tunable("allgather", n) and tunable("broadcast", n)
        for c in ("allreduce", "reduce", "reduce_scatter"):
            assert tunable(c, n) == (n == 2)
            for dt in ("float16", "float32", "float64", ml_dtypes.bfloat16):
                assert tunable(c, n, np.dtype(dt)) == (n == 2)
            for dt in ("int8", "uint8", "int32", "uint32", "int64", "uint64"):
                assert tunable(c, n, np.dtype(dt))


def test_contenders_are_the_models_choice_then_those_close_to_it() -> None:
    avail = tuple(names("allreduce"))
    chunk = 1 << 20
    for nbytes in (8, 1 << 10, 512 << 10, 8 << 20, 64 << 20):
        for n in (2, 3, 4):
            got = cost.contenders("allreduce", avail, n, nbytes, chunk)
            assert got[0] == cost.choose("allreduce", avail, n, nbytes, chunk)
            assert len(set(got)) == len(got) and set(got) <= set(avail)
            t = [cost.estimate("allreduce", a, n, nbytes, chunk, capped=n > 2) for a in got]
            assert all(x <= cost.TUNE_SPAN * t[0] for x in t[1:])
    # 8 bytes: direct through the slots is far ahead of everything, nothing to time
    assert cost.contenders("allreduce", avail, 2, 8, chunk) == ("direct",)
    # between two ranks one-shot holds no scratch, so it contends above its cap
    assert "oneshot" in cost.contenders("allreduce", avail, 2, 2 << 20, chunk)
    assert "oneshot" not in cost.contenders("allreduce", avail, 3, 2 << 20, chunk)


def _special(rng: np.random.Generator, count: int, dtype: Any) -> np.ndarray:
    x = rng.standard_normal(count).astype(np.float32)
    x[rng.integers(0, count, max(1, count // 50))] = 0.0
    x[rng.integers(0, count, max(1, count // 50))] = -0.0
    x[rng.integers(0, count, max(1, count // 200))] = np.inf
    x[rng.integers(0, count, max(1, count // 200))] = np.nan
    return x.astype(dtype)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # inf * 0 and the like, on purpose
@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16, np.float64])
def test_between_two_ranks_every_algorithm_gives_the_same_bits(dtype: Any) -> None:
    """What makes the n = 2 reductions safe to tune: x0 OP x1, whichever algorithm,
    signed zeros, infinities and NaNs included."""
    count = 40_009  # prime: ragged segments and chunks
    with communicators(2) as comms:

        def body(r: int) -> dict[tuple[str, str, str], bytes]:
            c = comms[r]
            x = _special(np.random.default_rng(r), count, dtype)
            got = {}
            for op in ("sum", "prod", "min", "max", "avg"):
                for a in names("allreduce"):
                    got[("allreduce", op, a)] = c.allreduce(
                        x, np.empty_like(x), op=op, algorithm=a
                    ).tobytes()
                for a in names("reduce_scatter"):
                    xs = x[: count - count % 2]
                    o = np.empty(xs.size // 2, xs.dtype)
                    got[("reduce_scatter", op, a)] = c.reduce_scatter(
                        xs, o, op=op, algorithm=a
                    ).tobytes()
                for a in names("reduce"):
                    o = np.empty_like(x)
                    res = c.reduce(x, o, root=1, op=op, algorithm=a)
                    got[("reduce", op, a)] = b"" if res is None else res.tobytes()
            return got

        res = run_ranks(2, body)
    for rank_got in res:
        by: dict[tuple[str, str], set[bytes]] = {}
        for (what, op, _), b in rank_got.items():
            by.setdefault((what, op), set()).add(b)
        differ = [k for k, v in by.items() if len(v) > 1]
        assert not differ, f"algorithms differ bitwise at n = 2: {differ}"


@pytest.mark.parametrize("n", [3, 4])
@pytest.mark.parametrize("dtype", [np.int8, np.uint32, np.int64])
def test_integer_reductions_give_the_same_bits_whichever_algorithm(n: int, dtype: Any) -> None:
    """What makes integer reductions safe to tune at any n: sums and products
    wrap alike in any order (the inputs span the whole range, so they do wrap)."""
    count = 10_007
    info = np.iinfo(dtype)
    ops = {"sum": np.add, "prod": np.multiply, "min": np.minimum, "max": np.maximum}
    xs = [
        np.random.default_rng(r).integers(info.min, info.max, count, dtype, endpoint=True)
        for r in range(n)
    ]
    with communicators(n) as comms:

        def body(r: int) -> dict[tuple[str, str, str], np.ndarray]:
            c = comms[r]
            got = {}
            for op in ops:
                for a in names("allreduce"):
                    o = np.zeros_like(xs[r])
                    got[("allreduce", op, a)] = c.allreduce(xs[r], o, op=op, algorithm=a)
                for a in names("reduce"):
                    o = np.zeros_like(xs[r])
                    if c.reduce(xs[r], o, root=n - 1, op=op, algorithm=a) is not None:
                        got[("reduce", op, a)] = o
                m = count - count % n
                for a in names("reduce_scatter"):
                    o = np.zeros(m // n, xs[r].dtype)
                    c.reduce_scatter(xs[r][:m], o, op=op, algorithm=a)
                    got[("reduce_scatter", op, a)] = o
            return got

        res = run_ranks(n, body)
    m = count - count % n
    for op, f in ops.items():
        want = f.reduce(np.stack(xs), axis=0, dtype=dtype)
        for r, rank_got in enumerate(res):
            for (what, o, a), v in rank_got.items():
                if o != op:
                    continue
                w = want[r * (m // n) : (r + 1) * (m // n)] if what == "reduce_scatter" else want
                np.testing.assert_array_equal(v, w, err_msg=f"{what} {op} {a} rank {r}")


def _key_of(c: pycoll.Communicator, what: str) -> list[Any]:
    return [
        (k, t.names, t.calls, t.best)
        for k, t in c._policy.tuners.items()
        if t is not None and k[0] == what
    ]


@pytest.mark.parametrize("n", [2, 3])
def test_ranks_run_the_same_algorithm_at_every_call_blocking_or_not(n: int) -> None:
    """Blocking calls replay plans, asynchronous ones take the slow path: both
    count the same schedule, so the ranks never disagree, and every result is right."""
    with communicators(n) as comms:
        avail = comms[0]._policy.candidates("allgather")
        close = {
            b: len(cost.contenders("allgather", avail, n, b, comms[0].config.chunk_bytes))
            for b in (256 << 10, 1 << 20, 2 << 20, 4 << 20, 8 << 20)
        }
        block = next(b for b, m in close.items() if m > 1)
        k, calls = block // 4, until_decided(close[block]) + 8

        def body(r: int) -> list[Any]:
            c = comms[r]
            x = np.full(k, r, np.int32)
            g = np.full(n * k, -1, np.int32)
            want = np.repeat(np.arange(n, dtype=np.int32), k)
            for i in range(calls):
                x[:] = r + i
                g[:] = -1
                if i % 5 == 3:
                    c.allgather(x, g, async_op=True).wait()
                else:
                    c.allgather(x, g)
                np.testing.assert_array_equal(g, want + i)
            # the slow path keeps the function it runs each tuner's calls by
            assert list(c._policy.tuned) == [t for t in c._policy.tuners.values() if t is not None]
            return _key_of(c, "allgather")

        got = run_ranks(n, body)
    assert got[0] and all(g == got[0] for g in got), got
    ((_, names_, calls, _),) = got[0]
    assert len(names_) > 1 and all(calls), calls  # every contender ran


def test_reductions_between_two_ranks_switch_without_changing_results() -> None:
    with communicators(2) as comms:
        avail = comms[0]._policy.candidates("allreduce")
        nbytes = 2 << 20
        close = len(cost.contenders("allreduce", avail, 2, nbytes, comms[0].config.chunk_bytes))
        assert close > 1

        def body(r: int) -> tuple[list[Any], bytes]:
            c = comms[r]
            rng = np.random.default_rng(7)
            xs = [rng.standard_normal(nbytes // 4).astype(np.float32) for _ in range(2)]
            out = np.empty_like(xs[0])
            want = (xs[0] + xs[1]).tobytes()
            seen = set()
            for _ in range(until_decided(close) + 4):
                out[:] = np.nan
                c.allreduce(xs[r], out)
                seen.add(out.tobytes())
            assert seen == {want}
            return _key_of(c, "allreduce"), want

        got = run_ranks(2, body)
    assert got[0][0] == got[1][0] and got[0][0]


def test_at_three_ranks_integer_reductions_are_tuned_and_float_ones_not() -> None:
    n, nbytes = 3, 512 << 10
    with communicators(n) as comms:
        avail = comms[0]._policy.candidates("allreduce")
        close = len(cost.contenders("allreduce", avail, n, nbytes, comms[0].config.chunk_bytes))
        assert close > 1

        def body(r: int) -> list[Any]:
            c = comms[r]
            xs = [np.arange(nbytes // 4, dtype=np.int32) * (k + 1) for k in range(n)]
            want = sum(xs)
            out = np.empty_like(xs[0])
            for _ in range(until_decided(close) + 4):
                out[:] = -1
                c.allreduce(xs[r], out)
                np.testing.assert_array_equal(out, want)
            f = xs[r].astype(np.float32)
            c.allreduce(f, np.empty_like(f))
            return _key_of(c, "allreduce")

        got = run_ranks(n, body)
    assert all(g == got[0] for g in got)
    ((key, names_, calls, _),) = got[0]  # one tuner: int32's; float32's is None
    assert key[2] == np.int32 and len(names_) > 1 and all(calls)


def test_tuning_is_off_when_asked_or_when_an_algorithm_is_named() -> None:
    big = np.zeros(1 << 20, np.float32)
    for cfg, algo in (
        ({"tune": False}, "auto"),
        ({}, "ring"),
        ({"algo": {"allgather": "direct"}}, "auto"),
    ):
        with communicators(2, **cfg) as comms:

            def body(r: int, algo: str = algo) -> int:
                c = comms[r]
                for _ in range(3):
                    c.allgather(big, algorithm=algo)
                return sum(t is not None for t in c._policy.tuners.values())

            assert run_ranks(2, body) == [0, 0], (cfg, algo)


@pytest.mark.timeout(120)
def test_caches_stay_bounded_under_calls_of_random_sizes() -> None:
    """Every kind of call (size) once: auto's tuner cache and the fast path's
    caches keep at most their limits, and every result is right."""
    from pycoll import plans as cm
    from pycoll import policy

    n, kinds = 2, policy.TUNERS_MAX + 300
    sizes = np.random.default_rng(12).permutation(np.arange(1, kinds + 1))
    with communicators(n) as comms:

        def body(r: int) -> dict[str, int]:
            c = comms[r]
            for k in sizes:
                x = np.full(int(k), r + 1, np.int32)
                g = c.allgather(x)
                assert g.shape == (n, k) and (g == np.arange(1, n + 1)[:, None]).all()
            return {
                "tuners": len(c._policy.tuners),
                "tuned": len(c._policy.tuned),
                "plans": len(c._engine.plans.plans) + len(c._engine.plans.weak_plans),
                "steps": len(c._engine.plans.steps),
                "kinds": len(c._engine.plans.kinds),
            }

        got = run_ranks(n, body)
    for g in got:
        assert g["tuners"] <= policy.TUNERS_MAX and g["tuned"] <= policy.TUNERS_MAX, g
        assert g["plans"] <= cm.PLAN_MAX + cm.WEAK_PLAN_MAX, g
        assert g["steps"] <= cm.STEPS_MAX and g["kinds"] <= cm.KINDS_MAX, g


@pytest.mark.timeout(60)
def test_check_names_a_tuned_algorithm_rather_than_a_number() -> None:
    """PYCOLL_CHECK=1: where one rank names an algorithm and the other's ``auto``
    tunes, the mismatch names both, ``auto[...]`` with its contenders."""
    n = 2
    with communicators(n, check=True) as comms:
        avail = comms[0]._policy.candidates("allgather")
        chunk = comms[0].config.chunk_bytes
        block = next(
            b
            for b in (256 << 10, 1 << 20, 2 << 20, 4 << 20, 8 << 20)
            if len(cost.contenders("allgather", avail, n, b, chunk)) > 1
        )

        def body(r: int) -> str:
            x = np.zeros(block // 4, np.int32)
            try:
                comms[r].allgather(x, algorithm="ring" if r == 0 else "auto")
            except pycoll.CollectiveMismatchError as exc:
                return str(exc)
            return "no error"

        said = run_ranks(n, body)
    for msg in said:
        assert "ranks [0]: ring; ranks [1]: auto[" in msg, msg
