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
  Gloo does; mpi4py is then never imported.

Subgroups: ``dist.new_group(ranks)`` (backend ``pycoll``, every rank entering,
as by default) is split from the world communicator (``comm.split``): no new
connections, no bootstrap.  torch calls the default group's ``new_group`` on
every rank, members or not, and non-members split with no color.  With
``use_local_synchronization=True`` or a timeout of its own, a subgroup
bootstraps over its store instead.  The world group and the subgroups split
from it share one worker thread (:mod:`.worker`) that runs their calls in
the order the program made them, since pycoll runs the calls of one family
of communicators one at a time; a group bootstrapped on its own has its own.

Collectives: ``allreduce`` (SUM, AVG, MIN, MAX, PRODUCT, BAND, BOR, BXOR; which
op takes which dtype: :mod:`pycoll.reduce`) and its coalesced form (one
allreduce per dtype over the tensors packed together), ``broadcast``,
``allgather``, ``_allgather_base`` / ``all_gather_single`` and the coalesced
form, ``reduce_scatter``, ``_reduce_scatter_base`` / ``reduce_scatter_single``
and the coalesced form, ``reduce``, ``barrier``, ``allgather_coalesced`` (one
allgather), ``alltoall_base`` / ``all_to_all_single`` (even and uneven splits),
``alltoall`` (lists of tensors), ``gather``, ``scatter`` (and so
``gather_object``, ``scatter_object_list``, ``distribute_tensor``, DCP) and
``monitored_barrier`` (over the group's store; torch's
``dist.monitored_barrier`` takes Gloo groups only, so call
:func:`monitored_barrier`): everything ``DistributedDataParallel``, FSDP
(both), DeviceMesh and DTensor use.  Point-to-point: ``send``, ``recv``,
``recv_anysource`` (the Work's ``_source_rank()`` names the sender), so
``isend``/``irecv``, ``batch_isend_irecv`` and the object send/recv, and
``_coalescing_manager`` batches (posted together in one ``comm.group()``).
The group keeps the name and description c10d gives it, by which DeviceMesh,
functional collectives and ``destroy_process_group`` find it.

Every call is queued, in call order, to the group's worker thread, which runs
it on the communicator; a send or receive is posted there and completes while
the thread waits for the next call, so they complete in any order among
themselves (a collective completes the ones posted before it first, as in
NCCL).  The returned ``Work`` fails loudly,
as Gloo's does: ``work.wait()``, ``work.result()``, the synchronous ``dist.*``
calls and ``work.get_future().wait()`` raise the collective's error, and the
future that DDP chains its bucket callbacks on completes with an error that
C++ sees (not with the exception as its value).  The errors are pycoll's
(``PeerAbortedError``, ``CollectiveTimeout``, ``CollectiveMismatchError``...)
and at the same time ``torch.distributed.DistBackendError``, a
``RuntimeError``.  Every collective is bounded by the group's timeout: the
``timeout=`` of ``init_process_group`` / ``new_group`` when one is given,
else ``PYCOLL_TIMEOUT`` (torch's own default of 30 minutes does not override
it); a send or receive waits that long for its peer.  What pycoll does not
offer (``merge_remote_group``, per-device ``_get_backend``, completion hooks)
raises :class:`~pycoll.UnsupportedError` naming it and what to use instead.

CPU tensors are passed to pycoll zero-copy through DLPack (which leaves the
tensor's storage resizable, as FSDP needs); CUDA tensors are staged through
host memory (copied out when the collective is issued, copied back when it
completes).  Data-movement
calls (broadcast, allgather, the exchanges, send and recv) accept any dtype,
moved as bytes; reductions
need a dtype pycoll supports (bool, float16, bfloat16, float32, float64, int8,
uint8, int16, uint16, int32, uint32, int64, uint64, complex64, complex128).

torch is imported only by this package; ``import pycoll`` never imports it.
"""

from __future__ import annotations

from pycoll.torch_backend.base import NAME
from pycoll.torch_backend.group import ProcessGroupPycoll, monitored_barrier
from pycoll.torch_backend.registration import MPI_LAUNCHER_VARS, register, under_mpi

__all__ = [
    "MPI_LAUNCHER_VARS",
    "NAME",
    "ProcessGroupPycoll",
    "monitored_barrier",
    "register",
    "under_mpi",
]
