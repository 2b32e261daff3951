"""Say "closed" to every peer when the interpreter exits without ``close()``.

A rank that leaves through an uncaught exception or ``sys.exit`` stays alive
while the interpreter finalizes (mpi4py's ``MPI_Finalize`` waits there for
the other ranks), so its shared-memory and RDMA peers see neither a dead pid
nor a closed socket and would wait out their whole timeout.  Every connection
and segment that has a peer registers here (:func:`watch`); at exit each one's
``mark_exiting()`` tells its peers, as ``close()`` would, but frees nothing
(another thread may still be in a collective): the shm family stores its
"closed" flag, RDMA posts its goodbye message.

The registry holds its objects strongly until they close (:func:`forget`):
one dropped without close() (its communicator a local of a frame that
``sys.exit`` unwound) is still marked at exit, rather than collected unseen.

Rule: the mark runs in an :mod:`atexit` callback, and every :func:`watch`
registers that callback again, so it comes after (and runs before, atexit being
last-in first-out) every callback registered before this communicator existed.
mpi4py finalizes MPI after all atexit callbacks (its hook is the interpreter's
C-level one), so the mark always precedes ``MPI_Finalize``.  A forked child
inherits the registry but not the connections: only the process that watched
an object marks it.
"""

from __future__ import annotations

import atexit
import logging
import os
from typing import Protocol

log = logging.getLogger(__name__)


class Exiting(Protocol):
    def mark_exiting(self) -> None: ...


_watched: dict[int, Exiting] = {}
_pid = 0


def watch(obj: Exiting) -> None:
    """Call ``obj.mark_exiting()`` when this process's interpreter exits, unless
    :func:`forget` came first."""
    global _watched, _pid
    if _pid != os.getpid():  # first use, or a forked child: the parent's objects are not ours
        _watched = {}
        _pid = os.getpid()
    _watched[id(obj)] = obj
    atexit.unregister(_at_exit)
    atexit.register(_at_exit)


def forget(obj: Exiting) -> None:
    """``obj`` closed: nothing to mark at exit."""
    if _watched.get(id(obj)) is obj:
        del _watched[id(obj)]


def _at_exit() -> None:
    if _pid != os.getpid():
        return
    for obj in list(_watched.values()):
        try:
            obj.mark_exiting()
        except Exception as exc:  # the process is going anyway: tell the rest
            log.debug("marking %r closed at exit: %s", obj, exc)
