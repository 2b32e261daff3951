"""Bootstraps: how the ranks of a communicator meet before any transport exists.

A :class:`Bootstrap` knows this rank and the group's size, and moves small
plain-data objects (None, bool, int, float, str, bytes and tuples, lists, dicts
and sets of them) among the ranks: ``arrive``, ``allgather``, ``bcast`` and
``barrier``, each bounded by a timeout after which it raises
:class:`~pycoll.errors.ConnectError` naming the ranks that did not answer.  It
also carries the one status exchange of :mod:`pycoll.diagnose`.  Two kinds:

* :class:`MpiBootstrap`, over an mpi4py communicator: ``arrive`` makes a private
  duplicate with ``MPI_Comm_idup``, polled against the deadline, and every later
  message is a non-blocking point-to-point one on that duplicate, polled with
  backoff.  No blocking MPI collective is ever called, so a rank that stalls or
  dies hangs nobody, and no receive of the caller's own traffic can take a
  bootstrap message.
* :class:`StoreBootstrap`, over a key-value store with ``set(key, value)``,
  ``get(key)`` and ``wait(keys, timeout)`` (a :class:`datetime.timedelta`), the
  surface of Gloo's ``rendezvous::Store`` and of torch's ``dist.Store``
  (``TCPStore``, ``FileStore``, ``HashStore``, ``PrefixStore``); pycoll's own
  :mod:`pycoll.stores` has two more.  ``check`` and ``add`` are used when the
  store has them.  mpi4py is never imported.

Values are decoded by an unpickler that loads no class or function: a stranger
who can write to a store can garble a bootstrap but never run code in it.
"""

from __future__ import annotations

import io
import logging
import pickle
import time
from datetime import timedelta
from typing import Any, Protocol, runtime_checkable

from pycoll.errors import ConnectError, InvalidArgumentError

log = logging.getLogger(__name__)

#: The tag of the give-up notices of :meth:`MpiBootstrap.arrive` on the caller's
#: communicator: the only messages pycoll ever sends there, and only when some
#: rank has not arrived within the timeout (MPI promises tags up to 32767).
GIVE_UP_TAG = 32_123
#: The tag of the status exchange on the private duplicate; the numbered
#: operations use tags 1 to :data:`_OPS_TAGS`.
STATUS_TAG = 0x7C0D
_OPS_TAGS = 30_000
#: Requests, buffers and half-made duplicates that MPI may still touch.
_abandoned: list[Any] = []


@runtime_checkable
class Bootstrap(Protocol):
    """What :mod:`pycoll.bootstrap` and the communicator need from their bootstrap.

    Every rank of the group calls the same operations in the same order.  Each
    waits at most ``timeout`` seconds, and then raises ConnectError naming the
    ranks that did not answer (stalled, failed elsewhere, or gone); after that
    the bootstrap is unusable.
    """

    rank: int
    size: int

    def arrive(self, timeout: float) -> None:
        """Wait until every rank has entered ``pycoll.init``; name those that did not."""

    def allgather(self, obj: Any, timeout: float, what: str) -> list[Any]:
        """Every rank's ``obj``, by rank."""

    def bcast(self, obj: Any, root: int, timeout: float, what: str) -> Any:
        """``root``'s ``obj`` on every rank."""

    def barrier(self, timeout: float, what: str) -> None:
        """Return once every rank has called it."""

    def exchange(self, payload: bytes, grace: float) -> dict[int, bytes]:
        """Send ``payload`` to every rank, and return what arrived within ``grace``
        seconds (at most once per bootstrap; never raises)."""

    def close(self) -> None:
        """Release what the bootstrap holds; local, never waits."""


# ----------------------------------------------------------------------------- encoding
class _DataOnly(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        raise pickle.UnpicklingError(f"bootstrap data may not name {module}.{name}")


def encode(obj: Any) -> bytes:
    return pickle.dumps(obj, protocol=5)


def decode(data: bytes) -> Any:
    """The object ``data`` encodes; raises for anything but plain data."""
    return _DataOnly(io.BytesIO(data)).load()


class _Base:
    """Numbering, decoding and the error for late ranks, shared by both bootstraps."""

    def __init__(self, rank: int, size: int) -> None:
        self.rank = rank
        self.size = size
        self._seq = 0
        self._broken = ""

    def _next(self, what: str) -> int:
        if self._broken:
            raise ConnectError(
                f"rank {self.rank}: {what}: the bootstrap is unusable ({self._broken})",
                rank=self.rank,
            )
        self._seq += 1
        return self._seq

    def _late(self, late: list[int], timeout: float, what: str) -> ConnectError:
        self._broken = f"rank(s) {late} did not answer in {what}"
        return ConnectError(
            f"rank {self.rank}: {what}: rank(s) {late} of the {self.size} did not answer "
            f"within {timeout:g} s (PYCOLL_TIMEOUT): stalled, failed or gone",
            rank=self.rank,
            peer=late[0],
        )

    def _open(self, seq: int, p: int, data: bytes, what: str) -> Any:
        try:
            got_seq, obj = decode(data)
        except Exception as exc:
            self._broken = f"garbled message from rank {p}"
            raise ConnectError(
                f"rank {self.rank}: {what}: a garbled bootstrap message from rank {p}: {exc}",
                rank=self.rank,
                peer=p,
            ) from None
        if got_seq != seq:
            self._broken = f"rank {p} is out of step"
            raise ConnectError(
                f"rank {self.rank}: {what}: rank {p} is at bootstrap step {got_seq}, this "
                f"rank at {seq}: the ranks did not call the same pycoll set-up",
                rank=self.rank,
                peer=p,
            )
        return obj

    def _gathered(self, seq: int, obj: Any, got: dict[int, bytes], what: str) -> list[Any]:
        """Every rank's object: ``obj`` here, the decoded ``got`` from the others."""
        return [
            obj if p == self.rank else self._open(seq, p, got[p], what) for p in range(self.size)
        ]

    def barrier(self, timeout: float, what: str) -> None:
        self.allgather(None, timeout, what)

    def allgather(self, obj: Any, timeout: float, what: str) -> list[Any]:  # pragma: no cover
        raise NotImplementedError


def _nap(nap: float) -> float:
    time.sleep(nap)
    return min(2 * nap, 0.01)


# ----------------------------------------------------------------------------- MPI
class MpiBootstrap(_Base):
    """A bootstrap over an mpi4py communicator (see the module docstring).

    Args:
        comm: the caller's communicator; pycoll sends nothing on it unless some
            rank is late (then a one-byte give-up notice with tag
            :data:`GIVE_UP_TAG`).
    """

    def __init__(self, comm: Any) -> None:
        super().__init__(comm.Get_rank(), comm.Get_size())
        self._parent = comm
        self._comm: Any = None
        self._pending: list[Any] = []  # what a late message may still touch, kept to close()
        self._status_done = False

    def arrive(self, timeout: float) -> None:
        """Duplicate the caller's communicator, without ever blocking past ``timeout``.

        ``MPI_Comm_idup`` completes only once every rank has called it, which is
        the arrival itself.  A rank whose deadline passes (or that hears another's
        give-up) sends a one-byte give-up notice to every rank on the caller's
        communicator and listens for theirs for a short grace period: the ranks
        that are inside ``init`` answer at once, and the silent ones are named.

        Raises:
            ConnectError: not every rank arrived in time; it names those that did not.
        """
        if self._comm is not None or self.size == 1:
            return
        from mpi4py import MPI

        parent = self._parent
        dup, req = parent.Idup()
        deadline = time.monotonic() + timeout
        nap = 1e-4
        while not req.Test():
            if parent.Iprobe(source=MPI.ANY_SOURCE, tag=GIVE_UP_TAG) or (
                time.monotonic() > deadline
            ):
                self._pending += [dup, req]
                raise self._give_up(timeout)
            nap = _nap(nap)
        dup.Set_errhandler(MPI.ERRORS_RETURN)
        self._comm = dup

    def _give_up(self, timeout: float) -> ConnectError:
        from mpi4py import MPI

        parent = self._parent
        peers = [p for p in range(self.size) if p != self.rank]
        early = time.monotonic()
        self._pending += [parent.Isend(b"\1", dest=p, tag=GIVE_UP_TAG) for p in peers]
        heard: set[int] = set()
        end = early + min(2.0, max(0.5, timeout / 4))
        nap = 1e-4
        while len(heard) < len(peers) and time.monotonic() < end:
            st = MPI.Status()
            msg = parent.Improbe(source=MPI.ANY_SOURCE, tag=GIVE_UP_TAG, status=st)
            if msg is None:
                nap = _nap(nap)
                continue
            buf = bytearray(max(1, st.Get_count(MPI.BYTE)))
            msg.Recv([buf, MPI.BYTE])
            heard.add(st.Get_source())
        late = [p for p in peers if p not in heard]
        self._broken = "init did not complete"
        if late:
            msg_ = (
                f"rank(s) {late} of the {self.size} did not call init within {timeout:g} s "
                "(PYCOLL_TIMEOUT)"
            )
        else:
            msg_ = (
                f"rank(s) {sorted(heard)} gave up waiting (their PYCOLL_TIMEOUT of "
                f"{timeout:g} s passed first) before every rank had called init"
            )
        return ConnectError(
            f"rank {self.rank}: pycoll.init: {msg_}",
            rank=self.rank,
            peer=late[0] if late else None,
        )

    def _ready(self, what: str) -> Any:
        if self._comm is None:
            raise ConnectError(
                f"rank {self.rank}: {what}: the MPI bootstrap has not arrived", rank=self.rank
            )
        return self._comm

    def _post(self, data: bytes, dests: list[int], tag: int) -> list[Any]:
        from mpi4py import MPI

        return [self._comm.Isend([data, MPI.BYTE], dest=p, tag=tag) for p in dests]

    def _collect(
        self, sources: list[int], tag: int, deadline: float, timeout: float, what: str
    ) -> dict[int, bytes]:
        from mpi4py import MPI

        got: dict[int, bytes] = {}
        waiting = list(sources)
        nap = 1e-4
        while waiting:
            for p in list(waiting):
                st = MPI.Status()
                msg = self._comm.Improbe(source=p, tag=tag, status=st)
                if msg is not None:
                    buf = bytearray(st.Get_count(MPI.BYTE))
                    msg.Recv([buf, MPI.BYTE])
                    got[p] = bytes(buf)
                    waiting.remove(p)
            if not waiting:
                break
            if time.monotonic() > deadline:
                raise self._late(waiting, timeout, what)
            nap = _nap(nap)
        return got

    def _finish(
        self, sends: list[Any], dests: list[int], deadline: float, timeout: float, what: str
    ) -> None:
        """Wait for ``sends`` (large ones complete once their receiver takes them)."""
        nap = 1e-4
        while True:
            open_ = [p for p, r in zip(dests, sends, strict=True) if not r.Test()]
            if not open_:
                return
            if time.monotonic() > deadline:
                self._pending += sends
                raise self._late(open_, timeout, what)
            nap = _nap(nap)

    def allgather(self, obj: Any, timeout: float, what: str) -> list[Any]:
        seq = self._next(what)
        if self.size == 1:
            return [obj]
        self._ready(what)
        tag = 1 + seq % _OPS_TAGS
        peers = [p for p in range(self.size) if p != self.rank]
        deadline = time.monotonic() + timeout
        sends = self._post(encode((seq, obj)), peers, tag)
        got = self._collect(peers, tag, deadline, timeout, what)
        self._finish(sends, peers, deadline, timeout, what)
        return self._gathered(seq, obj, got, what)

    def bcast(self, obj: Any, root: int, timeout: float, what: str) -> Any:
        seq = self._next(what)
        if self.size == 1:
            return obj
        self._ready(what)
        tag = 1 + seq % _OPS_TAGS
        deadline = time.monotonic() + timeout
        if self.rank == root:
            peers = [p for p in range(self.size) if p != root]
            self._finish(self._post(encode((seq, obj)), peers, tag), peers, deadline, timeout, what)
            return obj
        got = self._collect([root], tag, deadline, timeout, what)
        return self._open(seq, root, got[root], what)

    def exchange(self, payload: bytes, grace: float) -> dict[int, bytes]:
        from mpi4py import MPI

        got: dict[int, bytes] = {}
        if self._comm is None or self._status_done or self.size == 1:
            return got
        self._status_done = True
        peers = [p for p in range(self.size) if p != self.rank]
        bufs = {p: bytearray(len(payload)) for p in peers}
        recvs: dict[int, Any] = {}
        sends: list[Any] = []
        try:
            for p in peers:
                recvs[p] = self._comm.Irecv([bufs[p], MPI.BYTE], source=p, tag=STATUS_TAG)
                sends.append(self._comm.Isend([payload, MPI.BYTE], dest=p, tag=STATUS_TAG))
            end = time.monotonic() + grace
            while recvs and time.monotonic() < end:
                for p, req in list(recvs.items()):
                    if req.Test():
                        got[p] = bytes(bufs[p])
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
        # unanswered requests and their buffers stay referenced until close()
        self._pending += [payload, bufs, sends, list(recvs.values())]
        return got

    def close(self) -> None:
        comm, self._comm = self._comm, None
        self._broken = self._broken or "closed"
        if comm is not None:
            try:
                comm.Free()
            except Exception:
                pass
        # A duplicate whose MPI_Comm_idup never completed cannot be freed, and MPI
        # may still write into buffers of unanswered messages: keep them.
        _abandoned.extend(self._pending)
        self._pending.clear()


# ----------------------------------------------------------------------------- stores
class Store(Protocol):
    """The key-value store a :class:`StoreBootstrap` needs (torch's ``dist.Store``)."""

    def set(self, key: str, value: bytes) -> None: ...

    def get(self, key: str) -> bytes: ...

    def wait(self, keys: list[str], timeout: timedelta) -> None: ...


_local_inits: dict[int, int] = {}


class StoreBootstrap(_Base):
    """A bootstrap over a key-value store (see the module docstring).

    Keys live under ``<prefix>/<n>/``, where ``n`` counts this rank's bootstraps
    on the store (with the store's ``add`` where it has one, so that a new client
    of the same server agrees; else per store object in this process), so that
    ranks that made the same number of communicators on a store agree on ``n``.

    Args:
        store: an object with ``set``, ``get`` and ``wait(keys, timedelta)``.
        rank: this rank, in ``[0, size)``.
        size: the number of ranks.
        prefix: the key prefix.

    Raises:
        InvalidArgumentError: ``store`` lacks a method, or rank or size is bad.
    """

    def __init__(self, store: Any, rank: int, size: int, prefix: str = "pycoll") -> None:
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise InvalidArgumentError(f"pycoll.init: size={size!r} must be a positive int")
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < size:
            raise InvalidArgumentError(
                f"pycoll.init: rank={rank!r} must be an int in [0, {size}) (size={size})"
            )
        missing = [m for m in ("set", "get", "wait") if not callable(getattr(store, m, None))]
        if missing:
            raise InvalidArgumentError(
                f"rank {rank}: pycoll.init: store={type(store).__name__} has no "
                f"{', '.join(missing)}: a store needs set(key, value), get(key) and "
                "wait(keys, timedelta), like torch.distributed's Store"
            )
        super().__init__(rank, size)
        self._store = store
        if callable(getattr(store, "add", None)):
            n = int(store.add(f"{prefix}/inits/{rank}", 1))
        else:
            n = _local_inits[id(store)] = _local_inits.get(id(store), 0) + 1
        self._p = f"{prefix}/{n}"
        self._status_done = False

    def _key(self, seq: int | str, who: int | str) -> str:
        return f"{self._p}/{seq}/{who}"

    def _has(self, key: str) -> bool:
        check = getattr(self._store, "check", None)
        if callable(check):
            return bool(check([key]))
        try:
            self._store.wait([key], timedelta(milliseconds=1))
        except Exception:
            return False
        return True

    def _wait(
        self, keys: dict[int, str], deadline: float, timeout: float, what: str
    ) -> dict[int, bytes]:
        """The values of ``keys`` (rank -> key), once all are set, or ConnectError."""
        left = max(0.001, deadline - time.monotonic())
        try:
            self._store.wait(list(keys.values()), timedelta(seconds=left))
        except Exception as exc:
            try:
                late = [p for p, k in keys.items() if not self._has(k)]
            except Exception as exc2:
                self._broken = f"the store failed: {exc2}"
                raise ConnectError(
                    f"rank {self.rank}: {what}: the bootstrap store failed: {exc2}",
                    rank=self.rank,
                ) from exc
            if late:
                raise self._late(late, timeout, what) from None
        try:
            return {p: bytes(self._store.get(k)) for p, k in keys.items()}
        except Exception as exc:
            self._broken = f"the store failed: {exc}"
            raise ConnectError(
                f"rank {self.rank}: {what}: the bootstrap store failed: {exc}", rank=self.rank
            ) from exc

    def _set(self, key: str, data: bytes, what: str) -> None:
        try:
            self._store.set(key, data)
        except Exception as exc:
            self._broken = f"the store failed: {exc}"
            raise ConnectError(
                f"rank {self.rank}: {what}: the bootstrap store failed: {exc}", rank=self.rank
            ) from exc

    def arrive(self, timeout: float) -> None:
        seq = self._next("pycoll.init")
        self._set(self._key(seq, self.rank), encode((seq, None)), "pycoll.init")
        others = {p: self._key(seq, p) for p in range(self.size) if p != self.rank}
        try:
            self._wait(others, time.monotonic() + timeout, timeout, "pycoll.init")
        except ConnectError as exc:
            if exc.peer is None:
                raise
            late = [p for p, k in others.items() if not self._has(k)] or [exc.peer]
            raise ConnectError(
                f"rank {self.rank}: pycoll.init: rank(s) {late} of the {self.size} did not "
                f"call init within {timeout:g} s (PYCOLL_TIMEOUT)",
                rank=self.rank,
                peer=late[0],
            ) from None

    def allgather(self, obj: Any, timeout: float, what: str) -> list[Any]:
        seq = self._next(what)
        if self.size == 1:
            return [obj]
        self._set(self._key(seq, self.rank), encode((seq, obj)), what)
        others = {p: self._key(seq, p) for p in range(self.size) if p != self.rank}
        got = self._wait(others, time.monotonic() + timeout, timeout, what)
        return self._gathered(seq, obj, got, what)

    def bcast(self, obj: Any, root: int, timeout: float, what: str) -> Any:
        seq = self._next(what)
        if self.size == 1:
            return obj
        key = self._key(seq, "root")
        if self.rank == root:
            self._set(key, encode((seq, obj)), what)
            return obj
        got = self._wait({root: key}, time.monotonic() + timeout, timeout, what)
        return self._open(seq, root, got[root], what)

    def exchange(self, payload: bytes, grace: float) -> dict[int, bytes]:
        got: dict[int, bytes] = {}
        if self._status_done or self.size == 1:
            return got
        self._status_done = True
        try:
            self._store.set(self._key("status", self.rank), payload)
            end = time.monotonic() + grace
            waiting = {p: self._key("status", p) for p in range(self.size) if p != self.rank}
            while waiting:
                for p, k in list(waiting.items()):
                    if self._has(k):
                        got[p] = bytes(self._store.get(k))
                        del waiting[p]
                if not waiting or time.monotonic() >= end:
                    break
                time.sleep(0.01)
        except Exception as exc:
            log.info("status exchange failed: %s", exc)
        return got

    def close(self) -> None:
        self._broken = self._broken or "closed"
