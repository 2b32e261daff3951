"""What ``async_op=True`` returns: :class:`Request` (host collectives) and
:class:`DeviceRequest` (device collectives, which complete on a stream)."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import CancelledError, Future
from time import monotonic
from typing import Any

from pycoll.errors import CollectiveTimeout, CommunicatorClosedError
from pycoll.gpu.jobs import Job


class Request:
    """An asynchronous collective (``async_op=True``).

    ``wait(timeout)`` blocks until it finishes and returns its output (or raises
    its error); ``test()`` says whether it has finished; ``exception()`` gives the
    error, if any, once finished.
    """

    def __init__(self, future: Future[Any], what: str, rank: int) -> None:
        self._future = future
        self._what = what
        self._rank = rank

    def wait(self, timeout: float | None = None) -> Any:
        """Block until done; return the output array.

        Raises:
            CollectiveTimeout: still running after ``timeout`` seconds (the
                collective itself goes on, bounded by PYCOLL_TIMEOUT; its
                ``missing`` is empty, for no rank is known to be late).
            CommunicatorClosedError: ``abort()`` or ``close()`` ended it, or
                dropped it before it started.
        """
        try:
            return self._future.result(timeout)
        except TimeoutError:
            raise CollectiveTimeout(
                f"rank {self._rank}: {self._what} still running after wait(timeout={timeout}); "
                "it goes on (PYCOLL_TIMEOUT bounds it)",
                rank=self._rank,
            ) from None
        except CancelledError:
            raise self._dropped() from None

    def _dropped(self) -> CommunicatorClosedError:
        return CommunicatorClosedError(
            f"rank {self._rank}: {self._what}: the communicator was aborted before it started"
        )

    def test(self) -> bool:
        return self._future.done()

    def add_done_callback(self, fn: Callable[[Request], None]) -> None:
        """Call ``fn(self)`` once the collective finishes (at once if it has).

        It runs on pycoll's worker thread; keep it short and do not start
        collectives from it.
        """
        self._future.add_done_callback(lambda _: fn(self))

    def exception(self) -> BaseException | None:
        if not self._future.done():
            return None
        if self._future.cancelled():
            return self._dropped()
        return self._future.exception()

    def __repr__(self) -> str:
        state = "done" if self._future.done() else "pending"
        return f"<pycoll.Request {self._what} {state}>"


class DeviceRequest(Request):
    """An asynchronous device collective (``async_op=True`` on device buffers).

    As NCCL's: :meth:`wait` makes the caller's current stream (torch's for torch
    tensors, CuPy's otherwise) wait for the collective, on the device, and
    returns at once; work queued on that stream afterwards sees the output.
    ``wait(host=True)`` blocks the host until the output is ready for it too.
    Until ``wait``, the caller's stream does not wait for the collective.
    A failure raises from ``wait`` where it is already known, and otherwise from
    the communicator's next call.
    """

    def __init__(
        self, future: Future[Any], what: str, rank: int, job: Job, result: Any, like: Any, gpu: Any
    ) -> None:
        super().__init__(future, what, rank)
        self._job = job
        self._result = result
        self._like = like  # the input: torch's or CuPy's current stream
        self._gpu = gpu

    def wait(self, timeout: float | None = None, *, host: bool = False) -> Any:
        """Make the current stream wait for the collective; return its output.

        Args:
            timeout: with ``host=True``: seconds before the host wait gives up.
            host: block the host until the output is on the device (then the host
                may read it, as after a stream synchronize).

        Raises:
            CollectiveTimeout: ``host=True`` and not done after ``timeout``.
        """
        if host:
            t0 = monotonic()
            super().wait(timeout)
            left = None if timeout is None else max(0.0, timeout - (monotonic() - t0))
            self._gpu.inflight.wait(self._job, left)
            return self._result
        if self._future.done() or not self._job.gated:
            super().wait(timeout)  # raises its failure (ungated: waits for the host part)
        from pycoll.gpu.context import resolve_stream

        gpu = self._gpu
        stream = resolve_stream(None, self._like, gpu.device, self._rank, self._what)
        gpu.inflight.stream_wait(self._job, stream)
        return self._result

    def test(self) -> bool:
        """Whether the collective is over, on the device too."""
        return self._future.done() and self._gpu.inflight.complete(self._job)
