"""Communicators of several ranks inside one process, one thread per rank.

:class:`ThreadComm` stands in for the few mpi4py calls the bootstrap makes
(``bcast``, ``allgather``, ``allreduce``, ``Barrier``, and ``Isend`` and
``Irecv`` of the arrival bytes), so tests can build real
communicators over real transports without a launcher.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import pycoll
from pycoll.config import Config


class _Group:
    def __init__(self, n: int) -> None:
        self.n = n
        self.barrier = threading.Barrier(n, timeout=60)
        self.slots: list[Any] = [None] * n
        self.lock = threading.Lock()
        self.mail: set[tuple[int, int, int]] = set()  # (source, dest, tag) sent, unreceived


class ThreadComm:
    """The mpi4py subset the bootstrap uses, for ranks that are threads."""

    def __init__(self, group: _Group, rank: int) -> None:
        self._g = group
        self._rank = rank

    def Get_rank(self) -> int:
        return self._rank

    def Get_size(self) -> int:
        return self._g.n

    def allgather(self, obj: Any) -> list[Any]:
        g = self._g
        g.slots[self._rank] = obj
        g.barrier.wait()
        out = list(g.slots)
        g.barrier.wait()
        return out

    def bcast(self, obj: Any, root: int = 0) -> Any:
        return self.allgather(obj)[root]

    def allreduce(self, value: Any) -> Any:
        return sum(self.allgather(value))

    def Barrier(self) -> None:
        self._g.barrier.wait()

    def Isend(self, buf: Any, dest: int, tag: int) -> _Request:
        """Post a message (its bytes are not kept: only arrival bytes are sent)."""
        with self._g.lock:
            self._g.mail.add((self._rank, dest, tag))
        return _Request(lambda: True)

    def Irecv(self, buf: Any, source: int, tag: int) -> _Request:
        key = (source, self._rank, tag)

        def test() -> bool:
            with self._g.lock:
                if key in self._g.mail:
                    self._g.mail.discard(key)
                    return True
            return False

        return _Request(test)


class _Request:
    """The part of ``MPI.Request`` that the bootstrap uses."""

    def __init__(self, test: Callable[[], bool]) -> None:
        self._test = test
        self._done = False

    def Test(self) -> bool:
        self._done = self._done or self._test()
        return self._done

    def Wait(self) -> None:
        while not self.Test():
            time.sleep(1e-4)

    def Cancel(self) -> None:
        self._done = True

    def Free(self) -> None:
        self._done = True


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
    g = _Group(n)
    cfg = Config.from_env({}, **config)
    comms = run_ranks(n, lambda r: pycoll.Communicator(ThreadComm(g, r), cfg))  # type: ignore[arg-type]
    try:
        yield comms
    finally:
        for c in comms:
            c.close()
