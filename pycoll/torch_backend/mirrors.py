"""Asynchronous allreduces of CUDA tensors through pinned host mirrors.

Ranks that share one GPU time-slice it, and on the device path every wait of a
stream for another process's work costs up to a slice (docs/gpu.md, "One-sided
windows").  DDP's bucket allreduces are asynchronous and run on the group's
worker thread, so there, where every rank shares the GPU, they go the way
Gloo's do, with no stream ever waiting for another process:

1. on the group's stream (after the caller's, :mod:`.streams`), the tensor is
   copied into a pinned host mirror of its size;
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

A mirror is reused by the next call of its size and dtype; both run on the
group's stream, so the next copy into it is ordered after this copy out of it.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import torch

from pycoll.errors import CollectiveTimeout
from pycoll.gpu.jobs import poll
from pycoll.torch_backend.tensors import numpy_view

log = logging.getLogger(__name__)

#: Mirrors kept per process group (one per bucket size and dtype; DDP's buckets
#: have a handful of sizes); the least recently used one goes beyond that.
KEEP = 16


class Mirror:
    """A pinned host tensor, its NumPy view and one prepared allreduce per op."""

    __slots__ = ("array", "calls", "host")

    def __init__(self, numel: int, dtype: torch.dtype, rank: int) -> None:
        self.host = torch.empty(numel, dtype=dtype, pin_memory=True)
        self.array: np.ndarray = numpy_view(self.host, False, rank)
        self.calls: dict[str, Any] = {}


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
        self._mirrors: dict[tuple[int, torch.dtype], Mirror] = {}

    def allreduce(self, flat: torch.Tensor, op: str) -> None:
        """Reduce the contiguous CUDA tensor ``flat`` in place through its mirror,
        on the current stream (the group's, on the worker thread)."""
        if not self._mirrors:
            log.info(
                "pycoll backend, rank %d: asynchronous allreduces of CUDA tensors up to %d "
                "bytes go through pinned host mirrors: every rank shares one GPU, where a "
                "wait for another process's stream costs a time slice "
                "(PYCOLL_DEVICE_ASYNC_HOST_BYTES)",
                self._rank,
                self._comm.config.device_async_host_bytes,
            )
        m = self._mirror(flat)
        m.host.copy_(flat, non_blocking=True)
        self._wait(torch.cuda.current_stream(flat.device).record_event())
        call = m.calls.get(op)
        if call is None:
            call = m.calls[op] = self._comm.prepare("allreduce", m.array, op=op)
        call()
        flat.copy_(m.host, non_blocking=True)

    def _mirror(self, flat: torch.Tensor) -> Mirror:
        key = (flat.numel(), flat.dtype)
        m = self._mirrors.pop(key, None)
        if m is None:
            if len(self._mirrors) >= KEEP:
                self._mirrors.pop(next(iter(self._mirrors)))
            m = Mirror(key[0], key[1], self._rank)
        self._mirrors[key] = m  # most recently used last
        return m

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
        self._mirrors.clear()
