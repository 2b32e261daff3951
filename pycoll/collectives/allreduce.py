"""allreduce: every rank gets the reduction of every rank's ``sendbuf``.

``recvbuf=None`` is in place (the result lands in ``sendbuf``); a rank alone
copies; ``avg`` divides the sum by n on every rank.  An empty call still steps
with its peers (:attr:`Collective.always_steps`).
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
    check_alias,
    output,
    reducing,
)
from pycoll.reduce import ReduceOp, check_op_dtype, parse_op


class Allreduce(Collective):
    windows = True
    name = "allreduce"
    ident = 1
    reduces = True
    always_steps = True

    def check(
        self, n: int, r: int, sendbuf: Any, recvbuf: Any, op: Any, root: Any, extra: Any = None
    ) -> Spec:
        what = self.name
        rop = parse_op(op, r, what)
        x = as_buffer(sendbuf, r, what, "sendbuf", writable=recvbuf is None)
        out = x if recvbuf is None else output(recvbuf, x, x.count, r, what)
        in_place = check_alias(x, out, 0, r, what)
        check_op_dtype(rop, x.dtype, r, what)
        return Spec(
            self,
            n,
            r,
            x,
            out,
            rop,
            0,
            given=recvbuf is not None,
            in_place=in_place,
            x_written=recvbuf is None,
            result=out.obj,
        )

    def envelope(self, spec: Spec, step: Step | None, ops: ArrayOps) -> Prepare:
        copy = step is None and not spec.in_place  # alone
        avg = spec.op is ReduceOp.AVG
        return reducing(step, ops, spec.n, spec.x.dtype, copy=copy, avg=avg)


ALLREDUCE = Allreduce()
