"""Array-likes in, flat typed views out.

Host buffers are NumPy arrays.  Device buffers are CuPy arrays or anything with
``__cuda_array_interface__`` or a CUDA ``__dlpack__``; they are wrapped as CuPy
arrays without a copy, and CuPy is imported only when such a buffer shows up.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from pycoll.errors import InvalidArgumentError, UnsupportedError
from pycoll.reduce import DTYPES, check_dtype

_KDL_CUDA = 2
_BF16 = DTYPES["bfloat16"]
_KDL_CUDA_MANAGED = 13


@dataclass(slots=True)  # not frozen: that makes every call's construction 3x slower
class Buffer:
    """A validated, contiguous buffer seen as a flat array of ``count`` elements.

    Read-only by convention: nothing assigns to a Buffer after it is made.

    Attributes:
        obj: what the caller passed (returned back to them).
        flat: a 1-D view sharing memory with ``obj`` (numpy.ndarray or cupy.ndarray).
        device: -1 for host memory, else the CUDA device ordinal.
        logical: the element type when ``flat`` carries it under another name
            (device bfloat16 is viewed as uint16: CuPy has no bfloat16), else None.
    """

    obj: Any
    flat: Any
    device: int
    logical: np.dtype[Any] | None = None

    @property
    def dtype(self) -> np.dtype[Any]:
        if self.logical is not None:
            return self.logical
        return self.flat.dtype  # type: ignore[no-any-return]

    @property
    def count(self) -> int:
        return int(self.flat.size)

    @property
    def nbytes(self) -> int:
        return int(self.flat.nbytes)

    @property
    def is_device(self) -> bool:
        return self.device >= 0

    def same_memory(self, other: Buffer) -> bool:
        return bool(data_ptr(self.flat) == data_ptr(other.flat) and self.device == other.device)


def data_ptr(a: Any) -> int:
    if isinstance(a, np.ndarray):
        return int(a.__array_interface__["data"][0])
    return int(a.data.ptr)


def is_device_array(obj: object) -> bool:
    """True for CUDA arrays, decided without importing CuPy."""
    if isinstance(obj, np.ndarray):
        return False
    dev = getattr(obj, "__dlpack_device__", None)
    if dev is not None:
        try:
            return dev()[0] in (_KDL_CUDA, _KDL_CUDA_MANAGED)
        except Exception:
            return False
    try:  # a property that may raise (torch: bfloat16, CPU tensors)
        return hasattr(obj, "__cuda_array_interface__")
    except Exception:
        return False


def _is_torch(obj: object) -> bool:
    return type(obj).__module__.split(".", 1)[0] == "torch"


def device_signature(obj: Any) -> tuple[Any, ...] | None:
    """What must stay the same for a plan made on device array ``obj`` to apply
    again (shape, strides, dtype and address), or None for arrays other than
    CuPy's and torch's, which the fast path leaves alone."""
    mod = type(obj).__module__.split(".", 1)[0]
    if mod == "cupy":
        return (obj.shape, obj.strides, obj.dtype, obj.data.ptr)
    if mod == "torch":  # set_() and .data = can move a tensor's storage
        return (obj.shape, obj.stride(), obj.dtype, obj.data_ptr())
    return None


def _as_cupy(obj: Any, rank: int, what: str, arg: str) -> tuple[Any, np.dtype[Any] | None]:
    try:
        import cupy
    except ImportError as exc:
        raise UnsupportedError(
            f"rank {rank}: {what}: {arg} is a CUDA array, but CuPy is not installed "
            "(pip install 'pycoll-collectives[gpu]')",
            rank=rank,
        ) from exc
    if _is_torch(obj):
        t = obj.detach()
        if str(t.dtype) == "torch.bfloat16":
            import torch

            t = t.view(torch.int16)  # CuPy has no bfloat16: carry the bits
            return cupy.from_dlpack(t).view(cupy.uint16), _BF16
        return cupy.from_dlpack(t), None
    if hasattr(obj, "__cuda_array_interface__"):
        arr = cupy.asarray(obj)
    else:
        arr = cupy.from_dlpack(obj)
    if arr.dtype == _BF16:  # a CuPy that knows bfloat16: same bits, one code path
        return arr.view(cupy.uint16), _BF16
    return arr, None


def as_buffer(obj: Any, rank: int, what: str, arg: str, *, writable: bool) -> Buffer:
    """Validate ``obj`` and view it flat.

    Raises:
        InvalidArgumentError: not an array, not contiguous, read-only (when
            ``writable``), or of an unsupported dtype.  The message names the
            argument, the value and the rank.
        UnsupportedError: a CUDA array while CuPy is not installed.
    """
    logical = None
    if isinstance(obj, np.ndarray):
        arr = obj
        device = -1
        if writable and not arr.flags.writeable:
            raise InvalidArgumentError(f"rank {rank}: {what}: {arg} is read-only")
    elif is_device_array(obj):
        arr, logical = _as_cupy(obj, rank, what, arg)
        device = int(arr.device.id)
    else:
        raise InvalidArgumentError(
            f"rank {rank}: {what}: {arg} must be a NumPy array or a CUDA array "
            f"(CuPy, __cuda_array_interface__, __dlpack__), got {type(obj).__name__}"
        )
    if not arr.flags.c_contiguous:
        raise InvalidArgumentError(
            f"rank {rank}: {what}: {arg} with shape {arr.shape} and strides {arr.strides} "
            "is not C-contiguous; pass a contiguous array (np.ascontiguousarray)"
        )
    check_dtype(arr.dtype if logical is None else logical, rank, what, arg)
    return Buffer(obj, arr.reshape(-1), device, logical)
