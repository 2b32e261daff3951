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

Nothing here runs on the fast path.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

log = logging.getLogger(__name__)

_WORDS = 8
_MAGIC = 0x7063_6F6C_6C73_7431  # "pcollst1"
# states of the newest flight-recorder entry
_NONE, _RUNNING, _OK, _FAILED = 0, 1, 2, 3
_STATE_NAMES = {_NONE: "idle", _RUNNING: "running", _OK: "done", _FAILED: "failed"}


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

    @property
    def available(self) -> bool:
        return self._boot is not None and self.size > 1

    def exchange(self, mine: np.ndarray, grace: float) -> dict[int, np.ndarray]:
        """Send ``mine`` to every rank and collect what arrives within ``grace`` seconds."""
        boot, self._boot = self._boot, None  # at most once per communicator
        if boot is None:
            return {}
        got = boot.exchange(np.ascontiguousarray(mine, np.int64).tobytes(), grace)
        return {
            p: np.frombuffer(b, np.int64).copy() for p, b in got.items() if len(b) == _WORDS * 8
        }

    def close(self) -> None:
        """Drop the bootstrap (the communicator closes it)."""
        self._boot = None


def grace_for(timeout: float) -> float:
    """How long a timed-out rank waits for the others' status."""
    return min(10.0, max(0.5, timeout / 4))
