"""Device collectives as progress-thread jobs (pycoll.gpu.jobs), on CPU with fakes.

A fake CUDA runtime records what streams would wait for and which gates were
written; the communicator's side (a failure after the call returned reaches the
next call, or close) runs on a real one-rank communicator.  tests/gpu checks the
same on a device.
"""

from __future__ import annotations

import itertools
import sys
import threading

import numpy as np
import pytest

import pycoll
from pycoll.buffers import as_buffer
from pycoll.gpu.jobs import GATES, Gates, Inflight, Job
from pycoll.guard import Call

pytestmark = pytest.mark.timeout(60)


class _Rt:
    """Events are ints; ``done`` holds the completed ones."""

    def __init__(self) -> None:
        self._ids = itertools.count(1)
        self.done: set[int] = set()
        self.destroyed: list[int] = []

    def eventCreateWithFlags(self, flags: int) -> int:
        return next(self._ids)

    def eventRecord(self, ev: int, stream: int) -> None:
        pass

    def eventQuery(self, ev: int) -> int:
        return 0 if ev in self.done else 600

    def eventDestroy(self, ev: int) -> None:
        self.destroyed.append(ev)


class _Gates(Gates):
    def __init__(self) -> None:
        self.writes: list[tuple[int, int, int]] = []
        self.waits: list[tuple[int, int, int]] = []
        super().__init__(
            0x1000, 99, lambda *a: self.writes.append(a), lambda *a: self.waits.append(a)
        )


class _Job(Job):
    def __init__(self, gates: Gates, rt: _Rt, stream: int = 7) -> None:
        super().__init__(gates, rt)
        self.gates.wait(stream, self.seq)
        self.retire = self.event(stream)
        self.keep.append(np.ones(3))


def test_gates_are_one_word_per_collective() -> None:
    g = _Gates()
    seqs = [g.issue() for _ in range(3)]
    assert seqs == [1, 2, 3]
    g.wait(5, 2)
    g.open(6, 2)
    g.open_now(GATES + 2)  # the same word, a later collective
    assert g.waits == [(5, 0x1000 + 8, 2)]
    assert g.writes == [(6, 0x1000 + 8, 2), (99, 0x1000 + 8, GATES + 2)]


def test_settle_opens_a_gate_only_once() -> None:
    g, rt = _Gates(), _Rt()
    ok, bad = _Job(g, rt), _Job(g, rt)
    ok.open_after(3)
    ok.settle()
    bad.settle()  # the progress thread's part never opened it: failed
    bad.settle()
    assert g.writes == [(3, 0x1000 + 4, 1), (99, 0x1000 + 8, 2)]
    assert not ok.failed and bad.failed


def test_inflight_keeps_buffers_until_retired() -> None:
    g, rt = _Gates(), _Rt()
    fl = Inflight(rt, timeout=5.0, rank=0)
    a, b, c = _Job(g, rt), _Job(g, rt), _Job(g, rt)
    for j in (a, b, c):
        fl.add(j)
    a.open_after(3)
    b.open_after(3)
    rt.done.add(b.retire)  # b is over, but a (older) is not: nothing retires yet
    fl.reap()
    assert len(fl) == 3 and a.keep and b.keep
    assert not fl.complete(a) and fl.complete(b)
    rt.done.add(a.retire)
    fl.reap()
    assert len(fl) == 1 and not a.keep and not b.keep and c.keep
    assert a.retire in rt.destroyed
    fl.stream_wait(a, 11)  # retired: nothing to wait for
    fl.stream_wait(c, 11)
    assert g.waits[-1] == (11, 0x1000 + 12, 3)
    # c fails: opened from the side stream, kept (with its buffers) until close
    c.settle()
    rt.done.add(c.retire)
    fl.reap()
    assert len(fl) == 0 and c.keep
    fl.close()
    assert not c.keep and c.retire in rt.destroyed


def test_close_opens_the_gates_of_jobs_that_never_ran() -> None:
    g, rt = _Gates(), _Rt()
    fl = Inflight(rt, timeout=0.2, rank=0)
    j = _Job(g, rt)
    fl.add(j)
    fl.close()  # bounded: its retire event never completes here
    assert (99, 0x1000 + 4, 1) in g.writes and not j.keep


def test_host_wait_is_bounded() -> None:
    g, rt = _Gates(), _Rt()
    fl = Inflight(rt, timeout=5.0, rank=3)
    j = _Job(g, rt)
    fl.add(j)
    with pytest.raises(pycoll.CollectiveTimeout, match="rank 3"):
        fl.wait(j, 0.05)
    j.open_after(1)
    rt.done.add(j.retire)
    fl.wait(j, 1.0)


class _FakeJob:
    gated = True  # as with eager module loading: the call returns at once

    def __init__(self) -> None:
        self.settled = threading.Event()

    def settle(self) -> None:
        self.settled.set()


@pytest.mark.parametrize("where", ["next call", "close"])
def test_a_progress_thread_failure_reaches_the_caller(where: str) -> None:
    """The call returned its output; the job failed later: its gate is settled,
    the communicator is unusable, and the next call (else close) raises it."""
    comm = pycoll.init()
    x = np.ones(4, np.float32)
    buf = as_buffer(x, 0, "allreduce", "sendbuf", writable=True)
    job = _FakeJob()

    def run() -> None:
        raise RuntimeError("lost on the progress thread")

    call = Call("allreduce", buf.count, buf.dtype, None, 0, "ring")
    got = comm._engine.submit_device(job, run, x, False, call, 1, None, x)  # type: ignore[arg-type]
    assert got is x
    assert job.settled.wait(10)
    assert comm._engine.executor is not None
    comm._engine.executor.submit(lambda: None).result(10)  # the failed job is over
    if where == "next call":
        with pytest.raises(pycoll.CommunicatorClosedError, match="lost on the") as ei:
            comm.allreduce(x)
        assert isinstance(ei.value.__cause__, RuntimeError)
        comm.close()
    else:
        with pytest.raises(pycoll.CommunicatorClosedError, match="no later call reported"):
            comm.close()
        comm.close()


def test_external_stream_through_the_stream_protocol(monkeypatch: pytest.MonkeyPatch) -> None:
    """A foreign stream handle becomes a CuPy stream by the CUDA stream protocol
    where CuPy has ``Stream.from_external`` (CuPy 14 deprecates ExternalStream,
    and pycoll's own deprecation warnings fail its tests), on its device."""
    import types

    from pycoll.gpu import external_stream

    seen: list[tuple[str, object, int]] = []
    current = [0]

    class Device:
        def __init__(self, d: int) -> None:
            self.d = d

        def __enter__(self) -> None:
            current.append(self.d)

        def __exit__(self, *_: object) -> None:
            current.pop()

    class Stream:
        @classmethod
        def from_external(cls, obj: object) -> str:
            seen.append(("protocol", obj.__cuda_stream__(), current[-1]))  # type: ignore[attr-defined]
            return "stream"

    def external(ptr: int, device: int) -> str:
        seen.append(("ExternalStream", ptr, device))
        return "old"

    cuda = types.SimpleNamespace(Device=Device, Stream=Stream, ExternalStream=external)
    monkeypatch.setitem(sys.modules, "cupy", types.SimpleNamespace(cuda=cuda))
    assert external_stream(0xABC, 3) == "stream"
    assert seen == [("protocol", (0, 0xABC), 3)]
    del Stream.from_external
    assert external_stream(0xABC, 3) == "old"
    assert seen[-1] == ("ExternalStream", 0xABC, 3)
