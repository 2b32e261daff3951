"""Build two connected endpoints of one transport inside one process."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

from transports.base import Connection, TransportOptions
from transports.registry import transport_class


def transport_available(name: str) -> tuple[bool, str]:
    try:
        transport_class(name)
    except ImportError as exc:
        return False, f"{name}: {exc}"
    return True, ""


@contextmanager
def connected_pair(name: str, **kw: object) -> Iterator[tuple[Connection, Connection]]:
    """Yield (rank 0's connection to 1, rank 1's connection to 0)."""
    cls = transport_class(name)
    extra = tuple((k, str(v)) for k, v in kw.pop("extra", {}).items())  # type: ignore[attr-defined]
    opts = [
        TransportOptions(rank=r, size=2, timeout=20.0, secret=b"s3cret", extra=extra, **kw)  # type: ignore[arg-type]
        for r in (0, 1)
    ]
    ts = [cls(o) for o in opts]
    blobs = [t.listen() for t in ts]
    for r in (0, 1):
        ok, why = ts[r].can_connect(blobs[r], blobs[1 - r])
        assert ok, why
    conns: list[Connection | None] = [None, None]
    errors: list[BaseException] = []

    def go(r: int) -> None:
        try:
            conns[r] = ts[r].connect(1 - r, blobs[1 - r])
        except BaseException as exc:
            errors.append(exc)

    th = [threading.Thread(target=go, args=(r,)) for r in (0, 1)]
    for t in th:
        t.start()
    for t in th:
        t.join(30)
    if errors:
        raise errors[0]
    assert conns[0] is not None and conns[1] is not None
    try:
        yield conns[0], conns[1]
    finally:
        for c in conns:
            if c is not None:
                c.close()
        for t in ts:
            t.close()
