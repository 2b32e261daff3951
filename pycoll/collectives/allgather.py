"""allgather: every rank's ``sendbuf`` into everyone's output, rank-major.

The output holds ``n * k`` elements; ``recvbuf=None`` allocates one of shape
``(n, *sendbuf.shape)`` each call.  In place, ``sendbuf`` is block ``rank`` of
``recvbuf`` itself; otherwise the envelope copies a rank's own block, and the
algorithm moves the others; but on the host, from a block of
:data:`~pycoll.buffers.OWN_PLACED_MIN` bytes (2 MiB), every allgather algorithm places
its own block (:func:`~pycoll.buffers.place_own`), and ``direct`` by address
copies it in the same pass as its writes to the peers.
"""

from __future__ import annotations

from functools import partial
from typing import Any

from pycoll.buffers import as_buffer, own_placed
from pycoll.collectives.base import (
    HOST,
    ArrayOps,
    Collective,
    Prepare,
    Spec,
    Step,
    check_alias,
    empty_like,
    nothing,
    output,
    own_then,
)


class Allgather(Collective):
    windows = True
    name = "allgather"
    ident = 2

    def check(
        self, n: int, r: int, sendbuf: Any, recvbuf: Any, op: Any, root: Any, extra: Any = None
    ) -> Spec:
        what = self.name
        x = as_buffer(sendbuf, r, what, "sendbuf", writable=False)
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
            0,
            given=given,
            in_place=in_place,
            x_written=False,
            result=out.obj,
        )

    def fresh_shape(self, spec: Spec) -> tuple[int, ...] | None:
        return None if spec.given else (spec.n, *spec.x.shape)

    def envelope(self, spec: Spec, step: Step | None, ops: ArrayOps) -> Prepare:
        r, k = spec.r, spec.x.count
        if spec.in_place:  # the rank's own block is already there
            return nothing if step is None else partial(partial, step)
        if step is not None and ops is HOST and own_placed(spec.x.nbytes):
            return partial(partial, step)  # the algorithm places it (see the module)
        return own_then(step, ops, lambda x, out: (out[r * k : (r + 1) * k], x))

    def entry_form(self, spec: Spec, step: Step | None) -> tuple[Step, int] | None:
        form = super().entry_form(spec, step)  # the step alone, where the envelope is
        if form is None and step is not None:
            return step, spec.r * spec.x.nbytes  # own_then's copy, then the step
        return form


ALLGATHER = Allgather()
