"""broadcast: ``buf`` from ``root`` to every rank, in place.

The root's buffer is read, the others' written; the call returns ``buf``.
"""

from __future__ import annotations

from functools import partial
from typing import Any

from pycoll.buffers import as_buffer
from pycoll.collectives.base import ArrayOps, Collective, Prepare, Spec, Step, check_root, nothing


class Broadcast(Collective):
    windows = True
    name = "broadcast"
    ident = 3
    signature = ("x", "root")

    def check(
        self, n: int, r: int, sendbuf: Any, recvbuf: Any, op: Any, root: Any, extra: Any = None
    ) -> Spec:
        what = self.name
        root = check_root(root, n, r, what)
        b = as_buffer(sendbuf, r, what, "buf", writable=r != root)
        return Spec(
            self,
            n,
            r,
            b,
            b,
            None,
            root,
            given=False,
            in_place=True,
            x_written=r != root,
            result=b.obj,
        )

    def staging(self, spec: Spec) -> tuple[bool, bool]:
        return spec.r == spec.root, spec.r != spec.root

    def envelope(self, spec: Spec, step: Step | None, ops: ArrayOps) -> Prepare:
        if step is None:
            return nothing
        return partial(partial, step)


BROADCAST = Broadcast()
