"""Collective algorithms over :class:`~pycoll.algorithms.links.Links`.

Each algorithm is one function in one module, registered under a name for a
collective; ``auto`` picks by :mod:`pycoll.algorithms.cost`.
"""

from __future__ import annotations

from pycoll.algorithms import (  # noqa: F401 - registers the algorithms
    direct,
    dissemination,
    exchange,
    oneshot,
    ring,
    tree,
)
from pycoll.algorithms.registry import ALGORITHMS, get, names

__all__ = ["ALGORITHMS", "get", "names"]
