"""The compiled step (pycoll/_step.c): built where a C compiler is, the same
bytes as NumPy's reductions and as the Python steps, and refused where it
does not apply.

Unit checks call its reduction and its Step on NumPy arrays; then replayed small
allreduces, reduces, reduce-scatters, allgathers and broadcasts (ranks as
threads) with the compiled step on and off (``compiled=False``: the Python
steps) must agree bitwise for every dtype and op, at n = 2, 3 and 4, with
poisoned outputs; gathers, scatters (from every root) and alltoalls must hold
NumPy's bytes either way.
"""

from __future__ import annotations

import mmap
import os
import shutil
import sysconfig
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import pycoll
from pycoll.algorithms import direct
from pycoll.reduce import DTYPES, ReduceOp, reduce_rows, ufunc
from tests.inproc import communicators, run_ranks
from tests.reference import OPS, ops_for

pytestmark = pytest.mark.timeout(300)

step = direct.compiled
needs_step = pytest.mark.skipif(step is None, reason="pycoll._step was not built")


def _addr(a: np.ndarray) -> int:
    return int(a.__array_interface__["data"][0])


def test_built_where_a_compiler_is() -> None:
    """pip install builds it where cc and Python's headers are (CI has both);
    without them pycoll runs the Python steps, and says nothing is wrong."""
    headers = Path(sysconfig.get_paths()["include"], "Python.h").exists()
    if not (shutil.which("cc") and headers):
        pytest.skip("no C compiler or no Python headers here: the Python steps run")
    assert step is not None, "a C compiler is here, yet pycoll._step was not built"
    from pycoll.engine import replay_c

    assert replay_c is not None, "a C compiler is here, yet pycoll._replay was not built"


def _rows(dtype: np.dtype, n: int, count: int, rng: np.random.Generator) -> list[np.ndarray]:
    if dtype.kind in "iu":
        info = np.iinfo(dtype)
        return [
            rng.integers(info.min, info.max, count, dtype=dtype, endpoint=True) for _ in range(n)
        ]
    return [(rng.standard_normal(count) * 1e3).astype(dtype) for _ in range(n)]


@needs_step
@pytest.mark.parametrize("op", [op for op in OPS if op != "avg"])  # avg: sum, then a division
def test_reduce_matches_numpy_or_declines(op: str) -> None:
    """Every op on every dtype: the bits of the Python steps' reduction (NumPy's
    ufuncs in rank order: wrapping integers, IEEE sums and products), or False
    with the output untouched where it does not apply."""
    rng = np.random.default_rng(7)
    f = ufunc(ReduceOp(op))
    for name, dtype in DTYPES.items():
        if op not in ops_for(dtype):
            continue
        kind, code = direct._step_kind(dtype), direct._STEP_OPS[f]
        for n, count in ((2, 1), (3, 7), (4, 1031)):
            rows = (
                _rows(dtype, n, count, rng)
                if name != "bool"
                else [rng.integers(0, 2, count).astype(bool) for _ in range(n)]
            )
            ref = np.empty_like(rows[0])
            with np.errstate(all="ignore"):  # products overflow to inf, as they may
                reduce_rows(f, rows, ref)
            out = np.frombuffer(bytearray(b"\xa5" * (count * dtype.itemsize)), dtype)
            poison = out.copy()
            done = kind and step.reduce(code, kind, out, count, tuple(_addr(r) for r in rows))
            if done:
                assert np.array_equal(out.view(np.uint8), ref.view(np.uint8)), (name, op, n)
            else:  # only where IEEE or wrapping arithmetic is not NumPy's whole story
                exact = dtype.kind in "iu" or (
                    name in ("float32", "float64") and op in ("sum", "prod")
                )
                assert not exact, (name, op)
                assert np.array_equal(out.view(np.uint8), poison.view(np.uint8)), (name, op)


@needs_step
def test_reduce_in_place_and_sizes_checked() -> None:
    a = np.arange(5, dtype=np.int32)
    b = np.full(5, 10, np.int32)
    assert step.reduce(0, ord("i"), a, 5, (_addr(a), _addr(b)))
    assert a.tolist() == [10, 11, 12, 13, 14]
    with pytest.raises(ValueError, match="for 4 elements"):
        step.reduce(0, ord("i"), a, 4, (_addr(a), _addr(b)))
    assert not step.reduce(0, ord("i"), a, 5, (_addr(a),))  # one row: not here


@needs_step
def test_stream_copy_copies_every_byte_at_any_alignment() -> None:
    """The streaming copy's aligned body, its unaligned head and its tail, and
    overlapping ranges (a memmove then)."""
    rng = np.random.default_rng(5)
    src = rng.integers(0, 256, 9000, dtype=np.uint8)
    for off in (0, 1, 7, 15, 16, 33):
        for n in (0, 1, 15, 16, 17, 63, 64, 65, 127, 4096, 8191):
            dst = np.zeros(9000, np.uint8)
            step.stream_copy(_addr(dst) + off, _addr(src) + 3, n)
            assert dst[off : off + n].tobytes() == src[3 : 3 + n].tobytes(), (off, n)
            assert not dst[:off].any() and not dst[off + n :].any(), (off, n)
    buf = np.arange(4096, dtype=np.uint8)
    want = buf[:4000].copy()
    step.stream_copy(_addr(buf) + 50, _addr(buf), 4000)  # overlapping, forward
    assert buf[50:4050].tobytes() == want.tobytes()
    with pytest.raises(ValueError, match="negative"):
        step.stream_copy(_addr(buf), _addr(buf), -1)


def _at(page_offset: int, n: int) -> np.ndarray:
    """``n`` bytes starting ``page_offset`` bytes into a page, zeroed."""
    raw = np.zeros(n + 2 * mmap.PAGESIZE, np.uint8)
    base = -_addr(raw) % mmap.PAGESIZE
    return raw[base + page_offset : base + page_offset + n]


@needs_step
def test_copy_moves_every_byte_at_every_skew() -> None:
    """``_step.copy`` goes back to front where the destination starts 1-63 bytes
    after the source modulo the page: its aligned body, its unaligned tail past
    the last 16-byte boundary and its head, at lengths about those of its pieces,
    and every byte outside the range untouched."""
    rng = np.random.default_rng(11)
    for n in (1, 255, 256, 257, 319, 4095, 4096, 65537):
        src = _at(0, n)
        src[:] = rng.integers(0, 256, n, dtype=np.uint8)
        for off in (0, 1, 15, 16, 31, 32, 48, 63, 64, 2000, 4095):
            raw = _at(0, n + 4200)
            dst = raw[off : off + n]
            step.copy(dst, src)
            assert dst.tobytes() == src.tobytes(), (n, off)
            assert not raw[:off].any() and not raw[off + n :].any(), (n, off)


@needs_step
def test_copy_checks_its_buffers() -> None:
    """Unequal lengths, a read-only or non-contiguous destination raise and copy nothing."""
    a, b = np.zeros(8, np.uint8), np.ones(9, np.uint8)
    with pytest.raises(ValueError, match="9 bytes into 8"):
        step.copy(a, b)
    ro = np.zeros(9, np.uint8)
    ro.flags.writeable = False
    with pytest.raises((ValueError, BufferError)):
        step.copy(ro, b)
    with pytest.raises((ValueError, BufferError)):
        step.copy(np.zeros(18, np.uint8)[::2], b)
    with pytest.raises(TypeError):
        step.copy(a)
    assert not a.any() and not ro.any()


@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.parametrize("skew", [0, 16, 40])
def test_collectives_agree_with_outputs_skewed_from_inputs(n: int, skew: int) -> None:
    """Inputs page-aligned and outputs ``skew`` bytes into their pages (every
    copy between them, and between them and the slots, is a skewed one at 16
    and 40), at sizes through one slot and by address: every result NumPy's."""
    k = 70001  # float32: 280 KB, a prime count

    def run(r: int, comm: pycoll.Communicator) -> None:
        xs = [np.random.default_rng(j).standard_normal(n * k).astype(np.float32) for j in range(n)]
        for count in (k, 4099):
            x = _at(0, n * count * 4).view(np.float32)
            x[:] = xs[r][: n * count]
            out = _at(skew, n * count * 4).view(np.float32)
            out[:] = np.nan
            comm.allgather(x[:count], out)
            np.testing.assert_array_equal(out, np.concatenate([v[:count] for v in xs]))
            out[:] = np.nan
            comm.alltoall(x, out)
            want = np.concatenate([v[r * count : (r + 1) * count] for v in xs])
            np.testing.assert_array_equal(out, want)
            out[:] = np.nan
            comm.allreduce(x, out)
            acc = xs[0][: n * count].copy()
            for v in xs[1:]:  # rank order, as the collective reduces
                acc += v[: n * count]
            np.testing.assert_array_equal(out, acc)
            b = out[:count]
            b[:] = xs[0][:count] if r == 0 else np.nan
            comm.broadcast(b, root=0)
            np.testing.assert_array_equal(b, xs[0][:count])

    with communicators(n) as comms:
        run_ranks(n, lambda r: run(r, comms[r]))


@pytest.mark.parametrize("n", [1, 2, 3])
def test_collectives_agree_through_the_streaming_copy(
    n: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A rank's own block of an allgather, alltoall, gather and scatter, and a
    lone rank's allreduce, go through :func:`pycoll.buffers.copy_into`: with its
    threshold at 64 bytes every such copy of these calls streams (where the
    extension was built), and every result must still be NumPy's (the
    allreduce's too, at every n)."""
    from pycoll import buffers

    monkeypatch.setattr(buffers, "STREAM_COPY_BYTES", 64)
    k = 1009  # a prime, odd bytes past the 64-byte lines

    def run(r: int, comm: pycoll.Communicator) -> None:
        xs = [np.random.default_rng(j).standard_normal(n * k) for j in range(n)]
        x = xs[r]
        out = np.full(n * k, np.nan)
        comm.allgather(x[:k], out)
        np.testing.assert_array_equal(out, np.concatenate([v[:k] for v in xs]))
        out = np.full(n * k, np.nan)
        comm.alltoall(x, out)
        np.testing.assert_array_equal(out, np.concatenate([v[r * k : (r + 1) * k] for v in xs]))
        out = np.full(n * k, np.nan) if r == 0 else None
        comm.gather(x[:k], out, root=0)
        if r == 0:
            np.testing.assert_array_equal(out, np.concatenate([v[:k] for v in xs]))
        got = np.full(k, np.nan)
        comm.scatter(xs[0] if r == 0 else None, got, root=0)
        np.testing.assert_array_equal(got, xs[0][r * k : (r + 1) * k])
        ys = [v[:k] for v in xs]
        got = np.full(k, np.nan)
        comm.allreduce(ys[r], got)
        want = ys[0].copy()
        for v in ys[1:]:  # rank order, as the collective reduces
            want += v
        np.testing.assert_array_equal(got, want)

    with communicators(n) as comms:
        run_ranks(n, lambda r: run(r, comms[r]))


class _Group:
    """The attributes of a group that a Step reads and writes."""

    def __init__(self) -> None:
        self.seq, self.chain, self.last_big = 0, 0, 0


_MASK = ((1 << 64) - 1) ^ ((1 << 40) - 1)


def _fake(K: int, n: int, nbytes: int) -> tuple[np.ndarray, np.ndarray, dict[str, Any]]:
    """A segment's words ([done, K posted words of this rank, K of each peer])
    and slots (K per rank, rank 0 this one), and the addresses a Step takes."""
    nw = 1 + K * n + n  # ... and the peers' done words; shared, so a child process may post
    words = np.frombuffer(mmap.mmap(-1, 8 * nw), np.uint64)
    slots = np.zeros((n, K, nbytes), np.uint8)
    w0, s0 = _addr(words), _addr(slots)
    dones = tuple(w0 + 8 * (1 + K * n + j) for j in range(1, n))
    word = tuple(w0 + 8 * (1 + i) for i in range(K))
    theirs = tuple(tuple(w0 + 8 * (1 + K * j + i) for j in range(1, n)) for i in range(K))
    rows = tuple(tuple(s0 + (j * K + i) * nbytes for j in range(n)) for i in range(K))
    slot = tuple(r[0] for r in rows)
    at = {"slot": slot, "word": word, "theirs": theirs, "rows": rows, "done": w0, "dones": dones}
    return words, slots, at


def _make(
    mode: int,
    G: _Group,
    at: dict[str, Any],
    calls: list[tuple[Any, ...]],
    *,
    K: int,
    nbytes: int,
    count: int,
    spins: int = 8,
    kind: int = ord("i"),
    piece: int = 0,
    yield_ns: int = 0,
    ahead: int = 0,
    kd: int = 0,
    small: bool = False,
    hole_at: int = 0,
    hole: int = 0,
    oblk: int = -1,
) -> Any:
    """A Step on the fake segment ``at`` whose calls back are recorded in ``calls``
    (K words and K slots unless kd says, K ahead, one piece, chain multiplier 5,
    fingerprint word 3 << 40 unless said)."""
    return step.Step(
        mode,
        G,
        lambda s: calls.append(("claim", s)),
        lambda late, i, w: calls.append(("wait", late, i, w)),
        lambda i, out: calls.append(("reduce", i)),
        K,
        kd or K,
        small,
        5,
        _MASK,
        3 << 40,
        spins,
        nbytes,
        count,
        0,
        kind,
        at["slot"],
        at["word"],
        at["done"],
        at["theirs"],
        at["rows"],
        at["dones"],
        ahead or K,
        piece or nbytes,
        yield_ns,
        hole_at,
        hole,
        oblk,
    )


@needs_step
def test_step_posts_waits_and_reduces() -> None:
    """A READ step (allreduce) at n = 2, K = 2: it takes the next step and chain
    word on the group, copies x into its slot, stores done = s - 1 and its
    word, reduces once the peer's word is there, stores done = s; a peer not
    there after the spins is Python's wait, called with that peer's index; a
    step past K whose slot is not known free is Python's claim."""
    K, n, nbytes = 2, 2, 8
    words, slots, at = _fake(K, n, nbytes)
    G, calls = _Group(), []  # type: ignore[var-annotated]
    st = _make(direct._READ, G, at, calls, K=K, nbytes=nbytes, count=2)
    x, out = np.array([1, 2], np.int32), np.full(2, -1, np.int32)
    chain = (3 << 40) & _MASK
    words[1 + K + 1] = chain | 1  # the peer posted step 1 (slot index 1)
    slots[1, 1].view(np.int32)[:] = [10, 20]
    st(x, out)
    assert (G.seq, G.chain) == (1, chain) and calls == []
    assert out.tolist() == [11, 22] and slots[0, 1].view(np.int32).tolist() == [1, 2]
    assert int(words[0]) == 1 and int(words[1 + 1]) == chain | 1
    st(x, out)  # step 2: the peer's word is not there
    assert calls == [("wait", 0, 0, G.chain | 2)] and int(words[0]) == 2
    st(x, out)  # step 3 > K, the peer not done with step 1: claim first
    assert calls[1] == ("claim", 3)
    words[-1] = 2  # the peer is done with step 2
    st(x, out)  # step 4: no claim
    assert ("claim", 4) not in calls and calls[-1] == ("wait", 0, 0, G.chain | 4)
    with pytest.raises(ValueError, match="4 bytes for a 8-byte step"):
        st(x[:1], out)


@needs_step
def test_a_small_step_claims_w_back_and_a_whole_slot_step_k_back() -> None:
    """WRITE steps (a reduce off its root; no waits) with 8 words and 2 slots, the
    peer done with nothing: a small one takes steps 1-8 with no claim and claims
    step 9 (its word's last step is 1); one that fills its slot claims from
    step 3 (its slot's last step is 1) and marks the group's last_big; a small
    step after it in the same slot waits for it (its claim need is last_big),
    as the group's claim would."""
    W, kd, n, nbytes = 8, 2, 2, 4
    words, slots, at = _fake(W, n, nbytes)
    G, calls = _Group(), []  # type: ignore[var-annotated]
    mk = {"K": W, "nbytes": nbytes, "count": 1, "spins": 0, "kd": kd}
    small = _make(direct._WRITE, G, at, calls, small=True, **mk)
    big = _make(direct._WRITE, G, at, calls, **mk)
    x = np.array([1], np.int32)
    for _ in range(W):
        small(x, None)
    assert calls == [] and G.last_big == 0
    small(x, None)
    assert calls == [("claim", W + 1)]
    words[-1] = W + 1  # the peer is done with every step so far
    big(x, None)  # step 10: its slot's last step, 8, is done
    assert G.last_big == W + 2 and calls == [("claim", W + 1)]
    big(x, None)  # step 11: slot 1, last used by step 9: done
    small(x, None)  # step 12, slot 0: the whole-slot step 10 is not done
    assert G.last_big == W + 3 and calls[1:] == [("claim", W + 4)]
    words[-1] = W + 3
    small(x, None)  # step 13: no claim
    assert calls[2:] == []


@needs_step
def test_past_its_spins_a_step_yields_then_hands_the_wait_to_python() -> None:
    """A READ step whose peer posts 20 ms late, from another process, while the
    step yields (yield_ns 10 s): it ends with no Python wait.  With no peer and
    yield_ns 5 ms, Python's wait is called once 5 ms have passed; with
    yield_ns 0, at once."""
    K, n, nbytes = 2, 2, 8
    words, slots, at = _fake(K, n, nbytes)
    x, out = np.array([1, 2], np.int32), np.full(2, -1, np.int32)
    slots[1, 1].view(np.int32)[:] = [10, 20]
    waited = {}
    for yield_ns in (10_000_000_000, 5_000_000, 0):
        G, calls = _Group(), []  # type: ignore[var-annotated]
        words[:] = 0
        st = _make(direct._READ, G, at, calls, K=K, nbytes=nbytes, count=2, yield_ns=yield_ns)
        pid = os.fork() if yield_ns > 5_000_000 else -1
        if pid == 0:  # the peer: posts step 1 (slot index 1) 20 ms later
            time.sleep(0.02)
            words[1 + K + 1] = (3 << 40) & _MASK | 1
            os._exit(0)
        t0 = time.monotonic()
        st(x, out)
        waited[yield_ns] = time.monotonic() - t0, calls
        if pid > 0:
            os.waitpid(pid, 0)
            assert out.tolist() == [11, 22]
    late, calls = waited[10_000_000_000]
    assert calls == [] and 0.015 < late < 5, waited
    late, calls = waited[5_000_000]
    assert calls == [("wait", 0, 1, (3 << 40) & _MASK | 1)] and late >= 0.005, waited
    late, calls = waited[0]
    assert calls == [("wait", 0, 1, (3 << 40) & _MASK | 1)] and late < 0.005, waited


@needs_step
def test_step_modes_copy_where_they_should() -> None:
    """GATHER copies every nonzero row into its block; LEAF posts nothing and
    copies the root's slot into its buffer; a READ step of a dtype C does not
    reduce calls Python's reduce with the slot index."""
    K, n, nbytes = 2, 3, 4
    words, slots, at = _fake(K, n, nbytes)
    G, calls = _Group(), []  # type: ignore[var-annotated]
    rows = tuple((0, r[1], r[2]) for r in at["rows"])  # the own block: the envelope's
    gather = _make(direct._GATHER, G, {**at, "rows": rows}, calls, K=K, nbytes=nbytes, count=1)
    slots[1, 1].view(np.int32)[:] = 7
    slots[2, 1].view(np.int32)[:] = 9
    out = np.full(3, -1, np.int32)
    gather(np.array([5], np.int32), out)
    assert out.tolist() == [-1, 7, 9] and calls == [("wait", 0, 1, G.chain | 1)]
    leaf_at = {
        **at,
        "theirs": tuple((t[0],) for t in at["theirs"]),
        "rows": tuple((r[1],) for r in at["rows"]),
    }
    leaf = _make(direct._LEAF, G, leaf_at, calls, K=K, nbytes=nbytes, count=1, spins=0)
    before = words[1 : 1 + K].copy()
    buf = np.zeros(1, np.int32)
    slots[1, 0].view(np.int32)[:] = 42
    leaf(buf, None)
    assert buf.tolist() == [42] and (words[1 : 1 + K] == before).all() and int(words[0]) == 2
    red = _make(direct._READ, G, at, calls, K=K, nbytes=nbytes, count=1, spins=0, kind=0)
    red(np.array([1], np.int32), out[:1])
    assert calls[-1] == ("reduce", 1)


@needs_step
def test_a_step_leaves_its_hole_out_and_gathers_blocks_of_oblk() -> None:
    """A WRITE step with a hole copies x but its bytes [hole_at, hole_at +
    hole) into its slot (a scatter's root leaves its own block out); a GATHER
    step with oblk copies oblk bytes of each nonzero row into blocks of oblk
    (an alltoall's block in each peer's slot); x of another length, and a
    hole outside nbytes, in a LEAF or in a step of rounds, are refused."""
    K, n, nbytes = 2, 3, 8
    words, slots, at = _fake(K, n, nbytes)
    G, calls = _Group(), []  # type: ignore[var-annotated]
    mk = {"K": K, "nbytes": nbytes, "count": 2, "spins": 0}
    write = _make(direct._WRITE, G, at, calls, **mk, hole_at=4, hole=4)
    write(np.array([1, 2, 3], np.int32), None)
    assert slots[0, 1].view(np.int32).tolist() == [1, 3] and int(words[0]) == 1
    with pytest.raises(ValueError, match="8 bytes for a 12-byte step"):
        write(np.array([1, 2], np.int32), None)
    rows = tuple((0, r[1] + 4, r[2]) for r in at["rows"])  # block 1 of rank 1's slot
    gather = _make(direct._GATHER, G, {**at, "rows": rows}, calls, **mk, oblk=4)
    slots[1, 0].view(np.int32)[:] = [70, 71]
    slots[2, 0].view(np.int32)[:] = [90, 91]
    out = np.full(3, -1, np.int32)
    gather(np.array([5, 6], np.int32), out)
    assert out.tolist() == [-1, 71, 90]
    for bad in (
        {"mode": direct._WRITE, "hole_at": 12, "hole": 4},  # past nbytes
        {"mode": direct._LEAF, "hole_at": 0, "hole": 4},
        {"mode": direct._GATHER, "hole_at": 0, "hole": 4, "piece": 4},  # two rounds
    ):
        mode = bad.pop("mode")
        with pytest.raises(ValueError, match="hole"):
            _make(mode, G, at, calls, **mk, **bad)


@needs_step
def test_a_gather_step_goes_in_rounds_of_a_piece() -> None:
    """A GATHER step of 12 bytes a rank in pieces of 8 (K = 4, n = 3): two
    steps, both copied in and posted before either is read (done = s - 1 with
    the first alone), then each waited for, copied into its part of every
    peer's block and marked done; a block needs at most ``ahead`` rounds."""
    K, n, nbytes, piece = 4, 3, 12, 8
    words, slots, at = _fake(K, n, piece)
    G, calls = _Group(), []  # type: ignore[var-annotated]
    rows = tuple((0, r[1], r[2]) for r in at["rows"])
    mk = {"K": K, "nbytes": nbytes, "count": 3, "spins": 0, "piece": piece}
    gather = _make(direct._GATHER, G, {**at, "rows": rows}, calls, **mk)
    for j in (1, 2):  # round 1 (step 1, slot 1): 8 bytes; round 2 (step 2): 4
        slots[j, 1].view(np.int32)[:] = [10 * j, 10 * j + 1]
        slots[j, 2].view(np.int32)[:1] = 10 * j + 2
    x, out = np.array([5, 6, 7], np.int32), np.full(9, -1, np.int32)
    gather(x, out)
    c1 = (3 << 40) & _MASK
    c2 = (c1 * 5 + (3 << 40)) & _MASK
    assert (G.seq, G.chain) == (2, c2)
    assert calls == [("wait", 0, 1, c1 | 1), ("wait", 0, 2, c2 | 2)]
    assert slots[0, 1].view(np.int32).tolist() == [5, 6]
    assert slots[0, 2].view(np.int32)[:1].tolist() == [7]
    assert int(words[1 + 1]) == c1 | 1 and int(words[1 + 2]) == c2 | 2 and int(words[0]) == 2
    assert out.tolist() == [-1, -1, -1, 10, 11, 12, 20, 21, 22]
    with pytest.raises(ValueError, match="rounds"):  # 3 rounds, ahead 2
        _make(direct._GATHER, G, at, calls, K=K, nbytes=24, count=6, piece=8, ahead=2)
    with pytest.raises(ValueError, match="rounds"):  # only an allgather goes in rounds
        _make(direct._READ, G, at, calls, K=K, nbytes=16, count=4, piece=8, ahead=4)


class _Counting:
    """pycoll._step with the calls of its steps counted."""

    def __init__(self, real: Any) -> None:
        self.real, self.calls = real, 0
        self.reduce = real.reduce

    def Step(self, *args: Any) -> Any:  # the type it stands for
        st = self.real.Step(*args)

        def counted(x: Any, out: Any) -> None:
            self.calls += 1
            st(x, out)

        return counted


@pytest.mark.parametrize("n", [2, 3, 4])
def test_replayed_steps_agree_with_and_without_it(n: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Replayed small allreduces, reduces, reduce-scatters, allgathers and
    broadcasts (the prepared direct steps) give the same bits with the compiled
    step as with the Python one, for every dtype and op they take, with poisoned
    outputs and inputs that change between calls."""
    counting = _Counting(step) if step is not None else None
    monkeypatch.setattr(direct, "compiled", counting)
    results = {}
    for use in (True, False):
        before = counting.calls if counting is not None else 0
        with communicators(n, timeout=30, compiled=use) as comms:

            def body(r: int) -> dict[tuple[object, ...], bytes]:
                c, got = comms[r], {}
                rng = np.random.default_rng(100 + r)
                for name, dtype in DTYPES.items():
                    for op in ops_for(dtype):
                        for count in (1, 13):
                            x = np.empty(count, dtype)
                            out = np.empty(count, dtype)
                            red = np.empty(count, dtype) if r == 1 else None
                            for rep in range(3):  # later calls run the plan's step
                                if name == "bool":
                                    x[:] = rng.integers(0, 2, count).astype(bool)
                                elif dtype.kind in "iu":
                                    x[:] = rng.integers(0, 50, count).astype(dtype)
                                else:
                                    x[:] = rng.standard_normal(count).astype(dtype)
                                out.view(np.uint8)[:] = 0xA5
                                c.allreduce(x, out, op=op)
                                got[("allreduce", name, op, count, rep)] = out.tobytes()
                                if op == "avg":
                                    continue
                                if red is not None:
                                    red.view(np.uint8)[:] = 0xA5
                                c.reduce(x, red, root=1, op=op)
                                if red is not None:
                                    got[("reduce", name, op, count, rep)] = red.tobytes()
                                xs = np.tile(x, n)  # n blocks of count
                                blk = np.empty(count, dtype)
                                blk.view(np.uint8)[:] = 0xA5
                                c.reduce_scatter(xs, blk, op=op)
                                got[("reduce_scatter", name, op, count, rep)] = blk.tobytes()
                    for count in (1, 13):
                        x = np.empty(count, dtype)
                        out = np.empty(n * count, dtype)
                        for rep in range(3):
                            x[:] = rng.integers(0, 2, count).astype(dtype)
                            out.view(np.uint8)[:] = 0xA5
                            c.allgather(x, out)
                            got[("allgather", name, count, rep)] = out.tobytes()
                            c.broadcast(x, root=n - 1)
                            got[("broadcast", name, count, rep)] = x.tobytes()
                return got

            results[use] = run_ranks(n, body, timeout=240)
        if counting is not None:
            ran = counting.calls - before
            assert (ran > 0) if use else (ran == 0), (use, ran)
    for r in range(n):
        on, off = results[True][r], results[False][r]
        assert on.keys() == off.keys()
        diff = [k for k in on if on[k] != off[k]]
        assert not diff, f"rank {r}: the compiled and the Python steps differ at {diff[:5]}"
        same = ("allreduce", "allgather", "broadcast")  # every rank holds the same bits
        mine = {k: v for k, v in on.items() if k[0] in same}
        assert mine == {k: v for k, v in results[True][0].items() if k[0] in same}


@pytest.mark.parametrize("n", [2, 3, 4])
@pytest.mark.parametrize("way", ["compiled", "python", "mixed"])
def test_replayed_gathers_scatters_and_alltoalls_match_numpy(
    n: int, way: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Replayed small gathers and scatters from every root and alltoalls (the
    compiled steps: a gather's root and a scatter's reader copy blocks of their
    own, a scatter's root and an alltoall leave their own block out of their
    slot) hold NumPy's bytes on every rank for every dtype, with poisoned
    outputs and inputs that change between calls; ``python``: the same calls
    through the Python steps; ``mixed``: the even ranks compiled, the odd
    ones Python (the same words and slots either way)."""
    counting = _Counting(step) if step is not None else None
    monkeypatch.setattr(direct, "compiled", counting)
    before = counting.calls if counting is not None else 0
    use = way != "python"
    if way == "mixed":
        real = direct.prepare

        def prepare(
            what: str, L: Any, bo: Any, count: int, root: int = 0, fp: int = 0,
            on: bool = True, algo: str = "direct",
        ) -> Any:  # fmt: skip
            return real(what, L, bo, count, root, fp, on and L.rank % 2 == 0, algo)

        monkeypatch.setattr(direct, "prepare", prepare)

    def data(j: int, rep: int, count: int, dtype: np.dtype) -> np.ndarray:
        """Rank j's n blocks of ``count`` at call ``rep``: each element says whose and where."""
        return ((np.arange(n * count) * 7 + 31 * j + 5 * rep) % 97).astype(dtype)

    with communicators(n, timeout=30, compiled=use) as comms:

        def body(r: int) -> list[tuple[object, ...]]:
            c, wrong = comms[r], []
            for name, dtype in DTYPES.items():
                for count in (1, 13):
                    blk, mine = slice(r * count, (r + 1) * count), np.empty(count, dtype)
                    for root in range(n):
                        big = np.empty(n * count, dtype)  # the root's output or input
                        for rep in range(3):  # later calls run the plan's step
                            want = [data(j, rep, count, dtype) for j in range(n)]
                            mine[:] = want[r][:count]
                            big.view(np.uint8)[:] = 0xA5
                            c.gather(mine, big if r == root else None, root=root)
                            if (
                                r == root
                                and big.tobytes()
                                != np.concatenate([w[:count] for w in want]).tobytes()
                            ):
                                wrong.append(("gather", name, count, root, rep))
                            big[:] = want[root]
                            mine.view(np.uint8)[:] = 0xA5
                            c.scatter(big if r == root else None, mine, root=root)
                            if mine.tobytes() != want[root][blk].tobytes():
                                wrong.append(("scatter", name, count, root, rep))
                    x, out = np.empty(n * count, dtype), np.empty(n * count, dtype)
                    for rep in range(3):
                        want = [data(j, rep, count, dtype) for j in range(n)]
                        x[:] = want[r]
                        out.view(np.uint8)[:] = 0xA5
                        c.alltoall(x, out)
                        if out.tobytes() != np.concatenate([w[blk] for w in want]).tobytes():
                            wrong.append(("alltoall", name, count, rep))
            return wrong

        wrong = run_ranks(n, body, timeout=240)
    assert not any(wrong), wrong
    if counting is not None:
        ran = counting.calls - before
        assert (ran > 0) if use else (ran == 0), (use, ran)


@pytest.mark.parametrize(
    "call", ["plan", "fresh arrays", "allgather in rounds", "gather", "scatter", "alltoall"]
)
@pytest.mark.parametrize("use", [True, False], ids=["compiled", "python"])
def test_peer_gone_under_a_replayed_step_raises(use: bool, call: str) -> None:
    """Rank 1 closes after a few replayed calls; rank 0's next one, which
    waits for rank 1's posted word, raises within the timeout instead of
    spinning or returning its own input as a sum.  The calls: an allreduce on
    the same arrays (a plan), on new arrays each time (its kind, in the
    compiled entry where it was built), an allgather of 2.5 slots (the
    compiled step in rounds), and a gather's root, a scatter's reader and an
    alltoall (their compiled steps of one round)."""
    import time

    cfg = {"group_slot_bytes": 4096, "transports": ("shm",)} if "rounds" in call else {}
    with communicators(2, timeout=5, compiled=use, **cfg) as comms:

        def body(r: int) -> object:
            c = comms[r]
            k = 2560 if "rounds" in call else 3  # float32: 2.5 slots of 4 KiB
            x, out, red = (
                np.ones(k, np.float32),
                np.empty(2 * k, np.float32),
                np.empty(k, np.float32),
            )
            a2a = np.empty(2 * k, np.float32)

            def run() -> None:
                if "rounds" in call:
                    c.allgather(x, out)
                elif call == "gather":  # rank 0, the root, waits for rank 1's word
                    c.gather(x, out if r == 0 else None, root=0)
                elif call == "scatter":  # rank 0 waits for the root's word
                    c.scatter(out if r == 1 else None, x, root=1)
                elif call == "alltoall":
                    c.alltoall(out, a2a)
                elif call == "plan":
                    c.allreduce(x, red)
                else:
                    c.allreduce(np.ones(k, np.float32), np.empty(k, np.float32))

            for _ in range(4):
                run()
            if r == 1:
                c.close()
                return None
            time.sleep(0.2)  # rank 1 is gone
            out[:] = -1
            t0 = time.monotonic()
            with pytest.raises(pycoll.PycollError) as ei:
                run()
            return type(ei.value).__name__, time.monotonic() - t0

        res = run_ranks(2, body, timeout=60)
    name, waited = res[0]
    assert name in ("PeerAbortedError", "CollectiveTimeout"), res
    assert waited < 5 + 3, res


def _count_python_replays(comms: list[pycoll.Communicator]) -> list[int]:
    """Counts, per rank, of the calls that reach the Python replay (``Dispatch._replay``)."""
    counts = [0] * len(comms)
    for r, c in enumerate(comms):
        real = c._dispatch._replay

        def counted(*a: Any, _r: int = r, _real: Any = real) -> Any:
            counts[_r] += 1
            return _real(*a)

        c._dispatch._replay = counted  # type: ignore[method-assign]
    return counts


@pytest.mark.parametrize("use", [True, False], ids=["compiled", "python"])
def test_the_compiled_entry_runs_plans_and_hands_on_the_rest(
    use: bool, caplog: pytest.LogCaptureFixture
) -> None:
    """With the compiled entry (pycoll/_replay.c), a replayed call on the
    arrays of a plan never reaches the Python replay, and is numbered and
    recorded alike; with tracing on, or PYCOLL_COMPILED=0, every call does."""
    from pycoll.engine import replay_c

    if use and replay_c is None:
        pytest.skip("pycoll._replay was not built")
    with communicators(2, compiled=use) as comms:
        counts = _count_python_replays(comms)

        def body(r: int) -> list[Any]:
            c = comms[r]
            x, out = np.full(3, r + 1, np.int32), np.empty(3, np.int32)
            c.allreduce(x, out)
            seq = c._engine.seq
            for _ in range(5):
                out[:] = -1
                assert c.allreduce(x, out) is out and out.tolist() == [3, 3, 3]
            assert c._engine.seq == seq + 5
            last = c._engine.records()[-1]
            got = [counts[r], last.status, last.seq == c._engine.seq]
            with caplog.at_level(5, logger="pycoll.engine"):
                c.allreduce(x, out)
            return [*got, counts[r]]

        res = run_ranks(2, body, timeout=60)
    for r in range(2):
        ran, status, numbered, after = res[r]
        assert status == "ok" and numbered
        assert ran == (0 if use else 5), res
        assert after == ran + 1, res  # traced: the Python replay, which logs


@pytest.mark.parametrize("use", [True, False], ids=["compiled", "python"])
def test_the_compiled_entry_runs_weak_plans_on_their_very_arrays(use: bool) -> None:
    """Plans of large arrays (weak plans, which hold none) run in the compiled
    entry too: the same objects at the same addresses never reach the Python
    replay and get the caller's own arrays back (in place: sendbuf); an array
    that replaced a dropped one, maybe at its id, runs by its kind of call in
    Python and gives its own result."""
    from pycoll.engine import replay_c
    from pycoll.plans import PLAN_MAX_BYTES

    if use and replay_c is None:
        pytest.skip("pycoll._replay was not built")
    k = PLAN_MAX_BYTES // 4 + 6  # even: alltoall's two blocks
    with communicators(2, compiled=use) as comms:
        counts = _count_python_replays(comms)

        def body(r: int) -> list[Any]:
            c = comms[r]
            x, out = np.full(k, r + 1, np.int32), np.empty(k, np.int32)
            c.allreduce(x, out)
            c.alltoall(x, out)
            assert c._engine.plans.weak_plans and not c._engine.plans.plans
            for it in range(4):
                x[:] = r + it
                out[:] = -1
                assert c.allreduce(x, out) is out
                assert (out == 1 + 2 * it).all()
                y = np.arange(k, dtype=np.int32) + r * k
                x[:] = y
                assert c.alltoall(x, out) is out
                h = k // 2
                assert (out[:h] == (np.arange(k) + 0 * k)[r * h : (r + 1) * h]).all()
                assert (out[h:] == (np.arange(k) + 1 * k)[r * h : (r + 1) * h]).all()
            z = np.full(k, r + 1, np.int32)
            c.allreduce(z)
            for _ in range(2):
                z[:] = r + 2
                assert c.allreduce(z) is z and (z == 5).all()
            ran = counts[r]
            del out  # its plans go; a new array (perhaps at its id) is not theirs
            out2 = np.empty(k, np.int32)
            x[:] = 7
            assert c.allreduce(x, out2) is out2 and (out2 == 14).all()
            after = counts[r]
            # the plan's arrays from another thread: not the plan's (its thread's
            # waiting policy), so not the compiled entry's either
            got: list[Any] = []
            tids: list[int] = []

            def other() -> None:
                tids.append(threading.get_ident())
                got.append(c.allreduce(z))

            th = threading.Thread(target=other)
            z[:] = r + 3
            th.start()
            th.join(30)
            assert got and got[0] is z and (z == 7).all()
            mine = [p.tid for p in c._engine.plans.weak_plans.values() if p.x() is z]
            return [ran, after, counts[r], mine == tids]

        res = run_ranks(2, body, timeout=60)
    for r in range(2):
        ran, after, other, remade = res[r]
        assert ran == (0 if use else 10), res
        assert after == ran + 1, res  # the new array: by its kind, in Python
        # another thread: the slow path, which makes the plan that thread's
        assert other == after and remade, res


def test_nothing_of_a_replayed_call_outlives_close() -> None:
    """The compiled entry keeps the last call's plan at hand; close drops it, so
    the arrays of that call (and the step, which views the group segment) go
    with the caller's last reference."""
    import gc
    import weakref

    with communicators(2) as comms:

        def body(r: int) -> weakref.ref[np.ndarray]:
            x, out = np.ones(3, np.float32), np.empty(3, np.float32)
            for _ in range(3):
                comms[r].allreduce(x, out)
            return weakref.ref(out)

        refs = run_ranks(2, body, timeout=60)
        gc.collect()
        assert all(ref() is not None for ref in refs)  # the plans hold them
    gc.collect()
    assert all(ref() is None for ref in refs)


@pytest.mark.parametrize("use", [True, False])
def test_connections_follow_the_compiled_switch(use: bool) -> None:
    """``PYCOLL_COMPILED`` reaches the connections (their compiled piece loops,
    ``Connection.compiled``), and a point-to-point message of many pieces
    through shm's slots arrives whole either way."""
    with communicators(2, timeout=30, compiled=use) as comms:
        for c in comms:
            conn = c._engine.conns[1 - c.rank]
            assert conn.compiled is use
        n = (600 << 10) // 4 + 3  # pieces through the slots (below the read in place)
        x = np.random.default_rng(5).standard_normal(n).astype(np.float32)

        def body(r: int) -> bytes:
            c = comms[r]
            if r == 0:
                c.send(x, 1, tag=3)
                return b""
            got = np.full(n, np.nan, np.float32)
            c.recv(got, 0, tag=3)
            return got.tobytes()

        assert run_ranks(2, body, timeout=60)[1] == x.tobytes()


def test_the_compiled_data_pointer_is_numpys() -> None:
    """``pycoll._replay.data`` reads an array's first element's address from its
    struct: the same as ``__array_interface__`` for views at offsets, empty,
    read-only and strided arrays; other objects (a subclass too) are refused,
    and ``buffers.data_ptr`` answers for them the slow way."""
    from pycoll import buffers
    from pycoll.engine import replay_c

    if replay_c is None:
        pytest.skip("pycoll._replay was not built")
    base = np.arange(64, dtype=np.float64)
    ro = base[5:9]
    ro.flags.writeable = False
    for a in (base, base[3:], base[::3], np.empty(0, np.int8), ro, base.reshape(8, 8)[2:, 1:]):
        assert replay_c.data(a) == a.__array_interface__["data"][0]
        assert buffers.data_ptr(a) == a.__array_interface__["data"][0]
    mm = base.view(np.matrix)
    with pytest.raises(TypeError):
        replay_c.data(mm)
    with pytest.raises(TypeError):
        replay_c.data(b"bytes")
    assert buffers.data_ptr(mm) == mm.__array_interface__["data"][0]


@pytest.mark.parametrize("n", [2, 3, 4])
def test_allgathers_in_rounds_agree_across_compiled_and_python_ranks(
    n: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Replayed allgathers of more than a slot a rank (4 KiB slots), out of
    place and in place: the even ranks take the compiled step in rounds, the
    odd ones direct's Python rounds, and every rank must hold every block,
    bit for bit, with the outputs poisoned and the inputs new at every call.
    Past three slots a rank (the cross-memory route) no step is prepared."""
    used: dict[int, int] = {}
    real = direct._compiled_rounds

    def rounds(L: Any, G: Any, count: int) -> bool:
        ok = L.rank % 2 == 0 and real(L, G, count)
        used[L.rank] = used.get(L.rank, 0) + ok
        return ok

    monkeypatch.setattr(direct, "_compiled_rounds", rounds)
    slot = 4096
    cfg = {"transports": ("shm",), "group_slot_bytes": slot, "tune": False, "timeout": 30}
    dtypes = [np.dtype(t) for t in ("float32", "int8", "float64", "complex128", "bool")]
    with communicators(n, **cfg) as comms:

        def body(r: int) -> list[tuple[str, int, bool, int]]:
            c, bad = comms[r], []
            for dtype in dtypes:
                e = slot // dtype.itemsize  # elements of a slot
                for k in (e + 1, 2 * e, 2 * e + 7, 3 * e - 1, 3 * e + 1):
                    for in_place in (False, True):
                        for rep in range(3):  # later calls replay the prepared step
                            xs = [
                                np.random.default_rng([q, k, rep]).integers(0, 100, k).astype(dtype)
                                for q in range(n)
                            ]
                            out = np.empty(n * k, dtype)
                            out.view(np.uint8)[:] = 0xA5
                            x = xs[r]
                            if in_place:
                                out[r * k : (r + 1) * k] = x
                                x = out[r * k : (r + 1) * k]
                            c.allgather(x, out)
                            if out.tobytes() != np.concatenate(xs).tobytes():
                                bad.append((dtype.name, k, in_place, rep))
            return bad

        res = run_ranks(n, body, timeout=240)
    assert res == [[]] * n, res
    # rounds of 2-3 slots (4 sizes, 5 dtypes; in place or not, one step):
    # prepared once each on the compiled ranks; the 3-slot-plus size never
    assert all(used.get(r, 0) == (20 if r % 2 == 0 else 0) for r in range(n)), used


@pytest.mark.parametrize("other", ["another count", "a broadcast", "an allgather in one slot"])
def test_a_mismatch_under_an_allgather_in_rounds_raises(
    other: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two agreed allgathers of 2.5 slots a rank (the second replays the
    compiled step in rounds), then rank 1 runs another call: the mismatch
    surfaces at once on some rank, and no rank returns twice."""
    from tests.test_mismatch import _run_case

    prepared: list[int] = []
    real = direct._compiled_rounds

    def rounds(L: Any, G: Any, count: int) -> bool:
        ok = real(L, G, count)
        prepared.extend([L.rank] if ok else [])
        return ok

    monkeypatch.setattr(direct, "_compiled_rounds", rounds)

    k = 2560  # int32: 2.5 slots of 4 KiB

    def make(r: int) -> tuple[Any, Any]:
        x = np.full(k, r + 1, np.int32)
        out = np.empty(2 * k, np.int32)

        def fn(c: Any, a: str) -> Any:
            for _ in range(2):
                c.allgather(x, out, algorithm=a)
            if r == 0:
                return c.allgather(x, out, algorithm=a)
            if other == "another count":
                return c.allgather(x[:-1], out[:-2], algorithm=a)
            if other == "a broadcast":
                return c.broadcast(x, root=1, algorithm=a)
            return c.allgather(x[:1000], out[:2000], algorithm=a)

        return fn, None

    _run_case({"transports": ("shm",), "group_slot_bytes": 4096}, "direct", make)
    if step is not None:
        assert set(prepared) == {0, 1}, prepared  # both ranks replayed the rounds


@pytest.mark.parametrize("n", [2, 3])
def test_the_compiled_entry_runs_kinds_on_fresh_arrays(n: int) -> None:
    """A call on fresh arrays of a known kind (a new array each call, as
    ``tensor.numpy()`` gives) whose run is a compiled step alone runs in the
    compiled entry on the caller's arrays as they are: allreduce out of place
    and in place (no recvbuf), allgather (the own block copied first: a 2-D
    output), broadcast; 1-D and 2-D, reduced in C or through NumPy
    (float16), right every call with the outputs poisoned and numbered as the
    Python replay numbers them.  Calls that it
    may not take go on to Python: an output that is the input, avg (a
    division after the step), another thread's call; and a read-only output
    fails there as it should."""
    from pycoll.engine import replay_c

    if replay_c is None or step is None:
        pytest.skip("pycoll._replay or pycoll._step was not built")
    with communicators(n) as comms:
        counts = _count_python_replays(comms)

        def body(r: int) -> list[Any]:
            c, bad = comms[r], []
            cases = [("float32", (7,), "sum"), ("int64", (3, 5), "max"), ("float16", (13,), "sum")]
            for it in range(6):
                for name, shape, op in cases:
                    xs = [
                        np.random.default_rng([q, it]).integers(0, 9, shape).astype(name)
                        for q in range(n)
                    ]
                    x, out = xs[r].copy(), np.full(shape, 99, name)
                    got = c.allreduce(x, out, op=op)
                    want = xs[0].copy()
                    for v in xs[1:]:
                        want = np.maximum(want, v) if op == "max" else want + v
                    if got is not out or out.tobytes() != want.tobytes():
                        bad.append((name, it))
                for name, shape, _ in cases:  # allgather (own block first) and broadcast
                    xs = [
                        np.random.default_rng([q, it, 1]).integers(0, 9, shape).astype(name)
                        for q in range(n)
                    ]
                    out = np.full((n, *shape), 99, name)
                    if c.allgather(xs[r].copy(), out) is not out or (out != np.stack(xs)).any():
                        bad.append(("allgather", name, it))
                    b = xs[r].copy()
                    if c.broadcast(b, root=n - 1) is not b or (b != xs[n - 1]).any():
                        bad.append(("broadcast", name, it))
                    a = xs[r].copy()  # in place, no recvbuf: step(a, a)
                    want = np.sum(xs, axis=0, dtype=name)  # small integers: exact in float16
                    if c.allreduce(a) is not a or (a != want).any():
                        bad.append(("allreduce in place", name, it))
            seq, fresh = c._engine.seq, counts[r]
            big = np.full(8, r + 1.0)
            c.allreduce(big, big)  # in place: its own kind, no overlap allowed
            for _ in range(2):
                y = np.full(8, r + 1.0)
                if c.allreduce(y, y) is not y or (y != n * (n + 1) / 2).any():
                    bad.append("in place")
            for _ in range(3):
                a, o = np.full(4, float(r)), np.empty(4)
                if (c.allreduce(a, o, op="avg") != (n - 1) / 2).any():
                    bad.append("avg")
            python = counts[r] - fresh
            got: list[Any] = []
            th = threading.Thread(
                target=lambda: got.append(
                    c.allreduce(np.ones(7, np.float32), np.empty(7, np.float32))
                )
            )
            th.start()
            th.join(30)
            if not got or (got[0] != n).any():
                bad.append("thread")
            ro = np.empty(7, np.float32)
            ro.flags.writeable = False
            try:
                c.allreduce(np.ones(7, np.float32), ro)
                bad.append("read-only accepted")
            except pycoll.InvalidArgumentError as exc:
                if "recvbuf" not in str(exc):
                    bad.append(str(exc))
            c.barrier()
            return [bad, seq, fresh, python]

        res = run_ranks(n, body, timeout=120)
    for r in range(n):
        bad, seq, fresh, python = res[r]
        assert bad == [], res
        assert seq == 72, res  # every call numbered
        assert fresh == 0, res  # after each kind's first call, none reached Python
        # avg's two replays ran in Python (in place is no kind's: the slow path)
        assert python == 2, res


def test_a_mismatch_under_a_kind_in_the_compiled_entry_raises() -> None:
    """Two agreed allreduces on fresh arrays (the second runs by its kind in
    the compiled entry), then rank 1 runs another op: the mismatch surfaces at
    once on some rank, and no rank returns twice."""
    from tests.test_mismatch import _run_case

    def make(r: int) -> tuple[Any, Any]:
        def fn(c: Any, a: str) -> Any:
            for _ in range(2):
                c.allreduce(np.full(5, r + 1, np.int32), np.empty(5, np.int32), algorithm=a)
            op = "max" if r == 1 else "sum"
            return c.allreduce(
                np.full(5, r + 1, np.int32), np.empty(5, np.int32), op=op, algorithm=a
            )

        return fn, None

    _run_case({"transports": ("shm",)}, "direct", make)


def test_a_step_yields_only_under_a_policy_that_yields(monkeypatch: pytest.MonkeyPatch) -> None:
    """The caller's waiting policies (spin, then yield for long) give a step
    STEP_YIELD_NS of yields; the worker thread's, which naps almost at once to
    leave the GIL to the caller, none (the step holds the GIL while it yields)."""
    from pycoll.family import _waiting_policy
    from pycoll.reduce import ReduceOp
    from transports.base import Backoff

    if step is None:
        pytest.skip("pycoll._step was not built")
    made: list[int] = []

    class Recording:
        reduce = step.reduce

        @staticmethod
        def Step(*args: Any) -> Any:  # the type it stands for
            made.append(args[24])  # yield_ns
            return step.Step(*args)

    monkeypatch.setattr(direct, "compiled", Recording)
    with communicators(2) as comms:
        L = comms[0]._engine.links(np.dtype(np.float32), ReduceOp.SUM)
        fam = comms[0]._engine.fam
        for bo in (_waiting_policy(False), _waiting_policy(True), fam.polite, Backoff()):
            assert direct.prepare("allreduce", L, bo, 4) is not None
    assert made == [direct.STEP_YIELD_NS, direct.STEP_YIELD_NS, 0, direct.STEP_YIELD_NS], made
