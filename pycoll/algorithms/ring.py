"""Ring algorithms: bandwidth-optimal, n-1 (or 2(n-1)) steps.

Rank r sends to ``right = r+1`` and receives from ``left = r-1`` (mod n).
N is the buffer size in bytes.

allreduce (reduce-scatter, then allgather), pipelined in slices of
``n * chunk`` elements; each slice is cut into n segments:
    reduce-scatter step s (0..n-2): send segment r-s, receive segment r-s-1 and
        reduce it with the local one straight out of the transport;
    allgather step s (0..n-2): send segment r+1-s, receive segment r-s.
    Bytes sent per rank: 2(n-1)/n * N.  Segment k is summed in ring order starting
    at rank k, and the finished segment is copied to everyone, so all ranks hold
    the same bits.  Of two operands the lower rank's comes first (the partial
    sum, except where it arrives at rank 0), so at n = 2 every segment is
    ``x0 OP x1``, as in every other allreduce (which lets ``auto`` switch
    between them, see :mod:`pycoll.tune`).

allgather: n-1 steps; step s sends block r-s and receives block r-s-1.
    Bytes sent per rank: (n-1)/n * N_out.

reduce_scatter: n-1 steps over the blocks, rank r ending with block r;
    partial sums travel through two scratch buffers.  (n-1)/n * N_in per rank.

reduce: reduce-scatter into near-equal segments, then each rank sends its
    segment to the root.

broadcast: a pipelined chain root -> root+1 -> ...; see :mod:`.tree`.
"""

from __future__ import annotations

from typing import Any

from pycoll.algorithms.links import Links
from pycoll.algorithms.registry import register
from pycoll.algorithms.tree import pipelined_broadcast
from pycoll.buffers import place_own


def segments(lo: int, hi: int, n: int) -> list[int]:
    """Bounds of ``n`` contiguous near-equal parts of ``[lo, hi)``."""
    q, rem = divmod(hi - lo, n)
    return [lo + k * q + min(k, rem) for k in range(n + 1)]


@register("allreduce", "ring")
def allreduce(L: Links, x: Any, out: Any) -> None:
    n, r = L.size, L.rank
    right, left = (r + 1) % n, (r - 1) % n
    count = x.size
    step = L.chunk_elems * n
    for lo in range(0, count, step):
        b = segments(lo, min(lo + step, count), n)

        def seg(k: int, b: list[int] = b) -> slice:
            k %= n
            return slice(b[k], b[k + 1])

        for s in range(n - 1):
            src = x if s == 0 else out
            L.send(right, src[seg(r - s)])
            L.wait(L.recv_reduce(left, out[seg(r - s - 1)], x[seg(r - s - 1)], left < r))
        for s in range(n - 1):
            L.send(right, out[seg(r + 1 - s)])
            L.wait(L.recv(left, out[seg(r - s)]))
    L.finish()


@register("allgather", "ring")
def allgather(L: Links, x: Any, out: Any) -> None:
    n, r = L.size, L.rank
    right, left = (r + 1) % n, (r - 1) % n
    k = x.size

    def blk(b: int) -> Any:
        b %= n
        return out[b * k : (b + 1) * k]

    place_own(r, x, out)
    for s in range(n - 1):
        L.send(right, blk(r - s))
        L.wait(L.recv(left, blk(r - s - 1)))
    L.finish()


def _reduce_scatter(L: Links, x: Any, bounds: list[int], mine: Any) -> None:
    """Ring reduce-scatter of ``x`` cut at ``bounds``; rank r's block lands in ``mine``."""
    n, r = L.size, L.rank
    right, left = (r + 1) % n, (r - 1) % n
    longest = max(bounds[i + 1] - bounds[i] for i in range(n))
    chunk = min(L.chunk_elems, max(1, longest))
    scratch = [L.empty(chunk, x.dtype) for _ in range(2)]
    busy: list[Any] = [None, None]  # the send still reading each scratch buffer
    for lo in range(0, longest, chunk):

        def part(b: int, lo: int = lo) -> slice:
            b %= n
            a = min(bounds[b] + lo, bounds[b + 1])
            return slice(a, min(a + chunk, bounds[b + 1]))

        for s in range(n - 1):
            sb, rb = (r - s - 1) % n, (r - s - 2) % n
            src = x[part(sb)] if s == 0 else scratch[(s - 1) % 2][: part(sb).stop - part(sb).start]
            if src.size:
                req = L.send(right, src)
                if s:
                    busy[(s - 1) % 2] = req
            rs = part(rb)
            m = rs.stop - rs.start
            if s == n - 2:
                dst = mine[lo : lo + m]
            else:
                if busy[s % 2] is not None:
                    L.wait(busy[s % 2])
                    busy[s % 2] = None
                dst = scratch[s % 2][:m]
            if m:  # the lower rank's operand first, as in allreduce
                L.wait(L.recv_reduce(left, dst, x[rs], left < r))
    L.finish()


@register("reduce_scatter", "ring")
def reduce_scatter(L: Links, x: Any, out: Any) -> None:
    k = out.size
    _reduce_scatter(L, x, [b * k for b in range(L.size + 1)], out)


@register("reduce", "ring")
def reduce(L: Links, x: Any, out: Any, root: int) -> None:
    n, r = L.size, L.rank
    b = segments(0, x.size, n)
    if r == root:
        _reduce_scatter(L, x, b, out[b[r] : b[r + 1]])
        reqs = [L.recv(p, out[b[p] : b[p + 1]]) for p in range(n) if p != r and b[p + 1] > b[p]]
        L.wait(*reqs)
    else:
        mine = L.empty(b[r + 1] - b[r], x.dtype)
        _reduce_scatter(L, x, b, mine)
        if mine.size:
            L.send(root, mine)
    L.finish()


@register("broadcast", "ring")
def broadcast(L: Links, buf: Any, root: int) -> None:
    n = L.size
    v = (L.rank - root) % n
    parent = None if v == 0 else (L.rank - 1) % n
    children = [] if v == n - 1 else [(L.rank + 1) % n]
    pipelined_broadcast(L, buf, parent, children)
