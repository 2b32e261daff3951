"""Reduction operators and the dtypes they apply to, on host (NumPy) arrays.

A reduction writes ``out = a OP b`` elementwise.  The order in which the
algorithms combine contributions is fixed for a given (n, algorithm, size), so
every rank gets bitwise-identical results run after run.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from typing import Any

import ml_dtypes
import numpy as np

from pycoll.errors import InvalidArgumentError


class ReduceOp(enum.Enum):
    """Reduction operators (the names are also accepted as lowercase strings)."""

    SUM = "sum"
    PROD = "prod"
    MIN = "min"
    MAX = "max"
    AVG = "avg"


#: The dtypes pycoll supports, by name.
DTYPES: dict[str, np.dtype[Any]] = {
    name: np.dtype(t)
    for name, t in (
        ("int8", np.int8),
        ("uint8", np.uint8),
        ("int32", np.int32),
        ("uint32", np.uint32),
        ("int64", np.int64),
        ("uint64", np.uint64),
        ("float16", np.float16),
        ("bfloat16", ml_dtypes.bfloat16),
        ("float32", np.float32),
        ("float64", np.float64),
    )
}
_SUPPORTED = frozenset(DTYPES.values())

_UFUNC: dict[ReduceOp, Callable[..., Any]] = {
    ReduceOp.SUM: np.add,
    ReduceOp.AVG: np.add,  # divided by n once at the end
    ReduceOp.PROD: np.multiply,
    ReduceOp.MIN: np.minimum,
    ReduceOp.MAX: np.maximum,
}


_BY_NAME = {o.value: o for o in ReduceOp}


def parse_op(op: object, rank: int, what: str) -> ReduceOp:
    if isinstance(op, ReduceOp):
        return op
    rop = _BY_NAME.get(op) if isinstance(op, str) else None  # the common case, lowercase
    if rop is not None:
        return rop
    if isinstance(op, str):
        try:
            return ReduceOp(op.lower())
        except ValueError:
            pass
    raise InvalidArgumentError(
        f"rank {rank}: {what}: op={op!r} is not one of {', '.join(repr(o.value) for o in ReduceOp)}"
    )


def check_dtype(dtype: np.dtype[Any], rank: int, what: str, arg: str) -> None:
    if dtype not in _SUPPORTED:
        raise InvalidArgumentError(
            f"rank {rank}: {what}: {arg} has dtype {dtype}, which pycoll does not support; "
            f"use one of {', '.join(DTYPES)}"
        )


def check_op_dtype(op: ReduceOp, dtype: np.dtype[Any], rank: int, what: str) -> None:
    if op is ReduceOp.AVG and dtype.kind in "iu":
        raise InvalidArgumentError(
            f"rank {rank}: {what}: op='avg' needs a floating dtype, got {dtype} "
            "(integer averages would truncate differently across libraries; "
            "use op='sum' and divide)"
        )


def ufunc(op: ReduceOp) -> Callable[..., Any]:
    return _UFUNC[op]


def reduce_rows(f: Callable[..., Any], rows: Any, out: Any) -> None:
    """``out = ((rows[0] OP rows[1]) OP rows[2]) ...``: the contributions in rank
    order, the same operands in the same order on every rank (so the same bits);
    ``f(a, b, c)`` (``c = a OP b``) is the op's ufunc.  ``out`` may be ``rows[0]``
    or ``rows[1]``.  (The output goes by position: a keyword costs each call of a
    NumPy ufunc about 40 ns more, a tenth of the call at small sizes.)"""
    f(rows[0], rows[1], out)
    for row in rows[2:]:
        f(out, row, out)


def finish_avg(out: Any, n: int) -> None:
    """Turn a sum into an average in place (every rank does the same operation)."""
    np.divide(out, out.dtype.type(n), out=out)
