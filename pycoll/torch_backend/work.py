"""torch's ``Work`` for pycoll's calls: one per call, completed by the group's
worker thread (:mod:`pycoll.torch_backend.worker`)."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from contextlib import nullcontext
from datetime import timedelta
from time import monotonic
from typing import Any

import torch
import torch.distributed as dist

from pycoll.diagnose import grace_for
from pycoll.errors import CollectiveTimeout
from pycoll.torch_backend.errors import torch_error
from pycoll.torch_backend.streams import OnStream

log = logging.getLogger(__name__)


class Busy:
    """What the group's worker thread is running: the collective's name and since when."""

    def __init__(self) -> None:
        self.what = ""
        self.since: float | None = None


class _Done:
    """Whether a call is over: a ``threading.Event`` made only for a wait that
    starts before the call ends.  A call run on the caller's thread has ended
    before anyone waits, and an Event (a Condition and its lock) took about 2 us
    of the backend's 35 a synchronous call on the 2-core machine."""

    __slots__ = ("_event", "_flag", "_lock")

    def __init__(self) -> None:
        self._flag = False
        self._event: threading.Event | None = None
        self._lock = threading.Lock()

    def is_set(self) -> bool:
        return self._flag

    def set(self) -> None:
        with self._lock:
            self._flag = True
            event = self._event
        if event is not None:
            event.set()

    def wait(self, timeout: float | None = None) -> bool:
        if self._flag:
            return True
        with self._lock:
            if self._flag:
                return True
            if self._event is None:
                self._event = threading.Event()
            event = self._event
        return event.wait(timeout)


class Posted:
    """A point-to-point call posted on the communicator, completed later.

    Args:
        request: pycoll's request (``test()``, ``wait()``).
        finish: run once the request completed; returns the Work's outputs.
    """

    __slots__ = ("finish", "request")

    def __init__(self, request: Any, finish: Callable[[], Any]) -> None:
        self.request = request
        self.finish = finish


class Work(dist._Work):  # type: ignore[misc,name-defined]
    """One call (a collective, a send or a receive), queued to its group's worker
    thread: torch's ``Work``.

    ``wait()`` (what the synchronous ``dist.*`` calls run) and ``result()`` raise
    the call's error; ``get_future()``'s future completes with the outputs or
    fails with that error; ``is_completed()``, ``is_success()`` and
    ``exception()`` say how it ended; a receive's ``source_rank()`` names its
    sender.  No wait is unbounded: each collective is bounded by the
    communicator's timeout, and one that has run longer than that plus a grace
    period (a stuck worker) makes every waiter raise; a posted send or receive
    waits for its peer at most the timeout.
    """

    def __init__(
        self, what: str, rank: int, timeout: float, worker: Busy, cuda: OnStream | None = None
    ) -> None:
        super().__init__()
        self._what = what
        self._rank = rank
        self._timeout = timeout
        self._worker = worker
        self._done = _Done()
        self._error: BaseException | None = None
        self._outputs: Any = None
        self._posted: float | None = None  # when its send or receive was posted
        self._source: int | None = None  # a receive's sender, once complete
        # on CUDA tensors: the call's place on its group's stream (see .streams);
        # the future then records and waits for events on the device
        self._cuda = cuda
        # The future is made when someone asks for it (DDP's comm hooks do, a
        # dist.* call does not): a CUDA-aware future and its chained one cost
        # about 0.3 ms of host time a call on the H200 machine, more than the
        # rest of the backend's part of a call (benchmarks/RESULTS.md, "The
        # torch backend's share of a device allreduce").
        self._lock = threading.Lock()
        self._head: torch.futures.Future[Any] | None = None
        self._future: torch.futures.Future[Any] | None = None

    def _outcome(self, head: torch.futures.Future[Any]) -> Any:
        if self._error is not None:
            raise self._error
        return head.value()

    def _run(self, run: Callable[[], Any]) -> Posted | None:
        """Run the call (on the worker thread) and complete this work, or return
        the :class:`Posted` call that completes it later.  A call on the device
        completes with its stream current: the future records its events there."""
        self._worker.what, self._worker.since = self._what, monotonic()
        try:
            with nullcontext() if self._cuda is None else self._cuda.running():
                try:
                    outputs = run()
                except BaseException as exc:
                    self._fail(exc, current=True)
                    return None
                if isinstance(outputs, Posted):
                    self._posted = monotonic()
                    return outputs
                self._complete(outputs, current=True)
        except BaseException as exc:  # making the stream current, or leaving it
            if not self._done.is_set():
                self._fail(exc)
        finally:
            self._worker.since = None
        return None

    def _complete(self, outputs: Any, current: bool = False) -> None:
        """Complete the work (``current``: its stream is current, see :meth:`_resolve`)."""
        self._outputs = outputs
        if self._cuda is not None:
            self._cuda.ended()
        with self._lock:
            head = self._head
            if head is None:  # a get_future() from now on completes its own
                self._done.set()
                return
        try:
            self._resolve(head, current)
        finally:
            self._done.set()

    def _resolve(self, head: torch.futures.Future[Any], current: bool = False) -> None:
        """Complete the future (once the call is over).  On the device it records
        its events on the current stream, which must be the call's: ``current``
        says it is (the worker runs the call there), else it is made so."""
        cuda = self._cuda
        if cuda is None or current:
            head.set_result(self._outputs)
            return
        with cuda.running():
            head.set_result(self._outputs)

    def _fail(self, exc: BaseException, current: bool = False) -> None:
        log.info("pycoll backend: %s (raised by the Work's wait)", exc)
        self._error = torch_error(exc)
        self._complete(None, current)

    def wait(self, timeout: timedelta | None = None) -> bool:
        """Block until the collective's host part is done; raise its error.  On
        CUDA tensors, also make the current stream wait for its device work
        (the host does not wait for the GPU, as with ProcessGroupNCCL).

        Args:
            timeout: wait at most this long (torch's ``timedelta(0)``, or None:
                until the collective ends, which the group's timeout bounds).

        Raises:
            PycollError: the collective failed (also a ``DistBackendError``).
            CollectiveTimeout: not done within ``timeout``; the collective goes on.
        """
        limit = timeout.total_seconds() if timeout is not None else 0.0
        if limit > 0:
            if not self._done.wait(limit):
                raise torch_error(
                    CollectiveTimeout(
                        f"pycoll backend, rank {self._rank}: {self._what} still running after "
                        f"wait(timeout={limit:g} s); it goes on (the group's timeout bounds it)",
                        rank=self._rank,
                    )
                )
        else:
            self._wait_bounded()
        if self._error is not None:
            raise self._error
        if self._cuda is not None:
            self._cuda.join()
        return True

    def _wait_bounded(self) -> None:
        # Collectives queued before this one end within the timeout each, or fail
        # fast once one has failed; this bound catches a worker stuck beyond that.
        # A posted send or receive waits for its peer at most the timeout, as
        # Gloo's does.
        bound = self._timeout + grace_for(self._timeout) + 30.0
        start = monotonic()
        while not self._done.wait(1.0):
            since = self._worker.since
            if since is not None and monotonic() - since > bound:
                raise torch_error(
                    CollectiveTimeout(
                        f"pycoll backend, rank {self._rank}: {self._what} cannot finish: "
                        f"{self._worker.what} has run for {monotonic() - since:.0f} s on the "
                        f"group's worker, beyond its timeout of {self._timeout:g} s",
                        rank=self._rank,
                    )
                )
            if self._posted is not None and monotonic() - start > self._timeout:
                raise torch_error(
                    CollectiveTimeout(
                        f"pycoll backend, rank {self._rank}: {self._what} still pending after "
                        f"waiting the group's timeout of {self._timeout:g} s (its peer never "
                        "posted the matching call); it stays posted",
                        rank=self._rank,
                    )
                )

    def source_rank(self) -> int:
        """The group rank a receive took its message from (torch's ``sourceRank``).

        Raises:
            RuntimeError: not a receive, or not complete.
        """
        if self._source is None:
            raise RuntimeError(
                f"pycoll backend: sourceRank() may only be called on a completed recv or "
                f"recv-from-any work, not on {self!r}"
            )
        return self._source

    def _source_rank(self) -> int:
        return self.source_rank()

    def is_completed(self) -> bool:
        """Done, its device work too (on CUDA tensors)."""
        return self._done.is_set() and (self._cuda is None or self._cuda.over())

    def is_success(self) -> bool:
        return self._done.is_set() and self._error is None

    def exception(self) -> BaseException | None:
        return self._error

    def result(self) -> Any:
        self.wait()
        return self._outputs

    def get_future(self) -> torch.futures.Future[Any]:
        """The call's future, made on the first request: it completes with the
        outputs, or fails with the call's error.

        Future.set_exception stores the exception as the future's *value* (only
        Python's wait() raises it): DDP's reducer, in C++, would take it for its
        tensors and crash.  So the future returned is chained on the one the
        call completes, and an exception raised in the chained callback fails
        it in C++, where every consumer sees the error.
        """
        with self._lock:
            if self._future is None:
                cuda = self._cuda
                head: torch.futures.Future[Any] = (
                    torch.futures.Future()
                    if cuda is None
                    else torch.futures.Future(devices=[cuda.device])
                )
                self._head, self._future = head, head.then(self._outcome)
                if self._done.is_set():
                    self._resolve(head)
            return self._future

    def __repr__(self) -> str:
        state = "pending" if not self._done.is_set() else "failed" if self._error else "done"
        return f"<pycoll Work {self._what} {state}>"
