"""How a communicator runs its calls: inline or on its worker thread, one at a
time, each numbered, tagged and recorded, and how a failure ends them.

* **Execution.** A blocking call runs inline on the caller's thread while
  nothing is queued; ``async_op=True`` calls (and blocking ones made behind
  them) run in submission order on one worker thread.  A device call's host
  part runs on the worker too (:mod:`pycoll.gpu.jobs`).
* **One at a time.** A lock taken without waiting: a call that enters while
  another thread's collective runs fails, and so does the one it overlapped
  (:class:`ConcurrentCallError`); the communicator is then unusable.
* **Numbering.** Each call takes the next sequence number; its messages carry
  it with the call's fingerprint (:mod:`pycoll.guard`).  A call rejected for
  its arguments takes a number too (:meth:`Engine.reject`).
* **The flight recorder** keeps the last 32 calls; a timeout asks the other
  ranks where they are (:mod:`pycoll.diagnose`) and names the ranks that did
  not arrive.
* **Failure.** Every error but a user error leaves the communicator unusable
  (``failed``); transport errors become pycoll's at this boundary.  A failure
  owed to a peer (it closed or died, or timed out) names the rank that failed
  first, and this rank closes its connections telling every peer so (at once
  when a peer is gone, at ``close`` after a timeout): see :mod:`pycoll.errors`.
"""

from __future__ import annotations

import collections
import logging
import threading
import traceback
import zlib
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from time import monotonic
from typing import TYPE_CHECKING, Any, NoReturn

import numpy as np

from pycoll import algorithms, guard
from pycoll.algorithms import cost, direct
from pycoll.algorithms.links import Links
from pycoll.collectives import COLLECTIVES
from pycoll.config import TRACE, Config
from pycoll.diagnose import RankStatus, StatusChannel, decode, grace_for, summary
from pycoll.errors import (
    CollectiveMismatchError,
    CollectiveTimeout,
    CommunicatorClosedError,
    ConcurrentCallError,
    InvalidArgumentError,
    PeerAbortedError,
    PycollError,
    from_transport,
)
from pycoll.gpu.jobs import Job
from pycoll.guard import (
    AGREE_FP,
    CHECK_FP,
    FINGERPRINTS_MAX,
    M32,
    Call,
    fingerprint,
    fingerprinted,
)
from pycoll.plans import RECVBUF, SENDBUF, Kind, Plan, Plans, make_room
from pycoll.reduce import ReduceOp, ufunc
from pycoll.requests import DeviceRequest, Request
from transports.base import (
    Backoff,
    Deadline,
    PeerClosedError,
    TagMismatchError,
    TransportTimeout,
)
from transports.base import TransportError as WireError

if TYPE_CHECKING:
    from pycoll.family import Family

log = logging.getLogger(__name__)

replay_c: Any
try:  # the compiled entry of replayed calls (pycoll/_replay.c), built where a C compiler is
    from pycoll import _replay as replay_c
except ImportError:  # pragma: no cover - an install without a compiler
    replay_c = None

WORKER = "pycoll-progress"  # the name of the worker (progress) thread
_COLL_IDS = {c.name: c.ident for c in COLLECTIVES.values()}
_COLL_NAMES = {v: k for k, v in _COLL_IDS.items()}

#: The flight recorder keeps each call as a list ``[seq, call, started, ended,
#: status]`` (a :class:`Record` when read): the fast path makes one every call,
#: and a list costs half of what a dataclass does (0.22 against 0.48 us).
_SEQ, _CALL, _STARTED, _ENDED, _STATUS = range(5)


@dataclass(frozen=True, slots=True)
class Record:
    """One entry of the flight recorder: the recent collectives of this rank."""

    seq: int
    call: Call
    started: float
    ended: float | None = None
    status: str = "running"

    @property
    def collective(self) -> str:
        return self.call.collective

    def __str__(self) -> str:
        c = self.call
        dur = "" if self.ended is None else f" {1e6 * (self.ended - self.started):.0f}us"
        op = "-" if c.op is None else c.op.value
        return (
            f"#{self.seq} {c.collective}(count={c.count}, dtype={c.dtype}, "
            f"op={op}, root={c.root}, algo={c.algorithm}) {self.status}{dur}"
        )


class Engine:
    """The execution state of one communicator (see the module docstring).

    Args:
        rank, size, config: the communicator's.
        fam: the family it belongs to (shared with its sub-communicators).
        conns, kinds, group: its connections by its ranks, their transports, and
            the group segment its ranks share (or None).
        members: its ranks' ranks in the family's root communicator.
        ctx: its context: a number every member agrees on, folded into the
            fingerprint of its calls, so that no call of one communicator pairs
            with a call of another on the shared connections.
        bootstrap: for the status exchange of a timeout (None: no exchange).
        crowded: some host runs more ranks than it has cores (every rank's verdict).
        backoff: how this rank's blocking calls wait (its host's verdict).
    """

    def __init__(
        self,
        rank: int,
        size: int,
        config: Config,
        fam: Family,
        conns: dict[int, Any],
        kinds: dict[int, str],
        group: Any,
        members: tuple[int, ...],
        ctx: int,
        bootstrap: Any,
        crowded: bool,
        backoff: Backoff,
    ) -> None:
        self.rank = rank
        self.size = size
        self.config = config
        self.fam = fam
        self.conns = conns
        self.group = group
        self.kinds = dict(kinds)
        self.kinds[rank] = "self"
        self.members = members
        self.ctx = ctx
        self.crowded = crowded
        self.backoff = backoff
        self.closed = False
        self.p2p = fam.p2p
        self.enter, self.leave = fam.enter, fam.leave
        self.seq = 0
        # the current call's message tag and fingerprint (execute sets them for
        # links(); steps set their own), and the calls seen, by fingerprint
        self.tag = 0
        self.fp = 0
        self.fps: dict[int, Call] = {}
        self.recent: collections.deque[list[Any]] = collections.deque(maxlen=32)
        self.links_cache: dict[tuple[Any, ReduceOp | None], Links] = {}
        # through the attribute, so that a test may count the steps made
        self.compiled_entry = replay_c is not None and config.compiled
        self.plans = Plans(
            lambda k: self.make_step(k),
            self.seen,
            replay_c.Fit if self.compiled_entry else None,
            direct.compiled.Step if self.compiled_entry and direct.compiled is not None else None,
        )
        self.status = StatusChannel(bootstrap) if bootstrap is not None else None

    # the family's, read by tests and the communicator
    @property
    def failed(self) -> BaseException | None:
        return self.fam.failed

    @property
    def executor(self) -> ThreadPoolExecutor | None:
        return self.fam.executor

    @property
    def wiring(self) -> Any:
        return self.fam.wiring

    @property
    def inflight(self) -> int:
        return self.fam.inflight

    # ------------------------------------------------------------------ state
    def check_open(self, what: str) -> None:
        fam = self.fam
        if self.closed or fam.closed:
            raise CommunicatorClosedError(f"rank {self.rank}: {what}: communicator is closed")
        if fam.failed is not None:
            if not threading.current_thread().name.startswith(WORKER):
                fam.unseen = False  # reported to the caller
            raise CommunicatorClosedError(
                f"rank {self.rank}: {what}: communicator is unusable after an earlier "
                f"failure: {fam.failed}"
            ) from fam.failed

    def records(self) -> list[Record]:
        return [Record(*e) for e in self.recent]

    def recent_calls(self) -> list[str]:
        return [str(r) for r in self.records()]

    def seen(self, call: Call) -> None:
        """Keep ``call`` by fingerprint, to name a peer's call in a mismatch."""
        fp = call.fp
        if fp not in self.fps:
            make_room(self.fps, FINGERPRINTS_MAX)
            self.fps[fp] = call

    def shutdown(self) -> None:
        """Stop taking calls and drop the plans (they hold views of the group segment)."""
        self.closed = True
        self.plans.clear()

    def close_wiring(self) -> None:
        self.fam.close_wiring()
        self.conns = {}
        if self.status is not None:
            self.status.close()

    # ------------------------------------------------------------------ links and steps
    def links(self, dtype: np.dtype[Any], op: ReduceOp | None) -> Links:
        """The Links for (dtype, op), reused across calls.

        Their deadline is PYCOLL_TIMEOUT of inactivity: each wait re-arms it, so
        a call sets none.  Only one collective runs at a time and each ends with
        ``finish()``, so a cached Links holds no pending request between calls.
        """
        key = (dtype, op)
        L = self.links_cache.get(key)
        if L is None or L.conns is not self.conns:
            L = Links(
                self.rank,
                self.size,
                self.conns,
                Deadline(None, self.config.timeout),
                self.config.chunk_bytes,
                dtype,
                None if op is None else ufunc(op),
                self.backoff,
                self.group,
                self.crowded,
            )
            self.links_cache[key] = L
        L.tag, L.fp = self.tag, self.fp  # the running call's (see execute)
        fam = self.fam
        L._backoff = fam.polite if threading.current_thread() is not fam.caller else self.backoff
        L.patient = self.backoff
        L.use_compiled = self.config.compiled
        return L

    def make_step(self, key: tuple[Any, ...]) -> Callable[[Any, Any], None]:
        """``step(x, out)`` of ``key`` = (collective, algorithm, dtype, op, count,
        root, tuner, thread): the algorithm on flat host arrays, made once; with
        a tuner, the algorithm it names for each call."""
        what, algo, dtype, op, count, root, tuner, _ = key
        if tuner is not None:
            steps = [self.plans.step((what, a, dtype, op, count, root, None)) for a in tuner.names]
            return tuner.over(steps)
        L = self.links(dtype, op)
        bo = L.backoff  # the waiting policy of this thread
        # made once: a call adds a store (a routed algorithm's names it: guard.ROUTED)
        fp = fingerprint(fingerprinted(what, algo), count, dtype, op, root, self.ctx)
        if algo in direct.GROUP_ALGORITHMS:
            fast = direct.prepare(what, L, bo, count, root, fp, self.config.compiled, algo)
            if fast is not None:
                return fast
        hi = fp << 32
        g = algorithms.get(what, algo)
        sig = COLLECTIVES[what].signature

        # one closure per signature of the algorithms: a call adds no argument shuffling
        if sig == ("x", "root"):

            def step(a: Any, b: Any) -> None:
                L._backoff = bo  # an asynchronous call may have left another one
                L.tag, L.fp = hi | (self.seq & M32), fp  # replay has counted this call
                g(L, a, root)

        elif sig == ("x", "out", "root"):

            def step(a: Any, b: Any) -> None:
                L._backoff = bo
                L.tag, L.fp = hi | (self.seq & M32), fp
                g(L, a, b, root)

        elif sig == ():

            def step(a: Any, b: Any) -> None:
                L._backoff = bo
                L.tag, L.fp = hi | (self.seq & M32), fp
                g(L)

        else:

            def step(a: Any, b: Any) -> None:
                L._backoff = bo
                L.tag, L.fp = hi | (self.seq & M32), fp
                g(L, a, b)

        return step

    def agree(self, v: np.ndarray, names: tuple[str, ...]) -> np.ndarray:
        """``v`` summed over the ranks by the model's pick of allreduce ``names``,
        the same bits on each (a tuner's round ends with it)."""
        out = np.empty_like(v)
        L = self.links(v.dtype, ReduceOp.SUM)
        # every rank agrees at the same call, by whichever path it runs it
        fp = AGREE_FP ^ self.ctx
        L.tag, L.fp = (fp << 32) | (self.seq & M32), fp
        a = cost.choose(
            "allreduce",
            names,
            self.size,
            v.nbytes,
            self.config.chunk_bytes,
            self.config.group_slot_bytes,
        )
        algorithms.get("allreduce", a)(L, v, out)
        return out

    # ------------------------------------------------------------------ running
    def submit(
        self, run: Callable[[], Any], async_op: bool, call: Call, ident: int, numbered: bool = True
    ) -> Any:
        """Run ``run`` as call ``call``: now, or queued behind the worker's calls
        (``async_op``: on the worker, returning a :class:`Request`).  ``numbered``:
        a collective (else a point-to-point call, which takes no sequence number)."""
        fam = self.fam
        if async_op:
            with fam.lock:
                fut = self._queue(self.execute, run, call, ident, numbered)
            fut.add_done_callback(self.done)
            return Request(fut, call.collective, self.rank)
        with fam.lock:
            queued = fam.inflight > 0
            if queued:
                fut = self._queue(self.execute, run, call, ident, numbered)
        if queued:
            fut.add_done_callback(self.done)
            try:
                return fut.result()
            except CommunicatorClosedError:
                fam.unseen = False  # an earlier device failure, reported here
                raise
        return self.execute(run, call, ident, numbered)

    def _queue(self, fn: Callable[..., Any], *args: Any) -> Future[Any]:
        """Queue ``fn(*args)`` on the worker (the caller holds the family's lock)."""
        fam = self.fam
        if fam.executor is None:
            fam.executor = ThreadPoolExecutor(1, thread_name_prefix=WORKER)
        fut = fam.executor.submit(fn, *args)
        fam.inflight += 1
        return fut

    def submit_device(
        self,
        job: Job,
        run: Callable[[], Any],
        result: Any,
        async_op: bool,
        call: Call,
        ident: int,
        gpu: Any,
        like: Any,
    ) -> Any:
        """Hand a started device collective to the worker and return at once:
        ``result`` (its output), or a :class:`DeviceRequest`; without eager module
        loading a blocking one runs as a host call does (:mod:`pycoll.gpu.jobs`).
        The caller's side is already enqueued."""
        if not job.gated and not async_op:  # lazy module loading: as a host call
            try:
                self.submit(run, False, call, ident)
            finally:
                job.settle()
            return result
        try:
            with self.fam.lock:
                fut = self._queue(self._execute_device, job, async_op, run, call, ident)
        except BaseException:
            job.settle()  # it will never run: no stream may wait for it
            raise
        fut.add_done_callback(self.done)
        if async_op:
            return DeviceRequest(fut, call.collective, self.rank, job, result, like, gpu)
        return result

    def _execute_device(
        self, job: Job, async_op: bool, run: Callable[[], Any], call: Call, ident: int
    ) -> Any:
        """:meth:`execute` on the worker, for a device collective.  Its gate opens
        whatever happens; a blocking call's failure, which no caller holds a
        Request for, leaves the communicator unusable and is raised by the next
        call or by ``close``."""
        fam = self.fam
        try:
            return self.execute(run, call, ident)
        except BaseException as exc:
            if not async_op:
                if fam.failed is None:
                    fam.failed = exc
                if fam.failed is exc:
                    fam.unseen = True
            raise
        finally:
            job.settle()

    def done(self, _: Future[Any]) -> None:
        with self.fam.lock:
            self.fam.inflight -= 1

    def call_tag(self) -> int:
        """The running call's tag: what its messages and device windows carry."""
        return self.tag

    def execute(self, run: Callable[[], Any], call: Call, ident: int, numbered: bool = True) -> Any:
        """Run one call: number, tag and record it, check it (PYCOLL_CHECK), fail it.
        A collective first completes the point-to-point calls posted before it."""
        fam = self.fam
        self.check_open(call.collective)
        if not self.enter(False):
            self._intruded(call.collective)
        try:
            if numbered:
                self.seq = seq = self.seq + 1
                fp = self.fp = call.fp
                self.tag = (fp << 32) | (seq & M32)  # what links() gives this call's messages
                self.seen(call)
            else:
                seq = self.seq
            rec: list[Any] = [seq, call, monotonic(), None, "running"]
            self.recent.append(rec)
            trace = log.isEnabledFor(TRACE)
            if trace:
                log.log(TRACE, "start %s", Record(*rec))
            try:
                if numbered:
                    if self.p2p.live:
                        self.p2p.drain(self.backoff)
                    if self.config.check:
                        self._check_match(seq, call, ident)
                result = run()
            except BaseException as exc:
                self.fail(rec, exc, numbered)
        finally:
            self.leave()
        if fam.failed is not None:  # another thread's call came in meanwhile
            self._overlapped(rec)
        rec[_ENDED] = monotonic()
        rec[_STATUS] = "ok"
        if trace:
            log.log(TRACE, "done %s", Record(*rec))
        return result

    def entry(self, slow: Callable[..., Any]) -> Callable[..., Any]:
        """The public methods' entry: ``slow`` (:meth:`pycoll.dispatch.Dispatch.call`)
        behind the compiled entry (:mod:`pycoll._replay`), which runs the plans
        of NumPy arrays as :meth:`replay` would and hands it every other call;
        ``slow`` itself without it (PYCOLL_COMPILED=0, or not built)."""
        if not self.compiled_entry:
            return slow
        e = replay_c.Entry(
            slow,
            self.plans.plans,
            self.fam,
            self,
            self.p2p,
            self.enter,
            self.leave,
            self.recent.append,
            log.isEnabledFor,
            TRACE,
            self.fail,
            self._overlapped,
            np.ndarray,
            self.plans,
            self.plans.weak_plans,
            self.plans.kinds,
        )
        self.plans.on_clear = e.forget
        return e  # type: ignore[no-any-return]

    def replay(self, p: Plan | Kind, sendbuf: Any, recvbuf: Any) -> Any:
        """Run a plan or a kind of call (the fast path): what :meth:`execute` does,
        minus the checks that its making already did."""
        if not self.enter(False):
            self._intruded(p.call.collective)
        try:
            self.seq = seq = self.seq + 1
            rec: list[Any] = [seq, p.call, monotonic(), None, "running"]
            self.recent.append(rec)
            trace = log.isEnabledFor(TRACE)
            if trace:
                log.log(TRACE, "start %s", Record(*rec))
            try:
                if self.p2p.live:
                    self.p2p.drain(self.backoff)
                if type(p) is Plan:
                    result = p.go()
                    if result is None:
                        result = p.res
                else:
                    fp = self.fp = p.call.fp
                    self.tag = (fp << 32) | (seq & M32)  # a device plan's windows carry it
                    result = p.run(sendbuf, recvbuf)  # type: ignore[union-attr]
            except BaseException as exc:
                self.fail(rec, exc)
        finally:
            self.leave()
        if self.fam.failed is not None:  # another thread's call came in meanwhile
            self._overlapped(rec)
        rec[_ENDED] = monotonic()
        rec[_STATUS] = "ok"
        if trace:
            log.log(TRACE, "done %s", Record(*rec))
        if result is SENDBUF:
            return sendbuf
        return recvbuf if result is RECVBUF else result

    # ------------------------------------------------------------------ failures
    def _intruded(self, what: str) -> NoReturn:
        """A call found another thread's call running: fail it, and leave the
        communicator unusable so that the running one fails too."""
        fam = self.fam
        cur = self.recent[-1] if self.recent else None
        running = f" (its last: #{cur[_SEQ]} {cur[_CALL].collective})" if cur is not None else ""
        err = ConcurrentCallError(
            f"rank {self.rank}: {what}: called while another thread's call runs on this "
            f"communicator{running} or one that shares its connections; collectives pair up "
            "across ranks by their order, and "
            "calls that overlap have none that every rank shares, so both fail and the "
            "communicator is unusable.  Call collectives from one thread at a time (the "
            "next after the last returned), or queue them with async_op=True",
            rank=self.rank,
        )
        if fam.failed is None:
            fam.failed = err
        self.plans.clear()
        raise err

    def _overlapped(self, rec: list[Any]) -> NoReturn:
        """Call ``rec`` ran while the communicator failed on another thread: its
        result is not to be trusted."""
        failed = self.fam.failed
        rec[_STATUS] = "failed: overlapped"
        where = f"rank {self.rank}: {rec[_CALL].collective} #{rec[_SEQ]}"
        if isinstance(failed, ConcurrentCallError):
            err: PycollError = ConcurrentCallError(
                f"{where}: another thread called a collective while this one ran; its result "
                f"cannot be trusted (peers may have paired it with another call): {failed}",
                rank=self.rank,
            )
        else:
            err = CommunicatorClosedError(
                f"{where}: the communicator failed on another thread while this collective "
                f"ran: {failed}"
            )
        raise err from failed

    def fail(self, rec: list[Any], exc: BaseException, numbered: bool = True) -> NoReturn:
        """Record the failure of call ``rec`` and raise it as a pycoll error.

        Transport errors become pycoll's; every error but a user error (and a
        point-to-point message refused for its size) leaves the communicator,
        and the family that shares its connections, unusable.
        """
        fam = self.fam
        where = f"{rec[_CALL].collective} #{rec[_SEQ]}"
        if isinstance(exc, TagMismatchError):
            mis = guard.mismatch(self.rank, rec[_SEQ], rec[_CALL], exc, self.fps)
            mis.__cause__ = exc
            exc = mis
        elif fam.closed and not isinstance(exc, (PycollError, KeyboardInterrupt)):
            # close() or abort() tore the connections down under the call:
            # one class whatever the transport made of it (its error is the cause)
            how = "aborted" if fam.aborted else "closed"
            err: PycollError = CommunicatorClosedError(
                f"rank {self.rank}: {where}: the communicator was {how} while it ran"
            )
            err.__cause__ = exc
            exc = err
        elif isinstance(exc, WireError):
            if fam.blame is None:
                fam.blame = blame(exc, fam.rank)
            err = from_transport(exc, self.rank, where, self.kinds, fam.rank)
            err.__cause__ = exc
            exc = err
        rec[_STATUS] = f"failed: {type(exc).__name__}"
        if isinstance(exc, InvalidArgumentError) or getattr(exc, "_contained", False):
            exc._counted = True  # type: ignore[attr-defined]  # this call took its number
            raise exc
        if fam.failed is None:
            fam.failed = exc
        self.plans.clear()
        # The finished frames below us may hold views of shared segments; the
        # error outlives them, so drop their locals, or close() could not unmap them.
        for e in (exc, exc.__cause__):
            if e is not None:
                traceback.clear_frames(e.__traceback__)
        if isinstance(exc, PycollError):
            exc.recorder = tuple(self.recent_calls())
            if isinstance(exc, CollectiveTimeout) and numbered:
                self._explain_timeout(exc)
            # Raised, so not logged at ERROR too (the user would see it twice).
            log.info("rank %d raises: %s", self.rank, exc)
            log.info("flight recorder of rank %d:\n  %s", self.rank, "\n  ".join(exc.recorder))
        if fam.wiring is not None and (
            isinstance(exc, CollectiveMismatchError)
            or (isinstance(exc, PeerAbortedError) and fam.blame is not None)
        ):
            # The peers may wait for bytes this rank will never send: closing every
            # connection and the group makes them fail now, not at the timeout,
            # and names to them the rank that failed first (fam.blame).
            self.close_wiring()
        raise exc

    def reject(self, what: str) -> None:
        """Count a call that was rejected for its arguments: it takes a sequence
        number (and a step of the group's chain) as if it had run.

        Ranks that all reject a call stay in step; a rank that alone rejects it
        and goes on is one call apart, and its next collective raises
        :class:`CollectiveMismatchError` on every rank instead of pairing off by
        one for the rest of the job.  Behind queued asynchronous calls it counts in turn."""
        fam = self.fam
        with fam.lock:
            if fam.inflight:
                self._queue(self._skip, what).add_done_callback(self.done)
                return
        self._skip(what)

    def _skip(self, what: str) -> None:
        self.seq += 1
        now = monotonic()
        call = Call(what, 0, None, None, 0, "-", self.ctx)
        self.recent.append([self.seq, call, now, now, "rejected: InvalidArgumentError"])
        if self.group is not None and self.fam.wiring is not None:
            self.group.skip(zlib.crc32(f"rejected|{what}".encode()) ^ self.ctx)

    def _explain_timeout(self, exc: CollectiveTimeout) -> None:
        """Ask the live ranks where they are (pycoll.diagnose) and say it in ``exc``."""
        recs = self.records()
        cur = recs[-1]
        mine = summary(self.rank, recs, _COLL_IDS)
        got = (
            {}
            if self.status is None
            else self.status.exchange(mine, grace_for(self.config.timeout))
        )
        reports = {self.rank: decode(mine, _COLL_NAMES)}
        for p, words in got.items():
            reports[p] = decode(words, _COLL_NAMES)
        status: dict[int, str] = {}
        arrived: list[int] = []
        for p in range(self.size):
            st = reports.get(p)
            if st is None:
                status[p] = str(RankStatus(p, answered=False))
                continue
            status[p] = str(st)
            if st.current_seq == cur.seq and st.current == cur.collective and st.state != "done":
                arrived.append(p)
        missing = [p for p in range(self.size) if p not in arrived]
        exc.waiting_on = exc.missing
        exc.status = status
        if got:  # else nobody answered: the peers we waited on are all we know
            exc.missing = tuple(missing) or exc.waiting_on
        exc.args = (
            f"{exc.args[0]}: no progress for {self.config.timeout:g} s (PYCOLL_TIMEOUT); "
            f"ranks that did not arrive at {cur.collective} #{cur.seq}: {list(exc.missing)}; "
            f"status: {'; '.join(status.values())}; recent collectives on rank {self.rank}: "
            + " | ".join(self.recent_calls()[-4:]),
        )

    def _check_match(self, seq: int, call: Call, ident: int) -> None:
        def allgather(sig: np.ndarray, out: np.ndarray) -> None:
            L = self.links(sig.dtype, None)
            fp = CHECK_FP ^ self.ctx  # the same on every rank, whatever its call
            L.tag, L.fp = fp << 32, fp
            algorithms.get("allgather", "ring")(L, sig, out)

        guard.check_match(self.rank, self.size, seq, call, ident, _COLL_NAMES, allgather)


def blame(exc: WireError, me: int) -> int | None:
    """The rank that a transport error is owed to (transport numbering), or None.

    A peer that closed or died is; so is the rank it named as the reason it
    closed, unless that is this rank ``me`` (it saw this rank fail: nobody else
    to name); a timeout is owed to the first peer it waited for.
    """
    if isinstance(exc, PeerClosedError):
        if exc.cause_rank is None:
            return exc.peer
        return None if exc.cause_rank == me else exc.cause_rank
    if isinstance(exc, TransportTimeout) and exc.pending:
        return exc.pending[0]
    return None
