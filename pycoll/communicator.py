"""The Communicator: a group of ranks and the collectives they call together.

A thin facade: it wires the ranks at ``init`` (:mod:`pycoll.bootstrap`), then
hands every call to :class:`~pycoll.dispatch.Dispatch`, which checks it through
its collective (:mod:`pycoll.collectives`), picks the algorithm
(:mod:`pycoll.policy`) and runs it (:mod:`pycoll.engine`, :mod:`pycoll.plans`).
``docs/architecture.md`` follows one allreduce through these modules.
"""

from __future__ import annotations

import contextlib
from typing import Any

import numpy as np

from pycoll import family
from pycoll.collectives import (
    ALLGATHER,
    ALLGATHERV,
    ALLREDUCE,
    ALLTOALL,
    ALLTOALLV,
    BARRIER,
    BROADCAST,
    COLLECTIVES,
    GATHER,
    REDUCE,
    REDUCE_SCATTER,
    REDUCE_SCATTERV,
    SCATTER,
)
from pycoll.config import Config, setup_logging
from pycoll.dispatch import Dispatch, Prepared
from pycoll.engine import Engine
from pycoll.errors import CommunicatorClosedError, InvalidArgumentError
from pycoll.p2p import PeerCalls
from pycoll.policy import Policy
from pycoll.reduce import ReduceOp
from pycoll.rendezvous import Bootstrap
from pycoll.requests import DeviceRequest, Request

__all__ = ["Communicator", "DeviceRequest", "Request"]


#: What :meth:`Communicator.prepare` makes, by name: every collective but the
#: v-variants, whose counts go another way (:meth:`pycoll.dispatch.Dispatch.call_v`)
_PREPARABLE = {
    name: c for name, c in COLLECTIVES.items() if c not in (ALLGATHERV, ALLTOALLV, REDUCE_SCATTERV)
}


class Communicator:
    """A group of ranks that run collectives together; make one with :func:`pycoll.init`.

    Every call validates its arguments before any byte moves; all ranks must call
    the same collectives in the same order, and the guard that is always on
    (:mod:`pycoll.guard`) raises :class:`CollectiveMismatchError` where they do
    not.  Threads: any thread may call, one call at a time (a call that overlaps
    another thread's raises :class:`ConcurrentCallError`, and so does the one it
    overlapped); ``async_op=True`` calls run in submission order on one worker.
    ``PYCOLL_TIMEOUT`` counts seconds without progress.  README, "Reliability",
    says it all at length.
    """

    def __init__(self, bootstrap: Bootstrap, config: Config) -> None:
        self.config = config
        self.rank: int = bootstrap.rank
        self.size: int = bootstrap.size
        setup_logging(config.debug, self.rank)
        self._bootstrap = bootstrap
        eng, self._gpu, group_why = family.open_root(bootstrap, config)
        self._start(eng, group_why, root=True)

    def _start(self, eng: Engine, group_why: str, *, root: bool) -> None:
        """Wire the parts of a communicator around its engine (``root``: made by
        ``init``, not by :meth:`split` or :meth:`dup`)."""
        self._engine = eng
        self._root = root
        self._splits = 0  # split() and dup() calls so far: their contexts' seeds
        self._policy = Policy(
            eng.rank, eng.size, self.config, eng.group is not None, group_why, eng.agree, self._gpu
        )
        # A sub-communicator's ranks are not the device connections': its device
        # buffers go through pinned host memory.
        dispatch = Dispatch(eng, self._policy, self._gpu, device=root)
        self._call, self._call_v = dispatch.entry, dispatch.call_v
        self._dispatch = dispatch
        self._peers = PeerCalls(eng)

    # ------------------------------------------------------------------ public
    @property
    def device(self) -> int | None:
        """The CUDA device of this communicator's device buffers (the current device
        at :func:`pycoll.init`), or None where it has no device side."""
        return None if self._gpu is None else int(self._gpu.device)

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

    def returns_early(self, collective: str, nbytes: int) -> bool:
        """Whether a blocking call of ``collective`` (``algorithm="auto"``) on device
        buffers, ``nbytes`` bytes in ``sendbuf``, returns before its device work is
        done: its host part is only the peers' descriptors (the ``direct`` path,
        one-sided windows; docs/gpu.md, "Streams and the host").  False for host
        buffers' routes, for other paths, and on a sub-communicator."""
        coll = COLLECTIVES.get(collective)
        if coll is None or not self._root:
            return False
        return self._policy.returns_early(coll, int(nbytes))

    def async_via_host(self, collective: str, nbytes: int) -> bool:
        """Whether the torch backend runs an asynchronous ``collective`` on CUDA
        tensors of ``nbytes`` through pinned host mirrors instead of the device
        path: where every rank shares one GPU, allreduces up to
        ``PYCOLL_DEVICE_ASYNC_HOST_BYTES`` (docs/gpu.md, "The torch backend")."""
        return self._policy.async_via_host(collective, int(nbytes))

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
            algorithm, async_op, stream: as for :meth:`allreduce`; allgather
                also has "cma", direct's by-address route from one slot up
                (``auto`` times the two where they differ, docs/algorithms.md).

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

    def prepare(
        self,
        collective: str,
        sendbuf: Any = None,
        recvbuf: Any = None,
        *,
        op: str | ReduceOp = "sum",
        root: int = 0,
        algorithm: str = "auto",
    ) -> Prepared:
        """A blocking call of ``collective`` on these arrays, made once and run by
        calling it, as MPI 4's persistent collectives are (``MPI_Allreduce_init``):
        ``h = comm.prepare("allreduce", grad)``, then ``h()`` each step does what
        ``comm.allreduce(grad)`` does, for less time a call.  The arrays are
        bound; their contents are read afresh each call.  The first call is an
        ordinary one (checked then); see :class:`pycoll.dispatch.Prepared`.

        Args:
            collective: "allreduce", "allgather", "broadcast" (``sendbuf`` is
                its buffer), "reduce_scatter", "reduce", "alltoall", "gather",
                "scatter" or "barrier" (no arrays).
            sendbuf, recvbuf, op, root, algorithm: as for that collective.

        Raises:
            InvalidArgumentError: an unknown collective, or ``op``, ``root`` or
                ``recvbuf`` given to one that takes none.
        """
        coll = _PREPARABLE.get(collective) if isinstance(collective, str) else None
        if coll is None:
            raise InvalidArgumentError(
                f"rank {self.rank}: prepare: collective={collective!r} is not one of "
                f"{', '.join(_PREPARABLE)}"
            )
        if coll is BROADCAST and recvbuf is not None:
            raise InvalidArgumentError(
                f"rank {self.rank}: prepare: broadcast works in place on sendbuf; "
                "recvbuf must be None"
            )
        rooted = coll in (BROADCAST, REDUCE, GATHER, SCATTER)
        if not coll.reduces and op != "sum":
            raise InvalidArgumentError(
                f"rank {self.rank}: prepare: {collective} takes no op (got op={op!r})"
            )
        if not rooted and root != 0:
            raise InvalidArgumentError(
                f"rank {self.rank}: prepare: {collective} takes no root (got root={root!r})"
            )
        if coll is SCATTER and root != self.rank:  # as scatter(): recvbuf is all it has
            sendbuf = recvbuf
        return self._dispatch.prepare(
            coll,
            sendbuf,
            recvbuf,
            op if coll.reduces else None,
            root,
            "auto" if coll is BARRIER else algorithm,
        )

    def barrier(self, *, async_op: bool = False) -> Any:
        """Return once every rank has entered the barrier (one step on the group
        segment where every rank shares one, else a dissemination barrier of
        log2 n rounds).

        Returns:
            None (or a Request).
        """
        return self._call(BARRIER, None, None, None, 0, "auto", async_op, None)

    def alltoall(
        self,
        sendbuf: Any,
        recvbuf: Any = None,
        *,
        algorithm: str = "auto",
        async_op: bool = False,
        stream: Any = None,
    ) -> Any:
        """Send block j of ``sendbuf`` (``size * k`` elements) to rank j; block j of
        the output comes from rank j.

        Args:
            sendbuf: contiguous array of ``size * k`` elements.
            recvbuf: output of the same size and dtype (not overlapping
                ``sendbuf``), or None for a new array of ``sendbuf``'s shape.
            algorithm: "auto", "pairwise", "direct" (every rank on one host) or
                "cma" (direct's by-address route from one slot up; ``auto``
                times the two where they differ, docs/algorithms.md).
            async_op, stream: as for :meth:`allreduce`.

        Returns:
            The output (or a Request).
        """
        return self._call(ALLTOALL, sendbuf, recvbuf, None, 0, algorithm, async_op, stream)

    def alltoallv(
        self,
        sendbuf: Any,
        sendcounts: Any,
        recvbuf: Any,
        recvcounts: Any,
        *,
        async_op: bool = False,
        stream: Any = None,
    ) -> Any:
        """Send ``sendcounts[j]`` elements to rank j and receive ``recvcounts[j]``
        from it; the blocks lie at the prefix sums of the counts (zeros allowed).

        Rank i's ``sendcounts[j]`` must equal rank j's ``recvcounts[i]``.

        Returns:
            ``recvbuf`` (or a Request).
        """
        counts = (sendcounts, recvcounts)
        return self._call_v(ALLTOALLV, sendbuf, recvbuf, counts, None, async_op, stream)

    def gather(
        self,
        sendbuf: Any,
        recvbuf: Any = None,
        *,
        root: int = 0,
        algorithm: str = "auto",
        async_op: bool = False,
        stream: Any = None,
    ) -> Any:
        """Gather every rank's ``sendbuf`` (k elements) into ``recvbuf`` on ``root``,
        rank-major.

        On the root ``recvbuf`` holds ``size * k`` elements (None: a new array of
        shape ``(size, *sendbuf.shape)``; in place, ``sendbuf`` is block ``root``
        of it); other ranks ignore it.  ``algorithm``: "auto", "linear", "tree" or
        "direct" (ranks on one host).

        Returns:
            The output on the root, None elsewhere (or a Request).
        """
        return self._call(GATHER, sendbuf, recvbuf, None, root, algorithm, async_op, stream)

    def scatter(
        self,
        sendbuf: Any,
        recvbuf: Any,
        *,
        root: int = 0,
        algorithm: str = "auto",
        async_op: bool = False,
        stream: Any = None,
    ) -> Any:
        """Send block j of the root's ``sendbuf`` (``size * k`` elements) into rank
        j's ``recvbuf`` (k elements).

        Other ranks than the root ignore ``sendbuf`` (pass None).  In place on the
        root, ``recvbuf`` is block ``root`` of ``sendbuf``.  ``algorithm``:
        "auto", "linear", "tree" or "direct" (ranks on one host).

        Returns:
            ``recvbuf`` (or a Request).
        """
        if root != self.rank:  # recvbuf is all a receiving rank has: its plan holds it
            sendbuf = recvbuf
        return self._call(SCATTER, sendbuf, recvbuf, None, root, algorithm, async_op, stream)

    def allgatherv(
        self,
        sendbuf: Any,
        recvbuf: Any,
        counts: Any,
        *,
        async_op: bool = False,
        stream: Any = None,
    ) -> Any:
        """Gather rank j's ``sendbuf`` (``counts[j]`` elements) into every rank's
        ``recvbuf`` at the prefix sum of the counts before j (zeros allowed).

        Every rank passes the same ``counts``; in place, ``sendbuf`` is this
        rank's block of ``recvbuf``.

        Returns:
            ``recvbuf`` (or a Request).
        """
        return self._call_v(ALLGATHERV, sendbuf, recvbuf, counts, None, async_op, stream)

    def reduce_scatterv(
        self,
        sendbuf: Any,
        recvbuf: Any,
        counts: Any,
        *,
        op: str | ReduceOp = "sum",
        async_op: bool = False,
        stream: Any = None,
    ) -> Any:
        """Reduce ``sendbuf`` (``sum(counts)`` elements); rank r gets the reduced
        block r (``counts[r]`` elements, zeros allowed) in ``recvbuf``.

        Every rank passes the same ``counts``; ``op`` as for :meth:`allreduce`.

        Returns:
            ``recvbuf`` (or a Request).
        """
        return self._call_v(REDUCE_SCATTERV, sendbuf, recvbuf, counts, op, async_op, stream)

    # ------------------------------------------------------------------ point-to-point
    def send(self, buf: Any, peer: int, *, tag: int = 0, async_op: bool = False) -> Any:
        """Send ``buf`` (a contiguous array) to rank ``peer`` with a 64-bit ``tag``;
        with ``async_op`` return a request (``wait()``, ``test()``).

        Messages from one rank to another match in the order they were sent, per
        tag; point-to-point calls are ordered with this communicator's
        collectives as in NCCL (:mod:`pycoll.p2p`).

        Raises:
            InvalidArgumentError: a bad buffer, peer or tag.
            PeerAbortedError: the peer is gone.
        """
        return self._peers.call(True, buf, peer, tag, async_op)

    def recv(
        self, buf: Any, peer: int | None = None, *, tag: int = 0, async_op: bool = False
    ) -> Any:
        """Receive into ``buf`` the next message with ``tag`` from rank ``peer`` (any
        rank with None); return ``buf`` (or a request whose ``wait()`` does).

        :attr:`last_source` (or the request's ``source``) says who sent it.

        Raises:
            InvalidArgumentError: a bad buffer, peer or tag.
            CollectiveMismatchError: the message has another count or dtype
                (nothing is written).
            PeerAbortedError: the peer is gone.
        """
        return self._peers.call(False, buf, peer, tag, async_op)

    def sendrecv(
        self, sendbuf: Any, dest: int, recvbuf: Any, source: int | None, *, tag: int = 0
    ) -> Any:
        """Send ``sendbuf`` to ``dest`` and receive into ``recvbuf`` from ``source``,
        posted together (a ring shift never deadlocks).

        Returns:
            ``recvbuf``.
        """
        with self.group():
            self.send(sendbuf, dest, tag=tag)
            req = self.recv(recvbuf, source, tag=tag)
        return req.wait()

    def group(self) -> contextlib.AbstractContextManager[None]:
        """Post the point-to-point calls made inside together, and complete them
        on exit, as NCCL's ``ncclGroupStart``/``End`` (a ring shift never
        deadlocks, at any size); the calls inside return requests, done on exit.

        Raises:
            InvalidArgumentError: a group inside a group.
        """
        return self._peers.group()

    @property
    def last_source(self) -> int | None:
        """The rank whose message the last completed :meth:`recv` took."""
        return self._peers.last_source

    # ------------------------------------------------------------------ sub-communicators
    def split(self, color: int | None, key: int = 0) -> Communicator | None:
        """A communicator of the ranks that pass the same ``color`` (MPI_Comm_split,
        ncclCommSplit); every rank of this one calls it.

        Ranks are ordered by ``key``, then by their rank here.  The new
        communicator shares this one's connections (:mod:`pycoll.engine`'s
        family): its calls and this one's run in one order on each rank and
        never pair with each other.  It has the group segment (the ``direct``
        algorithms) only when it has all of this one's ranks in the same order.

        Args:
            color: a non-negative integer; None: this rank joins none (returns None).
            key: orders the ranks of the new communicator.

        Raises:
            InvalidArgumentError: a negative or non-integer color, a non-integer key.
        """
        if not family.split_arguments(color, key):
            self._engine.reject("split")
            raise InvalidArgumentError(
                f"rank {self.rank}: split: color={color!r} must be None or an integer >= 0, "
                f"key={key!r} an integer"
            )
        mine = np.array([-1 if color is None else int(color), int(key)], np.int64)
        every = self.allgather(mine)
        self._splits += 1
        if color is None:
            return None
        members = family.members_of(every, color)
        return self._child(members, f"split {self._splits} color {color}")

    def dup(self) -> Communicator:
        """A communicator of the same ranks in the same order, whose calls never pair
        with this one's (MPI_Comm_dup); every rank calls it.  It shares this one's
        connections and group segment, and moves no byte to be made."""
        self._engine.check_open("dup")
        self._splits += 1
        return self._child(list(range(self.size)), f"dup {self._splits}")

    def _child(self, members: list[int], seed: str) -> Communicator:
        eng, why = family.child(self._engine, members, seed, self._policy.group_why)
        c = Communicator.__new__(Communicator)
        c.config, c.rank, c.size = self.config, eng.rank, eng.size
        c._bootstrap = None  # type: ignore[assignment]
        c._gpu = self._gpu
        c._start(eng, why, root=False)
        return c

    # ------------------------------------------------------------------ lifecycle
    def close(self) -> None:
        """Release every connection and segment; idempotent.

        A sub-communicator (:meth:`split`, :meth:`dup`) only stops taking calls:
        the connections are its root communicator's, which closes them (and
        with them every sub-communicator) when it closes.
        """
        eng = self._engine
        if eng.closed:
            return
        eng.shutdown()
        if not self._root:
            return
        fam = eng.fam
        fam.teardown(True)
        self._gpu = None
        if fam.unseen:  # a device collective's output is wrong and nothing said so
            fam.unseen = False
            raise CommunicatorClosedError(
                f"rank {self.rank}: close: a device collective failed after its call "
                f"returned, and no later call reported it: {fam.failed}"
            ) from fam.failed

    def abort(self) -> None:
        """Tear down at once without waiting for peers or queued collectives.

        A collective it interrupts on this rank (on another thread, or queued)
        raises :class:`CommunicatorClosedError`, whatever the transport; peers
        waiting on this rank raise :class:`PeerAbortedError`.  On a
        sub-communicator it aborts the root communicator and every
        sub-communicator too, since they share the connections.
        """
        eng = self._engine
        eng.fam.aborted = True
        eng.shutdown()
        eng.fam.teardown(False)
        self._gpu = None

    def recent(self) -> list[str]:
        """The flight recorder: this rank's recent collectives, oldest first."""
        return self._engine.recent_calls()

    def __enter__(self) -> Communicator:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<pycoll.Communicator rank {self.rank} of {self.size}>"
