"""Families of communicators: the root that ``pycoll.init`` wires, and the
sub-communicators :meth:`~pycoll.Communicator.split` and
:meth:`~pycoll.Communicator.dup` make of it, which share its connections.

What a family shares (:class:`Family`): the connections and the group segment,
one lock and one worker that put every call of its communicators in one order
on each rank, the point-to-point state, and the failure that ends them all.
What each communicator has of its own (:class:`~pycoll.engine.Engine`): its
ranks, its *context* (a number folded into the fingerprint of its calls, so no
call of one pairs with another's on the shared connections), its sequence
numbers, flight recorder and plans.

What each transport does for a sub-communicator: nothing new.  shm, tcp and
rdma connections of the root serve it as they are; the group segment serves a
sub-communicator of the same ranks in the same order (:meth:`dup`), and any
other has none (its calls take the algorithms over connections).
"""

from __future__ import annotations

import os
import threading
import zlib
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from pycoll.bootstrap import wire
from pycoll.config import Config
from pycoll.diagnose import StatusChannel
from pycoll.engine import Engine
from pycoll.gpu import setup as gpu_setup
from pycoll.p2p import PointToPoint
from pycoll.rendezvous import Bootstrap
from transports.base import Backoff


class Family:
    """What a communicator shares with the sub-communicators made from it
    (:meth:`~pycoll.Communicator.split`, :meth:`~pycoll.Communicator.dup`): the
    connections, the one order in which the calls of all of them run (a lock
    taken without waiting, one worker thread), point-to-point state, and the
    failure that leaves all of them unusable, since they share the connections.

    Args:
        rank: this process' rank in the root communicator.
        config: the root communicator's settings.
        wiring: its connections and group segment (:class:`pycoll.bootstrap.Wiring`).
        gpu: its device side, or None; bootstrap: what it was wired over.
    """

    def __init__(self, rank: int, config: Config, wiring: Any, gpu: Any, bootstrap: Any) -> None:
        self.rank = rank  # in the root communicator, as the transports number ranks
        self.wiring = wiring
        self.gpu = gpu  # the device side (pycoll.gpu.context), or None
        self.bootstrap = bootstrap
        self.status: StatusChannel | None = None  # the root communicator's
        self.conns = wiring.conns
        self.closed = False
        self.aborted = False
        self.failed: BaseException | None = None
        # the rank (as the transports number it) whose failure this family failed
        # because of: every peer is told when the connections close
        self.blame: int | None = None
        # a device collective failed on the worker and no call has raised it yet
        self.unseen = False
        self.executor: ThreadPoolExecutor | None = None
        self.inflight = 0
        self.lock = threading.Lock()
        # Held while a call runs, inline or on the worker: taken without waiting,
        # so that a second thread's call fails rather than interleave.  On the
        # 2-core machine it made a replayed 8 B allreduce at n = 1 0.2-0.3 us slower.
        busy = threading.Lock()
        self.enter, self.leave = busy.acquire, busy.release
        self.caller = threading.current_thread()
        # Asynchronous calls run on a worker thread beside the caller's
        # computation: there a spinning waiter would take the core (and the GIL)
        # that the computation needs, so it naps almost at once instead.
        self.polite = Backoff(spins=4, yields=16, max_sleep=200e-6)
        self.p2p = PointToPoint(rank, wiring.conns, config.timeout)
        self.contexts: set[int] = {0}  # of its communicators, each one's own tag space

    def close_wiring(self) -> None:
        if self.wiring is not None:
            self.wiring.close(self.blame)
            self.wiring = None
            if self.gpu is not None:  # its connections close with it, later
                self.gpu.announce_closed(self.blame)
        self.conns = {}

    def teardown(self, wait: bool) -> None:
        """End the family: no more calls, the worker stopped (``wait``: once its
        queued calls ran, else dropping them), then the device side, the
        connections, the status channel and the bootstrap, in that order."""
        self.closed = True
        if self.executor is not None:
            self.executor.shutdown(wait=wait, cancel_futures=not wait)
            self.executor = None
        if self.gpu is not None:
            lost = self.gpu.close()
            self.gpu = None
            if lost is not None and self.failed is None:
                # a stream let go after its call returned: its output is wrong
                self.failed, self.unseen = lost, True
        self.close_wiring()
        if self.status is not None:
            self.status.close()
        if self.bootstrap is not None:
            self.bootstrap.close()


def open_root(bootstrap: Bootstrap, config: Config) -> tuple[Engine, Any, str]:
    """Wire the ranks of ``bootstrap`` (collectively): the root communicator's
    engine, its device side (or None) and why there is (or is not) a group segment.
    On failure everything made so far is released, the bootstrap too."""
    rank, size = bootstrap.rank, bootstrap.size
    try:
        wiring = wire(bootstrap, config)
    except BaseException:
        bootstrap.close()
        raise
    gpu = None
    try:  # the device side (second connection table, cuda_ipc); None without a GPU
        gpu = gpu_setup(bootstrap, config, rank, size)
        # per rank: CPUs, shm peers
        shm = [p for p, k in wiring.kind.items() if k == "shm"]
        seen = bootstrap.allgather((sorted(_cpus()), shm), config.timeout, "pycoll.init: CPUs")
    except BaseException:
        if gpu is not None:
            gpu.close()
        wiring.close()
        bootstrap.close()
        raise

    # More ranks on a host than cores they may run on?  The waiting policy
    # follows this rank's host; the algorithms follow every rank's verdict
    # (any), so that all ranks pick the same algorithm and the same steps.
    def crowded(r: int) -> bool:
        cpus, peers = seen[r]
        return 1 + len(peers) > len(set(cpus).union(*(seen[p][0] for p in peers)))

    for c in wiring.conns.values():  # (see _waiting_policy)
        c.spins = 0 if crowded(rank) else CONNECTION_SPINS
        c.compiled = config.compiled
    fam = Family(rank, config, wiring, gpu, bootstrap)
    eng = Engine(
        rank,
        size,
        config,
        fam,
        wiring.conns,
        wiring.kind,
        wiring.group,
        tuple(range(size)),
        0,
        bootstrap,
        any(crowded(r) for r in range(size)),
        _waiting_policy(crowded(rank)),
    )
    fam.status = eng.status
    return eng, gpu, wiring.group_why


def child(parent: Engine, members: list[int], seed: str, group_why: str) -> tuple[Engine, str]:
    """The engine of a sub-communicator of ``parent``'s ranks ``members`` (in
    that order), and why it has (or has not) the group segment.  ``seed``:
    what every member names this split by (its context follows from it)."""
    me = members.index(parent.rank)
    ctx = zlib.crc32(f"{parent.ctx}/{seed}".encode()) or 1
    same = members == list(range(parent.size))
    if not same:
        group_why = "a sub-communicator of other ranks than its parent has none"
    eng = Engine(
        me,
        len(members),
        parent.config,
        parent.fam,
        {i: parent.conns[m] for i, m in enumerate(members) if i != me},
        {i: parent.kinds[m] for i, m in enumerate(members)},
        parent.group if same else None,
        tuple(parent.members[m] for m in members),
        ctx,
        None,
        parent.crowded,
        parent.backoff,
    )
    return eng, group_why


def split_arguments(color: object, key: object) -> bool:
    """Whether ``split(color, key)`` was called right: color None or an int >= 0, key an int."""

    def integer(v: object) -> bool:
        return isinstance(v, (int, np.integer)) and not isinstance(v, bool)

    return (color is None or (integer(color) and color >= 0)) and integer(key)  # type: ignore[operator]


def members_of(every: Any, color: int) -> list[int]:
    """The ranks whose (color, key) row of ``every`` has ``color``, by key then rank."""
    return sorted(
        (r for r in range(len(every)) if every[r, 0] == color), key=lambda r: (every[r, 1], r)
    )


def _cpus() -> set[int]:
    """The CPUs this process may run on."""
    try:
        return set(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return set(range(os.cpu_count() or 1))


#: Rounds a connection's compiled loop waits for its peer between two pieces
#: of a large message before it returns to the waiting policy (about 100 us on
#: the 2-core machine, where a 256 KiB piece takes 5-20 us to copy).
CONNECTION_SPINS = 2048


def _waiting_policy(crowded: bool) -> Backoff:
    """How a blocking collective waits, given whether this host runs more ranks
    than it has cores.

    With a core per rank, a short spin answers fastest.  With more ranks than
    cores, a spinning waiter holds the very core its peer needs: it yields at
    once, and keeps yielding (never sleeping: a nap lasts 50 us or more) for a
    few milliseconds before it naps.
    """
    if crowded:
        return Backoff(spins=0, yields=20000)
    return Backoff()
