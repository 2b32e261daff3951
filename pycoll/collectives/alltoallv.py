"""alltoallv: ``sendcounts[j]`` elements of ``sendbuf`` (at their prefix sum) go
to rank j, which receives them as its ``recvcounts[i]`` elements from rank i.

Every pair must agree (``sendcounts[j]`` on rank i equals ``recvcounts[i]`` on
rank j); a pair that does not fails the call loudly on the receiving side, as
two messages of different sizes.  Counts may be zero.  The output may not
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
    own_then,
)
from pycoll.collectives.vcounts import Counted, counts
from pycoll.errors import InvalidArgumentError


class Alltoallv(Counted):
    name = "alltoallv"
    ident = 12

    def check(
        self, n: int, r: int, sendbuf: Any, recvbuf: Any, op: Any, root: Any, extra: Any = None
    ) -> Spec:
        what = self.name
        sc = counts(extra[0], n, r, what, "sendcounts")
        rc = counts(extra[1], n, r, what, "recvcounts")
        x = as_buffer(sendbuf, r, what, "sendbuf", writable=False)
        if x.count != sum(sc):
            raise InvalidArgumentError(
                f"rank {r}: {what}: sendbuf has {x.count} elements but sendcounts sum to {sum(sc)}"
            )
        if rc[r] != sc[r]:
            raise InvalidArgumentError(
                f"rank {r}: {what}: sendcounts[{r}]={sc[r]} but recvcounts[{r}]={rc[r]}: "
                "what a rank sends itself it receives"
            )
        out = output(recvbuf, x, sum(rc), r, what)
        check_alias(x, out, None, r, what)
        # every rank's counts differ: the fingerprint names none of them
        return Spec(
            self,
            n,
            r,
            x,
            out,
            None,
            0,
            given=True,
            in_place=False,
            x_written=False,
            result=out.obj,
            count=0,
            counts=(sc, rc),
        )

    def moves(self, spec: Spec) -> bool:
        return spec.n > 1

    def envelope(self, spec: Spec, step: Step | None, ops: ArrayOps) -> Prepare:
        r = spec.r
        sc, rc = spec.counts
        s0, r0 = sum(sc[:r]), sum(rc[:r])
        m = sc[r]
        return own_then(step, ops, lambda x, out: (out[r0 : r0 + m], x[s0 : s0 + m]))


ALLTOALLV = Alltoallv()
