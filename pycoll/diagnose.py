"""Who is stuck where: the status exchange behind :class:`~pycoll.CollectiveTimeout`.

When a collective times out, the ranks that are still alive tell each other
what their flight recorder says: the collective they are in and the last one
they completed.  The exchange runs over a private duplicate of the bootstrap's
MPI communicator (made once, at :func:`pycoll.init`), so it depends on none of
pycoll's own connections, and it uses only non-blocking point-to-point calls
with a short grace period:

* each rank that times out sends its summary (a few int64 words, never pickled)
  to every other rank and listens for theirs until all have answered or the
  grace period ends;
* ranks stuck in the same collective time out at about the same moment and so
  meet inside that window; a rank that never arrived (busy elsewhere, hung in
  user code, or dead) sends nothing, and that silence names it;
* a communicator exchanges at most once (it is unusable after the timeout), so
  stale messages can never be mistaken for fresh ones.

Nothing here runs on the fast path: the channel costs one ``Dup`` at start-up
and one ``Free`` at close.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

log = logging.getLogger(__name__)

_TAG = 0x7C0D
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
    """A private MPI communicator for the one status exchange of a communicator."""

    def __init__(self, mpi_comm: Any) -> None:
        self._comm: Any = None
        self._keep: list[Any] = []  # buffers and requests that must outlive a late message
        self.rank: int = mpi_comm.Get_rank()
        self.size: int = mpi_comm.Get_size()
        if self.size == 1 or not hasattr(mpi_comm, "Dup"):
            return
        try:
            comm = mpi_comm.Dup()
            try:
                from mpi4py import MPI

                comm.Set_errhandler(MPI.ERRORS_RETURN)
            except Exception:  # not mpi4py's MPI: keep its default
                pass
            self._comm = comm
        except Exception as exc:  # diagnosis is best effort, never a start-up failure
            log.info("status channel unavailable: %s", exc)

    @property
    def available(self) -> bool:
        return self._comm is not None

    def exchange(self, mine: np.ndarray, grace: float) -> dict[int, np.ndarray]:
        """Send ``mine`` to every rank and collect what arrives within ``grace`` seconds."""
        got: dict[int, np.ndarray] = {}
        comm = self._comm
        if comm is None:
            return got
        self._comm = None  # at most once per communicator
        bufs = {p: np.zeros(_WORDS, np.int64) for p in range(self.size) if p != self.rank}
        sends, recvs = [], {}
        try:
            for p, buf in bufs.items():
                recvs[p] = comm.Irecv(buf, source=p, tag=_TAG)
                sends.append(comm.Isend(mine, dest=p, tag=_TAG))
            end = time.monotonic() + grace
            while recvs and time.monotonic() < end:
                for p, req in list(recvs.items()):
                    if req.Test():
                        got[p] = bufs[p]
                        del recvs[p]
                if recvs:
                    time.sleep(0.002)
        except Exception as exc:
            log.info("status exchange failed: %s", exc)
        for req in recvs.values():
            try:
                req.Cancel()
            except Exception:
                pass
        # Unanswered requests and their buffers stay referenced until close().
        self._keep += [mine, bufs, sends, list(recvs.values()), comm]
        return got

    def close(self) -> None:
        """Free the duplicate communicator (local; never waits for peers)."""
        comms = [c for c in (self._comm,) if c is not None]
        comms += [k for k in self._keep if hasattr(k, "Free") and hasattr(k, "Dup")]
        self._comm = None
        for c in comms:
            try:
                c.Free()
            except Exception:
                pass
        self._keep.clear()


def grace_for(timeout: float) -> float:
    """How long a timed-out rank waits for the others' status."""
    return min(10.0, max(0.5, timeout / 4))
