"""The compiled step (pycoll/_step.c): built where a C compiler is, the same
bytes as NumPy's reductions and as the Python steps, and refused where it
does not apply.

Unit checks call its five functions on NumPy arrays; then replayed small
allreduces, reduces, reduce-scatters, allgathers and broadcasts (ranks as
threads) with the compiled step on and off (``compiled=False``: the Python
steps) must agree bitwise for every dtype and op, at n = 2, 3 and 4, with
poisoned outputs.
"""

from __future__ import annotations

import shutil
import sysconfig
from pathlib import Path

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
def test_post_wait_copies_publishes_and_waits() -> None:
    """post_wait copies x into the slot, then stores done and the posted word;
    it returns the first peer whose word is not there after its spins."""
    slot = np.zeros(8, np.uint8)
    words = np.zeros(4, np.uint64)  # [done, posted, peer a, peer b]
    at = [_addr(words) + 8 * k for k in range(4)]
    x = np.arange(8, dtype=np.uint8)
    words[2] = 77
    k = step.post_wait(x, _addr(slot), 8, at[0], 41, at[1], 77, (at[2], at[3]), 16)
    assert k == 1 and slot.tolist() == list(range(8))
    assert words[:2].tolist() == [41, 77]
    words[3] = 77
    assert step.post_wait(None, 0, 0, at[0], 42, at[1], 77, (at[2], at[3]), 16) == -1
    assert words[0] == 42
    with pytest.raises(ValueError, match="7 bytes for a 8-byte step"):
        step.post_wait(x[:7], _addr(slot), 8, at[0], 0, at[1], 0, (), 0)
    step.store(at[0], 99)
    assert words[0] == 99


class _Counting:
    """pycoll._step with its calls counted."""

    def __init__(self, real: object) -> None:
        self.real, self.calls = real, 0
        for name in ("reduce", "store", "wait", "copy_blocks"):
            setattr(self, name, getattr(real, name))

    def post_wait(self, *args: object) -> int:
        self.calls += 1
        return self.real.post_wait(*args)  # type: ignore[attr-defined,no-any-return]


@needs_step
def test_wait_and_copy_blocks() -> None:
    words = np.array([5, 6], np.uint64)
    at = (_addr(words), _addr(words) + 8)
    assert step.wait(at, 5, 0) == 1  # the second word is not 5
    words[1] = 5
    assert step.wait(at, 5, 0) == -1
    a, b = np.arange(4, dtype=np.uint8), np.arange(4, 8, dtype=np.uint8)
    out = np.full(12, 0xEE, np.uint8)
    step.copy_blocks(out, 4, (_addr(a), 0, _addr(b)))  # 0: the own block, untouched
    assert out.tolist() == [0, 1, 2, 3, 0xEE, 0xEE, 0xEE, 0xEE, 4, 5, 6, 7]
    with pytest.raises(ValueError, match="12-byte output for 2 blocks of 4"):
        step.copy_blocks(out, 4, (_addr(a), _addr(b)))


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


@pytest.mark.parametrize("use", [True, False], ids=["compiled", "python"])
def test_peer_gone_under_a_replayed_step_raises(use: bool) -> None:
    """Rank 1 closes after a few replayed allreduces; rank 0's next one, which
    waits for rank 1's posted word, raises within the timeout instead of
    spinning or returning its own input as a sum."""
    import time

    with communicators(2, timeout=5, compiled=use) as comms:

        def body(r: int) -> object:
            c = comms[r]
            x, out = np.ones(3, np.float32), np.empty(3, np.float32)
            for _ in range(4):
                c.allreduce(x, out)
            assert (out == 2).all()
            if r == 1:
                c.close()
                return None
            time.sleep(0.2)  # rank 1 is gone
            out[:] = -1
            t0 = time.monotonic()
            with pytest.raises(pycoll.PycollError) as ei:
                c.allreduce(x, out)
            return type(ei.value).__name__, time.monotonic() - t0

        res = run_ranks(2, body, timeout=60)
    name, waited = res[0]
    assert name in ("PeerAbortedError", "CollectiveTimeout"), res
    assert waited < 5 + 3, res
