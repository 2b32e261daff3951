"""reduce_scatterv: ``sendbuf`` holds the sum of ``counts`` elements; rank r
gets the reduction of every rank's block r (``counts[r]`` elements, at the
prefix sum of the counts before r).

Every rank passes the same ``counts``; counts may be zero.  The output may not
overlap the input.
"""

from __future__ import annotations

from typing import Any

from pycoll.buffers import as_buffer
from pycoll.collectives.base import (
    ArrayOps,
    Prepare,
    Spec,
    Step,
    check_alias,
    output,
    reducing,
)
from pycoll.collectives.vcounts import Counted, counts, digest
from pycoll.errors import InvalidArgumentError
from pycoll.reduce import ReduceOp, check_op_dtype, parse_op


class ReduceScatterv(Counted):
    name = "reduce_scatterv"
    ident = 11
    reduces = True

    def check(
        self, n: int, r: int, sendbuf: Any, recvbuf: Any, op: Any, root: Any, extra: Any = None
    ) -> Spec:
        what = self.name
        cs = counts(extra, n, r, what, "counts")
        rop = parse_op(op, r, what)
        x = as_buffer(sendbuf, r, what, "sendbuf", writable=False)
        if x.count != sum(cs):
            raise InvalidArgumentError(
                f"rank {r}: {what}: sendbuf has {x.count} elements but the counts sum to {sum(cs)}"
            )
        if recvbuf is None:
            raise InvalidArgumentError(f"rank {r}: {what}: recvbuf is required ({cs[r]} elements)")
        out = output(recvbuf, x, cs[r], r, what)
        check_alias(x, out, None, r, what)
        check_op_dtype(rop, x.dtype, r, what)
        return Spec(
            self,
            n,
            r,
            x,
            out,
            rop,
            0,
            given=True,
            in_place=False,
            x_written=False,
            result=out.obj,
            count=sum(cs),
            layout=digest(cs),
            counts=cs,
        )

    def envelope(self, spec: Spec, step: Step | None, ops: ArrayOps) -> Prepare:
        avg = spec.op is ReduceOp.AVG
        return reducing(step, ops, spec.n, spec.x.dtype, copy=spec.n == 1, avg=avg)


REDUCE_SCATTERV = ReduceScatterv()
