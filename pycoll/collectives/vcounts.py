"""What the v-variants share: per-rank element counts, checked into a tuple of
ints and digested for the call's fingerprint, and handed to their algorithms."""

from __future__ import annotations

import zlib
from typing import Any

import numpy as np

from pycoll.collectives.base import Collective, Spec
from pycoll.errors import InvalidArgumentError


def counts(v: Any, n: int, r: int, what: str, arg: str) -> tuple[int, ...]:
    """``v`` as ``n`` non-negative ints.

    Raises:
        InvalidArgumentError: not ``n`` of them, or a negative or non-integer one.
    """
    try:
        got = tuple(v)
    except TypeError:
        raise InvalidArgumentError(
            f"rank {r}: {what}: {arg} must be a sequence of {n} element counts, got {v!r}"
        ) from None
    ok = all(isinstance(c, (int, np.integer)) and not isinstance(c, bool) and c >= 0 for c in got)
    if len(got) != n or not ok:
        raise InvalidArgumentError(
            f"rank {r}: {what}: {arg}={list(got)!r} must be {n} non-negative integers "
            "(one element count per rank)"
        )
    return tuple(int(c) for c in got)


def digest(cs: tuple[int, ...]) -> int:
    """A digest of counts every rank passes alike (0 never: 0 means none)."""
    return zlib.crc32(np.asarray(cs, np.int64).tobytes()) or 1


class Counted(Collective):
    """A v-variant: its algorithms take the counts after the arrays, and calls of
    it are not replayed (the counts may change while the arrays stay)."""

    plannable = False

    def moves(self, spec: Spec) -> bool:
        return spec.n > 1 and spec.fp_count > 0

    def args(self, spec: Spec, x: Any, out: Any) -> tuple[Any, ...]:
        return (x, out, spec.counts)
