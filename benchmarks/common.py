"""Shared pieces of the benchmark scripts: sizes, dtypes, bus-bandwidth factors, metadata."""

from __future__ import annotations

import datetime
import os
import platform
import socket
import sys
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

#: The collectives ``all`` means in the sweep (the five of the first releases).
COLLECTIVES = ("allreduce", "allgather", "broadcast", "reduce_scatter", "reduce")
#: Block movers without a reduction, and the ring shift of point-to-point.
EXCHANGES = ("alltoall", "gather", "scatter", "sendrecv")
OPS = ("sum", "prod", "min", "max", "avg")

#: nccl-tests' bus-bandwidth factors: busbw = algbw * factor(n).  Its
#: doc/PERFORMANCE.md gives all but the last three, which are in its
#: gather.cu, scatter.cu and sendrecv.cu (GetBw):
#:
#: ==============  ==========  =============================================
#: allreduce       2(n-1)/n    each element: n-1 additions, n assignments
#: allgather       (n-1)/n     each rank takes n-1 blocks of size / n
#: reduce_scatter  (n-1)/n     each rank reduces n-1 blocks of size / n
#: broadcast       1           all of size leaves the root
#: reduce          1           all of size reaches the root
#: alltoall        (n-1)/n     each rank sends n-1 of its n blocks
#: gather          (n-1)/n     the root takes n-1 blocks of size / n
#: scatter         (n-1)/n     the root gives out n-1 blocks of size / n
#: sendrecv        1           each rank sends size and receives size
#: ==============  ==========  =============================================
BUSBW_FACTOR = {
    "allreduce": lambda n: 2 * (n - 1) / n,
    "allgather": lambda n: (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "broadcast": lambda n: 1.0,
    "reduce": lambda n: 1.0,
    "alltoall": lambda n: (n - 1) / n,
    "gather": lambda n: (n - 1) / n,
    "scatter": lambda n: (n - 1) / n,
    "sendrecv": lambda n: 1.0,
}


class Skip(Exception):
    """A system cannot run this case; the message is the one-line reason."""


def _dtypes() -> dict[str, tuple[np.dtype, str]]:
    import ml_dtypes

    table = {
        "int8": (np.int8, "int8"),
        "uint8": (np.uint8, "uint8"),
        "int32": (np.int32, "int32"),
        "uint32": (np.uint32, "uint32"),
        "int64": (np.int64, "int64"),
        "uint64": (np.uint64, "uint64"),
        "float16": (np.float16, "half"),
        "bfloat16": (ml_dtypes.bfloat16, "bfloat16"),
        "float32": (np.float32, "float"),
        "float64": (np.float64, "double"),
    }
    return {k: (np.dtype(t), nccl) for k, (t, nccl) in table.items()}


#: nccl-tests' spellings accepted by ``-d``
DTYPE_ALIASES = {"half": "float16", "float": "float32", "double": "float64", "bf16": "bfloat16"}


def dtype_names(value: str) -> list[str]:
    """``-d`` value -> the dtype names it means (``all``: every one, as nccl-tests)."""
    return list(_dtypes()) if value.lower() == "all" else [value]


def parse_dtype(name: str) -> tuple[np.dtype, str, str]:
    """``-d`` value -> (numpy dtype, canonical name, nccl-tests name).

    Raises:
        ValueError: an unknown name (the message lists the known ones).
    """
    key = DTYPE_ALIASES.get(name.lower(), name.lower())
    table = _dtypes()
    if key not in table:
        raise ValueError(
            f"unknown dtype {name!r}; choose from {', '.join(table)}, all (or half, float, double)"
        )
    dt, nccl = table[key]
    return dt, key, nccl


def parse_size(text: str | int) -> int:
    """``8``, ``64K``, ``256M``, ``1G`` (binary multiples) -> bytes."""
    if isinstance(text, int):
        return text
    from pycoll.config import parse_bytes

    return parse_bytes(text.strip().upper().removesuffix("B").removesuffix("I"))


def fmt_size(n: int) -> str:
    for unit, m in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if n >= m and n % m == 0:
            return f"{n // m}{unit}"
    return f"{n}B" if n < 1024 else f"{n / 1024:.1f}K"


def size_list(lo: int, hi: int, factor: float, step: int = 0) -> list[int]:
    """nccl-tests' sweep: lo, lo*f, lo*f^2 ... <= hi (or lo, lo+step, ... with ``step``)."""
    out = []
    s = lo
    while s <= hi:
        out.append(s)
        nxt = s + step if step else int(s * factor)
        if nxt <= s:
            break
        s = nxt
    return out


def geometry(collective: str, size: int, itemsize: int, n: int) -> tuple[int, int, int]:
    """(send count, recv count, count column) for an nccl-tests ``size``.

    As nccl-tests does, ``size`` is the larger buffer: the output of allgather
    and gather (on the root), the input of reduce_scatter and scatter (on the
    root), each rank's send and receive buffer of alltoall, the message of
    sendrecv; each rank's block is ``size / n`` rounded down (at least one
    element; nccl-tests' scatter also rounds it down to 16 bytes, this does
    not).  The measured size is ``max(send, recv) * itemsize``.

    The count column is the larger buffer's elements for the first five
    collectives, and, as nccl-tests' alltoall_perf, gather_perf and
    scatter_perf print it, one block's (``size / n``) for those three.
    """
    count = max(1, size // itemsize)
    per = max(1, count // n)
    if collective in ("allgather", "gather"):
        return per, per * n, per if collective == "gather" else per * n
    if collective in ("reduce_scatter", "scatter"):
        return per * n, per, per if collective == "scatter" else per * n
    if collective == "alltoall":
        return per * n, per * n, per
    return count, count, count


def said(times: dict[str, list[float]], digits: int = 0) -> str:
    """``name t t  name t t``: per name, times in seconds (those of
    ``versus.alternate``, per round) on one line, in us."""
    return "  ".join(
        f"{name} {' '.join(f'{t * 1e6:.{digits}f}' for t in ts)}" for name, ts in times.items()
    )


def under_mpi() -> bool:
    return any(
        k in os.environ for k in ("PMI_RANK", "PMI_SIZE", "OMPI_COMM_WORLD_RANK", "PMIX_RANK")
    )


def loopback_port(mpi: Any) -> int:
    """A free TCP port on 127.0.0.1 that rank 0 of MPI communicator ``mpi`` found,
    the same on every rank (for torch.distributed's rendezvous on one host)."""
    port = 0
    if mpi.Get_rank() == 0:
        with socket.socket() as sk:
            sk.bind(("127.0.0.1", 0))
            port = sk.getsockname()[1]
    return int(mpi.bcast(port, root=0))


def host_meta() -> dict[str, object]:
    """Host name, date and software versions for JSON records."""
    meta: dict[str, object] = {
        "host": socket.gethostname(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "python": platform.python_version(),
        "numpy": np.__version__,
        "nproc": os.cpu_count(),
    }
    try:
        from mpi4py import MPI

        meta["mpi"] = MPI.Get_library_version().splitlines()[0].strip()
        meta["mpi4py"] = __import__("mpi4py").__version__
    except Exception:
        pass
    try:
        import pycoll

        meta["pycoll"] = pycoll.__version__
    except Exception:
        pass
    return meta


def run_or_abort(run: Callable[[Any], list[dict[str, Any]]], args: Any) -> list[dict[str, Any]]:
    """``run(args)`` under mpiexec: an exception on any rank prints its traceback
    and aborts the whole job (``MPI_Abort``), so no rank waits forever for one
    that died."""
    from mpi4py import MPI

    try:
        return run(args)
    except SystemExit:
        raise
    except BaseException:
        traceback.print_exc()
        sys.stderr.flush()
        MPI.COMM_WORLD.Abort(1)
        raise


def exit_status(run: Any, args: Any) -> int:
    """:func:`run_or_abort` of a benchmark whose rows count wrong outputs:
    1 where any row has one, else 0."""
    rows = run_or_abort(run, args)
    return 1 if any(row["wrong"] for row in rows) else 0
