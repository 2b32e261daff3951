"""No stream waits forever for a peer that will never come.

A one-sided window queues stream waits on words its peer writes (the peer's
"ready" and "done" counts, in the pair's host segment): on a shared GPU a
non-leader's whole call is an exposure and such a wait, and it returns at
once.  If the peer then dies (killed, ``os._exit``), fails, or stays away past
the call's timeout, nobody writes the word, and the stream, every stream
ordered after it and every device synchronize in the process would wait for
good; on an H100 a leader that exited while its follower's stream waited on
a word in the leader's device memory did not finish exiting either.

One daemon thread per process looks after the windows whose streams wait
(:func:`watch`, until the wait is met or the window closes): every
:data:`PERIOD` seconds it asks each whether its waits are met and, if not,
whether the peer has failed, is gone or is late (the window's ``failure()``).
Then the window stores the awaited counts itself (``abandon()``): the stream
goes on, the outputs that peer should have written are filled with NaN
(0xFF bytes), the error is logged here and the connection raises it at its
next use.  The thread ends after :data:`IDLE_EXIT` seconds with no stream
waiting.  A window that :func:`forget` returned for is never looked at again.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Protocol

from transports.base import TransportError

log = logging.getLogger("pycoll.transports.cuda_ipc")

#: seconds between two looks at the waiting windows (a peer's death is seen
#: about this long after the pid check sees it)
PERIOD = 0.05
#: seconds the thread stays with nothing to look after before it ends (the
#: next wait starts another)
IDLE_EXIT = 2.0


class Watched(Protocol):
    def unmet(self) -> bool: ...

    def failure(self) -> TransportError | None: ...

    def abandon(self, why: TransportError) -> None: ...


_reg = threading.Condition(threading.Lock())  # the registry: held for a moment
_looking = threading.Lock()  # held by the thread while it looks at windows
_waiting: dict[int, Watched] = {}
_thread: threading.Thread | None = None
_pid = 0


def watch(w: Watched) -> None:
    """Look after ``w`` until its stream waits are met (or :func:`forget`);
    called after each stream wait it queues, so it is cheap: a dict store."""
    global _thread, _pid
    with _reg:
        if _pid != os.getpid():  # first use, or a forked child: none of the parent's
            _waiting.clear()
            _thread = None
            _pid = os.getpid()
        wake = not _waiting
        _waiting[id(w)] = w
        if _thread is None:
            _thread = threading.Thread(target=_run, name="pycoll-cuda-ipc-watchdog", daemon=True)
            _thread.start()
        if wake:
            _reg.notify()


def forget(w: Watched) -> None:
    """``w`` closes: never looked at again once this returns."""
    with _looking, _reg:
        _waiting.pop(id(w), None)


def look(w: Watched) -> bool:
    """One look at ``w``: whether it needs no more looking after.  It reads host
    words and the peer's pid, and makes no CUDA call unless it lets a stream
    go (a thread of ours may hold the driver in a device synchronize)."""
    if not w.unmet():
        return True
    why = w.failure()
    if why is None:
        return False
    if not w.unmet():  # the peer wrote it before it went
        return True
    log.error(
        "cuda_ipc: %s while this rank's stream waited for it; the stream was let go, "
        "its output filled with NaN (0xFF bytes), and the connection raises at its next use",
        why,
    )
    w.abandon(why)
    return True


def _run() -> None:
    global _thread
    while True:
        with _reg:
            if not _waiting:
                _reg.wait(IDLE_EXIT)
                if not _waiting:  # nothing to look after for a while: end
                    _thread = None
                    return
            items = list(_waiting.items())
        with _looking:  # forget() waits for the looks to end
            for key, w in items:
                with _reg:
                    if _waiting.get(key) is not w:
                        continue  # forgotten
                try:
                    done = look(w)
                except Exception as exc:
                    _lost(w, exc)
                    done = failed = True
                else:
                    failed = False
                if done:
                    with _reg:  # a wait queued since the look keeps it watched
                        if _waiting.get(key) is w and (failed or not _still_waits(w)):
                            del _waiting[key]
        time.sleep(PERIOD)


def _still_waits(w: Watched) -> bool:
    """``w.unmet()``; a window that cannot tell is dropped (logged): the thread
    must not die of one window, or no later wait would be looked after."""
    try:
        return w.unmet()
    except Exception as exc:
        _lost(w, exc)
        return False


def _lost(w: Watched, exc: Exception) -> None:
    log.warning(
        "cuda_ipc watchdog: looking at a window failed (%s: %s); it is no longer "
        "looked after (its close() still waits with a bound)",
        type(exc).__name__,
        exc,
    )
