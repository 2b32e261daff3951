"""The host side of cuda_ipc connections, on CPU, over a plain host segment with
a stand-in CUDA runtime (copies and events that do nothing): ring pieces carry
their message's tag, written and read where a peer would see them; a close
announced before the connection is released names its cause to the peer."""

from __future__ import annotations

import mmap
from collections import deque
from types import SimpleNamespace
from typing import Any

import pytest

from transports.base import DeviceSpan, TagMismatchError
from transports.cuda_ipc import rings
from transports.cuda_ipc.layout import _SEG_BYTES


class _Runtime:
    def memcpyAsync(self, dst: int, src: int, n: int, kind: int, stream: int) -> None:
        pass

    def eventRecord(self, ev: int, stream: int) -> None:
        pass

    def eventQuery(self, ev: int) -> int:
        return 0  # done


def _conn(side: int, mm: mmap.mmap) -> Any:
    """The host side of one end of a connection over ``mm`` (both ends share it)."""
    c = object.__new__(rings.CudaIpcConnection)
    c.peer, c.device, c._rt = 1 - side, 0, _Runtime()
    c.nslots, c.slot_bytes = 4, 4096
    c._mm, c._ring, c._peer_ring, c._sink_stream = mm, 1 << 40, 2 << 40, 9
    c._out, c._in = rings._Dir(mm, side), rings._Dir(mm, 1 - side)
    c._events = SimpleNamespace(get=lambda: 1, put=lambda ev: None)
    c._issued = c._sent = c._consumed = c._recvd = 0
    c._to_issue, c._copying, c._to_sink, c._sinking = deque(), deque(), deque(), deque()
    return c


@pytest.mark.parametrize("same", [True, False])
def test_a_piece_of_another_call_is_refused_before_its_sink(same: bool) -> None:
    mm = mmap.mmap(-1, _SEG_BYTES)
    a, b = _conn(0, mm), _conn(1, mm)
    sent = rings._IpcSend(a, DeviceSpan(3 << 40, 6000, 0, 5), (7 << 32) | 2)
    a._to_issue.append(sent)
    a._progress_sends()  # two pieces copied and published
    assert sent._done and a._out.head.load() == 2
    handed: list[tuple[int, int]] = []
    want = (7 << 32) | 2 if same else (8 << 32) | 2
    recv = rings._IpcRecv(b, 6000, lambda off, span: handed.append((off, span.nbytes)), want)
    b._to_sink.append(recv)
    if same:
        b._progress_recvs()
        assert handed == [(0, 4096), (4096, 1904)] and recv._done
    else:
        with pytest.raises(TagMismatchError, match="disagree on the call") as info:
            b._progress_recvs()
        assert (info.value.got, info.value.expected) == ((7 << 32) | 2, want)
        assert handed == []


def test_an_announced_close_names_its_cause_to_the_peer() -> None:
    """A rank whose communicator failed announces the close of its device
    connections before it releases them: the peer's next check raises
    PeerClosedError naming the rank that failed, and the exit hook keeps it."""
    from transports import _atomic, _segment
    from transports.base import PeerClosedError
    from transports.cuda_ipc.layout import _CLOSED_OFF

    mm = mmap.mmap(-1, _SEG_BYTES)
    a = _conn(0, mm)
    a._closed, a._closed_me = False, _atomic.Counter(mm, _CLOSED_OFF[0])
    seen_by_b = _atomic.Counter(mm, _CLOSED_OFF[0])
    _segment.check_alive(seen_by_b, 0, "cuda_ipc: peer 0", peer=0, transport="cuda_ipc")
    a.announce_close(3)
    a.mark_exiting()  # (the interpreter exits before close())
    with pytest.raises(PeerClosedError, match="because rank 3 failed") as info:
        _segment.check_alive(seen_by_b, 0, "cuda_ipc: peer 0", peer=0, transport="cuda_ipc")
    assert info.value.cause_rank == 3


def test_a_failure_that_closes_the_wiring_announces_the_device_side() -> None:
    from pycoll.family import Family

    told: list[int | None] = []
    fam = object.__new__(Family)
    fam.wiring = SimpleNamespace(close=lambda blame: None)
    fam.gpu = SimpleNamespace(announce_closed=told.append)
    fam.blame = 2
    fam.close_wiring()
    fam.close_wiring()  # once
    assert told == [2] and fam.wiring is None
