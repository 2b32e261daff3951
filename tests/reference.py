"""Seeded inputs and NumPy references for the collective tests (host and GPU).

Every rank derives every rank's input from seeds, so each one computes the
reference itself; ``assert_identical_everywhere`` compares result hashes across
``MPI.COMM_WORLD``.
"""

from __future__ import annotations

import hashlib

import ml_dtypes
import numpy as np


def data(rank: int, count: int, dtype: np.dtype, op: str, salt: int = 0) -> np.ndarray:
    rng = np.random.default_rng([rank, count, dtype.num, len(op), salt])
    if dtype.kind in "iu":
        info = np.iinfo(dtype)
        lo, hi = (max(info.min, -3), min(info.max, 4)) if op == "prod" else (info.min, info.max)
        return rng.integers(lo, hi, count, dtype=dtype, endpoint=True)
    v = rng.uniform(0.8, 1.25, count) if op == "prod" else rng.uniform(-4, 4, count)
    return v.astype(dtype)


def reference(xs: list[np.ndarray], op: str) -> np.ndarray:
    dt = xs[0].dtype
    wide = np.float64 if dt.kind == "f" or dt == ml_dtypes.bfloat16 else dt
    acc = xs[0].astype(wide)
    for x in xs[1:]:
        y = x.astype(wide)
        if op in ("sum", "avg"):
            acc = acc + y
        elif op == "prod":
            acc = acc * y
        elif op == "min":
            acc = np.minimum(acc, y)
        else:
            acc = np.maximum(acc, y)
    if op == "avg":
        acc = acc / len(xs)
    return acc


def assert_close(got: np.ndarray, ref: np.ndarray, dtype: np.dtype, n: int, what: str) -> None:
    if dtype.kind in "iu":
        assert np.array_equal(got, ref.astype(dtype)), what
        return
    tol = {2: 2e-2 if dtype == np.float16 else 6e-2, 4: 1e-5, 8: 1e-12}[dtype.itemsize] * n
    g = got.astype(np.float64)
    assert np.allclose(g, ref, rtol=tol, atol=tol * 4), f"{what}: max err {np.max(np.abs(g - ref))}"


def assert_identical_everywhere(a: np.ndarray, what: str) -> None:
    from mpi4py import MPI

    h = hashlib.sha256(np.ascontiguousarray(a).view(np.uint8).tobytes()).hexdigest()
    hs = MPI.COMM_WORLD.allgather(h)
    assert len(set(hs)) == 1, f"{what}: ranks differ bitwise: {hs}"
