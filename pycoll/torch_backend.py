"""pycoll as a ``torch.distributed`` backend.

::

    import torch.distributed as dist
    import pycoll.torch_backend

    pycoll.torch_backend.register()           # once per process
    dist.init_process_group("pycoll")         # under mpiexec or torchrun (see below)
    model = torch.nn.parallel.DistributedDataParallel(model)

The backend is a Python :class:`torch.distributed.ProcessGroup`
whose collectives run on a pycoll :class:`~pycoll.Communicator`, bootstrapped
(:mod:`pycoll.rendezvous`) in one of two ways:

* under an MPI launcher (``mpiexec -n N python train.py``), the world group
  over mpi4py's ``COMM_WORLD``; ``init_process_group("pycoll")`` then needs
  neither ``RANK`` nor ``MASTER_ADDR``: :func:`register` installs an ``mpi://``
  rendezvous (rank and size from MPI, a ``TCPStore`` served by rank 0 and found
  over MPI), which ``env://`` uses when ``MASTER_ADDR`` is unset.  Given a rank
  or size, it must be the MPI one; a mismatch raises at ``init_process_group``.
* anywhere else (``torchrun``), over the store torch hands the backend, as
  Gloo does; mpi4py is then never imported.  Subgroups
  (``dist.new_group(ranks, backend="pycoll")``) always bootstrap over their store.

Collectives: ``allreduce`` (SUM, AVG, MIN, MAX, PRODUCT, BAND, BOR, BXOR; which
op takes which dtype: :mod:`pycoll.reduce`) and its coalesced
form, ``broadcast``, ``allgather``, ``_allgather_base`` /
``all_gather_single`` and the coalesced form, ``reduce_scatter``,
``_reduce_scatter_base`` / ``reduce_scatter_single`` and the coalesced form,
``reduce``, ``barrier``, ``allgather_coalesced`` (one allgather) and
``monitored_barrier`` (over the group's store; torch's
``dist.monitored_barrier`` takes Gloo groups only, so call
:func:`monitored_barrier`): everything ``DistributedDataParallel``, FSDP
(both), DeviceMesh and DTensor use.  The group keeps the name and description
c10d gives it, by which DeviceMesh, functional collectives and
``destroy_process_group`` find it.

Every collective is queued, in call order, to one worker thread per process
group that runs it on the communicator.  The returned ``Work`` fails loudly,
as Gloo's does: ``work.wait()``, ``work.result()``, the synchronous ``dist.*``
calls and ``work.get_future().wait()`` raise the collective's error, and the
future that DDP chains its bucket callbacks on completes with an error that
C++ sees (not with the exception as its value).  The errors are pycoll's
(``PeerAbortedError``, ``CollectiveTimeout``, ``CollectiveMismatchError``...)
and at the same time ``torch.distributed.DistBackendError``, a
``RuntimeError``.  Every collective is bounded by the group's timeout: the
``timeout=`` of ``init_process_group`` / ``new_group`` when one is given,
else ``PYCOLL_TIMEOUT`` (torch's own default of 30 minutes does not override
it).  Operations pycoll does not offer (send/recv, gather, scatter,
all_to_all...) raise :class:`~pycoll.UnsupportedError` naming the operation
and what to use instead.

CPU tensors are passed to pycoll zero-copy through DLPack (which leaves the
tensor's storage resizable, as FSDP needs); CUDA tensors are staged through
host memory (copied out when the collective is issued, copied back when it
completes).  Data-movement
collectives (broadcast, allgather) accept any dtype, moved as bytes; reductions
need a dtype pycoll supports (bool, float16, bfloat16, float32, float64, int8,
uint8, int16, uint16, int32, uint32, int64, uint64, complex64, complex128).

torch is imported only by this module; ``import pycoll`` never imports it.
"""

from __future__ import annotations

import importlib
import logging
import os
import queue
import threading
from collections.abc import Callable, Sequence
from datetime import timedelta
from time import monotonic
from typing import Any
from urllib.parse import urlparse

import ml_dtypes
import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.constants import default_pg_timeout

import pycoll
from pycoll.diagnose import grace_for
from pycoll.errors import CollectiveTimeout, InvalidArgumentError, PycollError, UnsupportedError

log = logging.getLogger(__name__)

NAME = "pycoll"

_OPS = {
    dist.ReduceOp.SUM: "sum",
    dist.ReduceOp.AVG: "avg",
    dist.ReduceOp.MIN: "min",
    dist.ReduceOp.MAX: "max",
    dist.ReduceOp.PRODUCT: "prod",
    dist.ReduceOp.BAND: "band",
    dist.ReduceOp.BOR: "bor",
    dist.ReduceOp.BXOR: "bxor",
}

_NUMPY_DTYPES: dict[torch.dtype, Any] = {
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


# ----------------------------------------------------------------------------- tensors
class _Staged:
    """A tensor seen as a flat host NumPy array; ``finish()`` writes results back.

    CPU contiguous tensors share memory with the array (nothing to write back);
    non-contiguous and CUDA tensors go through a contiguous host copy.
    """

    def __init__(self, t: torch.Tensor, rank: int, *, as_bytes: bool, copy_in: bool = True) -> None:
        self.tensor = t
        src = t.detach()
        self.copied = src.device.type != "cpu" or not src.is_contiguous()
        if self.copied:
            host = (
                src.to("cpu", copy=True).contiguous()
                if copy_in
                else torch.empty(src.shape, dtype=src.dtype)
            )
        else:
            host = src
        self.host = host
        self.array = _numpy_view(host.reshape(-1), as_bytes, rank)

    def finish(self) -> None:
        if self.copied:
            self.tensor.detach().copy_(self.host)


def _numpy_view(flat: torch.Tensor, as_bytes: bool, rank: int) -> np.ndarray:
    # DLPack, not Tensor.numpy(): numpy() marks the storage non-resizable for good,
    # and FSDP frees and regrows its parameters' storage (resize_) between steps.
    # The capsule keeps the tensor alive as long as the array.
    if as_bytes:
        return np.from_dlpack(flat.view(torch.uint8))
    if flat.dtype is torch.bfloat16:  # not a DLPack dtype NumPy knows
        return np.from_dlpack(flat.view(torch.int16)).view(ml_dtypes.bfloat16)
    if flat.dtype not in _NUMPY_DTYPES:
        raise InvalidArgumentError(
            f"pycoll backend, rank {rank}: reductions on {flat.dtype} tensors are not supported; "
            f"use one of bfloat16, {', '.join(str(d) for d in _NUMPY_DTYPES)}"
        )
    return np.from_dlpack(flat)


def _op_name(op: Any) -> str:
    """``SUM``, ``BAND``...: a ``ReduceOp``'s name (its repr is an address)."""
    kind = getattr(op, "op", op)
    return str(getattr(kind, "name", kind))


def _op(opts: Any, rank: int) -> str:
    op = opts.reduceOp
    for key, name in _OPS.items():
        if op == key:
            return name
    known = ", ".join(_op_name(k) for k in _OPS)
    raise _torch_error(
        UnsupportedError(
            f"pycoll backend, rank {rank}: reduce op {_op_name(op)} is not supported; use one of {known}",
            rank=rank,
        )
    )


def _check_same(tensors: Sequence[torch.Tensor], what: str, rank: int) -> None:
    if len(tensors) != 1:
        # c10d's multi-device-per-process form (one tensor per local GPU) is gone
        # from DDP; every current caller passes a list of one.
        raise _torch_error(
            UnsupportedError(
                f"pycoll backend, rank {rank}: {what} takes a list of exactly one tensor, got {len(tensors)}",
                rank=rank,
            )
        )


def _check_dtypes(out: torch.Tensor, x: torch.Tensor, what: str, rank: int) -> None:
    if out.dtype != x.dtype:
        raise InvalidArgumentError(
            f"pycoll backend, rank {rank}: {what}: the output is {out.dtype} but the input is "
            f"{x.dtype}; they must match"
        )


# ----------------------------------------------------------------------------- errors
_TORCH_ERRORS: dict[type[BaseException], type[BaseException]] = {}


def _torch_error(exc: BaseException) -> BaseException:
    """``exc`` as an instance of its pycoll class and of torch's ``DistBackendError``.

    torch code catches ``RuntimeError`` (or ``DistBackendError``) from a failed
    collective, as Gloo raises; pycoll code catches ``PeerAbortedError`` and the
    like.  The copy keeps the message, the attributes (rank, peer, recorder...),
    the cause and the traceback.  User errors (``InvalidArgumentError``, a
    ``ValueError``) and foreign exceptions pass unchanged.
    """
    if not isinstance(exc, PycollError) or isinstance(exc, (ValueError, RuntimeError)):
        return exc
    base = type(exc)
    cls = _TORCH_ERRORS.get(base)
    if cls is None:
        cls = type(base.__name__, (base, dist.DistBackendError), {"__module__": base.__module__})
        cls.__qualname__ = base.__qualname__
        _TORCH_ERRORS[base] = cls
    new = cls.__new__(cls, *exc.args)
    new.args = exc.args
    new.__dict__.update(exc.__dict__)
    new.__cause__ = exc.__cause__
    new.__suppress_context__ = exc.__suppress_context__
    return new.with_traceback(exc.__traceback__)


def _unsupported(rank: int, what: str, instead: str) -> BaseException:
    return _torch_error(
        UnsupportedError(
            f"pycoll backend, rank {rank}: {what} is not supported by pycoll yet; {instead}",
            rank=rank,
        )
    )


# ----------------------------------------------------------------------------- work
class _Worker:
    """What the group's worker thread is running: the collective's name and since when."""

    def __init__(self) -> None:
        self.what = ""
        self.since: float | None = None


class _Work(dist._Work):  # type: ignore[misc,name-defined]
    """One collective, queued to its group's worker thread: torch's ``Work``.

    ``wait()`` (what the synchronous ``dist.*`` calls run) and ``result()`` raise
    the collective's error; ``get_future()``'s future completes with the outputs
    or fails with that error; ``is_completed()``, ``is_success()`` and
    ``exception()`` say how it ended.  No wait is unbounded: each collective is
    bounded by the communicator's timeout, and one that has run longer than that
    plus a grace period (a stuck worker) makes every waiter raise.
    """

    def __init__(self, what: str, rank: int, timeout: float, worker: _Worker) -> None:
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
            self._error = _torch_error(exc)
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
                raise _torch_error(
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
                raise _torch_error(
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


# ----------------------------------------------------------------------------- process group
class ProcessGroupPycoll(dist.ProcessGroup):
    """A ``torch.distributed`` process group over a pycoll communicator.

    Args:
        comm: the communicator (this group closes it on ``shutdown``).
        rank: this process' rank in the group (must equal ``comm.rank``).
        size: the group size (must equal ``comm.size``).
        bootstrap: the bootstrap ``comm`` was built over; ``shutdown`` passes a
            barrier on it (bounded by the timeout) before closing ``comm``.
        store: the group's ``torch.distributed`` store (``monitored_barrier`` meets
            there); None: ``monitored_barrier`` is unsupported.

    Every collective is bounded by ``comm.config.timeout``.
    """

    def __init__(
        self,
        comm: pycoll.Communicator,
        rank: int,
        size: int,
        bootstrap: Any = None,
        store: Any = None,
    ) -> None:
        super().__init__(rank, size)  # type: ignore[call-arg]
        if (comm.rank, comm.size) != (rank, size):
            raise RuntimeError(
                f"pycoll backend: torch rank {rank} of {size} but the pycoll communicator "
                f"is rank {comm.rank} of {comm.size}"
            )
        self._comm = comm
        self._bootstrap = bootstrap
        self._rank = rank
        self._size = size
        self._store = store
        self._timeout = float(comm.config.timeout)
        self._group_name = ""
        self._group_desc = ""
        self._monitored = 0  # monitored_barrier calls so far (their keys in the store)
        self._jobs: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._busy = _Worker()
        self._worker = threading.Thread(target=self._serve, name="pycoll-torch", daemon=True)
        self._worker.start()
        self._closed = False
        self._broken = False

    # --- identity
    def getBackendName(self) -> str:
        return NAME

    def getRank(self) -> int:
        return self._rank

    def getSize(self) -> int:
        return self._size

    # c10d names every group (``_set_group_name``/``_set_group_desc``) and looks
    # groups up by name: DeviceMesh, DTensor, FSDP2, functional collectives and
    # destroy_process_group.  A C++ group keeps the name in its backend; a Python
    # group has none, so it keeps the name itself.
    def setGroupName(self, name: str) -> None:
        self._group_name = name

    def getGroupName(self) -> str:
        return self._group_name

    def setGroupDesc(self, desc: str) -> None:
        self._group_desc = desc

    def getGroupDesc(self) -> str:
        return self._group_desc

    def __repr__(self) -> str:
        return f"<ProcessGroupPycoll rank {self._rank} of {self._size}>"

    @property
    def communicator(self) -> pycoll.Communicator:
        return self._comm

    # --- the worker
    def _serve(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            run, work = job
            work._run(run)
            if isinstance(work._error, PycollError) and not isinstance(
                work._error, InvalidArgumentError
            ):
                self._broken = True  # the communicator is unusable; peers may be gone

    def _enqueue(self, what: str, run: Callable[[], Any]) -> _Work:
        if self._closed:
            raise RuntimeError(f"pycoll backend: {self!r} is shut down")
        work = _Work(what, self._rank, self._timeout, self._busy)
        self._jobs.put((run, work))
        return work

    def shutdown(self) -> None:
        """Finish queued collectives, stop the worker, close the communicator."""
        if self._closed:
            return
        self._closed = True
        self._jobs.put(None)
        self._worker.join()
        if self._broken:  # a failed collective: the peers may be gone, wait for none
            self._comm.abort()
            return
        if self._bootstrap is not None:
            # Every rank must have drained its last collective before any closes:
            # a shm peer that sees the other end closed fails a receive whose data
            # was already delivered.
            try:
                self._bootstrap.barrier(self._comm.config.timeout, "pycoll backend: shutdown")
            except pycoll.PycollError as exc:
                log.warning("pycoll backend: %s", exc)
        self._comm.close()

    def abort(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._jobs.put(None)
        self._comm.abort()

    # --- collectives
    def allreduce(self, tensors: list[torch.Tensor], opts: Any = None) -> Any:  # type: ignore[override]
        _check_same(tensors, "allreduce", self._rank)
        return self.allreduce_coalesced(tensors, opts)

    def allreduce_coalesced(self, tensors: list[torch.Tensor], opts: Any = None) -> Any:
        op = _op(opts, self._rank) if opts is not None else "sum"
        staged = [_Staged(t, self._rank, as_bytes=False) for t in tensors]

        def run() -> list[torch.Tensor]:
            for s in staged:
                self._comm.allreduce(s.array, op=op)
                s.finish()
            return tensors

        return self._enqueue("allreduce", run)

    def broadcast(self, tensors: list[torch.Tensor], opts: Any = None) -> Any:  # type: ignore[override]
        _check_same(tensors, "broadcast", self._rank)
        root = int(opts.rootRank) if opts is not None else 0
        s = _Staged(tensors[0], self._rank, as_bytes=True, copy_in=self._rank == root)

        def run() -> list[torch.Tensor]:
            self._comm.broadcast(s.array, root=root)
            if self._rank != root:
                s.finish()
            return tensors

        return self._enqueue("broadcast", run)

    def reduce(self, tensors: list[torch.Tensor], opts: Any = None) -> Any:  # type: ignore[override]
        _check_same(tensors, "reduce", self._rank)
        op = _op(opts, self._rank) if opts is not None else "sum"
        root = int(opts.rootRank) if opts is not None else 0
        s = _Staged(tensors[0], self._rank, as_bytes=False)

        def run() -> list[torch.Tensor]:
            self._comm.reduce(s.array, root=root, op=op)
            if self._rank == root:
                s.finish()
            return tensors

        return self._enqueue("reduce", run)

    def allgather(  # type: ignore[override]
        self,
        output_tensors: list[list[torch.Tensor]],
        input_tensors: list[torch.Tensor],
        opts: Any = None,
    ) -> Any:
        _check_same(input_tensors, "allgather", self._rank)
        outs = output_tensors[0]
        if len(outs) != self._size:
            raise InvalidArgumentError(
                f"pycoll backend, rank {self._rank}: allgather needs {self._size} output tensors, got {len(outs)}"
            )
        x = _Staged(input_tensors[0], self._rank, as_bytes=True)
        k = x.array.size
        for o in outs:
            _check_dtypes(o, input_tensors[0], "allgather", self._rank)
            if o.numel() * o.element_size() != k:
                raise InvalidArgumentError(
                    f"pycoll backend, rank {self._rank}: allgather output tensor of {o.numel()} x {o.dtype} "
                    f"does not match the input's {input_tensors[0].numel()} x {input_tensors[0].dtype}"
                )
        staged = [_Staged(o, self._rank, as_bytes=True, copy_in=False) for o in outs]

        def run() -> list[list[torch.Tensor]]:
            gathered = self._comm.allgather(x.array).reshape(self._size, k)
            for r, s in enumerate(staged):
                s.array[...] = gathered[r]
                s.finish()
            return output_tensors

        return self._enqueue("allgather", run)

    def _allgather_base(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> Any:
        return self.allgather_into_tensor_coalesced([output], [input], opts)

    def all_gather_single(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> Any:
        return self.allgather_into_tensor_coalesced([output], [input], opts)

    def allgather_into_tensor_coalesced(
        self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None
    ) -> Any:
        pairs = []
        for o, i in zip(outputs, inputs, strict=True):
            _check_dtypes(o, i, "allgather_into_tensor", self._rank)
            if o.numel() * o.element_size() != self._size * i.numel() * i.element_size():
                raise InvalidArgumentError(
                    f"pycoll backend, rank {self._rank}: allgather output has {o.numel()} elements, expected "
                    f"{self._size} x {i.numel()}"
                )
            pairs.append(
                (
                    _Staged(i, self._rank, as_bytes=True),
                    _Staged(o, self._rank, as_bytes=True, copy_in=False),
                )
            )

        def run() -> list[torch.Tensor]:
            for x, out in pairs:
                self._comm.allgather(x.array, out.array)
                out.finish()
            return outputs

        return self._enqueue("allgather_into_tensor", run)

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
        _check_same(output_tensors, "reduce_scatter", self._rank)
        ins = input_tensors[0]
        for t in ins:
            _check_dtypes(output_tensors[0], t, "reduce_scatter", self._rank)
        if len(ins) != self._size:
            raise InvalidArgumentError(
                f"pycoll backend, rank {self._rank}: reduce_scatter needs {self._size} input tensors, got {len(ins)}"
            )
        flat_in = torch.cat([t.detach().reshape(-1).to("cpu") for t in ins])
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
        op = _op(opts, self._rank) if opts is not None else "sum"
        pairs = []
        for o, i in zip(outputs, inputs, strict=True):
            _check_dtypes(o, i, "reduce_scatter", self._rank)
            if i.numel() != self._size * o.numel():
                raise InvalidArgumentError(
                    f"pycoll backend, rank {self._rank}: reduce_scatter input has {i.numel()} elements, expected "
                    f"{self._size} x {o.numel()}"
                )
            pairs.append(
                (
                    _Staged(i, self._rank, as_bytes=False),
                    _Staged(o, self._rank, as_bytes=False, copy_in=False),
                )
            )

        def run() -> list[torch.Tensor]:
            for x, out in pairs:
                self._comm.reduce_scatter(x.array, out.array, op=op)
                out.finish()
            return outputs

        return self._enqueue("reduce_scatter", run)

    def barrier(self, opts: Any = None) -> Any:
        def run() -> list[torch.Tensor]:
            self._comm.barrier()
            return []

        return self._enqueue("barrier", run)

    def allgather_coalesced(  # type: ignore[override]
        self,
        output_lists: list[list[torch.Tensor]],
        inputs: list[torch.Tensor],
        opts: Any = None,
    ) -> Any:
        """All inputs gathered in one collective: each rank's inputs travel as one
        block of bytes, split into ``output_lists[i][r]`` on arrival."""
        if len(output_lists) != len(inputs):
            raise InvalidArgumentError(
                f"pycoll backend, rank {self._rank}: allgather_coalesced has {len(inputs)} inputs "
                f"but {len(output_lists)} output lists"
            )
        for outs, i in zip(output_lists, inputs, strict=True):
            if len(outs) != self._size:
                raise InvalidArgumentError(
                    f"pycoll backend, rank {self._rank}: allgather_coalesced needs {self._size} "
                    f"output tensors per input, got {len(outs)}"
                )
            for o in outs:
                _check_dtypes(o, i, "allgather_coalesced", self._rank)
                if o.numel() != i.numel():
                    raise InvalidArgumentError(
                        f"pycoll backend, rank {self._rank}: allgather_coalesced output of "
                        f"{o.numel()} elements for an input of {i.numel()}"
                    )
        sizes = [i.numel() * i.element_size() for i in inputs]
        parts = [i.detach().reshape(-1).view(torch.uint8).to("cpu") for i in inputs]
        block = torch.cat(parts) if parts else torch.empty(0, dtype=torch.uint8)
        x = _Staged(block, self._rank, as_bytes=True)

        def run() -> list[list[torch.Tensor]]:
            gathered = self._comm.allgather(x.array).reshape(self._size, -1)
            for r in range(self._size):
                at = 0
                for outs, n in zip(output_lists, sizes, strict=True):
                    s = _Staged(outs[r], self._rank, as_bytes=True, copy_in=False)
                    s.array[...] = gathered[r, at : at + n]
                    s.finish()
                    at += n
            return output_lists

        return self._enqueue("allgather_coalesced", run)

    def monitored_barrier(
        self, timeout: timedelta | None = None, wait_all_ranks: bool = False
    ) -> None:
        """A barrier that names the ranks that did not reach it within ``timeout``.

        Rank 0 waits for every other rank's arrival in the group's store, then lets
        them pass; queued collectives finish first.  (``dist.monitored_barrier``
        accepts Gloo groups only: call this method on the group, or
        :func:`monitored_barrier`.)

        Args:
            timeout: how long to wait (default: the group's timeout).
            wait_all_ranks: name every late rank, not only the first.

        Raises:
            CollectiveTimeout: some rank did not arrive (on rank 0, naming it), or
                rank 0 did not let this rank pass (on the others), within ``timeout``.
            UnsupportedError: the group was made without a store.
        """
        store = self._store
        if store is None:
            raise _unsupported(self._rank, "monitored_barrier without a store", "use barrier()")
        secs = timeout.total_seconds() if timeout is not None else self._timeout
        self._monitored += 1
        key = f"pycoll/monitored_barrier/{self._monitored}"
        rank, size = self._rank, self._size

        def late(msg: str, missing: list[int]) -> BaseException:
            return _torch_error(
                CollectiveTimeout(
                    f"pycoll backend, rank {rank}: monitored_barrier: {msg}",
                    missing=missing,
                    rank=rank,
                    peer=missing[0],
                )
            )

        def run() -> list[torch.Tensor]:
            deadline = monotonic() + secs
            if rank != 0:
                store.set(f"{key}/{rank}", "1")
                try:
                    store.wait(
                        [f"{key}/pass"], timedelta(seconds=max(deadline - monotonic(), 0.001))
                    )
                except dist.DistStoreError:
                    raise late(f"rank 0 did not let it pass within {secs:g} s", [0]) from None
                return []
            missing = []
            for r in range(1, size):
                try:
                    left = max(deadline - monotonic(), 0.001)
                    store.wait([f"{key}/{r}"], timedelta(seconds=left))
                except dist.DistStoreError:
                    missing.append(r)
                    if not wait_all_ranks:
                        break
            if missing:
                who = (
                    f"Rank {missing[0]}"
                    if len(missing) == 1
                    else "Ranks " + ", ".join(map(str, missing))
                )
                raise late(
                    f"{who} failed to pass monitoredBarrier in {secs * 1000:.0f} ms", missing
                )
            store.set(f"{key}/pass", "1")
            return []

        self._enqueue("monitored_barrier", run).wait()

    # --- what pycoll does not offer yet: a clear error, not torch's "No backend type"
    def send(self, tensors: list[torch.Tensor], dst: int, tag: int = 0) -> Any:  # type: ignore[override]
        raise _unsupported(self._rank, "send", _P2P)

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int = 0) -> Any:  # type: ignore[override]
        raise _unsupported(self._rank, "recv", _P2P)

    def recv_anysource(self, tensors: list[torch.Tensor], tag: int = 0) -> Any:
        raise _unsupported(self._rank, "recv from any source", _P2P)

    def gather(self, *args: Any, **kw: Any) -> Any:  # type: ignore[override]
        raise _unsupported(
            self._rank, "gather", "use all_gather (every rank gets the result), or " + _GLOO
        )

    def scatter(self, *args: Any, **kw: Any) -> Any:  # type: ignore[override]
        raise _unsupported(
            self._rank,
            "scatter",
            "use broadcast of the whole tensor and take this rank's part, or " + _GLOO,
        )

    def alltoall(self, *args: Any, **kw: Any) -> Any:  # type: ignore[override]
        raise _unsupported(self._rank, "all_to_all", _GLOO)

    def alltoall_base(self, *args: Any, **kw: Any) -> Any:
        raise _unsupported(self._rank, "all_to_all_single", _GLOO)

    def all_to_all_single(self, *args: Any, **kw: Any) -> Any:
        raise _unsupported(self._rank, "all_to_all_single", _GLOO)

    def _start_coalescing(self, device: Any) -> None:
        raise _unsupported(self._rank, "coalescing (_coalescing_manager)", _GLOO)

    def _end_coalescing(self, device: Any) -> Any:
        raise _unsupported(self._rank, "coalescing (_coalescing_manager)", _GLOO)

    def split_group(self, *args: Any, **kw: Any) -> Any:
        raise _unsupported(self._rank, "split_group", "use dist.new_group(ranks, backend='pycoll')")

    def merge_remote_group(self, *args: Any, **kw: Any) -> Any:
        raise _unsupported(self._rank, "merge_remote_group", _GLOO)


_GLOO = "run it on a Gloo group: dist.new_group(backend='gloo')"
_P2P = (
    "point-to-point (send/recv, isend/irecv, batch_isend_irecv, and gather_object or "
    "scatter_object_list through them) needs " + _GLOO
)


def monitored_barrier(
    group: Any = None, timeout: timedelta | None = None, wait_all_ranks: bool = False
) -> None:
    """``dist.monitored_barrier`` for pycoll groups (torch's accepts only Gloo's).

    Args:
        group: a pycoll process group (default: the default group).
        timeout, wait_all_ranks: as for :meth:`ProcessGroupPycoll.monitored_barrier`.
    """
    pg = group if group is not None else dist.distributed_c10d._get_default_group()
    if not isinstance(pg, ProcessGroupPycoll):
        raise InvalidArgumentError(
            f"pycoll backend: monitored_barrier needs a pycoll group, got {pg!r}"
        )
    pg.monitored_barrier(timeout, wait_all_ranks)


# ----------------------------------------------------------------------------- registration
_config: dict[str, Any] = {}


#: Variables an MPI launcher (MPICH's hydra, Open MPI, PMIx) sets in every rank.
MPI_LAUNCHER_VARS = ("PMI_RANK", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "PMIX_RANK")


def under_mpi() -> bool:
    """Whether this process was started by an MPI launcher (mpiexec, mpirun, srun)."""
    return any(v in os.environ for v in MPI_LAUNCHER_VARS)


def _create(dist_opts: Any, backend_opts: Any) -> ProcessGroupPycoll:
    """The creator ``torch.distributed`` calls (extended API) for each new group.

    Under an MPI launcher the world group bootstraps over mpi4py's
    ``COMM_WORLD`` (torch's rank must be the MPI rank).  Elsewhere (torchrun),
    and for every subgroup, it bootstraps over the store torch hands it, which
    is bounded by the timeout like every pycoll bootstrap.
    """
    rank, size = int(dist_opts.group_rank), int(dist_opts.group_size)
    members = [int(r) for r in dist_opts.global_ranks_in_group]
    store = getattr(dist_opts, "store", None)
    if under_mpi():
        from mpi4py import MPI

        world = MPI.COMM_WORLD
        if not members or members == list(range(world.Get_size())):
            if (world.Get_rank(), world.Get_size()) != (rank, size):
                raise RuntimeError(
                    f"pycoll backend: torch.distributed says this process is rank {rank} of "
                    f"{size}, but in MPI COMM_WORLD it is rank {world.Get_rank()} of "
                    f"{world.Get_size()}. Under mpiexec, give torch the MPI rank and size "
                    "(init_process_group('pycoll') with no rank, world_size or store does), "
                    "or launch with torchrun instead."
                )
            comm = pycoll.init(world, **{**_config, **_timeout_of(dist_opts)})
            return ProcessGroupPycoll(comm, rank, size, comm._bootstrap, store=store)
    if store is None:
        raise RuntimeError(
            "pycoll backend: torch.distributed gave no store, and this process was not "
            "started by an MPI launcher: launch with torchrun or mpiexec"
        )
    comm = pycoll.init(store=store, rank=rank, size=size, **{**_config, **_timeout_of(dist_opts)})
    return ProcessGroupPycoll(comm, rank, size, comm._bootstrap, store=store)


def _timeout_of(dist_opts: Any) -> dict[str, float]:
    """The ``timeout=`` of init_process_group/new_group as a Config override.

    torch passes its default (30 minutes) when the caller gives none; then
    PYCOLL_TIMEOUT (or register(timeout=...)) decides.
    """
    t = getattr(dist_opts, "timeout", None)
    if not isinstance(t, timedelta) or t == default_pg_timeout:
        return {}
    return {"timeout": t.total_seconds()}


def _mpi_rendezvous(url: str, timeout: timedelta = timedelta(minutes=30), **kwargs: Any) -> Any:
    """torch's rendezvous under an MPI launcher: rank and size from MPI, and a
    ``TCPStore`` that rank 0 serves, its address sent over mpi4py (bounded).

    Reached as ``init_method="mpi://"``, and for ``env://`` (the default) when
    ``MASTER_ADDR`` is unset under an MPI launcher.
    """
    from mpi4py import MPI

    from pycoll.rendezvous import MpiBootstrap
    from transports.tcp import host_id, select_interfaces

    world = MPI.COMM_WORLD
    rank, size = world.Get_rank(), world.Get_size()
    query = dict(q.split("=", 1) for q in urlparse(url).query.split("&") if "=" in q)
    for key, mine in (("rank", rank), ("world_size", size)):
        given = int(query.get(key, -1))
        if given not in (-1, mine):
            raise RuntimeError(
                f"pycoll backend: {key}={given} was given, but MPI says {mine} "
                f"(rank {rank} of {size}): under mpiexec, leave rank and world_size out"
            )
    wait = timeout.total_seconds()
    boot = MpiBootstrap(world)
    try:
        boot.arrive(wait)
        here = host_id()
        one_host = all(h == here for h in boot.allgather(here, wait, "torch rendezvous"))
        addr = None
        server = None
        if rank == 0:
            host = "127.0.0.1"
            if not one_host:
                addrs, _, _ = select_interfaces(os.environ.get("PYCOLL_SOCKET_IFNAME"))
                host = addrs[0].host
            server = dist.TCPStore(host, 0, size, True, timeout=timeout, wait_for_workers=False)
            addr = (host, int(server.port))
        host, port = boot.bcast(addr, 0, wait, "torch rendezvous")
        store = server or dist.TCPStore(host, port, size, False, timeout=timeout)
    finally:
        boot.close()
    yield store, rank, size
    raise RuntimeError("pycoll backend: the mpi:// rendezvous cannot run again")


def _install_rendezvous() -> None:
    """``mpi://``, and ``env://`` without ``MASTER_ADDR`` under an MPI launcher."""
    rdzv = importlib.import_module("torch.distributed.rendezvous")

    handlers = rdzv._rendezvous_handlers
    if "mpi" not in handlers:
        rdzv.register_rendezvous_handler("mpi", _mpi_rendezvous)
    env = handlers.get("env")
    if env is None or getattr(env, "_pycoll", False):
        return

    def env_or_mpi(url: str, **kwargs: Any) -> Any:
        if under_mpi() and not os.environ.get("MASTER_ADDR"):
            return _mpi_rendezvous(url, **kwargs)
        return env(url, **kwargs)

    env_or_mpi._pycoll = True  # type: ignore[attr-defined]
    handlers["env"] = env_or_mpi


def register(**config: Any) -> None:
    """Make ``"pycoll"`` a ``torch.distributed`` backend (idempotent).

    Args:
        **config: overrides of :class:`pycoll.Config` fields (e.g. ``chunk_bytes=...``)
            for the communicators the backend creates; they win over ``PYCOLL_*``.
    """
    _config.clear()
    _config.update(config)
    _install_rendezvous()
    if NAME.upper() in dist.Backend._plugins:
        return
    devices = ["cpu", "cuda"]
    dist.Backend.register_backend(NAME, _create, extended_api=True, devices=devices)
