"""reduce_scatter: ``sendbuf`` holds ``n * k`` elements; rank r gets the
reduction of every rank's block r (``k`` elements).

``recvbuf=None`` allocates a new 1-D output each call; there is no in-place
form (the output may not overlap the input).
"""

from __future__ import annotations

from typing import Any

from pycoll.buffers import as_buffer
from pycoll.collectives.base import (
    ArrayOps,
    Collective,
    Prepare,
    Spec,
    Step,
    blocks,
    check_alias,
    empty_like,
    output,
    reducing,
)
from pycoll.reduce import ReduceOp, check_op_dtype, parse_op


class ReduceScatter(Collective):
    windows = True
    name = "reduce_scatter"
    ident = 4
    reduces = True

    def check(
        self, n: int, r: int, sendbuf: Any, recvbuf: Any, op: Any, root: Any, extra: Any = None
    ) -> Spec:
        what = self.name
        rop = parse_op(op, r, what)
        x = as_buffer(sendbuf, r, what, "sendbuf", writable=False)
        k = blocks(x, n, r, what)
        given = recvbuf is not None
        if not given:
            recvbuf = empty_like(x, (k,))
        out = output(recvbuf, x, k, r, what)
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
            given=given,
            in_place=False,
            x_written=False,
            result=out.obj,
        )

    def fresh_shape(self, spec: Spec) -> tuple[int, ...] | None:
        return None if spec.given else (spec.x.count // spec.n,)

    def envelope(self, spec: Spec, step: Step | None, ops: ArrayOps) -> Prepare:
        avg = spec.op is ReduceOp.AVG
        return reducing(step, ops, spec.n, spec.x.dtype, copy=spec.n == 1, avg=avg)


REDUCE_SCATTER = ReduceScatter()
