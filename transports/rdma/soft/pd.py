"""Protection domain (``pyverbs.pd``)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from typing import Self  # 3.11; annotations only (3.10 has none)

    from transports.rdma.soft.device import Context


class PD:
    """A protection domain: MRs and QPs of one PD may be used together only."""

    def __init__(self, creator: Context) -> None:
        self.ctx = creator
        self._closed = False
        creator._add_ref(self)

    def close(self) -> None:
        self._closed = True

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
