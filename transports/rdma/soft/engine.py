"""The emulated NIC of one soft context: a TCP listener and one progress thread.

Every socket is non-blocking.  The NIC's work (reading requests and responses,
writing payloads, timers) runs under :attr:`Engine.lock`, by whichever thread
gets there first:

* the *progress thread* sleeps in ``select`` (no spinning) and wakes for socket
  readiness, for timers (RNR back-off, connect retries) and for work queued by
  other threads through :meth:`Engine.call_soon` (a self-pipe);
* a *user thread* that posts a work request or polls an empty CQ runs the
  ready work itself (:meth:`Engine.progress`) when the lock is free.  A thread
  that is already polling needs no wake-up, so a small message costs no thread
  hand-off on either side (the wake-up of a parked thread costs tens of
  microseconds, and the GIL hand-off to a woken thread up to a switch
  interval).  When a user thread finds the lock taken, the work is queued for
  the progress thread as before.

Data moves straight between the sockets and the registered memory:
``sendmsg`` from the source range, ``recv_into`` the checked target range, so
the kernel does the only copies.
"""

from __future__ import annotations

import errno
import hashlib
import heapq
import hmac
import itertools
import logging
import os
import secrets
import selectors
import socket
import struct
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from transports.rdma.soft.device import Context

log = logging.getLogger(__name__)

# The handshake of every connection, as in the tcp transport: a real HCA needs
# no such proof (the fabric is the boundary), but the emulation listens on a TCP
# port anyone on the host can reach.
#   acceptor -> CHALLENGE: magic, version, 16 random bytes (fresh per connection)
#   connector -> HELLO: magic, version, destination QPN, source QPN, source GID,
#                source LID (its context's TCP port), HMAC-SHA256 under the
#                job's secret of the challenge and those fields (:func:`hello`)
#   acceptor -> ACK: magic, HMAC of the hello's MAC (:func:`ack`)
# The connector sends no request before a valid ACK (it knows it reached the
# job, not a squatter on the port); the acceptor binds the stream to the named
# QP only after a valid HELLO, so a hello recorded from an earlier connection
# fails the fresh challenge.  A stranger is dropped and never fails the job.
CHALLENGE = struct.Struct("<4sHxx16s")
CHALLENGE_MAGIC = b"pcsc"
HELLO_FIELDS = struct.Struct("<4sHxxII16sHxx")
HELLO = struct.Struct(HELLO_FIELDS.format + "32s")
HELLO_MAGIC = b"pcsr"
HELLO_VERSION = 3
ACK = struct.Struct("<4s32s")
ACK_MAGIC = b"pcsa"
#: How long either side of a handshake waits for the other's next message.
HANDSHAKE_SECONDS = 10.0
#: Handshakes a context serves at once; past that it drops the oldest one that
#: has been silent for :data:`PENDING_GRACE` seconds, or stops accepting (the
#: kernel's backlog holds the rest) until one is.  A peer answers a challenge in
#: milliseconds, so only idle strangers are dropped.
MAX_PENDING = 64
PENDING_GRACE = 1.0
#: Longest pause of the listener when accept() runs out of descriptors (EMFILE).
ACCEPT_BACKOFF_MAX = 1.0
#: At most one log line per this many seconds about strangers (the rest are counted).
LOG_EVERY = 5.0


def hello(
    secret: bytes, challenge: bytes, dst_qpn: int, src_qpn: int, src_gid: bytes, src_lid: int
) -> bytes:
    """The HELLO a QP answers ``challenge`` with, proving that it holds the job's secret.

    The MAC covers the acceptor's fresh challenge (so it cannot be replayed) and
    the fields (so it binds one QP pair).
    """
    fields = HELLO_FIELDS.pack(HELLO_MAGIC, HELLO_VERSION, dst_qpn, src_qpn, src_gid, src_lid)
    mac = hmac.new(secret, b"pycoll-soft-rdma-hello\0" + challenge + fields, hashlib.sha256)
    return fields + mac.digest()


def ack(secret: bytes, hello_mac: bytes) -> bytes:
    """The acceptor's ACK of a HELLO whose MAC is ``hello_mac``."""
    mac = hmac.new(secret, b"pycoll-soft-rdma-ack\0" + hello_mac, hashlib.sha256)
    return ACK.pack(ACK_MAGIC, mac.digest())


class Throttle:
    """A logger call that speaks at most once per ``every`` seconds and counts the rest."""

    def __init__(self, every: float = LOG_EVERY) -> None:
        self.every = every
        self._next = 0.0
        self._quiet = 0

    def __call__(self, level: int, msg: str, *args: object) -> None:
        now = time.monotonic()
        if now < self._next:
            self._quiet += 1
            return
        if self._quiet:
            msg += " (and %d more since the last such message)"
            args = (*args, self._quiet)
        self._quiet = 0
        self._next = now + self.every
        log.log(level, msg, *args)


#: How long a user thread's poll keeps the progress thread off the sockets.
POLL_LEASE = 1e-3
#: How long closing a stream may wait to send what is already queued on it.
CLOSE_FLUSH = 0.5
#: How long a user thread waits for the lock while the progress thread holds it.
#: Waiting (rather than trying and spinning on) releases the GIL, which that
#: thread may need to finish: a spinning caller would make it wait for the
#: interpreter's switch interval (5 ms) while it holds the lock.
USER_LOCK_WAIT = 5e-3

_EMPTY = memoryview(bytearray(0))
_SCRATCH = memoryview(bytearray(1 << 18))  # discarded payloads land here (progress thread only)


class LinkOwner(Protocol):
    def on_link_lost(self, link: Link, exc: BaseException | None) -> None: ...

    def after_read(self) -> None: ...


class Link:
    """One TCP stream with a queue of outgoing buffers and one pending read target."""

    def __init__(
        self,
        engine: Engine,
        sock: socket.socket,
        owner: LinkOwner | None,
        connecting: bool = False,
    ) -> None:
        sock.setblocking(False)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.engine = engine
        self.sock = sock
        self.owner = owner
        self.connecting = connecting
        self.closed = False
        self.paused = False
        self.established = not connecting
        self.draining = False  # after an error: discard input, send only what is queued
        self._out: deque[memoryview] = deque()
        self._rx: memoryview | None = None
        self._rx_pos = 0
        self._rx_done: Callable[[], None] | None = None
        self._mask = 0
        engine.links.add(self)
        self._update_mask()

    # ------------------------------------------------------------------ reading
    def expect(self, view: memoryview, done: Callable[[], None]) -> None:
        """Fill ``view`` from the stream, then call ``done`` (which sets the next target)."""
        self._rx = view
        self._rx_pos = 0
        self._rx_done = done

    def discard(self, n: int, done: Callable[[], None]) -> None:
        """Read and drop ``n`` bytes, then call ``done``."""
        if n <= 0:
            self.expect(_EMPTY, done)
            return
        chunk = min(n, len(_SCRATCH))
        self.expect(_SCRATCH[:chunk], lambda: self.discard(n - chunk, done))

    def pause(self) -> None:
        self.paused = True
        self._update_mask()

    def resume(self) -> None:
        self.paused = False
        self._update_mask()
        self.engine.call_soon(self._read)

    def _read(self) -> None:
        for _ in range(256):
            rx = self._rx
            if rx is None or self.paused or self.closed:
                break
            if self._rx_pos < len(rx):
                try:
                    n = self.sock.recv_into(rx[self._rx_pos :])
                except (BlockingIOError, InterruptedError):
                    break
                except OSError as exc:
                    self.lost(exc)
                    return
                if n == 0:
                    self.lost(None)
                    return
                self._rx_pos += n
                if self._rx_pos < len(rx):
                    continue
            done = self._rx_done
            self._rx = None
            assert done is not None
            done()
        if self.owner is not None and not self.closed:
            self.owner.after_read()

    # ------------------------------------------------------------------ writing
    def send(self, *bufs: bytes | bytearray | memoryview) -> None:
        if self.closed:
            return
        for b in bufs:
            if len(b):
                self._out.append(b if isinstance(b, memoryview) else memoryview(b))
        if not self.connecting:
            self._flush()

    def _flush(self) -> None:
        out = self._out
        while out:
            try:
                n = self.sock.sendmsg(list(itertools.islice(out, 64)))
            except (BlockingIOError, InterruptedError):
                break
            except OSError as exc:
                self.lost(exc)
                return
            while n:
                head = out[0]
                if n >= len(head):
                    n -= len(head)
                    out.popleft()
                else:
                    out[0] = head[n:]
                    n = 0
        self._update_mask()

    # ------------------------------------------------------------------ events
    def _on_event(self, mask: int) -> None:
        if self.closed:  # a readiness event that outlived its socket (two threads select)
            return
        if self.connecting:
            err = self.sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
            if err:
                self.lost(OSError(err, os.strerror(err)))
                return
            self.connecting = False
            self.established = True
        if mask & selectors.EVENT_WRITE:
            self._flush()
        if mask & selectors.EVENT_READ and not self.closed:
            self._read()

    def _update_mask(self) -> None:
        if self.closed:
            return
        if self.connecting:
            want = selectors.EVENT_WRITE
        else:
            want = (0 if self.paused else selectors.EVENT_READ) | (
                selectors.EVENT_WRITE if self._out else 0
            )
        if want == self._mask:
            return
        sel = self.engine.sel
        if self._mask == 0:
            sel.register(self.sock, want, self._on_event)
        elif want == 0:
            sel.unregister(self.sock)
        else:
            sel.modify(self.sock, want, self._on_event)
        self._mask = want

    # ------------------------------------------------------------------ ending
    def finish(self) -> None:
        """Quiesce after a QP error: flush what is queued (a NAK), then discard all input.

        The stream stays open, as a QP in ERR stays silent on the wire: the peer
        learns of the error from that NAK, or when this QP is destroyed.
        """
        if self.closed or self.draining:
            return
        self.draining = True
        self.owner = None
        self.paused = False

        def sink() -> None:
            self.discard(len(_SCRATCH), sink)

        sink()
        self._flush()

    def lost(self, exc: BaseException | None) -> None:
        owner = self.owner
        self.close(flush=False)
        if owner is not None:
            owner.on_link_lost(self, exc)

    def close(self, flush: bool = True) -> None:
        """Close the stream.  What is already queued (typically the ACK of the last
        request, generated before the QP was destroyed) is still sent, waiting at
        most :data:`CLOSE_FLUSH` seconds, as a NIC transmits what it has generated."""
        if self.closed:
            return
        self.closed = True
        if self._mask:
            try:
                self.engine.sel.unregister(self.sock)
            except (KeyError, ValueError):
                pass
        self._mask = 0
        if flush and self._out and not self.connecting:
            try:
                self.sock.settimeout(CLOSE_FLUSH)
                for buf in self._out:
                    self.sock.sendall(buf)
            except OSError:
                pass
        self._out.clear()
        self.engine.links.discard(self)
        self.sock.close()


class Engine:
    """Listener, selector, timers and the progress thread of one :class:`Context`."""

    def __init__(self, ctx: Context) -> None:
        self.ctx = ctx
        #: held by whichever thread runs the NIC's work (see the module docstring)
        self.lock = threading.RLock()
        self._runner: threading.Thread | None = None
        self._lease = 0.0  # until when a polling user thread runs the NIC's work
        self.sel = selectors.DefaultSelector()
        self.links: set[Link] = set()
        self.listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.listener.bind((ctx.addr, 0))
        self.listener.listen(256)
        self.listener.setblocking(False)
        self.port: int = self.listener.getsockname()[1]
        self._rwake, self._wwake = os.pipe()
        os.set_blocking(self._rwake, False)
        os.set_blocking(self._wwake, False)
        self._wake_flag = False
        self._calls: deque[Callable[[], None]] = deque()
        self._timers: list[tuple[float, int, Callable[[], None]]] = []
        self._seq = itertools.count()
        self._closed = False
        self.sel.register(self.listener, selectors.EVENT_READ, self._on_accept)
        self._accepting = True
        self._accept_backoff = 0.0
        #: handshakes being served, oldest first (see :data:`MAX_PENDING`)
        self.greeters: dict[_Greeter, None] = {}
        self.strangers = Throttle()  # the log of dropped connections and accept errors
        self.sel.register(self._rwake, selectors.EVENT_READ, self._on_wake)
        self._thread = threading.Thread(
            target=self._run, name=f"pycoll-soft-rdma:{self.port}", daemon=True
        )
        self._thread.start()

    # ----------------------------------------------------------------- scheduling
    def in_thread(self) -> bool:
        """True when the calling thread is running the NIC's work right now."""
        return self._runner is threading.current_thread()

    def call_soon(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` as NIC work (from any thread), in order with earlier calls.

        Inside NIC work the call is queued and runs before that work returns;
        from a user thread it runs at once when the lock is free, else the
        progress thread is woken for it.
        """
        self._calls.append(fn)
        if self.in_thread():
            return
        if self._closed or not self.lock.acquire(timeout=USER_LOCK_WAIT):
            self._wake()
            return
        try:
            self._enter()
            self._drain()
        finally:
            self._leave()

    def call_later(self, delay: float, fn: Callable[[], None]) -> None:
        """Run ``fn`` as NIC work after ``delay`` seconds (from NIC work only)."""
        heapq.heappush(self._timers, (time.monotonic() + delay, next(self._seq), fn))
        if threading.current_thread() is not self._thread:
            self._wake()  # the progress thread must recompute its select timeout

    def progress(self) -> None:
        """Run whatever is ready (socket events, queued calls, due timers) in the
        calling thread; return when another thread is at it for long."""
        if self._closed or not self.lock.acquire(timeout=USER_LOCK_WAIT):
            return
        try:
            self._enter()
            self._lease = time.monotonic() + POLL_LEASE
            self._dispatch(self.sel.select(0))
        except OSError:  # a descriptor closed under us during shutdown
            if not self._closed:
                raise
        finally:
            self._leave()

    def wait(self, timeout: float, ready: Callable[[], bool]) -> None:
        """Block up to ``timeout`` seconds for NIC events, running them in the calling
        thread; return early once something happened.  ``ready()`` (checked with
        the lock held) says there is already something to take."""
        if self._closed:
            time.sleep(timeout)
            return
        if not self.lock.acquire(timeout=min(timeout, USER_LOCK_WAIT)):
            return  # another thread runs the NIC's work; that wait was the nap
        try:
            self._enter()
            self._lease = time.monotonic() + timeout + POLL_LEASE
            events = self.sel.select(0)
            if not events and not self._calls and not ready():
                events = self.sel.select(timeout)
            self._dispatch(events)
        except OSError:  # a descriptor closed under us during shutdown
            if not self._closed:
                raise
        finally:
            self._leave()

    def connect(self, host: str, port: int, owner: LinkOwner) -> Link:
        """Start a non-blocking connect (the owner then runs the handshake)."""
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setblocking(False)
        rc = sock.connect_ex((host, port))
        if rc not in (0, errno.EINPROGRESS):
            link = Link(self, sock, owner, connecting=False)
            self.call_soon(lambda: link.lost(OSError(rc, os.strerror(rc))))
            return link
        return Link(self, sock, owner, connecting=rc != 0)

    # ----------------------------------------------------------------- running
    def _enter(self) -> None:
        """Called with the lock just taken."""
        self._runner = threading.current_thread()

    def _leave(self) -> None:
        self._runner = None
        self.lock.release()
        if self._calls and not self._closed:
            self._wake()  # queued by a thread that found the lock taken just now

    def _wake(self) -> None:
        if self._wake_flag or self._closed:
            return
        self._wake_flag = True
        try:
            os.write(self._wwake, b"\0")
        except (BlockingIOError, OSError):
            pass

    def _dispatch(self, events: list[tuple[selectors.SelectorKey, int]]) -> None:
        """Handle ``events``, then queued calls and due timers (lock held)."""
        for key, mask in events:
            if self._closed:
                return
            self._guard(key.data, mask)
        self._drain()

    def _drain(self) -> None:
        """Run queued calls, and timers as they fall due (lock held)."""
        calls, timers = self._calls, self._timers
        while not self._closed:
            if calls:
                self._guard(calls.popleft())
            elif timers and timers[0][0] <= time.monotonic():
                self._guard(heapq.heappop(timers)[2])
            else:
                return

    def _run(self) -> None:
        # While a user thread is polling (its lease is fresh), it runs the NIC's
        # work itself: this thread then watches only the wake-up pipe and the
        # timers, and never waits for the lock, because holding it while waiting
        # for the GIL that a spinning poller holds would stall that poller.
        quiet = selectors.DefaultSelector()
        quiet.register(self._rwake, selectors.EVENT_READ, self._on_wake)
        try:
            while not self._closed:
                now = time.monotonic()
                lease = self._lease - now
                if self._calls:
                    timeout = 0.0
                elif self._timers:
                    timeout = min(1.0, max(0.0, self._timers[0][0] - now))
                else:
                    timeout = 1.0
                try:
                    if lease > 0 and timeout > 0:
                        if quiet.select(min(lease, timeout)):
                            self._on_wake(0)
                        events = []
                    else:
                        events = self.sel.select(timeout)
                except OSError:  # a descriptor closed under us during shutdown
                    if self._closed:
                        break
                    raise
                if not events and not self._calls and not self._due():
                    continue
                if self._lease > time.monotonic():
                    if not self.lock.acquire(blocking=False):
                        # the poller holds the lock and runs the queued work itself
                        if quiet.select(max(0.0, min(self._lease - time.monotonic(), POLL_LEASE))):
                            self._on_wake(0)
                        continue
                else:
                    self.lock.acquire()
                try:
                    self._enter()
                    self._dispatch(events)
                finally:
                    self._runner = None
                    self.lock.release()
        finally:
            quiet.close()

    def _due(self) -> bool:
        return bool(self._timers) and self._timers[0][0] <= time.monotonic()

    def _guard(self, fn: Callable[..., None], *args: object) -> None:
        try:
            fn(*args)
        except Exception:  # a bug must not kill the NIC silently: log it, keep serving
            log.exception("soft RDMA progress thread: unexpected error")

    def _on_wake(self, _mask: int) -> None:
        # Drain first, then clear the flag: a wake-up written in between stays in
        # the pipe, and the queued call is run by this same loop iteration.
        try:
            while os.read(self._rwake, 4096):
                pass
        except (BlockingIOError, OSError):
            pass
        self._wake_flag = False

    def _on_accept(self, _mask: int) -> None:
        while self._accepting:
            if len(self.greeters) >= MAX_PENDING and not self._drop_stale():
                oldest = next(iter(self.greeters))
                self._pause_accept(oldest.born + PENDING_GRACE - time.monotonic())
                return
            try:
                sock, addr = self.listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                # Out of descriptors (EMFILE...): a busy loop on a listener that stays
                # readable would only log; free a stale handshake and pause instead.
                self._drop_stale()
                self._accept_backoff = min(ACCEPT_BACKOFF_MAX, max(0.01, 2 * self._accept_backoff))
                self.strangers(
                    logging.WARNING,
                    "soft RDMA: accept on port %d failed (%s); pausing it %.2f s",
                    self.port,
                    exc,
                    self._accept_backoff,
                )
                self._pause_accept(self._accept_backoff)
                return
            self._accept_backoff = 0.0
            _Greeter(self, sock, f"{addr[0]}:{addr[1]}")

    def _drop_stale(self) -> bool:
        """Drop the oldest handshake if it has been silent for PENDING_GRACE seconds."""
        oldest = next(iter(self.greeters), None)
        if oldest is None or time.monotonic() - oldest.born < PENDING_GRACE:
            return False
        oldest.drop(f"silent for {PENDING_GRACE:g} s while {MAX_PENDING} handshakes wait")
        return True

    def _pause_accept(self, seconds: float) -> None:
        if self._accepting:
            self._accepting = False
            self.sel.unregister(self.listener)
        self.call_later(max(0.01, seconds), self._resume_accept)

    def _resume_accept(self) -> None:
        if not self._accepting and not self._closed:
            self._accepting = True
            self.sel.register(self.listener, selectors.EVENT_READ, self._on_accept)

    # ----------------------------------------------------------------- closing
    def close(self) -> None:
        """Stop the progress thread and close every socket: peers see the port go away."""
        if self._closed:
            return
        self._closed = True
        try:
            os.write(self._wwake, b"\0")
        except OSError:
            pass
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout=10)
        with self.lock:
            for link in list(self.links):  # registered or not (parked, paused)
                link.close()
            self.links.clear()
            self.listener.close()
            self.sel.close()
            os.close(self._rwake)
            os.close(self._wwake)
            self._calls.clear()
            self._timers.clear()


class _Greeter:
    """Serves the handshake of an accepted connection, then hands it to the named QP."""

    def __init__(self, engine: Engine, sock: socket.socket, peer: str) -> None:
        self.engine = engine
        self.peer = peer
        self.born = time.monotonic()
        self.nonce = secrets.token_bytes(16)
        self.buf = bytearray(HELLO.size)
        engine.greeters[self] = None
        self.link = Link(engine, sock, self)
        self.link.expect(memoryview(self.buf), self._on_hello)
        self.link.send(CHALLENGE.pack(CHALLENGE_MAGIC, HELLO_VERSION, self.nonce))
        engine.call_later(HANDSHAKE_SECONDS, self._expire)

    def _on_hello(self) -> None:
        eng = self.engine
        eng.greeters.pop(self, None)
        magic, version, dst_qpn, src_qpn, src_gid, src_lid, tag = HELLO.unpack(self.buf)
        if magic != HELLO_MAGIC or version != HELLO_VERSION:
            self.drop(f"not a soft RDMA hello (magic {bytes(magic)!r}, version {version})")
            return
        want = hello(eng.ctx.secret, self.nonce, dst_qpn, src_qpn, bytes(src_gid), src_lid)
        if not hmac.compare_digest(bytes(tag), want[-32:]):
            self.drop(
                f"its hello for QP {dst_qpn:#x} does not answer the challenge under the job's secret"
            )
            return
        qp = eng.ctx.qps.get(dst_qpn)
        if qp is None:
            self.drop(f"no QP {dst_qpn:#x} here", logging.DEBUG)
            return
        self.link.send(ack(eng.ctx.secret, bytes(tag)))
        if self.link.closed:
            return
        self.link.owner = None
        self.link.pause()
        qp._attach_inbound(self.link, src_qpn, bytes(src_gid), src_lid)  # type: ignore[attr-defined]

    def _expire(self) -> None:
        if self in self.engine.greeters:
            self.drop(f"no hello within {HANDSHAKE_SECONDS:g} s")

    def drop(self, why: str, level: int = logging.WARNING) -> None:
        self.engine.greeters.pop(self, None)
        self.engine.strangers(
            level,
            "soft RDMA: dropping a connection from %s to port %d: %s",
            self.peer,
            self.engine.port,
            why,
        )
        self.link.owner = None
        self.link.close(flush=False)  # a stranger that reads nothing must not hold us up

    def on_link_lost(self, link: Link, exc: BaseException | None) -> None:
        self.engine.greeters.pop(self, None)

    def after_read(self) -> None:
        pass
