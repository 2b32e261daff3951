"""The guard: how a rank sees that the ranks' calls do not pair up.

Always on: every message of a call carries its tag (the call's sequence number
in the low 32 bits, its :func:`fingerprint` in the high 32), and every step on
the group segment folds the fingerprint into a chain (:mod:`transports.shm_group`);
a transport that meets another tag raises before any byte reaches the output,
and :func:`mismatch` turns that into a :class:`CollectiveMismatchError` naming
both calls.  With ``PYCOLL_CHECK=1`` the ranks also compare their calls before
each one runs (:func:`check_match`), for a message naming every rank's arguments.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from pycoll import algorithms
from pycoll.errors import CollectiveMismatchError
from pycoll.reduce import DTYPES, ReduceOp
from transports.base import TagMismatchError

M32 = 0xFFFFFFFF
#: Fingerprints of pycoll's own exchanges inside a call, which every rank makes
#: whatever it was called with (PYCOLL_CHECK's, a tuner's agreement).
CHECK_FP = 0x43484B31  # "CHK1"
AGREE_FP = 0x41475231  # "AGR1"
#: Fingerprints of calls this rank made, kept to name a peer's call in a mismatch.
FINGERPRINTS_MAX = 256

_DTYPE_IDS = {dt: i for i, dt in enumerate(DTYPES.values(), 1)}
_OP_IDS = {op: i for i, op in enumerate(ReduceOp, 1)}


def fingerprint(
    collective: str,
    count: int,
    dtype: Any,
    op: ReduceOp | None,
    root: int,
    ctx: int = 0,
    layout: int = 0,
) -> int:
    """The 32-bit fingerprint of a call: what every rank of a matched call shares
    (its communicator's context, the collective, count, dtype, op and root; not
    the algorithm, which ``auto`` may vary per call, nor the arrays).  Derived
    from names, so new dtypes and ops need no table here."""
    dt = "-" if dtype is None else np.dtype(dtype).name
    key = f"{collective}|{count}|{dt}|{'-' if op is None else op.value}|{root}"
    if ctx:  # a sub-communicator's (the root communicator's context is 0)
        key = f"{ctx}|{key}"
    if layout:  # a v-variant's counts
        key = f"{key}|{layout}"
    return zlib.crc32(key.encode())


#: Algorithms that run another one's protocol by another route (``cma``: the
#: group protocol of ``direct``, by address where ``direct`` uses the slots).
#: Their calls' fingerprints name them, unlike every other algorithm's: ranks
#: that ran the two routes of one call would otherwise pair their steps, and one
#: would read a range the other never posted; so they raise a mismatch.
ROUTED = ("cma",)


def fingerprinted(collective: str, algorithm: str) -> str:
    """What :func:`fingerprint` takes as the collective of a call by ``algorithm``."""
    return f"{collective}@{algorithm}" if algorithm in ROUTED else collective


@dataclass(frozen=True, slots=True)
class Call:
    """What a collective call runs (made once per plan and kind of call)."""

    collective: str
    count: int
    dtype: Any
    op: ReduceOp | None
    root: int
    algorithm: str
    ctx: int = 0  # its communicator's context
    layout: int = 0  # a v-variant's counts, digested
    #: its :func:`fingerprint`, made once
    fp: int = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        fp = fingerprint(
            fingerprinted(self.collective, self.algorithm),
            self.count,
            self.dtype,
            self.op,
            self.root,
            self.ctx,
            self.layout,
        )
        object.__setattr__(self, "fp", fp)


def describe(call: Call) -> str:
    op = "" if call.op is None else f", op={call.op.value}"
    route = f", algorithm={call.algorithm}" if call.algorithm in ROUTED else ""
    return f"{call.collective}(count={call.count}, dtype={call.dtype}{op}, root={call.root}{route})"


def mismatch(
    rank: int, seq: int, call: Call, exc: TagMismatchError, fps: dict[int, Call]
) -> CollectiveMismatchError:
    """The error for a message (or a group step) whose tag says another call;
    ``fps``: the calls this rank made, by fingerprint (to name the peer's)."""
    here = f"rank {rank}: {call.collective} #{seq}"
    p = exc.peer
    if (exc.transport == "shm" and "group:" in str(exc)) or exc.of == "sizes":
        why = str(exc)  # the group's chain of calls; a device window's sizes (no tags)
    else:
        got_seq, got_fp = exc.got & M32, exc.got >> 32
        mine_seq, mine_fp = exc.expected & M32, exc.expected >> 32
        theirs = fps.get(got_fp)
        desc = describe(theirs) if theirs is not None else f"fingerprint {got_fp:#010x}"
        sent = "exposed its buffers for" if exc.of == "window" else "sent a message of"
        why = (
            f"rank {p} {sent} its call #{got_seq} ({desc}) where this rank "
            f"runs call #{mine_seq} ({describe(call)})"
        )
        if got_seq != mine_seq:
            why += (
                f"; the ranks are {abs(got_seq - mine_seq)} call(s) apart (one skipped, or "
                "alone rejected, a call)"
            )
        elif got_fp == mine_fp:
            why += "; the same call, another message: do the ranks run the same algorithm?"
    via = f" (via {exc.transport})" if exc.transport else ""
    return CollectiveMismatchError(
        f"{here}: mismatched collectives: {why}{via}",
        rank=rank,
        ranks=() if p is None else (p,),
        transport=exc.transport,
    )


# ------------------------------------------------------------------ PYCOLL_CHECK
def check_match(
    rank: int,
    size: int,
    seq: int,
    call: Call,
    ident: int,
    idents: dict[int, str],
    allgather: Callable[[np.ndarray, np.ndarray], None],
) -> None:
    """PYCOLL_CHECK=1: compare what every rank is about to run (one small allgather).

    Args:
        ident: the collective's number; ``idents`` names them back.
        allgather: gathers one int64 row per rank into a ``(size, k)`` array.

    Raises:
        CollectiveMismatchError: naming each rank's differing arguments.
    """
    if size == 1:
        return
    sig = np.array(
        [
            seq,
            ident,
            call.count,
            _DTYPE_IDS.get(call.dtype, 0),
            _OP_IDS.get(call.op, 0) if call.op else 0,
            call.root,
            _algo_id(call.algorithm),
        ],
        np.int64,
    )
    if call.collective == "broadcast":
        sig[1] = call.count
    allsig = np.empty((size, sig.size), np.int64)
    allsig[rank] = sig
    allgather(sig, allsig.reshape(-1))
    names = ("sequence number", "collective", "count", "dtype", "op", "root", "algorithm")
    problems: list[str] = []
    odd: set[int] = set()
    for col, name in enumerate(names):
        vals = allsig[:, col]
        if (vals != vals[0]).any():
            decode_v = _decoder(name, idents)
            by = {r: decode_v(int(v)) for r, v in enumerate(vals)}
            groups: dict[object, list[int]] = {}
            for r, v in by.items():
                groups.setdefault(v, []).append(r)
            detail = "; ".join(f"ranks {rs}: {v}" for v, rs in groups.items())
            problems.append(f"{name} ({detail})")
            odd.update(r for r, v in by.items() if v != by[rank])
    if problems:
        raise CollectiveMismatchError(
            f"rank {rank}: collective #{seq}: ranks disagree on " + ", ".join(problems),
            rank=rank,
            ranks=sorted(odd),
        )


def _known_algorithms() -> tuple[str, ...]:
    """Every algorithm name of every collective, sorted: the same on every rank."""
    return tuple(sorted({n for c in algorithms.ALGORITHMS for n in algorithms.names(c)}))


#: The flag of an ``auto[a,b,...]`` id (a tuner's contenders, see _algo_id).
_TUNED_ID = 1 << 60


def _algo_id(name: str) -> int:
    """An algorithm's name as a number every rank computes alike (str hash() is
    salted per process).  A tuner's ``auto[a,b,...]`` packs its contenders'
    indices into :func:`_known_algorithms`, 4 bits each in order, so that
    :func:`_decoder` gives the name back; any other name is a CRC."""
    if name.startswith("auto[") and name.endswith("]"):
        known = _known_algorithms()
        parts = name[5:-1].split(",")
        if len(known) < 16 and len(parts) <= 14 and all(a in known for a in parts):
            v = _TUNED_ID
            for i, a in enumerate(parts):
                v |= (known.index(a) + 1) << (4 * i)
            return v
    return zlib.crc32(name.encode()) & 0xFFFF


def _tuned_name(v: int) -> str | None:
    """The ``auto[...]`` name of an id :func:`_algo_id` packed, else None."""
    if v & ~(_TUNED_ID - 1) != _TUNED_ID:
        return None
    known, parts = _known_algorithms(), []
    v &= _TUNED_ID - 1
    while v:
        i = (v & 0xF) - 1
        if not 0 <= i < len(known):
            return None
        parts.append(known[i])
        v >>= 4
    return f"auto[{','.join(parts)}]"


def _decoder(name: str, idents: dict[int, str]) -> Callable[[int], object]:
    if name == "collective":
        return lambda v: idents.get(v, v)
    if name == "dtype":
        inv2 = {v: str(k) for k, v in _DTYPE_IDS.items()}
        return lambda v: inv2.get(v, v)
    if name == "op":
        inv3 = {v: k.value for k, v in _OP_IDS.items()}
        return lambda v: inv3.get(v, "-")
    if name == "algorithm":
        inv4 = {_algo_id(n): n for n in _known_algorithms()}
        return lambda v: inv4.get(v) or _tuned_name(v) or v
    return lambda v: v
