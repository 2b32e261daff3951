"""Security properties: private segments, authenticated peers, no unpickling."""

from __future__ import annotations

import logging
import os
import re
import socket
import stat
import struct
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from tests.inproc import communicators, run_ranks
from transports.base import TransportOptions
from transports.tcp import TcpTransport, decode_blob

pytestmark = pytest.mark.timeout(120)
ROOT = Path(__file__).resolve().parent.parent


def test_shm_segments_are_mode_0600_and_never_named(monkeypatch):
    from transports import _segment

    modes: list[int] = []
    real = _segment.create

    def spy(*args, **kw):  # type: ignore[no-untyped-def]
        mm, fd = real(*args, **kw)
        st = os.fstat(fd)
        modes.append(stat.S_IMODE(st.st_mode))
        assert st.st_nlink == 0, "a segment has a name"
        return mm, fd

    monkeypatch.setattr(_segment, "create", spy)
    before = {f for f in os.listdir("/dev/shm") if f.startswith("pycoll-")}
    old = os.umask(0)  # a permissive umask must not widen the mode
    try:
        with communicators(3, transports=("shm",), timeout=20) as comms:
            assert all(c.transport_of(p) == "shm" for c in comms for p in range(3) if p != c.rank)
            assert comms[0]._engine.group is not None  # the group segment too
            run_ranks(3, lambda r: comms[r].allreduce(np.ones(1 << 18, np.float32)))
    finally:
        os.umask(old)
    assert modes and all(m == 0o600 for m in modes), [oct(m) for m in modes]
    assert {f for f in os.listdir("/dev/shm") if f.startswith("pycoll-")} <= before


def test_transports_never_unpickle():
    """Nothing received off the wire is unpickled: transports import no deserializer."""
    bad = re.compile(
        r"^\s*(import|from)\s+(pickle|cPickle|marshal|shelve|dill|cloudpickle)\b", re.M
    )
    calls = re.compile(r"\b(pickle|marshal)\.(loads?|Unpickler)\b|\beval\(|\bexec\(")
    offenders = []
    for path in sorted((ROOT / "transports").rglob("*.py")):
        text = path.read_text()
        if bad.search(text) or calls.search(text):
            offenders.append(str(path.relative_to(ROOT)))
    assert not offenders, offenders


def _stranger(port: int, stop: threading.Event, log: list[str]) -> None:
    """Connect again and again: say nothing, send garbage, send a forged hello."""
    forged = b"PCTh" + bytes(3) + b"\x01" + os.urandom(60) + os.urandom(32)
    while not stop.is_set():
        for payload in (b"", os.urandom(300), forged):
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=1) as s:
                    s.settimeout(0.5)
                    if payload:
                        s.sendall(payload)
                    try:
                        s.recv(64)
                    except OSError:
                        pass
                    log.append("tried")
            except OSError:
                log.append("refused")
        stop.wait(0.01)


def test_tcp_stranger_is_dropped_and_the_job_goes_on(monkeypatch):
    """A stranger hammers rank 0's tcp port during set-up and collectives."""
    stop = threading.Event()
    tried: list[str] = []
    threads: list[threading.Thread] = []
    real_listen = TcpTransport.listen

    def listen(self):  # type: ignore[no-untyped-def]
        blob = real_listen(self)
        if self.options.rank == 0 and not threads:
            port = decode_blob(blob).addrs[0].port
            t = threading.Thread(target=_stranger, args=(port, stop, tried), daemon=True)
            threads.append(t)
            t.start()
        return blob

    monkeypatch.setattr(TcpTransport, "listen", listen)
    try:
        with communicators(3, transports=("tcp",), socket_ifname="lo", timeout=30) as comms:
            for i in range(20):
                outs = run_ranks(
                    3, lambda r, i=i: comms[r].allreduce(np.full(1000, r + i, np.int64))
                )
                for o in outs:
                    assert (o == 3 * i + 3).all()
    finally:
        stop.set()
        for t in threads:
            t.join(10)
    assert tried, "the stranger never got to try"


def soft_handshake(
    sock: socket.socket, secret: bytes, dst_qpn: int, src_qpn: int, gid: bytes, lid: int
) -> bytes:
    """A soft RDMA connector's side of the handshake on a blocking socket: read the
    challenge, answer it; returns what came back (the ACK, or b"" if dropped)."""
    from transports.rdma.soft import engine as eng

    challenge = _recv_n(sock, eng.CHALLENGE.size)
    _, _, nonce = eng.CHALLENGE.unpack(challenge)
    sock.sendall(eng.hello(secret, nonce, dst_qpn, src_qpn, gid, lid))
    return _recv_n(sock, eng.ACK.size)


def _recv_n(sock: socket.socket, n: int) -> bytes:
    got = b""
    while len(got) < n:
        try:
            part = sock.recv(n - len(got))
        except OSError:
            break
        if not part:
            break
        got += part
    return got


def _soft_pair(secret: bytes = b"job-secret") -> tuple[list, list[bytes]]:
    from transports.rdma.transport import RdmaTransport

    opts = [
        TransportOptions(
            rank=r,
            size=2,
            timeout=20.0,
            secret=secret,
            extra=(("rdma_provider", "soft"), ("rdma_memory", "host")),
        )
        for r in (0, 1)
    ]
    ts = [RdmaTransport(o) for o in opts]
    return ts, [t.listen() for t in ts]


def _both_ways(conns: list, rounds: int = 5) -> None:
    """Messages still flow both ways, with the right bytes."""
    from transports.base import Deadline, wait_all

    for i in range(rounds):
        for a in (0, 1):
            msg = os.urandom(3000 + i)
            out = bytearray(len(msg))
            wait_all(
                [conns[a].isend(memoryview(msg)), conns[1 - a].irecv_into(memoryview(out))],
                Deadline.after(30),
            )
            assert out == msg


def test_soft_rdma_forged_hello_cannot_write():
    """A stranger who read a rank's endpoint blob (it is not secret) forges the
    hello of a peer QP and writes into that rank's receive slots."""
    from transports.rdma.soft import rc
    from transports.rdma.transport import Endpoint

    ts, blobs = _soft_pair()
    try:
        conns = run_ranks(2, lambda r: ts[r].connect(1 - r, blobs[1 - r]))
        ep = Endpoint.unpack(blobs[0])
        qpn = ep.qps[1][0]  # the QP rank 0 made for rank 1
        with socket.create_connection(("127.0.0.1", ep.lid), timeout=5) as s:
            s.settimeout(2)
            # a hello signed with a guessed secret
            answer = soft_handshake(s, b"not-the-secret", qpn, 4242, ep.gid, 1)
            try:
                s.sendall(rc.REQ.pack(rc.OP_WRITE, 0, ep.rkey, 0, ep.slots_addr, 64) + b"\xee" * 64)
                answer += s.recv(64)
            except OSError:
                pass
        _both_ways(conns)  # the job goes on
        assert answer == b"", "soft RDMA answered a hello that lacks the job's secret"
    finally:
        for t in ts:
            t.close()


def test_soft_rdma_replayed_hello_is_rejected(monkeypatch):
    """A stranger without the secret replays the hello a peer sent (recorded off
    the wire): it must not take over the live link, and the job goes on."""
    from transports.rdma.soft import rc
    from transports.rdma.transport import Endpoint

    sent: list[bytes] = []
    real = rc.hello

    def spy(*args):  # type: ignore[no-untyped-def]
        h = real(*args)
        sent.append(h)
        return h

    monkeypatch.setattr(rc, "hello", spy)
    ts, blobs = _soft_pair()
    try:
        conns = run_ranks(2, lambda r: ts[r].connect(1 - r, blobs[1 - r]))
        _both_ways(conns, 1)  # both links are up
        ep = Endpoint.unpack(blobs[0])
        mine = [h for h in sent if struct.unpack_from("<4sHxxI", h)[2] == ep.qps[1][0]]
        assert mine, "no hello to rank 0's QP was recorded"
        for replay in mine * 3:
            with socket.create_connection(("127.0.0.1", ep.lid), timeout=5) as s:
                s.sendall(replay)
                s.settimeout(1)
                answer = b""
                try:
                    while chunk := s.recv(4096):
                        answer += chunk
                except OSError:
                    pass
            assert b"pcsa" not in answer, "a replayed hello was acknowledged"
        _both_ways(conns)
    finally:
        for t in ts:
            t.close()


def test_soft_rdma_idle_strangers_do_not_exhaust_fds(caplog):
    """200 strangers connect to a rank's soft RDMA port and say nothing, before
    the peers connect: the context holds a bounded number of them, the peers'
    handshake still gets through, and the log stays short."""
    from transports.rdma.transport import Endpoint

    def nfds() -> int:
        return len(os.listdir("/proc/self/fd"))

    ts, blobs = _soft_pair()
    strangers: list[socket.socket] = []
    caplog.set_level(logging.INFO, logger="transports.rdma.soft.engine")
    try:
        port = Endpoint.unpack(blobs[0]).lid
        before = nfds()
        for _ in range(200):
            strangers.append(socket.create_connection(("127.0.0.1", port), timeout=5))
        time.sleep(1.5)  # the context accepts what it will
        held = nfds() - before - len(strangers)  # the accepted ends, in this process too
        conns = run_ranks(2, lambda r: ts[r].connect(1 - r, blobs[1 - r]))
        _both_ways(conns)
        assert held <= 80, f"rank 0 holds {held} descriptors for 200 idle strangers"
        lines = [r for r in caplog.records if r.name == "transports.rdma.soft.engine"]
        assert len(lines) <= 5, [r.getMessage() for r in lines]
    finally:
        for s in strangers:
            s.close()
        for t in ts:
            t.close()


def test_soft_rdma_accept_out_of_descriptors_backs_off(caplog):
    """accept() failing with EMFILE (a stranger flood, a low ulimit) must not spin
    on the still-readable listener, nor log each failure."""
    import errno

    from transports.rdma import soft

    ctx = soft.Context(name="soft0", soft_secret=b"s")
    eng = ctx.engine
    real = eng.listener
    calls: list[float] = []

    class Exhausted:
        def accept(self):  # type: ignore[no-untyped-def]
            calls.append(time.monotonic())
            raise OSError(errno.EMFILE, "Too many open files")

        def __getattr__(self, name):  # type: ignore[no-untyped-def]
            return getattr(real, name)

    caplog.set_level(logging.INFO, logger="transports.rdma.soft.engine")
    eng.listener = Exhausted()  # type: ignore[assignment]
    client = socket.create_connection(("127.0.0.1", eng.port), timeout=5)
    try:
        time.sleep(1.0)
        assert calls, "the listener was never served"
        assert len(calls) < 50, f"{len(calls)} accept() calls in 1 s: a busy loop"
        lines = [r for r in caplog.records if r.name == "transports.rdma.soft.engine"]
        assert 1 <= len(lines) <= 2, [r.getMessage() for r in lines]
        eng.listener = real  # descriptors are back: the waiting connection is served
        deadline = time.monotonic() + 5
        while not eng.greeters and time.monotonic() < deadline:
            time.sleep(0.01)
        assert eng.greeters, "accepting never resumed"
    finally:
        eng.listener = real
        client.close()
        ctx.close()
