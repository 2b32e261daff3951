"""Who is stuck where: the status exchange behind :class:`~pycoll.CollectiveTimeout`.

When a collective times out, the ranks that are still alive tell each other
what their flight recorder says: the collective they are in and the last one
they completed.  The exchange runs over the communicator's bootstrap (a private
duplicate of the MPI communicator, or the key-value store), so it depends on
none of pycoll's own connections, and it never waits past a short grace period:

* each rank that times out sends its summary (a few int64 words, never pickled)
  to every other rank and listens for theirs until all have answered or the
  grace period ends;
* ranks stuck in the same collective time out at about the same moment and so
  meet inside that window; a rank that never arrived (busy elsewhere, hung in
  user code, or dead) sends nothing, and that silence names it;
* a communicator exchanges at most once (it is unusable after the timeout), so
  stale messages can never be mistaken for fresh ones.

The same bootstrap carries *failure notices* (:class:`Notice`): a rank that
sees a peer fail, that aborts, or whose threads overlap tells every other rank
which rank failed and when, before it closes anything.  A rank that then sees
a live neighbour close names the rank that failed first (the earliest notice),
and says that its neighbour closed because of it.  Waits poll for notices only
at their slow periodic checks, and a raised peer error once.

Nothing here runs on the fast path.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

log = logging.getLogger(__name__)

_WORDS = 8
_MAGIC = 0x7063_6F6C_6C73_7431  # "pcollst1"
# states of the newest flight-recorder entry
_NONE, _RUNNING, _OK, _FAILED = 0, 1, 2, 3
_STATE_NAMES = {_NONE: "idle", _RUNNING: "running", _OK: "done", _FAILED: "failed"}
_NOTICE_MAGIC = 0x7063_6F6C_6C66_6131  # "pcollfa1"
#: what a notice says the failed rank did
GONE, OVERLAP, ABORTED = 1, 2, 3
_CAUSES = {
    GONE: "exited or closed its connections",
    OVERLAP: "called collectives from two threads at once",
    ABORTED: "aborted its communicator",
}
#: how often a waiting collective looks for notices (seconds)
_POLL_EVERY = 0.05


@dataclass(frozen=True)
class Notice:
    """Rank ``origin`` saw rank ``culprit`` fail (``cause``) at wall-clock time
    ``at`` (seconds since the epoch)."""

    origin: int
    culprit: int
    cause: int
    at: float

    @property
    def how(self) -> str:
        return _CAUSES.get(self.cause, "failed")

    def __str__(self) -> str:
        seen = "" if self.origin == self.culprit else f", as rank {self.origin} saw"
        return f"rank {self.culprit} {self.how}{seen}"

    def words(self) -> bytes:
        w = (_NOTICE_MAGIC, self.origin, self.culprit, self.cause, int(self.at * 1e6))
        return np.array(w, np.int64).tobytes()

    @classmethod
    def parse(cls, data: bytes, origin: int) -> Notice | None:
        """The notice in ``data`` sent by ``origin``; None when it is not one."""
        if len(data) != 5 * 8:
            return None
        w = [int(v) for v in np.frombuffer(data, np.int64)]
        if w[0] != _NOTICE_MAGIC or w[1] != origin:
            return None
        return cls(w[1], w[2], w[3], w[4] / 1e6)


@dataclass(frozen=True)
class RankStatus:
    """What one rank reported (or ``answered=False`` when it stayed silent)."""

    rank: int
    answered: bool
    current_seq: int = 0
    current: str = ""
    state: str = ""
    last_done_seq: int = 0
    last_done: str = ""

    def __str__(self) -> str:
        if not self.answered:
            return (
                f"rank {self.rank}: no answer (not inside a pycoll collective: busy "
                "elsewhere, hung, or gone)"
            )
        done = (
            f"last completed #{self.last_done_seq} {self.last_done}"
            if self.last_done_seq
            else "completed none"
        )
        cur = f"#{self.current_seq} {self.current} {self.state}" if self.current_seq else "idle"
        return f"rank {self.rank}: {cur}; {done}"


def summary(rank: int, records: Sequence[Any], coll_ids: dict[str, int]) -> np.ndarray:
    """This rank's flight recorder as ``_WORDS`` int64 words."""
    out = np.zeros(_WORDS, np.int64)
    out[0] = _MAGIC
    out[1] = rank
    if records:
        cur = records[-1]
        out[2] = cur.seq
        out[3] = coll_ids.get(cur.collective, 0)
        status = str(cur.status)
        out[4] = _OK if status == "ok" else _FAILED if status.startswith("failed") else _RUNNING
        for rec in reversed(records):
            if rec.status == "ok":
                out[5] = rec.seq
                out[6] = coll_ids.get(rec.collective, 0)
                break
    return out


def decode(words: np.ndarray, coll_names: dict[int, str]) -> RankStatus | None:
    """Parse a summary; None when it is not one."""
    if words.size != _WORDS or int(words[0]) != _MAGIC:
        return None
    w = [int(v) for v in words]
    return RankStatus(
        rank=w[1],
        answered=True,
        current_seq=w[2],
        current=coll_names.get(w[3], "?"),
        state=_STATE_NAMES.get(w[4], "?"),
        last_done_seq=w[5],
        last_done=coll_names.get(w[6], "?"),
    )


class StatusChannel:
    """The one status exchange of a communicator, over its bootstrap
    (:meth:`pycoll.rendezvous.Bootstrap.exchange`)."""

    def __init__(self, bootstrap: Any) -> None:
        self._boot: Any = bootstrap
        self.rank: int = bootstrap.rank
        self.size: int = bootstrap.size
        self._exchanged = False
        self._told = False
        self._notices: list[Notice] = []
        self._next_poll = 0.0
        self._lock = threading.Lock()  # notices are polled from the worker thread too

    @property
    def available(self) -> bool:
        return self._boot is not None and self.size > 1 and not self._exchanged

    def exchange(self, mine: np.ndarray, grace: float) -> dict[int, np.ndarray]:
        """Send ``mine`` to every rank and collect what arrives within ``grace`` seconds."""
        boot = self._boot
        if boot is None or self._exchanged:
            return {}
        self._exchanged = True  # at most once per communicator
        got = boot.exchange(np.ascontiguousarray(mine, np.int64).tobytes(), grace)
        return {
            p: np.frombuffer(b, np.int64).copy() for p, b in got.items() if len(b) == _WORDS * 8
        }

    def notify(self, culprit: int, cause: int) -> None:
        """Tell every other rank that ``culprit`` failed (``cause``); at most once
        per communicator, never waiting."""
        with self._lock:
            boot = self._boot
            if boot is None or self.size == 1 or self._told:
                return
            self._told = True
            note = Notice(self.rank, culprit, cause, time.time())
            self._notices.append(note)
            boot.post(note.words(), culprit)

    def first(self, grace: float = 0.0) -> Notice | None:
        """The earliest failure notice so far (this rank's own included), waiting
        up to ``grace`` seconds for one; None when there is none.  Without grace it
        asks the bootstrap at most every ``_POLL_EVERY`` seconds."""
        notes = self._wait(grace, lambda notes: bool(notes))
        return min(notes, key=lambda n: n.at) if notes else None

    def about(self, peer: int, grace: float) -> tuple[Notice | None, Notice | None]:
        """For a ``peer`` seen to close: the earliest notice, and the one ``peer``
        sent (why it closed), waiting up to ``grace`` seconds for a notice from
        ``peer`` or one that names it."""
        notes = self._wait(grace, lambda ns: any(peer in (n.origin, n.culprit) for n in ns))
        own = [n for n in notes if n.origin == peer]
        first = min(notes, key=lambda n: n.at) if notes else None
        return first, (own[0] if own else None)

    def _wait(self, grace: float, enough: Callable[[list[Notice]], bool]) -> list[Notice]:
        end = time.monotonic() + grace
        nap = 0.002
        while True:
            with self._lock:
                now = time.monotonic()
                if self._boot is not None and (grace or now >= self._next_poll):
                    self._next_poll = now + _POLL_EVERY
                    for p, msgs in self._boot.poll().items():
                        self._notices += [n for m in msgs if (n := Notice.parse(m, p))]
                notes = list(self._notices)
            if enough(notes) or time.monotonic() >= end:
                return notes
            time.sleep(nap)
            nap = min(2 * nap, 0.02)

    def close(self) -> None:
        """Drop the bootstrap (the communicator closes it)."""
        with self._lock:
            self._boot = None


def grace_for(timeout: float) -> float:
    """How long a timed-out rank waits for the others' status."""
    return min(10.0, max(0.5, timeout / 4))
