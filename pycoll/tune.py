"""``auto`` times its close contenders while it runs, and keeps the fastest.

The cost model (:mod:`pycoll.algorithms.cost`) picks well where algorithms are
far apart.  Where they are close, which one wins depends on more than a model
holds: how the host's scheduler places the ranks' threads, whether the pages
are huge, what else runs: on the 2-core machine the same allreduce of 2 MiB at
n = 2 took 270-300 us with ``direct`` in some runs and 775 in others.
No fixed choice is within 10% of the best in both.

So a :class:`Tuner` runs the model's choice (the *incumbent*) for
:func:`window` calls, then each other contender :data:`TRIALS` times in a row
and the incumbent again as many (a *round*), and the ranks agree on the
fastest.  A rank times a call from the return of the one before it to its own
return, so what an algorithm leaves to pay after it returns counts as its own
(the caller's work between calls counts too, alike for every contender).
Each rank's figure for a contender is the median of these times in the last
:data:`POOLED` rounds, but for the first call of each run (the first decision
waits for that many rounds, run back to back); the figures are summed over the
ranks by a small allreduce, and the least sum wins (a challenger must beat the
incumbent by :data:`MARGIN`; the model's choice, once replaced, takes back over
by being the fastest at all).  The next round comes when the incumbent's calls
since will have taken 1/:data:`BUDGET` times as long as the round's challengers
took (so trying the others costs at most that fraction of the time), and at
least twice as late as the last one while the incumbent stays; from
:data:`PERIOD_MIN` calls up to :data:`PERIOD_MAX`.  The first round waits
until the challengers' calls of the first decision would be at most
:data:`FIRST` of the calls up to it: a kind of call that is made a few times
only is left to the model (the contenders are those it models within 2x of its
choice, so that share bounds what they can cost).

Why so: a call here takes 50-200 us with two ranks on two cores, give or take
half, so one or two calls say little, a call's time holds the wait its
predecessor left behind, and three calls in a row share a spell of the
machine; each of the rules above answers one of these (benchmarks/RESULTS.md, "The measurements behind the constants").

The schedule counts calls of one collective, size, dtype, op and root, which
every rank makes in the same order, so all ranks run the same algorithm at
every call without a word; the one exchange is the sum at the end of a round,
and its result is the same bits on every rank.

Only collectives whose result cannot depend on the algorithm are tuned:
allgather, broadcast and alltoall (they move bytes and compute nothing), the reductions
between two ranks (one operation on two operands: every algorithm computes
``x0 OP x1``), and the reductions of integers and bools at any n (sums and
products wrap modulo 2**bits, which any order gives alike, and min, max and
the bitwise ops are exact; neither has ``avg``).  Elsewhere algorithms add
floats (and complex numbers) in different orders,
and a training job would see its sums change in the last bits when ``auto``
switched.
``PYCOLL_TUNE=0`` turns tuning off: ``auto`` is then the model's choice alone.
"""

from __future__ import annotations

import logging
import math
import statistics
from collections.abc import Callable, Sequence
from time import perf_counter
from typing import Any

import numpy as np

from pycoll.config import TRACE

log = logging.getLogger(__name__)

#: Calls of the model's choice before the first round: at least ...
WINDOW = 8
#: ... and enough that the first decision's challenger calls are at most this
#: share of the calls up to it.
FIRST = 0.25
#: Calls of each contender in a round, in a row (the first is not timed).
TRIALS = 4
#: The time trying challengers may take, as a fraction of the incumbent's.
BUDGET = 0.03
#: Calls of the incumbent alone between rounds: at least (and at least WINDOW) ...
PERIOD_MIN = 16
#: ... and at most.
PERIOD_MAX = 1024
#: A challenger wins if its summed time is below (1 - MARGIN) of the incumbent's;
#: the model's choice needs no margin to come back, since what made it lose may
#: have been a spell of the machine (benchmarks/RESULTS.md, "The measurements behind the constants").
MARGIN = 0.05
#: Rounds whose timings a decision takes (the latest and those before it).
POOLED = 2

#: Collectives whose results are the same bits whichever algorithm runs.
MOVES_ONLY = ("allgather", "broadcast", "alltoall")
#: ... and these, between two ranks.
REDUCES = ("allreduce", "reduce", "reduce_scatter")


def window(contenders: int) -> int:
    """Calls of the model's choice before the first round, among ``contenders``
    algorithms: a kind of call shows it repeats before ``auto`` spends on it."""
    rounds = POOLED * TRIALS * contenders  # calls up to the first decision, past the window
    challengers = POOLED * TRIALS * (contenders - 1)
    return max(WINDOW, math.ceil(challengers / FIRST) - rounds)


def tunable(collective: str, n: int, dtype: np.dtype[Any] | None = None) -> bool:
    """Whether every algorithm of ``collective`` at ``n`` ranks gives the same
    bits (on ``dtype``, where it matters)."""
    if collective in MOVES_ONLY:
        return True
    return collective in REDUCES and (n == 2 or (dtype is not None and dtype.kind in "iub"))


class Tuner:
    """The online choice among ``names`` for one kind of call (see the module).

    Args:
        label: what the calls are, for the log (``"allgather 8 MiB float32"``).
        names: the contenders, the model's choice first (the first incumbent).
        agree: sums a float64 vector over the ranks (a collective; every rank
            calls it at the same call of the schedule and gets the same bits).
        clock: seconds, for the timings.
    """

    __slots__ = (
        "_agree",
        "_clock",
        "_last",
        "best",
        "calls",
        "history",
        "label",
        "left",
        "names",
        "period",
        "pos",
        "rounds",
        "schedule",
        "trials",
    )

    def __init__(
        self,
        label: str,
        names: Sequence[str],
        agree: Callable[[np.ndarray], np.ndarray],
        clock: Callable[[], float] = perf_counter,
    ) -> None:
        if len(names) < 2:
            raise ValueError("a tuner needs two contenders or more")
        self.label = label
        self.names = tuple(names)
        self._agree = agree
        self._clock = clock
        self._last = 0.0  # when the last call of the round returned
        self.best = 0
        self.left = window(len(self.names))  # calls of the incumbent alone before the next round
        self.period = PERIOD_MIN // 2  # doubled by a first round that keeps the model's choice
        self.schedule: tuple[int, ...] = ()  # this round's calls
        self.pos = 0
        self.trials: list[list[float]] = [[] for _ in self.names]
        self.history: list[list[list[float]]] = []  # the trials of the last rounds
        self.calls = [0] * len(self.names)  # calls run per contender, for the record
        self.rounds = 0

    @property
    def choice(self) -> str:
        """The algorithm the calls between rounds run."""
        return self.names[self.best]

    def over(self, fns: Sequence[Callable[..., None]]) -> Callable[..., None]:
        """A function that runs one call of ``fns[i](*args)`` by the schedule;
        ``fns`` holds one function per contender, in the order of ``names``."""
        fns = tuple(fns)
        run = self.run

        def tuned(*args: Any) -> None:
            # the calls between rounds, inline: on the 2-core machine the extra
            # call into run() cost 5% of a 128 KiB reduce-scatter at n = 2
            if self.left:
                self.left -= 1
                b = self.best
                self.calls[b] += 1
                fns[b](*args)
            else:
                run(fns, *args)

        return tuned

    def run(self, fns: Sequence[Callable[..., None]], *args: Any) -> None:
        """One call: ``fns[i](*args)`` for the contender the schedule names."""
        if self.left:
            self.left -= 1
            self.calls[self.best] += 1
            fns[self.best](*args)
            return
        if not self.schedule:  # the challengers, then the incumbent
            b = self.best
            order = [i for i in range(len(self.names)) if i != b] + [b]
            self.schedule = tuple(i for i in order for _ in range(TRIALS))
        i = self.schedule[self.pos]
        self.calls[i] += 1
        fns[i](*args)
        now = self._clock()
        if self.pos % TRIALS:  # the first of a run pays for the switch
            self.trials[i].append(now - self._last)
        self._last = now
        self.pos += 1
        if self.pos == len(self.schedule):
            self._decide()

    def _decide(self) -> None:
        self.history = [*self.history, self.trials][-POOLED:]
        self.trials = [[] for _ in self.names]
        self.schedule, self.pos = (), 0
        if len(self.history) < POOLED:  # the first decision: another round at once
            return
        mine = [
            statistics.median(t for h in self.history for t in h[i]) for i in range(len(self.names))
        ]
        total = self._agree(np.array(mine, np.float64))
        was = self.best
        win = int(np.argmin(total))
        # names[0], the model's choice, needs no margin (see MARGIN)
        if win and not total[win] < (1 - MARGIN) * total[was]:
            win = was
        self.rounds += 1
        # what a round costs in calls of the winner (the same figures on every rank)
        cost = TRIALS * sum(t for i, t in enumerate(total) if i != win) / total[win]
        period = max(PERIOD_MIN, math.ceil(cost / BUDGET))
        if win == was:
            period = max(period, 2 * self.period)
        else:
            self.best = win
        self.period = self.left = min(period, PERIOD_MAX)
        level = logging.INFO if self.rounds == 1 or win != was else TRACE
        if log.isEnabledFor(level):
            said = ", ".join(
                f"{a} {t * 1e6:.0f} us" for a, t in zip(self.names, total, strict=True)
            )
            how = "stays" if win == was else f"replaces {self.names[was]}"
            log.log(
                level,
                "tune %s: %s (medians, summed over ranks): %s %s; next look in %d calls",
                self.label,
                said,
                self.names[win],
                how,
                self.period,
            )
