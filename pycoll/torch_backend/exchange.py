"""The exchanges: all_to_all_single (even and uneven splits), all_to_all (lists of
tensors), gather and scatter, on pycoll's alltoall, alltoallv, gather and scatter.

Tensors move as bytes, so every dtype works.  Split sizes count rows (slices
along dimension 0), as torch's do; the counts pycoll gets are those rows'
bytes.  Lists of tensors travel packed into one contiguous block per rank.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from pycoll.errors import InvalidArgumentError
from pycoll.torch_backend.base import GroupBase
from pycoll.torch_backend.tensors import Staged, check_dtypes, check_one


def _row_bytes(t: torch.Tensor) -> int:
    """The bytes of one slice along dimension 0 (a 0-d tensor is one row)."""
    rows = t.shape[0] if t.dim() else 1
    return t.nbytes // rows if rows else 0


def _packed(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """The tensors' bytes, one after the other, in one contiguous CPU tensor."""
    if not tensors:
        return torch.empty(0, dtype=torch.uint8)
    return torch.cat([t.detach().reshape(-1).view(torch.uint8).to("cpu") for t in tensors])


def _unpack(block: torch.Tensor, tensors: Sequence[torch.Tensor]) -> None:
    """Copy ``block``'s bytes into ``tensors``, one after the other."""
    at = 0
    for t in tensors:
        n = t.nbytes
        if n:
            t.detach().copy_(block[at : at + n].view(t.dtype).reshape(t.shape))
        at += n


def _overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.device != b.device or not a.nbytes or not b.nbytes:
        return False
    a0, b0 = a.data_ptr(), b.data_ptr()
    return a0 < b0 + b.nbytes and b0 < a0 + a.nbytes


class Exchanges(GroupBase):
    """The exchanges of :class:`~pycoll.torch_backend.ProcessGroupPycoll`."""

    def alltoall_base(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        output_split_sizes: list[int],
        input_split_sizes: list[int],
        opts: Any = None,
    ) -> Any:
        """``dist.all_to_all_single``: rows ``input_split_sizes[j]`` of ``input``
        go to rank j, whose rows land at ``output_split_sizes`` (empty lists:
        equal splits)."""
        rank, n, what = self._rank, self._size, "all_to_all_single"
        check_dtypes(output, input, what, rank)
        if _overlap(output, input):
            input = input.clone()
        x = Staged(input, rank, as_bytes=True)
        out = Staged(output, rank, as_bytes=True, copy_in=False)
        if not output_split_sizes and not input_split_sizes:
            if input.nbytes % n or output.nbytes != input.nbytes:
                raise InvalidArgumentError(
                    f"pycoll backend, rank {rank}: {what}: without split sizes the input "
                    f"({input.numel()} elements) must split evenly into {n} and the output "
                    f"hold as many ({output.numel()})"
                )

            def even() -> list[torch.Tensor]:
                self._comm.alltoall(x.array, out.array)
                out.finish()
                return [output]

            return self._enqueue(what, even)
        send = self._counts(input, input_split_sizes, "input_split_sizes")
        recv = self._counts(output, output_split_sizes, "output_split_sizes")

        def uneven() -> list[torch.Tensor]:
            self._comm.alltoallv(x.array, send, out.array, recv)
            out.finish()
            return [output]

        return self._enqueue(what, uneven)

    def all_to_all_single(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        output_split_sizes: list[int],
        input_split_sizes: list[int],
        opts: Any = None,
    ) -> Any:
        return self.alltoall_base(output, input, output_split_sizes, input_split_sizes, opts)

    def _counts(self, t: torch.Tensor, splits: Sequence[int], arg: str) -> list[int]:
        """Byte counts per rank of ``t``'s rows split as ``splits`` (empty: evenly)."""
        rows = t.shape[0] if t.dim() else 1
        if not splits:
            if rows % self._size:
                raise InvalidArgumentError(
                    f"pycoll backend, rank {self._rank}: all_to_all_single: {rows} rows do "
                    f"not split evenly into {self._size} (pass {arg})"
                )
            splits = [rows // self._size] * self._size
        if len(splits) != self._size or sum(splits) != rows or min(splits) < 0:
            raise InvalidArgumentError(
                f"pycoll backend, rank {self._rank}: all_to_all_single: {arg}={list(splits)} "
                f"must be {self._size} non-negative row counts summing to {rows}"
            )
        row = _row_bytes(t)
        return [int(s) * row for s in splits]

    def alltoall(  # type: ignore[override]
        self,
        output_tensors: list[torch.Tensor],
        input_tensors: list[torch.Tensor],
        opts: Any = None,
    ) -> Any:
        """``dist.all_to_all``: ``input_tensors[j]`` goes to rank j, whose tensor
        lands in its ``output_tensors[i]``; sizes may differ per pair."""
        rank, n, what = self._rank, self._size, "all_to_all"
        if len(output_tensors) != n or len(input_tensors) != n:
            raise InvalidArgumentError(
                f"pycoll backend, rank {rank}: {what} needs {n} input and {n} output tensors, "
                f"got {len(input_tensors)} and {len(output_tensors)}"
            )
        for o, i in zip(output_tensors, input_tensors, strict=True):
            check_dtypes(o, i, what, rank)
        x = Staged(_packed(input_tensors), rank, as_bytes=True)
        block = torch.empty(sum(o.nbytes for o in output_tensors), dtype=torch.uint8)
        out = Staged(block, rank, as_bytes=True, copy_in=False)
        send = [t.nbytes for t in input_tensors]
        recv = [t.nbytes for t in output_tensors]

        def run() -> list[torch.Tensor]:
            self._comm.alltoallv(x.array, send, out.array, recv)
            _unpack(block, output_tensors)
            return output_tensors

        return self._enqueue(what, run)

    def gather(  # type: ignore[override]
        self,
        output_tensors: list[list[torch.Tensor]],
        input_tensors: list[torch.Tensor],
        opts: Any = None,
    ) -> Any:
        """``dist.gather``: every rank's tensor into the root's list, in rank order."""
        rank, n, what = self._rank, self._size, "gather"
        check_one(input_tensors, what, rank)
        root = int(opts.rootRank) if opts is not None else 0
        i = input_tensors[0]
        outs: list[torch.Tensor] = []
        if rank == root:
            if len(output_tensors) != 1 or len(output_tensors[0]) != n:
                raise InvalidArgumentError(
                    f"pycoll backend, rank {rank}: {what}: the root needs one list of {n} "
                    "output tensors"
                )
            outs = output_tensors[0]
            for o in outs:
                check_dtypes(o, i, what, rank)
                if o.numel() != i.numel():
                    raise InvalidArgumentError(
                        f"pycoll backend, rank {rank}: {what}: an output of {o.numel()} "
                        f"elements for an input of {i.numel()}"
                    )
        elif output_tensors and any(output_tensors):
            raise InvalidArgumentError(
                f"pycoll backend, rank {rank}: {what}: only the root ({root}) takes outputs"
            )
        x = Staged(i, rank, as_bytes=True)
        block = torch.empty(n * i.nbytes if rank == root else 0, dtype=torch.uint8)
        out = Staged(block, rank, as_bytes=True, copy_in=False) if rank == root else None

        def run() -> list[list[torch.Tensor]]:
            self._comm.gather(x.array, None if out is None else out.array, root=root)
            _unpack(block, outs)
            return output_tensors

        return self._enqueue(what, run)

    def scatter(  # type: ignore[override]
        self,
        output_tensors: list[torch.Tensor],
        input_tensors: list[list[torch.Tensor]],
        opts: Any = None,
    ) -> Any:
        """``dist.scatter``: the root's ``input_tensors[0][j]`` into rank j's tensor."""
        rank, n, what = self._rank, self._size, "scatter"
        check_one(output_tensors, what, rank)
        root = int(opts.rootRank) if opts is not None else 0
        o = output_tensors[0]
        packed = None
        if rank == root:
            if len(input_tensors) != 1 or len(input_tensors[0]) != n:
                raise InvalidArgumentError(
                    f"pycoll backend, rank {rank}: {what}: the root needs one list of {n} "
                    "input tensors"
                )
            for t in input_tensors[0]:
                check_dtypes(o, t, what, rank)
                if t.numel() != o.numel():
                    raise InvalidArgumentError(
                        f"pycoll backend, rank {rank}: {what}: an input of {t.numel()} "
                        f"elements for an output of {o.numel()}"
                    )
            packed = Staged(_packed(input_tensors[0]), rank, as_bytes=True)
        elif input_tensors and any(input_tensors):
            raise InvalidArgumentError(
                f"pycoll backend, rank {rank}: {what}: only the root ({root}) takes inputs"
            )
        out = Staged(o, rank, as_bytes=True, copy_in=False)

        def run() -> list[torch.Tensor]:
            self._comm.scatter(None if packed is None else packed.array, out.array, root=root)
            out.finish()
            return output_tensors

        return self._enqueue(what, run)
