"""The Communicator: a group of ranks and the collectives they call together.

A thin facade: it wires the ranks at ``init`` (:mod:`pycoll.bootstrap`), then
hands every call to :class:`~pycoll.dispatch.Dispatch`, which checks it through
its collective (:mod:`pycoll.collectives`), picks the algorithm
(:mod:`pycoll.policy`) and runs it (:mod:`pycoll.engine`, :mod:`pycoll.plans`).
``docs/architecture.md`` follows one allreduce through these modules.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from pycoll.bootstrap import wire
from pycoll.collectives import (
    ALLGATHER,
    ALLREDUCE,
    BARRIER,
    BROADCAST,
    REDUCE,
    REDUCE_SCATTER,
)
from pycoll.config import Config, setup_logging
from pycoll.dispatch import Dispatch
from pycoll.engine import Engine
from pycoll.errors import CommunicatorClosedError, InvalidArgumentError
from pycoll.gpu import setup as gpu_setup
from pycoll.policy import Policy
from pycoll.reduce import ReduceOp
from pycoll.rendezvous import Bootstrap
from pycoll.requests import DeviceRequest, Request
from transports.base import Backoff

__all__ = ["Communicator", "DeviceRequest", "Request"]


class Communicator:
    """A group of ranks that run collectives together.

    Create it with :func:`pycoll.init`.  Every collective validates its
    arguments before any byte moves, and all ranks of the group must call the
    same collectives in the same order.  The guard that is always on sees it
    where they do not (:mod:`pycoll.guard`): each message carries its call's tag
    (sequence number and fingerprint), each group step a chain of fingerprints,
    and a rank that meets another raises :class:`CollectiveMismatchError` and
    closes its connections so that its peers fail too.  A call rejected for its
    arguments counts as a call.  ``PYCOLL_CHECK=1`` compares every rank's call
    (and sequence number) before it runs, for a message that names each rank's
    arguments.

    Threads: any thread may call, one collective at a time; with several
    threads the program makes the order the same on every rank (each call after
    the last returned, or ``async_op=True`` calls, which run in submission order
    on the worker thread, blocking calls made meanwhile after them).  A call
    that enters while another thread's collective runs raises
    :class:`ConcurrentCallError`, so does the one it overlapped when it ends,
    and the communicator is unusable: overlapping calls have no order every rank
    shares, and pycoll never pairs them by chance.  The check is a lock taken
    without waiting.  ``PYCOLL_TIMEOUT`` counts seconds without
    progress (:class:`transports.base.Deadline`).
    """

    def __init__(self, bootstrap: Bootstrap, config: Config) -> None:
        self.config = config
        self.rank: int = bootstrap.rank
        self.size: int = bootstrap.size
        setup_logging(config.debug, self.rank)
        self._bootstrap = bootstrap
        try:
            wiring = wire(bootstrap, config)
        except BaseException:
            bootstrap.close()
            raise
        self._gpu: Any = None
        try:  # the device side (second connection table, cuda_ipc); None without a GPU
            self._gpu = gpu_setup(bootstrap, config, self.rank, self.size)
            # per rank: CPUs, shm peers
            shm = [p for p, k in wiring.kind.items() if k == "shm"]
            seen = bootstrap.allgather((sorted(_cpus()), shm), config.timeout, "pycoll.init: CPUs")
        except BaseException:
            if self._gpu is not None:
                self._gpu.close()
            wiring.close()
            bootstrap.close()
            raise

        # More ranks on a host than cores they may run on?  The waiting policy
        # follows this rank's host; the algorithms follow every rank's verdict
        # (any), so that all ranks pick the same algorithm and the same steps.
        def crowded(r: int) -> bool:
            cpus, peers = seen[r]
            return 1 + len(peers) > len(set(cpus).union(*(seen[p][0] for p in peers)))

        self._engine = eng = Engine(
            self.rank,
            self.size,
            config,
            wiring,
            bootstrap,
            any(crowded(r) for r in range(self.size)),
            _waiting_policy(crowded(self.rank)),
        )
        self._policy = Policy(
            self.rank,
            self.size,
            config,
            wiring.group is not None,
            wiring.group_why,
            eng.agree,
            self._gpu,
        )
        self._call = Dispatch(eng, self._policy, self._gpu).call

    # ------------------------------------------------------------------ public
    def transport_of(self, peer: int, *, device: bool = False) -> str:
        """The transport used to reach ``peer``: "self", "shm", "tcp", "rdma:host"...

        With ``device=True``: how device (GPU) buffers reach it: "cuda_ipc",
        "rdma:gdr", "rdma:dmabuf", or "staged:<host transport>" (pinned host copies).

        Raises:
            InvalidArgumentError: ``peer`` is not a rank of this communicator.
        """
        if not isinstance(peer, (int, np.integer)) or not 0 <= peer < self.size:
            raise InvalidArgumentError(
                f"rank {self.rank}: transport_of: peer={peer!r} is not in [0, {self.size})"
            )
        kinds = self._engine.kinds
        if device and self._gpu is not None:
            return str(self._gpu.kind(int(peer), self._engine.conns, kinds))
        return kinds[int(peer)]

    def allreduce(
        self,
        sendbuf: Any,
        recvbuf: Any = None,
        *,
        op: str | ReduceOp = "sum",
        algorithm: str = "auto",
        async_op: bool = False,
        stream: Any = None,
    ) -> Any:
        """Reduce ``sendbuf`` across ranks; every rank gets the result.

        Args:
            sendbuf: contiguous array; with ``recvbuf=None`` the result lands in it.
            recvbuf: output of the same size and dtype, or None for in place.
            op: "sum", "prod", "min", "max", "avg", "band", "bor", "bxor" or a
                :class:`ReduceOp` (which takes which dtype: :mod:`pycoll.reduce`).
            algorithm: "auto" (the cost model's pick, see :mod:`pycoll.tune`), or
                "ring", "tree", "direct" (every rank on one host) or "oneshot";
                the other collectives take the same but "oneshot".
            async_op: return a :class:`Request` instead of waiting.
            stream: device buffers only: the CUDA stream the collective is ordered
                on (CuPy or torch stream, or a ``cudaStream_t`` int); default the
                current stream.  See :mod:`pycoll.gpu.context` for the semantics.

        Returns:
            The output array (or a Request).

        Raises:
            InvalidArgumentError: bad buffers, op, dtype or algorithm.
            TransportError: the collective failed; the communicator is unusable.
        """
        return self._call(ALLREDUCE, sendbuf, recvbuf, op, 0, algorithm, async_op, stream)

    def allgather(
        self,
        sendbuf: Any,
        recvbuf: Any = None,
        *,
        algorithm: str = "auto",
        async_op: bool = False,
        stream: Any = None,
    ) -> Any:
        """Gather every rank's ``sendbuf`` into everyone's output, rank-major.

        Args:
            sendbuf: contiguous array of k elements (may be block ``rank`` of
                ``recvbuf`` itself, for in place).
            recvbuf: output of ``size * k`` elements; None allocates one of shape
                ``(size, *sendbuf.shape)``.
            algorithm, async_op, stream: as for :meth:`allreduce`.

        Returns:
            The output array (or a Request).
        """
        return self._call(ALLGATHER, sendbuf, recvbuf, None, 0, algorithm, async_op, stream)

    def broadcast(
        self,
        buf: Any,
        *,
        root: int = 0,
        algorithm: str = "auto",
        async_op: bool = False,
        stream: Any = None,
    ) -> Any:
        """Copy ``buf`` from ``root`` to every rank, in place.

        ``algorithm``, ``async_op`` and ``stream`` are as for :meth:`allreduce`.

        Returns:
            ``buf`` (or a Request).
        """
        return self._call(BROADCAST, buf, None, None, root, algorithm, async_op, stream)

    def reduce_scatter(
        self,
        sendbuf: Any,
        recvbuf: Any = None,
        *,
        op: str | ReduceOp = "sum",
        algorithm: str = "auto",
        async_op: bool = False,
        stream: Any = None,
    ) -> Any:
        """Reduce ``sendbuf`` (``size * k`` elements); rank r gets reduced block r.

        ``op``, ``algorithm``, ``async_op`` and ``stream`` are as for :meth:`allreduce`.

        Returns:
            The k-element output (or a Request); a new 1-D array if ``recvbuf`` is None.
        """
        return self._call(REDUCE_SCATTER, sendbuf, recvbuf, op, 0, algorithm, async_op, stream)

    def reduce(
        self,
        sendbuf: Any,
        recvbuf: Any = None,
        *,
        root: int = 0,
        op: str | ReduceOp = "sum",
        algorithm: str = "auto",
        async_op: bool = False,
        stream: Any = None,
    ) -> Any:
        """Reduce ``sendbuf`` across ranks into ``recvbuf`` on ``root``.

        On the root, ``recvbuf=None`` means in place (into ``sendbuf``); other
        ranks ignore ``recvbuf``.  ``op``, ``algorithm``, ``async_op`` and
        ``stream`` are as for :meth:`allreduce`.

        Returns:
            The output on the root, None elsewhere (or a Request).
        """
        return self._call(REDUCE, sendbuf, recvbuf, op, root, algorithm, async_op, stream)

    def barrier(self, *, async_op: bool = False) -> Any:
        """Return once every rank has entered the barrier (one step on the group
        segment where every rank shares one, else a dissemination barrier of
        log2 n rounds).

        Returns:
            None (or a Request).
        """
        return self._call(BARRIER, None, None, None, 0, "auto", async_op, None)

    # ------------------------------------------------------------------ lifecycle
    def close(self) -> None:
        """Release every connection and segment; idempotent."""
        eng = self._engine
        if eng.closed:
            return
        eng.shutdown(wait=True)
        self._close_rest()
        if eng.unseen:  # a device collective's output is wrong and nothing said so
            eng.unseen = False
            raise CommunicatorClosedError(
                f"rank {self.rank}: close: a device collective failed after its call "
                f"returned, and no later call reported it: {eng.failed}"
            ) from eng.failed

    def abort(self) -> None:
        """Tear down at once without waiting for peers or queued collectives.

        A collective it interrupts on this rank (on another thread, or queued)
        raises :class:`CommunicatorClosedError`, whatever the transport; peers
        waiting on this rank raise :class:`PeerAbortedError`.
        """
        self._engine.aborted = True
        self._engine.shutdown(wait=False)
        self._close_rest()

    def _close_rest(self) -> None:
        if self._gpu is not None:
            self._gpu.close()
            self._gpu = None
        self._engine.close_wiring()
        self._bootstrap.close()

    def recent(self) -> list[str]:
        """The flight recorder: this rank's recent collectives, oldest first."""
        return self._engine.recent_calls()

    def __enter__(self) -> Communicator:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<pycoll.Communicator rank {self.rank} of {self.size}>"


def _cpus() -> set[int]:
    """The CPUs this process may run on."""
    try:
        return set(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return set(range(os.cpu_count() or 1))


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
