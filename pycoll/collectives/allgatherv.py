"""allgatherv: rank j's ``sendbuf`` (``counts[j]`` elements) into everyone's
output at the prefix sum of the counts before j.

Every rank passes the same ``counts``; ``recvbuf`` holds their sum.  In place,
``sendbuf`` is rank r's block of ``recvbuf`` itself.  Counts may be zero.
"""

from __future__ import annotations

from functools import partial
from typing import Any

from pycoll.buffers import as_buffer
from pycoll.collectives.base import (
    ArrayOps,
    Prepare,
    Spec,
    Step,
    check_alias,
    nothing,
    output,
    own_then,
)
from pycoll.collectives.vcounts import Counted, counts, digest
from pycoll.errors import InvalidArgumentError


class Allgatherv(Counted):
    name = "allgatherv"
    ident = 10

    def check(
        self, n: int, r: int, sendbuf: Any, recvbuf: Any, op: Any, root: Any, extra: Any = None
    ) -> Spec:
        what = self.name
        cs = counts(extra, n, r, what, "counts")
        x = as_buffer(sendbuf, r, what, "sendbuf", writable=False)
        if x.count != cs[r]:
            raise InvalidArgumentError(
                f"rank {r}: {what}: sendbuf has {x.count} elements but counts[{r}] is {cs[r]}"
            )
        if recvbuf is None:
            raise InvalidArgumentError(
                f"rank {r}: {what}: recvbuf is required ({sum(cs)} elements)"
            )
        out = output(recvbuf, x, sum(cs), r, what)
        at = sum(cs[:r]) * x.dtype.itemsize
        how = f"sendbuf must be exactly rank {r}'s block of recvbuf"
        in_place = check_alias(x, out, at, r, what, how)
        return Spec(
            self,
            n,
            r,
            x,
            out,
            None,
            0,
            given=True,
            in_place=in_place,
            x_written=False,
            result=out.obj,
            count=sum(cs),
            layout=digest(cs),
            counts=cs,
        )

    def envelope(self, spec: Spec, step: Step | None, ops: ArrayOps) -> Prepare:
        r = spec.r
        lo = sum(spec.counts[:r])
        hi = lo + spec.counts[r]
        if spec.in_place:
            return nothing if step is None else partial(partial, step)
        return own_then(step, ops, lambda x, out: (out[lo:hi], x))


ALLGATHERV = Allgatherv()
