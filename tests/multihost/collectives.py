"""Run under mpiexec across simulated hosts: every collective against NumPy.

The host layout comes from ``PYCOLL_TEST_HOSTS`` (ranks per host, e.g. ``2,2``),
so each rank knows which peers share its host and asserts that pycoll picked
``PYCOLL_TEST_SAME_HOST`` (default ``shm``) for them and ``PYCOLL_TEST_OTHER_HOST``
(default ``tcp``) for everyone else.  Prints ``OK rank <r> ...`` at
the end; any mismatch raises, and mpi4py's ``-m mpi4py`` aborts the whole job.
"""

from __future__ import annotations

import os
import socket
import sys

import numpy as np

import pycoll

SIZES = (1, 7, 13, 1031, 65537)
CASES = (
    ("int32", "sum"),
    ("int64", "max"),
    ("uint8", "min"),
    ("float32", "sum"),
    ("float64", "prod"),
    ("float64", "avg"),
)


def host_of(rank: int, layout: list[int]) -> int:
    for h, n in enumerate(layout):
        if rank < n:
            return h
        rank -= n
    raise ValueError("rank beyond the layout")


def data(rank: int, n: int, dtype: str, salt: int) -> np.ndarray:
    rng = np.random.default_rng([rank, n, salt, len(dtype)])
    if np.dtype(dtype).kind == "f":
        return rng.uniform(0.5, 1.5, n).astype(dtype)
    return rng.integers(0, 4, n).astype(dtype)


def reduce_ref(xs: list[np.ndarray], op: str) -> np.ndarray:
    stack = np.stack(xs)
    if op == "avg":
        return stack.sum(axis=0) / len(xs)
    return {"sum": np.sum, "prod": np.prod, "min": np.min, "max": np.max}[op](stack, axis=0)


def close(got: np.ndarray, want: np.ndarray, what: str) -> None:
    if got.dtype.kind == "f":
        ok = np.allclose(
            got, want.astype(got.dtype), rtol=1e-4 if got.dtype == np.float32 else 1e-10
        )
    else:
        ok = np.array_equal(got, want.astype(got.dtype))
    if not ok:
        bad = np.flatnonzero(~np.isclose(got.astype(float), want.astype(float)))[:5]
        raise AssertionError(
            f"{what}: mismatch at {bad.tolist()}: got {got.ravel()[bad]}, want {want.ravel()[bad]}"
        )


def main() -> int:
    layout = [int(x) for x in os.environ["PYCOLL_TEST_HOSTS"].split(",")]
    with pycoll.init() as comm:
        r, size = comm.rank, comm.size
        assert size == sum(layout), (size, layout)
        me = host_of(r, layout)
        same_host = os.environ.get("PYCOLL_TEST_SAME_HOST", "shm")
        other_host = os.environ.get("PYCOLL_TEST_OTHER_HOST", "tcp")
        kinds = {p: comm.transport_of(p) for p in range(size)}
        for p, kind in kinds.items():
            want = "self" if p == r else (same_host if host_of(p, layout) == me else other_host)
            assert kind == want, f"rank {r} -> {p}: transport {kind}, expected {want}"
        print(f"rank {r} host {socket.gethostname()} transports {kinds}", flush=True)

        salt = 0
        for n in SIZES:
            for dtype, op in CASES:
                salt += 1
                xs = [data(q, n, dtype, salt) for q in range(size)]
                what = f"n={n} {dtype} {op}"

                got = comm.allreduce(xs[r].copy(), op=op)
                close(got, reduce_ref(xs, op), f"allreduce {what}")

                root = salt % size
                out = comm.reduce(xs[r].copy(), root=root, op=op)
                if r == root:
                    close(
                        np.asarray(out),
                        reduce_ref(xs, op),
                        f"reduce root={root} {what}",
                    )

                blocks = [data(q, n * size, dtype, salt + 1000) for q in range(size)]
                got = comm.reduce_scatter(blocks[r].copy(), op=op)
                close(
                    got,
                    reduce_ref(blocks, op)[r * n : (r + 1) * n],
                    f"reduce_scatter {what}",
                )

            x = data(r, n, "float32", salt)
            got = comm.allgather(x)
            close(
                np.asarray(got).reshape(size, n),
                np.stack([data(q, n, "float32", salt) for q in range(size)]),
                f"allgather n={n}",
            )

            for root in {0, size - 1}:
                buf = data(root, n, "int64", salt) if r == root else np.zeros(n, np.int64)
                comm.broadcast(buf, root=root)
                close(buf, data(root, n, "int64", salt), f"broadcast n={n} root={root}")
        comm.barrier()
    print(f"OK rank {r} host {socket.gethostname()}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
