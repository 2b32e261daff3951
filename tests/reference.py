"""Seeded inputs and NumPy references for the collective tests (host and GPU).

Every rank derives every rank's input from seeds, so each one computes the
reference itself; ``assert_identical_everywhere`` compares result hashes across
``MPI.COMM_WORLD``.
"""

from __future__ import annotations

import hashlib

import ml_dtypes
import numpy as np

#: Every op pycoll takes.
OPS = ["sum", "prod", "min", "max", "avg", "band", "bor", "bxor"]
BITWISE = ("band", "bor", "bxor")
_UFUNCS = {
    "sum": np.add,
    "avg": np.add,
    "prod": np.multiply,
    "min": np.minimum,
    "max": np.maximum,
    "band": np.bitwise_and,
    "bor": np.bitwise_or,
    "bxor": np.bitwise_xor,
}


def ops_for(dtype: np.dtype) -> list[str]:
    """The ops pycoll must reduce ``dtype`` with (the contract, written out again
    here so that a test checks the library's table rather than reuses it)."""
    if dtype.kind == "b":
        return ["min", "max", *BITWISE]
    if dtype.kind in "iu":
        return ["sum", "prod", "min", "max", *BITWISE]
    if dtype.kind == "c":
        return ["sum", "prod", "avg"]
    return ["sum", "prod", "min", "max", "avg"]


def data(rank: int, count: int, dtype: np.dtype, op: str, salt: int = 0) -> np.ndarray:
    rng = np.random.default_rng([rank, count, dtype.num, len(op), salt])
    if dtype.kind == "b":
        return rng.integers(0, 1, count, endpoint=True).astype(dtype)
    if dtype.kind == "c":
        if op == "prod":  # near the unit circle: products of n stay near 1
            v = rng.uniform(0.8, 1.25, count) * np.exp(1j * rng.uniform(-np.pi, np.pi, count))
        else:
            v = rng.uniform(-4, 4, count) + 1j * rng.uniform(-4, 4, count)
        return v.astype(dtype)
    if dtype.kind in "iu":
        info = np.iinfo(dtype)
        lo, hi = (max(info.min, -3), min(info.max, 4)) if op == "prod" else (info.min, info.max)
        return rng.integers(lo, hi, count, dtype=dtype, endpoint=True)
    v = rng.uniform(0.8, 1.25, count) if op == "prod" else rng.uniform(-4, 4, count)
    return v.astype(dtype)


def reference(xs: list[np.ndarray], op: str) -> np.ndarray:
    dt = xs[0].dtype
    if dt.kind == "f" or dt == ml_dtypes.bfloat16:
        wide: np.dtype = np.dtype(np.float64)
    else:  # integers and bools exactly (wrapping), complex in double precision
        wide = np.dtype(np.complex128) if dt.kind == "c" else dt
    acc = xs[0].astype(wide)
    f = _UFUNCS[op]
    for x in xs[1:]:
        acc = f(acc, x.astype(wide))
    if op == "avg":
        acc = acc / len(xs)
    return acc


def assert_close(got: np.ndarray, ref: np.ndarray, dtype: np.dtype, n: int, what: str) -> None:
    assert got.dtype == dtype, f"{what}: dtype {got.dtype}"
    if dtype.kind in "iub":
        assert np.array_equal(got, ref.astype(dtype)), what
        return
    part = dtype.itemsize // 2 if dtype.kind == "c" else dtype.itemsize  # of a component
    tol = {2: 2e-2 if dtype == np.float16 else 6e-2, 4: 1e-5, 8: 1e-12}[part] * n
    g = got.astype(np.complex128 if dtype.kind == "c" else np.float64)
    assert np.allclose(g, ref, rtol=tol, atol=tol * 4), f"{what}: max err {np.max(np.abs(g - ref))}"


def assert_identical_everywhere(a: np.ndarray, what: str) -> None:
    from mpi4py import MPI

    h = hashlib.sha256(np.ascontiguousarray(a).view(np.uint8).tobytes()).hexdigest()
    hs = MPI.COMM_WORLD.allgather(h)
    assert len(set(hs)) == 1, f"{what}: ranks differ bitwise: {hs}"
