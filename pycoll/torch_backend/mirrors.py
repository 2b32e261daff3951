"""Asynchronous allreduces of CUDA tensors through pinned host mirrors.

Ranks that share one GPU time-slice it, and on the device path every wait of a
stream for another process's work costs up to a slice (docs/gpu.md, "One-sided
windows").  DDP's bucket allreduces are asynchronous, so there, where every
rank shares the GPU, they go the way Gloo's do, with no stream ever waiting for
another process:

1. the tensor is copied into a pinned host mirror of its own
   (:meth:`Mirrors.copy_in`).  The caller's thread queues that copy, as Gloo's
   does, on the group's stream after the caller's: so it is queued at once
   rather than once the worker has woken.  Its few CUDA calls go straight to
   the driver with the GIL held (:class:`transports.cuda_driver.Queuer`): the
   thread that makes them runs DDP's hooks, and the torch calls they replace
   cost it 140 us a bucket beside the worker;
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
import weakref
from typing import Any

import numpy as np
import torch

from pycoll.errors import CollectiveTimeout
from pycoll.gpu.jobs import poll
from pycoll.torch_backend.tensors import numpy_view
from transports.cuda_driver import Queuer

log = logging.getLogger(__name__)

#: Sizes (numel and dtype) whose free mirrors a process group keeps (DDP's
#: buckets have a handful of sizes); the least recently freed goes beyond that.
KEEP = 16


class Mirror:
    """A pinned host tensor, its NumPy view and one prepared allreduce per op."""

    __slots__ = ("__weakref__", "addr", "array", "calls", "copied", "host", "key")

    def __init__(self, numel: int, dtype: torch.dtype, rank: int, cu: Queuer) -> None:
        self.key = (numel, dtype)
        self.host = torch.empty(numel, dtype=dtype, pin_memory=True)
        self.addr = self.host.data_ptr()
        self.array: np.ndarray = numpy_view(self.host, False, rank)
        self.calls: dict[str, Any] = {}
        # recorded after each copy in: one event for the mirror's life (a new one
        # a call cost the caller's thread its creation)
        self.copied = cu.event()
        weakref.finalize(self, cu.free, self.copied)


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
        self._cu: Queuer | None = None
        self._stuck: list[Mirror] = []  # mirrors whose copies never ended: held
        # recorded on the caller's stream, waited for by the group's (under _lock)
        self._ready = 0

    def allreduce(self, flat: torch.Tensor, op: str) -> None:
        """Reduce the contiguous CUDA tensor ``flat`` in place through a mirror, on
        the current stream (the group's, on the worker thread)."""
        stream = torch.cuda.current_stream(flat.device).cuda_stream
        self.reduce(self.copy_in(flat, stream), flat, op, stream)

    def copy_in(self, flat: torch.Tensor, stream: int, after: int | None = None) -> Mirror:
        """Queue the copy of the contiguous CUDA tensor ``flat`` into a free mirror
        on ``stream`` (a ``cudaStream_t`` of its device), after the work queued
        so far on the stream ``after`` (when given; 0 is the legacy default
        stream), and record the mirror's
        ``copied`` event after it.  The mirror is the call's until :meth:`reduce`
        frees it."""
        cu = self._cu
        if cu is None:
            cu = self._cu = Queuer(flat.get_device())
            self._ready = cu.event()
            weakref.finalize(self, cu.free, self._ready)
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
        m = self._take(flat.numel(), flat.dtype, cu)
        if after is not None:
            with self._lock:  # one event: record and wait as a pair
                cu.record(self._ready, after)
                cu.wait(stream, self._ready)
        cu.copy(m.addr, flat.data_ptr(), flat.nbytes, stream)
        cu.record(m.copied, stream)
        return m

    def reduce(self, m: Mirror, flat: torch.Tensor, op: str, stream: int) -> None:
        """Once the copy into ``m`` is done, reduce it on the host and queue its
        copy back into ``flat`` on ``stream`` (the group's, a ``cudaStream_t``);
        ``m`` is free again, also where the reduction raised (nothing of it is in
        flight)."""
        try:
            cu = self._cu
            assert cu is not None, "reduce() before copy_in()"
            self._wait(cu, m.copied)
            call = m.calls.get(op)
            if call is None:
                call = m.calls[op] = self._comm.prepare("allreduce", m.array, op=op)
            call()
            cu.copy(flat.data_ptr(), m.addr, flat.nbytes, stream)
            cu.record(m.copied, stream)  # now: once the copy back has read the mirror
        finally:
            self._give(m)

    def _take(self, numel: int, dtype: torch.dtype, cu: Queuer) -> Mirror:
        with self._lock:
            free = self._free.get((numel, dtype))
            if free:
                return free.pop()
        return Mirror(numel, dtype, self._rank, cu)

    def _give(self, m: Mirror) -> None:
        with self._lock:
            free = self._free.pop(m.key, [])
            free.append(m)
            self._free[m.key] = free  # most recently freed size last
            gone = self._free.pop(next(iter(self._free))) if len(self._free) > KEEP else []
        self._drop(gone)

    def _drop(self, mirrors: list[Mirror]) -> None:
        """Let ``mirrors`` go once their last copies are done: their pinned memory
        goes back to torch, which would hand it out again (torch's own copies
        mark it in use; these, made through the driver, do not)."""
        cu = self._cu
        if cu is None:  # no copy was ever queued
            return
        for m in mirrors:
            try:
                self._wait(cu, m.copied)
            except CollectiveTimeout:
                log.warning(
                    "pycoll backend, rank %d: a host mirror's copy did not end within %g s; "
                    "its %d bytes of pinned memory stay held",
                    self._rank,
                    self._timeout,
                    m.host.nbytes,
                )
                self._stuck.append(m)

    def _wait(self, cu: Queuer, copied: int) -> None:
        """Until the copies into or out of a mirror are done: a copy in follows the
        caller's work queued before the call (the gradients), so it may take a
        while."""
        poll(
            lambda: cu.done(copied),
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
            gone = [m for free in self._free.values() for m in free]
            self._free.clear()
        self._drop(gone)
