"""The worker thread of a family of process groups.

A pycoll communicator and the sub-communicators split from it share one set of
connections and take one call at a time (:mod:`pycoll.engine`'s family): two
threads inside calls of one family raise ``ConcurrentCallError``.  So the world
group and the subgroups split from it (:meth:`ProcessGroupPycoll.new_group`)
share one :class:`Lane`: one thread that runs their calls in the order the
program issued them.  A group bootstrapped on its own has a lane of its own.

Point-to-point calls do not hold the thread until they complete: a job posts
the send or receive (``async_op=True``) and returns a :class:`Posted`; between
jobs the thread progresses what is posted and completes each ``Work`` as its
request completes, so that an ``irecv`` posted before an ``isend`` on both
ranks never deadlocks.

A call may also run on the caller's thread (:meth:`Lane.run_here`), when nothing
is queued, running or posted: program order holds, and the two thread hops are
saved.  The process group does that only for device calls whose host part ends
before their device work (:meth:`pycoll.Communicator.returns_early`).
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from typing import Any

from pycoll.errors import CommunicatorClosedError, InvalidArgumentError, PycollError
from pycoll.torch_backend.work import Busy, Posted, Work

log = logging.getLogger(__name__)

#: Idle naps between rounds of progress while point-to-point calls are posted:
#: from 20 us, doubling, to at most 2 ms (a new job ends a nap at once).
NAP_MIN = 20e-6
NAP_MAX = 2e-3


class Lane:
    """One worker thread and its queue, shared by a family of process groups.

    Args:
        name: the thread's name.
    """

    def __init__(self, name: str = "pycoll-torch") -> None:
        self.jobs: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self.busy = Busy()
        self.broken = False  # a call failed: the family is unusable, peers may be gone
        self.users = 0  # open process groups on this lane
        self.posted: list[tuple[Posted, Work]] = []
        # the memory spans of queued mirrored allreduces (see ahead_clear), by Work
        self.mirrored: dict[int, tuple[int, int]] = {}
        # held by whoever runs a job or progresses posted calls (the thread, or a
        # caller in run_here); pending counts jobs put and not yet run, so that a
        # caller holding _running and seeing 0 knows it is next in program order
        self._running = threading.Lock()
        self._count = threading.Lock()
        self.pending = 0
        self.thread = threading.Thread(target=self._serve, name=name, daemon=True)
        self.thread.start()

    # ------------------------------------------------------------------ groups
    def join(self) -> Lane:
        """A process group starts using the lane."""
        self.users += 1
        return self

    def leave(self, wait: bool = True) -> None:
        """A process group is done with the lane; the last one stops the thread
        (``wait``: once it has run what is queued)."""
        self.users -= 1
        if self.users == 0:
            self.jobs.put(None)
            if wait:
                self.thread.join()

    # ------------------------------------------------------------------ jobs
    def put(self, run: Callable[[], Any], work: Work) -> None:
        """Queue ``run``, which completes ``work``."""
        self._queue((run, work))

    def put_mirrored(self, run: Callable[[], Any], work: Work, span: tuple[int, int]) -> None:
        """Queue a mirrored allreduce (:mod:`.mirrors`) whose caller queued its copy
        in; ``run`` calls :meth:`mirrored_done` once it queued its copy back into
        the memory ``span`` (or failed)."""
        with self._count:
            self.mirrored[id(work)] = span
            self.pending += 1
        self.jobs.put((run, work))

    def mirrored_done(self, work: Work) -> None:
        with self._count:
            self.mirrored.pop(id(work), None)

    def ahead_clear(self, lo: int, hi: int) -> bool:
        """Whether a call may queue device work from the caller's thread, ahead of
        the jobs queued before it: nothing is posted, and every job queued or
        running is a mirrored allreduce that has no more device work to queue in
        the memory ``[lo, hi)``.  The group's stream then orders the new work as if
        the worker had queued it in program order."""
        with self._count:
            if self.posted or self.pending != len(self.mirrored):
                return False
            return all(hi <= a or b <= lo for a, b in self.mirrored.values())

    def _queue(self, job: Any) -> None:
        with self._count:
            self.pending += 1
        self.jobs.put(job)

    def run_here(self, run: Callable[[], Any], work: Work) -> bool:
        """Run ``run`` (which completes ``work``) on the calling thread if nothing is
        queued, running or posted; whether it did (else queue it with :meth:`put`)."""
        if not self._running.acquire(blocking=False):
            return False
        try:
            with self._count:
                if self.pending or self.posted:
                    return False
            self._run((run, work))
        finally:
            self._running.release()
        if self.posted:
            self._queue(_wake)  # the thread sleeps in jobs.get() while nothing is posted
        return True

    def call(self, fn: Callable[[], Any]) -> Any:
        """Run ``fn`` on the thread after what is queued; its result (or error)."""
        box: list[Any] = []
        done = threading.Event()

        def run() -> None:
            try:
                box.append((True, fn()))
            except BaseException as exc:
                box.append((False, exc))
            finally:
                done.set()

        self._queue(run)
        done.wait()
        ok, value = box[0]
        if not ok:
            raise value
        return value

    # ------------------------------------------------------------------ the thread
    def _serve(self) -> None:
        nap = 0.0
        while True:
            try:
                job = self.jobs.get(timeout=nap) if self.posted else self.jobs.get()
            except queue.Empty:
                job = False
            if job is None:
                self._abandon()
                return
            if job is not False:
                with self._running:
                    self._run(job)
                    with self._count:
                        self.pending -= 1
            moved = False
            if self.posted:
                with self._running:
                    moved = self._progress()
            if moved or job is not False:
                nap = 0.0
            else:
                nap = min(max(2 * nap, NAP_MIN), NAP_MAX)

    def _run(self, job: Any) -> None:
        if not isinstance(job, tuple):
            job()  # a call(): it keeps its own outcome
            return
        run, work = job
        posted = work._run(run)
        if posted is not None:
            self.posted.append((posted, work))
        self._note(work._error)

    def _note(self, error: BaseException | None) -> None:
        if isinstance(error, PycollError) and not isinstance(error, InvalidArgumentError):
            self.broken = True

    def _progress(self) -> bool:
        """One round of progress on the posted calls; whether any completed."""
        moved = False
        still = []
        for posted, work in self.posted:
            try:
                if not posted.request.test():
                    still.append((posted, work))
                    continue
                posted.request.wait()
                work._source = getattr(posted.request, "source", None)
                outputs = posted.finish()
            except BaseException as exc:
                work._fail(exc)
                self._note(exc)
            else:
                work._complete(outputs)
            moved = True
        self.posted = still
        return moved

    def _abandon(self) -> None:
        """The last group shut down with calls still posted: they fail."""
        for _, work in self.posted:
            work._fail(
                CommunicatorClosedError(
                    f"pycoll backend: {work._what} was still pending when its process "
                    "group shut down"
                )
            )
        self.posted = []


def _wake() -> None:
    """A job that does nothing: it wakes the thread to progress what run_here posted."""
