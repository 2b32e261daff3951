"""Point-to-point: send, recv, recv from any source, and coalesced batches.

torch's ``isend``/``irecv``/``send``/``recv`` call :meth:`PointToPoint.send`,
:meth:`~PointToPoint.recv` and :meth:`~PointToPoint.recv_anysource`.  Each is
a job on the group's worker that posts the call on the communicator
(``async_op=True``) and returns at once; the worker completes the ``Work``
when the message has moved (:mod:`.worker`).  So the calls of one rank
complete in any order among themselves, as Gloo's do: ``dist.batch_isend_irecv``
of a ring, which torch runs as one ``isend``/``irecv`` after the other for a
Python group, never deadlocks.  Between ``_start_coalescing`` and
``_end_coalescing`` (``dist._coalescing_manager``) the calls are kept and
posted together in one ``comm.group()``.

Tensors move as bytes: any dtype, and a receive takes a message of its own
size in bytes (another raises ``CollectiveMismatchError`` and writes nothing).
A collective of the group's family first completes the calls posted before it
(:mod:`pycoll.p2p`), as NCCL orders them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from pycoll.errors import InvalidArgumentError
from pycoll.torch_backend.base import GroupBase
from pycoll.torch_backend.tensors import Staged, check_one
from pycoll.torch_backend.work import Posted, Work

#: One call of a coalesced batch: send or not, the tensor's flat bytes, the peer
#: (None: any source), the tag, its Work and what completes it.
_Call = tuple[bool, Any, int | None, int, Work, Callable[[], Any]]


class PointToPoint(GroupBase):
    """The point-to-point calls of :class:`~pycoll.torch_backend.ProcessGroupPycoll`."""

    def send(self, tensors: list[torch.Tensor], dstRank: int, tag: int = 0) -> Any:  # type: ignore[override]
        check_one(tensors, "send", self._rank)
        peer = self._peer(dstRank, "send")
        x = Staged(tensors[0], self._rank, as_bytes=True)
        return self._post(True, x.array, peer, tag, f"send to {peer} (tag {tag})", lambda: tensors)

    def recv(self, tensors: list[torch.Tensor], srcRank: int, tag: int = 0) -> Any:  # type: ignore[override]
        check_one(tensors, "recv", self._rank)
        peer = self._peer(srcRank, "recv")
        return self._receive(tensors, peer, tag, f"recv from {peer} (tag {tag})")

    def recv_anysource(self, tensors: list[torch.Tensor], tag: int = 0) -> Any:
        """A receive from any rank of the group; the Work's ``_source_rank()`` names it."""
        check_one(tensors, "recv", self._rank)
        return self._receive(tensors, None, tag, f"recv from any source (tag {tag})")

    def _receive(self, tensors: list[torch.Tensor], peer: int | None, tag: int, what: str) -> Any:
        out = Staged(tensors[0], self._rank, as_bytes=True, copy_in=False)

        def finish() -> list[torch.Tensor]:
            out.finish()
            return tensors

        return self._post(False, out.array, peer, tag, what, finish)

    def _peer(self, rank: Any, what: str) -> int:
        if not isinstance(rank, int) or not 0 <= rank < self._size:
            raise InvalidArgumentError(
                f"pycoll backend, rank {self._rank}: {what}: peer {rank!r} is not a rank "
                f"of this group of {self._size}"
            )
        return rank

    def _post(
        self,
        send: bool,
        flat: Any,
        peer: int | None,
        tag: int,
        what: str,
        finish: Callable[[], Any],
    ) -> Work:
        comm = self._comm
        batch = self._batch
        if batch is not None:  # posted at _end_coalescing
            work = Work(what, self._rank, self._timeout, self._lane.busy)
            batch.append((send, flat, peer, tag, work, finish))
            return work

        def run() -> Posted:
            return Posted(_issue(comm, send, flat, peer, tag, True), finish)

        return self._enqueue(what, run)

    # --- coalescing: dist._coalescing_manager(group, device)
    def _start_coalescing(self, device: Any) -> None:
        if self._batch is not None:
            raise InvalidArgumentError(
                f"pycoll backend, rank {self._rank}: _start_coalescing: already coalescing"
            )
        self._batch = []

    def _end_coalescing(self, device: Any) -> Any:
        """Post the point-to-point calls made since ``_start_coalescing`` together
        (``comm.group()``); the Work completes once all of them have."""
        batch, self._batch = self._batch, None
        if batch is None:
            raise InvalidArgumentError(
                f"pycoll backend, rank {self._rank}: _end_coalescing without _start_coalescing"
            )
        comm = self._comm

        def run() -> list[torch.Tensor]:
            try:
                with comm.group():
                    reqs = [_issue(comm, s, x, p, t, False) for s, x, p, t, _, _ in batch]
            except BaseException as exc:
                for call in batch:
                    call[4]._fail(exc)
                raise
            outputs: list[torch.Tensor] = []
            first: BaseException | None = None
            for (_, _, _, _, work, finish), req in zip(batch, reqs, strict=True):
                try:
                    req.wait()
                    work._source = req.source
                    out = finish()
                except BaseException as exc:
                    work._fail(exc)
                    first = first or exc
                else:
                    work._complete(out)
                    outputs += out
            if first is not None:
                raise first
            return outputs

        return self._enqueue(f"{len(batch)} coalesced send/recv", run)


def _issue(comm: Any, send: bool, flat: Any, peer: int | None, tag: int, async_op: bool) -> Any:
    """``comm.send`` or ``comm.recv``: a request (or, inside ``group()``, one
    that completes at the group's exit)."""
    if send:
        return comm.send(flat, peer, tag=tag, async_op=async_op)
    return comm.recv(flat, peer, tag=tag, async_op=async_op)
