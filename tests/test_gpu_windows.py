"""A rank that opens a peer's window checks the sizes the peer exposed.

Runs without a GPU: :meth:`Windows.open` is called on a stand-in whose
connection hands out exposed spans, as cuda_ipc's ``open_window`` does.  On the
H200 at n = 3 and 4, a broadcast of 12 bytes on two ranks and 24 on the root
returned the root's first 12 bytes with no error, before this check.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from pycoll.gpu.windows import KeptWindows, Windows
from transports.base import DeviceSpan, PeerClosedError, TagMismatchError


def _windows(*sizes: int) -> Any:
    spans = [DeviceSpan(1 << 40, n, 0, 0) for n in sizes]
    conn = SimpleNamespace(open_window=lambda stream, deadline, tag: spans)
    W = SimpleNamespace(
        conns={1: conn},
        _sptr=0,
        deadline=None,
        tag=0,
        _as_array=lambda ptr, nbytes, dtype, device: np.zeros(nbytes // dtype.itemsize, dtype),
    )
    W._views = lambda *args: Windows._views(W, *args)
    return W


F4 = np.dtype(np.float32)


def test_matching_sizes_open() -> None:
    assert [a.size for a in Windows.open(_windows(12), 1, F4, 12)] == [3]
    assert [a.size for a in Windows.open(_windows(12, 48), 1, F4, 12, 48)] == [3, 12]
    assert [a.size for a in Windows.open(_windows(12), 1, F4, 12, 12)] == [3]  # in place


@pytest.mark.parametrize(
    "exposed,first,last",
    [((12,), 24, None), ((24,), 12, None), ((12, 48), 12, 24), ((12, 24), 24, 24), ((), 12, None)],
)
def test_other_sizes_raise_a_mismatch_naming_the_peer(
    exposed: tuple[int, ...], first: int, last: int | None
) -> None:
    with pytest.raises(TagMismatchError, match="rank 1 exposed buffers of") as info:
        Windows.open(_windows(*exposed), 1, F4, first, last)
    assert info.value.peer == 1 and info.value.of == "sizes"


def _kept(exposed: list[list[DeviceSpan]]) -> Any:
    """A device plan's windows whose peer 1 exposes ``exposed[k]`` at its k-th call."""
    calls = iter(exposed)
    W = object.__new__(KeptWindows)
    W.conns = {1: SimpleNamespace(open_window=lambda stream, deadline, tag: next(calls))}
    W._sptr, W.deadline, W._opened, W._exposed, W.tag = 0, None, {}, {}, 0
    W._as_array = lambda ptr, nbytes, dtype, device: np.zeros(nbytes // dtype.itemsize, dtype)
    return W


def test_a_plan_reuses_the_views_of_spans_exposed_again() -> None:
    same = [DeviceSpan(1 << 40, 12, 0, 0)]
    W = _kept([same, list(same)])
    first = W.open(1, F4, 12)
    assert W.open(1, F4, 12)[0] is first[0]


def test_a_plan_checks_spans_that_changed() -> None:
    """A peer that exposes other spans than last time (another call) is checked
    and opened afresh, as an ordinary call's windows do."""
    a, moved, bigger = (
        [DeviceSpan(1 << 40, 12, 0, 0)],
        [DeviceSpan(2 << 40, 12, 0, 0)],
        [DeviceSpan(1 << 40, 24, 0, 0)],
    )
    W = _kept([a, moved, bigger])
    first = W.open(1, F4, 12)
    again = W.open(1, F4, 12)
    assert again[0] is not first[0] and again[0].size == 3
    with pytest.raises(TagMismatchError, match="rank 1 exposed buffers of"):
        W.open(1, F4, 12)


def _ipc_window(side: int = 0, mm: Any = None) -> tuple[Any, list[int]]:
    """cuda_ipc's window of side ``side`` of a connection, on a plain host
    segment (``mm``: the other side's, to pair them): the peer's words
    (exposed, ready, released, closed) may be set by hand, and the stream
    waits its openings enqueue are listed."""
    import mmap

    from transports import _atomic
    from transports.cuda_ipc import windows as ipc
    from transports.cuda_ipc.layout import (
        _CLOSED_OFF,
        _SEG_BYTES,
        _W_DONE,
        _W_EXPOSED,
        _W_READY,
        _W_RELEASED,
        _WIN_OFF,
    )

    mm = mmap.mmap(-1, _SEG_BYTES) if mm is None else mm
    mine, theirs = _WIN_OFF[side], _WIN_OFF[1 - side]
    w = object.__new__(ipc._Window)
    w._mm, w._mine, w._theirs, w._dev, w._read, w._last = mm, mine, theirs, 0, None, 0
    w.opened = w.exposed = w.opened_ready = w.opened_waiting = w.waited = w.released = 0
    w._give_up_at, w.abandoned, w._sides = None, None, []
    w.ready_by_host = w.ready_by_stream = 0
    w._written = [None] * 4
    w._exposed_me = _atomic.Counter(mm, mine + _W_EXPOSED)
    w._ready_me = _atomic.Counter(mm, mine + _W_READY)
    w._exposed_peer = _atomic.Counter(mm, theirs + _W_EXPOSED)
    w._ready_peer = _atomic.Counter(mm, theirs + _W_READY)
    w._released_peer = _atomic.Counter(mm, theirs + _W_RELEASED)
    w._done_me = _atomic.Counter(mm, mine + _W_DONE)
    w._done_peer = _atomic.Counter(mm, theirs + _W_DONE)
    closed = _atomic.Counter(mm, _CLOSED_OFF[1 - side])
    peer = 1 - side

    def check_peer() -> None:
        if closed.load():
            raise PeerClosedError(f"cuda_ipc: peer {peer} closed its connection", peer=peer)

    w._conn = SimpleNamespace(
        check_peer=check_peer, peer=peer, device=0, _closed_peer=closed, _peer_pid=0
    )
    waits: list[int] = []
    w._on_stream = lambda op, stream, addr, value: waits.append(value)
    return w, waits


def _wait_released(w: Any, seconds: float = 5.0) -> None:
    """The follower's end of a call: expose (its peer releases nothing yet) and
    have the stream wait for the peer's "done" word."""
    from transports.base import Deadline

    w.exposed += 1
    w.wait_released(0, Deadline.after(seconds, idle=True))


@pytest.mark.parametrize("how", ["exited", "failed"])
def test_a_stream_waiting_on_a_gone_peer_is_let_go(
    how: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A follower's call returns with its stream waiting for the leader's "done"
    word.  A leader that dies or fails never writes it: the watchdog stores it
    itself (the stream goes on rather than hold the process for good), and the
    failure is kept for the connection to raise at its next use."""
    from transports.cuda_ipc import watchdog
    from transports.cuda_ipc import windows as ipc

    monkeypatch.setattr(watchdog, "watch", lambda w: None)
    w, waits = _ipc_window(1)
    _wait_released(w)
    assert waits == [1] and w.unmet()
    assert watchdog.look(w) is False  # the leader is alive: keep waiting
    if how == "exited":
        w._conn._peer_pid = 9
        monkeypatch.setattr(ipc, "process_gone", lambda pid: pid == 9)
    else:  # it failed and said so, before it released our exposure
        w._conn._closed_peer.store(2)
    assert watchdog.look(w) is True
    assert w._done_peer.load() == 1 and not w.unmet()
    assert isinstance(w.abandoned, PeerClosedError)
    assert ("has exited" if how == "exited" else "closed") in str(w.abandoned)


def test_a_live_peer_whose_host_released_is_waited_for_even_once_closed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A leader whose host queued its release and then failed (a later call) or
    closed is alive: its stream still writes the "done" count, however far
    behind its GPU is, so the follower's stream is not let go early.  Once
    its process is gone, what it queued died with it."""
    from transports.cuda_ipc import watchdog
    from transports.cuda_ipc import windows as ipc

    monkeypatch.setattr(watchdog, "watch", lambda w: None)
    w, _ = _ipc_window(1)
    _wait_released(w, seconds=0.01)
    w._released_peer.store(1)  # its host released our exposure
    w._conn._closed_peer.store(2)  # then failed
    time.sleep(0.02)  # past the timeout too
    w._conn._peer_pid = 9
    monkeypatch.setattr(ipc, "process_gone", lambda pid: False)
    assert watchdog.look(w) is False and w.abandoned is None
    monkeypatch.setattr(ipc, "process_gone", lambda pid: True)
    assert watchdog.look(w) is True and isinstance(w.abandoned, PeerClosedError)


def test_outputs_the_gone_peer_never_wrote_are_poisoned_before_the_stream_goes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """What the leader should have written into the follower's exposed outputs
    is filled with 0xFF bytes (NaN) on a side stream, and that stream, not the
    host, then writes the "done" count: the waiting stream never sees the
    stale output as a result.  Inputs are left alone."""
    from transports.base import Deadline
    from transports.cuda_ipc import windows as ipc

    done: list[tuple[str, Any]] = []
    monkeypatch.setattr(ipc, "stream_idle", lambda stream: True)
    monkeypatch.setattr(ipc.watchdog, "watch", lambda w: None)
    monkeypatch.setattr(ipc, "stream_write", lambda st, addr, v: done.append(("write", st, v)))
    monkeypatch.setattr(ipc, "on_device", lambda d: contextlib.nullcontext())
    w, _ = _ipc_window(1)
    w._marked_done = lambda: True
    w._rt = SimpleNamespace(
        streamCreateWithFlags=lambda flags: 77,
        memsetAsync=lambda ptr, v, n, st: done.append(("memset", ptr, v, n, st)),
    )
    x = DeviceSpan(0x1000, 64, 0, 0, b"h" * 64, 0)
    out = DeviceSpan(0x2000, 64, 0, 0, b"h" * 64, 0, written=True)
    w.expose([x, out], 0, Deadline.after(5))
    w.wait_released(0, Deadline.after(5, idle=True))
    w.abandon(PeerClosedError("cuda_ipc: peer 0 (pid 9) has exited", peer=0))
    assert done == [("memset", 0x2000, 0xFF, 64, 77), ("write", 77, 1)]
    assert w._done_peer.load() == 0 and w._sides == [77]  # the side stream writes it
    # let go once: a look before the side stream's write landed poisons nothing again
    assert ipc.watchdog.look(w) is True and not w.unmet()
    assert len(done) == 2 and w._sides == [77]


def test_a_stream_is_let_go_even_where_its_outputs_cannot_be_poisoned(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A failed CUDA call on the side stream (a context going away) must not
    leave the stream waiting: the host stores the count, and says the outputs
    were not filled (the connection still raises at its next use)."""
    from transports.base import Deadline
    from transports.cuda_ipc import windows as ipc

    monkeypatch.setattr(ipc, "stream_idle", lambda stream: True)
    monkeypatch.setattr(ipc.watchdog, "watch", lambda w: None)
    monkeypatch.setattr(ipc, "on_device", lambda d: contextlib.nullcontext())
    w, _ = _ipc_window(1)
    w._marked_done = lambda: True

    def memset(*_: object) -> None:
        raise RuntimeError("cudaErrorContextIsDestroyed")

    w._rt = SimpleNamespace(streamCreateWithFlags=lambda flags: 77, memsetAsync=memset)
    out = DeviceSpan(0x2000, 64, 0, 0, b"h" * 64, 0, written=True)
    w.expose([out], 0, Deadline.after(5))
    w.wait_released(0, Deadline.after(5, idle=True))
    why = PeerClosedError("cuda_ipc: peer 0 (pid 9) has exited", peer=0)
    with caplog.at_level(logging.ERROR, logger="pycoll.transports.cuda_ipc"):
        w.abandon(why)
    assert w._done_peer.load() == 1 and not w.unmet() and w.abandoned is why
    assert "could not be filled" in caplog.text and "ContextIsDestroyed" in caplog.text
    assert w._sides == [77]  # created: still destroyed at close


def test_a_stream_waiting_on_a_peer_that_wrote_before_it_went_is_not_let_go(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from transports.cuda_ipc import watchdog

    monkeypatch.setattr(watchdog, "watch", lambda w: None)
    w, _ = _ipc_window(1)
    _wait_released(w)
    w._done_peer.store(1)  # the leader's stream wrote it, then the leader exited
    w._conn._closed_peer.store(1)
    assert watchdog.look(w) is True and w.abandoned is None


def test_a_stream_waiting_past_the_timeout_is_let_go(monkeypatch: pytest.MonkeyPatch) -> None:
    """A leader that is alive but never comes: after the call's timeout the
    stream goes on and the connection raises a timeout at its next use.  One
    whose host queued its release is not late, however long its GPU takes."""
    from transports.base import TransportTimeout
    from transports.cuda_ipc import watchdog

    monkeypatch.setattr(watchdog, "watch", lambda w: None)
    w, _ = _ipc_window(1)
    _wait_released(w, seconds=0.05)
    assert watchdog.look(w) is False
    time.sleep(0.06)
    w._released_peer.store(1)  # its host queued the release: only its GPU is behind
    assert watchdog.look(w) is False and w.abandoned is None
    w._released_peer.store(0)  # (as if it had not)
    assert watchdog.look(w) is True
    assert isinstance(w.abandoned, TransportTimeout) and w._done_peer.load() == 1


def test_the_leader_stream_waiting_on_a_gone_follower_is_let_go(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The leader's opening queued a wait for the follower's "ready" word (its
    stream was busy, its host had queued the write): a follower that fails is
    still waited for, since its stream writes it; one that dies before its
    stream did is let go."""
    from transports.base import Deadline
    from transports.cuda_ipc import watchdog
    from transports.cuda_ipc import windows as ipc

    monkeypatch.setattr(watchdog, "watch", lambda w: None)
    w, waits = _ipc_window(0)
    w._exposed_peer.store(1)
    w.open(0, Deadline.after(0.01))
    assert waits == [1] and w.unmet()
    w._conn._closed_peer.store(3)
    w._conn._peer_pid = 9
    time.sleep(0.02)
    monkeypatch.setattr(ipc, "process_gone", lambda pid: False)
    assert watchdog.look(w) is False
    monkeypatch.setattr(ipc, "process_gone", lambda pid: True)
    assert watchdog.look(w) is True and w._ready_peer.load() == 1


@pytest.mark.parametrize("how", ["gone", "failed", "late"])
def test_close_lets_a_waiting_stream_go_within_a_bound(
    how: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """close() waits for our stream's work on the words, and never without a
    bound: a wait on a peer that is gone, or that failed before its host
    released our exposure, is let go at once (our end is closed by then, so
    its check_peer says nothing: the peer's "closed" word is read itself); one
    on a live peer whose host never released it, at the call's timeout."""
    from transports.base import TransportTimeout
    from transports.cuda_ipc import watchdog
    from transports.cuda_ipc import windows as ipc

    monkeypatch.setattr(watchdog, "watch", lambda w: None)
    monkeypatch.setattr(ipc, "_UNMAP_WAIT", 0.05)
    w, _ = _ipc_window(1)
    _wait_released(w, seconds=0.1)
    # the stream's last work (its wait) ends once the "done" word is written
    w._last = 1
    w._rt = SimpleNamespace(eventQuery=lambda ev: 0 if w._done_peer.load() >= 1 else 600)
    w._conn._peer_pid = 9
    w._conn.check_peer = lambda: None  # as a closed connection's is
    monkeypatch.setattr(ipc, "process_gone", lambda pid: how == "gone")
    if how == "failed":
        w._conn._closed_peer.store(2)  # closed because rank 0 failed
    t = time.monotonic()
    assert w._drain() is True
    took = time.monotonic() - t
    if how == "gone":
        assert isinstance(w.abandoned, PeerClosedError) and took < 0.05
        assert "has exited" in str(w.abandoned)
    elif how == "failed":
        assert isinstance(w.abandoned, PeerClosedError) and took < 0.05
        assert "because rank 0 failed" in str(w.abandoned)
    else:
        assert isinstance(w.abandoned, TransportTimeout) and 0.09 < took < 2
    assert w._done_peer.load() == 1


def test_the_watchdog_thread_lets_a_stream_go_and_forgets_closed_windows(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The thread itself: a window is looked at until its peer fails, then let go;
    one forgotten (closed) is never looked at again; with nothing left to look
    after, the thread ends."""
    from transports.cuda_ipc import watchdog

    monkeypatch.setattr(watchdog, "IDLE_EXIT", 0.05)

    w, _ = _ipc_window(1)
    other, _ = _ipc_window(1)
    looks: list[int] = []
    other.unmet = lambda: looks.append(1) or True
    _wait_released(w)  # registers it
    watchdog.watch(other)
    watchdog.forget(other)
    n = len(looks)
    w._conn._closed_peer.store(2)
    end = time.monotonic() + 5
    while w.abandoned is None and time.monotonic() < end:
        time.sleep(0.01)
    assert isinstance(w.abandoned, PeerClosedError) and w._done_peer.load() == 1
    assert len(looks) == n
    assert id(w) not in watchdog._waiting
    thread = watchdog._thread
    if thread is not None:
        thread.join(5)
    assert watchdog._thread is None and not any(
        t.name == "pycoll-cuda-ipc-watchdog" for t in threading.enumerate()
    )


@pytest.mark.parametrize("where", ["failure", "unmet"])
def test_the_watchdog_thread_survives_a_window_that_raises(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, where: str
) -> None:
    """A window whose look raises (its peer's state unreadable, or its own words)
    is dropped and logged, and the thread goes on looking after the others: had
    it died, no later stream wait in the process would be let go."""
    from transports.cuda_ipc import watchdog

    monkeypatch.setattr(watchdog, "IDLE_EXIT", 0.05)
    bad, _ = _ipc_window(1)
    calls = {"unmet": 0}

    def boom(*_: object) -> None:
        raise ValueError("unreadable")

    if where == "failure":
        bad.failure = boom
        bad.unmet = lambda: True
    else:  # the look says done; the check that keeps a re-armed window raises
        bad.failure = lambda: None

        def unmet() -> bool:
            calls["unmet"] += 1
            if calls["unmet"] > 1:
                boom()
            return False

        bad.unmet = unmet
    w, _ = _ipc_window(1)
    with caplog.at_level(logging.WARNING, logger="pycoll.transports.cuda_ipc"):
        watchdog.watch(bad)
        end = time.monotonic() + 5
        while id(bad) in watchdog._waiting and time.monotonic() < end:
            time.sleep(0.01)
        assert id(bad) not in watchdog._waiting
        assert "no longer looked after" in caplog.text and "unreadable" in caplog.text
        _wait_released(w)  # a later wait, on the same thread or a new one
        w._conn._closed_peer.store(2)
        while w.abandoned is None and time.monotonic() < end:
            time.sleep(0.01)
    assert isinstance(w.abandoned, PeerClosedError) and w._done_peer.load() == 1


def test_a_connection_raises_what_the_watchdog_saw_at_its_next_use() -> None:
    from transports.cuda_ipc.rings import CudaIpcConnection

    exc = PeerClosedError("cuda_ipc: peer 0 (pid 9) has exited", peer=0)
    conn = SimpleNamespace(_closed=False, peer=0, _win=SimpleNamespace(abandoned=exc))
    with pytest.raises(PeerClosedError, match="has exited"):
        CudaIpcConnection._check_open(conn)


def test_an_exposure_already_ready_needs_no_stream_wait() -> None:
    """Opening exposure k enqueues a stream wait for the peer's "ready" word
    only where that word has not reached k yet: a peer whose host stored it
    (its stream was idle) has final buffers."""
    from transports.base import Deadline

    w, waits = _ipc_window()
    w._exposed_peer.store(1)
    w._ready_peer.store(1)
    assert w.open(0, Deadline.after(5)) == [] and waits == []
    w._exposed_peer.store(2)  # exposed, its stream still busy: the word says 1
    w.open(0, Deadline.after(5))
    assert waits == [2] and (w.opened_ready, w.opened_waiting) == (1, 1)
    w._exposed_peer.store(3)
    w._ready_peer.store(3)
    w.open(0, Deadline.after(5))
    assert waits == [2] and w.opened == 3


@pytest.mark.parametrize(
    "word,seq,reached",
    [
        (5, 5, True),
        (6, 5, True),
        (4, 5, False),
        (0, 0xFFFFFFFF, True),  # the stream's 32 bits wrapped past seq
        (0xFFFFFFFF, 1 << 32, False),
        ((1 << 32) | 3, (1 << 32) + 3, True),  # the host's 64-bit store
        (3, (1 << 32) + 3, True),  # the stream's 32-bit write of the same count
    ],
)
def test_the_ready_word_compares_as_the_stream_wait_does(
    word: int, seq: int, reached: bool
) -> None:
    from transports.cuda_ipc.windows import _reached

    assert _reached(word, seq) is reached


def test_an_exposure_to_a_closed_peer_raises_before_it_is_shown(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A peer that closed its end (it failed or left) never opens nor releases
    what we expose: the exposure raises at once, storing nothing, rather than
    leave our stream waiting on the device for a release that never comes."""
    from transports.base import Deadline
    from transports.cuda_ipc import windows as ipc

    monkeypatch.setattr(ipc, "stream_idle", lambda stream: True)
    w, _ = _ipc_window()
    w.expose([], 0, Deadline.after(5))
    assert (w.exposed, w._exposed_me.load(), w._ready_me.load()) == (1, 1, 1)
    w._conn._closed_peer.store(1)
    with pytest.raises(PeerClosedError, match="closed"):
        w.expose([], 0, Deadline.after(5))
    assert (w.exposed, w._exposed_me.load(), w._ready_me.load()) == (1, 1, 1)


def test_an_opening_checks_the_tag_of_the_exposing_call(monkeypatch: pytest.MonkeyPatch) -> None:
    """An exposure carries its call's tag; the peer's opening compares it with
    its own call's and, where they differ (the ranks run different calls of
    the same sizes: an allreduce against a broadcast, another communicator's
    call, calls out of order), raises TagMismatchError before it maps or
    enqueues anything."""
    from transports.base import Deadline
    from transports.cuda_ipc import windows as ipc

    monkeypatch.setattr(ipc, "stream_idle", lambda stream: True)
    a, _ = _ipc_window(0)
    b, waits = _ipc_window(1, a._mm)
    a.expose([], 0, Deadline.after(5), tag=(7 << 32) | 1)
    assert b.open(0, Deadline.after(5), tag=(7 << 32) | 1) == [] and b.opened == 1
    # a plan's spans handed again (with their handles) are not described again,
    # but each exposure still carries its own call's tag
    same = [DeviceSpan(0, 0, 0, 0, b"h" * 64, 0)]
    for seq in range(2, 7):
        a._released_peer.store(seq - 1)  # b released the one before
        a.expose(same, 0, Deadline.after(5), tag=(7 << 32) | seq)
        assert b.open(0, Deadline.after(5), tag=(7 << 32) | seq)[0].nbytes == 0
    a._released_peer.store(6)
    a.expose(same, 0, Deadline.after(5), tag=(9 << 32) | 7)
    with pytest.raises(TagMismatchError, match="another call") as info:
        b.open(0, Deadline.after(5), tag=(7 << 32) | 7)
    got = (info.value.got, info.value.expected, info.value.peer)
    assert got == ((9 << 32) | 7, (7 << 32) | 7, 0) and info.value.of == "window"
    assert b.opened == 6 and waits == []


def test_the_windows_hand_their_call_tag_to_the_connection() -> None:
    """pycoll's windows give each exposure and opening the running call's tag."""
    seen: list[tuple[str, int]] = []
    conn = SimpleNamespace(
        expose=lambda spans, stream, deadline, tag: seen.append(("expose", tag)),
        open_window=lambda stream, deadline, tag: seen.append(("open", tag)) or [],
    )
    W = object.__new__(Windows)
    W.conns, W._sptr, W.deadline, W.tag = {1: conn}, 0, None, (5 << 32) | 3
    W._spans = lambda arrays, written: ([], [])
    W.expose([1], [])
    with pytest.raises(TagMismatchError):  # no spans came back: the sizes check
        W.open(1, F4, 12)
    assert seen == [("expose", (5 << 32) | 3), ("open", (5 << 32) | 3)]


def test_a_window_of_another_call_is_named_as_a_mismatch() -> None:
    """The engine's error for an opening that met another call's exposure names
    both calls, as it does for a message."""
    from pycoll.guard import Call, mismatch
    from pycoll.reduce import ReduceOp

    mine = Call("allreduce", 1 << 18, F4, ReduceOp.SUM, 0, "direct")
    theirs = Call("broadcast", 1 << 18, F4, None, 0, "direct")
    exc = TagMismatchError(
        "cuda_ipc: peer 1 exposed buffers for another call",
        got=(theirs.fp << 32) | 5,
        expected=(mine.fp << 32) | 5,
        of="window",
        peer=1,
        transport="cuda_ipc",
    )
    err = mismatch(0, 5, mine, exc, {mine.fp: mine, theirs.fp: theirs})
    assert "rank 1 exposed its buffers for its call #5 (broadcast(" in str(err)
    assert "where this rank runs call #5 (allreduce(" in str(err) and err.ranks == (1,)
    sizes = TagMismatchError(
        "windows: rank 1 exposed buffers of [12] bytes", got=12, expected=24, of="sizes"
    )
    assert str(mismatch(0, 5, mine, sizes, {})).endswith("exposed buffers of [12] bytes")


@pytest.mark.parametrize(
    "stat,gone",
    [
        (b"42 (python) R 1 42 42 0 -1 4194560 0 0", False),  # running
        (b"42 (python) S 1 42 42 0 -1 4194564 0 0", True),  # PF_EXITING (0x4) set
        (b"42 (python) Z 1 42 42 0 -1 4194560 0 0", True),  # a zombie
        (b"42 (a) Z (b) S 1 42 42 0 -1 4194560 0 0", False),  # a name holding ") Z ("
        (b"42 (a) Z (b) D 1 42 42 0 -1 4194564 0 0", True),
    ],
)
def test_a_peer_that_has_begun_to_exit_is_gone(
    stat: bytes, gone: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A peer whose exit waits in the kernel (its flags say PF_EXITING) runs no more
    of its code: the watchdog must not wait for it as for a live one."""
    import io

    from transports import _segment

    monkeypatch.setattr(_segment.os, "kill", lambda pid, sig: None)
    monkeypatch.setattr("builtins.open", lambda path, mode="r": io.BytesIO(stat))
    assert _segment.process_gone(42) is gone


def test_close_raises_a_let_go_stream_no_call_reported() -> None:
    """A stream the watchdog let go after its call returned: the output was wrong,
    so close() raises when no later call did (the device context hands the
    connections' stream_failure up), and not when one did."""
    import pycoll
    from pycoll.gpu.context import GpuContext

    lost = PeerClosedError("cuda_ipc: peer 0 (pid 9) has exited", peer=0)
    ctx = object.__new__(GpuContext)
    ctx.inflight = SimpleNamespace(close=lambda: None)
    ctx.dconns = {
        0: SimpleNamespace(stream_failure=lambda: None),
        1: SimpleNamespace(stream_failure=lambda: lost),
    }
    ctx._close = ctx._scratch = ctx._back = ctx._back_event = ctx._pool = None
    ctx._mirrors = {}
    assert GpuContext.close(ctx) is lost and ctx.dconns == {}

    comm = pycoll.init()
    comm._engine.fam.gpu = SimpleNamespace(close=lambda: lost)
    with pytest.raises(pycoll.CommunicatorClosedError, match="no later call reported") as ei:
        comm.close()
    assert ei.value.__cause__ is lost
    comm = pycoll.init()
    comm._engine.fam.gpu = SimpleNamespace(close=lambda: lost)
    comm._engine.fam.failed = RuntimeError("reported by a call")
    comm.close()  # a call raised already: nothing more
