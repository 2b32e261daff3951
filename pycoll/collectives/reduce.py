"""reduce: the reduction of every rank's ``sendbuf`` lands in ``recvbuf`` on ``root``.

On the root ``recvbuf=None`` is in place (into ``sendbuf``); the other ranks
ignore ``recvbuf`` and reduce through scratch; ``avg`` divides on the root.
The call returns the output on the root and None elsewhere.
"""

from __future__ import annotations

from typing import Any

from pycoll.buffers import Buffer, as_buffer
from pycoll.collectives.base import (
    ArrayOps,
    Collective,
    Prepare,
    Spec,
    Step,
    check_alias,
    check_root,
    output,
    reducing,
)
from pycoll.reduce import ReduceOp, check_op_dtype, parse_op


class Reduce(Collective):
    windows = True
    name = "reduce"
    ident = 5
    signature = ("x", "out", "root")
    reduces = True

    def check(
        self, n: int, r: int, sendbuf: Any, recvbuf: Any, op: Any, root: Any, extra: Any = None
    ) -> Spec:
        what = self.name
        root = check_root(root, n, r, what)
        rop = parse_op(op, r, what)
        is_root = r == root
        x = as_buffer(sendbuf, r, what, "sendbuf", writable=is_root and recvbuf is None)
        out: Buffer | None = None
        in_place = False
        if is_root:
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
            root,
            given=is_root and recvbuf is not None,
            in_place=in_place,
            x_written=is_root and recvbuf is None,
            result=None if out is None else out.obj,
        )

    def envelope(self, spec: Spec, step: Step | None, ops: ArrayOps) -> Prepare:
        copy = spec.n == 1 and not spec.in_place
        avg = spec.op is ReduceOp.AVG and spec.r == spec.root
        return reducing(step, ops, spec.n, spec.x.dtype, copy=copy, avg=avg, scratch=True)


REDUCE = Reduce()
