"""CUDA tensors on the device: a process group's stream, and each call's place on it.

Like ProcessGroupNCCL: each process group has one CUDA stream per device.  An
asynchronous call on CUDA tensors records an event on the caller's current
stream; the group's stream waits for it, the pycoll collective runs on that
stream (``stream=`` names it), and an end event is recorded.  ``Work.wait()``
makes the caller's current stream wait for the end event, and the Work's
future is CUDA-aware (``torch.futures.Future(devices=...)``): a consumer's
streams wait for it too, so DDP's comm hooks chain on the device.  Every tensor
the call touches is marked in use by the group's stream (``record_stream``), so
memory the caller frees is not handed out again before the collective is done
with it.

A synchronous call (``async_op=False``, which torch waits for at once) runs on
the caller's current stream instead, as ProcessGroupNCCL does: pycoll orders
its device work after that stream's work and that stream's later work after
it, so there is no event to record or wait for, and nothing else uses the
memory.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch


class OnStream:
    """One call's place on a stream.

    Made on the caller's thread.  On the group's stream: it records the caller's
    current stream, which the group's stream waits for before the call runs.  On
    the caller's current stream (``current``, a synchronous call, as
    ProcessGroupNCCL runs ``async_op=False``): the call is ordered there already,
    and later work there is ordered after it, so nothing is recorded or waited
    for; where the caller's thread runs the call, the stream is current already.

    Args:
        stream: the group's stream on the tensors' device, or (``current``) the
            caller's current stream.
        after: the group's stream waits for the caller's (False: the call orders
            its work after the caller's itself, as the mirrors do).
    """

    __slots__ = ("caller", "device", "end", "ready", "stream")

    def __init__(
        self, stream: torch.cuda.Stream, current: bool = False, after: bool = True
    ) -> None:
        self.stream = stream
        self.device = stream.device
        self.ready: torch.cuda.Event | None = None
        self.caller = threading.get_ident() if current else None
        if not current and after:
            self.ready = torch.cuda.current_stream(self.device).record_event()
        self.end: torch.cuda.Event | None = None

    @contextmanager
    def running(self) -> Iterator[None]:
        """The call's stream current on this thread, after the caller's work."""
        if self.caller == threading.get_ident():
            yield  # the caller's own stream, on its own thread
            return
        with current(self.stream):
            if self.ready is not None:
                self.stream.wait_event(self.ready)
                self.ready = None
            yield

    def ended(self) -> None:
        """Mark the end of the call's work on the group's stream (once).  On the
        caller's stream, only when asked (:meth:`over`, a future): an event
        recorded there later is later than the call's work too."""
        if self.end is None and self.caller is None:
            self.end = self.stream.record_event()

    def join(self) -> None:
        """Make the caller's current stream wait for the call's work (on the
        caller's stream, it is ordered before what follows there already)."""
        if self.caller is None:
            assert self.end is not None, "join() before the call ran"
            torch.cuda.current_stream(self.device).wait_event(self.end)

    def over(self) -> bool:
        """Whether the device work of the call is done (once its host part is)."""
        if self.end is None and self.caller is not None:
            self.end = self.stream.record_event()
        return self.end is not None and self.end.query()


@contextmanager
def current(stream: torch.cuda.Stream) -> Iterator[None]:
    """``stream`` current on this thread (and its device, where another was),
    as before afterwards.

    By hand rather than ``torch.cuda.device`` and ``torch.cuda.stream``: the
    ``stream`` context alone took 9-14 us a call on the H200 machine's host,
    and it sets the device even where it is already current."""
    idx = stream.device_index
    old = torch.cuda.current_device()
    if old != idx:
        torch.cuda.set_device(idx)
    prev = torch.cuda.current_stream(idx)
    torch.cuda.set_stream(stream)
    try:
        yield
    finally:
        torch.cuda.set_stream(prev)
        if old != idx:
            torch.cuda.set_device(old)


_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)


def caller_stream(device: int) -> int:
    """The ``cudaStream_t`` of the current stream of CUDA ``device`` on this thread.

    torch's private ``_cuda_getCurrentRawStream`` where it has it (what its own
    compiled kernels use): ``torch.cuda.current_stream`` builds a Python stream
    object, 28 us of the thread that runs DDP's hooks on the H200 machine."""
    if _raw_stream is not None:
        return int(_raw_stream(device))
    return int(torch.cuda.current_stream(device).cuda_stream)


def keep(stream: torch.cuda.Stream | None, *tensors: Any) -> None:
    """Mark the CUDA ``tensors`` as used by ``stream`` (see the module docstring)."""
    if stream is None:
        return
    seen: set[int] = set()
    for t in tensors:
        if isinstance(t, torch.Tensor) and t.is_cuda and id(t) not in seen:
            seen.add(id(t))
            t.record_stream(stream)
