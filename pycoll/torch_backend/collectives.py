"""The reductions and data movement DDP, FSDP and DTensor use: allreduce (and its
coalesced form), broadcast, reduce, allgather (and its single-tensor and
coalesced forms), reduce_scatter (likewise) and barrier."""

from __future__ import annotations

from typing import Any

import torch
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from pycoll.errors import InvalidArgumentError
from pycoll.torch_backend.base import GroupBase, is_sync
from pycoll.torch_backend.streams import caller_stream, keep
from pycoll.torch_backend.tensors import Staged, check_dtype, check_dtypes, check_one, reduce_op
from pycoll.torch_backend.work import Work


def _there(t: torch.Tensor, stream: torch.cuda.Stream | None) -> torch.Tensor:
    """``t`` detached, on the host unless the call runs on the device (``stream``)."""
    return t.detach() if stream is not None else t.detach().to("cpu")


class Collectives(GroupBase):
    """The collectives of :class:`~pycoll.torch_backend.ProcessGroupPycoll`."""

    def allreduce(self, tensors: list[torch.Tensor], opts: Any = None) -> Any:  # type: ignore[override]
        check_one(tensors, "allreduce", self._rank)
        if tensors[0].is_cuda and not is_sync(opts):
            work = self._mirrored(tensors, opts)
            if work is not None:
                return work
        return self.allreduce_coalesced(tensors, opts)

    def _mirrored(self, tensors: list[torch.Tensor], opts: Any) -> Work | None:
        """DDP's bucket allreduce where every rank shares the GPU: an asynchronous
        allreduce of one CUDA tensor through a pinned host mirror (:mod:`.mirrors`),
        its copy in queued from this thread, as Gloo's is.  None where that does
        not hold, and the general path takes the call: a tensor it cannot take as
        it is (another device, not contiguous, empty), one over the limit, or
        calls queued ahead that may still queue work in its memory."""
        (t,) = tensors
        rank, nbytes = self._rank, t.nbytes
        if not (
            nbytes
            and t.layout == torch.strided
            and t.is_contiguous()
            and self._comm.async_via_host("allreduce", nbytes)
        ):
            return None
        stream = self._stream(tensors, "allreduce")
        lo = t.data_ptr()
        lane = self._lane
        if stream is None or not lane.ahead_clear(lo, lo + nbytes):
            return None
        check_dtype(t.dtype, rank)
        op = reduce_op(opts, rank) if opts is not None else "sum"
        # The copy in goes on the group's stream after the caller's work, queued
        # through the driver (each torch CUDA call here cost the thread that runs
        # DDP's hooks: benchmarks/RESULTS.md, "DDP's bucket allreduces"); the
        # worker's part never waits on the device.
        work = self._work("allreduce", stream, after=False)
        mirrors = self._mirrors
        raw = stream.cuda_stream
        m = mirrors.copy_in(t, raw, caller_stream(t.get_device()))

        def run() -> list[torch.Tensor]:
            try:
                keep(stream, t)  # the group's stream reads it and writes it back
                mirrors.reduce(m, t, op, raw)
            finally:
                lane.mirrored_done(work)
            return tensors

        lane.put_mirrored(run, work, (lo, lo + nbytes))
        return work

    def allreduce_coalesced(self, tensors: list[torch.Tensor], opts: Any = None) -> Any:
        """All ``tensors`` reduced with one allreduce per dtype: the tensors of one
        dtype are packed into one flat buffer (in their order), reduced together
        and unpacked; a dtype with a single tensor is reduced in place."""
        rank = self._rank
        op = reduce_op(opts, rank) if opts is not None else "sum"
        sync = is_sync(opts)
        stream = self._stream(tensors, "allreduce", sync)
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for t in tensors:
            by_dtype.setdefault(t.dtype, []).append(t)
        parts: list[tuple[Staged, list[torch.Tensor] | None]] = []
        for ts in by_dtype.values():
            if len(ts) == 1:
                parts.append((Staged(ts[0], rank, as_bytes=False, stream=stream), None))
            else:
                flat = _flatten_dense_tensors([_there(t, stream) for t in ts])
                parts.append((Staged(flat, rank, as_bytes=False, stream=stream), ts))

        sizes = [sum(t.nbytes for t in ts) for ts in by_dtype.values()]
        # where every rank shares the GPU: through pinned host mirrors (.mirrors)
        mirrored = (
            stream is not None
            and not sync
            and all(self._comm.async_via_host("allreduce", n) for n in sizes)
        )

        def run() -> list[torch.Tensor]:
            for s, packed in parts:
                if mirrored:
                    self._mirrors.allreduce(s.array, op)
                elif stream is not None and packed is None and not s.copied:
                    # the same tensor again is the same pycoll call: a device plan (.kept)
                    k = self._kept
                    self._comm.allreduce(k.array(s.array), op=op, stream=k.stream(stream))
                else:
                    self._comm.allreduce(s.array, op=op, stream=stream)
                if packed is None:
                    s.finish()
                    continue
                for t, r in zip(packed, _unflatten_dense_tensors(s.tensor, packed), strict=True):
                    t.detach().copy_(r)
            return tensors

        here = not mirrored and self._here(stream, "allreduce", sizes, sync)
        return self._enqueue("allreduce", run, stream, here, sync)

    def broadcast(self, tensors: list[torch.Tensor], opts: Any = None) -> Any:  # type: ignore[override]
        check_one(tensors, "broadcast", self._rank)
        root = int(opts.rootRank) if opts is not None else 0
        sync = is_sync(opts)
        stream = self._stream(tensors, "broadcast", sync)
        s = Staged(tensors[0], self._rank, as_bytes=True, copy_in=self._rank == root, stream=stream)

        def run() -> list[torch.Tensor]:
            self._comm.broadcast(s.array, root=root, stream=stream)
            if self._rank != root:
                s.finish()
            return tensors

        here = self._here(stream, "broadcast", [tensors[0].nbytes], sync)
        return self._enqueue("broadcast", run, stream, here, sync)

    def reduce(self, tensors: list[torch.Tensor], opts: Any = None) -> Any:  # type: ignore[override]
        check_one(tensors, "reduce", self._rank)
        op = reduce_op(opts, self._rank) if opts is not None else "sum"
        root = int(opts.rootRank) if opts is not None else 0
        sync = is_sync(opts)
        stream = self._stream(tensors, "reduce", sync)
        s = Staged(tensors[0], self._rank, as_bytes=False, stream=stream)

        def run() -> list[torch.Tensor]:
            self._comm.reduce(s.array, root=root, op=op, stream=stream)
            if self._rank == root:
                s.finish()
            return tensors

        here = self._here(stream, "reduce", [tensors[0].nbytes], sync)
        return self._enqueue("reduce", run, stream, here, sync)

    def allgather(  # type: ignore[override]
        self,
        output_tensors: list[list[torch.Tensor]],
        input_tensors: list[torch.Tensor],
        opts: Any = None,
    ) -> Any:
        check_one(input_tensors, "allgather", self._rank)
        outs = output_tensors[0]
        if len(outs) != self._size:
            raise InvalidArgumentError(
                f"pycoll backend, rank {self._rank}: allgather needs {self._size} output tensors, got {len(outs)}"
            )
        sync = is_sync(opts)
        stream = self._stream([*input_tensors, *outs], "allgather", sync)
        x = Staged(input_tensors[0], self._rank, as_bytes=True, stream=stream)
        k = input_tensors[0].nbytes
        for o in outs:
            check_dtypes(o, input_tensors[0], "allgather", self._rank)
            if o.nbytes != k:
                raise InvalidArgumentError(
                    f"pycoll backend, rank {self._rank}: allgather output tensor of {o.numel()} x {o.dtype} "
                    f"does not match the input's {input_tensors[0].numel()} x {input_tensors[0].dtype}"
                )
        staged = [Staged(o, self._rank, as_bytes=True, copy_in=False, stream=stream) for o in outs]

        def run() -> list[list[torch.Tensor]]:
            gathered = self._comm.allgather(x.array, x.empty(self._size * k))
            for r, s in enumerate(staged):
                s.array[...] = gathered[r * k : (r + 1) * k]
                s.finish()
            return output_tensors

        return self._enqueue("allgather", run, stream, here=sync, sync=sync)

    def _allgather_base(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> Any:
        return self.allgather_into_tensor_coalesced([output], [input], opts)

    def all_gather_single(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> Any:
        return self.allgather_into_tensor_coalesced([output], [input], opts)

    def allgather_into_tensor_coalesced(
        self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None
    ) -> Any:
        sync = is_sync(opts)
        stream = self._stream([*outputs, *inputs], "allgather_into_tensor", sync)
        pairs = []
        for o, i in zip(outputs, inputs, strict=True):
            check_dtypes(o, i, "allgather_into_tensor", self._rank)
            if o.nbytes != self._size * i.nbytes:
                raise InvalidArgumentError(
                    f"pycoll backend, rank {self._rank}: allgather output has {o.numel()} elements, expected "
                    f"{self._size} x {i.numel()}"
                )
            pairs.append(
                (
                    Staged(i, self._rank, as_bytes=True, stream=stream),
                    Staged(o, self._rank, as_bytes=True, copy_in=False, stream=stream),
                )
            )

        def run() -> list[torch.Tensor]:
            for x, out in pairs:
                self._comm.allgather(x.array, out.array, stream=stream)
                out.finish()
            return outputs

        here = self._here(stream, "allgather", [i.nbytes for i in inputs], sync)
        return self._enqueue("allgather_into_tensor", run, stream, here, sync)

    def all_gather_single_coalesced(
        self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None
    ) -> Any:
        return self.allgather_into_tensor_coalesced(outputs, inputs, opts)

    def reduce_scatter(  # type: ignore[override]
        self,
        output_tensors: list[torch.Tensor],
        input_tensors: list[list[torch.Tensor]],
        opts: Any = None,
    ) -> Any:
        check_one(output_tensors, "reduce_scatter", self._rank)
        ins = input_tensors[0]
        for t in ins:
            check_dtypes(output_tensors[0], t, "reduce_scatter", self._rank)
        if len(ins) != self._size:
            raise InvalidArgumentError(
                f"pycoll backend, rank {self._rank}: reduce_scatter needs {self._size} input tensors, got {len(ins)}"
            )
        stream = self._stream([*ins, *output_tensors], "reduce_scatter", is_sync(opts))
        flat_in = torch.cat([_there(t, stream).reshape(-1) for t in ins])
        return self._reduce_scatter([output_tensors[0]], [flat_in], opts)

    def _reduce_scatter_base(
        self, output: torch.Tensor, input: torch.Tensor, opts: Any = None
    ) -> Any:
        return self._reduce_scatter([output], [input], opts)

    def reduce_scatter_single(
        self, output: torch.Tensor, input: torch.Tensor, opts: Any = None
    ) -> Any:
        return self._reduce_scatter([output], [input], opts)

    def reduce_scatter_tensor_coalesced(
        self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None
    ) -> Any:
        return self._reduce_scatter(outputs, inputs, opts)

    def reduce_scatter_single_coalesced(
        self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None
    ) -> Any:
        return self._reduce_scatter(outputs, inputs, opts)

    def _reduce_scatter(
        self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any
    ) -> Any:
        op = reduce_op(opts, self._rank) if opts is not None else "sum"
        sync = is_sync(opts)
        stream = self._stream([*outputs, *inputs], "reduce_scatter", sync)
        pairs = []
        for o, i in zip(outputs, inputs, strict=True):
            check_dtypes(o, i, "reduce_scatter", self._rank)
            if i.numel() != self._size * o.numel():
                raise InvalidArgumentError(
                    f"pycoll backend, rank {self._rank}: reduce_scatter input has {i.numel()} elements, expected "
                    f"{self._size} x {o.numel()}"
                )
            pairs.append(
                (
                    Staged(i, self._rank, as_bytes=False, stream=stream),
                    Staged(o, self._rank, as_bytes=False, copy_in=False, stream=stream),
                )
            )

        def run() -> list[torch.Tensor]:
            for x, out in pairs:
                self._comm.reduce_scatter(x.array, out.array, op=op, stream=stream)
                out.finish()
            return outputs

        here = self._here(stream, "reduce_scatter", [i.nbytes for i in inputs], sync)
        return self._enqueue("reduce_scatter", run, stream, here, sync)

    def barrier(self, opts: Any = None) -> Any:
        def run() -> list[torch.Tensor]:
            self._comm.barrier()
            return []

        return self._enqueue("barrier", run, here=is_sync(opts))

    def allgather_coalesced(  # type: ignore[override]
        self,
        output_lists: list[list[torch.Tensor]],
        inputs: list[torch.Tensor],
        opts: Any = None,
    ) -> Any:
        """All inputs gathered in one collective: each rank's inputs travel as one
        block of bytes, split into ``output_lists[r][i]`` (rank r's input i, as
        torch's ``all_gather_coalesced`` lays them out) on arrival."""
        rank, n = self._rank, self._size
        if len(output_lists) != n:
            raise InvalidArgumentError(
                f"pycoll backend, rank {rank}: allgather_coalesced needs {n} output lists "
                f"(one per rank), got {len(output_lists)}"
            )
        for outs in output_lists:
            if len(outs) != len(inputs):
                raise InvalidArgumentError(
                    f"pycoll backend, rank {rank}: allgather_coalesced has {len(inputs)} "
                    f"inputs but an output list of {len(outs)}"
                )
            for o, i in zip(outs, inputs, strict=True):
                check_dtypes(o, i, "allgather_coalesced", rank)
                if o.numel() != i.numel():
                    raise InvalidArgumentError(
                        f"pycoll backend, rank {rank}: allgather_coalesced output of "
                        f"{o.numel()} elements for an input of {i.numel()}"
                    )
        stream = self._stream(
            [*inputs, *(o for outs in output_lists for o in outs)], "allgather_coalesced"
        )
        sizes = [i.nbytes for i in inputs]
        parts = [_there(i, stream).reshape(-1).view(torch.uint8) for i in inputs]
        block = torch.cat(parts) if parts else torch.empty(0, dtype=torch.uint8)
        x = Staged(block, self._rank, as_bytes=True, stream=stream)
        outputs = [
            [Staged(o, rank, as_bytes=True, copy_in=False, stream=stream) for o in outs]
            for outs in output_lists
        ]
        total = sum(sizes)

        def run() -> list[list[torch.Tensor]]:
            gathered = self._comm.allgather(x.array, x.empty(self._size * total))
            for r, outs in enumerate(outputs):
                at = r * total
                for s, k in zip(outs, sizes, strict=True):
                    s.array[...] = gathered[at : at + k]
                    s.finish()
                    at += k
            return output_lists

        return self._enqueue("allgather_coalesced", run, stream)
