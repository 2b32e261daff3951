"""Algorithms that deliver each rank's blocks to their own destinations:
alltoall(v), gather, scatter, and the v-variants of allgather and reduce_scatter.

n ranks; k elements a block (N = k bytes a rank for gather and scatter, n k
for alltoall).  Blocks of one message are contiguous; the v-variants' blocks
sit at the prefix sums of their counts, and a block of no elements moves nothing.

alltoall ``pairwise``: n-1 steps; in step s rank r sends block r+s to rank r+s
    and receives block r-s from rank r-s (mod n), one peer each way a step, so
    no link carries two messages at once.  (n-1) k sent a rank.  ``alltoallv``
    does the same with each pair's own counts.
gather ``linear``: every rank sends its block to the root, which posts its
    n-1 receives at once: one step, (n-1) k into the root.
gather ``tree``: a binomial tree over the ranks relative to the root: in round
    i a rank whose relative rank has bit i set sends everything it holds (its
    subtree's blocks, contiguous) to the rank without that bit and leaves;
    ceil(log2 n) steps, the same bytes into the root.
scatter ``linear`` and ``tree``: the same, in reverse.
allgatherv ``ring``: as allgather's ring, block b being ``counts[b]`` elements.
reduce_scatterv ``ring``: as reduce_scatter's ring, cut at the counts' prefix sums.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from pycoll.algorithms.links import Links
from pycoll.algorithms.registry import register
from pycoll.algorithms.ring import _reduce_scatter
from pycoll.buffers import copy_into, place_root


def displacements(counts: Any) -> list[int]:
    """The prefix sums of ``counts``: block b is ``[d[b], d[b + 1])``."""
    return [0, *np.cumsum(counts, dtype=np.int64).tolist()]


# ------------------------------------------------------------------ alltoall
@register("alltoall", "pairwise")
def alltoall(L: Links, x: Any, out: Any) -> None:
    n = L.size
    k = x.size // n
    b = [i * k for i in range(n + 1)]
    _pairwise(L, x, b, out, b)


@register("alltoallv", "pairwise")
def alltoallv(L: Links, x: Any, out: Any, counts: tuple[Any, Any]) -> None:
    """``counts``: (sendcounts, recvcounts) of this rank."""
    _pairwise(L, x, displacements(counts[0]), out, displacements(counts[1]))


def _pairwise(L: Links, x: Any, sd: list[int], out: Any, rd: list[int]) -> None:
    n, r = L.size, L.rank
    for s in range(1, n):
        dst, src = (r + s) % n, (r - s) % n
        L.send(dst, x[sd[dst] : sd[dst + 1]])
        L.wait(L.recv(src, out[rd[src] : rd[src + 1]]))
    L.finish()


# ------------------------------------------------------------------ gather and scatter
@register("gather", "linear")
def gather_linear(L: Links, x: Any, out: Any, root: int) -> None:
    n, r, k = L.size, L.rank, x.size
    if r != root:
        L.send(root, x)
    else:
        got = [L.recv(p, out[p * k : (p + 1) * k]) for p in range(n) if p != root]
        place_root(False, r, x, out)
        L.wait(*got)
    L.finish()


@register("scatter", "linear")
def scatter_linear(L: Links, x: Any, out: Any, root: int) -> None:
    n, r, k = L.size, L.rank, out.size
    if r == root:
        for p in range(n):
            if p != root:
                L.send(p, x[p * k : (p + 1) * k])
        place_root(True, r, x, out)
    else:
        L.wait(L.recv(root, out))
    L.finish()


def _subtree(v: int, n: int) -> int:
    """Blocks in the binomial subtree of relative rank ``v`` (itself included)."""
    return min(v & -v if v else n, n - v)


@register("gather", "tree")
def gather_tree(L: Links, x: Any, out: Any, root: int) -> None:
    n, r, k = L.size, L.rank, x.size
    v = (r - root) % n
    span = _subtree(v, n)
    # relative blocks v .. v + span - 1; at root 0 they are the output itself
    acc = out if v == 0 and root == 0 else L.empty(span * k, x.dtype)
    if acc is not out:
        acc[:k] = x
    else:
        place_root(False, r, x, out)
    mask = 1
    while mask < span:
        child = v + mask
        got = min(mask, n - child)
        L.wait(L.recv((child + root) % n, acc[mask * k : (mask + got) * k]))
        mask <<= 1
    if v:
        L.send((v - (v & -v) + root) % n, acc[: span * k])
    elif acc is not out:  # relative block i is rank (i + root)'s
        cut = (n - root) * k
        out[root * k :] = acc[:cut]
        out[: root * k] = acc[cut:]
    L.finish()


@register("scatter", "tree")
def scatter_tree(L: Links, x: Any, out: Any, root: int) -> None:
    n, r, k = L.size, L.rank, out.size
    v = (r - root) % n
    span = _subtree(v, n)
    if v == 0:
        if root == 0:
            acc = x
        else:  # relative order: rank root's block first
            acc = L.empty(n * k, out.dtype)
            cut = (n - root) * k
            copy_into(acc[:cut], x[root * k :])
            copy_into(acc[cut:], x[: root * k])
    else:
        acc = L.empty(span * k, out.dtype)
        L.wait(L.recv((v - (v & -v) + root) % n, acc))
    mask = 1
    while mask < span:
        mask <<= 1
    mask >>= 1
    while mask:  # the largest subtree first
        child = v + mask
        if child < n:
            got = min(mask, n - child)
            L.send((child + root) % n, acc[mask * k : (mask + got) * k])
        mask >>= 1
    if v:
        copy_into(out, acc[:k])
    else:
        place_root(True, r, x, out)
    L.finish()


# ------------------------------------------------------------------ v-variants
@register("allgatherv", "ring")
def allgatherv(L: Links, x: Any, out: Any, counts: Any) -> None:
    n, r = L.size, L.rank
    right, left = (r + 1) % n, (r - 1) % n
    d = displacements(counts)

    def blk(b: int) -> Any:
        b %= n
        return out[d[b] : d[b + 1]]

    for s in range(n - 1):
        L.send(right, blk(r - s))
        L.wait(L.recv(left, blk(r - s - 1)))
    L.finish()


@register("reduce_scatterv", "ring")
def reduce_scatterv(L: Links, x: Any, out: Any, counts: Any) -> None:
    _reduce_scatter(L, x, displacements(counts), out)
