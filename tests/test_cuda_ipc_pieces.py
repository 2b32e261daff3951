"""cuda_ipc's ring pieces carry their message's tag, on CPU: a connection's
send and receive progress run over a plain host segment with a stand-in CUDA
runtime (copies and events that do nothing), the pieces' lengths and tags
written and read where a peer would see them."""

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
