"""The process group: a ``torch.distributed.ProcessGroup`` over a pycoll communicator."""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable, Sequence
from datetime import timedelta
from time import monotonic
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.constants import default_pg_timeout

import pycoll
from pycoll.errors import CollectiveTimeout, InvalidArgumentError
from pycoll.torch_backend.errors import GLOO, P2P, torch_error, unsupported
from pycoll.torch_backend.tensors import Staged, check_dtypes, check_one, reduce_op
from pycoll.torch_backend.work import Work
from pycoll.torch_backend.worker import Lane

log = logging.getLogger(__name__)

NAME = "pycoll"


class ProcessGroupPycoll(dist.ProcessGroup):
    """A ``torch.distributed`` process group over a pycoll communicator.

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
        self._closed = False

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

    # --- the worker
    def _enqueue(self, what: str, run: Callable[[], Any]) -> Work:
        if self._closed:
            raise RuntimeError(f"pycoll backend: {self!r} is shut down")
        lane = self._lane
        work = Work(what, self._rank, self._timeout, lane.busy)
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

    # --- subgroups
    @property
    def new_group(self) -> Callable[..., Any] | None:
        """torch's hook for subgroups of the default group: :meth:`split_group`
        where a split can make the group, else None (torch then builds it through
        the backend's creator, over a bootstrap of its own, as for any backend).

        ``dist.new_group`` calls ``default_pg.new_group(ranks, timeout=...,
        pg_options=..., group_name=..., group_desc=...)`` on every rank of the
        world, member or not, where the default group has that method, without
        the backend it was asked for; its caller's frame holds that.  A split
        needs every rank of this group, so only calls where every rank enters
        take it: backend ``pycoll``, no ``use_local_synchronization``, and this
        group's timeout (or torch's default, which leaves it to pycoll).
        """
        caller = sys._getframe(1)
        if caller.f_code.co_name != "_new_group_with_tag" or self._closed:
            return None
        asked = caller.f_locals
        if str(asked.get("backend")) != NAME or asked.get("use_local_synchronization"):
            return None
        t = asked.get("timeout")
        if isinstance(t, timedelta) and t not in (
            default_pg_timeout,
            timedelta(seconds=self._timeout),
        ):
            return None
        return self._new_subgroup

    def _new_subgroup(
        self,
        ranks: Sequence[int],
        timeout: timedelta | None = None,
        pg_options: Any = None,
        group_name: str | None = None,
        group_desc: str | None = None,
    ) -> ProcessGroupPycoll | None:
        return self.split_group(ranks, timeout, pg_options, group_name, group_desc)

    def split_group(  # type: ignore[override]
        self,
        new_ranks: Sequence[int],
        timeout: timedelta | None = None,
        opts: Any = None,
        group_name: str | None = None,
        group_desc: str | None = None,
        device_types: Any = None,
    ) -> ProcessGroupPycoll | None:
        """The group of ``new_ranks`` (ranks of this group; their order is the new
        group's), split from this group's communicator; every rank of this group
        calls it.  It shares this group's connections and worker thread, and its
        timeout.

        Returns:
            The new group, or None on a rank that is not in ``new_ranks``.
        """
        members = [int(r) for r in new_ranks]
        me = self._rank
        color, key = (0, members.index(me)) if me in members else (None, 0)
        if self._closed:
            raise RuntimeError(f"pycoll backend: {self!r} is shut down")
        try:
            comm = self._lane.call(lambda: self._comm.split(color, key))
        except BaseException as exc:
            raise torch_error(exc) from None
        if comm is None:
            return None
        store = None
        if self._store is not None:
            store = dist.PrefixStore(f"pycoll/split/{group_name}/", self._store)
        pg = ProcessGroupPycoll(comm, comm.rank, comm.size, store=store, lane=self._lane)
        pg.setGroupName(group_name or "")
        pg.setGroupDesc(group_desc or "undefined")
        return pg

    # --- collectives
    def allreduce(self, tensors: list[torch.Tensor], opts: Any = None) -> Any:  # type: ignore[override]
        check_one(tensors, "allreduce", self._rank)
        return self.allreduce_coalesced(tensors, opts)

    def allreduce_coalesced(self, tensors: list[torch.Tensor], opts: Any = None) -> Any:
        op = reduce_op(opts, self._rank) if opts is not None else "sum"
        staged = [Staged(t, self._rank, as_bytes=False) for t in tensors]

        def run() -> list[torch.Tensor]:
            for s in staged:
                self._comm.allreduce(s.array, op=op)
                s.finish()
            return tensors

        return self._enqueue("allreduce", run)

    def broadcast(self, tensors: list[torch.Tensor], opts: Any = None) -> Any:  # type: ignore[override]
        check_one(tensors, "broadcast", self._rank)
        root = int(opts.rootRank) if opts is not None else 0
        s = Staged(tensors[0], self._rank, as_bytes=True, copy_in=self._rank == root)

        def run() -> list[torch.Tensor]:
            self._comm.broadcast(s.array, root=root)
            if self._rank != root:
                s.finish()
            return tensors

        return self._enqueue("broadcast", run)

    def reduce(self, tensors: list[torch.Tensor], opts: Any = None) -> Any:  # type: ignore[override]
        check_one(tensors, "reduce", self._rank)
        op = reduce_op(opts, self._rank) if opts is not None else "sum"
        root = int(opts.rootRank) if opts is not None else 0
        s = Staged(tensors[0], self._rank, as_bytes=False)

        def run() -> list[torch.Tensor]:
            self._comm.reduce(s.array, root=root, op=op)
            if self._rank == root:
                s.finish()
            return tensors

        return self._enqueue("reduce", run)

    def allgather(  # type: ignore[override]
        self,
        output_tensors: list[list[torch.Tensor]],
        input_tensors: list[torch.Tensor],
        opts: Any = None,
    ) -> Any:
        check_one(input_tensors, "allgather", self._rank)
        outs = output_tensors[0]
        if len(outs) != self._size:
            raise InvalidArgumentError(
                f"pycoll backend, rank {self._rank}: allgather needs {self._size} output tensors, got {len(outs)}"
            )
        x = Staged(input_tensors[0], self._rank, as_bytes=True)
        k = x.array.size
        for o in outs:
            check_dtypes(o, input_tensors[0], "allgather", self._rank)
            if o.numel() * o.element_size() != k:
                raise InvalidArgumentError(
                    f"pycoll backend, rank {self._rank}: allgather output tensor of {o.numel()} x {o.dtype} "
                    f"does not match the input's {input_tensors[0].numel()} x {input_tensors[0].dtype}"
                )
        staged = [Staged(o, self._rank, as_bytes=True, copy_in=False) for o in outs]

        def run() -> list[list[torch.Tensor]]:
            gathered = self._comm.allgather(x.array).reshape(self._size, k)
            for r, s in enumerate(staged):
                s.array[...] = gathered[r]
                s.finish()
            return output_tensors

        return self._enqueue("allgather", run)

    def _allgather_base(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> Any:
        return self.allgather_into_tensor_coalesced([output], [input], opts)

    def all_gather_single(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> Any:
        return self.allgather_into_tensor_coalesced([output], [input], opts)

    def allgather_into_tensor_coalesced(
        self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None
    ) -> Any:
        pairs = []
        for o, i in zip(outputs, inputs, strict=True):
            check_dtypes(o, i, "allgather_into_tensor", self._rank)
            if o.numel() * o.element_size() != self._size * i.numel() * i.element_size():
                raise InvalidArgumentError(
                    f"pycoll backend, rank {self._rank}: allgather output has {o.numel()} elements, expected "
                    f"{self._size} x {i.numel()}"
                )
            pairs.append(
                (
                    Staged(i, self._rank, as_bytes=True),
                    Staged(o, self._rank, as_bytes=True, copy_in=False),
                )
            )

        def run() -> list[torch.Tensor]:
            for x, out in pairs:
                self._comm.allgather(x.array, out.array)
                out.finish()
            return outputs

        return self._enqueue("allgather_into_tensor", run)

    def all_gather_single_coalesced(
        self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None
    ) -> Any:
        return self.allgather_into_tensor_coalesced(outputs, inputs, opts)

    def reduce_scatter(  # type: ignore[override]
        self,
        output_tensors: list[torch.Tensor],
        input_tensors: list[list[torch.Tensor]],
        opts: Any = None,
    ) -> Any:
        check_one(output_tensors, "reduce_scatter", self._rank)
        ins = input_tensors[0]
        for t in ins:
            check_dtypes(output_tensors[0], t, "reduce_scatter", self._rank)
        if len(ins) != self._size:
            raise InvalidArgumentError(
                f"pycoll backend, rank {self._rank}: reduce_scatter needs {self._size} input tensors, got {len(ins)}"
            )
        flat_in = torch.cat([t.detach().reshape(-1).to("cpu") for t in ins])
        return self._reduce_scatter([output_tensors[0]], [flat_in], opts)

    def _reduce_scatter_base(
        self, output: torch.Tensor, input: torch.Tensor, opts: Any = None
    ) -> Any:
        return self._reduce_scatter([output], [input], opts)

    def reduce_scatter_single(
        self, output: torch.Tensor, input: torch.Tensor, opts: Any = None
    ) -> Any:
        return self._reduce_scatter([output], [input], opts)

    def reduce_scatter_tensor_coalesced(
        self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None
    ) -> Any:
        return self._reduce_scatter(outputs, inputs, opts)

    def reduce_scatter_single_coalesced(
        self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None
    ) -> Any:
        return self._reduce_scatter(outputs, inputs, opts)

    def _reduce_scatter(
        self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any
    ) -> Any:
        op = reduce_op(opts, self._rank) if opts is not None else "sum"
        pairs = []
        for o, i in zip(outputs, inputs, strict=True):
            check_dtypes(o, i, "reduce_scatter", self._rank)
            if i.numel() != self._size * o.numel():
                raise InvalidArgumentError(
                    f"pycoll backend, rank {self._rank}: reduce_scatter input has {i.numel()} elements, expected "
                    f"{self._size} x {o.numel()}"
                )
            pairs.append(
                (
                    Staged(i, self._rank, as_bytes=False),
                    Staged(o, self._rank, as_bytes=False, copy_in=False),
                )
            )

        def run() -> list[torch.Tensor]:
            for x, out in pairs:
                self._comm.reduce_scatter(x.array, out.array, op=op)
                out.finish()
            return outputs

        return self._enqueue("reduce_scatter", run)

    def barrier(self, opts: Any = None) -> Any:
        def run() -> list[torch.Tensor]:
            self._comm.barrier()
            return []

        return self._enqueue("barrier", run)

    def allgather_coalesced(  # type: ignore[override]
        self,
        output_lists: list[list[torch.Tensor]],
        inputs: list[torch.Tensor],
        opts: Any = None,
    ) -> Any:
        """All inputs gathered in one collective: each rank's inputs travel as one
        block of bytes, split into ``output_lists[i][r]`` on arrival."""
        if len(output_lists) != len(inputs):
            raise InvalidArgumentError(
                f"pycoll backend, rank {self._rank}: allgather_coalesced has {len(inputs)} inputs "
                f"but {len(output_lists)} output lists"
            )
        for outs, i in zip(output_lists, inputs, strict=True):
            if len(outs) != self._size:
                raise InvalidArgumentError(
                    f"pycoll backend, rank {self._rank}: allgather_coalesced needs {self._size} "
                    f"output tensors per input, got {len(outs)}"
                )
            for o in outs:
                check_dtypes(o, i, "allgather_coalesced", self._rank)
                if o.numel() != i.numel():
                    raise InvalidArgumentError(
                        f"pycoll backend, rank {self._rank}: allgather_coalesced output of "
                        f"{o.numel()} elements for an input of {i.numel()}"
                    )
        sizes = [i.numel() * i.element_size() for i in inputs]
        parts = [i.detach().reshape(-1).view(torch.uint8).to("cpu") for i in inputs]
        block = torch.cat(parts) if parts else torch.empty(0, dtype=torch.uint8)
        x = Staged(block, self._rank, as_bytes=True)

        def run() -> list[list[torch.Tensor]]:
            gathered = self._comm.allgather(x.array).reshape(self._size, -1)
            for r in range(self._size):
                at = 0
                for outs, n in zip(output_lists, sizes, strict=True):
                    s = Staged(outs[r], self._rank, as_bytes=True, copy_in=False)
                    s.array[...] = gathered[r, at : at + n]
                    s.finish()
                    at += n
            return output_lists

        return self._enqueue("allgather_coalesced", run)

    def monitored_barrier(
        self, timeout: timedelta | None = None, wait_all_ranks: bool = False
    ) -> None:
        """A barrier that names the ranks that did not reach it within ``timeout``.

        Rank 0 waits for every other rank's arrival in the group's store, then lets
        them pass; queued collectives finish first.  (``dist.monitored_barrier``
        accepts Gloo groups only: call this method on the group, or
        :func:`monitored_barrier`.)

        Args:
            timeout: how long to wait (default: the group's timeout).
            wait_all_ranks: name every late rank, not only the first.

        Raises:
            CollectiveTimeout: some rank did not arrive (on rank 0, naming it), or
                rank 0 did not let this rank pass (on the others), within ``timeout``.
            UnsupportedError: the group was made without a store.
        """
        store = self._store
        if store is None:
            raise unsupported(self._rank, "monitored_barrier without a store", "use barrier()")
        secs = timeout.total_seconds() if timeout is not None else self._timeout
        self._monitored += 1
        key = f"pycoll/monitored_barrier/{self._monitored}"
        rank, size = self._rank, self._size

        def late(msg: str, missing: list[int]) -> BaseException:
            return torch_error(
                CollectiveTimeout(
                    f"pycoll backend, rank {rank}: monitored_barrier: {msg}",
                    missing=missing,
                    rank=rank,
                    peer=missing[0],
                )
            )

        def run() -> list[torch.Tensor]:
            deadline = monotonic() + secs
            if rank != 0:
                store.set(f"{key}/{rank}", "1")
                try:
                    store.wait(
                        [f"{key}/pass"], timedelta(seconds=max(deadline - monotonic(), 0.001))
                    )
                except dist.DistStoreError:
                    raise late(f"rank 0 did not let it pass within {secs:g} s", [0]) from None
                return []
            missing = []
            for r in range(1, size):
                try:
                    left = max(deadline - monotonic(), 0.001)
                    store.wait([f"{key}/{r}"], timedelta(seconds=left))
                except dist.DistStoreError:
                    missing.append(r)
                    if not wait_all_ranks:
                        break
            if missing:
                who = (
                    f"Rank {missing[0]}"
                    if len(missing) == 1
                    else "Ranks " + ", ".join(map(str, missing))
                )
                raise late(
                    f"{who} failed to pass monitoredBarrier in {secs * 1000:.0f} ms", missing
                )
            store.set(f"{key}/pass", "1")
            return []

        self._enqueue("monitored_barrier", run).wait()

    # --- what pycoll does not offer yet: a clear error, not torch's "No backend type"
    def send(self, tensors: list[torch.Tensor], dst: int, tag: int = 0) -> Any:  # type: ignore[override]
        raise unsupported(self._rank, "send", P2P)

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int = 0) -> Any:  # type: ignore[override]
        raise unsupported(self._rank, "recv", P2P)

    def recv_anysource(self, tensors: list[torch.Tensor], tag: int = 0) -> Any:
        raise unsupported(self._rank, "recv from any source", P2P)

    def gather(self, *args: Any, **kw: Any) -> Any:  # type: ignore[override]
        raise unsupported(
            self._rank, "gather", "use all_gather (every rank gets the result), or " + GLOO
        )

    def scatter(self, *args: Any, **kw: Any) -> Any:  # type: ignore[override]
        raise unsupported(
            self._rank,
            "scatter",
            "use broadcast of the whole tensor and take this rank's part, or " + GLOO,
        )

    def alltoall(self, *args: Any, **kw: Any) -> Any:  # type: ignore[override]
        raise unsupported(self._rank, "all_to_all", GLOO)

    def alltoall_base(self, *args: Any, **kw: Any) -> Any:
        raise unsupported(self._rank, "all_to_all_single", GLOO)

    def all_to_all_single(self, *args: Any, **kw: Any) -> Any:
        raise unsupported(self._rank, "all_to_all_single", GLOO)

    def _start_coalescing(self, device: Any) -> None:
        raise unsupported(self._rank, "coalescing (_coalescing_manager)", GLOO)

    def _end_coalescing(self, device: Any) -> Any:
        raise unsupported(self._rank, "coalescing (_coalescing_manager)", GLOO)

    def merge_remote_group(self, *args: Any, **kw: Any) -> Any:
        raise unsupported(self._rank, "merge_remote_group", GLOO)


def monitored_barrier(
    group: Any = None, timeout: timedelta | None = None, wait_all_ranks: bool = False
) -> None:
    """``dist.monitored_barrier`` for pycoll groups (torch's accepts only Gloo's).

    Args:
        group: a pycoll process group (default: the default group).
        timeout, wait_all_ranks: as for :meth:`ProcessGroupPycoll.monitored_barrier`.
    """
    pg = group if group is not None else dist.distributed_c10d._get_default_group()
    if not isinstance(pg, ProcessGroupPycoll):
        raise InvalidArgumentError(
            f"pycoll backend: monitored_barrier needs a pycoll group, got {pg!r}"
        )
    pg.monitored_barrier(timeout, wait_all_ranks)
