"""CUDA tensors on the device: a process group's stream, and each call's place on it.

Like ProcessGroupNCCL: each process group has one CUDA stream per device.  A
call on CUDA tensors records an event on the caller's current stream; the
group's worker makes the group's stream wait for it, runs the pycoll
collective with that stream current (pycoll takes torch's current stream for
torch tensors), and records an end event.  ``Work.wait()`` makes the caller's
current stream wait for the end event, and the Work's future is CUDA-aware
(``torch.futures.Future(devices=...)``): a consumer's streams wait for it too,
so DDP's comm hooks chain on the device.  Every tensor the call touches is
marked in use by the group's stream (``record_stream``), so memory the caller
frees is not handed out again before the collective is done with it.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch


class OnStream:
    """One call's place on its group's stream.

    Made on the caller's thread: it records the caller's current stream, which
    the group's stream waits for before the call runs.

    Args:
        stream: the group's stream on the tensors' device.
    """

    __slots__ = ("device", "end", "ready", "stream")

    def __init__(self, stream: torch.cuda.Stream) -> None:
        self.stream = stream
        self.device = stream.device
        self.ready = torch.cuda.current_stream(self.device).record_event()
        self.end: torch.cuda.Event | None = None

    @contextmanager
    def running(self) -> Iterator[None]:
        """The group's stream current on this thread, after the caller's work."""
        with torch.cuda.device(self.device), torch.cuda.stream(self.stream):
            self.stream.wait_event(self.ready)
            yield

    def ended(self) -> None:
        """Mark the end of the call's work on the group's stream (once)."""
        if self.end is None:
            self.end = self.stream.record_event()

    def join(self) -> None:
        """Make the caller's current stream wait for the call's work."""
        assert self.end is not None, "join() before the call ran"
        torch.cuda.current_stream(self.device).wait_event(self.end)

    def over(self) -> bool:
        """Whether the device work of the call is done."""
        return self.end is not None and self.end.query()


def keep(stream: torch.cuda.Stream | None, *tensors: Any) -> None:
    """Mark the CUDA ``tensors`` as used by ``stream`` (see the module docstring)."""
    if stream is None:
        return
    for t in tensors:
        if isinstance(t, torch.Tensor) and t.is_cuda:
            t.record_stream(stream)
