"""Host staging of device bytes for connections that cannot move GPU memory
(shm, tcp, rdma:host): pinned double buffers and a three-stage pipeline.

A message of N bytes is cut into pieces of :func:`piece_bytes` (both ends cut
the same way, from the same configuration), each sent as its own transport
message:

    send:  D2H copy of piece k into pinned buffer k % 2  ->  isend(buffer)
    recv:  irecv into pinned buffer k % 2  ->  H2D copy (or H2D into a device
           scratch and a reduction kernel ``out = local OP incoming``)

Messages on a connection are matched in the order they are posted, so the
pieces of two requests to one peer must not interleave: requests of one
direction of one connection form a *lane*, and only the request at the head of
its lane posts transport messages; it leaves the lane once it has posted its
last piece (completion may come later).

With two buffers per request, the D2H copy of piece k+1 runs while piece k is on
the wire, and the H2D copy of piece k while piece k+1 arrives; a buffer is
reused only once the event recorded after its copy has completed; the host
observes completion by polling events.  H2D copies and reductions go on the
collective's stream.  D2H copies go on a second stream, so that a rank's copies
in the two directions overlap (PCIe carries both at once: on an H200, 50.3 and
48.1 GB/s together, against 51.7 for one alone).  Each D2H copy first waits for
the collective's stream (what it reads was written there), and a write on the
collective's stream first waits for every D2H copy still reading the bytes it
overwrites (:meth:`Pinned.before_write`).

Where the connection has a shared send buffer (:meth:`Connection.send_buffer`:
shm), no CPU touches the bytes.  The sender's two pinned buffers are that
buffer, registered with CUDA, and only the head of the lane holds them; the
receiver registers the peer's buffer and its sink copies each piece to the
device straight out of it, waiting for that copy before it returns (the sender
reuses the buffer once the sink has returned).  This matters for speed: on an
H200 a host-to-device copy of 4 MiB that a CPU has just written runs at 42-43
GB/s, against 52 GB/s when a device-to-host copy wrote it (modified cache lines
slow the GPU's reads), and the CPU copy itself ran at a few GB/s.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Any

import numpy as np

from transports.base import Cap, Connection, Request

_NOT_READY = 600  # cudaErrorNotReady
_D2H, _H2D = 2, 1  # cudaMemcpyDeviceToHost, cudaMemcpyHostToDevice
_DEPTH = 2  # pinned buffers per request


def piece_bytes(chunk_bytes: int) -> int:
    """The staging piece for a device chunk size: a quarter chunk, 64 KiB..4 MiB.

    A pinned copy has a fixed cost of several microseconds, so small pieces copy
    well below the link's rate: with the default 16 MiB chunk, 1 MiB pieces ran
    their D2H and H2D copies at 20-27 GB/s on an H200 whose pinned copies reach
    55 GB/s, 4 MiB pieces at 43-50 GB/s; 8 MiB pieces were no better, and 16 MiB
    pieces made the whole collective slower (less overlap between the copies and
    the wire).  Each piece is also one copy or kernel that ranks sharing a GPU
    may wait a time slice for, another reason not to cut messages finer.
    """
    p = min(4 << 20, max(64 << 10, chunk_bytes // 4))
    return p - p % 64


def _pieces(nbytes: int, piece: int) -> list[tuple[int, int]]:
    return [(o, min(piece, nbytes - o)) for o in range(0, nbytes, piece)]


class LegStats:
    """Device time of every staging copy, per leg (opt-in, for benchmarks).

    ``Pinned.legs = LegStats()`` makes every D2H and H2D copy of the pipeline
    record a pair of timing events around it; :meth:`rates` then gives each leg's
    bytes per second of copy time, to compare with a plain pinned copy.
    """

    def __init__(self) -> None:
        import cupy

        self._rt = cupy.cuda.runtime
        self._pending: list[tuple[str, int, int, int]] = []  # leg, start, end, bytes
        self.bytes = {"d2h": 0, "h2d": 0}
        self.seconds = {"d2h": 0.0, "h2d": 0.0}

    def start(self, stream: int) -> int:
        ev = int(self._rt.eventCreate())
        self._rt.eventRecord(ev, stream)
        return ev

    def stop(self, leg: str, start: int, nbytes: int, stream: int) -> None:
        ev = int(self._rt.eventCreate())
        self._rt.eventRecord(ev, stream)
        self._pending.append((leg, start, ev, nbytes))

    def rates(self) -> dict[str, float]:
        """GB/s of copy time per leg, over every copy recorded so far."""
        rt = self._rt
        for leg, a, b, n in self._pending:
            rt.eventSynchronize(b)
            self.seconds[leg] += rt.eventElapsedTime(a, b) * 1e-3
            self.bytes[leg] += n
            rt.eventDestroy(a)
            rt.eventDestroy(b)
        self._pending.clear()
        return {k: self.bytes[k] / self.seconds[k] / 1e9 for k in self.bytes if self.seconds[k]}


class _SharedSend:
    """A connection's shared send buffer cut into ``_DEPTH`` registered pieces."""

    def __init__(self, conn: Connection, piece: int, buf: np.ndarray) -> None:
        self.conn = conn  # (keeps the id used as its key alive)
        self.piece = piece
        self.free: list[tuple[Any, np.ndarray]] = [
            (None, buf[i * piece : (i + 1) * piece]) for i in range(_DEPTH)
        ]
        self.holders: list[StagedSend] = []  # requests with pieces of it in flight


class Pinned:
    """Pinned host buffers and events, reused across requests of one communicator."""

    def __init__(self, device: int) -> None:
        import cupy

        self._cp = cupy
        self._rt = cupy.cuda.runtime
        self._device = device
        self._side: Any = None  # the stream of D2H copies
        self._reading: dict[int, tuple[int, int]] = {}  # D2H event: device bytes it reads
        self._bufs: dict[int, list[tuple[Any, np.ndarray]]] = {}
        self._events: list[int] = []
        self._lanes: dict[tuple[int, str], deque[Request]] = {}
        self._shared: dict[int, _SharedSend | None] = {}  # by id(conn)
        self._peer_bufs: dict[int, tuple[Connection, int, int]] = {}  # id(conn): start, end
        self._registered: list[int] = []  # host addresses registered with CUDA
        self.legs: LegStats | None = None

    def copy(self, leg: str, dst: int, src: int, nbytes: int, kind: int, stream: int) -> None:
        """``cudaMemcpyAsync`` on ``stream``; timed into :attr:`legs` when that is set."""
        legs = self.legs
        t0 = legs.start(stream) if legs else 0
        self._rt.memcpyAsync(dst, src, nbytes, kind, stream)
        if legs:
            legs.stop(leg, t0, nbytes, stream)

    def d2h(self, dst: int, src: int, nbytes: int, stream: int) -> int:
        """Copy ``nbytes`` of device memory at ``src`` to pinned ``dst`` on the D2H
        stream, after the work queued on ``stream`` so far; returns the event
        recorded after the copy (give it back with :meth:`read_done`)."""
        rt = self._rt
        if self._side is None:
            with self._cp.cuda.Device(self._device):
                self._side = self._cp.cuda.Stream(non_blocking=True)
        side = self._side.ptr
        dep = self.event()
        rt.eventRecord(dep, stream)
        rt.streamWaitEvent(side, dep, 0)
        self.put_event(dep)  # (a wait holds the record it saw, not later ones)
        self.copy("d2h", dst, src, nbytes, _D2H, side)
        ev = self.event()
        rt.eventRecord(ev, side)
        self._reading[ev] = (src, src + nbytes)
        return ev

    def read_done(self, ev: int) -> None:
        """The D2H copy of event ``ev`` has completed: recycle the event."""
        del self._reading[ev]
        self.put_event(ev)

    def before_write(self, ptr: int, nbytes: int, stream: int) -> None:
        """Make ``stream`` wait for the D2H copies that still read device bytes in
        ``[ptr, ptr + nbytes)``."""
        end = ptr + nbytes
        for ev, (lo, hi) in self._reading.items():
            if lo < end and ptr < hi:
                self._rt.streamWaitEvent(stream, ev, 0)

    def lane(self, conn: Connection, direction: str) -> deque[Request]:
        """The FIFO of staged requests posting on ``conn`` in ``direction`` ("s"/"r")."""
        return self._lanes.setdefault((id(conn), direction), deque())

    def get(self, nbytes: int) -> tuple[Any, np.ndarray]:
        free = self._bufs.setdefault(nbytes, [])
        if free:
            return free.pop()
        mem = self._cp.cuda.alloc_pinned_memory(nbytes)
        return mem, np.frombuffer(mem, np.uint8, nbytes)

    def put(self, nbytes: int, buf: tuple[Any, np.ndarray]) -> None:
        self._bufs[nbytes].append(buf)

    def shared_send(self, conn: Connection, piece: int) -> _SharedSend | None:
        """``conn``'s shared send buffer as pinned pieces, or None (no such
        buffer, or one cut for another piece size)."""
        key = id(conn)
        if key not in self._shared:
            buf = conn.send_buffer(_DEPTH * piece)
            if buf is not None:
                self._register(buf)
            self._shared[key] = None if buf is None else _SharedSend(conn, piece, buf)
        sh = self._shared[key]
        return sh if sh is not None and sh.piece == piece else None

    def device_readable(self, conn: Connection, ptr: int, nbytes: int) -> bool:
        """Whether ``[ptr, ptr + nbytes)`` lies in ``conn``'s peer's shared send
        buffer, which a device copy reads at full speed (registered here once)."""
        have = self._peer_bufs.get(id(conn))
        if have is None:
            buf = conn.recv_buffer()
            if buf is None:
                return False
            lo = self._register(buf)
            self._peer_bufs[id(conn)] = have = (conn, lo, lo + buf.nbytes)
        return have[1] <= ptr and ptr + nbytes <= have[2]

    def _register(self, buf: np.ndarray) -> int:
        ptr = int(buf.__array_interface__["data"][0])
        self._rt.hostRegister(ptr, buf.nbytes, 0)
        self._registered.append(ptr)
        return ptr

    def event(self) -> int:
        if self._events:
            return self._events.pop()
        return int(self._rt.eventCreateWithFlags(0x2))

    def put_event(self, ev: int) -> None:
        self._events.append(ev)

    def close(self) -> None:
        self._events.extend(self._reading)  # (D2H copies of requests that failed)
        self._reading.clear()
        self._side = None
        for ev in self._events:
            try:
                self._rt.eventDestroy(ev)
            except Exception:
                pass
        self._events.clear()
        self._bufs.clear()
        self._lanes.clear()
        # before the transports unmap them: drop our views, unregister
        for sh in self._shared.values():
            if sh is not None:
                sh.free.clear()  # (a finished request may still point at it)
                sh.holders.clear()
        self._shared.clear()
        self._peer_bufs.clear()
        for ptr in self._registered:
            try:
                self._rt.hostUnregister(ptr)
            except Exception:
                pass
        self._registered.clear()


class StagedSend(Request):
    """Send device bytes ``[ptr, ptr + nbytes)`` through a host connection."""

    def __init__(
        self,
        conn: Connection,
        ptr: int,
        nbytes: int,
        piece: int,
        stream: int,
        pool: Pinned,
        tag: int = 0,
    ) -> None:
        self.conn = conn
        self.peer = conn.peer
        self._tag = tag  # every piece's, as the call's messages carry (pycoll.guard)
        self._rt = pool._rt
        self._ptr = ptr
        self._stream = stream
        self._pool = pool
        self._todo = deque(_pieces(nbytes, piece))
        self._piece = piece
        # in flight, in order: [offset, n, buffer, event or None, send request or None]
        self._flight: deque[list[Any]] = deque()
        self._spare: list[tuple[Any, np.ndarray]] = []
        self._shared = pool.shared_send(conn, piece)
        self._lane = pool.lane(conn, "s")
        self._lane.append(self)
        self._posted = 0
        self._npieces = len(self._todo)

    def _progress(self) -> bool:
        lane = self._lane
        if lane and lane[0] is not self:
            lane[0].test()  # progress the lane like a connection progresses its queue
        while self._round():
            pass
        if self._todo or self._flight:
            return False
        for b in self._spare:
            self._pool.put(self._piece, b)
        self._spare.clear()
        return True

    def _round(self) -> bool:
        """One pass over the pipeline; True when a buffer was freed for more work."""
        rt = self._rt
        # 1. start D2H copies while a pinned buffer is free
        while self._todo and len(self._flight) < _DEPTH:
            buf = self._take()
            if buf is None:
                break
            off, n = self._todo.popleft()
            ev = self._pool.d2h(buf[1].ctypes.data, self._ptr + off, n, self._stream)
            self._flight.append([off, n, buf, ev, None])
        # 2. post sends in order once copied (at the head of the lane only);
        # 3. free buffers once sent
        for item in self._flight:
            off, n, buf, ev, req = item
            if req is None:
                if not self._lane or self._lane[0] is not self:
                    break
                if rt.eventQuery(ev) == _NOT_READY:
                    break
                self._pool.read_done(ev)
                item[3] = None
                item[4] = self.conn.isend(memoryview(buf[1][:n]), self._tag)  # type: ignore[arg-type]
                self._posted += 1
                if self._posted == self._npieces:
                    self._lane.popleft()
        return self._reap() and bool(self._todo)

    def _take(self) -> tuple[Any, np.ndarray] | None:
        """A pinned buffer for the next piece, or None for now."""
        sh = self._shared
        if sh is None:
            return self._spare.pop() if self._spare else self._pool.get(self._piece)
        # Only the head of the lane may hold the connection's buffers: a later
        # request holding them would wait for the head, which waits for them.
        if not self._lane or self._lane[0] is not self:
            return None
        if not sh.free:
            for h in list(sh.holders):
                h._reap()  # earlier requests, out of the lane, whose sends may be done
            if not sh.free:
                return None
        if self not in sh.holders:
            sh.holders.append(self)
        return sh.free.pop()

    def _reap(self) -> bool:
        """Free the buffers of the leading pieces that are sent; True if any were."""
        freed = False
        while self._flight:
            item = self._flight[0]
            if item[4] is None or not item[4].test():
                break
            self._flight.popleft()
            (self._shared.free if self._shared else self._spare).append(item[2])
            freed = True
        if self._shared and not self._flight and self in self._shared.holders:
            self._shared.holders.remove(self)
        return freed

    def check_peer(self) -> None:
        self.conn.check_peer()


class StagedRecv(Request):
    """Receive into device bytes, or reduce ``out = local OP incoming`` on device.

    Args:
        out: CuPy 1-D array (the destination).
        local: CuPy array of the same size for a reduction, or None for a copy.
        reduce: ``f(a, b, out=c)`` on device (with ``local``).
        incoming_first: compute ``incoming OP local`` instead.
    """

    def __init__(
        self,
        conn: Connection,
        out: Any,
        local: Any,
        reduce: Callable[..., Any] | None,
        piece: int,
        stream: Any,
        pool: Pinned,
        incoming_first: bool = False,
        tag: int = 0,
    ) -> None:
        self.conn = conn
        self.peer = conn.peer
        self._tag = tag  # what every piece must carry: the sender's call's
        self._rt = pool._rt
        self._out = out
        self._local = local
        self._reduce = reduce
        self._first = incoming_first
        self._stream = stream  # a CuPy stream object
        self._pool = pool
        self._piece = piece
        self._todo = deque(_pieces(out.nbytes, piece))
        self._flight: deque[list[Any]] = deque()  # [off, n, buf, recv req, event or None]
        self._spare: list[tuple[Any, np.ndarray]] = []
        self._scratch: Any = None
        self._isz = out.dtype.itemsize
        self._optr = int(out.data.ptr)
        # the peer may send from its shared buffer: take pieces in place (see module)
        self._in_place = Cap.SHARED_SEND_BUFFERS in conn.caps
        self._lane = pool.lane(conn, "r")
        self._lane.append(self)

    def _post(self) -> None:
        if not self._todo or self._lane[0] is not self:
            return  # all posted (and out of the lane), or not our turn yet
        while self._todo and len(self._flight) < _DEPTH:
            off, n = self._todo.popleft()
            if self._in_place:
                req = self.conn.irecv(n, self._sink(off), self._tag)
                self._flight.append([off, n, None, req, None])
            else:
                buf = self._spare.pop() if self._spare else self._pool.get(self._piece)
                req = self.conn.irecv_into(memoryview(buf[1][:n]), self._tag)  # type: ignore[arg-type]
                self._flight.append([off, n, buf, req, None])
            if not self._todo:
                self._lane.popleft()

    def _sink(self, off: int) -> Callable[[int, memoryview], None]:
        def sink(at: int, view: memoryview) -> None:
            self._drain(off + at, view)

        return sink

    def _drain(self, off: int, view: memoryview) -> None:
        """Copy (or reduce) the bytes of ``view`` to ``off`` on the device and wait
        for the copy: the sender reuses that memory once we return."""
        src = np.frombuffer(view, np.uint8)
        n = src.nbytes
        ptr = int(src.__array_interface__["data"][0])
        tmp = None
        if not self._pool.device_readable(self.conn, ptr, n):
            # a slot or a cross-memory read: through a pinned buffer, as without sharing
            tmp = self._pool.get(self._piece)
            tmp[1][:n] = src
            ptr = tmp[1].ctypes.data
        ev = self._pool.event()
        self._put_piece(off, n, ptr, ev)
        self._rt.eventSynchronize(ev)
        self._pool.put_event(ev)
        if tmp is not None:
            self._pool.put(self._piece, tmp)

    def _progress(self) -> bool:
        lane = self._lane
        if lane and lane[0] is not self:
            lane[0].test()  # progress the lane like a connection progresses its queue
        while self._round():
            pass
        if self._todo or self._flight:
            return False
        for b in self._spare:
            self._pool.put(self._piece, b)
        self._spare.clear()
        self._scratch = None
        return True

    def _round(self) -> bool:
        """One pass over the pipeline; True when a buffer was freed for more work."""
        rt = self._rt
        self._post()
        if self._in_place:  # each piece was copied (and waited for) by its sink
            done = False
            while self._flight and self._flight[0][3].test():
                self._flight.popleft()
                done = True
            return done and bool(self._todo)
        sptr = self._stream.ptr
        for item in self._flight:
            off, n, buf, req, ev = item
            if ev is not None:
                continue
            if not req.test():
                break
            self._put_piece(off, n, buf[1].ctypes.data)
            ev = self._pool.event()
            rt.eventRecord(ev, sptr)
            item[4] = ev
        freed = False
        while self._flight:
            item = self._flight[0]
            ev = item[4]
            if ev is None or rt.eventQuery(ev) == _NOT_READY:
                break
            self._pool.put_event(ev)
            self._flight.popleft()
            self._spare.append(item[2])
            freed = True
        return freed and bool(self._todo)

    def _put_piece(self, off: int, n: int, host: int, copied: int = 0) -> None:
        """Copy the ``n`` bytes at ``host`` to ``out[off:]``, or reduce them into
        it; records event ``copied`` (when not 0) once the bytes at ``host`` are
        copied to the device (before a reduction kernel)."""
        if self._local is not None:
            self._reduce_piece(off, n, host, copied)
            return
        sptr = self._stream.ptr
        self._pool.before_write(self._optr + off, n, sptr)
        self._pool.copy("h2d", self._optr + off, host, n, _H2D, sptr)
        if copied:
            self._rt.eventRecord(copied, sptr)

    def _reduce_piece(self, off: int, n: int, host: int, copied: int = 0) -> None:
        """H2D of the ``n`` bytes at ``host`` into a device scratch, then the
        reduction kernel into ``out[off:]``; records event ``copied`` (when not 0)
        between the two."""
        import cupy

        isz = self._isz
        if self._scratch is None:
            # one device scratch per pinned buffer: a kernel may still read the other
            k = min(self._piece, self._out.nbytes) // isz
            self._scratch = [cupy.empty(k, self._out.dtype) for _ in range(_DEPTH)]
            self._turn = 0
        sc = self._scratch[self._turn][: n // isz]
        self._turn = (self._turn + 1) % _DEPTH
        self._pool.copy("h2d", int(sc.data.ptr), host, n, _H2D, self._stream.ptr)
        if copied:
            self._rt.eventRecord(copied, self._stream.ptr)
        i, j = off // isz, (off + n) // isz
        assert self._reduce is not None
        self._pool.before_write(self._optr + off, n, self._stream.ptr)
        with self._stream:
            if self._first:
                self._reduce(sc, self._local[i:j], out=self._out[i:j])
            else:
                self._reduce(self._local[i:j], sc, out=self._out[i:j])

    def check_peer(self) -> None:
        self.conn.check_peer()
