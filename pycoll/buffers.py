"""Array-likes in, flat typed views out.

Host buffers are NumPy arrays, torch CPU tensors, and anything with the buffer
protocol (memoryview, bytearray, bytes, array.array, mmap, ctypes arrays), as
mpi4py takes them; each is viewed as a NumPy array without a copy.  A torch
tensor is viewed through ``__array_interface__`` built from its data pointer:
``tensor.numpy()`` would make its storage non-resizable for good, and NumPy
before 2.3 imports DLPack read-only.  Read-only buffers (bytes, a read-only
memoryview) may be inputs, never outputs.

Device buffers are CuPy arrays or anything with ``__cuda_array_interface__`` or
a CUDA ``__dlpack__``; they are wrapped as CuPy arrays without a copy (a CUDA
torch tensor from its data pointer, as a CPU one), and CuPy is imported only
when such a buffer shows up.
"""

from __future__ import annotations

from collections.abc import Callable
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

    @property
    def shape(self) -> tuple[int, ...]:
        """The caller's shape (a memoryview's, a tensor's; a bytearray is 1-D)."""
        shape = getattr(self.obj, "shape", None)
        if shape is None:
            return tuple(memoryview(self.obj).shape or ())
        return tuple(shape)

    def same_memory(self, other: Buffer) -> bool:
        return bool(data_ptr(self.flat) == data_ptr(other.flat) and self.device == other.device)


def _compiled_data() -> Any:
    """:func:`pycoll._replay.data` where it was built and reads what NumPy says."""
    try:
        from pycoll._replay import data
    except ImportError:
        return None
    probe = np.empty(8, np.uint8)[3:]
    return data if data(probe) == probe.__array_interface__["data"][0] else None


_data = _compiled_data()


def data_ptr(a: Any) -> int:
    """The address of a NumPy or CuPy array's first element (for a NumPy array
    read from its struct where the compiled entry was built: about 0.1 us
    against 0.9 through ``__array_interface__``)."""
    if type(a) is np.ndarray and _data is not None:
        return _data(a)  # type: ignore[no-any-return]
    if isinstance(a, np.ndarray):
        return int(a.__array_interface__["data"][0])
    return int(a.data.ptr)


_stream_copy: Any
_copy: Any
try:  # pycoll/_step.c, built by pip install where a C compiler is found
    from pycoll._step import copy as _copy
    from pycoll._step import stream_copy as _stream_copy
except ImportError:  # pragma: no cover - an install without a compiler
    _stream_copy = _copy = None


def _assign(dst: Any, src: Any) -> None:
    dst[...] = src


#: ``copy_flat(dst, src)``: ``dst``'s bytes = ``src``'s, for two C-contiguous
#: buffers of one length (a caller's flat array and a slot).  Where the compiled
#: module was built, ``_step.copy``: where ``dst`` starts 1-63 bytes after
#: ``src`` modulo the page, memcpy's REP MOVSB runs many times slower, and it
#: copies another way (transports/_copies.h: 64 KiB 16 bytes on, 22 us with
#: NumPy's copy against 1.7; benchmarks/skewed_copies.py).
copy_flat: Callable[[Any, Any], None] = _copy if _copy is not None else _assign

#: A host copy of at least this many bytes stores past the caches
#: (``_step.stream_copy``).  On the 2-core Intel VM two processes copying at
#: once (the ranks of an allgather) copied 32 MiB each 1.11x as fast that way
#: and 64 MiB 1.66x, one process alone 32 MiB 0.92x and 64 MiB 1.40x; 8-24 MiB
#: 0.91-0.95x (benchmarks/stream_copy.py; benchmarks/RESULTS.md, "Streaming
#: copies").  glibc's memcpy makes the same switch from the cache size the CPU
#: reports, which a VM may overstate (480 MiB there).
STREAM_COPY_BYTES = 32 << 20
#: ... and one of at least this many bytes (and less than the above) goes
#: through :data:`copy_flat`; below it memcpy takes no REP MOVSB.
FLAT_COPY_BYTES = 2 << 10


def copy_into(dst: Any, src: Any) -> None:
    """``dst[...] = src`` for host arrays of one dtype; contiguous ones of at
    least :data:`FLAT_COPY_BYTES` go through the compiled copies, without the
    GIL from 256 KiB up (:data:`copy_flat`, or :data:`STREAM_COPY_BYTES` and
    up storing past the caches)."""
    nbytes = dst.nbytes
    if (
        nbytes >= FLAT_COPY_BYTES
        and _copy is not None
        and isinstance(dst, np.ndarray)
        and isinstance(src, np.ndarray)
        and dst.dtype == src.dtype
        and src.nbytes == nbytes
        and dst.flags.c_contiguous
        and src.flags.c_contiguous
    ):
        if nbytes >= STREAM_COPY_BYTES:
            _stream_copy(data_ptr(dst), data_ptr(src), nbytes)
        else:
            _copy(dst, src)
    else:
        dst[...] = src


#: An out-of-place host allgather whose block has at least this many bytes has
#: its rank's own block copied by the algorithm, not by the envelope, so that
#: ``direct`` by address copies it in the same pass as its writes to the peers,
#: each piece read once (:func:`pycoll.algorithms.direct.allgather`).  On the
#: 2-core Intel VM that took 16 MiB allgathers at n = 2 from 1218-1241 to
#: 1084-1100 us and 8 MiB at n = 4 from 1352-1376 to 1106-1116; blocks of
#: 1 MiB, which stay in the cache anyway, went from 136-142 to 153-156 at n = 2
#: (benchmarks/RESULTS.md, "The allgather's own block in the same pass, again").
OWN_PLACED_MIN = 2 << 20


def own_placed(nbytes: int) -> bool:
    """Whether a host allgather's own block of ``nbytes`` is its algorithm's to
    copy (:data:`OWN_PLACED_MIN`): the envelope leaves it, and no prepared slot
    step, which never copies it, runs the call."""
    return nbytes >= OWN_PLACED_MIN


def own_block(rank: int, x: Any, out: Any) -> Any | None:
    """Block ``rank`` of a host allgather's flat ``out``, which its algorithm fills
    from ``x``; None where the envelope fills it (a block not :func:`own_placed`,
    or device arrays, whose envelope copies on the collective's stream even
    where a host algorithm moves the others) or ``x`` already is that block
    (in place)."""
    if not own_placed(x.nbytes) or not isinstance(x, np.ndarray):
        return None
    k = x.size
    own = out[rank * k : (rank + 1) * k]
    return None if data_ptr(own) == data_ptr(x) else own


def place_own(rank: int, x: Any, out: Any) -> None:
    """A host allgather algorithm's first act: the rank's own block where the
    envelope left it to the algorithm (:func:`own_block`)."""
    own = own_block(rank, x, out)
    if own is not None:
        copy_into(own, x)


#: A host gather's or scatter's root whose own block has more than this many
#: bytes leaves its copy to the algorithm, not to the envelope, so that
#: ``direct`` by address copies it while the other ranks write their blocks
#: into the root's output (gather) or read theirs out of its input (scatter)
#: rather than before they start (:func:`root_block`).
ROOT_PLACED_MIN = 256 << 10


def root_placed(nbytes: int) -> bool:
    """Whether a host gather's or scatter's root block of ``nbytes`` is its
    algorithm's to copy (:data:`ROOT_PLACED_MIN`)."""
    return nbytes > ROOT_PLACED_MIN


def root_block(scatter: bool, rank: int, x: Any, out: Any) -> tuple[Any, Any] | None:
    """``(dst, src)`` of the own block of a host gather's root (``scatter``: a
    scatter's root) where its algorithm copies it (:func:`root_placed`); None
    where the envelope does (a smaller block, device arrays) or none is
    needed (in place)."""
    if not (isinstance(x, np.ndarray) and isinstance(out, np.ndarray)):
        return None
    k = out.size if scatter else x.size
    if not root_placed(k * x.itemsize):
        return None
    blk = slice(rank * k, (rank + 1) * k)
    dst, src = (out, x[blk]) if scatter else (out[blk], x)
    return None if data_ptr(dst) == data_ptr(src) else (dst, src)


def place_root(scatter: bool, rank: int, x: Any, out: Any) -> None:
    """:func:`root_block`'s copy, where there is one (the root of a gather
    algorithm, ``scatter`` False, or of a scatter algorithm)."""
    own = root_block(scatter, rank, x, out)
    if own is not None:
        copy_into(*own)


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


def is_torch(obj: object) -> bool:
    """True for torch tensors (and other torch objects), decided without importing torch."""
    return type(obj).__module__.split(".", 1)[0] == "torch"


#: torch dtypes (by name) and the NumPy types their host memory is viewed as
#: (bfloat16 as its bits, then as ml_dtypes' bfloat16).
_TORCH_AS = {
    "torch.bool": np.bool_,
    "torch.int8": np.int8,
    "torch.uint8": np.uint8,
    "torch.int16": np.int16,
    "torch.uint16": np.uint16,
    "torch.int32": np.int32,
    "torch.uint32": np.uint32,
    "torch.int64": np.int64,
    "torch.uint64": np.uint64,
    "torch.float16": np.float16,
    "torch.bfloat16": np.uint16,
    "torch.float32": np.float32,
    "torch.float64": np.float64,
    "torch.complex64": np.complex64,
    "torch.complex128": np.complex128,
}


class _TensorMemory:
    """What NumPy wraps for a torch CPU tensor: its ``__array_interface__``, and a
    reference that keeps the tensor alive as long as the array is."""

    __slots__ = ("__array_interface__", "tensor")

    def __init__(self, t: Any, typestr: str) -> None:
        self.tensor = t
        item = t.element_size()
        self.__array_interface__ = {
            "version": 3,
            "data": (t.data_ptr(), False),
            "shape": tuple(t.shape),
            "strides": tuple(item * s for s in t.stride()),
            "typestr": typestr,
        }


def _torch_host(obj: Any, rank: int, what: str, arg: str) -> Any:
    """A NumPy view of torch CPU tensor ``obj``'s memory (no copy; the storage
    stays resizable)."""
    t = obj.detach()
    if t.device.type != "cpu":
        raise InvalidArgumentError(
            f"rank {rank}: {what}: {arg} is a torch tensor on {t.device}; pycoll takes "
            "CPU and CUDA tensors"
        )
    as_type = _check_torch(t, rank, what, arg)
    if t.numel() == 0:
        arr = np.empty(tuple(t.shape), as_type)  # no memory to share (data_ptr may be 0)
    else:
        arr = np.asarray(_TensorMemory(t, np.dtype(as_type).str))
    return arr.view(_BF16) if str(t.dtype) == "torch.bfloat16" else arr


def _check_torch(t: Any, rank: int, what: str, arg: str) -> Any:
    """The NumPy type a dense torch tensor's memory is viewed as (bfloat16 as its bits).

    Raises:
        InvalidArgumentError: a sparse tensor, a lazily conjugated or negated view,
            or a dtype pycoll does not take.
    """
    if str(t.layout) != "torch.strided":
        raise InvalidArgumentError(
            f"rank {rank}: {what}: {arg} is a {t.layout} tensor; pass a dense one (.to_dense())"
        )
    if t.is_conj() or t.is_neg():
        raise InvalidArgumentError(
            f"rank {rank}: {what}: {arg} is a lazily conjugated or negated view, whose memory "
            "does not hold its values; call .resolve_conj() / .resolve_neg() first"
        )
    as_type = _TORCH_AS.get(str(t.dtype))
    if as_type is None:
        raise InvalidArgumentError(
            f"rank {rank}: {what}: {arg} has dtype {t.dtype}, which pycoll does not support; "
            f"use one of {', '.join(DTYPES)}"
        )
    return as_type


def _torch_device(cupy: Any, obj: Any, rank: int, what: str, arg: str) -> tuple[Any, Any]:
    """A CuPy view of CUDA tensor ``obj``'s memory, built from its data pointer,
    and its logical dtype (bfloat16, carried as uint16 bits) or None.

    Not ``cupy.from_dlpack``: that exchange took 35 us a call on the H200
    machine's host (this view: 15 us), much of it torch ordering CuPy's current
    stream after its own, which pycoll does itself on the stream the call names
    (:mod:`pycoll.gpu.context`).
    The view keeps the tensor alive.
    """
    t = obj.detach()
    as_type = _check_torch(t, rank, what, arg)
    shape, dev = tuple(t.shape), t.device.index
    if t.numel() == 0:
        with cupy.cuda.Device(dev):
            arr = cupy.empty(shape, as_type)
    else:
        item = t.element_size()
        strides = tuple(item * s for s in t.stride())
        extent = item + sum((n - 1) * s for n, s in zip(shape, strides, strict=True))
        mem = cupy.cuda.UnownedMemory(t.data_ptr(), extent, t, dev)
        arr = cupy.ndarray(shape, as_type, cupy.cuda.MemoryPointer(mem, 0), strides)
    return arr, _BF16 if str(t.dtype) == "torch.bfloat16" else None


def _buffer_host(obj: Any, rank: int, what: str, arg: str) -> Any:
    """A NumPy view of a buffer-protocol object (no copy), or None if it has none."""
    try:
        mv = memoryview(obj)
    except TypeError:
        return None
    try:
        return np.asarray(mv)
    except (TypeError, ValueError) as exc:  # a format NumPy cannot read
        raise InvalidArgumentError(
            f"rank {rank}: {what}: {arg} ({type(obj).__name__}, format {mv.format!r}) "
            f"cannot be read as an array: {exc}"
        ) from exc


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
    if is_torch(obj):
        return _torch_device(cupy, obj, rank, what, arg)
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
        InvalidArgumentError: not an array, a tensor or a buffer, not contiguous,
            read-only (when ``writable``), or of an unsupported dtype.  The message names the
            argument, the value and the rank.
        UnsupportedError: a CUDA array while CuPy is not installed.
    """
    logical = None
    if isinstance(obj, np.ndarray):
        arr = obj
        device = -1
    elif is_device_array(obj):
        arr, logical = _as_cupy(obj, rank, what, arg)
        device = int(arr.device.id)
    else:
        arr = (
            _torch_host(obj, rank, what, arg)
            if is_torch(obj)
            else _buffer_host(obj, rank, what, arg)
        )
        device = -1
        if arr is None:
            raise InvalidArgumentError(
                f"rank {rank}: {what}: {arg} must be a NumPy array, a torch tensor, a buffer "
                "(memoryview, bytearray, array.array, ...) or a CUDA array "
                f"(CuPy, __cuda_array_interface__, __dlpack__), got {type(obj).__name__}"
            )
    if device < 0 and writable and not arr.flags.writeable:
        kind = "" if isinstance(obj, np.ndarray) else f" ({type(obj).__name__})"
        raise InvalidArgumentError(
            f"rank {rank}: {what}: {arg} is read-only{kind}; it is written here, "
            "so pass a writable buffer"
        )
    if not arr.flags.c_contiguous:
        fix = ".contiguous()" if is_torch(obj) else "np.ascontiguousarray"
        raise InvalidArgumentError(
            f"rank {rank}: {what}: {arg} with shape {arr.shape} and strides {arr.strides} "
            f"is not C-contiguous; pass a contiguous array ({fix})"
        )
    check_dtype(arr.dtype if logical is None else logical, rank, what, arg)
    return Buffer(obj, arr.reshape(-1), device, logical)
