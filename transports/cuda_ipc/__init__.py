"""CUDA IPC transport: GPU memory between processes on one host (one GPU or several).

A device connection (:attr:`~transports.base.Cap.DEVICE`): it moves device
memory only (:meth:`~CudaIpcConnection.isend_device` /
:meth:`~CudaIpcConnection.irecv_device`); host buffers keep using shm.

Per pair of ranks:

* each rank ``cudaMalloc``\\ s a ring of ``nslots`` device slots for its
  *incoming* direction and exports it with ``cudaIpcGetMemHandle``;
* a small nameless host segment (mode 0600, created by the lower rank and
  opened by the higher one through the creator's descriptor, as in
  :mod:`transports._segment`, so a crash at any moment leaks nothing) holds both rings' handles and the flow-control counters, as in
  :mod:`transports.shm`: per direction the sender owns ``head`` (slots
  published) and the receiver owns ``tail`` (slots released);
* a sender opens the peer's handle once, on first use, and keeps it.  Several
  ranks on one GPU work: IPC between processes on one device is allowed (NCCL
  refuses that setup, CUDA does not).

Sending a piece: ``cudaMemcpyAsync`` from the user's buffer into the peer's next
free slot on the sender's stream (:attr:`DeviceSpan.stream`), then an event;
once the host sees the event complete it writes the piece length and stores
``head + 1`` (release).  Receiving: the receiver sees ``head`` move (acquire),
hands the slot to the sink as a :class:`DeviceSpan` on its own memory (the sink
copies or reduces straight out of the slot, enqueued on the span's stream), records an
event, and stores ``tail + 1`` only once that event completed, so the peer
never overwrites a slot that a queued kernel still reads.  Several slots are in
flight per direction, so copies, reductions and the host's polling overlap.

One-sided windows (:attr:`~transports.base.Cap.ONE_SIDED`): besides the
rings, a connection lets each side expose whole buffers to the other (see
:mod:`~transports.cuda_ipc.windows`): descriptors in the host segment, ordering through device words
written and waited on by the streams themselves, so the host never waits.

Completion is observed by polling events from the host: a request is done when
its bytes were copied (send) or consumed by the sink's queued work (receive).
CUDA is reached through CuPy's runtime API and the driver library, both loaded
lazily (:mod:`transports.cuda_driver`).

Modules: :mod:`~transports.cuda_ipc.layout` (the control segment),
:mod:`~transports.cuda_ipc.rings` (the connection and its rings),
:mod:`~transports.cuda_ipc.windows` (one-sided windows) and
:mod:`~transports.cuda_ipc.transport` (set-up).
"""

from __future__ import annotations

from transports.cuda_ipc.layout import NAME
from transports.cuda_ipc.rings import CudaIpcConnection
from transports.cuda_ipc.transport import CudaIpcTransport

__all__ = ["NAME", "CudaIpcConnection", "CudaIpcTransport"]
