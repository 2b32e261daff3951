"""One-sided windows of a cuda_ipc connection (:attr:`~transports.base.Cap.ONE_SIDED`).

Each side exposes whole buffers to the other: descriptors in the host segment,
ordering through device words written and waited on by the streams themselves,
so the host never waits (see :class:`_Window`).
"""

from __future__ import annotations

import mmap
import struct
from collections import OrderedDict
from collections.abc import Sequence
from typing import TYPE_CHECKING

from transports import _atomic
from transports.base import Backoff, Deadline, DeviceSpan, TransportError, TransportTimeout
from transports.cuda_driver import export, on_device, stream_wait, stream_write
from transports.cuda_ipc.layout import (
    _F_EXPOSED,
    _F_RELEASED,
    _W_DESC,
    _W_DESC_BYTES,
    _W_EXPOSED,
    _W_MAX_SPANS,
    _W_RELEASED,
    _W_SPAN,
    _WIN_OFF,
    _WIN_SLOTS,
    NAME,
    _ipc_open,
)

if TYPE_CHECKING:
    from transports.cuda_ipc.rings import CudaIpcConnection

_OPEN_CACHE = 32  # peer allocations kept mapped per connection


class _Window:
    """One-sided windows of one connection: the host side of :meth:`Connection.expose`.

    Ordering on the device uses two 32-bit words per side in device memory, right
    after each side's ring (the peer has that allocation mapped already): our
    "exposed" and "released" counts.  Exposing ``k`` enqueues a write of ``k`` into
    our "exposed" word on the exposing stream (``cuStreamWriteValue32``, after the
    work already queued there); the peer's stream waits until that word reaches
    ``k`` (``cuStreamWaitValue32``).  The counts only grow, so no signal is ever
    reused, and the host never waits for the device.

    The host needs the same counts, in the shared segment, for the descriptors:
    our exposure ``k`` describes its spans in slot ``(k - 1) % 4``, and a slot is
    rewritten only once the peer's host released the exposure that used it.
    """

    def __init__(self, conn: CudaIpcConnection, mm: mmap.mmap) -> None:
        self._conn = conn
        self._rt = conn._rt
        mine = _WIN_OFF[conn._side]
        theirs = _WIN_OFF[1 - conn._side]
        self._mm = mm
        self._mine = mine
        self._theirs = theirs
        self._exposed_me = _atomic.Counter(mm, mine + _W_EXPOSED)
        self._released_me = _atomic.Counter(mm, mine + _W_RELEASED)
        self._exposed_peer = _atomic.Counter(mm, theirs + _W_EXPOSED)
        self._released_peer = _atomic.Counter(mm, theirs + _W_RELEASED)
        self.exposed = self.waited = 0  # our exposures made / whose release we waited for
        self.opened = self.released = 0  # the peer's exposures opened / released
        self._flags = conn._ring + conn.nslots * conn.slot_bytes  # our device words
        self._maps: OrderedDict[bytes, int] = OrderedDict()  # peer handle -> mapped base

    def counters(self) -> tuple[_atomic.Counter, ...]:
        return (self._exposed_me, self._released_me, self._exposed_peer, self._released_peer)

    # ------------------------------------------------------------------ helpers
    def _await(self, ctr: _atomic.Counter, value: int, deadline: Deadline, what: str) -> None:
        if ctr.load() >= value:
            return
        bo = Backoff()
        while ctr.load() < value:
            self._conn.check_peer()
            if deadline.expired():
                raise TransportTimeout(
                    f"cuda_ipc: timed out waiting for peer {self._conn.peer} to {what}",
                    pending=[self._conn.peer],
                )
            bo.pause()

    def _peer_flags(self) -> int:
        conn = self._conn
        if not conn._peer_opened:
            conn._open_peer()
        return conn._peer_ring + conn.nslots * conn.slot_bytes

    def _map(self, handle: bytes, raw: int, stream: int) -> int:
        """The base of the peer's allocation ``handle`` in our address space (cached;
        what it uses on ``stream``, the only one that reads the windows)."""
        conn = self._conn
        if not conn._peer_ipc:
            return raw  # both ends in one process
        base = self._maps.get(handle)
        if base is not None:
            self._maps.move_to_end(handle)
            return base
        rt = self._rt
        with on_device(conn.device):
            if len(self._maps) >= _OPEN_CACHE:
                # no queued work may still use what we unmap; not the whole device:
                # other streams may wait for the very collective that maps this
                rt.streamSynchronize(stream)
                _, old = self._maps.popitem(last=False)
                rt.ipcCloseMemHandle(old)
            base = _ipc_open(handle, conn.peer, "exposed buffer", TransportError)
        self._maps[handle] = base
        return base

    # ------------------------------------------------------------------ protocol
    def expose(self, spans: Sequence[DeviceSpan], stream: int, deadline: Deadline) -> None:
        if len(spans) > _W_MAX_SPANS:
            raise ValueError(f"cuda_ipc: at most {_W_MAX_SPANS} spans per window")
        seq = self.exposed + 1
        self._await(self._released_peer, seq - _WIN_SLOTS, deadline, "release a window")
        slot = (seq - 1) % _WIN_SLOTS
        off = self._mine + _W_DESC + slot * _W_DESC_BYTES
        struct.pack_into("<Q", self._mm, off, len(spans))
        for i, sp in enumerate(spans):
            handle, offset = export(sp.ptr) if sp.nbytes else (bytes(64), 0)
            _W_SPAN.pack_into(
                self._mm, off + 8 + i * _W_SPAN.size, handle, offset, sp.nbytes, sp.ptr
            )
        stream_write(stream, self._flags + _F_EXPOSED, seq)
        self.exposed = seq
        self._exposed_me.store(seq)

    def open(self, stream: int, deadline: Deadline) -> list[DeviceSpan]:
        seq = self.opened + 1
        self._await(self._exposed_peer, seq, deadline, "expose its buffers")
        flags = self._peer_flags()
        slot = (seq - 1) % _WIN_SLOTS
        off = self._theirs + _W_DESC + slot * _W_DESC_BYTES
        (count,) = struct.unpack_from("<Q", self._mm, off)
        spans = []
        dev = self._conn.device
        for i in range(min(count, _W_MAX_SPANS)):
            handle, offset, nbytes, raw = _W_SPAN.unpack_from(self._mm, off + 8 + i * _W_SPAN.size)
            ptr = self._map(handle, raw - offset, stream) + offset if nbytes else 0
            spans.append(DeviceSpan(ptr, nbytes, dev, stream))
        stream_wait(stream, flags + _F_EXPOSED, seq)
        self.opened = seq
        return spans

    def release(self, stream: int) -> None:
        seq = self.released + 1
        if seq > self.opened:
            raise TransportError(
                "cuda_ipc: release() without an open window", peer=self._conn.peer, transport=NAME
            )
        stream_write(stream, self._flags + _F_RELEASED, seq)
        self.released = seq
        self._released_me.store(seq)

    def wait_released(self, stream: int, deadline: Deadline) -> None:
        seq = self.waited + 1
        if seq > self.exposed:
            raise TransportError(
                "cuda_ipc: wait_released() without an exposure",
                peer=self._conn.peer,
                transport=NAME,
            )
        stream_wait(stream, self._peer_flags() + _F_RELEASED, seq)
        self.waited = seq

    def close(self) -> None:
        """Unmap the peer's buffers (after the device is done with them)."""
        rt = self._rt
        if self._maps:
            rt.deviceSynchronize()
        for base in self._maps.values():
            rt.ipcCloseMemHandle(base)
        self._maps.clear()
