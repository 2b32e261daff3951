"""gather: every rank's ``sendbuf`` (k elements) into the root's output, rank-major.

On the root the output holds ``n * k`` elements (``recvbuf=None`` allocates one
of shape ``(n, *sendbuf.shape)``); in place, ``sendbuf`` is block ``root`` of
``recvbuf``.  Other ranks ignore ``recvbuf``; the call returns the output on
the root and None elsewhere.  On the host, from a block of more than
:data:`~pycoll.buffers.ROOT_PLACED_MIN` bytes, the root's algorithm copies its
own block (:func:`~pycoll.buffers.place_root`), ``direct`` by address while the
other ranks write theirs; below that, the envelope copies it first.
"""

from __future__ import annotations

from functools import partial
from typing import Any

from pycoll.buffers import Buffer, as_buffer, root_placed
from pycoll.collectives.base import (
    HOST,
    ArrayOps,
    Collective,
    Prepare,
    Spec,
    Step,
    check_alias,
    check_root,
    empty_like,
    nothing,
    output,
    own_then,
)


class Gather(Collective):
    name = "gather"
    ident = 8
    signature = ("x", "out", "root")

    def check(
        self, n: int, r: int, sendbuf: Any, recvbuf: Any, op: Any, root: Any, extra: Any = None
    ) -> Spec:
        what = self.name
        root = check_root(root, n, r, what)
        x = as_buffer(sendbuf, r, what, "sendbuf", writable=False)
        out: Buffer | None = None
        in_place = given = False
        if r == root:
            given = recvbuf is not None
            if not given:
                recvbuf = empty_like(x, (n, *x.shape))
            out = output(recvbuf, x, n * x.count, r, what)
            how = f"sendbuf must be exactly block {r} of recvbuf"
            in_place = check_alias(x, out, r * x.nbytes, r, what, how)
        return Spec(
            self,
            n,
            r,
            x,
            out,
            None,
            root,
            given=given,
            in_place=in_place,
            x_written=False,
            result=None if out is None else out.obj,
        )

    def fresh_shape(self, spec: Spec) -> tuple[int, ...] | None:
        if spec.r != spec.root or spec.given:
            return None
        return (spec.n, *spec.x.shape)

    def staging(self, spec: Spec) -> tuple[bool, bool]:
        return True, spec.r == spec.root

    def envelope(self, spec: Spec, step: Step | None, ops: ArrayOps) -> Prepare:
        r, k = spec.r, spec.x.count
        if r != spec.root or spec.in_place:
            return nothing if step is None else partial(partial, step)
        if step is not None and ops is HOST and root_placed(spec.x.nbytes):
            return partial(partial, step)  # the algorithm copies it (see the module)
        return own_then(step, ops, lambda x, out: (out[r * k : (r + 1) * k], x))


GATHER = Gather()
