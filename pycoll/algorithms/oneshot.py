"""One-shot allreduce for small messages: one step, whatever n.

Every rank sends its whole buffer to every other rank, then reduces the n
contributions itself in rank order, ``((x0 OP x1) OP x2) ...``: the same
operands in the same order on every rank, so all ranks hold the same bits.
Latency is one step (the ring needs 2(n-1), the tree 2 log n); bytes sent per
rank are (n-1) * N, so it is only for small N.  With n = 2 the peer's bytes are
reduced straight out of the transport.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from pycoll.algorithms.links import Links
from pycoll.algorithms.registry import register
from pycoll.reduce import reduce_rows


@register("allreduce", "oneshot")
def allreduce(L: Links, x: Any, out: Any) -> None:
    n, r = L.size, L.rank
    # In place, our own bytes must not change while a send may still read them.
    src = x.copy() if np.shares_memory(x, out) else x
    if n == 2:
        peer = 1 - r
        L.send(peer, src)
        L.wait(L.recv_reduce(peer, out, src, incoming_first=r == 1))
        L.finish()
        return
    rows = L.empty((n, x.size), x.dtype)
    for p in range(n):
        if p != r:
            L.send(p, src)
    L.wait(*[L.recv(p, rows[p]) for p in range(n) if p != r])
    rows[r] = src
    assert L.reduce is not None
    reduce_rows(L.reduce, rows, out)
    L.finish()
