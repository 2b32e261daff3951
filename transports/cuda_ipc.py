"""CUDA IPC transport: GPU memory between processes on one host (one GPU or several).

A device-capable connection (:attr:`Connection.device_capable`): it moves device
memory only (:meth:`~CudaIpcConnection.isend_device` /
:meth:`~CudaIpcConnection.irecv_device`); host buffers keep using shm.

Per pair of ranks:

* each rank ``cudaMalloc``\\ s a ring of ``nslots`` device slots for its
  *incoming* direction and exports it with ``cudaIpcGetMemHandle``;
* a small host segment ``/dev/shm/pycoll-<token>-ipc-<lo>-<hi>`` (mode 0600,
  created by the lower rank, unlinked as soon as the higher rank attached)
  holds both rings' handles and the flow-control counters, as in
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

Completion is observed by polling events from the host: a request is done when
its bytes were copied (send) or consumed by the sink's queued work (receive).
CUDA is reached through CuPy's runtime API, imported lazily.
"""

from __future__ import annotations

import logging
import mmap
import os
import secrets
import struct
from collections import deque
from collections.abc import Callable
from typing import Any

from transports import _atomic, _segment
from transports.base import (
    PIECE_ALIGN,
    Backoff,
    BlobError,
    ConnectError,
    Connection,
    Deadline,
    DeviceSink,
    DeviceSpan,
    DoneRequest,
    PeerClosedError,
    Request,
    Sink,
    Transport,
    TransportError,
    TransportOptions,
)

log = logging.getLogger(__name__)

NAME = "cuda_ipc"
SHM_DIR = _segment.SHM_DIR
_MAGIC = 0x70636F6C6C697063  # "pcollipc"
_VERSION = 1
_HDR = struct.Struct("<IIQ")  # at 8: version, nslots, slot_bytes
# per side (0 = creator = lower rank): pid, ready flag, ipc handle, raw pointer
_SIDE_OFF = (256, 512)
_SIDE = struct.Struct("<Q8x64sQ")  # pid, (ready is a counter at +8), handle, ptr
_CLOSED_OFF = (1024, 1152)
_CTRL0 = 4096
_CTRL_SIZE = 2048
_SEG_BYTES = 8192
_MAX_SLOTS = (_CTRL_SIZE - 256) // 8
_BLOB = struct.Struct("<4sHH16sQQQQQ16s")
_BLOB_TAG = b"PCIP"
_NOT_READY = 600  # cudaErrorNotReady
_D2D = 3  # cudaMemcpyDeviceToDevice
_DEFAULT = 4  # cudaMemcpyDefault (unified addressing: across GPUs too)
_IPC_LAZY_PEER = 1  # cudaIpcMemLazyEnablePeerAccess
_EVENT_FLAGS = 0x2  # cudaEventDisableTiming (blocking sync off: we poll)


def _cuda() -> Any:
    """CuPy's runtime module (imported on first use, never at import time)."""
    import cupy

    return cupy.cuda.runtime


class _Identity:
    """Same host (boot id), same IPC namespace and /dev/shm, and which GPU (PCI bus id)."""

    __slots__ = ("boot", "bus", "ipc_ns", "pid", "pid_ns", "rank", "shm_dev", "token")

    def __init__(self, rank: int, token: bytes, bus: bytes) -> None:
        self.rank = rank
        self.token = token
        self.boot = _segment.boot_id()
        self.ipc_ns = _segment.ns_inode("ipc")
        self.pid_ns = _segment.ns_inode("pid")
        self.shm_dev = _segment.shm_device()
        self.pid = os.getpid()
        self.bus = bus

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
        )

    @classmethod
    def unpack(cls, blob: bytes) -> _Identity:
        if len(blob) != _BLOB.size:
            raise BlobError(f"cuda_ipc endpoint blob has {len(blob)} bytes, expected {_BLOB.size}")
        tag, ver, _, boot, token, ipc, pidns, dev, rp, bus = _BLOB.unpack(blob)
        if tag != _BLOB_TAG or ver != _VERSION:
            raise BlobError(f"not a cuda_ipc endpoint blob (tag {tag!r}, version {ver})")
        self = cls.__new__(cls)
        self.boot, self.ipc_ns, self.pid_ns, self.shm_dev = boot, ipc, pidns, dev
        self.token = token.to_bytes(8, "little")
        self.rank, self.pid = rp >> 32, rp & 0xFFFFFFFF
        self.bus = bus.rstrip(b"\0")
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
        rt = _cuda()
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

    def listen(self) -> bytes:
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
        name = f"pycoll-{lo.token.hex()}-ipc-{lo.rank}-{hi.rank}"
        creator = me is lo
        deadline = Deadline.after(self.options.timeout)
        mm = self._create(name, peer_rank) if creator else self._attach(name, peer_rank, deadline)
        try:
            conn = CudaIpcConnection(
                mm,
                name,
                creator,
                peer_rank,
                self.device,
                other.pid if other.pid_ns == me.pid_ns else 0,
                self.options.timeout,
            )
        except BaseException as exc:
            mm.close()
            if creator:
                _segment.unlink(name)
            if isinstance(exc, TransportError) or not isinstance(exc, Exception):
                raise
            raise ConnectError(
                f"cuda_ipc: setting up device memory for peer {peer_rank}: {exc}",
                peer=peer_rank,
                transport=NAME,
            ) from exc
        self._conns.append(conn)
        log.debug("cuda_ipc: rank %d <-> %d over %s", me.rank, peer_rank, name)
        return conn

    def _create(self, name: str, peer: int) -> mmap.mmap:
        mm = _segment.create(name, _SEG_BYTES, peer=peer, transport=NAME)
        _HDR.pack_into(mm, 8, _VERSION, self.nslots, self.slot_bytes)
        struct.pack_into("<Q", mm, 0, _MAGIC)  # last: the attacher waits for it
        return mm

    def _attach(self, name: str, peer: int, deadline: Deadline) -> mmap.mmap:
        mm = _segment.attach(
            name,
            magic=_MAGIC,
            min_size=_SEG_BYTES,
            peer=peer,
            transport=NAME,
            deadline=deadline,
            timeout=self.options.timeout,
        )
        ver, nslots, slot_bytes = _HDR.unpack_from(mm, 8)
        if ver != _VERSION or not 2 <= nslots <= _MAX_SLOTS or slot_bytes % 4096:
            mm.close()
            raise ConnectError(
                f"cuda_ipc: segment {name} has version {ver} and geometry {nslots}x{slot_bytes}: "
                "ranks run different pycoll versions?",
                peer=peer,
                transport=NAME,
            )
        _segment.unlink(name)  # both sides attached: nothing outlives the job
        return mm

    def close(self) -> None:
        for c in self._conns:
            c.close()
        self._conns.clear()


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
    device_capable = True

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
        rt = _cuda()
        self._rt = rt
        self._events = _Events(rt)
        self._ring = 0  # my incoming ring (device memory I own)
        self._peer_ring = 0  # the peer's incoming ring, opened on first send
        self._peer_opened = False
        self._peer_ipc = False  # opened through ipcOpenMemHandle (closed on close())
        #: the stream the receive sinks' work goes on; the layer above may set it
        #: (it must be a stream of ``device``); 0 until then means a stream of our own.
        self.sink_stream = 0
        self._own_stream = 0
        with _on_device(device):
            self._ring = int(rt.malloc(self.nslots * self.slot_bytes))
            try:
                handle = rt.ipcGetMemHandle(self._ring)
            except BaseException:
                rt.free(self._ring)
                self._ring = 0
                raise
        _SIDE.pack_into(mm, _SIDE_OFF[self._side], os.getpid(), handle, self._ring)
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

    # ------------------------------------------------------------------ host memory
    def isend(self, data: memoryview) -> Request:
        raise TransportError(
            "cuda_ipc moves device memory only; host buffers use shm",
            peer=self.peer,
            transport=NAME,
        )

    def irecv(self, nbytes: int, sink: Sink) -> Request:
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
            try:
                with _on_device(self.device):
                    self._peer_ring = int(self._rt.ipcOpenMemHandle(handle, _IPC_LAZY_PEER))
                self._peer_ipc = True
            except Exception as exc:
                raise ConnectError(
                    f"cuda_ipc: cannot open peer {self.peer}'s memory handle: {exc}",
                    peer=self.peer,
                    transport=NAME,
                ) from exc
        self._peer_opened = True

    def _stream(self) -> int:
        if self.sink_stream:
            return self.sink_stream
        if not self._own_stream:
            with _on_device(self.device):
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

    # ------------------------------------------------------------------ health
    def check_peer(self) -> None:
        if self._closed:
            return
        if self._closed_peer.load():
            raise PeerClosedError(
                f"cuda_ipc: peer {self.peer} closed its connection", peer=self.peer, transport=NAME
            )
        pid = self._peer_pid
        if pid:
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                raise PeerClosedError(
                    f"cuda_ipc: peer {self.peer} (pid {pid}) has exited",
                    peer=self.peer,
                    transport=NAME,
                ) from None
            except PermissionError:
                pass

    def _check_open(self) -> None:
        if self._closed:
            raise TransportError(
                f"cuda_ipc connection to peer {self.peer} is closed", peer=self.peer, transport=NAME
            )

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self._closed_me.store(1)
        except ValueError:
            pass
        rt = self._rt
        try:
            with _on_device(self.device):
                for ev, *_ in list(self._sinking):
                    rt.eventSynchronize(ev)
                for _, ev, *_ in list(self._copying):
                    rt.eventSynchronize(ev)
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
        ):
            ctr.release_buffer()
        try:
            self._mm.close()
        except BufferError:
            log.warning("cuda_ipc: segment %s still has views; not unmapped", self._name)
        if self._creator:
            _segment.unlink(self._name)


class _on_device:
    """``with _on_device(d):`` makes CUDA device ``d`` current, then restores the old one."""

    __slots__ = ("_dev", "_old", "_rt")

    def __init__(self, dev: int) -> None:
        self._dev = dev
        self._rt = _cuda()
        self._old = -1

    def __enter__(self) -> None:
        self._old = int(self._rt.getDevice())
        if self._old != self._dev:
            self._rt.setDevice(self._dev)

    def __exit__(self, *exc: object) -> None:
        if self._old != self._dev:
            self._rt.setDevice(self._old)


class _IpcSend(Request):
    def __init__(self, conn: CudaIpcConnection, span: DeviceSpan) -> None:
        self.conn = conn
        self.peer = conn.peer
        self.span = span
        self.issued = 0
        self.published = 0

    def _progress(self) -> bool:
        self.conn._progress_sends()
        return self._done

    def check_peer(self) -> None:
        self.conn.check_peer()


class _IpcRecv(Request):
    def __init__(self, conn: CudaIpcConnection, nbytes: int, sink: DeviceSink) -> None:
        self.conn = conn
        self.peer = conn.peer
        self.nbytes = nbytes
        self.sink: Callable[[int, DeviceSpan], None] = sink
        self.handed = 0
        self.done_bytes = 0

    def _progress(self) -> bool:
        self.conn._progress_recvs()
        return self._done

    def check_peer(self) -> None:
        self.conn.check_peer()


assert PIECE_ALIGN <= 4096
