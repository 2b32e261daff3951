"""The cuda_ipc control segment: where each thing sits, shared by the rings
(:mod:`~transports.cuda_ipc.rings`), the windows (:mod:`~transports.cuda_ipc.windows`)
and the transport (:mod:`~transports.cuda_ipc.transport`).

Offsets in bytes::

    0      header: magic, version, nslots, slot_bytes, identity (at 32)
    256    per side (0 = creator = lower rank): pid, ready flag, IPC handle and
           raw pointer of the side's ring
    1024   per side: "closed" flag
    4096   direction 0 (lo -> hi) control: head, tail (own cache lines), each slot's
           piece length and tag
    6144   direction 1 (hi -> lo) control
    8192   side 0's windows: exposed and released counts, the "ready" and
           "done" words, one descriptor per window slot
    12288  side 1's windows

Both sides map the whole segment for their device too (``cudaHostRegister``), so
that the peer's stream can wait on a side's "ready" and "done" words, which
that side's host or stream writes.  Every word a stream waits on lives here,
never in a peer's device memory: a survivor's host can always store it itself
when the peer that should have is gone (:mod:`~transports.cuda_ipc.watchdog`).
Each side's device allocation holds its ring alone.
"""

from __future__ import annotations

import struct

from transports import _segment
from transports.base import TransportError
from transports.cuda_driver import runtime

NAME = "cuda_ipc"
SHM_DIR = _segment.SHM_DIR
_MAGIC = 0x70636F6C6C697063  # "pcollipc"
_VERSION = 6  # 4: "ready" in the segment; 5: calls' tags; 6: "done" in the segment
_HDR = struct.Struct("<IIQ")  # at 8: version, nslots, slot_bytes
# per side (0 = creator = lower rank): pid, ready flag, ipc handle, raw pointer
_SIDE_OFF = (256, 512)
_SIDE = struct.Struct("<Q8x64sQ")  # pid, (ready is a counter at +8), handle, ptr
_CLOSED_OFF = (1024, 1152)
_CTRL0 = 4096
_CTRL_SIZE = 2048
# one-sided windows, per side (written by that side): the host's exposed and
# released counts, the exposures whose buffers are ready on the device (written
# by the host or by the stream, see windows._Window.expose), the peer's
# exposures that this side's device work is done with (written by the stream,
# see windows._Window.release), then one
# descriptor per window slot: the span count, the spans, and at its end the
# exposing call's tag
_WIN_OFF = (8192, 12288)
_WIN_SLOTS = 4
_W_EXPOSED, _W_RELEASED, _W_READY, _W_DONE, _W_DESC = 0, 128, 256, 384, 1024
_W_DESC_BYTES = 512
_W_DESC_TAG = _W_DESC_BYTES - 8  # in a descriptor slot: the exposing call's tag (64 bits)
_W_MAX_SPANS = 4
_W_SPAN = struct.Struct("<64sQQQ")  # handle, offset in the allocation, nbytes, raw pointer
_SEG_BYTES = 16384
_META = struct.Struct("<QQ")  # per ring slot, after head and tail: the piece's length, its tag
_MAX_SLOTS = (_CTRL_SIZE - 256) // _META.size
_IPC_LAZY_PEER = 1  # cudaIpcMemLazyEnablePeerAccess


def _ipc_open(handle: bytes, peer: int, what: str, error: type[TransportError]) -> int:
    """Map a peer's allocation (``cudaIpcOpenMemHandle``) on the current device."""
    try:
        return int(runtime().ipcOpenMemHandle(handle, _IPC_LAZY_PEER))
    except Exception as exc:
        raise error(
            f"cuda_ipc: cannot open peer {peer}'s {what}: {exc}", peer=peer, transport=NAME
        ) from exc
