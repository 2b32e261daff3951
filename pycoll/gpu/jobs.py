"""Device collectives as jobs: what keeps their buffers alive, how their failures
reach the caller, and the gates that would let every call only enqueue.

Gated (NCCL's contract; off for now, see below), a device collective call does
two things on the caller's thread and returns:

1. it enqueues its start on the caller's stream (an event, or the copy of the
   input to pinned host memory) and, for a blocking call, the wait for its end
   on that same stream: later work on the stream sees the result;
2. it hands the rest, the part that drives transfers from the host, to the
   communicator's progress thread (its worker), which runs jobs in call order.

The end is a *gate*: a 32-bit word in device memory per collective (a ring of
:data:`GATES` words, collective ``k`` using word ``k % GATES``).  The caller's
stream waits until the word reaches ``k`` (``cuStreamWaitValue32``, a cyclic
comparison, so ``k`` may wrap), enqueued before the progress thread has
enqueued anything; the progress thread opens it by writing ``k`` into the word
after the collective's device work (``cuStreamWriteValue32`` on pycoll's stream)
or, for host work (small messages through pinned memory), from a side stream
once that work is done.  An event cannot do this: a stream waits for the last
record of an event made *before* the wait was enqueued.

A job that fails, or never runs, opens its gate from the side stream anyway, so
that no stream waits forever; its output is then wrong, and the failure makes
the communicator unusable: the next call (or ``Request.wait``) raises it, and so
does ``close()`` when nothing did.  Each collective writes its own word, so a
late write by pycoll's stream never takes a gate back.

Gating is off (:attr:`GpuContext.gated <pycoll.gpu.context.GpuContext.gated>`):
loading a CUDA module synchronizes the context, and CuPy compiles and loads
each kernel as a module of its own at its first use.  Seen on an H200 at n = 2
(also with ``CUDA_MODULE_LOADING=EAGER``): the progress thread, loading the
reduction kernel of a collective whose gate the caller's stream waited for,
never returned, nor did the peer.  Gates need every kernel the progress thread
may launch loaded before any gate closes (as NCCL loads its kernels at init).
So a job is *ungated*: a blocking call runs its host part on the caller's
thread (or behind the queued ones) and orders the caller's stream after an
event recorded at its end, and an asynchronous one runs on the progress thread,
its ``wait`` first waiting for that host part.

Buffers (and pinned mirrors) stay referenced by their job until the job's
*retire* event, recorded after the gate's wait (and the copy back), or
ungated after the collective's last work, has
completed: :class:`Inflight` drops them as it sees that.  A job that failed
keeps them until the communicator closes, since device work that uses them may
still be queued.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from pycoll.errors import CollectiveTimeout
from transports.base import Backoff

#: Gate words per communicator; at most half as many collectives are in flight
#: (a new call waits, on the host, for the oldest to complete beyond that).
GATES = 4096
_NOT_READY = 600  # cudaErrorNotReady
_EVENT_FLAGS = 0x2  # cudaEventDisableTiming


def poll(
    ready: Callable[[], bool],
    timeout: float,
    fail: Callable[[], Exception],
    max_sleep: float = 100e-6,
) -> None:
    """Until ``ready()`` (an event's query: the work queued on a stream before a
    collective's host part), polling with back-off; after ``timeout`` seconds,
    raise ``fail()``.  The host never blocks in the driver, so the wait is bounded."""
    if ready():
        return
    at = time.monotonic() + timeout
    bo = Backoff(spins=16, yields=64, max_sleep=max_sleep)
    while not ready():
        if time.monotonic() >= at:
            raise fail()
        bo.pause()


class Gates:
    """The ring of gate words and the side stream that opens gates from the host.

    Args:
        base: device address of :data:`GATES` zeroed 32-bit words.
        side: ``cudaStream_t`` of a stream that waits for nothing (opens gates).
        write: ``write(stream, addr, value)``, ``cuStreamWriteValue32``.
        wait: ``wait(stream, addr, value)``, ``cuStreamWaitValue32`` (GEQ, cyclic).
    """

    def __init__(
        self,
        base: int,
        side: int,
        write: Callable[[int, int, int], None],
        wait: Callable[[int, int, int], None],
        device: int | None = None,
    ) -> None:
        self.base = base
        self.side = side
        self._write = write
        self._wait = wait
        self.device = device  # made current where the thread may have no context yet
        self.issued = 0

    @classmethod
    def on_device(cls, device: int) -> tuple[Gates, Any]:
        """Gates in fresh device memory of ``device``; also returns what owns that
        memory and the side stream (keep it as long as the gates)."""
        import cupy

        from transports import cuda_driver

        rt = cupy.cuda.runtime
        with cupy.cuda.Device(device):
            side = cupy.cuda.Stream(non_blocking=True)
            mem = cupy.cuda.alloc(4 * GATES)
            rt.memsetAsync(int(mem.ptr), 0, 4 * GATES, side.ptr)
            rt.streamSynchronize(side.ptr)  # zeroed before any stream waits on it
        gates = cls(
            int(mem.ptr), int(side.ptr), cuda_driver.stream_write, cuda_driver.stream_wait, device
        )
        return gates, (mem, side)

    def issue(self) -> int:
        self.issued += 1
        return self.issued

    def _addr(self, seq: int) -> int:
        return self.base + 4 * (seq % GATES)

    def wait(self, stream: int, seq: int) -> None:
        """Make ``stream`` wait until gate ``seq`` is open."""
        self._wait(stream, self._addr(seq), seq)

    def open(self, stream: int, seq: int) -> None:
        """Open gate ``seq`` after the work queued on ``stream``."""
        self._write(stream, self._addr(seq), seq)

    def open_now(self, seq: int) -> None:
        """Open gate ``seq`` from the side stream (after nothing), from any thread."""
        if self.device is None:
            self._write(self.side, self._addr(seq), seq)
            return
        import cupy

        with cupy.cuda.Device(self.device):
            self._write(self.side, self._addr(seq), seq)


class Job:
    """One device collective: its gate, its retire event and what it keeps alive.

    Made on the caller's thread (the subclass enqueues the caller's side and
    records :attr:`retire`); :meth:`settle` runs on the progress thread once the
    job's own part is over, whatever happened to it.
    """

    def __init__(self, gates: Gates, rt: Any, gated: bool = True) -> None:
        self.gates = gates
        self._rt = rt
        #: the caller's stream waits for a gate (else for an event, see the module)
        self.gated = gated
        self.seq = gates.issue()
        self.opened = False  # the gate is (or will be, by queued work) open
        self.failed = False  # opened by settle(): the output is not to be trusted
        self.retire = 0  # event: the job's device work and copies are over
        self.retired = False
        self.keep: list[Any] = []  # what the device work uses
        self.events: list[int] = []  # destroyed at retirement

    def event(self, stream: int) -> int:
        ev = int(self._rt.eventCreateWithFlags(_EVENT_FLAGS))
        self._rt.eventRecord(ev, stream)
        self.events.append(ev)
        return ev

    def open_after(self, stream: int) -> None:
        """Open the gate after the work queued on ``stream`` (the job succeeded)."""
        self.gates.open(stream, self.seq)
        self.opened = True

    def settle(self) -> None:
        """After the progress thread's part: a gate still closed is opened now, and
        the job counts as failed (its output is wrong)."""
        if not self.opened:
            self.opened = True
            self.failed = True
            if self.gated:
                self.gates.open_now(self.seq)

    def stream_wait(self, stream: int) -> None:
        """Make ``stream`` wait for the job's result (``Request.wait``); an ungated
        job's host part is over by then (its retire event is recorded)."""
        if self.gated:
            self.gates.wait(stream, self.seq)
        else:
            self._rt.streamWaitEvent(stream, self.retire, 0)

    def _complete(self) -> bool:
        return self.retired or (
            self.opened and (not self.retire or self._rt.eventQuery(self.retire) != _NOT_READY)
        )


class Inflight:
    """The jobs of one communicator whose device work may not be over, oldest first.

    Touched by the caller's thread (``add``, ``close``) and by whoever waits on a
    Request (``complete``, ``stream_wait``): one lock.
    """

    def __init__(self, rt: Any, timeout: float, rank: int) -> None:
        self._rt = rt
        self.timeout = timeout
        self.rank = rank
        self._jobs: deque[Job] = deque()
        self._failed: list[Job] = []  # kept, with their buffers, until close
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._jobs)

    def add(self, job: Job) -> None:
        """Track ``job``; first drop the completed ones, and beyond ``GATES // 2`` in
        flight wait (bounded) for the oldest."""
        self.reap()
        if len(self._jobs) >= GATES // 2:
            oldest = self._jobs[0]
            self._until(oldest, time.monotonic() + self.timeout, " (the oldest in flight)")
            self.reap()
        with self._lock:
            self._jobs.append(job)

    def reap(self) -> None:
        with self._lock:
            jobs = self._jobs
            while jobs and jobs[0]._complete():
                self._retire(jobs.popleft())

    def _retire(self, job: Job) -> None:
        if job.failed:
            self._failed.append(job)
            return
        job.retired = True
        job.keep.clear()
        for ev in job.events:
            self._rt.eventDestroy(ev)
        job.events.clear()

    def complete(self, job: Job) -> bool:
        with self._lock:
            return job._complete()

    def stream_wait(self, job: Job, stream: int) -> None:
        with self._lock:
            if not job.retired:
                job.stream_wait(stream)

    def wait(self, job: Job, timeout: float | None) -> None:
        """Block the host until ``job``'s device work is over (``Request.wait(host=True)``)."""
        self._until(job, None if timeout is None else time.monotonic() + timeout, "")

    def _until(self, job: Job, at: float | None, what: str) -> None:
        bo = Backoff(spins=0, yields=16, max_sleep=1e-3)
        while not self.complete(job):
            if at is not None and time.monotonic() >= at:
                raise CollectiveTimeout(
                    f"rank {self.rank}: device collective #{job.seq}{what}: its device "
                    "work is not over after the timeout",
                    rank=self.rank,
                )
            bo.pause()

    def close(self) -> None:
        """Open every gate still closed (jobs that never ran), wait (bounded by the
        timeout) for the device work to end, and drop everything."""
        with self._lock:
            jobs = list(self._jobs) + self._failed
            self._jobs.clear()
            self._failed = []
        at = time.monotonic() + self.timeout
        bo = Backoff(spins=0, yields=16, max_sleep=1e-3)
        for job in jobs:
            job.settle()
            while not job._complete() and time.monotonic() < at:
                bo.pause()
            job.failed = False
            self._retire(job)
