"""torch's ``Work`` for pycoll's collectives: one per call, completed by the
group's worker thread."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from datetime import timedelta
from time import monotonic
from typing import Any

import torch
import torch.distributed as dist

from pycoll.diagnose import grace_for
from pycoll.errors import CollectiveTimeout
from pycoll.torch_backend.errors import torch_error

log = logging.getLogger(__name__)


class Busy:
    """What the group's worker thread is running: the collective's name and since when."""

    def __init__(self) -> None:
        self.what = ""
        self.since: float | None = None


class Work(dist._Work):  # type: ignore[misc,name-defined]
    """One collective, queued to its group's worker thread: torch's ``Work``.

    ``wait()`` (what the synchronous ``dist.*`` calls run) and ``result()`` raise
    the collective's error; ``get_future()``'s future completes with the outputs
    or fails with that error; ``is_completed()``, ``is_success()`` and
    ``exception()`` say how it ended.  No wait is unbounded: each collective is
    bounded by the communicator's timeout, and one that has run longer than that
    plus a grace period (a stuck worker) makes every waiter raise.
    """

    def __init__(self, what: str, rank: int, timeout: float, worker: Busy) -> None:
        super().__init__()
        self._what = what
        self._rank = rank
        self._timeout = timeout
        self._worker = worker
        self._done = threading.Event()
        self._error: BaseException | None = None
        self._outputs: Any = None
        self._head: torch.futures.Future[Any] = torch.futures.Future()
        # Future.set_exception stores the exception as the future's *value* (only
        # Python's wait() raises it): DDP's reducer, in C++, would take it for its
        # tensors and crash.  An exception raised in a then() callback fails the
        # chained future in C++, where every consumer sees the error.
        self._future = self._head.then(self._outcome)

    def _outcome(self, head: torch.futures.Future[Any]) -> Any:
        if self._error is not None:
            raise self._error
        return head.value()

    def _run(self, run: Callable[[], Any]) -> None:
        """Run the collective (on the worker thread) and complete this work."""
        self._worker.what, self._worker.since = self._what, monotonic()
        try:
            self._outputs = run()
        except BaseException as exc:
            log.info("pycoll backend: %s (raised by the Work's wait)", exc)
            self._error = torch_error(exc)
        finally:
            self._worker.since = None
            try:
                self._head.set_result(self._outputs)
            finally:
                self._done.set()

    def wait(self, timeout: timedelta | None = None) -> bool:
        """Block until the collective is done; raise its error.

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
        return True

    def _wait_bounded(self) -> None:
        # Collectives queued before this one end within the timeout each, or fail
        # fast once one has failed; this bound catches a worker stuck beyond that.
        bound = self._timeout + grace_for(self._timeout) + 30.0
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

    def is_completed(self) -> bool:
        return self._done.is_set()

    def is_success(self) -> bool:
        return self._done.is_set() and self._error is None

    def exception(self) -> BaseException | None:
        return self._error

    def result(self) -> Any:
        self.wait()
        return self._outputs

    def get_future(self) -> torch.futures.Future[Any]:
        return self._future

    def __repr__(self) -> str:
        state = "pending" if not self._done.is_set() else "failed" if self._error else "done"
        return f"<pycoll Work {self._what} {state}>"
