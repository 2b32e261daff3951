"""What an algorithm sees: its rank, the world size, and point-to-point moves.

Algorithms never name a transport; they post sends and receives of typed array
slices to peers through a :class:`Links` object and wait on them.

Rules the algorithms follow (and that make them deadlock-free on any transport
that keeps :mod:`transports.base`'s flow-control rule):

* messages between two ranks are matched in the order they were posted, so both
  sides post in the same order;
* :meth:`Links.wait` progresses *every* outstanding request, including sends an
  algorithm chose not to wait for, so a rank never stalls a peer it owes bytes to;
* a buffer read by a pending send is not overwritten until that send completed, or
  until causality guarantees it was read (the bytes coming back depend on it).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

# Group is the node-wide segment's protocol (transports.shm_group implements it);
# the algorithms import it from here.
from transports.base import (
    Backoff,
    Connection,
    Deadline,
    Group,
    Request,
    idle_round,
    wait_all,
)


def _bytes(a: Any) -> memoryview:
    return memoryview(a.view(np.uint8))


class Links:
    """Point-to-point operations on typed host arrays for one collective call.

    Args:
        rank: this rank.
        size: number of ranks.
        conns: peer rank -> connection.
        deadline: when waiting gives up (raises transports.TransportTimeout).
        chunk_bytes: the pipeline chunk size.
        itemsize: bytes per element of the collective's dtype.
        reduce: the ufunc-like ``reduce(a, b, out=...)`` of the collective's op.
        backoff: how waits spin, yield and sleep.
        group: memory shared by all ranks (one host), or None; algorithms that
            need it (``direct``) are candidates only when it is there.
        crowded: this host runs more ranks than it has cores (each waits its
            turn for one), so an extra step costs more than it saves in bytes.
    """

    __slots__ = (
        "_backoff",
        "_pending",
        "chunk_elems",
        "conns",
        "crowded",
        "deadline",
        "dtype",
        "fp",
        "group",
        "patient",
        "rank",
        "reduce",
        "size",
        "tag",
        "use_compiled",
    )

    def __init__(
        self,
        rank: int,
        size: int,
        conns: dict[int, Connection],
        deadline: Deadline,
        chunk_bytes: int,
        dtype: np.dtype[Any],
        reduce: Callable[..., Any] | None,
        backoff: Backoff,
        group: Group | None = None,
        crowded: bool = False,
    ) -> None:
        self.rank = rank
        self.size = size
        self.conns = conns
        self.deadline = deadline
        self.dtype = dtype
        self.chunk_elems = max(1, chunk_bytes // dtype.itemsize)
        self.reduce = reduce
        self._pending: list[Request] = []
        self._backoff = backoff
        #: how a wait that holds no GIL waits: the communicator's own policy,
        #: also on the worker thread, whose ``backoff`` naps almost at once to
        #: leave the GIL to the caller's computation (the engine sets it)
        self.patient = backoff
        #: whether the compiled pieces may run (``PYCOLL_COMPILED``; the engine sets it)
        self.use_compiled = True
        self.group = group
        self.crowded = crowded
        #: the tag of this call's messages, and its fingerprint for the group's
        #: steps (the communicator sets both before each call)
        self.tag = 0
        self.fp = 0

    @property
    def backoff(self) -> Backoff:
        """How this collective's waits spin, yield and sleep."""
        return self._backoff

    # ----------------------------------------------------------------- posting
    def send(self, peer: int, a: Any) -> Request:
        """Post a send of array slice ``a``; it stays pending until waited on."""
        req = self.conns[peer].isend(_bytes(a), self.tag)
        self._pending.append(req)
        return req

    def empty(self, shape: Any, dtype: Any) -> Any:
        """Scratch memory where the collective's buffers live (host here; device
        for :class:`pycoll.gpu.links.DeviceLinks`)."""
        return np.empty(shape, dtype)

    def recv(self, peer: int, out: Any) -> Request:
        """Post a receive into array slice ``out``."""
        return self.conns[peer].irecv_into(_bytes(out), self.tag)

    def recv_reduce(self, peer: int, out: Any, local: Any, incoming_first: bool = False) -> Request:
        """Post a receive that computes ``out = local OP incoming`` (or
        ``incoming OP local``) straight from the transport's memory, piece by piece."""
        f = self.reduce
        assert f is not None
        dtype = self.dtype
        isz = dtype.itemsize

        if incoming_first:

            def sink(off: int, piece: memoryview) -> None:
                i = off // isz
                j = i + len(piece) // isz
                f(np.frombuffer(piece, dtype), local[i:j], out=out[i:j])
        else:

            def sink(off: int, piece: memoryview) -> None:
                i = off // isz
                j = i + len(piece) // isz
                f(local[i:j], np.frombuffer(piece, dtype), out=out[i:j])

        return self.conns[peer].irecv(out.nbytes, sink, self.tag)

    # ----------------------------------------------------------------- waiting
    def wait(self, *reqs: Request) -> None:
        """Block until ``reqs`` complete, progressing every pending send meanwhile."""
        targets = [r for r in reqs if not r._done]
        if not targets:
            return
        pend = self._pending
        if pend:
            self._pending = pend = [r for r in pend if not r._done]
        if not pend:
            wait_all(targets, self.deadline, self._backoff)
            return
        bo = self._backoff
        bo.reset()
        # progress sends too, but return as soon as the targets are done
        while True:
            progressed = False
            for r in pend:
                if not r._done and r.test():
                    progressed = True
            done = True
            for r in targets:
                if not r._done:
                    if r.test():
                        progressed = True
                    else:
                        done = False
            if done:
                return
            if progressed:
                bo.reset()
                continue
            idle_round(bo, [r for r in targets + pend if not r._done], self.deadline)

    def finish(self) -> None:
        """Wait for every pending send (the end of a collective)."""
        pend = [r for r in self._pending if not r._done]
        self._pending = []
        if pend:
            wait_all(pend, self.deadline, self._backoff)
