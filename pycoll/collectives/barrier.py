"""barrier: returns once every rank has entered it.

It moves one byte (or one step on the group segment) and no user buffer:
``direct`` where every rank shares the group segment, else ``dissemination``.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import numpy as np

from pycoll.buffers import Buffer
from pycoll.collectives.base import ArrayOps, Collective, Prepare, Spec, Step, nothing


class Barrier(Collective):
    name = "barrier"
    ident = 6
    signature = ()
    plannable = False  # no user buffer; its one byte moves by the slow path

    def check(
        self, n: int, r: int, sendbuf: Any, recvbuf: Any, op: Any, root: Any, extra: Any = None
    ) -> Spec:
        token = np.zeros(1, np.uint8)
        x = Buffer(token, token, -1)
        return Spec(
            self,
            n,
            r,
            x,
            None,
            None,
            0,
            given=False,
            in_place=True,
            x_written=False,
            result=None,
        )

    def envelope(self, spec: Spec, step: Step | None, ops: ArrayOps) -> Prepare:
        return nothing if step is None else partial(partial, step)


BARRIER = Barrier()
