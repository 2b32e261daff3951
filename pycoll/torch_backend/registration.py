"""Registration: the ``"pycoll"`` backend's creator and the ``mpi://`` rendezvous."""

from __future__ import annotations

import importlib
import os
from datetime import timedelta
from typing import Any
from urllib.parse import urlparse

import torch.distributed as dist
from torch.distributed.constants import default_pg_timeout

import pycoll
from pycoll.torch_backend.base import NAME
from pycoll.torch_backend.group import ProcessGroupPycoll

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
