"""alltoall: block j of every rank's ``sendbuf`` goes to rank j.

``sendbuf`` holds ``n * k`` elements; the output, of the same size, holds
block r of every rank, rank-major (block j came from rank j).  ``recvbuf=None``
allocates one of ``sendbuf``'s shape each call.  The output may not overlap
the input; the envelope copies a rank's own block, the algorithm the others.
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
    own_then,
)


class Alltoall(Collective):
    name = "alltoall"
    ident = 7

    def check(
        self, n: int, r: int, sendbuf: Any, recvbuf: Any, op: Any, root: Any, extra: Any = None
    ) -> Spec:
        what = self.name
        x = as_buffer(sendbuf, r, what, "sendbuf", writable=False)
        blocks(x, n, r, what)
        given = recvbuf is not None
        if not given:
            recvbuf = empty_like(x, x.shape)
        out = output(recvbuf, x, x.count, r, what)
        check_alias(x, out, None, r, what)
        return Spec(
            self,
            n,
            r,
            x,
            out,
            None,
            0,
            given=given,
            in_place=False,
            x_written=False,
            result=out.obj,
        )

    def fresh_shape(self, spec: Spec) -> tuple[int, ...] | None:
        return None if spec.given else spec.x.shape

    def envelope(self, spec: Spec, step: Step | None, ops: ArrayOps) -> Prepare:
        r, k = spec.r, spec.x.count // spec.n
        return own_then(
            step, ops, lambda x, out: (out[r * k : (r + 1) * k], x[r * k : (r + 1) * k])
        )


ALLTOALL = Alltoall()
