"""CuPy views of CUDA tensors and CuPy streams of torch streams, kept per group,
so that a call on the same tensor and stream again is the same pycoll call.

pycoll replays a blocking ``direct`` call made again on the same CuPy arrays
and stream as a device plan (:mod:`pycoll.gpu.replay`), which skips the checks
and setup of a call, and found the plan by the arrays' identity.  A tensor
handed to pycoll as it is becomes a new CuPy view at every call (15 us on the
H200 machine's host, ``pycoll.buffers``), and never the same array.  This
cache hands pycoll the view it made the first time for the same memory
(address, element count, dtype and device), and the same CuPy stream for the
same torch stream.

It holds each tensor it made a view of, so that no other tensor gets its
memory while the view is kept: at most :data:`KEPT_MAX` tensors, the least
recently used dropped first, all of them when the group shuts down.  bfloat16
tensors (CuPy has no bfloat16) and empty ones are handed on as they are.
"""

from __future__ import annotations

import warnings
from collections import OrderedDict
from typing import Any

import torch

from pycoll.buffers import as_buffer

#: Tensors (and their views) kept per group; each holds its memory.
KEPT_MAX = 16


class _Handle:
    """A CUDA stream by its address, as the CUDA stream protocol names one."""

    __slots__ = ("_ptr",)

    def __init__(self, ptr: int) -> None:
        self._ptr = ptr

    def __cuda_stream__(self) -> tuple[int, int]:
        return (0, self._ptr)


def _cupy_stream(ptr: int, device: int) -> Any:
    """A CuPy stream object for the CUDA stream at ``ptr`` (not owned by CuPy)."""
    import cupy

    make = getattr(cupy.cuda.Stream, "from_external", None)
    if make is not None:
        try:
            return make(_Handle(ptr))
        except Exception:  # another signature: the older way below
            pass
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        return cupy.cuda.ExternalStream(ptr, device)


class Kept:
    """The views and streams of one process group (see the module).

    Args:
        rank: this rank, for the errors of a view that cannot be made.
    """

    def __init__(self, rank: int) -> None:
        self._rank = rank
        self._arrays: OrderedDict[tuple[Any, ...], tuple[Any, torch.Tensor]] = OrderedDict()
        self._streams: dict[int, tuple[Any, torch.cuda.Stream]] = {}

    def array(self, t: torch.Tensor) -> Any:
        """The kept CuPy view of flat CUDA tensor ``t``'s memory, or ``t`` itself."""
        key = (t.data_ptr(), t.numel(), t.dtype, t.device.index)
        hit = self._arrays.get(key)
        if hit is not None:
            self._arrays.move_to_end(key)
            return hit[0]
        if t.dtype == torch.bfloat16 or not t.numel() or not t.is_contiguous():
            return t
        view = as_buffer(t, self._rank, "allreduce", "tensor", writable=True).flat
        if len(self._arrays) >= KEPT_MAX:
            self._arrays.popitem(last=False)
        self._arrays[key] = (view, t)
        return view

    def stream(self, s: torch.cuda.Stream) -> Any:
        """A CuPy stream for torch stream ``s`` (the same object for the same stream)."""
        ptr = int(s.cuda_stream)
        hit = self._streams.get(ptr)
        if hit is None:
            if len(self._streams) >= KEPT_MAX:
                self._streams.clear()
            hit = self._streams[ptr] = (_cupy_stream(ptr, s.device.index), s)
        return hit[0]

    def clear(self) -> None:
        self._arrays.clear()
        self._streams.clear()
