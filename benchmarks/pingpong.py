"""Point-to-point ping-pong through each system's public send and receive, for
``versus.py pingpong``.

One call is one round trip: rank 0 sends ``size`` bytes to rank 1 and waits
for them to come back; rank 1 receives them and sends them back.  Other ranks
make no call (they idle through the block).  The time of a message is half the
round trip, and its bandwidth ``size`` / that time (OSU's osu_latency).

Systems: ``pycoll`` (``comm.send`` and ``comm.recv``), ``mpi`` (mpi4py's
``Send`` and ``Recv``) and ``gloo`` (``torch.distributed.send`` and ``recv``),
each on the same two NumPy arrays: rank 0 sends ``send`` and receives into
``recv``; rank 1 receives into ``send`` and sends it back.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from exchanges import rank_data

SYSTEMS = ("pycoll", "mpi", "gloo")
TAG = 7


def _idle() -> None:
    pass


def calls(kind: str, handle: Any, send: Any, recv: Any, rank: int) -> Callable[[], None]:
    """One round trip of ``kind`` on this rank (every system through the same
    two-level call, so none pays more Python than another).

    Args:
        kind: one of :data:`SYSTEMS`.
        handle: the pycoll communicator, mpi4py's ``COMM_WORLD``, or
            ``torch.distributed`` (then ``send`` and ``recv`` are tensors).
    """
    if rank > 1:
        return _idle
    if kind == "pycoll":
        put = lambda b, p: handle.send(b, p, tag=TAG)
        take = lambda b, p: handle.recv(b, p, tag=TAG)
    elif kind == "mpi":
        put = lambda b, p: handle.Send(b, p, tag=TAG)
        take = lambda b, p: handle.Recv(b, p, tag=TAG)
    elif kind == "gloo":
        put = lambda b, p: handle.send(b, p, tag=TAG)
        take = lambda b, p: handle.recv(b, p, tag=TAG)
    else:
        raise KeyError(kind)
    peer = 1 - rank
    if rank == 0:

        def ping() -> None:
            put(send, peer)
            take(recv, peer)

        return ping

    def pong() -> None:
        take(send, peer)
        put(send, peer)

    return pong


def load(send: Any, recv: Any, rank: int, dtype: Any, poison: Callable[[Any], None]) -> None:
    """Rank 0's message into ``send``; poison where the message will land."""
    if rank == 0:
        send[...] = rank_data(0, send.size, dtype)
        poison(recv)
    elif rank == 1:
        poison(send)


def landed(send: Any, recv: Any, rank: int) -> Any:
    """Where rank 0's message ends up on this rank (None: it does not)."""
    return recv if rank == 0 else send if rank == 1 else None


def reference(count: int, rank: int, dtype: Any) -> Any:
    """What :func:`landed` must hold after a round trip."""
    return rank_data(0, count, dtype) if rank in (0, 1) else None
