"""Direct algorithms: every rank copies straight from (or to) every other.

For ranks that all share one host: they use the communicator's shared
:class:`~pycoll.algorithms.links.Group` instead of point-to-point connections.
Each collective is one or two *steps*; in a step every rank publishes its
contribution and the readers wait only for the ranks they read from.

Small messages (the contribution fits a slot) go through the slots: a rank
copies its contribution into its slot and publishes the step; readers reduce or
copy straight out of the peers' slots.  One step, one copy in, whatever n.  Each
rank has K slots (``G.slots``) and W posted words (``G.words``, 8 K), step ``s``
uses slot ``s % K`` and word ``s % W``; a step of at most ``G.sub_bytes`` a rank
(a slot's W / K-th part) fills a part of its slot of its own, so a rank may run
W such steps ahead of the slowest peer before it waits, K of larger ones.
Larger ones, when the group allows cross-memory copies, go by address: a rank
posts where its buffer is and the peers copy out of it (``read``) or into it
(``write``) with one kernel copy each; the collective ends when every peer said
it is done, so no buffer is returned to its owner while a peer still uses it.
Where there is a choice, a rank writes its part into the peers' outputs rather
than have them read it: the kernel pins the other process's pages, and outputs
are the likelier to be on huge pages (see :func:`allgather`).  Without
cross-memory copies, larger messages go through the slots in rounds of a slot
each (an allgather writes up to ``G.ahead`` rounds before it reads any); so do
mid-sized allreduces and reduces where ranks outnumber cores
(``ROUNDS_CROWDED_*``).

Every step is taken with the call's fingerprint (``L.fp``, or ``fp`` of
:func:`prepare`), which the group folds into the word a rank posts; a reader
waits for the word its own step has, so ranks that run different calls raise
instead of reading each other's slots (:mod:`pycoll.algorithms.links`' Group).

Reductions combine the contributions in rank order, ``((x0 OP x1) OP x2) ...``,
and every element is reduced by one rank only (or by every rank identically), so
all ranks hold the same bits.

allreduce: slots: everyone reduces every contribution.  By address: rank r
    reduces segment r of every rank's input into its output (a reduce-scatter),
    then writes it into every peer's output (an allgather).  Per rank (n-1)/n N
    read and reduced, (n-1)/n N written.
allgather: slots: rank r copies every peer's block out of the slots.  By
    address: rank r writes its block into every peer's output; (n-1) k.
broadcast: every non-root reads the root's buffer; N read.
reduce_scatter: rank r reads block r of every peer's input and reduces; (n-1) k.
reduce: a reduce-scatter into segments, then every rank writes its segment
    into the root's output.
alltoall: slots: every rank's slot holds a piece of each of its blocks, and
    rank r copies piece r out of every peer's.  By address: rank r writes its
    block j into rank j's output; (n-1) k.
barrier: every rank publishes a step and waits for everyone's.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from pycoll.algorithms.cost import ALLGATHER_SLOT_ROUNDS, ALLTOALL_BY_ADDRESS_MIN, split_allreduce
from pycoll.algorithms.links import Group, Links
from pycoll.algorithms.registry import register
from pycoll.algorithms.ring import segments
from pycoll.buffers import (
    STREAM_COPY_BYTES,
    copy_flat,
    copy_into,
    data_ptr,
    own_block,
    own_placed,
    place_own,
    place_root,
    root_placed,
)
from pycoll.reduce import reduce_rows
from transports.base import Backoff

compiled: Any
try:  # the compiled step (pycoll/_step.c), built by pip install where a C compiler is
    from pycoll import _step as compiled  # found; without it the prepared steps stay in Python
except ImportError:  # pragma: no cover - an install without a compiler
    compiled = None

#: Peers' bytes are reduced in pieces of this size (they stay in cache).
PIECE_BYTES = 256 << 10
#: An allgather by address copies its own block and writes it to the peers in
#: pieces of this size, each read from memory once for all of them: 16 MiB at
#: n = 2 on the 2-core Intel VM took 1084-1100 us against 1218-1241 as one copy
#: and one write a peer (benchmarks/RESULTS.md, "The allgather's own block in
#: the same pass, again").
OWN_PIECE_BYTES = 256 << 10


#: The algorithms that run over the group segment, so need every rank on one
#: host sharing memory (``cma``: the other route of ``direct``'s protocol).
GROUP_ALGORITHMS = ("direct", "cma")


def _group(L: Links) -> Group:
    G = L.group
    assert G is not None, "direct algorithms need a shared group (the communicator checks)"
    return G


def _addr(a: Any) -> int:
    return data_ptr(a)


def _others(n: int, r: int) -> list[int]:
    """Every rank but r, starting after it (so that readers spread over sources)."""
    return [(r + d) % n for d in range(1, n)]


def _by_address(G: Group, nbytes: int) -> bool:
    return G.cma and nbytes > G.slot_bytes


#: Where ranks outnumber cores, an allreduce goes through the slots in rounds,
#: not by address, while each rank's rounds reduce at most this many bytes
#: ((n - 1) N: every rank reduces every contribution) ...
ROUNDS_CROWDED_ALLREDUCE = 2 << 20
#: ... and a reduce, where the root alone reduces, up to this many.  By address
#: takes three steps that each wait for every rank, and a wait for a rank that
#: is off its core costs a time slice; a round is one step, and a rank may run
#: K of them ahead: a crowded reduce of 512 KiB at n = 4 took 172-211 us by
#: address against 756-801 in rounds (benchmarks/RESULTS.md, "The measurements behind the constants").
ROUNDS_CROWDED_REDUCE = 4 << 20


#: A broadcast larger than this goes by address where ranks have a core each
#: (where they outnumber the cores, from a slot up): through a slot the root's
#: copy in and the readers' copies out follow each other, by address the root
#: and the readers copy at once, after a longer handshake.  At n = 2 on the
#: 2-core machine, through a slot against by address (compiled): 24 KiB 2.4
#: against 5.4 us, 64 KiB 4.7-6.0 against 6.3, 96 KiB 8.1 against 6.6-7.0,
#: 128 KiB 12.3 against 7.0 (benchmarks/RESULTS.md, "The broadcast by address
#: without the GIL").
BROADCAST_BY_ADDRESS_MIN = 64 << 10


def _reduces_by_address(L: Links, G: Group, nbytes: int, crowded_limit: int) -> bool:
    """Whether a reduction of ``nbytes`` a rank goes by address (see above)."""
    if not _by_address(G, nbytes):
        return False
    return not (L.crowded and (L.size - 1) * nbytes <= crowded_limit)


def _step(L: Links, G: Group) -> int:
    """The next step, of the call whose fingerprint ``L.fp`` holds (see
    :class:`~pycoll.algorithms.links.Group`: a peer that runs another call waits
    for another posted word, and raises)."""
    return G.step(L.fp)


def _post_buffer(L: Links, G: Group, a: Any) -> int:
    """Take the next step, claim it (it fills no slot) and post where ``a`` lies
    for the peers to read (or write); ``a`` None: the word alone."""
    s = _step(L, G)
    G.claim(s, L.deadline, L.backoff, small=True)
    if a is None:
        G.post(s)
    else:
        G.post(s, _addr(a), a.nbytes)
    return s


def _scatter_order(n: int, root: int) -> list[int]:
    """The ranks whose blocks a scatter's root writes into its slot, in order."""
    return [j for j in range(n) if j != root]


# ------------------------------------------------------------------ by slots
def _rounds(L: Links, G: Group, dtype: Any, total: int, per_round: int, width: int = 1) -> Any:
    """The slot rounds of a message of ``total`` elements, ``per_round`` a round:
    ``(lo, hi, s, views, small)`` with the step ``s`` taken, ``views[j]`` rank j's
    slot for it, ``width * (hi - lo)`` elements long, and whether the step is
    small (the message is: one round of at most ``G.sub_bytes`` a rank; the
    same on every rank, and as :func:`prepare`'s steps decide it)."""
    small = G.small(width * total * np.dtype(dtype).itemsize)
    for lo in range(0, total, per_round):
        hi = min(lo + per_round, total)
        s = _step(L, G)
        yield lo, hi, s, G.views(dtype, width * (hi - lo), small)[s % G.words], small


def _slot_reduce(L: Links, G: Group, x: Any, out: Any, root: int | None) -> None:
    """``out = x0 OP x1 OP ...`` through the slots, on every rank (root None) or the root."""
    n, r = L.size, L.rank
    f = L.reduce
    assert f is not None
    dl, bo = L.deadline, L.backoff
    others = _others(n, r)
    per_round = max(1, G.slot_bytes // x.itemsize)
    if root is None and split_allreduce(n, min(x.size, per_round) * x.itemsize, L.crowded):
        _slot_allreduce_split(L, G, x, out, per_round)
        return
    for lo, hi, s, v, small in _rounds(L, G, x.dtype, x.size, per_round):
        G.claim(s, dl, bo, small)
        copy_flat(v[r], x[lo:hi])
        G.post(s)
        if root is None or r == root:
            G.wait(others, s, dl, bo)
            reduce_rows(f, v, out[lo:hi])
        G.done(s)


def _slot_allreduce_split(L: Links, G: Group, x: Any, out: Any, per_round: int) -> None:
    """Allreduce through the slots in two steps a round: every rank posts its
    contribution, reduces its own segment of everyone's, posts that, and copies
    the others' finished segments (see :func:`split_allreduce`)."""
    n, r = L.size, L.rank
    f = L.reduce
    assert f is not None
    dl, bo = L.deadline, L.backoff
    others = _others(n, r)
    for lo, hi, s, v, small in _rounds(L, G, x.dtype, x.size, per_round):
        b = segments(0, hi - lo, n)
        G.claim(s, dl, bo, small)
        copy_flat(v[r], x[lo:hi])
        G.post(s)
        G.wait(others, s, dl, bo)
        seg = slice(b[r], b[r + 1])
        acc = out[lo + b[r] : lo + b[r + 1]]
        reduce_rows(f, [row[seg] for row in v], acc)
        G.done(s)
        t = _step(L, G)
        G.claim(t, dl, bo, small)
        w = G.views(x.dtype, hi - lo, small)[t % G.words]
        w[r][seg] = acc
        G.post(t)
        G.wait(others, t, dl, bo)
        for j in others:
            out[lo + b[j] : lo + b[j + 1]] = w[j][b[j] : b[j + 1]]
        G.done(t)


def _slot_elements(G: Group, dtype: Any) -> int:
    """The elements of ``dtype`` a round of a slot carries."""
    return max(1, G.slot_bytes // dtype.itemsize)


def _compiled_rounds(L: Links, G: Group, count: int) -> bool:
    """Whether :func:`allgather` of ``count`` elements a rank goes through the
    slots in rounds that one compiled step can take: all of them posted before
    any is read (at most ``G.ahead``, and the 8 a step holds)."""
    if compiled is None or (
        G.cma and count * L.dtype.itemsize > ALLGATHER_SLOT_ROUNDS * G.slot_bytes
    ):
        return False
    return -(-count // _slot_elements(G, L.dtype)) <= min(G.ahead, COMPILED_ROUNDS)


def _slot_allgather(L: Links, G: Group, x: Any, out: Any) -> None:
    """Round by round; when there are at most ``G.ahead`` rounds, every round is
    written and posted before any is read: a rank that shares its core then
    does its part in one go, instead of waiting for its peers once a round."""
    n, r = L.size, L.rank
    dl, bo = L.deadline, L.backoff
    others = _others(n, r)
    k = x.size
    per_round = _slot_elements(G, x.dtype)
    ahead = -(-k // per_round) <= G.ahead
    unread: list[Any] = []

    def read() -> None:
        for lo, hi, s, v, _ in unread:
            for j in others:
                G.wait((j,), s, dl, bo)
                copy_flat(out[j * k + lo : j * k + hi], v[j])
            G.done(s)
        unread.clear()

    for rnd in _rounds(L, G, x.dtype, k, per_round):
        lo, hi, s, v, small = rnd
        G.claim(s, dl, bo, small)
        copy_flat(v[r], x[lo:hi])
        G.post(s, consumed=not unread)  # with no round unread, step s - 1 is consumed
        unread.append(rnd)
        if not ahead:
            read()
    read()


def _slot_broadcast(L: Links, G: Group, buf: Any, root: int) -> None:
    r = L.rank
    dl, bo = L.deadline, L.backoff
    per_round = max(1, G.slot_bytes // buf.itemsize)
    for lo, hi, s, v, small in _rounds(L, G, buf.dtype, buf.size, per_round):
        if r == root:
            G.claim(s, dl, bo, small)
            copy_flat(v[r], buf[lo:hi])
            G.post(s)
            G.done(s)  # (it reads nothing; see broadcast)
        else:
            G.wait((root,), s, dl, bo)
            copy_flat(buf[lo:hi], v[root])
            G.done(s)


def _slot_reduce_scatter(L: Links, G: Group, x: Any, out: Any) -> None:
    """Round by round: each rank's slot holds the same piece of every block."""
    n, r = L.size, L.rank
    f = L.reduce
    assert f is not None
    dl, bo = L.deadline, L.backoff
    others = _others(n, r)
    k = out.size
    for lo, hi, s, v, small in _rounds(
        L, G, x.dtype, k, max(1, G.slot_bytes // x.itemsize // n), n
    ):
        c = hi - lo
        G.claim(s, dl, bo, small)
        mine = v[r]
        if c == k:
            copy_flat(mine, x)
        else:
            for b in range(n):
                copy_flat(mine[b * c : (b + 1) * c], x[b * k + lo : b * k + hi])
        G.post(s)
        G.wait(others, s, dl, bo)
        blk = slice(r * c, (r + 1) * c)
        reduce_rows(f, [row[blk] for row in v], out[lo:hi])
        G.done(s)


# ------------------------------------------------------------------ by address
def _reduce_range(L: Links, G: Group, s: int, x: Any, lo: int, hi: int, acc: Any) -> None:
    """``acc = x0[lo:hi] OP x1[lo:hi] OP ...``, every rank's x posted for step ``s``.

    ``acc`` may be this rank's own ``x[lo:hi]`` (in place).
    """
    n, r = L.size, L.rank
    f = L.reduce
    assert f is not None
    isz = x.itemsize
    p = max(1, PIECE_BYTES // isz)
    width = min(p, hi - lo)
    tmp = np.empty(width, x.dtype)
    # in place, our operand would be overwritten before its turn (unless it is first)
    own = np.empty(width, x.dtype) if r and np.may_share_memory(acc, x) else None
    for a in range(lo, hi, p):
        b = min(a + p, hi)
        o = acc[a - lo : b - lo]
        mine = x[a:b]
        if own is not None:
            mine = own[: b - a]
            copy_flat(mine, x[a:b])
        if r == 0:
            first = mine
        else:
            G.read(0, s, a * isz, o)
            first = o
        for j in range(1, n):
            if j == r:
                src = mine
            else:
                src = tmp[: b - a]
                G.read(j, s, a * isz, src)
            f(first if j == 1 else o, src, out=o)


def _finish(L: Links, G: Group, s: int) -> None:
    """Done with step ``s``; return once every peer is (our buffers are free)."""
    G.done(s)
    G.wait_done(_others(L.size, L.rank), s, L.deadline, L.backoff)


@register("allreduce", "direct")
def allreduce(L: Links, x: Any, out: Any) -> None:
    G = _group(L)
    if not _reduces_by_address(L, G, x.nbytes, ROUNDS_CROWDED_ALLREDUCE):
        _slot_reduce(L, G, x, out, None)
        return
    n, r = L.size, L.rank
    b = segments(0, x.size, n)
    if _compiled(L, G, x, out, b[r], b[r + 1], two=True):
        return
    dl, bo = L.deadline, L.backoff
    others = _others(n, r)
    isz = x.itemsize
    s = _post_buffer(L, G, x)
    G.wait(others, s, dl, bo)
    _reduce_range(L, G, s, x, b[r], b[r + 1], out[b[r] : b[r + 1]])
    # our finished segment goes into every peer's output (see allgather)
    t = _post_buffer(L, G, out)
    seg = out[b[r] : b[r + 1]]
    for j in others:
        G.wait((j,), t, dl, bo)
        G.write(j, t, b[r] * isz, seg)
    _finish(L, G, t)


#: How long the compiled allreduce waits for a peer without the GIL before it
#: hands the wait to the group's (which checks the deadline and the peer's life).
BY_ADDRESS_PATIENCE_NS = 50_000_000
#: A back-off's spin round in Python, about: the compiled wait spins a policy's
#: ``spins`` rounds for that many nanoseconds each.
ROUND_NS = 300


def _compiled(L: Links, G: Group, x: Any, out: Any, lo: int, hi: int, two: bool) -> bool:
    """:func:`allreduce` (``two`` steps) or :func:`reduce_scatter` by address, this
    rank's block ``[lo, hi)`` of ``x``, as one call of
    ``pycoll._step.reduction_by_address``, which releases the GIL from its
    first claim to its last wait: the same steps, words and bytes.  A wait that
    outlasts ``BY_ADDRESS_PATIENCE_NS`` (or finds a peer closed, or another
    word of the step) is finished here by the group's own, which raises what
    it finds wrong; then the call goes on.  False, touching nothing, where it
    does not apply (no compiled module, ``PYCOLL_COMPILED=0``, or an op or dtype
    C does not reduce).

    Where ranks share a process with other Python threads (DDP's hooks beside
    the torch backend's worker), a wait that keeps the GIL makes each thread
    queue for the other: on the H200, n = 2, a 1 MiB allreduce took 120-170 us
    alone and 230-630 us inside DDP (benchmarks/RESULTS.md, "The worker's host
    allreduce, four experiments", and "The allreduce by address without the GIL")."""
    entry = _entry(L, "reduction_by_address")
    if entry is None:
        return False
    code, kind = _STEP_OPS.get(L.reduce, -1), _step_kind(x.dtype)
    if code < 0 or not kind or (chr(kind) in "fd" and code > 1):
        return False
    s, w1 = _entry_step(L, G)
    t, w2 = _entry_step(L, G) if two else (s, w1)
    args = (*_entry_head(L, G), x, out, lo, hi, kind, code, PIECE_BYTES, s, w1, t, w2, two)
    _drive(L, G, entry, args, 3, lo * x.itemsize, (hi - lo) * x.itemsize)
    return True


def _entry_head(L: Links, G: Group) -> tuple[Any, int, int]:
    """The first arguments of a compiled entry by address: the group's control
    layout, its K and this rank.  The entries' steps fill no slot, so their K is
    the group's posted words: word and range s % W, a claim of step s - W."""
    return G.control(), G.words, L.rank


def _entry_step(L: Links, G: Group) -> tuple[int, int]:
    """Take the next step of a compiled entry by address: it and its posted word."""
    s = _step(L, G)
    return s, G.chains[s % G.words] | s


def _entry(L: Links, name: str) -> Callable[..., Any] | None:
    """``pycoll._step``'s entry ``name``, or None where compiled calls are off
    (``PYCOLL_COMPILED=0``) or the module was not built."""
    if not L.use_compiled or compiled is None:
        return None
    return getattr(compiled, name, None)


def _drive(
    L: Links, G: Group, entry: Callable[..., Any], args: tuple, reads: int, at: int, nbytes: int
) -> None:
    """Run a compiled entry by address (``entry(*args, phase, k, patience...)``)
    to its end: each wait it hands back is finished by the group's own (with
    the deadline, the peer's liveness and the mismatch check), then it resumes
    where it stopped.  A copy that failed raises the group's error: a read in
    phase ``reads`` (else a write) of ``nbytes`` at offset ``at`` of the peer's range.

    It waits as a caller's thread does, also on the worker, whose back-off
    naps almost at once to leave the GIL to the caller's computation: this
    wait holds no GIL.  DDP on the H200, n = 2, alternating jobs in one
    machine start: 1.04-1.06x Gloo's step with the worker's back-off, 0.95-0.99x
    with this one (benchmarks/RESULTS.md, "The allreduce by address without the GIL")."""
    dl, bo = L.deadline, L.patient
    wait = (int(bo.spins * ROUND_NS), bo.yields, int(bo.max_sleep * 1e9), BY_ADDRESS_PATIENCE_NS)
    phase = k = 0
    while True:
        rc, phase, k, j, v = entry(*args, phase, k, *wait)
        if rc == 0:
            return
        if rc == 1:  # a peer's done word: the group's wait, then on
            G.wait_done((j,), v, dl, bo)
        elif rc == 2:  # a peer's posted word: the group's wait raises on a mismatch
            G.wait_word((j,), (v & ((1 << G.step_bits) - 1)) % G.words, v, dl, bo)
        else:
            what = "read" if phase == reads else "write"
            if rc == 3:
                raise G.copy_error(what, j, nbytes, v)
            raise G.range_error(what, j, at, nbytes, v)


@register("allgather", "direct")
def allgather(L: Links, x: Any, out: Any) -> None:
    """Through the slots in rounds up to ALLGATHER_SLOT_ROUNDS of them, else by
    address: each rank writes its block into every peer's output.

    A cross-memory copy pins the other process's pages, 2 MiB pages far faster
    than 4 KiB ones (17-19 against 7-9 GB/s for 2 MiB on the 2-core machine), and
    the output, n blocks long, is the likelier to be on huge pages: so the ranks
    write into the outputs instead of reading the inputs (benchmarks/RESULTS.md, "The measurements behind the constants").
    """
    _allgather(L, x, out, ALLGATHER_SLOT_ROUNDS)


@register("allgather", "cma")
def allgather_cma(L: Links, x: Any, out: Any) -> None:
    """``direct``'s by-address route from one slot up: every block a
    cross-memory write (see :data:`pycoll.algorithms.cost.CMA_CONTENDS`)."""
    _allgather(L, x, out, 1)


def _allgather(L: Links, x: Any, out: Any, slot_rounds: int) -> None:
    """Through the slots for blocks up to ``slot_rounds`` slots, else by address.

    A large block's own copy is the algorithm's (:func:`pycoll.buffers.own_block`).
    By address a rank copies it and writes it into the peers' outputs in pieces
    of :data:`OWN_PIECE_BYTES`, so each piece is read from memory once (the
    later copies find it in the cache); a block that streams
    (:data:`~pycoll.buffers.STREAM_COPY_BYTES`) is copied whole first.  The
    writes go from the copy: it lies in an output, so it is aligned as the
    peers' outputs are, where ``x`` may not be (the kernel's copy between two
    buffers that differ modulo 64 took 1.6x as long: benchmarks/RESULTS.md,
    "An input that ends where its output begins").
    """
    G = _group(L)
    if not (G.cma and x.nbytes > slot_rounds * G.slot_bytes):
        place_own(L.rank, x, out)
        _slot_allgather(L, G, x, out)
        return
    own = own_block(L.rank, x, out)
    if own is not None and x.nbytes >= STREAM_COPY_BYTES:
        copy_into(own, x)  # whole, streaming
        x, own = own, None  # the writes go from the copy (see below)
    if _compiled_allgather(L, G, x, own, out):
        return
    dl, bo = L.deadline, L.backoff
    s = _post_buffer(L, G, out)
    isz, at = x.itemsize, L.rank * x.nbytes
    others = _others(L.size, L.rank)
    p = x.size if own is None else max(1, OWN_PIECE_BYTES // isz)
    for lo in range(0, x.size, p):
        piece = x[lo : lo + p]
        if own is not None:  # written from the copy: in an output, aligned as the peers'
            own[lo : lo + p] = piece
            piece = own[lo : lo + p]
        for j in others:
            if not lo:
                G.wait((j,), s, dl, bo)
            G.write(j, s, at + lo * isz, piece)
    _finish(L, G, s)


def _compiled_allgather(L: Links, G: Group, x: Any, own: Any, out: Any) -> bool:
    """:func:`allgather` by address as one call of
    ``pycoll._step.allgather_by_address`` without the GIL, as :func:`_compiled`
    runs the allreduce: the same steps, words and bytes.  ``own``: the own
    block's place in ``out``, or None where it is already there.  False,
    touching nothing, without the compiled module or with ``PYCOLL_COMPILED=0``.

    The Python steps spent about 1.5 ms of CPU a call in the interpreter at
    16 MiB, n = 4, on the 2-core machine (per-piece calls, and waits that yield
    from Python: a sixth of the call's CPU, against a twentieth for MPI's), CPU
    that the rank sharing the core needed for its copies; compiled, 16 MiB took
    2332 against 2833 us at n = 3 and 976 against 1115 at n = 2
    (benchmarks/RESULTS.md, "The allgather by address in C")."""
    entry = _entry(L, "allgather_by_address")
    if entry is None:
        return False
    s, w = _entry_step(L, G)
    oa = 0 if own is None else _addr(own)
    bufs = (_addr(x), x.nbytes, oa, _addr(out), out.nbytes)
    args = (*_entry_head(L, G), *bufs, OWN_PIECE_BYTES, s, w)
    _drive(L, G, entry, args, -1, L.rank * x.nbytes, x.nbytes)
    return True


@register("broadcast", "direct")
def broadcast(L: Links, buf: Any, root: int) -> None:
    """Through one slot, else by address (see :data:`BROADCAST_BY_ADDRESS_MIN`):
    the readers copy the root's buffer; where it was built, by one compiled
    call without the GIL (:func:`_compiled_broadcast`).

    By address the root does not wait idle: it writes the last 1/n of each
    reader's buffer while the readers read the rest (each reader reads (n-1)/n
    of it, the root writes (n-1)/n of it in all).  That pays also where ranks
    outnumber cores: on the 2-core machine at n = 3, 1-32 MiB took 15-35% less
    time than with the readers reading it all, and at n = 4 as much or less.

    (Rounds of slots up to all K of them, the root copying in while the readers
    copy out, were up to 2x faster from 512 KiB to 2 MiB on the 2-core machine
    in some runs and 1.2-4x slower in others; the direct reads were steady.)"""
    G = _group(L)
    if not _broadcasts_by_address(L, G, buf.nbytes):
        _slot_broadcast(L, G, buf, root)
        return
    cut = buf.size - buf.size // L.size  # the root writes [cut:)
    if _compiled_broadcast(L, G, buf, root, cut):
        return
    dl, bo = L.deadline, L.backoff
    others = _others(L.size, root)
    tail = cut < buf.size
    if L.rank == root:
        # The root marks each step done like every rank, though it reads nothing:
        # a reader that posts its buffer first claims the step, which waits until
        # every rank is done with the step K before it.  With the tail, "done" also
        # tells the readers that it is written.
        s = _post_buffer(L, G, buf)
        for j in others if tail else ():
            G.wait((j,), s, dl, bo)
            G.write(j, s, cut * buf.itemsize, buf[cut:])
        G.done(s)
        G.wait_done(others, s, dl, bo)
    else:
        s = _post_buffer(L, G, buf) if tail else _step(L, G)
        G.wait((root,), s, dl, bo)
        G.read(root, s, 0, buf[:cut])
        G.done(s)
        if tail:
            G.wait_done((root,), s, dl, bo)


def _broadcasts_by_address(L: Links, G: Group, nbytes: int) -> bool:
    """Whether a broadcast of ``nbytes`` goes by address (see :func:`broadcast`)."""
    if not G.cma:
        return False
    return nbytes > (G.slot_bytes if L.crowded else min(G.slot_bytes, BROADCAST_BY_ADDRESS_MIN))


def _compiled_broadcast(L: Links, G: Group, buf: Any, root: int, cut: int) -> bool:
    """:func:`broadcast` by address as one call of
    ``pycoll._step.broadcast_by_address`` without the GIL, as :func:`_compiled`
    runs the allreduce: the same steps, words and bytes.  False, touching
    nothing, without the compiled module or with ``PYCOLL_COMPILED=0``."""
    entry = _entry(L, "broadcast_by_address")
    if entry is None:
        return False
    s, w = _entry_step(L, G)
    cut *= buf.itemsize
    args = (*_entry_head(L, G), _addr(buf), buf.nbytes, cut, root, s, w)
    if L.rank == root:  # its failed copy is a write of the tail
        _drive(L, G, entry, args, -1, cut, buf.nbytes - cut)
    else:
        _drive(L, G, entry, args, 2, 0, cut)
    return True


@register("gather", "direct")
def gather(L: Links, x: Any, out: Any, root: int) -> None:
    """Through the slots up to a slot a block (each rank writes its block into
    its slot, the root copies them out), else by address: the root posts its
    output, each other rank writes its block into it, and the root copies its
    own block meanwhile (:func:`pycoll.buffers.root_block`; where the envelope
    copied it first and the root read each block in turn, 1 MiB at n = 3 on
    the 2-core AMD VM took 132 us).  The root posts a word in the slot path
    too, so that two ranks that each think themselves the root see each
    other's.  On the 2-core AMD VM, prepared (:func:`prepare`), against
    ``linear`` over shm and MPI: 1 KiB at n = 2 2.9 us (7.1, 2.8), n = 4 9.5
    (46.3, 17.1); 64 KiB at n = 2 8.4 (17.3, 16.1)."""
    G = _group(L)
    n, r, k = L.size, L.rank, x.size
    dl, bo = L.deadline, L.backoff
    others = _others(n, r) if r == root else []
    if G.cma and x.nbytes > G.slot_bytes:
        if r != root:
            s = _step(L, G)
            G.claim(s, dl, bo, small=True)  # no slot
            G.post(s)
            G.wait((root,), s, dl, bo)
            G.write(root, s, r * x.nbytes, x)
            G.done(s)
            return
        s = _post_buffer(L, G, out)
        place_root(False, r, x, out)
        G.wait(others, s, dl, bo)  # each rank's word: the same call
        _finish(L, G, s)  # every block written
        return
    if r == root:
        place_root(False, r, x, out)
    for lo, hi, s, v, small in _rounds(L, G, x.dtype, k, _slot_elements(G, x.dtype)):
        G.claim(s, dl, bo, small)
        if r != root:
            copy_flat(v[r], x[lo:hi])
            G.post(s)
            G.done(s)  # it reads nothing (the root reads its slot before K steps pass)
        else:
            G.post(s)  # its slot unused: another rank that thinks itself root sees it
            for j in others:
                G.wait((j,), s, dl, bo)
                copy_flat(out[j * k + lo : j * k + hi], v[j])
            G.done(s)


@register("scatter", "direct")
def scatter(L: Links, x: Any, out: Any, root: int) -> None:
    """Through the slots where the n - 1 other blocks fit one slot: the root
    writes every block but its own into its slot, and each rank copies out its
    own; else by address (each rank reads its block out of the root's input,
    which the root keeps posted until every rank is done, copying its own
    block meanwhile: :func:`pycoll.buffers.root_block`); without
    cross-memory copies, through the slots round by round.  On the 2-core AMD
    VM: in rounds, 1 MiB at n = 4 took 290 us, 175 with ``linear``, by address
    125; prepared (:func:`prepare`), against ``linear`` over shm and MPI,
    1 KiB at n = 2 3.5 us (10.0, 2.3), n = 4 9.4 (40.2, 10.1), 64 KiB at n = 2
    6.5 (9.4, 9.9)."""
    G = _group(L)
    n, r, k = L.size, L.rank, out.size
    dl, bo = L.deadline, L.backoff
    if n == 1:
        return
    if G.cma and (n - 1) * out.nbytes > G.slot_bytes:  # more than one round of the slots
        if r == root:
            s = _post_buffer(L, G, x)
            place_root(True, r, x, out)
            G.done(s)  # it reads nothing
            G.wait_done(_others(n, r), s, dl, bo)  # x is the readers' until then
            return
        s = _step(L, G)
        G.wait((root,), s, dl, bo)
        G.read(root, s, r * out.nbytes, out)
        G.done(s)
        return
    if r == root:
        place_root(True, r, x, out)
    others = _scatter_order(n, root)
    p = others.index(r) if r != root else -1
    per_round = max(1, _slot_elements(G, out.dtype) // (n - 1))
    for lo, hi, s, v, small in _rounds(L, G, out.dtype, k, per_round, n - 1):
        c = hi - lo
        if r == root:
            G.claim(s, dl, bo, small)
            mine = v[r]
            for q, j in enumerate(others):
                copy_flat(mine[q * c : (q + 1) * c], x[j * k + lo : j * k + hi])
            G.post(s)
            G.done(s)  # it reads nothing
        else:
            G.wait((root,), s, dl, bo)
            copy_flat(out[lo:hi], v[root][p * c : (p + 1) * c])
            G.done(s)


@register("reduce_scatter", "direct")
def reduce_scatter(L: Links, x: Any, out: Any) -> None:
    G = _group(L)
    if not _by_address(G, x.nbytes):
        _slot_reduce_scatter(L, G, x, out)
        return
    r, k = L.rank, out.size
    if _compiled(L, G, x, out, r * k, (r + 1) * k, two=False):
        return
    s = _post_buffer(L, G, x)
    G.wait(_others(L.size, r), s, L.deadline, L.backoff)
    _reduce_range(L, G, s, x, r * k, (r + 1) * k, out)
    _finish(L, G, s)


@register("reduce", "direct")
def reduce(L: Links, x: Any, out: Any, root: int) -> None:
    G = _group(L)
    if not _reduces_by_address(L, G, x.nbytes, ROUNDS_CROWDED_REDUCE):
        _slot_reduce(L, G, x, out, root)
        return
    n, r = L.size, L.rank
    dl, bo = L.deadline, L.backoff
    others = _others(n, r)
    b = segments(0, x.size, n)
    s = _post_buffer(L, G, x)
    G.wait(others, s, dl, bo)
    mine = out[b[r] : b[r + 1]] if r == root else np.empty(b[r + 1] - b[r], x.dtype)
    _reduce_range(L, G, s, x, b[r], b[r + 1], mine)
    # each finished segment goes into the root's output (see allgather)
    if r == root:
        t = _post_buffer(L, G, out)
    else:
        t = _step(L, G)
        G.claim(t, dl, bo, small=True)  # no slot
        G.post(t)
        G.wait((root,), t, dl, bo)
        G.write(root, t, b[r] * x.itemsize, mine)
    _finish(L, G, t)


@register("alltoall", "direct")
def alltoall(L: Links, x: Any, out: Any) -> None:
    """By address (with cross-memory copies, from :data:`ALLTOALL_BY_ADDRESS_MIN`
    and above a slot): each rank reads its block out of every peer's input;
    else round by round through the slots, each slot holding a piece of every
    block but our own (the envelope's), from which every peer takes its own;
    when there are at most ``G.ahead`` rounds, every round is written and
    posted before any is read, as in allgather.  At 1 MiB on the 2-core
    machine, in alternating blocks, writing ahead took 0.82-0.88x the time at
    n = 4, and leaving our own block out of the slots (fewer rounds) 0.66x at
    n = 3 and 0.90-0.92x at n = 2 (benchmarks/RESULTS.md, "Where alltoall's
    time goes").

    Reads, not writes as allgather's: an input is as long as the output here,
    so it is as likely to be on huge pages, and its lines are clean (nothing
    wrote them during the call).  In alternating blocks on the 2-core machine
    the reads took 0.60-0.87x the writes' time at 4-16 MiB, n = 2-4, in eight
    cells of nine (benchmarks/RESULTS.md, "Where alltoall's time goes")."""
    _alltoall(L, x, out, ALLTOALL_BY_ADDRESS_MIN)


@register("alltoall", "cma")
def alltoall_cma(L: Links, x: Any, out: Any) -> None:
    """``direct``'s by-address route from one slot up: each rank reads its
    block out of every peer's input (see :data:`pycoll.algorithms.cost.CMA_CONTENDS`)."""
    _alltoall(L, x, out, 0)


def _alltoall(L: Links, x: Any, out: Any, by_address_min: int) -> None:
    """By address from ``by_address_min`` bytes and above a slot, else through the slots."""
    G = _group(L)
    n, r = L.size, L.rank
    dl, bo = L.deadline, L.backoff
    k = x.size // n
    if n == 1:
        return
    by_address = _prepare_alltoall(L, bo, x.size, L.fp, by_address_min)
    if by_address is not None:
        by_address(x, out)
        return
    others = _others(n, r)
    per_round = max(1, G.slot_bytes // x.itemsize // (n - 1))
    ahead = -(-k // per_round) <= G.ahead
    unread: list[Any] = []

    def read() -> None:
        for lo, hi, s, v, _ in unread:
            c = hi - lo
            for j in others:
                G.wait((j,), s, dl, bo)
                p = r if r < j else r - 1
                copy_flat(out[j * k + lo : j * k + hi], v[j][p * c : (p + 1) * c])
            G.done(s)
        unread.clear()

    for rnd in _rounds(L, G, x.dtype, k, per_round, n - 1):
        lo, hi, s, v, small = rnd
        c = hi - lo
        G.claim(s, dl, bo, small)
        mine = v[r]
        for b in others:  # our own block is the envelope's
            p = b if b < r else b - 1
            copy_flat(mine[p * c : (p + 1) * c], x[b * k + lo : b * k + hi])
        G.post(s, consumed=not unread)
        unread.append(rnd)
        if not ahead:
            read()
    read()


def _prepare_alltoall(
    L: Links, backoff: Backoff, count: int, fp: int, by_address_min: int
) -> Callable[[Any, Any], None] | None:
    """Alltoall's by-address route of ``count`` input elements, prepared: each
    rank posts its input's range and reads its block out of every peer's
    (cross-memory copies), with the block offsets, the peers and the group's
    methods worked out once; None where the call goes through the slots.
    :func:`_alltoall` runs it once; a plan's step (:func:`prepare`) keeps it.  At 1 MiB, n = 2 on the 2-core machine the
    call's own Python took about 10 us of 63 (``benchmarks/RESULTS.md``)."""
    G = L.group
    n, r = L.size, L.rank
    isz = L.dtype.itemsize
    nbytes = count * isz
    if G is None or n < 2 or count % n:
        return None
    if not (G.cma and nbytes > G.slot_bytes and nbytes >= by_address_min):
        return None
    blk = count // n * isz
    at = r * blk
    others = tuple(_others(n, r))
    reads = tuple((j, j * blk) for j in others)
    dl = L.deadline
    step, claim, post, wait, read_at = G.step, G.claim, G.post, G.wait, G.read_at
    done, wait_done = G.done, G.wait_done

    def run(x: Any, out: Any) -> None:
        oa = _addr(out)
        s = step(fp)
        claim(s, dl, backoff, True)  # no slot
        post(s, _addr(x), nbytes)
        for j, off in reads:
            wait((j,), s, dl, backoff)
            read_at(j, s, at, oa + off, blk)
        done(s)
        wait_done(others, s, dl, backoff)

    return run


def _alltoall_fits(L: Links, count: int) -> bool:
    """Whether an alltoall of ``count`` input elements goes through the slots in
    one round (:func:`_alltoall`, where :func:`_prepare_alltoall` found it does
    not go by address), as one compiled step: each rank copies the n - 1 blocks
    not its own into its slot and each peer's block for it out of theirs."""
    G, n = L.group, L.size
    if G is None or n < 2 or count <= 0 or count % n:
        return False
    return (n - 1) * (count // n) * L.dtype.itemsize <= G.slot_bytes


@register("barrier", "direct")
def barrier(L: Links) -> None:
    G = _group(L)
    s = _step(L, G)
    G.claim(s, L.deadline, L.backoff, small=True)  # no slot, but the posted word
    G.post(s)
    G.wait(_others(L.size, L.rank), s, L.deadline, L.backoff)


# ------------------------------------------------------------------ prepared
#: Rounds a compiled step spins on the peers' words (about 1-4 us on the 2-core
#: machine) before it hands the wait to the group's, which backs off; none where
#: ranks outnumber cores (a spin there holds the core the awaited rank needs: at
#: n = 3 and 4 on two cores, 256 rounds made 8 B allgathers 20-30% slower).
STEP_SPINS = 256

#: Past its spins, a compiled step's wait yields the CPU for up to this long
#: (ns) before it hands the wait to the group's, in Python: at n = 3 and 4 on
#: the 2-core machine, where ranks outnumber cores and a wait comes at once,
#: that Python wait cost a replayed 8 B allreduce 6.2-6.3 against 3.3-3.6 us
#: (n = 3) and 7.9-8.9 against 4.1-4.2 (n = 4); with a core per rank it
#: changed nothing
#: (benchmarks/RESULTS.md, "Yielding in the compiled step").
STEP_YIELD_NS = 50_000
#: ... where the thread's waiting policy yields at least this many times
#: itself: the step holds the GIL while it yields, and the worker thread's
#: policy (``Family.polite``, 16 yields) naps almost at once to leave the GIL
#: to the caller's computation, so its steps hand a wait to Python at once.
STEP_YIELD_POLICY_MIN = 64

#: The compiled reduction's codes of NumPy's ufuncs (pycoll/_step.c, ``reduce``).
_STEP_OPS: dict[Any, int] = {
    np.add: 0,
    np.multiply: 1,
    np.minimum: 2,
    np.maximum: 3,
    np.bitwise_and: 4,
    np.bitwise_or: 5,
    np.bitwise_xor: 6,
}


#: ... and of the dtypes it reduces: integers by width (upper case: unsigned),
#: float32 and float64, in native byte order.
_INT_KINDS = {1: "b", 2: "h", 4: "i", 8: "q"}


def _step_kind(dtype: Any) -> int:
    """The compiled reduction's code of ``dtype``; 0: it does not reduce it."""
    if not dtype.isnative:
        return 0
    if dtype.kind in "iu" and dtype.itemsize in _INT_KINDS:
        c = _INT_KINDS[dtype.itemsize]
        return ord(c.upper() if dtype.kind == "u" else c)
    if dtype.kind == "f" and dtype.itemsize in (4, 8):
        return ord("f" if dtype.itemsize == 4 else "d")
    return 0


class _Compiled:
    """The addresses a compiled step reads and writes, per word index ``i``:
    ``slot[i]`` and ``word[i]`` (this rank's), ``theirs[i]`` (the peers' posted
    words, in ``others`` order) and ``rows[i]`` (every rank's slot, or its part
    where the step is ``small``, in rank order); ``done``: this rank's done
    word, ``dones`` the peers' (in ``others`` order)."""

    def __init__(self, G: Group, r: int, n: int, others: tuple[int, ...], small: bool) -> None:
        K = G.words
        at = [[G.addresses(j, i, small) for i in range(K)] for j in range(n)]
        self.slot = tuple(at[r][i][0] for i in range(K))
        self.word = tuple(at[r][i][1] for i in range(K))
        self.done = at[r][0][2]
        self.dones = tuple(at[j][0][2] for j in others)
        self.theirs = tuple(tuple(at[j][i][1] for j in others) for i in range(K))
        self.rows = tuple(tuple(at[j][i][0] for j in range(n)) for i in range(K))


def _prepare_scatter(
    L: Links, G: Group, backoff: Backoff, k: int, root: int, fp: int, use_compiled: bool
) -> Callable[[Any, Any], None] | None:
    """:func:`scatter` through the slots in one round (blocks of ``k``
    elements; the root's slot holds n - 1 of them), prepared as :func:`prepare`'s
    steps are (where ``use_compiled``, as a compiled step); None where it takes
    more rounds."""
    n, r = L.size, L.rank
    width = (n - 1) * k
    if width * L.dtype.itemsize > G.slot_bytes:
        return None
    if use_compiled:
        return _compiled_step("scatter", G, L, backoff, k, root, fp)
    small = G.small(width * L.dtype.itemsize)
    views = G.views(L.dtype, width, small)
    K, dl, bo = G.words, L.deadline, backoff
    mul, cmask, fpw = G.chain_mul, G.chain_mask, fp << G.step_bits
    others = _scatter_order(n, root)
    if r == root:
        mine = tuple(v[r] for v in views)
        places = tuple((p * k, (p + 1) * k, j * k, (j + 1) * k) for p, j in enumerate(others))
        claim, post_word, done = G.claim, G.post_word, G.done

        def run_root(x: Any, _: Any) -> None:
            s = G.seq = G.seq + 1
            c = G.chain = (G.chain * mul + fpw) & cmask
            i = s % K
            w = c | s
            claim(s, dl, bo, small)
            m = mine[i]
            for a, b, lo, hi in places:
                copy_flat(m[a:b], x[lo:hi])
            post_word(i, w, s)
            done(s)

        return run_root
    p = others.index(r)  # its x is its output (Scatter.check)
    return _prepared_reader(
        L, G, backoff, fp, root, tuple(v[root][p * k : (p + 1) * k] for v in views)
    )


def _prepared_writer(
    L: Links, G: Group, backoff: Backoff, fp: int, small: bool, mine: tuple[Any, ...]
) -> Callable[[Any, Any], None]:
    """A prepared step that copies its first argument into ``mine[s % K]`` (its
    slot, or its part of it) and posts it, reading nothing: a broadcast's
    root, a gather's senders."""
    K, dl, bo = G.words, L.deadline, backoff
    mul, cmask, fpw = G.chain_mul, G.chain_mask, fp << G.step_bits
    claim, post_word, done = G.claim, G.post_word, G.done

    def run_writer(x: Any, _: Any) -> None:
        s = G.seq = G.seq + 1
        c = G.chain = (G.chain * mul + fpw) & cmask
        i = s % K
        w = c | s
        claim(s, dl, bo, small)
        copy_flat(mine[i], x)
        post_word(i, w, s)
        done(s)

    return run_writer


def _prepared_reader(
    L: Links, G: Group, backoff: Backoff, fp: int, src: int, theirs: tuple[Any, ...]
) -> Callable[[Any, Any], None]:
    """A prepared step that waits for rank ``src``'s word and copies
    ``theirs[s % K]`` (its slot, or a part) into its first argument: a
    broadcast's readers, a scatter's."""
    K, dl, bo = G.words, L.deadline, backoff
    mul, cmask, fpw = G.chain_mul, G.chain_mask, fp << G.step_bits
    srcs, wait_word, done = (src,), G.wait_word, G.done

    def run_leaf(buf: Any, _: Any) -> None:
        s = G.seq = G.seq + 1
        c = G.chain = (G.chain * mul + fpw) & cmask
        i = s % K
        w = c | s
        wait_word(srcs, i, w, dl, bo)
        copy_flat(buf, theirs[i])
        done(s)

    return run_leaf


def prepare(
    collective: str,
    L: Links,
    backoff: Backoff,
    count: int,
    root: int = 0,
    fp: int = 0,
    use_compiled: bool = True,
    algorithm: str = "direct",
) -> Callable[[Any, Any], None] | None:
    """The one-step slot path of ``collective`` with everything but the buffers
    worked out in advance, or None where it does not apply.

    For the communicator's fast path, which calls the same collective on the same
    buffers again and again: the returned ``run(x, out)`` (``run(buf, None)`` for
    broadcast) does exactly what the registered algorithm does for ``count``
    input elements of ``L.dtype`` that fit one slot, in a handful of Python-level
    calls.  ``L.deadline`` is an inactivity timeout that every wait re-arms, so
    a call sets none.  ``fp``: the call's fingerprint, which each step folds into
    the group's chain as :meth:`~pycoll.algorithms.links.Group.step` does
    (written out here, a store and a compare more a step than with no fingerprint).
    ``use_compiled``: allreduce and reduce copy in, publish, wait and reduce
    through :mod:`pycoll._step` where it was built (:data:`compiled`), the same
    bytes and words as the Python steps below.  ``algorithm``: ``direct`` or
    ``cma``; of ``cma`` only alltoall's by-address route is prepared
    (:func:`_prepare_alltoall`).
    """
    if collective == "alltoall":
        by_address_min = 0 if algorithm == "cma" else ALLTOALL_BY_ADDRESS_MIN
        run = _prepare_alltoall(L, backoff, count, fp, by_address_min)
        G = L.group
        if run is None and G is not None and use_compiled and compiled is not None:
            if _alltoall_fits(L, count):
                return _compiled_step(collective, G, L, backoff, count, root, fp)
        return run
    if algorithm != "direct":
        return None
    G = L.group
    n, r = L.size, L.rank
    if G is None or n < 2 or count <= 0:
        return None
    if collective == "allgather" and own_placed(count * L.dtype.itemsize):
        return None  # its own block is the algorithm's (see allgather); none here copies it
    if collective in ("gather", "scatter") and root_placed(count * L.dtype.itemsize):
        return None  # the root's own block is the algorithm's (see gather)
    if count * L.dtype.itemsize > G.slot_bytes:
        if collective == "allgather" and use_compiled and _compiled_rounds(L, G, count):
            return _compiled_step(collective, G, L, backoff, count, root, fp)
        return None
    if collective == "reduce_scatter" and count % n:
        return None
    if collective == "broadcast" and _broadcasts_by_address(L, G, count * L.dtype.itemsize):
        return None
    views = G.views(L.dtype, count)  # views[s % K][j]: rank j's slot for step s
    K = G.words
    small = G.small(count * L.dtype.itemsize)  # as views and _rounds decide it
    mine = tuple(v[r] for v in views)
    others = tuple(_others(n, r))
    dl, bo, f = L.deadline, backoff, L.reduce
    claim, done = G.claim, G.done
    post_word, wait_word = G.post_word, G.wait_word
    mul, cmask, fpw = G.chain_mul, G.chain_mask, fp << G.step_bits  # fp above the step
    # Each closure below writes out its step's start (deadline, step, claim, copy
    # in, post) rather than calling a shared helper: at n = 2 on the 2-core machine
    # the helper made an 8 B allreduce 4.00-4.05 us instead of 3.83-3.92 (three
    # alternating runs each of sweep.py allreduce -b 8 -e 8 -n 5000).

    if collective == "allreduce" and split_allreduce(n, count * L.dtype.itemsize, L.crowded):
        assert f is not None
        b = segments(0, count, n)
        seg = slice(b[r], b[r + 1])
        parts = tuple(tuple(row[seg] for row in v) for v in views)
        outs = tuple(
            (j, b[j], b[j + 1], tuple(v[j][b[j] : b[j + 1]] for v in views)) for j in others
        )
        lo_r, hi_r = b[r], b[r + 1]

        def run_split(x: Any, out: Any) -> None:
            s = G.seq = G.seq + 1
            c = G.chain = (G.chain * mul + fpw) & cmask
            i = s % K
            w = c | s
            claim(s, dl, bo, small)
            copy_flat(mine[i], x)
            post_word(i, w, s)
            wait_word(others, i, w, dl, bo)
            acc = out[lo_r:hi_r]
            reduce_rows(f, parts[i], acc)
            done(s)
            t = G.seq = s + 1
            c = G.chain = (G.chain * mul + fpw) & cmask
            j2 = t % K
            w2 = c | t
            claim(t, dl, bo, small)
            mine[j2][seg] = acc
            post_word(j2, w2, t)
            wait_word(others, j2, w2, dl, bo)
            for _j, lo, hi, theirs in outs:
                out[lo:hi] = theirs[j2]
            done(t)

        return run_split

    compile_it = use_compiled and compiled is not None
    if collective == "reduce" and r == root and r <= 1 and not (compile_it and small):
        assert f is not None
        # Nobody reads the root's slot, so a root that is rank 0 or 1 reduces its
        # own input where it lies: as rows[r] it is an operand of the first
        # f(rows[0], rows[1], out), read before ``out`` (which may be the
        # input itself) is written.  It fills no slot, yet claims the step: its
        # posted word replaces that of step s - K, which a leaf (waiting on no
        # peer, so up to K steps ahead) may have posted and the root not yet seen.
        rows = tuple(list(v) for v in views)

        def run_reduce_root(x: Any, out: Any) -> None:
            s = G.seq = G.seq + 1
            c = G.chain = (G.chain * mul + fpw) & cmask
            i = s % K
            w = c | s
            claim(s, dl, bo, small)
            post_word(i, w, s)
            wait_word(others, i, w, dl, bo)
            rw = rows[i]
            rw[r] = x
            reduce_rows(f, rw, out)
            rw[r] = mine[i]  # hold no caller's array
            done(s)

        return run_reduce_root

    if compile_it and collective in _COMPILED:
        return _compiled_step(collective, G, L, backoff, count, root, fp)

    if collective in ("allreduce", "reduce"):
        assert f is not None
        reader = collective == "allreduce" or r == root

        def run_reduce(x: Any, out: Any) -> None:
            s = G.seq = G.seq + 1
            c = G.chain = (G.chain * mul + fpw) & cmask
            i = s % K
            w = c | s
            claim(s, dl, bo, small)
            copy_flat(mine[i], x)
            post_word(i, w, s)
            if reader:
                wait_word(others, i, w, dl, bo)
                reduce_rows(f, views[i], out)
            done(s)

        return run_reduce

    if collective == "allgather":
        k = count
        blocks = tuple((j, j * k, (j + 1) * k) for j in others)

        def run_allgather(x: Any, out: Any) -> None:
            s = G.seq = G.seq + 1
            c = G.chain = (G.chain * mul + fpw) & cmask
            i = s % K
            w = c | s
            claim(s, dl, bo, small)
            copy_flat(mine[i], x)
            post_word(i, w, s)
            v = views[i]
            wait_word(others, i, w, dl, bo)
            for j, lo, hi in blocks:
                copy_flat(out[lo:hi], v[j])
            done(s)

        return run_allgather

    if collective == "broadcast":
        theirs = tuple(v[root] for v in views)

        if r == root:
            return _prepared_writer(L, G, backoff, fp, small, mine)
        return _prepared_reader(L, G, backoff, fp, root, theirs)

    if collective == "gather":
        if r != root:
            return _prepared_writer(L, G, backoff, fp, small, mine)
        k = count
        blocks = tuple((j, j * k, (j + 1) * k) for j in others)

        def run_gather_root(_: Any, out: Any) -> None:
            s = G.seq = G.seq + 1
            c = G.chain = (G.chain * mul + fpw) & cmask
            i = s % K
            w = c | s
            claim(s, dl, bo, small)
            post_word(i, w, s)
            v = views[i]
            wait_word(others, i, w, dl, bo)
            for j, lo, hi in blocks:
                copy_flat(out[lo:hi], v[j])
            done(s)

        return run_gather_root

    if collective == "scatter":
        return _prepare_scatter(L, G, backoff, count, root, fp, compile_it)

    if collective == "reduce_scatter":
        assert f is not None
        k = count // n
        blk = slice(r * k, (r + 1) * k)
        parts = tuple(tuple(v[j][blk] for j in range(n)) for v in views)

        def run_reduce_scatter(x: Any, out: Any) -> None:
            s = G.seq = G.seq + 1
            c = G.chain = (G.chain * mul + fpw) & cmask
            i = s % K
            w = c | s
            claim(s, dl, bo, small)
            copy_flat(mine[i], x)
            post_word(i, w, s)
            wait_word(others, i, w, dl, bo)
            reduce_rows(f, parts[i], out)
            done(s)

        return run_reduce_scatter
    return None


def _compiled_step(
    collective: str,
    G: Group,
    L: Links,
    backoff: Backoff,
    count: int,
    root: int,
    fp: int,
) -> Callable[[Any, Any], None]:
    """:func:`prepare`'s step of ``collective`` as one :class:`pycoll._step.Step`:
    the same bytes and words as the Python closures there, with the group's
    claim, wait and (for ops and dtypes C does not reduce) reduction called back
    in Python when they have something to do.  ``fp``: the call's fingerprint."""
    n, r = L.size, L.rank
    others = tuple(_others(n, r))
    nbytes = count * L.dtype.itemsize
    held = nbytes  # what the step's slot holds
    hole_at = hole = 0  # the bytes of x that stay out of the slot: its own block
    oblk = nbytes  # a GATHER step's block of the output
    if collective == "scatter":  # the root's slot holds the n - 1 other blocks in rank order
        held = nbytes * (n - 1)
        if r == root:
            hole_at, hole, nbytes = root * nbytes, nbytes, held
    elif collective == "alltoall":  # count: all n blocks; its slot holds the n - 1 others
        oblk = nbytes // n
        hole_at, hole = r * oblk, oblk
        nbytes = held = nbytes - oblk
    small = G.small(held)  # a step of rounds (an allgather of more than a slot) is not
    at = _Compiled(G, r, n, others, small)
    K = G.words
    dl, f = L.deadline, L.reduce
    code, kind = _STEP_OPS.get(f, -1), _step_kind(L.dtype)
    if code < 0:
        kind = 0  # C reduces nothing: reduce() each time
    theirs: tuple[tuple[int, ...], ...] = at.theirs
    rows: tuple[tuple[int, ...], ...] = at.rows
    peers: tuple[int, ...] = others
    parts: Any = None
    red_count = count
    piece = nbytes

    if collective in ("allreduce", "reduce"):
        parts = G.views(L.dtype, count, small)
        mode = _READ if collective == "allreduce" or r == root else _WRITE
    elif collective == "allgather" or (collective == "gather" and r == root):
        # every rank's slot but this rank's own block (the envelope copies it); a
        # gather's root copies its input into its slot too, which nobody reads
        mode = _GATHER
        rows = tuple(tuple(0 if j == r else a for j, a in enumerate(row)) for row in at.rows)
        piece = _slot_elements(G, L.dtype) * L.dtype.itemsize  # a block of more goes in rounds
    elif collective == "gather" or (collective == "scatter" and r == root):
        mode = _WRITE
    elif collective == "alltoall":  # block r of each peer's slot, where it lies there
        mode = _GATHER
        rows = tuple(
            tuple(0 if j == r else a + (r if r < j else r - 1) * oblk for j, a in enumerate(row))
            for row in at.rows
        )
    elif collective == "scatter":  # a reader (see _prepare_scatter): its block of the root's slot
        mode = _LEAF
        peers = (root,)
        off = _scatter_order(n, root).index(r) * nbytes
        theirs = tuple((at.theirs[i][others.index(root)],) for i in range(K))
        rows = tuple((at.rows[i][root] + off,) for i in range(K))
    elif collective == "reduce_scatter":
        mode = _SCATTER
        red_count = k = count // n
        off = r * k * L.dtype.itemsize  # block r of every rank's slot
        rows = tuple(tuple(a + off for a in row) for row in at.rows)
        blk = slice(r * k, (r + 1) * k)
        parts = tuple(tuple(v[j][blk] for j in range(n)) for v in G.views(L.dtype, count, small))
    elif r == root:
        mode = _ROOT
    else:
        mode = _LEAF  # waits for the root's word alone, and copies the root's slot
        peers = (root,)
        theirs = tuple((at.theirs[i][others.index(root)],) for i in range(K))
        rows = tuple((at.rows[i][root],) for i in range(K))

    def claim(s: int) -> None:
        G.claim(s, dl, backoff, small)

    def wait(late: int, i: int, w: int) -> None:
        G.wait_word(peers[late:], i, w, dl, backoff)

    def reduce(i: int, out: Any) -> None:
        assert f is not None
        reduce_rows(f, parts[i], out)

    return compiled.Step(  # type: ignore[no-any-return]
        mode,
        G,
        claim,
        wait,
        reduce,
        K,
        G.slots,
        small,
        G.chain_mul,
        G.chain_mask,
        (fp << G.step_bits) & _U64,  # fp above the step, as prepare's fpw
        0 if L.crowded else STEP_SPINS,
        nbytes,
        red_count,
        max(code, 0),
        kind,
        at.slot,
        at.word,
        at.done,
        theirs,
        rows,
        at.dones,
        G.ahead,
        piece,
        STEP_YIELD_NS if backoff.yields >= STEP_YIELD_POLICY_MIN else 0,
        hole_at,
        hole,
        oblk,
    )


# the modes of pycoll._step.Step
_READ, _WRITE, _GATHER, _SCATTER, _ROOT, _LEAF = range(6)
_U64 = (1 << 64) - 1
#: The rounds one compiled allgather step takes at most (pycoll/_step.c, MAXR).
COMPILED_ROUNDS = 8
_COMPILED = ("allreduce", "reduce", "allgather", "reduce_scatter", "broadcast", "gather")
# (and through their own checks: a scatter's and an alltoall's step of one round)
