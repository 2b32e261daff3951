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
``reduce`` and ``barrier``: everything ``DistributedDataParallel`` uses.

Every collective is queued, in call order, to one worker thread per process
group that runs it on the communicator; the returned ``Work`` wraps a
:class:`torch.futures.Future` that the worker completes with the output
tensors (or the error), so ``work.wait()``, ``work.is_completed()`` and
``work.get_future()`` (which DDP chains its bucket callbacks on) behave as
with Gloo.  CPU tensors are passed to pycoll zero-copy through their NumPy
views; CUDA tensors are staged through host memory (copied out when the
collective is issued, copied back when it completes).  Data-movement
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
from typing import Any
from urllib.parse import urlparse

import ml_dtypes
import numpy as np
import torch
import torch.distributed as dist
from torch._C._distributed_c10d import _create_work_from_future  # type: ignore[attr-defined]

import pycoll
from pycoll.errors import InvalidArgumentError, UnsupportedError

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
    if as_bytes:
        return flat.view(torch.uint8).numpy()
    if flat.dtype is torch.bfloat16:
        return flat.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    if flat.dtype not in _NUMPY_DTYPES:
        raise InvalidArgumentError(
            f"pycoll backend, rank {rank}: reductions on {flat.dtype} tensors are not supported; "
            f"use one of bfloat16, {', '.join(str(d) for d in _NUMPY_DTYPES)}"
        )
    return flat.numpy()


def _op(opts: Any, rank: int) -> str:
    op = opts.reduceOp
    for key, name in _OPS.items():
        if op == key:
            return name
    raise UnsupportedError(
        f"pycoll backend, rank {rank}: reduce op {op} is not supported; use SUM, AVG, MIN, MAX, PRODUCT, BAND, BOR or BXOR",
        rank=rank,
    )


def _check_same(tensors: Sequence[torch.Tensor], what: str, rank: int) -> None:
    if len(tensors) != 1:
        # c10d's multi-device-per-process form (one tensor per local GPU) is gone
        # from DDP; every current caller passes a list of one.
        raise UnsupportedError(
            f"pycoll backend, rank {rank}: {what} takes a list of exactly one tensor, got {len(tensors)}",
            rank=rank,
        )


# ----------------------------------------------------------------------------- process group
class ProcessGroupPycoll(dist.ProcessGroup):
    """A ``torch.distributed`` process group over a pycoll communicator.

    Args:
        comm: the communicator (this group closes it on ``shutdown``).
        rank: this process' rank in the group (must equal ``comm.rank``).
        size: the group size (must equal ``comm.size``).
        bootstrap: the bootstrap ``comm`` was built over; ``shutdown`` passes a
            barrier on it (bounded by the timeout) before closing ``comm``.
    """

    def __init__(
        self, comm: pycoll.Communicator, rank: int, size: int, bootstrap: Any = None
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
        self._jobs: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._worker = threading.Thread(target=self._serve, name="pycoll-torch", daemon=True)
        self._worker.start()
        self._closed = False

    # --- identity
    def getBackendName(self) -> str:
        return NAME

    def getRank(self) -> int:
        return self._rank

    def getSize(self) -> int:
        return self._size

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
            run, fut = job
            try:
                result = run()
            except BaseException as exc:
                log.info("pycoll backend: %s (raised by the Work's wait)", exc)
                fut.set_exception(exc)
            else:
                fut.set_result(result)

    def _enqueue(self, run: Callable[[], Any]) -> Any:
        if self._closed:
            raise RuntimeError(f"pycoll backend: {self!r} is shut down")
        fut: torch.futures.Future[Any] = torch.futures.Future()
        self._jobs.put((run, fut))
        return _create_work_from_future(fut)

    def shutdown(self) -> None:
        """Finish queued collectives, stop the worker, close the communicator."""
        if self._closed:
            return
        self._closed = True
        self._jobs.put(None)
        self._worker.join()
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

        return self._enqueue(run)

    def broadcast(self, tensors: list[torch.Tensor], opts: Any = None) -> Any:  # type: ignore[override]
        _check_same(tensors, "broadcast", self._rank)
        root = int(opts.rootRank) if opts is not None else 0
        s = _Staged(tensors[0], self._rank, as_bytes=True, copy_in=self._rank == root)

        def run() -> list[torch.Tensor]:
            self._comm.broadcast(s.array, root=root)
            if self._rank != root:
                s.finish()
            return tensors

        return self._enqueue(run)

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

        return self._enqueue(run)

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

        return self._enqueue(run)

    def _allgather_base(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> Any:
        return self.allgather_into_tensor_coalesced([output], [input], opts)

    def all_gather_single(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> Any:
        return self.allgather_into_tensor_coalesced([output], [input], opts)

    def allgather_into_tensor_coalesced(
        self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None
    ) -> Any:
        pairs = []
        for o, i in zip(outputs, inputs, strict=True):
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

        return self._enqueue(run)

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

        return self._enqueue(run)

    def barrier(self, opts: Any = None) -> Any:
        def run() -> list[torch.Tensor]:
            self._comm.barrier()
            return []

        return self._enqueue(run)


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
            comm = pycoll.init(world, **_config)
            return ProcessGroupPycoll(comm, rank, size, comm._bootstrap)
    if store is None:
        raise RuntimeError(
            "pycoll backend: torch.distributed gave no store, and this process was not "
            "started by an MPI launcher: launch with torchrun or mpiexec"
        )
    comm = pycoll.init(store=store, rank=rank, size=size, **_config)
    return ProcessGroupPycoll(comm, rank, size, comm._bootstrap)


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
