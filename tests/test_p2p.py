"""Point-to-point and sub-communicators off the happy path (ranks are threads,
:mod:`tests.inproc`): a dead or silent peer, mismatched sizes and dtypes, a
collective that meets a point-to-point message, bad arguments; and the ring
shift of a group over every transport."""

from __future__ import annotations

import threading
import time
from typing import Any

import numpy as np
import pytest

import pycoll
from pycoll import p2p
from tests.inproc import communicators, run_ranks
from transports import shm

pytestmark = pytest.mark.timeout(120)

TRANSPORTS = [("shm",), ("tcp",), ("rdma",)]


def _cfg(transports: tuple[str, ...]) -> dict[str, object]:
    cfg: dict[str, object] = {"transports": transports, "timeout": 20}
    if transports == ("rdma",):
        cfg["rdma_provider"] = "soft"
    return cfg


@pytest.mark.parametrize("transports", TRANSPORTS, ids=lambda t: t[0])
def test_ring_shift_in_a_group_never_deadlocks(transports):
    """Every rank sends right and receives left, from one element to several
    slots and chunks (about 1 MiB: through shm's slots in pieces; 12 MiB: read
    in place): all posted together, nothing waits for a receive first."""
    with communicators(3, **_cfg(transports)) as comms:

        def body(r: int) -> None:
            c = comms[r]
            for count in (1, 1000, (1 << 18) + 7, 3 << 20):
                x = np.full(count, r, np.int32)
                y = np.full(count, -1, np.int32)
                with c.group():
                    c.send(x, (r + 1) % 3, tag=4)
                    c.recv(y, (r - 1) % 3, tag=4)
                assert (y == (r - 1) % 3).all(), (transports, count)
                any_src = np.full(count, -1, np.int32)
                c.sendrecv(x, (r + 1) % 3, any_src, None)
                assert (any_src == (r - 1) % 3).all() and c.last_source == (r - 1) % 3

        run_ranks(3, body)


def test_size_or_dtype_mismatch_raises_and_writes_nothing():
    with communicators(2, timeout=20) as comms:

        def body(r: int) -> list[str]:
            c = comms[r]
            msgs = []
            if r == 0:
                c.send(np.arange(4, dtype=np.int32), 1)
                c.send(np.arange(4, dtype=np.float32), 1)
                c.send(np.arange(4, dtype=np.int32), 1)
            else:
                for bad in (np.full(5, -1, np.int32), np.full(4, -1, np.int32)):
                    with pytest.raises(pycoll.CollectiveMismatchError) as ei:
                        c.recv(bad, 0)
                    assert (bad == -1).all(), "a refused message wrote into recvbuf"
                    msgs.append(str(ei.value))
                ok = c.recv(np.empty(4, np.int32), 0)  # the stream stays in step
                assert (ok == np.arange(4)).all()
            assert c.allreduce(np.ones(1))[0] == 2  # and the communicator usable
            return msgs

        msgs = run_ranks(2, body)[1]
    assert "rank 0 sent 4 x int32" in msgs[0] and "receives 5 x int32" in msgs[0], msgs
    assert "4 x float32" in msgs[1] and "4 x int32" in msgs[1], msgs


@pytest.mark.parametrize("transports", TRANSPORTS, ids=lambda t: t[0])
def test_a_large_size_mismatch_writes_nothing_and_the_stream_stays_in_step(transports):
    """A 1 MiB payload (on shm: pieces through the slots) into a receive of
    another count is refused before a byte lands; the pieces are drained, and
    the next message of the pair arrives whole."""
    k = 1 << 18
    with communicators(2, **_cfg(transports)) as comms:

        def body(r: int) -> None:
            c = comms[r]
            if r == 0:
                c.send(np.arange(k, dtype=np.int32), 1)
                c.send(np.arange(k, dtype=np.int32) + 1, 1)
                return
            bad = np.full(k + 1, -1, np.int32)
            with pytest.raises(pycoll.CollectiveMismatchError, match="where this rank receives"):
                c.recv(bad, 0)
            assert (bad == -1).all(), "a refused message wrote into recvbuf"
            ok = c.recv(np.full(k, -1, np.int32), 0)
            assert (ok == np.arange(k) + 1).all()

        run_ranks(2, body)


@pytest.mark.parametrize("transports", [("shm",), ("tcp",)], ids=lambda t: t[0])
def test_recv_from_a_rank_that_is_gone_raises_peer_aborted(transports):
    with communicators(2, **_cfg(transports)) as comms:
        comms[1].abort()
        start = time.monotonic()
        with pytest.raises(pycoll.PeerAbortedError):
            comms[0].recv(np.empty(3), 1)
        assert time.monotonic() - start < 10


@pytest.mark.parametrize("transports", [("shm",), ("tcp",)], ids=lambda t: t[0])
def test_blocking_send_to_a_rank_that_is_gone_raises_peer_aborted(transports):
    """A blocking send (the short way of a call alone) of a message the peer must
    take, to a rank that has gone: it raises, and fast."""
    with communicators(2, **_cfg(transports)) as comms:
        comms[1].abort()
        start = time.monotonic()
        with pytest.raises(pycoll.PeerAbortedError):
            comms[0].send(np.ones(4 << 20), 1)  # 32 MiB
        assert time.monotonic() - start < 10


def test_blocking_send_to_a_silent_peer_times_out_naming_it():
    with communicators(2, timeout=1) as comms:
        start = time.monotonic()
        with pytest.raises(pycoll.CollectiveTimeout) as ei:
            comms[0].send(np.ones(4 << 20), 1)
        assert time.monotonic() - start < 8
        assert 1 in ei.value.missing or ei.value.peer == 1, ei.value


def test_silent_peer_times_out_naming_it():
    with communicators(2, timeout=1) as comms:
        start = time.monotonic()
        with pytest.raises(pycoll.CollectiveTimeout) as ei:
            comms[0].recv(np.empty(3), 1, tag=2)
        assert time.monotonic() - start < 8
        assert 1 in ei.value.missing or ei.value.peer == 1, ei.value
        # a request's wait(timeout) gives up and leaves it pending
        req = comms[1].recv(np.empty(1), 0, async_op=True)
        with pytest.raises(pycoll.CollectiveTimeout, match="still pending"):
            req.wait(0.2)


def test_collective_that_meets_a_point_to_point_message_raises():
    """Rank 0 sends, rank 1 starts a collective instead of receiving: over tcp
    the collective meets the message and rank 1 raises, never pairing the two;
    rank 0's allreduce, whose bytes from rank 1 were sent before, is right or
    raises, and its next call raises.  (On one host the collective goes through
    the group segment and the message waits on the pair's connection.)"""
    with communicators(2, transports=("tcp",), timeout=10) as comms:

        def body(r: int) -> str:
            c = comms[r]
            try:
                if r == 0:
                    c.send(np.arange(3.0), 1, tag=1)
                got = c.allreduce(np.full(3, r + 1.0))
            except pycoll.PycollError as exc:
                return type(exc).__name__
            assert (got == 3.0).all(), got  # never a wrong result
            with pytest.raises(pycoll.PycollError):
                c.allreduce(np.ones(3))
            return "right"

        got = run_ranks(2, body)
    assert got[1] == "CollectiveMismatchError", got
    with communicators(2, timeout=10) as comms:

        def on_shm(r: int) -> None:
            c = comms[r]
            if r == 0:
                c.send(np.arange(3.0), 1, tag=1)
            assert c.allreduce(np.ones(3))[0] == 2
            if r == 1:
                assert (c.recv(np.empty(3), 0, tag=1) == np.arange(3.0)).all()

        run_ranks(2, on_shm)


def _ping_pong(c: Any, r: int, x: np.ndarray, y: np.ndarray, rounds: int, tag: int) -> None:
    """Ranks 0 and 1 send ``x`` and receive into ``y`` in turn, ``rounds`` times,
    new contents each time into a poisoned output, checked on arrival."""
    for i in range(rounds):
        x[:] = np.arange(x.size) + 100 * i + r
        y[:] = np.nan
        if r == 0:
            c.send(x, 1, tag=tag)
            c.recv(y, 1, tag=tag)
        else:
            c.recv(y, 0, tag=tag)
            c.send(x, 0, tag=tag)
        assert (y == np.arange(y.size) + 100 * i + 1 - r).all(), (i, y[:3])


def test_large_arrays_replay_without_holding_them() -> None:
    """Blocking calls on the same array beyond AGAIN_MAX_BYTES replay too
    (pycoll.p2p._Again, weak): fresh data every time, and the replay keeps
    nothing of the array alive once the caller lets go of it."""
    import gc
    import weakref

    n = p2p.AGAIN_MAX_BYTES // 4 + 5
    with communicators(2, timeout=30) as comms:

        def body(r: int) -> bool:
            c = comms[r]
            x = np.empty(n, np.float32)
            y = np.empty(n, np.float32)
            _ping_pong(c, r, x, y, 6, 4)
            again = c._peers._again
            assert again[(True, id(x), 1 - r, 4)].weak
            assert again[(False, id(y), 1 - r, 4)].weak
            gone = weakref.ref(x)
            del x
            gc.collect()
            return gone() is None

        assert run_ranks(2, body, timeout=60) == [True, True]


@pytest.mark.parametrize("transports", TRANSPORTS, ids=lambda t: t[0])
def test_same_arrays_again_replay_and_still_check(transports):
    """Blocking calls on the same array, peer and tag run again without their
    checks (pycoll.p2p._Again): the data is fresh every time, and an array that
    changed shape or became read-only, or a bad peer or tag, is still refused."""
    with communicators(2, **_cfg(transports)) as comms:

        def body(r: int) -> None:
            c = comms[r]
            x = np.empty(7, np.float32)
            y = np.empty(7, np.float32)
            _ping_pong(c, r, x, y, 40, 3)
            assert c.last_source == 1 - r
            assert {(True, id(x), 1 - r, 3), (False, id(y), 1 - r, 3)} <= c._peers._again.keys()
            flat = np.zeros(8, np.int64)
            if r == 0:
                c.send(flat, 1)
                c.send(flat, 1)
                flat.shape = (2, 4)  # the same object, another shape: the checks again
                c.send(flat, 1)
                c.send(np.arange(4, dtype=np.int64), 1)
            else:
                got = np.full(8, -1, np.int64)
                c.recv(got, 0)
                c.recv(got, 0)
                assert (got == 0).all()
                with pytest.raises(pycoll.CollectiveMismatchError):
                    c.recv(got[:5], 0)  # 8 elements sent: refused, nothing written
                assert (got == 0).all()
                got.flags.writeable = False
                with pytest.raises(pycoll.InvalidArgumentError, match="read-only"):
                    c.recv(got, 0)
                got = np.empty(4, np.int64)
                c.recv(got, 0)
                assert (got == np.arange(4)).all()
            with pytest.raises(pycoll.InvalidArgumentError, match="peer=2"):
                c.send(x, 2, tag=3)
            with pytest.raises(pycoll.InvalidArgumentError, match="tag=True"):
                c.send(x, 1 - r, tag=True)
            assert c.allreduce(np.ones(1))[0] == 2  # in step, and usable

        run_ranks(2, body)


def _count_quick(c: pycoll.Communicator, peer: int) -> dict[str, list[object]]:
    """Record what the connection to ``peer``'s put_now and take_now return."""
    conn = c._peers.p2p.conns[c._peers.engine.members[peer]]
    seen: dict[str, list[object]] = {"put": [], "take": []}
    put, take = conn.put_now, conn.take_now

    def put_now(*a: object) -> bool:
        seen["put"].append(got := put(*a))
        return got

    def take_now(*a: object) -> int:
        seen["take"].append(got := take(*a))
        return got

    conn.put_now, conn.take_now = put_now, take_now
    return seen


@pytest.mark.skipif(not shm._ring, reason="transports._ring was not built")
def test_replayed_eager_messages_go_the_quick_way_and_fall_back_when_another_comes():
    """On shm, a replayed blocking call of an eager message moves it in one
    compiled step (ShmConnection.put_now, take_now): fresh data each time.  A
    message that is not the replayed receive's (another tag, count or dtype,
    a sub-communicator's) is left for the usual way, which matches or refuses
    it as on a first call, and writes nothing wrong."""
    with communicators(2, timeout=20) as comms:

        def body(r: int) -> dict[str, list[object]]:
            c = comms[r]
            seen = _count_quick(c, 1 - r)
            sub = c.dup()
            x = np.empty(5, np.int16)
            y = np.empty(5, np.int16)
            for i in range(30):
                x[:] = np.arange(5) + 10 * i + r
                y[:] = -1
                late = i % 3 == 0  # now and then the message is there before its receive
                if r == 0:
                    c.send(x, 1, tag=3)
                    if i == 10:  # another tag first: unexpected, then taken by its own recv
                        c.send(np.full(5, 77, np.int16), 1, tag=4)
                    if i == 20:  # the same tag on a sub-communicator first
                        sub.send(np.full(5, 55, np.int16), 1, tag=3)
                    if late:
                        time.sleep(0.002)
                    c.recv(y, 1, tag=3)
                else:
                    if i == 11:
                        z = np.full(5, -1, np.int16)
                        assert (c.recv(z, 0, tag=4) == 77).all()
                    if i == 21:
                        z = np.full(5, -1, np.int16)
                        assert (sub.recv(z, 0, tag=3) == 55).all()
                    if late:
                        time.sleep(0.002)
                    c.recv(y, 0, tag=3)
                    c.send(x, 0, tag=3)
                assert (y == np.arange(5) + 10 * i + 1 - r).all(), (i, y)
            # the replayed receive meets another count, then another dtype, under its tag
            if r == 0:
                c.send(np.arange(6, dtype=np.int16), 1, tag=3)
                c.send(np.arange(5, dtype=np.uint16), 1, tag=3)
                c.send(x, 1, tag=3)
            else:
                for theirs in ("6 x int16", "5 x uint16"):
                    y[:] = -1
                    with pytest.raises(pycoll.CollectiveMismatchError, match=theirs):
                        c.recv(y, 0, tag=3)
                    assert (y == -1).all()
                c.recv(y, 0, tag=3)
                assert (y == np.arange(5) + 290).all()
            assert c.allreduce(np.ones(1))[0] == 2  # in step, and usable
            sub.close()
            return seen

        seen = run_ranks(2, body)
    for r in range(2):
        assert seen[r]["put"].count(True) >= 25, seen[r]
        assert seen[r]["take"].count(1) >= 1, seen[r]  # (threads: only what is there)
    assert -1 in seen[1]["take"], seen[1]  # the other messages were left for the usual way


@pytest.mark.skipif(not shm._ring, reason="transports._ring was not built")
def test_a_thread_that_calls_during_a_quick_send_fails_both_calls():
    """Another thread's send while a replayed send is in its compiled step:
    both raise ConcurrentCallError, as on the usual way, and the communicator
    is unusable after; the peer gets the one message that went, whole."""
    with communicators(2, timeout=20) as comms:

        def body(r: int) -> list[str]:
            c = comms[r]
            x = np.arange(4, dtype=np.int32)
            if r == 1:
                got = np.full(4, -1, np.int32)
                for _ in range(3):
                    got[:] = -1
                    c.recv(got, 0)
                    assert (got == x).all()
                return []
            c.send(x, 1)
            c.send(x, 1)  # (the second checked call makes the replay)
            conn = c._peers.p2p.conns[c._peers.engine.members[1]]
            put = conn.put_now
            seen: list[str] = []

            def intrude() -> None:
                try:
                    c.send(np.zeros(2, np.int64), 1, tag=9)
                except pycoll.PycollError as exc:
                    seen.append(type(exc).__name__)

            def put_now(*args: object) -> bool:
                t = threading.Thread(target=intrude)
                t.start()
                t.join()
                return put(*args)

            conn.put_now = put_now
            with pytest.raises(pycoll.ConcurrentCallError):
                c.send(x, 1)  # goes, but another call ran meanwhile
            conn.put_now = put
            with pytest.raises(pycoll.PycollError):
                c.send(x, 1)
            return seen

        assert run_ranks(2, body)[0] == ["ConcurrentCallError"]


@pytest.mark.parametrize("compiled", [True, False])
@pytest.mark.parametrize("transports", TRANSPORTS, ids=lambda t: t[0])
def test_only_shm_with_the_compiled_ring_replays_the_quick_way(transports, compiled):
    """The quick way needs a connection with Cap.QUICK (shm, transports._ring
    built) and PYCOLL_COMPILED on; a message over 32 KiB (not eager) never takes it."""
    with communicators(2, compiled=compiled, **_cfg(transports)) as comms:

        def body(r: int) -> list[bool]:
            c = comms[r]
            small, big = np.full(3, r, np.int64), np.full(5000, r, np.int64)
            for a in (small, big):
                for _ in range(3):
                    if r == 0:
                        c.send(a, 1)
                    else:
                        c.recv(a, 0)
                assert (a == 0).all()
            return [
                c._peers._again[(r == 0, id(a), 1 - r, 0)].conn is not None for a in (small, big)
            ]

        got = run_ranks(2, body)
    quick = compiled and transports == ("shm",) and shm._ring is not None
    assert got == [[quick, False]] * 2, got


@pytest.mark.parametrize("count", [3, p2p.AGAIN_MAX_BYTES // 8 + 5], ids=["small", "large"])
@pytest.mark.parametrize("transports", TRANSPORTS, ids=lambda t: t[0])
def test_replayed_recv_from_a_rank_that_is_gone_raises_peer_aborted(transports, count):
    """A receive replayed on the same array (pycoll.p2p._Again) whose peer
    aborts: PeerAbortedError within the timeout, the buffer untouched; also for
    an array the replay holds only weakly (beyond AGAIN_MAX_BYTES)."""
    with communicators(2, **_cfg(transports)) as comms:

        def body(r: int) -> object:
            c = comms[r]
            buf = np.zeros(count)
            for _ in range(3):
                if r == 0:
                    c.recv(buf, 1)
                else:
                    c.send(buf, 0)
            if r == 1:
                c.abort()
                return None
            again = c._peers._again[(False, id(buf), 1, 0)]
            assert again.weak is (buf.nbytes > p2p.AGAIN_MAX_BYTES)
            buf[:] = -1
            start = time.monotonic()
            with pytest.raises(pycoll.PeerAbortedError):
                c.recv(buf, 1)
            assert (buf == -1).all()
            return time.monotonic() - start

        assert run_ranks(2, body)[0] < 10


class _BlindProbe:
    """A connection whose probe sees nothing until ``until`` (monotonic)."""

    def __init__(self, conn: Any, until: float) -> None:
        self.conn, self.until = conn, until

    def probe(self) -> int | None:
        return None if time.monotonic() < self.until else self.conn.probe()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.conn, name)


@pytest.mark.parametrize("transports", TRANSPORTS, ids=lambda t: t[0])
def test_the_last_message_of_a_rank_that_aborts_is_received(transports):
    """A rank sends and aborts while the receiver's wait is between a probe that
    saw nothing and its liveness check (forced here: the probe is blind for a
    while): the message is still received whole, and the next receive raises
    PeerAbortedError."""
    with communicators(2, **_cfg(transports)) as comms:
        sent = threading.Event()

        def body(r: int) -> object:
            c = comms[r]
            if r == 1:
                c.send(np.arange(7.0), 0)
                c.abort()
                sent.set()
                return None
            conns = c._peers.p2p.conns
            assert sent.wait(20)
            time.sleep(0.2)  # the abort is visible
            conns[1] = _BlindProbe(conns[1], time.monotonic() + 0.5)
            buf = np.full(7, -1.0)
            c.recv(buf, 1)
            conns[1] = conns[1].conn
            assert np.array_equal(buf, np.arange(7.0))
            with pytest.raises(pycoll.PeerAbortedError):
                c.recv(buf, 1)
            return True

        assert run_ranks(2, body)[0] is True


def test_bad_arguments_raise_before_anything_moves():
    with communicators(2, timeout=10) as comms:
        c = comms[0]
        for call, match in (
            (lambda: c.send(np.ones(2), 2), "peer=2"),
            (lambda: c.send(np.ones(2), None), "destination"),
            (lambda: c.recv(np.ones(2), -1), "peer=-1"),
            (lambda: c.send(np.ones(2), 1, tag=1.5), "tag=1.5"),
            (lambda: c.send(np.ones(2), 1, tag=1 << 63), "64-bit"),
            (lambda: c.recv(np.ones(4)[::2], 1), "not C-contiguous"),
            (lambda: c.recv(_read_only(), 1), "read-only"),
            (lambda: c.recv(np.ones(2), 1, tag=True), "tag=True"),
            (lambda: c.split(-1), "color=-1"),
            (lambda: c.split(1, key="a"), "key='a'"),
        ):
            seq = c._engine.seq
            with pytest.raises(pycoll.InvalidArgumentError, match=match):
                call()
            assert c._engine.seq <= seq + 1
        with c.group():
            req = c.send(np.ones(1), 0)
            with pytest.raises(pycoll.InvalidArgumentError, match="inside group"):
                req.wait()
        with pytest.raises(pycoll.InvalidArgumentError, match="already inside"):
            with c.group():
                with c.group():
                    pass
        with pytest.raises(pycoll.InvalidArgumentError, match="recvbuf is required"):
            c.scatter(np.ones(2), None)
        with pytest.raises(pycoll.InvalidArgumentError, match=r"counts=\[1\]"):
            c.allgatherv(np.ones(1), np.ones(2), [1])
        with pytest.raises(pycoll.InvalidArgumentError, match="counts\\[0\\] is 2"):
            c.allgatherv(np.ones(1), np.ones(3), [2, 1])
        with pytest.raises(pycoll.InvalidArgumentError, match="recvcounts"):
            c.alltoallv(np.ones(2), [1, 1], np.ones(2), [2, 0])


def test_sub_communicators_share_connections_and_never_pair_with_the_parent():
    with communicators(4, timeout=20) as comms:

        def body(r: int) -> None:
            c = comms[r]
            sub = c.split(r // 2)
            assert sub._engine.conns[1 - sub.rank] is c._engine.conns[r ^ 1]  # no new connection
            assert sub.transport_of(1 - sub.rank) == c.transport_of(r ^ 1)
            dup = c.dup()
            assert dup._engine.group is c._engine.group  # the same ranks share the segment
            assert sub._engine.group is None
            for _ in range(20):  # the same calls on three communicators, interleaved
                a = c.allreduce(np.ones(4))
                b = sub.allreduce(np.ones(4))
                d = dup.allreduce(np.ones(4))
                assert a[0] == 4 and b[0] == 2 and d[0] == 4
                x = sub.allgather(np.array([r]))
                assert sorted(x.ravel()) == [r - r % 2, r - r % 2 + 1]
            assert sub._engine.ctx != c._engine.ctx != dup._engine.ctx

        run_ranks(4, body)


def _read_only() -> np.ndarray:
    a = np.ones(2)
    a.flags.writeable = False
    return a
