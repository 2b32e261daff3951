"""The ``auto`` policy: a latency/bandwidth (alpha-beta-gamma) cost model.

For each algorithm the model counts sequential steps (each costs ``alpha``),
bytes on the busiest link (``beta`` per byte) and bytes reduced (``gamma`` per
byte), and ``auto`` takes the cheapest.  The constants are per transport kind
and come from measurements on the machine in ``benchmarks/RESULTS.md``
(``benchmarks/fit_cost.py`` refits them from a sweep's JSON).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

from pycoll.config import GROUP_SLOT_BYTES


@dataclass(frozen=True)
class Constants:
    alpha: float  # seconds per sequential step
    beta: float  # seconds per byte on a link
    gamma: float  # seconds per byte reduced


#: one-shot allreduce sends (n-1) N bytes a rank; never above this size.
ONESHOT_MAX_BYTES = 64 << 10

#: Fitted from benchmarks/results (see RESULTS.md); shm on the 2-core CI machine.
DEFAULT = Constants(alpha=5.52e-05, beta=1 / 9.77e9, gamma=1 / 2.3e9)

#: A step of a ``direct`` algorithm, in units of ``alpha``: one store and one wait on
#: shared memory, where the others' step is a message through a transport.  Measured
#: on the 2-core machine (8 B, n = 2..4), direct took 0.2-0.4 of one-shot's time.
DIRECT_STEP = 0.25
#: Up to a slot a direct algorithm goes through the group's slots (one step);
#: above it, by address (two or three steps).  The group's default slot size
#: (PYCOLL_GROUP_SLOT_BYTES sets it; the policy passes the configured one).
DIRECT_SLOT_BYTES = GROUP_SLOT_BYTES
#: By address, allgather's writers all copy into every peer at once; from blocks
#: of this size up the ring's pipelined copies may win, below it direct does: its
#: bytes then count DIRECT_ALLGATHER_BYTES times.  With 32 MiB blocks the ring
#: took 1.03-1.05x direct's time at n = 2 (benchmarks/RESULTS.md, "The measurements behind the constants").
DIRECT_ALLGATHER_BIG = 32 << 20
DIRECT_ALLGATHER_BYTES = 1.25
#: allgather blocks of up to this many slots go through the slots in rounds, not
#: by address: 71-76 against 86-87 us at n = 2 with 512 KiB blocks on the 2-core
#: machine (benchmarks/RESULTS.md, "The measurements behind the constants").
ALLGATHER_SLOT_ROUNDS = 3

#: alltoall goes by address (each rank's cross-memory reads out of its peers'
#: inputs) from this many bytes, and above one slot; below, through the slots
#: (two memcpys a block).  NumPy puts arrays from 4 MiB on huge pages, where a
#: cross-memory copy costs 2.6-3.5x less than on the 4 KiB pages below that; on
#: the 2-core VM at 1-2 MiB, MPI's time over pycoll's went from 0.58-0.80 by
#: address to 0.66-1.10 through the slots at n = 2, 0.70-0.76 to 0.85-1.02 at
#: n = 4, and stayed within the noise at n = 3 (benchmarks/RESULTS.md, "Where
#: alltoall's time goes").
ALLTOALL_BY_ADDRESS_MIN = 4 << 20

#: Between those sizes and one slot, ``direct`` goes through the slots and
#: ``cma`` (the same algorithms) by address.  Which is faster changes with the
#: machine's state: at n = 2 on the 2-core VM, a 1 MiB allgather took 71-76 us
#: through the slots against 86-87 by address one day, and 116 against 65 on
#: another; a 1 MiB alltoall 51 against 86, then 143 against 86.  So ``auto``
#: times the two there (:mod:`pycoll.tune`: ``cma`` is modelled at this factor of
#: ``direct``'s time, within the tuner's span) and keeps the faster.
CMA_CONTENDS = 1.01

#: Through the slots, allreduce at n >= 3 splits from this many bytes up, unless
#: ranks outnumber cores: each rank reduces its segment of everyone's
#: contribution and copies the others' finished segments (two steps, about 3 N
#: bytes read a rank) instead of reducing everything (one step, n N read and
#: (n - 1) N reduced).  With fewer cores than ranks the second step's wait costs
#: more than the bytes saved (2-core machine, n = 3 and 4, 8-256 KiB: one step
#: was 1.0-4x faster).
DIRECT_SPLIT_BYTES = 32 << 10


def split_allreduce(n: int, nbytes: int, crowded: bool) -> bool:
    """Whether a slot allreduce of ``nbytes`` a round at ``n`` ranks splits the work."""
    return n >= 3 and nbytes >= DIRECT_SPLIT_BYTES and not crowded


def estimate(
    collective: str,
    algorithm: str,
    n: int,
    nbytes: int,
    chunk: int,
    k: Constants = DEFAULT,
    capped: bool = True,
    slot: int = DIRECT_SLOT_BYTES,
) -> float:
    """Modelled seconds for one call; ``nbytes`` is the per-rank input size;
    ``capped``: one-shot costs infinity above :data:`ONESHOT_MAX_BYTES` (what
    ``auto`` picks by); ``slot``: the group segment's slot size."""
    if n <= 1:
        return 0.0
    lg = math.ceil(math.log2(n))
    slices = max(1, math.ceil(nbytes / (chunk * n)))
    chunks = max(1, math.ceil(nbytes / chunk))
    f = (n - 1) / n
    if algorithm == "direct":
        return _direct(collective, n, nbytes, k, slot)
    if algorithm == "cma":  # direct's other route, only where the two differ
        if _routes_differ(collective, nbytes, slot):
            return CMA_CONTENDS * _direct(collective, n, nbytes, k, slot)
        return math.inf
    if collective == "allreduce":
        if algorithm == "oneshot":
            if capped and nbytes > ONESHOT_MAX_BYTES:
                return math.inf
            return (1 + 0.25 * (n - 2)) * k.alpha + (n - 1) * nbytes * (k.beta + k.gamma)
        if algorithm == "ring":
            return 2 * (n - 1) * slices * k.alpha + 2 * f * nbytes * k.beta + f * nbytes * k.gamma
        if algorithm == "tree":
            half = max(1, math.ceil(chunks / 2))
            return (2 * lg + half) * k.alpha + 2 * nbytes * k.beta + nbytes * k.gamma
    if collective == "allgather":
        if algorithm == "ring":
            return (n - 1) * k.alpha + f * n * nbytes * k.beta
        if algorithm == "tree":
            return 2 * lg * k.alpha + 2 * n * nbytes * k.beta
    if collective == "reduce_scatter":
        # a ring step hands partial sums through scratch buffers: measured ~1.25 steps
        if algorithm == "ring":
            return 1.25 * (n - 1) * k.alpha + f * nbytes * (k.beta + k.gamma)
        if algorithm == "tree":
            return (lg + 1) * k.alpha + 2 * nbytes * k.beta + nbytes * k.gamma
    if collective == "broadcast":
        # a tree node forwards each chunk to two children, one after the other
        if algorithm == "ring":
            return (n - 1 + chunks) * k.alpha + nbytes * k.beta
        if algorithm == "tree":
            return (2 * lg + chunks) * k.alpha + 2 * nbytes * k.beta
    if collective in ("alltoall", "alltoallv") and algorithm == "pairwise":
        return (n - 1) * k.alpha + f * nbytes * k.beta
    if collective in ("gather", "scatter"):  # nbytes: one rank's block
        if algorithm == "linear":  # one step; the root's posts each cost a little
            return (1 + 0.25 * (n - 2)) * k.alpha + (n - 1) * nbytes * k.beta
        if algorithm == "tree":  # forwarded blocks are copied again on the way
            return lg * k.alpha + 1.5 * (n - 1) * nbytes * k.beta
    if collective == "reduce":
        # ring: reduce-scatter (scratch hand-offs) and then a gather that waits on every
        # block; measured at n = 2..4 it pays about two steps per slice more
        if algorithm == "ring":
            return (
                (2 * (n - 1) * slices + 2) * k.alpha
                + (f + 1 / n) * nbytes * k.beta
                + (f * nbytes * k.gamma)
            )
        if algorithm == "tree":
            fan = min(2, n - 1)  # bytes a node receives and reduces, per input byte
            return (lg + chunks) * k.alpha + fan * nbytes * (k.beta + k.gamma)
    return math.inf


def _routes_differ(collective: str, nbytes: int, slot: int) -> bool:
    """Whether ``direct`` goes through the slots where ``cma`` goes by address."""
    if collective == "allgather":  # nbytes: one rank's block
        return slot < nbytes <= ALLGATHER_SLOT_ROUNDS * slot
    if collective == "alltoall":  # nbytes: one rank's whole input
        return slot < nbytes < ALLTOALL_BY_ADDRESS_MIN
    return False


def _direct(collective: str, n: int, nbytes: int, k: Constants, slot: int) -> float:
    """Direct algorithms (ranks on one host): every rank copies from (or to) every other.

    Through the slots: one step, the input copied in once, and each reader
    copies (or reduces) every contribution it needs.  By address: a step to
    post, the reads, and a closing step (so no buffer is reused while read).
    """
    f = (n - 1) / n
    a = DIRECT_STEP * k.alpha
    small = nbytes <= slot
    # Crowded, mid-sized allreduces and reduces go through the slots in rounds
    # (direct.ROUNDS_CROWDED_*), measured faster than by address; they are
    # modelled as by address all the same: with these constants, fitted where
    # reductions run from memory, the rounds' (n - 1) N bytes reduced, which
    # stay in cache, would be modelled slower than they run.
    if collective == "allreduce":
        if small:  # one step (split, it is two steps and fewer bytes: no worse)
            return a + nbytes * k.beta + (n - 1) * nbytes * k.gamma
        return 3 * a + 2 * f * nbytes * k.beta + f * nbytes * k.gamma
    if collective == "reduce":
        if small:
            return a + nbytes * k.beta + (n - 1) * nbytes * k.gamma
        return 3 * a + 2 * f * nbytes * k.beta + f * nbytes * k.gamma
    if collective == "alltoall":  # nbytes: one rank's whole input
        if small:  # copied into the slot, then each block out of the peers'
            return a + 2 * nbytes * k.beta
        return 2 * a + f * nbytes * k.beta
    if collective == "allgather":  # nbytes: one rank's block
        if small:
            return a + n * nbytes * k.beta
        w = DIRECT_ALLGATHER_BYTES if nbytes >= DIRECT_ALLGATHER_BIG else 1.0
        return 2 * a + w * (n - 1) * nbytes * k.beta
    if collective == "broadcast":
        return (1 if small else 2) * a + (2 if small else 1) * nbytes * k.beta
    if collective == "reduce_scatter":  # nbytes: one rank's whole input
        if small:
            return a + nbytes * k.beta + f * nbytes * k.gamma
        return 2 * a + f * nbytes * (k.beta + k.gamma)
    if collective == "gather":  # nbytes: one rank's block
        if small:  # the root copies the others' blocks out of their slots
            return a + (n - 1) * nbytes * k.beta
        return 2 * a + nbytes * k.beta  # each writes its own into the root's output
    if collective == "scatter":  # the root copies the others' blocks in, each its own out
        if (n - 1) * nbytes <= slot:  # one round of the slots, else by address
            return a + n * nbytes * k.beta
        return 2 * a + nbytes * k.beta
    return math.inf


@functools.lru_cache(maxsize=4096)
def choose(
    collective: str,
    candidates: tuple[str, ...],
    n: int,
    nbytes: int,
    chunk: int,
    slot: int = DIRECT_SLOT_BYTES,
) -> str:
    """The cheapest of ``candidates`` by the model (ties go to the first); cached."""
    return min(candidates, key=lambda a: estimate(collective, a, n, nbytes, chunk, slot=slot))


#: The model's runners-up that ``auto`` times while it runs (:mod:`pycoll.tune`):
#: those modelled within this factor of its choice.  Where the model erred on
#: the 2-core machine, the faster algorithm was modelled up to 1.9x slower
#: (benchmarks/RESULTS.md, "The measurements behind the constants").
TUNE_SPAN = 2.0


@functools.lru_cache(maxsize=4096)
def contenders(
    collective: str,
    candidates: tuple[str, ...],
    n: int,
    nbytes: int,
    chunk: int,
    slot: int = DIRECT_SLOT_BYTES,
) -> tuple[str, ...]:
    """The model's choice, then the other ``candidates`` modelled within
    :data:`TUNE_SPAN` of it, cheapest first.  One-shot counts uncapped at n = 2,
    where it needs no scratch (its cap is for the n - 1 rows it holds above)."""
    best = choose(collective, candidates, n, nbytes, chunk, slot)
    t = {a: estimate(collective, a, n, nbytes, chunk, capped=n > 2, slot=slot) for a in candidates}
    limit = TUNE_SPAN * t[best]
    rest = sorted((a for a in candidates if a != best and t[a] <= limit), key=t.__getitem__)
    return (best, *rest)
