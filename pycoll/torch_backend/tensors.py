"""Tensors as pycoll sees them: flat host NumPy views or CUDA tensors, dtypes,
reduce ops, checks.

CPU contiguous tensors are viewed zero-copy through DLPack (which leaves their
storage resizable).  CUDA tensors of the communicator's device stay there
(:mod:`.streams`); on another device, they and non-contiguous tensors go through
a contiguous copy that :meth:`Staged.finish` writes back.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import ml_dtypes
import numpy as np
import torch
import torch.distributed as dist

from pycoll.errors import InvalidArgumentError, UnsupportedError
from pycoll.torch_backend.errors import torch_error
from pycoll.torch_backend.streams import keep

OPS = {
    dist.ReduceOp.SUM: "sum",
    dist.ReduceOp.AVG: "avg",
    dist.ReduceOp.MIN: "min",
    dist.ReduceOp.MAX: "max",
    dist.ReduceOp.PRODUCT: "prod",
    dist.ReduceOp.BAND: "band",
    dist.ReduceOp.BOR: "bor",
    dist.ReduceOp.BXOR: "bxor",
}

NUMPY_DTYPES: dict[torch.dtype, Any] = {
    torch.bool: np.bool_,
    torch.float16: np.float16,
    torch.float32: np.float32,
    torch.float64: np.float64,
    torch.int8: np.int8,
    torch.uint8: np.uint8,
    torch.int16: np.int16,
    torch.uint16: np.uint16,
    torch.int32: np.int32,
    torch.int64: np.int64,
    torch.uint32: np.uint32,
    torch.uint64: np.uint64,
    torch.complex64: np.complex64,
    torch.complex128: np.complex128,
}


class Staged:
    """A tensor seen as a flat array pycoll takes; ``finish()`` writes results back.

    On the host (``stream`` None): a flat NumPy view.  CPU contiguous tensors
    share memory with it (nothing to write back); non-contiguous and CUDA
    tensors go through a contiguous host copy.

    On the device (``stream``: the group's stream on the tensor's device, see
    :mod:`.streams`): a flat CUDA tensor, the tensor itself when it is
    contiguous, else a contiguous device copy (made on the caller's stream)
    that ``finish()`` writes back on the current one.
    """

    def __init__(
        self,
        t: torch.Tensor,
        rank: int,
        *,
        as_bytes: bool,
        copy_in: bool = True,
        stream: torch.cuda.Stream | None = None,
    ) -> None:
        if t.layout != torch.strided:  # sparse (COO, CSR...) and other layouts
            raise torch_error(
                UnsupportedError(
                    f"pycoll backend, rank {rank}: {t.layout} tensors are not supported; "
                    "pass dense tensors (tensor.to_dense()), or run it on a Gloo group",
                    rank=rank,
                )
            )
        self.tensor = t
        src = t.detach()
        # where pycoll reads it: this device (on the group's stream), else the host
        where = src.device if stream is not None else torch.device("cpu")
        self.copied = src.device != where or not src.is_contiguous()
        if self.copied:
            c = torch.empty(src.shape, dtype=src.dtype, device=where)
            if copy_in:
                c.copy_(src)  # to the host: waits for the caller's stream
        else:
            c = src
        self.contiguous = c  # the tensor itself where it needs no copy
        flat = c.reshape(-1)
        self.array: Any
        if stream is None:
            self.array = numpy_view(flat, as_bytes, rank)
            return
        if not as_bytes:
            check_dtype(flat.dtype, rank)
        self.array = flat.view(torch.uint8) if as_bytes else flat
        keep(stream, src, c)

    def empty(self, count: int) -> Any:
        """A new flat byte array of ``count`` bytes, where this one lies."""
        if isinstance(self.array, np.ndarray):
            return np.empty(count, np.uint8)
        return torch.empty(count, dtype=torch.uint8, device=self.array.device)

    def finish(self) -> None:
        if self.copied:
            t = self.tensor.detach()
            t.copy_(self.contiguous)
            if t.is_cuda and self.contiguous.device.type == "cpu":
                # A CUDA tensor through the host (another device than the
                # communicator's; the exchanges and point-to-point calls): the copy
                # back ran on this thread's stream, which the caller's streams do
                # not wait for, so it is over before the Work completes.
                torch.cuda.current_stream(t.device).synchronize()


def check_dtype(dtype: torch.dtype, rank: int) -> None:
    """Raise unless pycoll reduces ``dtype`` (bfloat16 and :data:`NUMPY_DTYPES`)."""
    if dtype is not torch.bfloat16 and dtype not in NUMPY_DTYPES:
        raise InvalidArgumentError(
            f"pycoll backend, rank {rank}: reductions on {dtype} tensors are not supported; "
            f"use one of bfloat16, {', '.join(str(d) for d in NUMPY_DTYPES)}"
        )


def numpy_view(flat: torch.Tensor, as_bytes: bool, rank: int) -> np.ndarray:
    # DLPack, not Tensor.numpy(): numpy() marks the storage non-resizable for good,
    # and FSDP frees and regrows its parameters' storage (resize_) between steps.
    # The capsule keeps the tensor alive as long as the array.
    if as_bytes:
        return _from_dlpack(flat.view(torch.uint8))
    if flat.dtype is torch.bfloat16:  # not a DLPack dtype NumPy knows
        return _from_dlpack(flat.view(torch.int16)).view(ml_dtypes.bfloat16)
    check_dtype(flat.dtype, rank)
    return _from_dlpack(flat)


def _from_dlpack(t: torch.Tensor) -> np.ndarray:
    try:
        return np.from_dlpack(t)
    except (BufferError, RuntimeError, TypeError):
        # Pinned memory: DLPack names it CUDA host memory, which NumPy may refuse.
        # numpy() shares it too (and fixes the storage's size, which nobody
        # resizes in pinned buffers).
        return t.numpy()


def op_name(op: Any) -> str:
    """``SUM``, ``BAND``...: a ``ReduceOp``'s name (its repr is an address)."""
    kind = getattr(op, "op", op)
    return str(getattr(kind, "name", kind))


def reduce_op(opts: Any, rank: int) -> str:
    op = opts.reduceOp
    for key, name in OPS.items():
        if op == key:
            return name
    known = ", ".join(op_name(k) for k in OPS)
    raise torch_error(
        UnsupportedError(
            f"pycoll backend, rank {rank}: reduce op {op_name(op)} is not supported; use one of {known}",
            rank=rank,
        )
    )


def check_one(tensors: Sequence[torch.Tensor], what: str, rank: int) -> None:
    if len(tensors) != 1:
        # c10d's multi-device-per-process form (one tensor per local GPU) is gone
        # from DDP; every current caller passes a list of one.
        raise torch_error(
            UnsupportedError(
                f"pycoll backend, rank {rank}: {what} takes a list of exactly one tensor, got {len(tensors)}",
                rank=rank,
            )
        )


def check_dtypes(out: torch.Tensor, x: torch.Tensor, what: str, rank: int) -> None:
    if out.dtype != x.dtype:
        raise InvalidArgumentError(
            f"pycoll backend, rank {rank}: {what}: the output is {out.dtype} but the input is "
            f"{x.dtype}; they must match"
        )
