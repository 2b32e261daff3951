"""scatter: block j of the root's ``sendbuf`` (``n * k`` elements) into rank j's ``recvbuf``.

Every rank passes ``recvbuf`` (k elements); other ranks than the root ignore
``sendbuf`` (None will do).  In place on the root, ``recvbuf`` is block
``root`` of ``sendbuf``.  The call returns ``recvbuf``.  On the host, from a
block of more than :data:`~pycoll.buffers.ROOT_PLACED_MIN` bytes, the root's
algorithm copies its own block (:func:`~pycoll.buffers.place_root`), ``direct``
by address while the other ranks read theirs; below that, the envelope copies
it first.
"""

from __future__ import annotations

from functools import partial
from typing import Any

from pycoll.buffers import as_buffer, root_placed
from pycoll.collectives.base import (
    HOST,
    ArrayOps,
    Collective,
    Prepare,
    Spec,
    Step,
    blocks,
    check_alias,
    check_root,
    nothing,
    output,
    own_then,
)
from pycoll.errors import InvalidArgumentError


class Scatter(Collective):
    name = "scatter"
    ident = 9
    signature = ("x", "out", "root")

    def check(
        self, n: int, r: int, sendbuf: Any, recvbuf: Any, op: Any, root: Any, extra: Any = None
    ) -> Spec:
        what = self.name
        root = check_root(root, n, r, what)
        if recvbuf is None:
            raise InvalidArgumentError(f"rank {r}: {what}: recvbuf is required (k elements)")
        if r != root:
            out = as_buffer(recvbuf, r, what, "recvbuf", writable=True)
            return Spec(
                self,
                n,
                r,
                out,
                out,
                None,
                root,
                given=True,
                in_place=True,
                x_written=True,
                result=out.obj,
            )
        x = as_buffer(sendbuf, r, what, "sendbuf", writable=False)
        k = blocks(x, n, r, what)
        out = output(recvbuf, x, k, r, what)
        how = f"recvbuf must be exactly block {r} of sendbuf"
        in_place = False
        if out is not x:
            in_place = check_alias(out, x, r * out.nbytes, r, what, how)
        return Spec(
            self,
            n,
            r,
            x,
            out,
            None,
            root,
            given=True,
            in_place=in_place,
            x_written=False,
            result=out.obj,
            count=k,
        )

    def staging(self, spec: Spec) -> tuple[bool, bool]:
        return spec.r == spec.root, True

    def envelope(self, spec: Spec, step: Step | None, ops: ArrayOps) -> Prepare:
        r, k = spec.r, spec.fp_count
        if r != spec.root or spec.in_place:
            return nothing if step is None else partial(partial, step)
        if step is not None and ops is HOST and root_placed(k * spec.x.dtype.itemsize):
            return partial(partial, step)  # the algorithm copies it (see the module)
        return own_then(step, ops, lambda x, out: (out, x[r * k : (r + 1) * k]))


SCATTER = Scatter()
