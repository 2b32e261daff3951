"""The cuda_ipc data path: a ring of device slots per direction, host-side flow control.

See :mod:`transports.cuda_ipc` for the protocol; :class:`CudaIpcConnection`
also holds the one-sided windows (:mod:`~transports.cuda_ipc.windows`).
"""

from __future__ import annotations

import logging
import mmap
import os
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

from transports import _atomic, _exit, _segment
from transports.base import (
    PIECE_ALIGN,
    Backoff,
    Cap,
    ConnectError,
    Connection,
    Deadline,
    DeviceSink,
    DeviceSpan,
    DoneRequest,
    QueuedRequest,
    Request,
    Sink,
    TransportError,
    tag_mismatch,
)
from transports.cuda_driver import on_device, runtime
from transports.cuda_ipc.layout import (
    _CLOSED_OFF,
    _CTRL0,
    _CTRL_SIZE,
    _HDR,
    _META,
    _SIDE,
    _SIDE_OFF,
    NAME,
    _ipc_open,
)
from transports.cuda_ipc.windows import _UNMAP_WAIT, _settled, _Window

log = logging.getLogger(__name__)

_NOT_READY = 600  # cudaErrorNotReady
_DEFAULT = 4  # cudaMemcpyDefault (unified addressing: across GPUs too)
_EVENT_FLAGS = 0x2  # cudaEventDisableTiming (blocking sync off: we poll)


class _Events:
    """A free list of CUDA events (creating one costs more than recording it)."""

    def __init__(self, rt: Any) -> None:
        self._rt = rt
        self._free: list[int] = []
        self._all: list[int] = []

    def get(self) -> int:
        if self._free:
            return self._free.pop()
        ev = int(self._rt.eventCreateWithFlags(_EVENT_FLAGS))
        self._all.append(ev)
        return ev

    def put(self, ev: int) -> None:
        self._free.append(ev)

    def close(self) -> None:
        for ev in self._all:
            try:
                self._rt.eventDestroy(ev)
            except Exception:  # the context may already be gone at exit
                pass
        self._all.clear()
        self._free.clear()


class _Dir:
    """Counters and per-slot lengths of one direction in the control segment."""

    __slots__ = ("head", "meta_off", "tail")

    def __init__(self, mm: mmap.mmap, d: int) -> None:
        ctrl = _CTRL0 + d * _CTRL_SIZE
        self.head = _atomic.Counter(mm, ctrl)
        self.tail = _atomic.Counter(mm, ctrl + 128)
        self.meta_off = ctrl + 256


class CudaIpcConnection(Connection):
    """One pair of device rings plus host-side flow control; see the module docstring."""

    transport = NAME
    #: and Cap.SAME_DEVICE where both ends use one GPU (known once connected)
    caps = Cap.DEVICE | Cap.ONE_SIDED | Cap.SINK_STREAM

    def __init__(
        self,
        mm: mmap.mmap,
        name: str,
        creator: bool,
        peer: int,
        device: int,
        peer_pid: int,
        timeout: float,
    ) -> None:
        self.peer = peer
        self.device = device
        self._mm = mm
        self._name = name
        self._creator = creator
        self._side = 0 if creator else 1
        self._peer_pid = peer_pid
        self._timeout = timeout
        self._closed = False
        _, self.nslots, self.slot_bytes = _HDR.unpack_from(mm, 8)
        out_d, in_d = (0, 1) if creator else (1, 0)
        self._out = _Dir(mm, out_d)
        self._in = _Dir(mm, in_d)
        self._peer_ready = _atomic.Counter(mm, _SIDE_OFF[1 - self._side] + 8)
        self._closed_peer = _atomic.Counter(mm, _CLOSED_OFF[1 - self._side])
        self._closed_me = _atomic.Counter(mm, _CLOSED_OFF[self._side])
        rt = runtime()
        self._rt = rt
        self._events = _Events(rt)
        self._ring = 0  # my incoming ring (device memory I own)
        self._peer_ring = 0  # the peer's incoming ring, opened on first send
        self._peer_opened = False
        self._peer_ipc = False  # opened through ipcOpenMemHandle (closed on close())
        # the stream the receive sinks' work goes on (set_sink_stream); 0 until
        # then means a stream of our own
        self._sink_stream = 0
        self._own_stream = 0
        with on_device(device):
            self._ring = int(rt.malloc(self.nslots * self.slot_bytes))
            try:
                handle = rt.ipcGetMemHandle(self._ring)
            except BaseException:
                rt.free(self._ring)
                self._ring = 0
                raise
        _SIDE.pack_into(mm, _SIDE_OFF[self._side], os.getpid(), handle, self._ring)
        try:
            self._win = _Window(self, mm)
        except BaseException:
            with on_device(device):
                rt.free(self._ring)
            self._ring = 0
            raise
        _atomic.Counter(mm, _SIDE_OFF[self._side] + 8).store(1)
        # sender state
        self._issued = 0  # slots whose copy was enqueued
        self._sent = 0  # slots published (head)
        self._to_issue: deque[_IpcSend] = deque()
        self._copying: deque[tuple[int, int, int, _IpcSend]] = deque()  # slot, event, n, req
        # receiver state
        self._consumed = 0  # slots handed to a sink
        self._recvd = 0  # slots released (tail)
        self._to_sink: deque[_IpcRecv] = deque()
        self._sinking: deque[tuple[int, int, _IpcRecv]] = deque()  # event, n, req
        _exit.watch(self)

    # ------------------------------------------------------------------ host memory
    def isend(self, data: memoryview, tag: int = 0) -> Request:
        raise TransportError(
            "cuda_ipc moves device memory only; host buffers use shm",
            peer=self.peer,
            transport=NAME,
        )

    def irecv(self, nbytes: int, sink: Sink, tag: int = 0) -> Request:
        raise TransportError(
            "cuda_ipc moves device memory only; host buffers use shm",
            peer=self.peer,
            transport=NAME,
        )

    # ------------------------------------------------------------------ posting
    def isend_device(self, data: DeviceSpan, tag: int = 0) -> Request:
        self._check_open()
        if data.nbytes == 0:
            return DoneRequest(self.peer)
        if not self._peer_opened:
            self._open_peer()
        req = _IpcSend(self, data, tag)
        self._to_issue.append(req)
        return req

    def irecv_device(self, nbytes: int, sink: DeviceSink, device: int, tag: int = 0) -> Request:
        self._check_open()
        if nbytes == 0:
            return DoneRequest(self.peer)
        if device != self.device:
            raise TransportError(
                f"cuda_ipc: receive on cuda:{device} but the connection's ring is on "
                f"cuda:{self.device}",
                peer=self.peer,
                transport=NAME,
            )
        req = _IpcRecv(self, nbytes, sink, tag)
        self._to_sink.append(req)
        return req

    def _open_peer(self) -> None:
        """Open the peer's incoming ring (once; cached for the connection's life)."""
        deadline = Deadline.after(self._timeout)
        bo = Backoff(spins=0, yields=16)
        while not self._peer_ready.load():
            self.check_peer()
            if deadline.expired():
                raise ConnectError(
                    f"cuda_ipc: peer {self.peer} never published its ring",
                    peer=self.peer,
                    transport=NAME,
                )
            bo.pause()
        pid, handle, ptr = _SIDE.unpack_from(self._mm, _SIDE_OFF[1 - self._side])
        if pid == os.getpid():
            # both ends in one process (tests): IPC handles cannot be opened here
            self._peer_ring = ptr
        else:
            with on_device(self.device):
                self._peer_ring = _ipc_open(handle, self.peer, "memory handle", ConnectError)
            self._peer_ipc = True
        self._peer_opened = True

    def set_sink_stream(self, stream: int) -> None:
        """Run receive sinks on ``stream`` (a stream of :attr:`device`)."""
        self._sink_stream = stream

    def _stream(self) -> int:
        if self._sink_stream:
            return self._sink_stream
        if not self._own_stream:
            with on_device(self.device):
                self._own_stream = int(self._rt.streamCreateWithFlags(1))  # non-blocking
        return self._own_stream

    # ------------------------------------------------------------------ progress
    def _progress_sends(self) -> None:
        rt = self._rt
        ns, sb = self.nslots, self.slot_bytes
        # 1. enqueue copies into free slots, in order
        q = self._to_issue
        if q:
            tail = self._out.tail.load()
            while q and self._issued - tail < ns:
                req = q[0]
                src = req.span
                n = min(sb, src.nbytes - req.issued)
                slot = self._issued % ns
                rt.memcpyAsync(
                    self._peer_ring + slot * sb, src.ptr + req.issued, n, _DEFAULT, src.stream
                )
                ev = self._events.get()
                rt.eventRecord(ev, src.stream)
                self._copying.append((slot, ev, n, req))
                self._issued += 1
                req.issued += n
                if req.issued >= src.nbytes:
                    q.popleft()
        # 2. publish finished copies, in order
        c = self._copying
        while c:
            slot, ev, n, req = c[0]
            if rt.eventQuery(ev) == _NOT_READY:
                return
            _META.pack_into(self._mm, self._out.meta_off + _META.size * slot, n, req.tag)
            self._sent += 1
            self._out.head.store(self._sent)
            c.popleft()
            self._events.put(ev)
            req.published += n
            if req.published >= req.span.nbytes:
                req._done = True

    def _progress_recvs(self) -> None:
        rt = self._rt
        ns, sb = self.nslots, self.slot_bytes
        # 1. hand arrived slots to their sinks, in order
        q = self._to_sink
        if q:
            head = self._in.head.load()
            stream = self._stream()
            while q and self._consumed < head:
                req = q[0]
                slot = self._consumed % ns
                n, tag = _META.unpack_from(self._mm, self._in.meta_off + _META.size * slot)
                if tag != req.tag:
                    raise tag_mismatch(NAME, self.peer, tag, req.tag)
                want = min(sb, req.nbytes - req.handed)
                if n != want:
                    raise TransportError(
                        f"cuda_ipc: peer {self.peer} sent a {n}-byte piece where {want} were "
                        "expected (mismatched messages: do both ranks run the same collective?)",
                        peer=self.peer,
                        transport=NAME,
                    )
                req.sink(req.handed, DeviceSpan(self._ring + slot * sb, n, self.device, stream))
                ev = self._events.get()
                rt.eventRecord(ev, stream)
                self._sinking.append((ev, n, req))
                self._consumed += 1
                req.handed += n
                if req.handed >= req.nbytes:
                    q.popleft()
        # 2. release slots whose queued work finished, in order
        s = self._sinking
        while s:
            ev, n, req = s[0]
            if rt.eventQuery(ev) == _NOT_READY:
                return
            self._recvd += 1
            self._in.tail.store(self._recvd)
            s.popleft()
            self._events.put(ev)
            req.done_bytes += n
            if req.done_bytes >= req.nbytes:
                req._done = True

    # ------------------------------------------------------------------ one-sided
    def expose(
        self, spans: Sequence[DeviceSpan], stream: int, deadline: Deadline, tag: int = 0
    ) -> None:
        self._check_open()
        self._win.expose(spans, stream, deadline, tag)

    def open_window(self, stream: int, deadline: Deadline, tag: int = 0) -> list[DeviceSpan]:
        self._check_open()
        if not self._peer_opened:
            self._open_peer()
        return self._win.open(stream, deadline, tag)

    def release(self, stream: int) -> None:
        self._check_open()
        self._win.release(stream)

    def wait_released(self, stream: int, deadline: Deadline) -> None:
        self._check_open()
        self._win.wait_released(stream, deadline)

    # ------------------------------------------------------------------ health
    def check_peer(self) -> None:
        if self._closed:
            return
        _segment.check_alive(
            self._closed_peer,
            self._peer_pid,
            f"cuda_ipc: peer {self.peer}",
            peer=self.peer,
            transport=NAME,
        )

    def stream_failure(self) -> TransportError | None:
        return self._win.abandoned

    def announce_close(self, cause: int | None = None) -> None:
        if not self._closed:
            self._say_closed(cause)

    def mark_exiting(self) -> None:
        """At interpreter exit without close(): the peer sees "closed" (:mod:`transports._exit`)."""
        if not self._closed:
            self._say_closed(None)

    def _say_closed(self, cause: int | None) -> None:
        """Our "closed" word, once: a close announced with its cause keeps it."""
        if not self._closed_me.load():
            self._closed_me.store(_segment.closed_word(cause))

    def _check_open(self) -> None:
        if self._closed:
            raise TransportError(
                f"cuda_ipc connection to peer {self.peer} is closed", peer=self.peer, transport=NAME
            )
        if self._win.abandoned is not None:  # the watchdog let a stream of ours go
            raise self._win.abandoned

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        _exit.forget(self)
        try:
            self._say_closed(None)
        except ValueError:
            pass
        rt = self._rt
        try:
            with on_device(self.device):
                self._win.close()  # first: it lets go of streams that wait on the peer
                events = [ev for ev, *_ in self._sinking] + [ev for _, ev, *_ in self._copying]
                # copies in flight end, unless their stream waits on a peer that
                # is alive and late: then the ring stays mapped until exit
                if all(_settled(rt, ev, _UNMAP_WAIT) for ev in events):
                    if self._peer_ipc:
                        rt.ipcCloseMemHandle(self._peer_ring)
                    if self._ring:
                        rt.free(self._ring)
                else:
                    log.warning(
                        "cuda_ipc: copies to or from peer %d still queued after %.0f s; "
                        "the rings stay mapped until the process exits",
                        self.peer,
                        _UNMAP_WAIT,
                    )
                if self._own_stream:
                    rt.streamDestroy(self._own_stream)
                self._events.close()
        except Exception as exc:  # a dying context: the process exit frees it all
            log.debug("cuda_ipc: releasing device memory for peer %d: %s", self.peer, exc)
        self._ring = self._peer_ring = self._own_stream = 0
        self._to_issue.clear()
        self._copying.clear()
        self._to_sink.clear()
        self._sinking.clear()
        for ctr in (
            self._out.head,
            self._out.tail,
            self._in.head,
            self._in.tail,
            self._peer_ready,
            self._closed_peer,
            self._closed_me,
            *self._win.counters(),
        ):
            ctr.release_buffer()
        try:
            self._mm.close()
        except BufferError:
            log.warning("cuda_ipc: segment %s still has views; not unmapped", self._name)


class _IpcSend(QueuedRequest):
    def __init__(self, conn: CudaIpcConnection, span: DeviceSpan, tag: int) -> None:
        super().__init__(conn, conn._progress_sends)
        self.span = span
        self.tag = tag
        self.issued = 0
        self.published = 0


class _IpcRecv(QueuedRequest):
    def __init__(self, conn: CudaIpcConnection, nbytes: int, sink: DeviceSink, tag: int) -> None:
        super().__init__(conn, conn._progress_recvs)
        self.nbytes = nbytes
        self.tag = tag
        self.sink: Callable[[int, DeviceSpan], None] = sink
        self.handed = 0
        self.done_bytes = 0


assert PIECE_ALIGN <= 4096
