"""Dissemination barrier: ceil(log2 n) rounds; in round k rank r signals
``r + 2^k`` and waits for ``r - 2^k`` (mod n), one byte each way.

A rank leaves once it has heard, directly or through the chain, from every
other rank.  (On one host the ``direct`` barrier, one step on the group
segment, takes its place.)
"""

from __future__ import annotations

import numpy as np

from pycoll.algorithms.links import Links
from pycoll.algorithms.registry import register


@register("barrier", "dissemination")
def barrier(L: Links) -> None:
    n, r = L.size, L.rank
    token = np.zeros(1, np.uint8)
    got = np.empty(1, np.uint8)
    d = 1
    while d < n:
        L.send((r + d) % n, token)
        L.wait(L.recv((r - d) % n, got))
        d <<= 1
    L.finish()
