"""Communicators of several ranks inside one process, one thread per rank.

The ranks bootstrap over one :class:`pycoll.stores.HashStore`
(:class:`pycoll.rendezvous.StoreBootstrap`), so tests can build real
communicators over real transports without a launcher.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import pycoll
from pycoll.config import Config
from pycoll.rendezvous import StoreBootstrap
from pycoll.stores import HashStore


def run_ranks(n: int, fn: Callable[[int], Any], timeout: float = 60) -> list[Any]:
    """Run ``fn(rank)`` on ``n`` threads; return the results (or raise the first error)."""
    out: list[Any] = [None] * n
    errs: list[BaseException] = []

    def go(r: int) -> None:
        try:
            out[r] = fn(r)
        except BaseException as exc:
            errs.append(exc)

    ths = [threading.Thread(target=go, args=(r,), name=f"rank{r}") for r in range(n)]
    for t in ths:
        t.start()
    for t in ths:
        t.join(timeout)
    assert not any(t.is_alive() for t in ths), "a rank thread hung"
    if errs:
        raise errs[0]
    return out


@contextmanager
def communicators(n: int, **config: Any) -> Iterator[Sequence[pycoll.Communicator]]:
    """``n`` connected communicators (ranks as threads); closed on exit."""
    store = HashStore()
    cfg = Config.from_env({}, **config)
    comms = run_ranks(n, lambda r: pycoll.Communicator(StoreBootstrap(store, r, n), cfg))
    try:
        yield comms
    finally:
        for c in comms:
            c.close()
