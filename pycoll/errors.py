"""pycoll's exceptions: one root, user errors apart from system errors.

::

    PycollError
    ├── InvalidArgumentError (also ValueError)   bad input, raised before any byte moves
    ├── UnsupportedError                         a valid request this build/machine cannot do
    ├── CommunicatorClosedError                  used after close() / after a failure
    ├── CollectiveMismatchError                  ranks called different collectives, or out of step
    ├── ConcurrentCallError                      two threads ran collectives on one communicator at once
    └── TransportError                           a connection failed: rank, peer, transport, errno
        ├── ConnectError                         set-up failed, or no transport reaches a peer
        ├── PeerAbortedError                     a peer exited or aborted (the first to fail)
        └── CollectiveTimeout                    ranks did not arrive within PYCOLL_TIMEOUT

System errors carry ``rank``, ``peer`` and ``transport`` (None where there is
none) and keep the transport's own exception as ``__cause__``
(:func:`translate` does the mapping at the boundary).

Blame.  A rank whose collective fails because of a peer closes its connections
saying which rank failed (``Connection.close_because``), so a rank that is no
neighbour of a dead one hears of it from a live one: its
:class:`PeerAbortedError` names the rank that failed first as ``peer``, and
the live rank it heard it from as ``via`` ("rank 3 closed its connections
because rank 2 failed"), never blaming that one.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import transports.base as tb


class PycollError(Exception):
    """Root of every error pycoll raises.

    Attributes:
        recorder: for a failed collective, this rank's flight recorder (its
            recent collectives, oldest first) at the moment of the failure.
    """

    recorder: tuple[str, ...] = ()


class InvalidArgumentError(PycollError, ValueError):
    """A bad argument; raised on the calling rank before any byte moves."""


class _Located(PycollError):
    """An error that says where: this rank, and the peer and transport if any."""

    def __init__(
        self,
        message: str,
        *,
        rank: int | None = None,
        peer: int | None = None,
        transport: str | None = None,
    ) -> None:
        super().__init__(message)
        self.rank = rank
        self.peer = peer
        self.transport = transport


class UnsupportedError(_Located):
    """A valid request that this installation or machine cannot serve; ``rank``,
    ``peer`` and ``transport`` where known (None otherwise)."""


class CommunicatorClosedError(PycollError):
    """The communicator was closed, or a failed collective left it unusable."""


class CollectiveMismatchError(_Located):
    """Ranks called different collectives, counts, dtypes, ops or roots, or are
    out of step (one skipped a call).

    Found by the guard that every message carries (its tag, see
    :func:`pycoll.communicator.fingerprint`), or by ``PYCOLL_CHECK=1``'s
    comparison before the call.

    Attributes:
        rank: this rank.
        ranks: every rank whose call differs from this rank's (as far as this
            rank knows: the guard names the peer whose message said so).
        peer: the first of them (None if none differs from this rank's call).
        transport: the connection the mismatched message came by, or None
            (PYCOLL_CHECK's comparison).
    """

    def __init__(
        self,
        message: str,
        *,
        rank: int | None = None,
        ranks: Sequence[int] = (),
        transport: str | None = None,
    ) -> None:
        super().__init__(message, rank=rank, peer=ranks[0] if ranks else None, transport=transport)
        self.ranks = tuple(ranks)


class ConcurrentCallError(_Located):
    """Two threads ran collectives on one communicator at the same time.

    Collectives pair up across ranks by the order in which they run, and calls
    that overlap on one rank have no order that every rank shares: both calls
    fail (the one that entered second at once, the one already running when it
    ends) and the communicator is unusable, rather than pair a call with another
    rank's different one.  ``rank``: this rank; ``peer`` and ``transport``: None.
    """


class TransportError(_Located):
    """A failure on a connection; names this rank, the peer and the transport."""

    def __init__(
        self,
        message: str,
        *,
        rank: int | None = None,
        peer: int | None = None,
        transport: str | None = None,
        errno: int | None = None,
    ) -> None:
        super().__init__(message, rank=rank, peer=peer, transport=transport)
        self.errno = errno


class ConnectError(TransportError):
    """Connection set-up failed, or no transport can reach a peer."""


class PeerAbortedError(TransportError):
    """A peer exited, aborted or closed its end in the middle of a collective.

    Attributes:
        peer: the rank that failed first, as far as this rank knows: the one it
            saw exit or close, or the one named by a peer that closed because
            of it.
        via: the live peer that closed its connections because ``peer``
            failed, and told this rank so; None when this rank saw ``peer`` go
            itself.  ``transport`` is that of the connection it learnt it by.
    """

    def __init__(self, message: str, *, via: int | None = None, **kw: object) -> None:
        super().__init__(message, **kw)  # type: ignore[arg-type]
        self.via = via


class CollectiveTimeout(TransportError):
    """A collective did not finish within the timeout; ``missing`` names the ranks.

    Attributes:
        missing: the ranks that did not arrive (silent in the status exchange, or
            elsewhere); when every rank arrived, the peers this rank waited on.
        waiting_on: the peers whose bytes this rank was still waiting for.
        status: rank -> what it reported (its current and last completed
            collective with sequence numbers), or why it did not answer.
    """

    def __init__(self, message: str, *, missing: Sequence[int] = (), **kw: object) -> None:
        super().__init__(message, **kw)  # type: ignore[arg-type]
        self.missing = tuple(missing)
        self.waiting_on = self.missing
        self.status: dict[int, str] = {}


def from_transport(
    exc: tb.TransportError,
    rank: int,
    what: str,
    transport_of: dict[int, str],
    me: int | None = None,
) -> TransportError | CollectiveMismatchError:
    """The pycoll exception for a :mod:`transports` exception (raise it ``from exc``).

    ``me``: this rank as the transports number it (its rank in the root
    communicator, ``rank`` where None), to tell when a peer closed because of it.
    """
    if isinstance(exc, tb.TagMismatchError):
        return CollectiveMismatchError(
            f"rank {rank}: {what}: mismatched collectives: {exc}",
            rank=rank,
            ranks=() if exc.peer is None else (exc.peer,),
            transport=exc.transport,
        )
    if isinstance(exc, tb.TransportTimeout):
        peers = list(exc.pending)
        via = ", ".join(f"{p}={transport_of.get(p, '?')}" for p in peers)
        return CollectiveTimeout(
            f"rank {rank}: {what} timed out waiting for rank(s) {peers} (transports: {via})",
            missing=peers,
            rank=rank,
            peer=peers[0] if peers else None,
            transport=transport_of.get(peers[0]) if peers else None,
        )
    cls: type[TransportError] = TransportError
    if isinstance(exc, tb.PeerClosedError):
        cause = exc.cause_rank
        if cause is not None and cause != exc.peer:
            return _closed_because(exc, cause, rank, what, rank if me is None else me)
        cls = PeerAbortedError
    elif isinstance(exc, tb.ConnectError):
        cls = ConnectError
    return cls(
        f"rank {rank}: {what}: {exc}",
        rank=rank,
        peer=exc.peer,
        transport=exc.transport,
        errno=exc.errno,
    )


def _closed_because(
    exc: tb.PeerClosedError, cause: int, rank: int, what: str, me: int
) -> PeerAbortedError:
    """Peer ``exc.peer`` closed its connections because rank ``cause`` failed."""
    if cause == me:  # it saw this rank fail (say, time out): nobody else to name
        return PeerAbortedError(
            f"rank {rank}: {what}: rank {exc.peer} closed its connections because it saw "
            f"this rank fail ({exc})",
            rank=rank,
            peer=exc.peer,
            transport=exc.transport,
            errno=exc.errno,
        )
    return PeerAbortedError(
        f"rank {rank}: {what}: rank {exc.peer} closed its connections because rank {cause} "
        f"failed ({exc})",
        rank=rank,
        peer=cause,
        via=exc.peer,
        transport=exc.transport,
        errno=exc.errno,
    )


@contextlib.contextmanager
def translate(rank: int, what: str, transport_of: dict[int, str]) -> Iterator[None]:
    """Map :mod:`transports` exceptions to pycoll's at the layer boundary."""
    try:
        yield
    except tb.TransportError as exc:
        raise from_transport(exc, rank, what, transport_of) from exc
