"""What every pycoll process group has: identity, its worker, its lifecycle."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

import pycoll
from pycoll.errors import InvalidArgumentError
from pycoll.torch_backend.kept import Kept
from pycoll.torch_backend.mirrors import Mirrors
from pycoll.torch_backend.streams import OnStream
from pycoll.torch_backend.work import Work
from pycoll.torch_backend.worker import Lane

log = logging.getLogger(__name__)

NAME = "pycoll"


class GroupBase(dist.ProcessGroup):
    """A ``torch.distributed`` process group over a pycoll communicator: the part
    its operations (:mod:`.collectives`, :mod:`.peer`, :mod:`.exchange`) share.

    Args:
        comm: the communicator (this group closes it on ``shutdown``).
        rank: this process' rank in the group (must equal ``comm.rank``).
        size: the group size (must equal ``comm.size``).
        bootstrap: the bootstrap ``comm`` was built over; ``shutdown`` passes a
            barrier on it (bounded by the timeout) before closing ``comm``.
        store: the group's ``torch.distributed`` store (``monitored_barrier`` meets
            there); None: ``monitored_barrier`` is unsupported.
        lane: the worker thread of ``comm``'s family (:mod:`.worker`), shared with
            the groups over communicators split from the same root; None: a new one.

    Every collective is bounded by ``comm.config.timeout``.
    """

    def __init__(
        self,
        comm: pycoll.Communicator,
        rank: int,
        size: int,
        bootstrap: Any = None,
        store: Any = None,
        lane: Lane | None = None,
    ) -> None:
        super().__init__(rank, size)  # type: ignore[call-arg]
        if (comm.rank, comm.size) != (rank, size):
            raise RuntimeError(
                f"pycoll backend: torch rank {rank} of {size} but the pycoll communicator "
                f"is rank {comm.rank} of {comm.size}"
            )
        self._comm = comm
        self._bootstrap = bootstrap
        self._rank = rank
        self._size = size
        self._store = store
        self._timeout = float(comm.config.timeout)
        self._group_name = ""
        self._group_desc = ""
        self._monitored = 0  # monitored_barrier calls so far (their keys in the store)
        self._lane = (lane or Lane()).join()
        self._streams: dict[int, torch.cuda.Stream] = {}  # per device (see .streams)
        self._staged_why = ""  # why CUDA tensors go through the host, once logged
        self._mirrors = Mirrors(comm, self._timeout)  # see .mirrors
        self._kept = Kept(rank)  # see .kept
        self._closed = False
        # the point-to-point calls since _start_coalescing (:mod:`.peer`), else None
        self._batch: list[Any] | None = None

    # --- identity
    def getBackendName(self) -> str:
        return NAME

    def getRank(self) -> int:
        return self._rank

    def getSize(self) -> int:
        return self._size

    # c10d names every group (``_set_group_name``/``_set_group_desc``) and looks
    # groups up by name: DeviceMesh, DTensor, FSDP2, functional collectives and
    # destroy_process_group.  A C++ group keeps the name in its backend; a Python
    # group has none, so it keeps the name itself.
    def setGroupName(self, name: str) -> None:
        self._group_name = name

    def getGroupName(self) -> str:
        return self._group_name

    def setGroupDesc(self, desc: str) -> None:
        self._group_desc = desc

    def getGroupDesc(self) -> str:
        return self._group_desc

    def __repr__(self) -> str:
        return f"<ProcessGroupPycoll rank {self._rank} of {self._size}>"

    @property
    def communicator(self) -> pycoll.Communicator:
        return self._comm

    # --- the device
    def _stream(
        self, tensors: Sequence[torch.Tensor], what: str, sync: bool = False
    ) -> torch.cuda.Stream | None:
        """The stream the call runs on where it runs on the device (its tensors are
        CUDA tensors of the communicator's device), else None: it goes through the
        host.  The group's stream; for a synchronous call (``sync``, see
        :func:`is_sync`), the caller's current stream, as ProcessGroupNCCL does.

        Raises:
            InvalidArgumentError: CPU and CUDA tensors, or tensors of two devices.
        """
        if not sync and len(tensors) == 1 and tensors[0].is_cuda:  # DDP's calls
            known = self._streams.get(tensors[0].get_device())  # made for this device
            if known is not None:
                return known
        devices = {t.device for t in tensors}
        if not devices or all(d.type == "cpu" for d in devices):
            return None
        if len(devices) > 1:
            names = ", ".join(sorted(str(d) for d in devices))
            raise InvalidArgumentError(
                f"pycoll backend, rank {self._rank}: {what}: tensors on {names}; "
                "one call takes tensors of one device"
            )
        (dev,) = devices
        mine = self._comm.device
        why = ""
        if dev.type != "cuda":
            why = f"pycoll moves {dev.type} tensors through host memory"
        elif mine is None:
            why = "the communicator has no device side (is CuPy installed?)"
        elif dev.index != mine:
            why = (
                f"they are on {dev} but the communicator's device is cuda:{mine} (the current "
                "device at init_process_group: call torch.cuda.set_device first)"
            )
        if why:
            if why != self._staged_why:
                self._staged_why = why
                log.warning(
                    "pycoll backend, rank %d: %s tensors go through the host: %s",
                    self._rank,
                    dev,
                    why,
                )
            return None
        assert mine is not None
        if sync:
            return torch.cuda.current_stream(dev)
        stream = self._streams.get(mine)
        if stream is None:
            stream = self._streams[mine] = torch.cuda.Stream(dev)
            log.info(
                "pycoll backend, rank %d: collectives on %s run on stream %s",
                self._rank,
                dev,
                stream,
            )
        return stream

    # --- the worker
    def _here(
        self, stream: torch.cuda.Stream | None, what: str, sizes: Sequence[int], sync: bool
    ) -> bool:
        """Whether a call may run on the caller's thread (when the worker is idle,
        :meth:`Lane.run_here`).  A synchronous call (``sync``) may: its caller
        waits for it anyway.  An asynchronous one may where it runs on the device
        and each of its pycoll calls (``what``, of ``sizes`` bytes in ``sendbuf``)
        returns before its device work is done, having waited only for the peers'
        descriptors.  The worker's two thread hops cost such a call more than that
        wait: 130-190 us of a 256 MiB allreduce on the H200 machine
        (benchmarks/RESULTS.md, "The torch backend's share of a device allreduce")."""
        if sync:
            return True
        return stream is not None and all(self._comm.returns_early(what, n) for n in sizes)

    def _work(
        self, what: str, stream: torch.cuda.Stream | None, sync: bool = False, after: bool = True
    ) -> Work:
        """The Work of a call; with ``stream``, its place there (:class:`OnStream`)."""
        if self._closed:
            raise RuntimeError(f"pycoll backend: {self!r} is shut down")
        return Work(
            what,
            self._rank,
            self._timeout,
            self._lane.busy,
            OnStream(stream, current=sync, after=after) if stream is not None else None,
        )

    def _enqueue(
        self,
        what: str,
        run: Callable[[], Any],
        stream: torch.cuda.Stream | None = None,
        here: bool = False,
        sync: bool = False,
    ) -> Work:
        """Queue ``run`` to the worker (``here``: run it on this thread if the worker
        is idle, see :meth:`Lane.run_here`); with ``stream``, ordered on the device
        after the caller's current stream and before what ``Work.wait()`` orders
        after it (``sync``: ``stream`` is the caller's current stream)."""
        work = self._work(what, stream, sync)
        lane = self._lane
        if not (here and lane.run_here(run, work)):
            lane.put(run, work)
        return work

    def shutdown(self) -> None:
        """Finish queued calls, close the communicator, stop the worker (once no
        group of the family uses it)."""
        if self._closed:
            return
        self._closed = True
        lane = self._lane

        def close() -> None:
            if lane.broken:  # a failed call: the peers may be gone, wait for none
                self._comm.abort()
                return
            if self._bootstrap is not None:
                # Every rank must have drained its last collective before any closes:
                # a shm peer that sees the other end closed fails a receive whose
                # data was already delivered.
                try:
                    self._bootstrap.barrier(self._comm.config.timeout, "pycoll backend: shutdown")
                except pycoll.PycollError as exc:
                    log.warning("pycoll backend: %s", exc)
            self._comm.close()
            self._mirrors.clear()
            self._kept.clear()

        try:
            lane.call(close)
        finally:
            lane.leave()

    def abort(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._comm.abort()
        self._lane.leave(wait=False)


def is_sync(opts: Any) -> bool:
    """Whether torch waits for the call as soon as it returns (``async_op=False``:
    torch sets ``opts.asyncOp``; DDP's own calls and older torch leave it True)."""
    return opts is not None and getattr(opts, "asyncOp", True) is False
