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
:class:`_Window`): descriptors in the host segment, ordering through device words
written and waited on by the streams themselves, so the host never waits.

Completion is observed by polling events from the host: a request is done when
its bytes were copied (send) or consumed by the sink's queued work (receive).
CUDA is reached through CuPy's runtime API and the driver library, both loaded
lazily (:mod:`transports.cuda_driver`).
"""

from __future__ import annotations

import logging
import mmap
import os
import secrets
import struct
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from typing import Any

from transports import _atomic, _exit, _segment
from transports.base import (
    PIECE_ALIGN,
    Backoff,
    BlobError,
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
    Transport,
    TransportError,
    TransportOptions,
    TransportTimeout,
)
from transports.cuda_driver import export, on_device, runtime, stream_wait, stream_write

log = logging.getLogger(__name__)

NAME = "cuda_ipc"
SHM_DIR = _segment.SHM_DIR
_MAGIC = 0x70636F6C6C697063  # "pcollipc"
_VERSION = 3
_HDR = struct.Struct("<IIQ")  # at 8: version, nslots, slot_bytes
# per side (0 = creator = lower rank): pid, ready flag, ipc handle, raw pointer
_SIDE_OFF = (256, 512)
_SIDE = struct.Struct("<Q8x64sQ")  # pid, (ready is a counter at +8), handle, ptr
_CLOSED_OFF = (1024, 1152)
_CTRL0 = 4096
_CTRL_SIZE = 2048
# one-sided windows, per side (written by that side): the host's exposed and
# released counts, then one descriptor per window slot
_WIN_OFF = (8192, 12288)
_WIN_SLOTS = 4
_W_EXPOSED, _W_RELEASED, _W_DESC = 0, 128, 1024
_W_DESC_BYTES = 512
_W_MAX_SPANS = 4
_W_SPAN = struct.Struct("<64sQQQ")  # handle, offset in the allocation, nbytes, raw pointer
_SEG_BYTES = 16384
_MAX_SLOTS = (_CTRL_SIZE - 256) // 8
_BLOB = struct.Struct("<4sHH16sQQQQQ16sQ")
_BLOB_TAG = b"PCIP"
_NOT_READY = 600  # cudaErrorNotReady
_D2D = 3  # cudaMemcpyDeviceToDevice
_DEFAULT = 4  # cudaMemcpyDefault (unified addressing: across GPUs too)
_IPC_LAZY_PEER = 1  # cudaIpcMemLazyEnablePeerAccess
_EVENT_FLAGS = 0x2  # cudaEventDisableTiming (blocking sync off: we poll)
_FLAG_BYTES = 256  # device words after the ring: "exposed" at +0, "released" at +128
_OPEN_CACHE = 32  # peer allocations kept mapped per connection


class _Identity:
    """Same host (boot id), same IPC namespace and /dev/shm, and which GPU (PCI bus id)."""

    __slots__ = ("boot", "bus", "dirfd", "ipc_ns", "pid", "pid_ns", "rank", "shm_dev", "token")

    def __init__(self, rank: int, token: bytes, bus: bytes) -> None:
        self.rank = rank
        self.token = token
        self.boot = _segment.boot_id()
        self.ipc_ns = _segment.ns_inode("ipc")
        self.pid_ns = _segment.ns_inode("pid")
        self.shm_dev = _segment.shm_device()
        self.pid = os.getpid()
        self.bus = bus
        self.dirfd = 0  # this rank's segment directory (transports._segment.Directory)

    def pack(self) -> bytes:
        return _BLOB.pack(
            _BLOB_TAG,
            _VERSION,
            0,
            self.boot,
            int.from_bytes(self.token, "little"),
            self.ipc_ns,
            self.pid_ns,
            self.shm_dev,
            (self.rank << 32) | self.pid,
            self.bus.ljust(16, b"\0")[:16],
            self.dirfd,
        )

    @classmethod
    def unpack(cls, blob: bytes) -> _Identity:
        if len(blob) != _BLOB.size:
            raise BlobError(f"cuda_ipc endpoint blob has {len(blob)} bytes, expected {_BLOB.size}")
        tag, ver, _, boot, token, ipc, pidns, dev, rp, bus, dirfd = _BLOB.unpack(blob)
        if tag != _BLOB_TAG or ver != _VERSION:
            raise BlobError(f"not a cuda_ipc endpoint blob (tag {tag!r}, version {ver})")
        self = cls.__new__(cls)
        self.boot, self.ipc_ns, self.pid_ns, self.shm_dev = boot, ipc, pidns, dev
        self.token = token.to_bytes(8, "little")
        self.rank, self.pid = rp >> 32, rp & 0xFFFFFFFF
        self.bus = bus.rstrip(b"\0")
        self.dirfd = dirfd
        return self


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


class CudaIpcTransport(Transport):
    """Connections that move device memory through CUDA IPC between ranks of one host.

    The device is the current CUDA device when the transport is created (set it
    before ``pycoll.init``).  Slots are ``options.slot_bytes`` (at least 64 KiB).

    Raises:
        ImportError: CuPy is not installed.
        TransportError: no CUDA device is visible.
    """

    name = NAME

    def __init__(self, options: TransportOptions) -> None:
        super().__init__(options)
        rt = runtime()
        try:
            count = rt.getDeviceCount()
        except Exception as exc:
            raise TransportError(f"cuda_ipc: no CUDA device ({exc})", transport=NAME) from exc
        if count < 1:
            raise TransportError("cuda_ipc: no CUDA device", transport=NAME)
        self._rt = rt
        self.device = int(rt.getDevice())
        self._me = _Identity(options.rank, secrets.token_bytes(8), _bus_id(rt, self.device))
        self.nslots = min(_MAX_SLOTS, max(2, options.nslots))
        self.slot_bytes = max(1 << 16, -(-options.slot_bytes // 4096) * 4096)
        self._conns: list[CudaIpcConnection] = []
        self._dir: _segment.Directory | None = None
        self._handles: list[int] = []  # descriptors of the segments made here (see _segment)

    def listen(self) -> bytes:
        if self._dir is None:
            self._dir = _segment.Directory(self.options.size, self._me.token, NAME)
            self._me.dirfd = self._dir.fd
        return self._me.pack()

    def can_connect(self, local: bytes, peer: bytes) -> tuple[bool, str]:
        a, b = _Identity.unpack(local), _Identity.unpack(peer)
        ok, why = _atomic.available()
        if not ok:
            return False, why
        ok, why = _segment.shared_memory_verdict(a, b)
        if not ok:
            return False, why
        if a.bus == b.bus:
            return True, f"same host and GPU ({a.bus.decode()})"
        try:
            other = int(self._rt.deviceGetByPCIBusId(b.bus.decode()))
        except Exception:
            return False, f"the peer's GPU {b.bus.decode()} is not visible here"
        if not self._rt.deviceCanAccessPeer(self.device, other):
            return False, f"no peer access from GPU {a.bus.decode()} to {b.bus.decode()}"
        return True, f"same host, peer access {a.bus.decode()} -> {b.bus.decode()}"

    def connect(self, peer_rank: int, peer: bytes) -> Connection:
        other = _Identity.unpack(peer)
        if other.rank != peer_rank:
            raise BlobError(f"cuda_ipc blob for rank {peer_rank} says rank {other.rank}")
        me = self._me
        lo, hi = (me, other) if me.rank < other.rank else (other, me)
        name = f"cuda_ipc {lo.rank}-{hi.rank}"
        ident = lo.token + struct.pack("<II", lo.rank, hi.rank)
        creator = me is lo
        if self._dir is None:
            self.listen()
        assert self._dir is not None
        fd = -1
        if creator:
            mm, fd = self._create(ident, peer_rank)
        else:
            mm = self._attach(other, ident, peer_rank)
        try:
            conn = CudaIpcConnection(
                mm, name, creator, peer_rank, self.device, other.pid, self.options.timeout
            )
        except BaseException as exc:
            mm.close()
            if fd >= 0:
                os.close(fd)
            if isinstance(exc, TransportError) or not isinstance(exc, Exception):
                raise
            raise ConnectError(
                f"cuda_ipc: setting up device memory for peer {peer_rank}: {exc}",
                peer=peer_rank,
                transport=NAME,
            ) from exc
        if creator:
            self._handles.append(fd)
            self._dir.publish(peer_rank, fd)  # last: the peer trusts what it then finds
        if me.bus == other.bus:
            conn.caps |= Cap.SAME_DEVICE  # several ranks sharing one GPU
        self._conns.append(conn)
        log.debug("cuda_ipc: rank %d <-> %d over %s", me.rank, peer_rank, name)
        return conn

    def _create(self, ident: bytes, peer: int) -> tuple[mmap.mmap, int]:
        mm, fd = _segment.create(_SEG_BYTES, ident=ident, peer=peer, transport=NAME)
        _HDR.pack_into(mm, 8, _VERSION, self.nslots, self.slot_bytes)
        struct.pack_into("<Q", mm, 0, _MAGIC)  # last: the attacher checks it
        return mm, fd

    def _attach(self, lo: _Identity, ident: bytes, peer: int) -> mmap.mmap:
        timeout = self.options.timeout
        handle = _segment.find(
            lo.pid,
            lo.dirfd,
            lo.token,
            self._me.rank,
            peer=peer,
            transport=NAME,
            deadline=Deadline.after(timeout),
            timeout=timeout,
        )
        mm = _segment.attach(
            lo.pid,
            handle,
            magic=_MAGIC,
            ident=ident,
            min_size=_SEG_BYTES,
            peer=peer,
            transport=NAME,
        )
        ver, nslots, slot_bytes = _HDR.unpack_from(mm, 8)
        if ver != _VERSION or not 2 <= nslots <= _MAX_SLOTS or slot_bytes % 4096:
            mm.close()
            raise ConnectError(
                f"cuda_ipc: the segment of rank {peer} has version {ver} and geometry "
                f"{nslots}x{slot_bytes}: ranks run different pycoll versions?",
                peer=peer,
                transport=NAME,
            )
        return mm

    def close(self) -> None:
        for c in self._conns:
            c.close()
        self._conns.clear()
        for fd in self._handles:
            os.close(fd)
        self._handles.clear()
        if self._dir is not None:
            self._dir.close()
            self._dir = None


def _bus_id(rt: Any, dev: int) -> bytes:
    """The GPU's PCI bus id (the same in every process, whatever CUDA_VISIBLE_DEVICES says)."""
    try:
        bus = rt.deviceGetPCIBusId(dev)
    except AttributeError:
        import cupy

        bus = cupy.cuda.Device(dev).pci_bus_id
    return str(bus).lower().encode()[:16]


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
            # the ring, then the window flags (see _Window) in the same allocation
            self._ring = int(rt.malloc(self.nslots * self.slot_bytes + _FLAG_BYTES))
            rt.memset(self._ring + self.nslots * self.slot_bytes, 0, _FLAG_BYTES)
            try:
                handle = rt.ipcGetMemHandle(self._ring)
            except BaseException:
                rt.free(self._ring)
                self._ring = 0
                raise
        _SIDE.pack_into(mm, _SIDE_OFF[self._side], os.getpid(), handle, self._ring)
        self._win = _Window(self, mm)
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
    def isend_device(self, data: DeviceSpan) -> Request:
        self._check_open()
        if data.nbytes == 0:
            return DoneRequest(self.peer)
        if not self._peer_opened:
            self._open_peer()
        req = _IpcSend(self, data)
        self._to_issue.append(req)
        return req

    def irecv_device(self, nbytes: int, sink: DeviceSink, device: int) -> Request:
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
        req = _IpcRecv(self, nbytes, sink)
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
            struct.pack_into("<Q", self._mm, self._out.meta_off + 8 * slot, n)
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
                (n,) = struct.unpack_from("<Q", self._mm, self._in.meta_off + 8 * slot)
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
    def expose(self, spans: Sequence[DeviceSpan], stream: int, deadline: Deadline) -> None:
        self._check_open()
        self._win.expose(spans, stream, deadline)

    def open_window(self, stream: int, deadline: Deadline) -> list[DeviceSpan]:
        self._check_open()
        if not self._peer_opened:
            self._open_peer()
        return self._win.open(stream, deadline)

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

    def mark_exiting(self) -> None:
        """At interpreter exit without close(): the peer sees "closed" (:mod:`transports._exit`)."""
        if not self._closed:
            self._closed_me.store(1)

    def _check_open(self) -> None:
        if self._closed:
            raise TransportError(
                f"cuda_ipc connection to peer {self.peer} is closed", peer=self.peer, transport=NAME
            )

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        _exit.forget(self)
        try:
            self._closed_me.store(1)
        except ValueError:
            pass
        rt = self._rt
        try:
            with on_device(self.device):
                for ev, *_ in list(self._sinking):
                    rt.eventSynchronize(ev)
                for _, ev, *_ in list(self._copying):
                    rt.eventSynchronize(ev)
                self._win.close()
                if self._peer_ipc:
                    rt.ipcCloseMemHandle(self._peer_ring)
                if self._ring:
                    rt.free(self._ring)
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


_F_EXPOSED, _F_RELEASED = 0, 128


def _ipc_open(handle: bytes, peer: int, what: str, error: type[TransportError]) -> int:
    """Map a peer's allocation (``cudaIpcOpenMemHandle``) on the current device."""
    try:
        return int(runtime().ipcOpenMemHandle(handle, _IPC_LAZY_PEER))
    except Exception as exc:
        raise error(
            f"cuda_ipc: cannot open peer {peer}'s {what}: {exc}", peer=peer, transport=NAME
        ) from exc


class _IpcSend(QueuedRequest):
    def __init__(self, conn: CudaIpcConnection, span: DeviceSpan) -> None:
        super().__init__(conn, conn._progress_sends)
        self.span = span
        self.issued = 0
        self.published = 0


class _IpcRecv(QueuedRequest):
    def __init__(self, conn: CudaIpcConnection, nbytes: int, sink: DeviceSink) -> None:
        super().__init__(conn, conn._progress_recvs)
        self.nbytes = nbytes
        self.sink: Callable[[int, DeviceSpan], None] = sink
        self.handed = 0
        self.done_bytes = 0


assert PIECE_ALIGN <= 4096
