"""One-sided windows of a cuda_ipc connection (:attr:`~transports.base.Cap.ONE_SIDED`).

Each side exposes whole buffers to the other: descriptors in the host segment,
ordering through words that the streams wait on, so the host never waits for
the device (see :class:`_Window`).
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import struct
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from transports import _atomic
from transports._segment import check_alive, process_gone
from transports.base import (
    Backoff,
    Deadline,
    DeviceSpan,
    PeerClosedError,
    TagMismatchError,
    TransportError,
    TransportTimeout,
)
from transports.cuda_driver import (
    export,
    host_map,
    host_unmap,
    on_device,
    stream_idle,
    stream_wait,
    stream_write,
)
from transports.cuda_ipc import watchdog
from transports.cuda_ipc.layout import (
    _SEG_BYTES,
    _W_DESC,
    _W_DESC_BYTES,
    _W_DESC_TAG,
    _W_DONE,
    _W_EXPOSED,
    _W_MAX_SPANS,
    _W_READY,
    _W_RELEASED,
    _W_SPAN,
    _WIN_OFF,
    _WIN_SLOTS,
    NAME,
    _ipc_open,
)

if TYPE_CHECKING:
    from transports.cuda_ipc.rings import CudaIpcConnection

log = logging.getLogger("pycoll.transports.cuda_ipc")

_OPEN_CACHE = 32  # peer allocations kept mapped per connection
_TAG = struct.Struct("<Q")
_UNMAP_WAIT = 5.0  # seconds close() waits for queued work on the segment's words


class _Window:
    """One-sided windows of one connection: the host side of :meth:`Connection.expose`.

    Exposure ``k`` describes its spans, and its call's tag, in descriptor slot
    ``(k - 1) % 4`` of the shared segment and stores ``k`` into our host
    "exposed" count; a slot is rewritten only once the peer's host released the
    exposure that used it.  The peer's opening compares the tag with its own
    call's before it maps or enqueues anything.

    The device ordering uses words that only grow, so no signal is ever reused
    and the host never waits for the device:

    * "ready" (in the segment, which both sides map for their device): the
      peer's stream waits until it reaches ``k`` (``cuStreamWaitValue32``)
      before it touches exposure ``k``; where the peer's host already reads
      ``k`` there when it opens the window, the buffers are final and its
      stream has nothing to wait for (two driver calls fewer, 6-7 us of the
      opener's host time on the H200).  If our stream has nothing left to run
      when we expose (its work, and what it waited for, is done), the buffers
      are final and our host stores ``k`` at once; otherwise our stream writes
      it after its queued work
      (``cuStreamWriteValue32``).  The host store matters where the ranks share
      a GPU: a word that only our stream can write makes the peer's stream wait
      for a time slice of our context (on the H200 at n = 2, 2.1-2.4 ms of GPU
      time for a 1 MiB allreduce against 0.29 ms).
    * "done" (in the segment too): our stream writes the count of the peer's
      exposures we released after the work that read its buffers; the peer's
      stream waits on it.

    Every word a stream of ours waits on is the peer's, in the segment, which
    our host can store too.  While such a wait is queued and not met, the
    :mod:`~transports.cuda_ipc.watchdog` looks at the peer; a peer that failed
    or is gone, or whose host has not released our exposure within the call's
    timeout, will never write it, and the watchdog stores the awaited count itself
    (:meth:`abandon`): the stream goes on rather than wait forever, the
    failure is logged, and the connection raises it at its next use.
    """

    def __init__(self, conn: CudaIpcConnection, mm: mmap.mmap) -> None:
        self._conn = conn
        self._rt = conn._rt
        mine = _WIN_OFF[conn._side]
        theirs = _WIN_OFF[1 - conn._side]
        self._mm = mm
        self._mine = mine
        self._theirs = theirs
        view = ctypes.c_char.from_buffer(mm)
        self._host = ctypes.addressof(view)
        del view  # the export ends here: only the counters below hold the mapping
        with on_device(conn.device):
            self._dev = host_map(self._host, _SEG_BYTES)  # the segment, seen by the device
        self._exposed_me = _atomic.Counter(mm, mine + _W_EXPOSED)
        self._released_me = _atomic.Counter(mm, mine + _W_RELEASED)
        self._ready_me = _atomic.Counter(mm, mine + _W_READY)
        self._exposed_peer = _atomic.Counter(mm, theirs + _W_EXPOSED)
        self._ready_peer = _atomic.Counter(mm, theirs + _W_READY)
        self._released_peer = _atomic.Counter(mm, theirs + _W_RELEASED)
        self._done_me = _atomic.Counter(mm, mine + _W_DONE)
        self._done_peer = _atomic.Counter(mm, theirs + _W_DONE)
        self.exposed = self.waited = 0  # our exposures made / whose release we waited for
        self.opened = self.released = 0  # the peer's exposures opened / released
        self._maps: OrderedDict[bytes, int] = OrderedDict()  # peer handle -> mapped base
        self._last = 0  # an event after the latest stream work on the segment's words
        self._last_stream = 0
        self.ready_by_host = self.ready_by_stream = 0  # how exposures were signaled
        self.opened_ready = self.opened_waiting = 0  # peer's exposures found ready / waited for
        # the spans each of our descriptor slots describes, as handed to expose()
        self._written: list[Sequence[DeviceSpan] | None] = [None] * _WIN_SLOTS
        # the peer's last descriptor as read, the stream, and the spans made of it
        self._read: tuple[bytes, int, list[DeviceSpan]] | None = None
        self._give_up_at: float | None = None  # when the watchdog lets our stream go
        self._sides: list[int] = []  # streams that poisoned outputs (abandon)
        #: why the watchdog let our stream go; the connection raises it at next use
        self.abandoned: TransportError | None = None

    def counters(self) -> tuple[_atomic.Counter, ...]:
        return (
            self._exposed_me,
            self._released_me,
            self._ready_me,
            self._exposed_peer,
            self._ready_peer,
            self._released_peer,
            self._done_me,
            self._done_peer,
        )

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
    def expose(
        self, spans: Sequence[DeviceSpan], stream: int, deadline: Deadline, tag: int = 0
    ) -> None:
        if len(spans) > _W_MAX_SPANS:
            raise ValueError(f"cuda_ipc: at most {_W_MAX_SPANS} spans per window")
        if self._conn._closed_peer.load():
            # a peer that closed (it failed, or left) never releases what we
            # show it, and our stream would wait for that on the device forever:
            # raise here, not 4 exposures later when the window slots run out
            self._conn.check_peer()
        seq = self.exposed + 1
        self._await(self._released_peer, seq - _WIN_SLOTS, deadline, "release a window")
        slot = (seq - 1) % _WIN_SLOTS
        if self._written[slot] is not spans or not (spans and spans[0].handle):
            # a list of spans with their handles, handed again, is unchanged (a
            # device plan's, pycoll.gpu.windows.KeptWindows): the slot still says it
            self._describe(slot, spans)
        _TAG.pack_into(self._mm, self._mine + _W_DESC + slot * _W_DESC_BYTES + _W_DESC_TAG, tag)
        # an idle stream: the buffers are final, and no stream write of an older
        # count is still queued (the word must only grow), so the host stores it
        # before the exposure is shown, and the peer's stream need not wait
        if stream_idle(stream) and self._marked_done():
            self._ready_me.store(seq)
            self.ready_by_host += 1
        else:
            self._on_stream(stream_write, stream, self._dev + self._mine + _W_READY, seq)
            self.ready_by_stream += 1
        self.exposed = seq
        self._exposed_me.store(seq)

    def _describe(self, slot: int, spans: Sequence[DeviceSpan]) -> None:
        """Write ``spans`` into our descriptor slot ``slot``."""
        off = self._mine + _W_DESC + slot * _W_DESC_BYTES
        struct.pack_into("<Q", self._mm, off, len(spans))
        for i, sp in enumerate(spans):
            if not sp.nbytes:
                handle, offset = bytes(64), 0
            elif sp.handle:
                handle, offset = sp.handle, sp.offset
            else:
                handle, offset = export(sp.ptr)
            _W_SPAN.pack_into(
                self._mm, off + 8 + i * _W_SPAN.size, handle, offset, sp.nbytes, sp.ptr
            )
        self._written[slot] = spans

    def open(self, stream: int, deadline: Deadline, tag: int = 0) -> list[DeviceSpan]:
        seq = self.opened + 1
        self._await(self._exposed_peer, seq, deadline, "expose its buffers")
        slot = (seq - 1) % _WIN_SLOTS
        off = self._theirs + _W_DESC + slot * _W_DESC_BYTES
        (theirs,) = _TAG.unpack_from(self._mm, off + _W_DESC_TAG)
        if theirs != tag:
            raise TagMismatchError(
                f"cuda_ipc: peer {self._conn.peer} exposed buffers for another call "
                f"(tag {theirs:#018x}, this call's {tag:#018x})",
                got=theirs,
                expected=tag,
                of="window",
                peer=self._conn.peer,
                transport=NAME,
            )
        (count,) = struct.unpack_from("<Q", self._mm, off)
        count = min(count, _W_MAX_SPANS)
        raw_desc = self._mm[off : off + 8 + count * _W_SPAN.size]
        last = self._read
        if last is not None and last[0] == raw_desc and last[1] == stream:
            spans = last[2]  # the peer exposed what it did last time: the same spans
        else:
            spans = self._spans_of(off, count, stream)
            self._read = (raw_desc, stream, spans)
        self.opened = seq
        if _reached(self._ready_peer.load(), seq):
            self.opened_ready += 1  # final already: nothing for the stream to wait for
        else:
            self._on_stream(stream_wait, stream, self._dev + self._theirs + _W_READY, seq)
            self.opened_waiting += 1
            self._watch(deadline)
        return spans

    def _spans_of(self, off: int, count: int, stream: int) -> list[DeviceSpan]:
        """The peer's spans described at ``off``, mapped into our address space."""
        spans = []
        dev = self._conn.device
        for i in range(count):
            handle, offset, nbytes, raw = _W_SPAN.unpack_from(self._mm, off + 8 + i * _W_SPAN.size)
            ptr = self._map(handle, raw - offset, stream) + offset if nbytes else 0
            spans.append(DeviceSpan(ptr, nbytes, dev, stream))
        return spans

    def _on_stream(self, op: Any, stream: int, addr: int, value: int) -> None:
        """``op(stream, addr, value)`` (a stream write or wait of a word), ordered
        after the last stream work on the words and remembered as the latest.

        A stream other than the last one's first waits, on the device, for the
        last one's work, so that the words only grow (callers may change
        streams: a device plan runs on its caller's stream, an ordinary call on
        pycoll's).  The latest work must be done before close() unmaps the
        words for the device, before the host stores "ready", and before
        another stream's work on them; one event says when it is."""
        rt = self._rt
        if self._last and stream != self._last_stream:
            rt.streamWaitEvent(stream, self._last, 0)
        op(stream, addr, value)
        if not self._last:
            self._last = int(rt.eventCreateWithFlags(0x2))  # cudaEventDisableTiming
        rt.eventRecord(self._last, stream)
        self._last_stream = stream

    def _marked_done(self) -> bool:
        return not self._last or self._rt.eventQuery(self._last) == 0

    def release(self, stream: int) -> None:
        seq = self.released + 1
        if seq > self.opened:
            raise TransportError(
                "cuda_ipc: release() without an open window", peer=self._conn.peer, transport=NAME
            )
        self._on_stream(stream_write, stream, self._dev + self._mine + _W_DONE, seq)
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
        self.waited = seq
        if not _reached(self._done_peer.load(), seq):
            self._on_stream(stream_wait, stream, self._dev + self._theirs + _W_DONE, seq)
            self._watch(deadline)

    # ------------------------------------------------------------------ failures
    def _watch(self, deadline: Deadline) -> None:
        """A stream wait on a peer's word was queued: the watchdog looks after it
        until it is met, within the call's timeout (an idle deadline's stretch)."""
        seconds = deadline.idle
        if seconds is None and deadline.at is not None:
            seconds = max(0.0, deadline.at - time.monotonic())
        self._give_up_at = None if seconds is None else time.monotonic() + seconds
        watchdog.watch(self)

    def unmet(self) -> bool:
        """Whether a stream wait we queued may still wait: a count of the peer's
        that our stream waits for has not been written, and we have not let it
        go (:meth:`abandon` wrote it, or queued its write; no wait is queued
        after that, since the connection raises at its next use)."""
        return self.abandoned is None and not (
            _reached(self._ready_peer.load(), self.opened)
            and _reached(self._done_peer.load(), self.waited)
        )

    def failure(self) -> TransportError | None:
        """Why the peer will never write what our stream waits for (None: it may).

        A peer whose process is gone never will: its queued work died with it.
        One that is alive and whose host queued every word we wait for (the
        "done" count: its release; a "ready" one we open only once its host
        showed it) will, however far behind its GPU is, even if it has closed
        or failed since.  One whose host has not queued it will not if it has
        closed, and is late once the call's timeout has passed."""
        conn = self._conn
        peer, pid = conn.peer, conn._peer_pid
        if pid and process_gone(pid):
            return PeerClosedError(
                f"cuda_ipc: peer {peer} (pid {pid}) has exited", peer=peer, transport=NAME
            )
        if _reached(self._released_peer.load(), self.waited):
            return None
        try:  # its "closed" word, also once our own end closed (check_peer is quiet then)
            check_alive(conn._closed_peer, 0, f"cuda_ipc: peer {peer}", peer=peer, transport=NAME)
        except TransportError as exc:
            return exc
        at = self._give_up_at
        if at is not None and time.monotonic() >= at:
            return TransportTimeout(
                f"cuda_ipc: peer {peer} did not release our exposure within the call's timeout",
                pending=[peer],
            )
        return None

    def abandon(self, why: TransportError) -> None:
        """Write the counts our stream waits for into the peer's words ourselves, so
        that it goes on (the connection raises ``why`` at its next use).  Only
        ever for a peer that will not.  What the peer should have written into
        our exposed outputs is filled with 0xFF bytes first (NaN for floating
        types), on a side stream that then writes the "done" count."""
        if self.abandoned is None:
            self.abandoned = why
        if not _reached(self._ready_peer.load(), self.opened):
            self._ready_peer.store(self.opened)
        seq = self.waited
        if _reached(self._done_peer.load(), seq):
            return
        outputs = [
            sp
            for k in range(max(1, seq - _WIN_SLOTS + 1), seq + 1)
            if not _reached(self._done_peer.load(), k)
            for sp in self._written[(k - 1) % _WIN_SLOTS] or ()
            if sp.written and sp.nbytes
        ]
        if not outputs:
            self._done_peer.store(seq)
            return
        rt = self._rt
        try:
            with on_device(self._conn.device):
                side = int(rt.streamCreateWithFlags(1))  # cudaStreamNonBlocking
                self._sides.append(side)  # destroyed at close, once it ran
                for sp in outputs:
                    rt.memsetAsync(sp.ptr, 0xFF, sp.nbytes, side)
                stream_write(side, self._dev + self._theirs + _W_DONE, seq)
        except Exception as exc:  # the stream must go on all the same
            log.error(
                "cuda_ipc: the outputs peer %d should have written could not be filled "
                "with NaN (%s); our stream is let go with them as they are",
                self._conn.peer,
                exc,
            )
            self._done_peer.store(seq)

    def _synchronize(self) -> None:
        try:
            with on_device(self._conn.device):
                self._rt.deviceSynchronize()
        except Exception as exc:  # a failed context: nothing left to wait for
            log.debug("cuda_ipc: device synchronize at close: %s", exc)

    def _drain(self) -> bool:
        """Whether our stream work on the words ends, as close() waits for it: a
        stream wait the peer will never meet is let go at once (the watchdog's
        :func:`~transports.cuda_ipc.watchdog.look`, every
        :data:`~transports.cuda_ipc.watchdog.PERIOD`), and any still unmet at
        the call's timeout (at least :data:`_UNMAP_WAIT` seconds from now) then:
        we are leaving, and nothing may wait for us."""
        rt = self._rt
        if not self._last:
            return True
        seconds = max(_UNMAP_WAIT, (self._give_up_at or 0.0) - time.monotonic())
        if _settled(rt, self._last, seconds, lambda: watchdog.look(self)):
            return True
        if not self.unmet():
            return False  # our stream is stuck on something else
        self.abandon(
            TransportTimeout(
                f"cuda_ipc: closed while our stream still waited for peer {self._conn.peer}",
                pending=[self._conn.peer],
            )
        )
        log.warning("cuda_ipc: %s; let go at close()", self.abandoned)
        return _settled(rt, self._last, 1.0)

    def close(self) -> None:
        """Unmap the peer's buffers and our segment's device mapping, once the
        device is done with them (:meth:`_drain`), never waiting without a
        bound.  Work that still does not end keeps the mappings until the
        process exits."""
        rt = self._rt
        watchdog.forget(self)
        done = self._drain()
        # other streams of ours may read the peer's buffers (a copy queued before
        # a call failed): the device must be done with them before they unmap
        if done and self._maps:
            done = _bounded(self._synchronize, _UNMAP_WAIT)
        if self._last:
            rt.eventDestroy(self._last)
            self._last = 0
        for side in self._sides:
            if done:
                rt.streamSynchronize(side)  # a memset and a word write: they end
            rt.streamDestroy(side)
        self._sides.clear()
        if not done:
            log.warning(
                "cuda_ipc: queued work still uses the windows of peer %d after %.0f s; "
                "they stay mapped until the process exits",
                self._conn.peer,
                _UNMAP_WAIT,
            )
            self._maps.clear()
            self._dev = 0
        for base in self._maps.values():
            rt.ipcCloseMemHandle(base)
        self._maps.clear()
        if self._dev:
            host_unmap(self._host)
            self._dev = 0


def _reached(word: int, seq: int) -> bool:
    """Whether the 32-bit word a stream or host writes (``seq`` mod 2**32, only
    growing) has reached ``seq``, as ``cuStreamWaitValue32``'s GEQ compares."""
    return (word - seq) & 0xFFFFFFFF < 0x80000000


def _settled(rt: object, event: int, seconds: float, every: Any = None) -> bool:
    """Whether ``event`` completes within ``seconds`` (polled, backing off);
    ``every()``, if given, is called meanwhile once a watchdog period."""
    now = time.monotonic()
    end, look = now + seconds, now
    bo = Backoff()
    while now < end:
        if rt.eventQuery(event) == 0:  # type: ignore[attr-defined]
            return True
        if every is not None and now >= look:
            look = now + watchdog.PERIOD
            every()
        bo.pause()
        now = time.monotonic()
    return False


def _bounded(call: Any, seconds: float) -> bool:
    """Whether ``call()`` (a driver call that may block, such as a device
    synchronize) returns within ``seconds``; if not, it is left blocked on a
    daemon thread."""
    t = threading.Thread(target=call, name="pycoll-cuda-ipc-sync", daemon=True)
    t.start()
    t.join(seconds)
    return not t.is_alive()
