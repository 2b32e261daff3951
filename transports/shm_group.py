"""A segment shared by every rank of a group on one host: posted bytes and addresses.

Where :mod:`transports.shm` joins two ranks through a ring of slots, this joins
all ranks of a communicator at once, for algorithms in which every rank reads
straight from every other (pycoll's ``direct`` family).  The lowest rank creates
it (mode 0600) without a name; its :attr:`ShmGroup.handle` travels with the
bootstrap, the others open it through the creator's descriptor, and the creator
drops that descriptor once everyone has (:meth:`ShmGroup.release_handle`).
Nothing is ever named in ``/dev/shm``, so a kill at any moment leaks nothing
(the rule is in :mod:`transports._segment`).

Layout (offsets in bytes)::

    0        header: magic, version, ranks, slot_bytes, slots (K), identity (at 32)
    4096     control, LINE bytes a rank: W "posted" words (one per word index;
             W = 64 with K = 8, see WORDS), the "done" counter on its own cache
             line, then pid, pid namespace, a "closed" word (and why:
             :func:`transports._segment.closed_word`), the address of the
             rank's mapping (for the direct-read probe), and a posted
             (address, length) range per word index
    DATA0    slots: rank j's slot i at DATA0 + (K j + i) * slot_bytes

Protocol.  Every rank counts the same sequence numbers (one per step of a
collective).  For step ``s`` a rank writes its slot ``s % K`` (or its posted
range ``s % W``) and then stores its posted word ``s % W`` with release
semantics; a reader loads that word with acquire semantics
(:mod:`transports._atomic`), then reads the slot or the range.  A *small* step,
one of at most ``sub_bytes`` (a slot's ``W / K``-th part) a rank, takes part
``(s // K) % (W / K)`` of slot ``s % K``: word index ``i = s % W`` names slot
``i % K`` and part ``i // K``.

The posted word is the step in its low 40 bits and, above them, a 24-bit
*chain*: each step folds the fingerprint of the call it belongs to (an integer
the caller passes to :meth:`ShmGroup.step`) into the chain of the steps before.
A reader waits for the very word its own step has, so two ranks that run
different calls, or whose earlier calls differed (even calls that moved no byte
between them, such as two broadcasts from different roots), raise
:class:`~transports.base.TagMismatchError` at the first step where one waits for
the other, instead of reading each other's bytes.  A rank seen past a step it
never posted is a mismatch too (it runs another collective).  A reader that has finished with everything of step
``s`` stores ``done = s``; :meth:`ShmGroup.post` of step ``s`` stores
``done = s - 1`` first, unless the caller says it has not consumed that step
yet.  A rank may post up to ``ahead`` (``min(AHEAD, K)``) steps it has not
consumed (several rounds of slots written before any is read), never more: so
a peer seen at step ``s`` has consumed step ``s - ahead``, and :meth:`claim`
need not load its ``done`` for that.  A slot part, range or posted word is
rewritten only after every peer's ``done`` reached the last step that used it
(:meth:`ShmGroup.claim`; so a step claims even where it fills no slot, or a
peer that has not yet seen the word of step ``s`` would meet step ``s + W``
there and raise a mismatch): a step that may fill its whole slot waits for
step ``s - K``; a small one (or one that fills none) for step ``s - W``, and
for the last whole-slot step before it where that came after ``s - K``.  So a
rank runs up to W small steps ahead of the slowest peer, and back-to-back
small collectives rarely wait on a descheduled one.  A posted user buffer is returned
to its owner only after every reader said ``done`` (:meth:`ShmGroup.wait_done`).

Large ranges are read with cross-memory attach (:mod:`transports._cma`): one
copy, by the reader, out of the owner's memory.  :meth:`ShmGroup.probe` checks
once whether the kernel allows it.

Waiting spins briefly, then yields, then sleeps (:class:`transports.base.Backoff`),
so four ranks on two cores do not starve each other; now and then it checks that
the awaited rank is alive and that the deadline has not passed.
"""

from __future__ import annotations

import errno
import logging
import mmap
import os
import struct
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np

from transports import _atomic, _cma, _exit, _segment
from transports.base import (
    Backoff,
    ConnectError,
    Deadline,
    Group,
    PeerClosedError,
    TagMismatchError,
    TransportError,
    TransportTimeout,
)

log = logging.getLogger(__name__)

TRANSPORT = "shm"
#: Default bytes of one slot; PYCOLL_GROUP_SLOT_BYTES sets it.
SLOT_BYTES = 256 << 10
#: Slots per rank (K): a rank may run this many steps of more than a part of a
#: slot (``sub_bytes``, below) ahead of the slowest peer.
SLOTS = 8
#: Posted words per rank (W, a multiple of K; with K = 8, 64): a step takes word
#: and range ``s % W``, and a small step (:attr:`ShmGroup.sub_bytes`, SUB_BYTES)
#: fills a part of its slot of its own, so that such steps run up to W ahead.
#: Where ranks outnumber cores a broadcast's root otherwise stops K steps ahead
#: of a reader that is off its core, and each stop costs a switch of the two:
#: at n = 3 on the 2-core machine a replayed 1 KiB broadcast took 2.03-2.13 us
#: with 64 steps ahead against 2.42-2.89 with 8, and 2.23 against 3.19 with
#: root and reader pinned to one core (benchmarks/RESULTS.md, "Small steps run
#: 64 ahead").  Only their words grow: 64 slots would make every slot step's
#: bytes cycle through 16 MiB a rank (a 256 KiB allreduce took 150-155 against
#: 98-115 us so).
WORDS = 64
#: The bytes of a small step a rank (at most a slot's W / K-th part): the
#: parts of a slot lie in its first W / K * 4 KiB, 16 pages a rank with K = 8,
#: and are touched at set-up, so that a run of small steps meets no page fault.
#: Parts of 32 KiB cycled the first 64 steps through 2 MiB a rank: sweep.py's
#: default 20 calls of an 8 B allreduce at n = 4 then took 18.4-30.4 us a call
#: against 8.3-21.0 with 8 slots (RESULTS.md, "Small steps run 64 ahead").
SUB_BYTES = 4 << 10
#: Steps a rank may post before it has consumed them (at most K; see ``post``):
#: all K, so that an alltoall or allgather of up to K rounds through the slots
#: writes them all before it reads any.  At n = 4 on two cores, an alltoall of
#: 2 MiB (6 rounds) took MPI's time over pycoll's from 0.66-0.69 to 0.79-0.86
#: when this went from 4 to 8 (benchmarks/RESULTS.md, "Where alltoall's time goes").
AHEAD = 8
_MAX_SLOTS = 64
_MAGIC = 0x70636F6C6C677270  # "pcollgrp"
_VERSION = 7
_PAGE = 4096
# at offset 8, after the magic: version, ranks, slot_bytes, slots
_HDR = struct.Struct("<IIQI")
_CTRL0 = 4096
_RANGE = struct.Struct("<QQ")
#: The posted word: the step below bit 40, the chain of fingerprints above.
STEP_BITS = 40
_STEP_MASK = (1 << STEP_BITS) - 1
#: The chain as kept: already in place above the step, so a word is ``chain | step``.
CHAIN_MASK = ((1 << 64) - 1) ^ _STEP_MASK
#: What a chain folds in per step: ``chain * CHAIN_MUL + fingerprint`` (an odd
#: factor: one step's different fingerprints never give the same chain).
CHAIN_MUL = 5


def _up64(n: int) -> int:
    return -(-n // 64) * 64


def words_of(slots: int) -> int:
    """Posted words (and ranges) a rank has with ``slots`` slots: W (see WORDS)."""
    return slots * max(1, WORDS // slots)


def _offsets(slots: int) -> tuple[int, int, int, int, int, int, int]:
    """Offsets in a rank's control line (posted words, done, pid, pid namespace,
    closed, mapping address, ranges) and the line's length."""
    W = words_of(slots)
    done = _up64(8 * W)  # the posted words, then done on its own cache line
    pid = done + 64
    ranges = pid + 64
    return done, pid, pid + 8, pid + 16, pid + 24, ranges, _up64(ranges + W * _RANGE.size)


def _line(slots: int) -> int:
    """Bytes of a rank's control line."""
    return _offsets(slots)[-1]


def _data0(size: int, slots: int) -> int:
    return _CTRL0 + -(-size * _line(slots) // _PAGE) * _PAGE


def segment_bytes(size: int, slot_bytes: int, slots: int = SLOTS) -> int:
    """Bytes of the segment for ``size`` ranks with ``slots`` slots of ``slot_bytes``."""
    return _data0(size, slots) + slots * size * slot_bytes


_HANDLE = struct.Struct("<QQ8s")  # the creator's pid, its descriptor, the token


class ControlLayout(NamedTuple):
    """The control lines in the segment: rank j's posted word i at ``ctrl0 + j *
    line + 8 i``, its done, closed and range i (address, length) words at
    offsets ``done``, ``closed`` and ``ranges + 16 i`` of its line; ``memory``
    exports the segment; ``pids`` are the ranks' pids (0 for this rank's own)."""

    memory: Any
    ctrl0: int
    line: int
    done: int
    closed: int
    ranges: int
    pids: tuple[int, ...]


class ShmGroup:
    """This rank's view of the group segment: a :class:`transports.base.Group`.

    Create it with :meth:`create` (the lowest rank) or :meth:`attach` (the others).

    Attributes:
        rank: this rank's index in the group.
        size: number of ranks.
        slot_bytes: bytes of one slot.
        slots: slots per rank (K); step ``s`` uses slot ``s % K``.
        words: posted words (and ranges) per rank (W); step ``s`` uses word ``s % W``.
        sub_bytes: the bytes of a small step's part of a slot.
        last_big: the last step that may have filled this rank's whole slot.
        cma: whether peers' posted ranges may be read and written directly (set
            by the layer above once every rank's :meth:`probe` succeeded).
        ahead: how many steps a rank may post before it has consumed them.
    """

    def __init__(self, mm: mmap.mmap, name: str, rank: int, fd: int = -1) -> None:
        self._mm = mm
        self.name = name
        self.rank = rank
        self._fd = fd  # the creator's descriptor (the handle), until every rank attached
        #: what the other ranks need to :meth:`attach` (the creator's; else b"")
        self.handle = b""
        _, self.size, self.slot_bytes, self.slots = _HDR.unpack_from(mm, 8)
        self.ahead = min(AHEAD, self.slots)
        K = self.slots
        W = self.words = words_of(K)
        self.sub_bytes = min(SUB_BYTES, self.slot_bytes // (W // K)) // 64 * 64
        self.last_big = 0
        done_off, self._pid_off, pidns_off, closed_off, mapaddr_off, self._ranges_off, ln = (
            _offsets(K)
        )
        n, self._line = self.size, ln
        self._buf = np.frombuffer(mm, np.uint8)
        # posted[j][i]: rank j's posted word of word index i
        self._posted = [
            [_atomic.Counter(mm, _CTRL0 + j * ln + 8 * i) for i in range(W)] for j in range(n)
        ]
        self._done = [_atomic.Counter(mm, _CTRL0 + j * ln + done_off) for j in range(n)]
        self._closed_flag = [_atomic.Counter(mm, _CTRL0 + j * ln + closed_off) for j in range(n)]
        self._my_posted = [c.store for c in self._posted[rank]]
        self._my_done = self._done[rank].store
        #: the chain of fingerprints as of this rank's latest step, and as of the
        #: step of each word index (what that step's posted word holds), kept
        #: above STEP_BITS as in the word
        self.chain = 0
        self.chains = [0] * W
        # for steps written out by the caller (post_word, wait_word)
        self.chain_mul, self.chain_mask, self.step_bits = CHAIN_MUL, CHAIN_MASK, STEP_BITS
        # what we know for sure of each rank's "done", to skip loads, and the
        # least of it over the peers as last computed (it only grows)
        self._known_done = [0] * n
        self._peers = [j for j in range(n) if j != rank]
        self._done_floor = 0
        self._pids = [0] * n
        self._data0 = _data0(n, self.slots)
        self._touch_parts()
        self._views: dict[tuple[Any, int, bool | None], list[list[Any]]] = {}
        self.cma = False
        self.seq = 0
        self._closed = False
        self._control: ControlLayout | None = None  # made by control(), once
        self._mapaddr_off = mapaddr_off
        line = _CTRL0 + rank * ln
        struct.pack_into("<Q", mm, line + pidns_off, _segment.ns_inode("pid"))
        struct.pack_into("<Q", mm, line + mapaddr_off, self._buf.__array_interface__["data"][0])
        # the pid last: a peer that sees it sees the rest of our line
        _atomic.Counter(mm, line + self._pid_off).store(os.getpid())
        _exit.watch(self)

    def _touch_parts(self) -> None:
        """Map every page of the small steps' parts of every rank's slots now (a
        write to this rank's own, a read of the others'), not at a step's first
        touch: a part is first used up to W steps in."""
        K, span = self.slots, self.words // self.slots * self.sub_bytes
        for j in range(self.size):
            first = self._data0 + K * j * self.slot_bytes
            pages = np.array(
                [first + i * self.slot_bytes + o for i in range(K) for o in range(0, span, _PAGE)]
            )
            if j == self.rank:
                self._buf[pages] = 0  # nothing is posted before set-up ends
            else:
                self._buf[pages].sum()

    # ------------------------------------------------------------------ set-up
    @classmethod
    def create(
        cls, token: bytes, rank: int, size: int, slot_bytes: int = SLOT_BYTES, slots: int = SLOTS
    ) -> ShmGroup:
        """Create the segment (the lowest rank) and map it, with ``slots`` slots a rank
        (at least 2; the attachers take the number from the header).

        Raises:
            ConnectError: /dev/shm lacks the room, or the file cannot be created.
        """
        slot = max(_PAGE, -(-slot_bytes // _PAGE) * _PAGE)
        if not 2 <= slots <= _MAX_SLOTS:
            raise ValueError(f"slots must be 2 to {_MAX_SLOTS}, not {slots}")
        mm, fd = _segment.create(
            segment_bytes(size, slot, slots),
            ident=token,
            peer=-1,
            transport=TRANSPORT,
            hint="enlarge it (docker --shm-size) or lower PYCOLL_GROUP_SLOT_BYTES",
        )
        _HDR.pack_into(mm, 8, _VERSION, size, slot, slots)
        struct.pack_into("<Q", mm, 0, _MAGIC)  # last: attachers check it
        try:
            self = cls(mm, f"group {token.hex()}", rank, fd)
        except BaseException:
            mm.close()
            os.close(fd)
            raise
        self.handle = _HANDLE.pack(os.getpid(), fd, token)
        return self

    @classmethod
    def attach(cls, handle: bytes, rank: int, size: int) -> ShmGroup:
        """Map the segment the lowest rank created, given its :attr:`handle`.

        Raises:
            ConnectError: it cannot be opened, or its geometry does not match.
        """
        if len(handle) != _HANDLE.size:
            raise ConnectError(f"group segment handle of {len(handle)} bytes", transport=TRANSPORT)
        pid, fd, token = _HANDLE.unpack(handle)
        name = f"group {token.hex()}"
        mm = _segment.attach(
            pid, fd, magic=_MAGIC, ident=token, min_size=_CTRL0, peer=0, transport=TRANSPORT
        )
        ver, n, slot, k = _HDR.unpack_from(mm, 8)
        if (
            ver != _VERSION
            or n != size
            or slot % _PAGE
            or not 2 <= k <= _MAX_SLOTS
            or len(mm) != segment_bytes(n, slot, k)
        ):
            mm.close()
            raise ConnectError(
                f"group segment {name} has version {ver}, {n} ranks and {k} {slot}-byte slots, "
                f"which does not match {size} ranks and its size: ranks run different "
                "pycoll versions?",
                transport=TRANSPORT,
            )
        return cls(mm, name, rank)

    def release_handle(self) -> None:
        """Every rank has attached: the creator drops its descriptor (the mappings
        keep the memory)."""
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def probe(self) -> tuple[bool, str]:
        """Whether this rank may read every peer's memory directly, and why not.

        Call it once every rank has attached (each has published its mapping).
        """
        if not _cma.available():
            return False, "process_vm_readv is not available"
        got = np.zeros(1, np.uint64)
        for j in range(self.size):
            if j == self.rank:
                continue
            pid = self.pid(j)
            if not pid:
                return False, f"rank {j} runs in another pid namespace"
            addr = struct.unpack_from("<Q", self._mm, _CTRL0 + j * self._line + self._mapaddr_off)[
                0
            ]
            try:
                _cma.read(pid, addr, got.__array_interface__["data"][0], 8)
            except OSError as exc:
                return False, f"reading rank {j}'s memory: {exc.strerror}"
            if int(got[0]) != _MAGIC:
                return False, f"rank {j}'s mapping did not read back"
            try:  # the magic we just read, written back where it was: no change
                _cma.write(pid, addr, got.__array_interface__["data"][0], 8)
            except OSError as exc:
                return False, f"writing rank {j}'s memory: {exc.strerror}"
        return True, "cross-memory attach works"

    def pid(self, j: int) -> int:
        """Rank ``j``'s pid in our pid namespace, or 0 when unknown."""
        pid = self._pids[j]
        if not pid:
            line = _CTRL0 + j * self._line
            pid, ns = struct.unpack_from("<QQ", self._mm, line + self._pid_off)
            if ns != _segment.ns_inode("pid"):
                return 0
            self._pids[j] = pid
        return pid

    # ------------------------------------------------------------------ data
    def slot(self, j: int, seq: int) -> Any:
        """Rank ``j``'s whole slot for step ``seq``, as bytes (a uint8 array)."""
        start = self._data0 + (self.slots * j + seq % self.slots) * self.slot_bytes
        return self._buf[start : start + self.slot_bytes]

    def small(self, nbytes: int) -> bool:
        """Whether a step of ``nbytes`` a rank is small (fills a part of a slot)."""
        return nbytes <= self.sub_bytes

    def _at(self, j: int, i: int, small: bool) -> int:
        """Offset of rank ``j``'s slot for word index ``i`` (small: of its part)."""
        K = self.slots
        part = i // K * self.sub_bytes if small else 0
        return self._data0 + (K * j + i % K) * self.slot_bytes + part

    def views(self, dtype: Any, count: int, small: bool | None = None) -> list[list[Any]]:
        """``views[seq % words][j]``: ``count`` elements of ``dtype`` of rank j's
        slot for step ``seq``: its part of the slot where the step is small
        (``small``; None: where ``count`` elements are, :meth:`small`), else
        from the slot's start.  (A message of several rounds is not small, its
        short last round neither.)

        Cached: small collectives call this once per call.
        """
        key = (dtype, count, small)
        v = self._views.get(key)
        if v is None:
            if len(self._views) > 256:
                self._views.clear()
            if small is None:
                small = self.small(count * np.dtype(dtype).itemsize)
            v = [
                [
                    np.frombuffer(self._mm, dtype, count, self._at(j, i, small))
                    for j in range(self.size)
                ]
                for i in range(self.words)
            ]
            self._views[key] = v
        return v

    def addresses(self, j: int, i: int, small: bool = False) -> tuple[int, int, int]:
        """Rank ``j``'s slot for word index ``i`` (small: its part), its posted
        word of that index and its "done" word, as addresses in this process
        (valid while the group is open)."""
        base = self._buf.__array_interface__["data"][0]
        return base + self._at(j, i, small), self._posted[j][i].address, self._done[j].address

    def control(self) -> ControlLayout:
        """Where the control lines lie, for compiled steps that load and store the
        words themselves (``pycoll._step.reduction_by_address`` and
        ``broadcast_by_address``).  Call it once
        :meth:`probe` succeeded (every peer's pid is known then)."""
        if self._closed:
            raise TransportError("group segment is closed", transport=TRANSPORT)
        c = self._control
        if c is None:
            done, _, _, closed, _, ranges, _ = _offsets(self.slots)
            pids = tuple(0 if j == self.rank else self.pid(j) for j in range(self.size))
            c = self._control = ControlLayout(
                self._mm, _CTRL0, self._line, done, closed, ranges, pids
            )
        return c

    def claim(self, seq: int, deadline: Deadline, backoff: Backoff, small: bool = False) -> None:
        """Wait until this rank may overwrite its slot and posted word for step ``seq``.

        That is, until every peer is done with the last step that used them, so
        has seen this rank's word of that step: step ``seq - slots`` for a step
        that may fill its whole slot; where ``small`` (it fills at most its
        part, or nothing), step ``seq - words``, or the last whole-slot step
        (:attr:`last_big`) where that came after ``seq - slots``.
        """
        if small:
            need = max(seq - self.words, min(self.last_big, seq - self.slots))
        else:
            self.last_big = seq
            need = seq - self.slots
        if need <= self._done_floor:  # most calls: 0.1 us, against 0.3 for the loop
            return
        known = self._known_done
        for j in self._peers:
            if known[j] < need:
                self._wait(self._done, j, need, deadline, backoff)
        self._done_floor = min([known[j] for j in self._peers], default=need)

    def step(self, fingerprint: int) -> int:
        """Take the next step, of a call whose fingerprint is ``fingerprint``
        (an integer that every rank computes alike for the same call); return it.

        The step's posted word carries the chain of every step's fingerprint so
        far (see the module docstring).  ``pycoll.algorithms.direct``'s
        prepared steps do the same inline.
        """
        s = self.seq = self.seq + 1
        self.chains[s % self.words] = self.chain = (
            self.chain * CHAIN_MUL + (fingerprint << STEP_BITS)
        ) & CHAIN_MASK
        return s

    def skip(self, fingerprint: int) -> None:
        """Fold a call that took no step into the chain (a call this rank rejected):
        a peer that ran it instead then meets another chain at its next step."""
        self.chain = (self.chain * CHAIN_MUL + (fingerprint << STEP_BITS)) & CHAIN_MASK

    def post(self, seq: int, addr: int = 0, nbytes: int = 0, consumed: bool = True) -> None:
        """Publish step ``seq``: the slot is written and, when ``nbytes``, peers may
        read ``[addr, addr + nbytes)`` of this process's memory until they are done.

        The range is kept per word index (``seq % words``), like the words: :meth:`claim`
        the step first.  ``consumed``: this rank is done with step ``seq - 1``
        (else it says so later with :meth:`done`; it must have consumed step
        ``seq - ahead``).
        """
        i = seq % self.words
        if nbytes:
            off = _CTRL0 + self.rank * self._line + self._ranges_off + i * _RANGE.size
            _RANGE.pack_into(self._mm, off, addr, nbytes)
        if consumed:
            self._my_done(seq - 1)
        self._my_posted[i](self.chains[i] | seq)

    def done(self, seq: int) -> None:
        """Say that this rank has finished reading everything of step ``seq``."""
        self._my_done(seq)

    def post_word(self, i: int, word: int, seq: int) -> None:
        """:meth:`post` of step ``seq`` (word index ``i``, no range, consumed) whose
        posted word ``word`` the caller made as :meth:`step` would: the prepared
        steps of the direct algorithms, which compute it once for both calls."""
        self._my_done(seq - 1)
        self._my_posted[i](word)

    def wait_word(
        self, peers: Iterable[int], i: int, word: int, deadline: Deadline, backoff: Backoff
    ) -> None:
        """:meth:`wait` for the step of posted word ``word`` (word index ``i``)."""
        posted = self._posted
        known = self._known_done
        sure = (word & _STEP_MASK) - self.ahead
        for j in peers:
            if posted[j][i].load() != word:
                self._wait_posted(j, i, word, deadline, backoff)
            if known[j] < sure:  # noqa: PLR1730 (as in wait)
                known[j] = sure

    def wait(self, peers: Iterable[int], seq: int, deadline: Deadline, backoff: Backoff) -> None:
        """Wait until every rank of ``peers`` posted step ``seq``.

        Raises:
            TagMismatchError: a peer posted step ``seq`` with another chain of
                fingerprints, or went past it without posting it.
        """
        posted = self._posted
        known = self._known_done
        i = seq % self.words
        word = self.chains[i] | seq
        sure = seq - self.ahead  # what a peer that posted ``seq`` has consumed
        for j in peers:
            if posted[j][i].load() != word:
                self._wait_posted(j, i, word, deadline, backoff)
            if known[j] < sure:  # noqa: PLR1730 (max() costs 0.15 us, this 0.03)
                known[j] = sure

    def wait_done(
        self, peers: Iterable[int], seq: int, deadline: Deadline, backoff: Backoff
    ) -> None:
        """Wait until every rank of ``peers`` is done with step ``seq``."""
        known = self._known_done
        for j in peers:
            if known[j] < seq:
                self._wait(self._done, j, seq, deadline, backoff)

    def read(self, j: int, seq: int, offset: int, out: Any) -> None:
        """Copy bytes ``[offset, offset + out.nbytes)`` of the range rank ``j``
        posted for step ``seq`` into the contiguous array ``out`` (cross-memory attach).

        Raises:
            PeerClosedError: rank j has exited.
            TransportError: the read failed or falls outside the posted range.
        """
        self._attach_copy(_cma.read, "read", j, seq, offset, out)

    def write(self, j: int, seq: int, offset: int, src: Any) -> None:
        """Copy the contiguous array ``src`` into bytes ``[offset, offset +
        src.nbytes)`` of the range rank ``j`` posted for step ``seq``.

        Raises:
            PeerClosedError: rank j has exited.
            TransportError: the write failed or falls outside the posted range.
        """
        self._attach_copy(_cma.write, "write", j, seq, offset, src)

    def read_at(self, j: int, seq: int, offset: int, local: int, n: int) -> None:
        """:meth:`read` into the ``n`` bytes at address ``local`` of this process
        (which the caller keeps allocated: a prepared step's output)."""
        self._attach_at(_cma.read, "read", j, seq, offset, local, n)

    def _attach_copy(
        self, copy: Callable[..., None], what: str, j: int, seq: int, offset: int, local: Any
    ) -> None:
        n = local.nbytes
        at = local.__array_interface__["data"][0] if n else 0
        self._attach_at(copy, what, j, seq, offset, at, n)

    def _attach_at(
        self, copy: Callable[..., None], what: str, j: int, seq: int, offset: int, at: int, n: int
    ) -> None:
        addr, nbytes = _RANGE.unpack_from(
            self._mm, _CTRL0 + j * self._line + self._ranges_off + (seq % self.words) * _RANGE.size
        )
        if offset < 0 or offset + n > nbytes:
            raise self.range_error(what, j, offset, n, nbytes)
        if not n:
            return
        try:
            copy(self.pid(j), addr + offset, at, n)
        except OSError as exc:
            raise self.copy_error(what, j, n, exc.errno or errno.EIO) from exc

    def range_error(self, what: str, j: int, offset: int, n: int, nbytes: int) -> TransportError:
        """A read or write of ``[offset, offset + n)`` beyond rank ``j``'s posted range."""
        return TransportError(
            f"group: {what} of bytes [{offset}, {offset + n}) of rank {j}'s posted "
            f"{nbytes}-byte range (mismatched collectives: do all ranks run the same one?)",
            peer=j,
            transport=TRANSPORT,
        )

    def copy_error(self, what: str, j: int, n: int, err: int) -> TransportError:
        """A direct read or write of ``n`` bytes with rank ``j`` that failed with ``err``."""
        cls = PeerClosedError if err == errno.ESRCH else TransportError
        return cls(
            f"group: direct {what} of {n} bytes with rank {j}: {os.strerror(err)}",
            peer=j,
            transport=TRANSPORT,
            errno=err,
        )

    # ------------------------------------------------------------------ waiting
    def _wait_posted(self, j: int, i: int, word: int, deadline: Deadline, bo: Backoff) -> None:
        """Until rank ``j``'s posted word ``i`` is ``word``; raise where it cannot be."""
        c = self._posted[j][i]
        seq = word & _STEP_MASK
        bo.reset()
        spins = bo.spins
        try:
            while (v := c.load()) != word:
                if v & _STEP_MASK >= seq:  # this step, another chain (or past it)
                    raise self._mismatch(j, v, word)
                bo.pause()
                n = bo._n
                if n > spins and n % 64 == 0:
                    # Past this step without posting it: it runs another call.
                    # (Steps are posted in order: read the others first.)
                    last = max((x.load() for x in self._posted[j]), key=_STEP_MASK.__and__)
                    if c.load() == word:
                        return
                    if last & _STEP_MASK > seq:
                        raise self._mismatch(j, last, word)
                    self._check(j, deadline, n <= spins + 64, lambda: c.load() == word)
        except ValueError:  # the counters' memory went under us
            self._check_open(j)
            raise

    def _mismatch(self, j: int, got: int, want: int) -> TagMismatchError:
        s, c = got & _STEP_MASK, got >> STEP_BITS
        seq, chain = want & _STEP_MASK, want >> STEP_BITS
        if s == seq:
            what = f"posted step {s} with fingerprint chain {c:#08x}, this rank's is {chain:#08x}"
        else:
            what = f"posted step {s} (chain {c:#08x}) but never step {seq}"
        return TagMismatchError(
            f"group: rank {j} {what}: the ranks' collectives differ (at this call, or at an "
            "earlier one that moved no byte between them)",
            got=got,
            expected=want,
            peer=j,
            transport=TRANSPORT,
        )

    def _wait(
        self,
        counters: list[_atomic.Counter],
        j: int,
        seq: int,
        deadline: Deadline,
        bo: Backoff,
    ) -> None:
        c = counters[j]  # not its bound load: close() must be able to drop the memory
        bo.reset()
        spins = bo.spins
        try:
            while (v := c.load()) < seq:
                bo.pause()
                n = bo._n
                if n > spins and n % 64 == 0 and counters[j].load() < seq:
                    # the first check follows progress
                    self._check(j, deadline, n <= spins + 64, lambda: counters[j].load() >= seq)
        except ValueError:  # the counters' memory went under us
            self._check_open(j)
            raise
        if counters is self._done:  # what it saw: a peer well ahead lets later claims skip it
            self._known_done[j] = v

    def _check_open(self, j: int) -> None:
        if self._closed:
            raise TransportError("group segment is closed", peer=j, transport=TRANSPORT)

    def _check(
        self,
        j: int,
        deadline: Deadline,
        fresh: bool = False,
        there: Callable[[], bool] | None = None,
    ) -> None:
        """Raise where rank ``j`` is gone or the wait is overdue.  ``there()``: whether
        what the caller waits for has come (:func:`transports._segment.check_alive`)."""
        self._check_open(j)
        _segment.check_alive(
            self._closed_flag[j],
            self.pid(j),
            f"group: rank {j}",
            peer=j,
            transport=TRANSPORT,
            there=there,
        )
        if deadline.overdue(fresh):
            raise TransportTimeout(f"timed out waiting for peer(s) [{j}]", pending=[j], peer=j)

    # ------------------------------------------------------------------ closing
    def mark_exiting(self) -> None:
        """At interpreter exit without close(): peers see "closed" (:mod:`transports._exit`)."""
        if not self._closed:
            self._closed_flag[self.rank].store(1)

    def close_because(self, rank: int) -> None:
        """:meth:`close`, and the others read why with our "closed" word: this rank
        closes because rank ``rank`` failed (``PeerClosedError.cause_rank``)."""
        self._close(rank)

    def close(self) -> None:
        """Unmap (and drop the handle); idempotent."""
        self._close(None)

    def _close(self, cause: int | None) -> None:
        if self._closed:
            return
        self._closed = True
        _exit.forget(self)
        try:
            self._closed_flag[self.rank].store(_segment.closed_word(cause))
        except ValueError:
            pass
        for c in (*(w for ws in self._posted for w in ws), *self._done, *self._closed_flag):
            c.release_buffer()
        self._my_posted = [_closed] * self.words  # they held the counters' memory
        self._my_done = _closed
        self._views.clear()
        self._control = None
        self._buf = None  # type: ignore[assignment]
        try:
            self._mm.close()
        except BufferError:
            # a collective still runs on another thread (abort): the mapping goes
            # when its last view does
            log.info("group: segment %s still in use; unmapped when that ends", self.name)
        self._mm = None  # type: ignore[assignment]
        self.release_handle()

    def __enter__(self) -> ShmGroup:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _closed(value: int) -> None:
    raise TransportError("group segment is closed", transport=TRANSPORT)


if TYPE_CHECKING:

    def _is_a_group(g: ShmGroup) -> Group:
        return g  # mypy checks here that ShmGroup meets the protocol
