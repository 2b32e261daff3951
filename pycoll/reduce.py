"""Reduction operators and the dtypes they apply to, on host (NumPy) arrays.

A reduction writes ``out = a OP b`` elementwise.  The order in which the
algorithms combine contributions is fixed for a given (n, algorithm, size), so
every rank gets bitwise-identical results run after run.

Which op applies to which dtype (:func:`check_op_dtype`):

========================  ===========================================  =========
dtypes                    ops                                          rejected
========================  ===========================================  =========
bool                      band, bor, bxor, min (= band), max (= bor)   sum, prod, avg
int8 ... uint64           sum, prod, min, max, band, bor, bxor         avg
float16 ... float64       sum, prod, min, max, avg                     band, bor, bxor
complex64, complex128     sum, prod, avg                               min, max, band, bor, bxor
========================  ===========================================  =========

``sum`` and ``prod`` of bools are rejected: NumPy's elementwise ``add`` makes
them a logical or, while ``numpy.sum`` and ``torch.sum`` count, and NCCL (through
torch) turns them into max and min; pycoll takes neither guess.  ``avg`` of
integers would truncate differently across libraries; complex numbers have no
order.  Sums and products wrap in integer dtypes, as in NumPy.
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
    BAND = "band"
    BOR = "bor"
    BXOR = "bxor"


#: The dtypes pycoll supports, by name.
DTYPES: dict[str, np.dtype[Any]] = {
    name: np.dtype(t)
    for name, t in (
        ("bool", np.bool_),
        ("int8", np.int8),
        ("uint8", np.uint8),
        ("int16", np.int16),
        ("uint16", np.uint16),
        ("int32", np.int32),
        ("uint32", np.uint32),
        ("int64", np.int64),
        ("uint64", np.uint64),
        ("float16", np.float16),
        ("bfloat16", ml_dtypes.bfloat16),
        ("float32", np.float32),
        ("float64", np.float64),
        ("complex64", np.complex64),
        ("complex128", np.complex128),
    )
}
_SUPPORTED = frozenset(DTYPES.values())

_UFUNC: dict[ReduceOp, Callable[..., Any]] = {
    ReduceOp.SUM: np.add,
    ReduceOp.AVG: np.add,  # divided by n once at the end
    ReduceOp.PROD: np.multiply,
    ReduceOp.MIN: np.minimum,
    ReduceOp.MAX: np.maximum,
    ReduceOp.BAND: np.bitwise_and,
    ReduceOp.BOR: np.bitwise_or,
    ReduceOp.BXOR: np.bitwise_xor,
}
#: Ufuncs that take their output by keyword only: NumPy 2.4 deprecates a third
#: positional argument of maximum and minimum.
_OUT_BY_KEYWORD = (np.maximum, np.minimum)

_BITWISE = frozenset({ReduceOp.BAND, ReduceOp.BOR, ReduceOp.BXOR})
#: The ops of each family of dtypes (see the module's table).
_OPS_OF = {
    "bool": frozenset({ReduceOp.MIN, ReduceOp.MAX}) | _BITWISE,
    "integer": frozenset({ReduceOp.SUM, ReduceOp.PROD, ReduceOp.MIN, ReduceOp.MAX}) | _BITWISE,
    "floating": frozenset({ReduceOp.SUM, ReduceOp.PROD, ReduceOp.MIN, ReduceOp.MAX, ReduceOp.AVG}),
    "complex": frozenset({ReduceOp.SUM, ReduceOp.PROD, ReduceOp.AVG}),
}
_WHY = {
    ("bool", ReduceOp.SUM): "NumPy's add makes it a logical or, numpy.sum and torch.sum "
    "count; use 'bor' (any) or sum an integer copy to count",
    ("bool", ReduceOp.PROD): "use 'band' (all)",
    ("bool", ReduceOp.AVG): "use 'bor' or 'band', or average a floating copy",
    ("integer", ReduceOp.AVG): "integer averages would truncate differently across "
    "libraries; use op='sum' and divide",
    ("complex", ReduceOp.MIN): "complex numbers have no order",
    ("complex", ReduceOp.MAX): "complex numbers have no order",
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


def family(dtype: np.dtype[Any]) -> str:
    """``"bool"``, ``"integer"``, ``"floating"`` (bfloat16 too) or ``"complex"``."""
    kind = dtype.kind
    if kind == "b":
        return "bool"
    if kind in "iu":
        return "integer"
    return "complex" if kind == "c" else "floating"


def supports(op: ReduceOp, dtype: np.dtype[Any]) -> bool:
    """Whether pycoll reduces ``dtype`` (a supported one) with ``op``."""
    return op in _OPS_OF[family(dtype)]


def check_op_dtype(op: ReduceOp, dtype: np.dtype[Any], rank: int, what: str) -> None:
    """Raise unless ``op`` applies to ``dtype`` (see the module's table).

    Raises:
        InvalidArgumentError: naming the rank, the op, the dtype and what to use.
    """
    fam = family(dtype)
    if op in _OPS_OF[fam]:
        return
    why = _WHY.get((fam, op))
    if why is None and op in _BITWISE:
        why = "bitwise ops take integer and bool dtypes"
    takes = ", ".join(repr(o.value) for o in ReduceOp if o in _OPS_OF[fam])
    raise InvalidArgumentError(
        f"rank {rank}: {what}: op={op.value!r} does not apply to dtype {dtype} ({why}); "
        f"{dtype} takes {takes}"
    )


def ufunc(op: ReduceOp) -> Callable[..., Any]:
    return _UFUNC[op]


def reduce_rows(f: Callable[..., Any], rows: Any, out: Any) -> None:
    """``out = ((rows[0] OP rows[1]) OP rows[2]) ...``: the contributions in rank
    order, the same operands in the same order on every rank (so the same bits);
    ``f(a, b, c)`` (``c = a OP b``) is the op's ufunc.  ``out`` may be ``rows[0]``
    or ``rows[1]``.  (The output goes by position: a keyword costs each call of a
    NumPy ufunc about 40 ns more, a tenth of the call at small sizes; but maximum
    and minimum take it by keyword, see :data:`_OUT_BY_KEYWORD`.)"""
    if f in _OUT_BY_KEYWORD:
        f(rows[0], rows[1], out=out)
        for row in rows[2:]:
            f(out, row, out=out)
        return
    f(rows[0], rows[1], out)
    for row in rows[2:]:
        f(out, row, out)


def finish_avg(out: Any, n: int) -> None:
    """Turn a sum into an average in place (every rank does the same operation)."""
    np.divide(out, out.dtype.type(n), out=out)
