"""Asynchronous allreduces of CUDA tensors through pinned host mirrors.

Ranks that share one GPU time-slice it, and on the device path every wait of a
stream for another process's work costs up to a slice (docs/gpu.md, "One-sided
windows").  DDP's bucket allreduces are asynchronous, so there, where every
rank shares the GPU, they go the way Gloo's do, with no stream ever waiting for
another process:

1. the tensor is copied into a pinned host mirror of its own
   (:meth:`Mirrors.copy_in`).  The caller's thread queues that copy, as Gloo's
   does, on the group's stream after the caller's: so it is queued at once
   rather than once the worker has woken;
2. the worker waits on the host for that copy (polling its event with back-off,
   bounded by the group's timeout);
3. the host allreduce runs in place on the mirror, as a prepared call
   (:meth:`pycoll.Communicator.prepare`: planned once, replayed afterwards);
4. the mirror is copied back into the tensor on the group's stream, and the
   Work completes; ``Work.wait()`` then makes the caller's stream wait for
   that copy, on the device.

So ``Work.wait()`` on such a call waits on the host until the reduction is done
(the worker's part), as Gloo's does; the device path's would not.  The choice,
and the size up to which it holds, is :meth:`pycoll.Communicator.async_via_host`.

A mirror belongs to one call from its copy in to its copy back; then it is free
for the next call of its size and dtype.  Both copies run on the group's
stream, and the host frees a mirror once it has queued its copy back: so the
next copy in comes after it on the device, and the host touches a mirror only
after its copy in is done.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

import numpy as np
import torch

from pycoll.errors import CollectiveTimeout
from pycoll.gpu.jobs import poll
from pycoll.torch_backend.tensors import numpy_view

log = logging.getLogger(__name__)

#: Sizes (numel and dtype) whose free mirrors a process group keeps (DDP's
#: buckets have a handful of sizes); the least recently freed goes beyond that.
KEEP = 16


class Mirror:
    """A pinned host tensor, its NumPy view and one prepared allreduce per op."""

    __slots__ = ("array", "calls", "copied", "host", "key")

    def __init__(self, numel: int, dtype: torch.dtype, rank: int) -> None:
        self.key = (numel, dtype)
        self.host = torch.empty(numel, dtype=dtype, pin_memory=True)
        self.array: np.ndarray = numpy_view(self.host, False, rank)
        self.calls: dict[str, Any] = {}
        # recorded after each copy in: one event for the mirror's life (a new one
        # a call cost the caller's thread its creation)
        self.copied = torch.cuda.Event()


class Mirrors:
    """A process group's pinned mirrors and its host allreduce through them.

    Args:
        comm: the group's communicator.
        timeout: seconds to wait for the copy into a mirror (the group's timeout).
    """

    def __init__(self, comm: Any, timeout: float) -> None:
        self._comm = comm
        self._timeout = timeout
        self._rank = comm.rank
        # the free mirrors by (numel, dtype), the least recently freed size first;
        # taken on the caller's thread, freed on the worker's
        self._free: dict[tuple[int, torch.dtype], list[Mirror]] = {}
        self._lock = threading.Lock()
        self._logged = False

    def allreduce(self, flat: torch.Tensor, op: str) -> None:
        """Reduce the contiguous CUDA tensor ``flat`` in place through a mirror, on
        the current stream (the group's, on the worker thread)."""
        self.reduce(self.copy_in(flat), flat, op)

    def copy_in(self, flat: torch.Tensor, stream: torch.cuda.Stream | None = None) -> Mirror:
        """Queue the copy of the contiguous CUDA tensor ``flat`` into a free mirror,
        on ``stream`` (the current stream of its device), and record the mirror's
        ``copied`` event after it.  The mirror is the call's until :meth:`reduce`
        frees it."""
        if not self._logged:
            self._logged = True
            log.info(
                "pycoll backend, rank %d: asynchronous allreduces of CUDA tensors up to %d "
                "bytes go through pinned host mirrors: every rank shares one GPU, where a "
                "wait for another process's stream costs a time slice "
                "(PYCOLL_DEVICE_ASYNC_HOST_BYTES)",
                self._rank,
                self._comm.config.device_async_host_bytes,
            )
        m = self._take(flat.numel(), flat.dtype)
        m.host.copy_(flat, non_blocking=True)
        m.copied.record(stream or torch.cuda.current_stream(flat.device))
        return m

    def reduce(self, m: Mirror, flat: torch.Tensor, op: str) -> None:
        """Once the copy into ``m`` is done, reduce it on the host and queue its
        copy back into ``flat`` on the current stream (the group's); ``m`` is free
        again, also where the reduction raised (nothing of it is in flight)."""
        try:
            self._wait(m.copied)
            call = m.calls.get(op)
            if call is None:
                call = m.calls[op] = self._comm.prepare("allreduce", m.array, op=op)
            call()
            flat.copy_(m.host, non_blocking=True)
        finally:
            self._give(m)

    def _take(self, numel: int, dtype: torch.dtype) -> Mirror:
        with self._lock:
            free = self._free.get((numel, dtype))
            if free:
                return free.pop()
        return Mirror(numel, dtype, self._rank)

    def _give(self, m: Mirror) -> None:
        with self._lock:
            free = self._free.pop(m.key, [])
            free.append(m)
            self._free[m.key] = free  # most recently freed size last
            if len(self._free) > KEEP:
                self._free.pop(next(iter(self._free)))

    def _wait(self, copied: torch.cuda.Event) -> None:
        """Until the copy into the mirror is done: it follows the caller's work
        queued before the call (the gradients), so it may take a while."""
        poll(
            copied.query,
            self._timeout,
            lambda: CollectiveTimeout(
                f"pycoll backend, rank {self._rank}: the work queued on the stream "
                f"before an allreduce did not finish within {self._timeout:g} s "
                "(the group's timeout)",
                rank=self._rank,
            ),
            max_sleep=50e-6,
        )

    def clear(self) -> None:
        """Drop the mirrors (the group is shutting down)."""
        with self._lock:
            self._free.clear()
