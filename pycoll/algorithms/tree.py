"""Tree algorithms: logarithmic latency, pipelined in chunks.

Binary tree (:func:`btree`): ranks are laid out in order and a node's parent is
found from its lowest set bit, so the tree is balanced, leaves are the odd
ranks and interior nodes the even ones; rank 0 is the root and has one child.

Double binary tree (:func:`double_btree`), as NCCL builds it: the second tree
is the first mirrored (odd n) or shifted by one (even n), so a rank that is
interior in one tree is a leaf in the other and both directions of each link
carry data.  allreduce sends the first half of the buffer through tree A and
the second half through tree B.

allreduce, per tree and per chunk: reduce up (a node computes
``x OP child0 OP child1`` in that order, receiving child0's bytes straight into
the reduction), then broadcast down.  The down phase lags the up phase by a few
chunks so that the two overlap.  The root's result is copied to everyone, so all
ranks hold the same bits.  Per rank about 2N bytes leave an interior node.

broadcast: pipelined along a binary tree rooted at ``root`` (ranks relabelled
``v = r - root``): each chunk is forwarded to the children as soon as it arrives.

reduce: the up phase alone, on a tree rooted at ``root``.

allgather: binomial gather of the blocks to rank 0, then a tree broadcast.

reduce_scatter: a tree reduce to rank 0, which then sends each rank its block.
"""

from __future__ import annotations

from typing import Any

from pycoll.algorithms.links import Links
from pycoll.algorithms.registry import register
from pycoll.buffers import copy_into, place_own


def btree(n: int, r: int) -> tuple[int | None, list[int]]:
    """(parent, children) of rank ``r`` in the in-order binary tree of ``n`` ranks."""
    if n <= 1:
        return None, []
    bit = 1
    while bit < n and not (bit & r):
        bit <<= 1
    if r == 0:
        return None, [bit >> 1]
    up = (r ^ bit) | (bit << 1)
    if up >= n:
        up = r ^ bit
    low = bit >> 1
    children: list[int] = []
    if low:
        children.append(r - low)
        while low and r + low >= n:
            low >>= 1
        if low:
            children.append(r + low)
    return up, children


def double_btree(n: int, r: int) -> list[tuple[int | None, list[int]]]:
    """The two trees of the double binary tree, as (parent, children) of rank ``r``."""
    a = btree(n, r)
    if n % 2:
        to_v = lambda x: n - 1 - x
        to_r = to_v
    else:
        to_v = lambda x: (x - 1) % n
        to_r = lambda v: (v + 1) % n
    p, ch = btree(n, to_v(r))
    b = (None if p is None else to_r(p), [to_r(c) for c in ch])
    return [a, b]


def rooted_btree(n: int, r: int, root: int) -> tuple[int | None, list[int]]:
    """The binary tree relabelled so that ``root`` is its root."""
    p, ch = btree(n, (r - root) % n)
    return (None if p is None else (p + root) % n), [(c + root) % n for c in ch]


def depth(n: int) -> int:
    d = 0
    while (1 << d) < n:
        d += 1
    return d + 1


def _chunks(lo: int, hi: int, chunk: int) -> list[slice]:
    return [slice(a, min(a + chunk, hi)) for a in range(lo, hi, chunk)]


class _Up:
    """Reduce-up state of one tree over one range of the buffer."""

    def __init__(
        self, L: Links, tree: tuple[int | None, list[int]], lo: int, hi: int, dtype: Any
    ) -> None:
        self.parent, self.children = tree
        self.parts = _chunks(lo, hi, L.chunk_elems)
        self.scratch = (
            L.empty(min(L.chunk_elems, hi - lo), dtype) if len(self.children) > 1 else None
        )


def _up_post(L: Links, job: _Up, c: int, x: Any, out: Any) -> list[Any]:
    sl = job.parts[c]
    reqs = []
    ch = job.children
    if ch:  # the lower rank's operand first: at n = 2, x0 OP x1 whichever tree
        reqs.append(L.recv_reduce(ch[0], out[sl], x[sl], ch[0] < L.rank))
    for child in ch[1:]:
        assert job.scratch is not None
        reqs.append(L.recv(child, job.scratch[: sl.stop - sl.start]))
    return reqs


def _up_finish(L: Links, job: _Up, c: int, x: Any, out: Any) -> None:
    sl = job.parts[c]
    if len(job.children) > 1:
        assert job.scratch is not None and L.reduce is not None
        L.reduce(out[sl], job.scratch[: sl.stop - sl.start], out=out[sl])
    if job.parent is not None:
        L.send(job.parent, out[sl] if job.children else x[sl])
    elif not job.children and out is not x:
        copy_into(out[sl], x[sl])


@register("allreduce", "tree")
def allreduce(L: Links, x: Any, out: Any) -> None:
    n, r = L.size, L.rank
    count = x.size
    mid = (count + 1) // 2
    trees = double_btree(n, r)
    jobs = [_Up(L, trees[0], 0, mid, x.dtype), _Up(L, trees[1], mid, count, x.dtype)]
    nch = max(len(j.parts) for j in jobs)
    lag = depth(n)
    # Jobs are handled one after the other within each phase: a node that is
    # interior in both trees must not wait on tree B before it has fed tree A
    # (that wait can depend on its own tree-A bytes), and likewise going down.
    for t in range(nch + lag):
        if t < nch:
            for j in jobs:
                if t < len(j.parts):
                    L.wait(*_up_post(L, j, t, x, out))
                    _up_finish(L, j, t, x, out)
        d = t - lag
        if d < 0:
            continue
        for j in jobs:
            if d < len(j.parts):
                sl = j.parts[d]
                if j.parent is not None:
                    L.wait(L.recv(j.parent, out[sl]))
                for child in j.children:
                    L.send(child, out[sl])
    L.finish()


@register("reduce", "tree")
def reduce(L: Links, x: Any, out: Any, root: int) -> None:
    job = _Up(L, rooted_btree(L.size, L.rank, root), 0, x.size, x.dtype)
    for c in range(len(job.parts)):
        L.wait(*_up_post(L, job, c, x, out))
        _up_finish(L, job, c, x, out)
    L.finish()


def pipelined_broadcast(L: Links, buf: Any, parent: int | None, children: list[int]) -> None:
    """Forward ``buf`` chunk by chunk from ``parent`` (None at the root) to ``children``."""
    parts = _chunks(0, buf.size, L.chunk_elems)
    if parent is None:
        for sl in parts:
            for child in children:
                L.send(child, buf[sl])
    else:
        recvs = [L.recv(parent, buf[sl]) for sl in parts]
        for sl, req in zip(parts, recvs, strict=True):
            L.wait(req)
            for child in children:
                L.send(child, buf[sl])
    L.finish()


@register("broadcast", "tree")
def broadcast(L: Links, buf: Any, root: int) -> None:
    parent, children = rooted_btree(L.size, L.rank, root)
    pipelined_broadcast(L, buf, parent, children)


@register("allgather", "tree")
def allgather(L: Links, x: Any, out: Any) -> None:
    n, r = L.size, L.rank
    k = x.size
    place_own(r, x, out)
    # binomial gather to rank 0: rank r owns blocks [r, r + 2^j) after round j
    bit = 1
    while bit < n:
        if r & bit:
            L.send(r - bit, out[r * k : min(r + bit, n) * k])
            break
        if r + bit < n:
            L.wait(L.recv(r + bit, out[(r + bit) * k : min(r + 2 * bit, n) * k]))
        bit <<= 1
    L.finish()
    broadcast(L, out, 0)


@register("reduce_scatter", "tree")
def reduce_scatter(L: Links, x: Any, out: Any) -> None:
    n, r = L.size, L.rank
    k = out.size
    full = L.empty(x.size, x.dtype) if r == 0 else None
    reduce(L, x, full if full is not None else L.empty(x.size, x.dtype), 0)
    if r == 0:
        assert full is not None
        for p in range(1, n):
            L.send(p, full[p * k : (p + 1) * k])
        copy_into(out, full[:k])
    else:
        L.wait(L.recv(0, out))
    L.finish()
