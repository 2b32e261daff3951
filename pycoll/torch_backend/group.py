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

from pycoll.errors import CollectiveTimeout, InvalidArgumentError
from pycoll.torch_backend.base import NAME
from pycoll.torch_backend.collectives import Collectives
from pycoll.torch_backend.errors import GLOO, torch_error, unsupported
from pycoll.torch_backend.exchange import Exchanges
from pycoll.torch_backend.peer import PointToPoint

log = logging.getLogger(__name__)


class ProcessGroupPycoll(PointToPoint, Exchanges, Collectives):
    """A ``torch.distributed`` process group over a pycoll communicator; its
    arguments are :class:`~pycoll.torch_backend.base.GroupBase`'s.

    Every call is bounded by ``comm.config.timeout``.
    """

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

    # --- torch's bookkeeping
    def get_group_store(self) -> Any:
        return self._store

    def _wait_for_pending_works(self) -> None:
        """Return once the calls queued so far have run."""
        self._lane.call(lambda: None)

    # --- what pycoll does not offer yet: a clear error, not torch's "No backend type"
    def _get_backend(self, device: Any) -> Any:
        raise unsupported(
            self._rank,
            f"_get_backend({device}) (a per-device backend object)",
            "a pycoll group is its own backend: call its methods",
        )

    def _register_on_completion_hook(self, hook: Any) -> None:
        raise unsupported(
            self._rank,
            "_register_on_completion_hook",
            "chain on the Work's future: work.get_future().then(...)",
        )

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
