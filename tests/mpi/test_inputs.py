"""Host inputs other than NumPy arrays, as mpi4py takes them: the buffer protocol
(memoryview, bytearray, bytes, array.array) and torch CPU tensors, zero-copy.

Each kind of buffer is made first and then seen through a NumPy view of its own
memory: the collective is called on the buffer, and the view must show the
NumPy reference (so the result landed in the caller's memory, not in a copy).
Runs on every rank under mpiexec (tests/test_mpirun.py: n = 1..4).
"""

from __future__ import annotations

import array
import itertools

import ml_dtypes
import numpy as np
import pytest
from mpi4py import MPI

import pycoll
from tests.reference import assert_close, data, reference

pytestmark = [pytest.mark.mpi, pytest.mark.timeout(300)]

WORLD = MPI.COMM_WORLD
RANK, SIZE = WORLD.Get_rank(), WORLD.Get_size()
SIZES = [1, 7, 1021]


def _torch():
    return pytest.importorskip("torch", reason="torch is not installed")


def _bytearray(count):
    b = bytearray(count)
    return b, np.frombuffer(b, np.uint8)


def _array(code, dtype):
    def make(count):
        a = array.array(code, bytes(count * np.dtype(dtype).itemsize))
        return a, np.frombuffer(a, dtype)

    return make


def _memoryview(fmt, dtype):
    def make(count):
        mv = memoryview(bytearray(count * np.dtype(dtype).itemsize)).cast(fmt)
        return mv, np.frombuffer(mv, dtype)

    return make


def _tensor(name):
    def make(count):
        torch = _torch()
        t = torch.zeros(count, dtype=getattr(torch, name))
        if name == "bfloat16":  # NumPy's DLPack has no bfloat16: its bits
            return t, np.from_dlpack(t.view(torch.int16)).view(ml_dtypes.bfloat16)
        return t, np.from_dlpack(t)

    return make


#: name -> (make(count) -> (buffer, NumPy view of its memory), the op to reduce with)
KINDS = {
    "bytearray": (_bytearray, "sum"),
    "array-d": (_array("d", np.float64), "sum"),
    "array-h": (_array("h", np.int16), "bxor"),
    "memoryview-f": (_memoryview("f", np.float32), "max"),
    "memoryview-?": (_memoryview("?", np.bool_), "bor"),
    "torch-float32": (_tensor("float32"), "sum"),
    "torch-bfloat16": (_tensor("bfloat16"), "sum"),
    "torch-complex64": (_tensor("complex64"), "prod"),
    "torch-bool": (_tensor("bool"), "band"),
}


@pytest.fixture(scope="module")
def comm():
    c = pycoll.init(timeout=120)
    yield c
    c.close()


def _made(kind, count, values=None):
    make, _ = KINDS[kind]
    buf, view = make(count)
    if values is None:
        view.view(np.uint8)[...] = 0xA5  # poison
        if view.dtype == np.bool_:
            view[...] = False
    else:
        view[...] = values
    return buf, view


@pytest.mark.parametrize("kind", list(KINDS))
def test_allreduce(comm, kind):
    op = KINDS[kind][1]
    for count, inplace in itertools.product(SIZES, (False, True)):
        dtype = _made(kind, 1)[1].dtype
        xs = [data(r, count, dtype, op) for r in range(SIZE)]
        what = f"allreduce {kind} {op} count={count} inplace={inplace}"
        x, xv = _made(kind, count, xs[RANK])
        if inplace:
            got = comm.allreduce(x, op=op)
            assert got is x
            out_view = xv
        else:
            out, out_view = _made(kind, count)
            got = comm.allreduce(x, out, op=op)
            assert got is out
            assert np.array_equal(xv.view(np.uint8), xs[RANK].view(np.uint8)), what
        assert_close(out_view, reference(xs, op), dtype, SIZE, what)
        # again on the same buffers (a replayed plan, where there is one)
        xv[...] = xs[RANK]
        comm.allreduce(x, op=op) if inplace else comm.allreduce(x, out, op=op)
        assert_close(out_view, reference(xs, op), dtype, SIZE, what + " again")


@pytest.mark.parametrize("kind", list(KINDS))
def test_allgather(comm, kind):
    for count, inplace in itertools.product(SIZES, (False, True)):
        dtype = _made(kind, 1)[1].dtype
        xs = [data(r, count, dtype, "sum") for r in range(SIZE)]
        what = f"allgather {kind} count={count} inplace={inplace}"
        out, out_view = _made(kind, SIZE * count)
        if inplace:
            out_view[RANK * count : (RANK + 1) * count] = xs[RANK]
            got = comm.allgather(out[RANK * count : (RANK + 1) * count], out)
        else:
            x, _ = _made(kind, count, xs[RANK])
            got = comm.allgather(x, out)
        assert got is out
        assert np.array_equal(out_view.view(np.uint8), np.concatenate(xs).view(np.uint8)), what
        x, _ = _made(kind, count, xs[RANK])
        new = comm.allgather(x)  # a new output: the input's family for tensors
        if kind.startswith("torch"):
            assert (
                type(new) is type(x) and new.dtype == x.dtype and tuple(new.shape) == (SIZE, count)
            )
        else:
            assert isinstance(new, np.ndarray) and new.shape == (SIZE, count)
            assert np.array_equal(new.reshape(-1).view(np.uint8), np.concatenate(xs).view(np.uint8))


@pytest.mark.parametrize("kind", list(KINDS))
def test_broadcast(comm, kind):
    for count, root in itertools.product(SIZES, range(SIZE)):
        dtype = _made(kind, 1)[1].dtype
        want = data(root, count, dtype, "sum", salt=7)
        buf, view = _made(kind, count, want) if RANK == root else _made(kind, count)
        assert comm.broadcast(buf, root=root) is buf
        assert np.array_equal(view.view(np.uint8), want.view(np.uint8)), (kind, count, root)


def test_read_only_inputs(comm):
    """bytes and read-only memoryviews are fine where nothing is written."""
    count = 13
    xs = [data(r, count, np.dtype(np.uint8), "sum") for r in range(SIZE)]
    for ro in (xs[RANK].tobytes(), memoryview(xs[RANK].copy()).toreadonly()):
        out = np.empty(count, np.uint8)
        comm.allreduce(ro, out)
        assert np.array_equal(out, reference(xs, "sum").astype(np.uint8))
        g = np.empty(SIZE * count, np.uint8)
        comm.allgather(ro, g)
        assert np.array_equal(g, np.concatenate(xs))
    root = SIZE - 1
    if RANK == root:
        b = comm.broadcast(xs[root].tobytes(), root=root)
    else:
        b = comm.broadcast(bytearray(count), root=root)
    assert bytes(b) == xs[root].tobytes()


def test_buffers_stay_resizable(comm):
    """Nothing holds an export or makes storage non-resizable after the call: a
    bytearray can grow and a torch tensor can be resized."""
    ba = bytearray(b"\x01" * 8)
    for _ in range(3):
        comm.allreduce(ba, op="max")
    ba.extend(b"\x02" * 8)  # BufferError while an export lives
    assert len(ba) == 16
    torch = _torch()
    t = torch.ones(8)
    for _ in range(3):
        comm.allreduce(t)
    assert torch.equal(t, torch.full((8,), float(SIZE**3)))
    t.resize_(1 << 16)  # "Trying to resize storage that is not resizable" after .numpy()
    t2 = torch.ones(8)
    comm.allreduce(t2)  # the same id may come back: the old plan must not apply
    assert torch.equal(t2, torch.full((8,), float(SIZE)))
