"""GPU buffers as first-class: device collectives without host round trips.

Importing this package imports no GPU library: CuPy is imported when a device
buffer shows up or a GPU is probed at :func:`pycoll.init`.

* :mod:`pycoll.gpu.reduce`: local reductions with CuPy kernels (bfloat16 as uint16).
* :mod:`pycoll.gpu.links`: :class:`~pycoll.gpu.links.DeviceLinks`, the routing of
  device bytes per peer (device-capable connection, or pinned host staging).
* :mod:`pycoll.gpu.staging`: the pinned double-buffered D2H / wire / H2D pipeline.
* :mod:`pycoll.gpu.context`: streams, events and the collective bodies.
* :mod:`pycoll.gpu.windows`: collectives through one-sided device windows
  (``direct``: every rank reads and writes its peers' buffers itself).
* :mod:`pycoll.gpu.jobs`: device collectives as jobs (retire events that keep
  buffers alive, failures, and the gates that would let every call only enqueue).
"""

from __future__ import annotations

import importlib.util
import logging
from typing import Any

from pycoll.config import Config
from pycoll.errors import ConnectError
from transports.base import Cap

log = logging.getLogger(__name__)


def present() -> bool:
    """Whether CuPy imports and sees a CUDA device (False, quickly, without CuPy)."""
    if importlib.util.find_spec("cupy") is None:
        return False
    try:
        import cupy

        return int(cupy.cuda.runtime.getDeviceCount()) > 0
    except Exception:
        return False


class _Foreign:
    """A CUDA stream handle as the CUDA stream protocol presents one
    (``__cuda_stream__``: the protocol's version, 0, and the handle)."""

    __slots__ = ("ptr",)

    def __init__(self, ptr: int) -> None:
        self.ptr = ptr

    def __cuda_stream__(self) -> tuple[int, int]:
        return (0, self.ptr)


def external_stream(ptr: int, device: int) -> Any:
    """A CuPy stream object for the CUDA stream ``ptr`` of ``device``, which
    someone else (torch, the caller) owns: through the CUDA stream protocol
    (``Stream.from_external``, CuPy 14) where CuPy has it, else by the
    ``ExternalStream`` that CuPy 14 deprecates."""
    import cupy

    make = getattr(cupy.cuda.Stream, "from_external", None)
    if make is None:
        return cupy.cuda.ExternalStream(ptr, device)
    with cupy.cuda.Device(device):
        return make(_Foreign(ptr))


def setup(boot: Any, config: Config, rank: int, size: int) -> Any:
    """Build the device side of a communicator, collectively; None without a GPU here.

    When any rank has a GPU, every rank takes part in wiring the device table
    (``config.device_transports``; a rank without a GPU refuses every pair).
    If setting up the device connections fails, all ranks fall back to staging
    device bytes through the host connections, with a warning.
    """
    t, what = config.timeout, "pycoll.init: device"
    local = present()
    anyone = any(boot.allgather(local, t, what))
    if not anyone:
        return None
    from pycoll.bootstrap import wire

    wiring = None
    if size > 1 and config.device_transports:
        try:
            wiring = wire(boot, config, device=True)
        except ConnectError as exc:
            log.warning(
                "rank %d: device connections failed (%s); device buffers will be staged "
                "through host memory",
                rank,
                exc,
            )
            wiring = None
    # one-sided windows only when every pair has them: all ranks must agree
    mine = (
        local
        and wiring is not None
        and len(wiring.conns) == size - 1
        and all(Cap.ONE_SIDED in c.caps for c in wiring.conns.values())
    )
    one_sided = all(boot.allgather(bool(mine), t, what))
    # every rank on the same GPU: one rank's kernels can do a collective's work
    same = bool(
        mine
        and wiring is not None
        and all(Cap.SAME_DEVICE in c.caps for c in wiring.conns.values())
    )
    shared = all(boot.allgather(same, t, what))
    if not local:
        if wiring is not None:
            wiring.close()
        return None
    import cupy

    from pycoll.gpu.context import GpuContext

    ctx = GpuContext(
        rank,
        size,
        int(cupy.cuda.runtime.getDevice()),
        dict(wiring.conns) if wiring else {},
        dict(wiring.kind) if wiring else {},
        config.device_chunk_bytes,
        config.timeout,
        wiring.close if wiring else None,
    )
    ctx.one_sided = one_sided and size > 1
    ctx.shared_device = shared and ctx.one_sided
    log.info(
        "rank %d: device collectives %s%s",
        rank,
        "read and write peer buffers directly (one-sided windows to every peer)"
        if ctx.one_sided
        else "move chunks through the device connections or pinned host staging "
        "(not every pair has one-sided windows)",
        "; all ranks share one GPU, so one rank runs each collective's kernels"
        if ctx.shared_device
        else "",
    )
    return ctx
