"""Sweep pycoll's collectives over message sizes, nccl-tests style, with baselines.

Run under mpiexec; rank 0 prints::

    mpiexec -n 4 python benchmarks/sweep.py allreduce -b 8 -e 256M -f 4
    mpiexec -n 4 python benchmarks/sweep.py all -b 1M -e 64M -f 4 --algorithm all \\
        --baselines mpi,gloo --json out.json --plot plots/
    mpiexec -n 4 python benchmarks/sweep.py alltoall -b 8 -e 16M -f 8 --baselines mpi,gloo

Flags follow nccl-tests: ``-b`` min bytes, ``-e`` max bytes, ``-f`` factor (or
``-i`` increment), ``-n`` iterations, ``-w`` warm-up iterations, ``-c`` check
(0 off), ``-d`` dtype (or ``all``), ``-o`` op (or ``all``), ``-r`` root;
repetitions are ``--repetitions``.  The collective ``all`` is the first five
(allreduce, allgather, broadcast, reduce_scatter, reduce); alltoall, gather,
scatter and sendrecv run by name.

``size`` and ``count`` are nccl-tests' (its ``*_perf`` print the larger
buffer's bytes, and the elements of the count argument):

==============  ===============================================  ==============
collective      size                                             count
==============  ===============================================  ==============
allreduce       the buffer                                       size elements
broadcast       the buffer                                       size elements
reduce          the buffer                                       size elements
allgather       the output (each rank sends size / n)            size elements
reduce_scatter  the input (each rank receives size / n)          size elements
alltoall        each rank's send and receive buffer              size / n
gather          the root's output (each rank sends size / n)     size / n
scatter         the root's input (each rank receives size / n)   size / n
sendrecv        what each rank sends to rank + 1 and receives    size elements
                from rank - 1
==============  ===============================================  ==============

Timing (OSU style): per system and size, ``-w`` warm-up calls, an MPI barrier,
then ``-n`` timed calls; ``time`` is the per-call mean on the slowest rank (max
over ranks).  For each size every system runs in turn (pycoll's algorithms, then
the baselines) before the next size, so machine noise hits them alike.

Columns: ``size count type redop root``, then ``time algbw busbw #wrong`` for
the out-of-place and for the in-place call side by side, as in nccl-tests
(time in us; algbw = size / time and busbw = algbw * factor in GB/s, with
nccl-tests' factors, ``common.BUSBW_FACTOR``: 2(n-1)/n for allreduce, (n-1)/n
for allgather, reduce_scatter, alltoall, gather and scatter, 1 for broadcast,
reduce and sendrecv); with ``--limits`` a ``frac`` column, busbw as a fraction of
the memory-bandwidth bound of that algorithm (see ``benchmarks/limits.py``); then
per baseline ``<b>(us)``, its time, and ``x<b>`` = baseline time / pycoll time
(above 1: pycoll is faster).

Baselines use the same buffers in the same job: ``mpi`` (mpi4py's
``Allreduce``/``Allgather``/``Bcast``/``Reduce_scatter_block``/``Reduce``,
``Alltoall``/``Gather``/``Scatter``/``Sendrecv`` on the NumPy arrays), ``gloo``
(torch.distributed over tensors that share the arrays' memory; its allreduce
and reduce work in place on the output buffer; ``all_to_all_single``,
``gather``, ``scatter``, and for sendrecv an ``isend`` and an ``irecv`` posted
together by ``batch_isend_irecv``), and ``nccl`` (torch.distributed,
``--device cuda`` only), and ``torch-pycoll`` (the same torch.distributed calls
on a ``"pycoll"`` process group, ``pycoll.torch_backend``: what pycoll's own
call costs a torch user).  alltoall, gather, scatter and sendrecv are checked
against inputs whose every value tells the sender and the place
(``exchanges.py``).  ``avg`` is a sum followed
by a division for the baselines, as pycoll does it.  A baseline that cannot run
(not installed, dtype or op unsupported) is skipped with a one-line reason.

Host buffers are mapped one by one and backed by 2 MiB pages as ``--hugepages``
says (default ``numpy``: from 4 MiB, as NumPy asks for them), so the kind of
page, which changes the cost of a copy between processes by up to 2x at 2 MiB,
does not depend on what the process allocated before (``benchmarks/hostmem.py``);
each JSON record says what the kernel gave (``hugepage_frac``).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import socket
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

import exchanges
import hostmem
from common import (
    BUSBW_FACTOR,
    COLLECTIVES,
    EXCHANGES,
    OPS,
    Skip,
    dtype_names,
    geometry,
    host_meta,
    parse_dtype,
    parse_size,
    run_or_abort,
    size_list,
)

#: Collectives with a root, and with a reduction op (nccl-tests prints root -1
#: and redop none for the others).
ROOTED = ("broadcast", "reduce", "gather", "scatter")
REDUCING = ("allreduce", "reduce_scatter", "reduce")
#: The baselines that run through torch.distributed (see the module docstring).
TORCH_BASELINES = ("gloo", "nccl", "torch-pycoll")


def forms(coll: str, asked: list[bool]) -> list[bool]:
    """The forms (in place or not) of ``coll`` measured: those asked for, where it
    has both; pycoll's broadcast has only the in-place form, reduce_scatter,
    alltoall, gather, scatter and sendrecv only the out-of-place one."""
    if coll == "broadcast":
        return [True]
    if coll in ("reduce_scatter", *EXCHANGES):
        return [False]
    return asked


# --------------------------------------------------------------------------- arguments
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        description="nccl-tests style sweep of pycoll collectives (run under mpiexec)",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument(
        "collective",
        choices=(*COLLECTIVES, *EXCHANGES, "all"),
        help=f"all: the first five ({', '.join(COLLECTIVES)}); {', '.join(EXCHANGES)} run by name",
    )
    ap.add_argument("-b", "--minbytes", default="8", help="min size in bytes (8, 64K, 1M)")
    ap.add_argument("-e", "--maxbytes", default="32M", help="max size in bytes")
    ap.add_argument(
        "-f", "--stepfactor", type=float, default=2.0, help="size multiplication factor"
    )
    ap.add_argument("-i", "--stepbytes", default="0", help="size increment (instead of -f)")
    ap.add_argument("-n", "--iters", type=int, default=20, help="timed iterations")
    ap.add_argument("-w", "--warmup_iters", type=int, default=5, help="warm-up iterations")
    ap.add_argument(
        "-c",
        "--check",
        type=int,
        default=1,
        help="check results: 0 off, else on (nccl-tests' count of checked iterations; "
        "pycoll checks the first call of each system and size)",
    )
    ap.add_argument(
        "-d", "--datatype", default="float32", help="dtype (float, half, int32 ...) or all"
    )
    ap.add_argument("-o", "--op", default="sum", help=f"reduction op: {', '.join(OPS)} or all")
    ap.add_argument(
        "-r", "--root", type=int, default=0, help="root of broadcast, reduce, gather, scatter"
    )
    ap.add_argument(
        "--algorithm",
        default="auto",
        help="auto, ring, tree, a comma list, or all (auto and every registered algorithm)",
    )
    ap.add_argument("--transport", default=None, help="pycoll transports, e.g. shm or tcp,shm")
    ap.add_argument("--chunk-bytes", default=None, help="pycoll chunk_bytes (default: pycoll's)")
    ap.add_argument("--timeout", type=float, default=300.0, help="pycoll timeout in seconds")
    ap.add_argument("--device", choices=("host", "cuda"), default="host")
    ap.add_argument("--baselines", default="", help="comma list of mpi, gloo, nccl, torch-pycoll")
    ap.add_argument(
        "--inplace",
        default="both",
        choices=("both", "0", "1"),
        help="both (out-of-place and in-place side by side, as nccl-tests), 0 or 1 alone",
    )
    ap.add_argument(
        "--hugepages",
        choices=hostmem.POLICIES,
        default="numpy",
        help="host buffers on 2 MiB pages: numpy (from 4 MiB, as NumPy asks), on, off",
    )
    ap.add_argument(
        "--repetitions", "--reps", type=int, default=1, dest="reps", help="repeat each measurement"
    )
    ap.add_argument(
        "--max-time",
        type=float,
        default=0.0,
        help="cap the timed loop near this many seconds per system and size (0: off)",
    )
    ap.add_argument(
        "--min-time",
        type=float,
        default=0.0,
        help="stretch the timed loop to about this many seconds per system and size "
        "when -n calls take less (0: off; --max-time still caps it)",
    )
    ap.add_argument(
        "--settle",
        type=float,
        default=0.25,
        help="after a Gloo turn, the next system warms up at least this many seconds",
    )
    ap.add_argument("--limits", action="store_true", help="measure machine limits; add frac")
    ap.add_argument("--limits-bytes", default="256M", help="array size for --limits")
    ap.add_argument("--json", default=None, help="write one record per measurement here")
    ap.add_argument("--plot", default=None, help="write one PNG per collective into this dir")
    ap.add_argument("--no-progress", action="store_true", help="no progress bar")
    a = ap.parse_args(argv)
    for flag, name in (("-b", "minbytes"), ("-e", "maxbytes"), ("-i", "stepbytes")):
        text = getattr(a, name)
        try:
            value = parse_size(text)
        except (ValueError, ArithmeticError):
            value = -1
        if value < 0:
            ap.error(f"{flag} {text!r} is not a size: bytes, optionally with K, M or G (64K, 1M)")
        setattr(a, name, value)
    if a.iters < 1 or a.warmup_iters < 0 or a.reps < 1:
        ap.error("-n and --repetitions must be >= 1, -w >= 0")
    if a.check < 0:
        ap.error(f"-c {a.check}: 0 (off) or a positive count")
    a.check = int(a.check > 0)
    if a.op.lower() != "all" and a.op.lower() not in OPS:
        ap.error(f"-o {a.op!r}: choose from {', '.join(OPS)} or all")
    a.ops = list(OPS) if a.op.lower() == "all" else [a.op.lower()]
    try:
        a.dtypes = [parse_dtype(d) for d in dtype_names(a.datatype)]
    except ValueError as exc:
        ap.error(f"-d {a.datatype!r}: {exc}")
    a.variants = [False, True] if a.inplace == "both" else [a.inplace == "1"]
    a.baselines = [b.strip().lower() for b in a.baselines.split(",") if b.strip()]
    for b in a.baselines:
        if b not in ("mpi", *TORCH_BASELINES):
            ap.error(f"unknown baseline {b!r}; choose from mpi, {', '.join(TORCH_BASELINES)}")
    return a


# --------------------------------------------------------------------------- data
@dataclass
class Case:
    collective: str
    size: int  # nccl-tests size in bytes
    send_count: int
    recv_count: int
    count: int  # nccl-tests count column (elements of the larger buffer)
    dtype: np.dtype
    dtype_name: str
    op: str
    root: int
    inplace: bool

    @property
    def reducing(self) -> bool:
        return self.collective in ("allreduce", "reduce_scatter", "reduce")


def _pattern(op: str) -> np.ndarray:
    # small integers keep every sum/product exact in every dtype, whatever the order
    if op == "prod":
        return (np.arange(13) % 2 + 1).astype(np.float64)
    if op in ("min", "max"):
        return ((np.arange(13) * 7) % 11).astype(np.float64)
    return (np.arange(13) % 5).astype(np.float64)


def rank_input(rank: int, count: int, case: Case) -> np.ndarray:
    """Rank ``rank``'s deterministic input of ``count`` elements (host array)."""
    pat = np.roll(_pattern(case.op), -3 * rank).astype(case.dtype)
    return np.resize(pat, count)


def _combine(a: np.ndarray, b: np.ndarray, op: str) -> np.ndarray:
    f = {"sum": np.add, "avg": np.add, "prod": np.multiply, "min": np.minimum, "max": np.maximum}
    return f[op](a, b)


def expected(case: Case, rank: int, n: int) -> np.ndarray | None:
    """The NumPy reference of this rank's output (None: this rank has no output)."""
    c = case.collective
    if c in EXCHANGES:
        return exchanges.expected(
            c, rank, n, case.root, case.send_count, case.recv_count, case.dtype
        )
    if c == "broadcast":
        return rank_input(case.root, case.count, case)
    if c == "allgather":
        return np.concatenate([rank_input(p, case.send_count, case) for p in range(n)])
    if c == "reduce" and rank != case.root:
        return None
    acc = rank_input(0, case.send_count, case)
    for p in range(1, n):
        acc = _combine(acc, rank_input(p, case.send_count, case), case.op)
    if case.op == "avg":
        acc = (acc.astype(np.float64) / n).astype(case.dtype)
    if c == "reduce_scatter":
        k = case.recv_count
        return acc[rank * k : (rank + 1) * k]
    return acc


def count_wrong(out: Any, ref: np.ndarray | None, case: Case) -> int:
    if ref is None:
        return 0
    got = out.get() if hasattr(out, "get") else np.asarray(out)
    got = got.reshape(-1)
    if case.op == "avg":  # floating dtypes only; the division may round differently
        tol = {2: 1e-2, 4: 1e-5, 8: 1e-12}[case.dtype.itemsize]
        g, r = got.astype(np.float64), ref.astype(np.float64)
        bad = ~np.isclose(g, r, rtol=tol, atol=tol)
    else:
        bad = got.view(np.uint8).reshape(got.size, -1) != ref.view(np.uint8).reshape(ref.size, -1)
        bad = bad.any(axis=1)
    return int(np.count_nonzero(bad))


# --------------------------------------------------------------------------- buffers
@dataclass
class Buffers:
    send: Any
    recv: Any
    xp: Any  # numpy or cupy

    def poison(self, arr: Any) -> None:
        arr.view(self.xp.uint8).fill(0x5A)

    def load(self, dst: Any, host: np.ndarray) -> None:
        if self.xp is np:
            np.copyto(dst.reshape(-1), host)
        else:
            dst.reshape(-1).set(host)


def input_bytes(case: Case) -> int:
    """Bytes of one rank's input (the size pycoll's ``auto`` decides by; for
    scatter, the block each rank receives)."""
    count = case.count if case.collective == "broadcast" else case.send_count
    if case.collective == "scatter":
        count = case.recv_count
    return count * case.dtype.itemsize


def tuned_calls(comm: Any, coll: str, nbytes: int) -> dict[str, int]:
    """Calls ``auto`` has run of each algorithm for ``coll`` calls of ``nbytes``
    input bytes (its online choice, :mod:`pycoll.tune`); empty where untuned."""
    out: dict[str, int] = {}
    for key, t in comm._policy.tuners.items():
        if t is not None and key[0] == coll and key[1] == nbytes:
            for a, c in zip(t.names, t.calls, strict=True):
                out[a] = out.get(a, 0) + c
    return out


def make_buffers(case: Case, xp: Any, hugepages: str = "numpy", rank: int = 0) -> Buffers:
    """Device buffers from ``xp``; host ones each in its own mapping, backed by
    pages as ``hugepages`` says (see ``benchmarks/hostmem.py``).  A buffer that
    ``rank`` does not hold (gather's output off the root, scatter's input) is
    None."""

    def empty(count: int) -> Any:
        if xp is np:
            return hostmem.empty(count, case.dtype, hugepages)
        return xp.empty(count, case.dtype)

    if case.collective == "broadcast":
        b = empty(case.count)
        return Buffers(b, b, xp)
    has_send, has_recv = exchanges.holds(case.collective, rank, case.root)
    send = empty(case.send_count) if has_send else None
    return Buffers(send, empty(case.recv_count) if has_recv else None, xp)


# --------------------------------------------------------------------------- systems
@dataclass
class Prepared:
    """What a system runs for one case: the call, how to load inputs, where the output is."""

    call: Callable[[], Any]
    load: Callable[[], None]
    output: Callable[[], Any]


@dataclass
class System:
    kind: str  # pycoll, mpi, gloo, nccl
    algorithm: str = ""  # pycoll only
    skipped: dict[str, str] = field(default_factory=dict)

    @property
    def label(self) -> str:
        return f"pycoll:{self.algorithm}" if self.kind == "pycoll" else self.kind


def _default_load(
    case: Case, bufs: Buffers, rank: int, in_recv: bool = False
) -> Callable[[], None]:
    """Inputs into sendbuf (or recvbuf for in-place calls), poison in the output."""

    def load() -> None:
        c = case.collective
        if c in EXCHANGES:
            if bufs.send is not None:
                x = exchanges.rank_data(rank, case.send_count, case.dtype)
                bufs.load(bufs.send, x)
            if bufs.recv is not None:
                bufs.poison(bufs.recv)
            return
        if c == "broadcast":
            if rank == case.root:
                bufs.load(bufs.send, rank_input(rank, case.count, case))
            else:
                bufs.poison(bufs.send)
            return
        if c == "allgather" and in_recv:
            bufs.poison(bufs.recv)
            k = case.send_count
            bufs.load(bufs.recv[rank * k : (rank + 1) * k], rank_input(rank, k, case))
            return
        x = rank_input(rank, case.send_count, case)
        if in_recv:
            bufs.load(bufs.recv, x)
        else:
            bufs.load(bufs.send, x)
            bufs.poison(bufs.recv)

    return load


class Runner:
    """Builds the call of every system for every case."""

    def __init__(self, args: argparse.Namespace, mpi_comm: Any, comm: Any, xp: Any) -> None:
        self.a = args
        self.mpi = mpi_comm
        self.comm = comm
        self.xp = xp
        self.rank = mpi_comm.Get_rank()
        self.n = mpi_comm.Get_size()
        self.torch: Any = None
        self.dist: Any = None
        self.nccl_group: Any = None
        self.pycoll_group: Any = None  # torch.distributed over pycoll (torch-pycoll)
        self._persistent: list[Any] = []  # MPI persistent requests, freed by free_persistent

    def free_persistent(self) -> None:
        for req in self._persistent:
            req.Free()
        self._persistent.clear()

    # ------------------------------------------------------------ pycoll
    def pycoll(self, algo: str, case: Case, bufs: Buffers) -> Prepared:
        c, comm, op, root = case.collective, self.comm, case.op, case.root
        s, r = bufs.send, bufs.recv
        if c in EXCHANGES:
            call = exchanges.pycoll_call(comm, c, s, r, algo, root)
            return Prepared(call, _default_load(case, bufs, self.rank), lambda: r)
        inplace = case.inplace and c in ("allreduce", "allgather", "reduce")
        if c == "allreduce":
            call = (
                (lambda: comm.allreduce(r, op=op, algorithm=algo))
                if inplace
                else (lambda: comm.allreduce(s, r, op=op, algorithm=algo))
            )
        elif c == "allgather":
            k = case.send_count
            mine = r[self.rank * k : (self.rank + 1) * k]
            call = (
                (lambda: comm.allgather(mine, r, algorithm=algo))
                if inplace
                else (lambda: comm.allgather(s, r, algorithm=algo))
            )
        elif c == "broadcast":
            call = lambda: comm.broadcast(s, root=root, algorithm=algo)
        elif c == "reduce_scatter":
            call = lambda: comm.reduce_scatter(s, r, op=op, algorithm=algo)
        else:
            if inplace:
                call = (
                    (lambda: comm.reduce(r, None, root=root, op=op, algorithm=algo))
                    if self.rank == root
                    else (lambda: comm.reduce(s, None, root=root, op=op, algorithm=algo))
                )
            else:
                call = lambda: comm.reduce(s, r, root=root, op=op, algorithm=algo)
        in_recv = inplace and (c != "reduce" or self.rank == root)
        load = _default_load(case, bufs, self.rank, in_recv)
        if inplace and c == "reduce" and self.rank != root:
            load = _default_load(case, bufs, self.rank, False)
        return Prepared(call, load, lambda: s if c == "broadcast" else r)

    # ------------------------------------------------------------ mpi
    def mpi_baseline(self, case: Case, bufs: Buffers) -> Prepared:
        from mpi4py import MPI

        if self.xp is not np:
            raise Skip("host buffers only (use a CUDA-aware MPI and extend this runner)")
        if case.dtype_name == "bfloat16":
            raise Skip("MPI has no bfloat16 datatype")
        c, w, root = case.collective, self.mpi, case.root
        s, r = bufs.send, bufs.recv
        if c in EXCHANGES:
            call = exchanges.mpi_call(w, c, s, r, root)
            return Prepared(call, _default_load(case, bufs, self.rank), lambda: r)
        mop = {"sum": MPI.SUM, "avg": MPI.SUM, "prod": MPI.PROD, "min": MPI.MIN, "max": MPI.MAX}[
            case.op
        ]
        inplace = case.inplace
        n = self.n
        avg = case.op == "avg"
        if c == "allreduce":
            src = MPI.IN_PLACE if inplace else s
            base = lambda: w.Allreduce(src, r, op=mop)
        elif c == "allgather":
            src = MPI.IN_PLACE if inplace else s
            base = lambda: w.Allgather(src, r)
        elif c == "broadcast":
            base = lambda: w.Bcast(s, root=root)
        elif c == "reduce_scatter":
            base = lambda: w.Reduce_scatter_block(s, r, op=mop)
        else:
            src = MPI.IN_PLACE if inplace and self.rank == root else s
            base = lambda: w.Reduce(src, r, op=mop, root=root)
        has_out = c != "reduce" or self.rank == root
        if avg and has_out:

            def call() -> None:
                base()
                np.divide(r, r.dtype.type(n), out=r)

        else:
            call = base
        in_recv = (inplace and c in ("allreduce", "allgather")) or (
            inplace and c == "reduce" and self.rank == root
        )
        return Prepared(
            call,
            _default_load(case, bufs, self.rank, in_recv),
            lambda: s if c == "broadcast" else r,
        )

    # ------------------------------------------------------------ torch.distributed
    def init_torch(self, want_nccl: bool, want_pycoll: bool = False) -> str | None:
        """Start torch.distributed (gloo as the default group, and a ``"pycoll"``
        group with ``want_pycoll``); None or a reason."""
        try:
            warnings.filterwarnings("ignore", module="torch")
            import torch
            import torch.distributed as dist
        except Exception as exc:
            return f"torch not importable: {type(exc).__name__}: {exc}"
        if not dist.is_available() or not dist.is_gloo_available():
            return "torch.distributed with gloo is not available in this torch build"
        hosts = self.mpi.allgather(socket.gethostname())
        addr = os.environ.get("MASTER_ADDR")
        if addr is None:
            if len(set(hosts)) == 1:
                addr = "127.0.0.1"
                os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
            else:
                addr = socket.gethostbyname(socket.gethostname()) if self.rank == 0 else None
                addr = self.mpi.bcast(addr, root=0)
        port = None
        if self.rank == 0:
            with socket.socket() as sk:
                sk.bind((addr if addr != "127.0.0.1" else "127.0.0.1", 0))
                port = sk.getsockname()[1]
        port = self.mpi.bcast(port, root=0)
        dist.init_process_group(
            "gloo", init_method=f"tcp://{addr}:{port}", rank=self.rank, world_size=self.n
        )
        self.torch, self.dist = torch, dist
        if want_nccl:
            self.nccl_group = dist.new_group(backend="nccl")
        if want_pycoll:
            import pycoll.torch_backend

            pycoll.torch_backend.register()
            self.pycoll_group = dist.new_group(backend="pycoll")
        return None

    def _tensor(self, arr: Any, case: Case) -> Any:
        torch = self.torch
        if arr is None:  # a buffer this rank does not hold
            return None
        if self.xp is not np:
            return torch.as_tensor(arr, device="cuda")
        if case.dtype_name == "bfloat16":
            return torch.from_numpy(arr.view(np.int16)).view(torch.bfloat16)
        return torch.from_numpy(arr)

    def torch_baseline(self, kind: str, case: Case, bufs: Buffers) -> Prepared:
        if self.dist is None:
            raise Skip("torch.distributed not initialised")
        if kind == "gloo" and self.xp is not np:
            raise Skip("gloo baseline runs on host buffers only")
        if kind == "nccl" and self.nccl_group is None:
            raise Skip("no NCCL group")
        if kind == "torch-pycoll" and self.pycoll_group is None:
            raise Skip("no pycoll process group")
        group = {"nccl": self.nccl_group, "torch-pycoll": self.pycoll_group}.get(kind)
        dist = self.dist
        R = dist.ReduceOp
        top = {"sum": R.SUM, "avg": R.SUM, "prod": R.PRODUCT, "min": R.MIN, "max": R.MAX}[case.op]
        c, root, n = case.collective, case.root, self.n
        ts, tr = self._tensor(bufs.send, case), self._tensor(bufs.recv, case)
        if c in EXCHANGES:
            call = exchanges.torch_call(dist, group, c, ts, tr, root, self.rank, n)
            return Prepared(call, _default_load(case, bufs, self.rank), lambda: tr)
        in_recv = c in ("allreduce", "reduce")
        if c == "allreduce":
            base = lambda: dist.all_reduce(tr, op=top, group=group)
        elif c == "allgather":
            k = case.send_count
            tsrc = tr[self.rank * k : (self.rank + 1) * k] if case.inplace else ts
            in_recv = case.inplace
            base = lambda: dist.all_gather_into_tensor(tr, tsrc, group=group)
        elif c == "broadcast":
            base = lambda: dist.broadcast(ts, src=root, group=group)
        elif c == "reduce_scatter":
            base = lambda: dist.reduce_scatter_tensor(tr, ts, op=top, group=group)
        else:
            base = lambda: dist.reduce(tr, dst=root, op=top, group=group)
        has_out = c != "reduce" or self.rank == root
        if case.op == "avg" and has_out:

            def call() -> None:
                base()
                tr.div_(n)

        else:
            call = base
        return Prepared(
            call,
            _default_load(case, bufs, self.rank, in_recv),
            lambda: ts if c == "broadcast" else tr,
        )

    def prepare(self, system: System, case: Case, bufs: Buffers) -> Prepared:
        if system.kind == "pycoll":
            return self.pycoll(system.algorithm, case, bufs)
        if system.kind == "mpi":
            return self.mpi_baseline(case, bufs)
        if system.kind in ("pycoll-prepared", "mpi-persistent"):
            return self.persistent(system.kind, case, bufs)
        return self.torch_baseline(system.kind, case, bufs)

    # ------------------------------------------------------------ persistent calls
    def persistent(self, kind: str, case: Case, bufs: Buffers) -> Prepared:
        """Out-of-place calls made once and run again: pycoll's ``comm.prepare``
        (``pycoll-prepared``) or MPI 4's persistent collectives
        (``mpi-persistent``: ``Allreduce_init`` and the others, Start and Wait)."""
        c, root, s, r = case.collective, case.root, bufs.send, bufs.recv
        if case.inplace or c in EXCHANGES or self.xp is not np:
            raise Skip("persistent calls: out of place, on host arrays, the five collectives")
        load = _default_load(case, bufs, self.rank)
        output = lambda: s if c == "broadcast" else r
        if kind == "pycoll-prepared":
            if c == "broadcast":
                h = self.comm.prepare(c, s, root=root)
            elif c == "allgather":
                h = self.comm.prepare(c, s, r)
            else:
                h = self.comm.prepare(c, s, r, op=case.op, root=root)
            return Prepared(h, load, output)
        from mpi4py import MPI

        if case.op != "sum":
            raise Skip("mpi-persistent: op sum only")
        w = self.mpi
        try:
            if c == "allreduce":
                req = w.Allreduce_init(s, r, op=MPI.SUM)
            elif c == "allgather":
                req = w.Allgather_init(s, r)
            elif c == "broadcast":
                req = w.Bcast_init(s, root=root)
            elif c == "reduce_scatter":
                req = w.Reduce_scatter_block_init(s, r, op=MPI.SUM)
            else:
                req = w.Reduce_init(s, r, op=MPI.SUM, root=root)
        except (AttributeError, NotImplementedError) as exc:
            raise Skip(f"this MPI has no persistent collectives ({exc})") from exc
        self._persistent.append(req)

        def call() -> None:
            req.Start()
            req.Wait()

        return Prepared(call, load, output)


# --------------------------------------------------------------------------- timing
def sync_fn(xp: Any, runner: Runner) -> Callable[[], None]:
    if xp is np:
        return lambda: None

    def sync() -> None:
        xp.cuda.get_current_stream().synchronize()
        xp.cuda.Device().synchronize()
        if runner.torch is not None and runner.torch.cuda.is_available():
            runner.torch.cuda.synchronize()

    return sync


def timed(
    call: Callable[[], Any],
    args: argparse.Namespace,
    mpi_comm: Any,
    sync: Callable[[], None],
    settle: float = 0.0,
) -> tuple[float, int, float, float]:
    """(seconds per call on the slowest rank, iterations timed, median, min).

    The first figure is the mean over the timed loop (OSU's); the per-call
    median and minimum (each the max over ranks) go to the JSON for noisy
    machines.  On a device the per-call figures include no synchronisation and
    only the mean is meaningful.  The warm-up runs ``-w`` calls, and more in
    batches as long as that took less than ``settle`` seconds on the slowest rank.
    The warm-up's time per call sets how many calls ``--min-time`` and
    ``--max-time`` ask for.
    """
    from mpi4py import MPI

    iters = args.iters
    t0 = time.perf_counter()
    for _ in range(args.warmup_iters):
        call()
    sync()
    warm = args.warmup_iters
    if settle > 0:  # every rank makes the same calls: the batches end by agreement
        batch = max(1, args.warmup_iters)
        while mpi_comm.allreduce(time.perf_counter() - t0, op=MPI.MAX) < settle:
            for _ in range(batch):
                call()
            sync()
            warm += batch
    if (args.max_time > 0 or args.min_time > 0) and warm:
        per = max(mpi_comm.allreduce((time.perf_counter() - t0) / warm, op=MPI.MAX), 1e-9)
        if args.min_time > 0:
            iters = max(iters, int(args.min_time / per))
        if args.max_time > 0:
            iters = max(1, min(iters, int(args.max_time / per)))
    ts = np.empty(iters)
    clock = time.perf_counter
    mpi_comm.Barrier()
    t0 = clock()
    for i in range(iters):
        t = clock()
        call()
        ts[i] = clock() - t
    sync()
    dt = (clock() - t0) / iters
    stats = np.empty(3)
    mpi_comm.Allreduce(np.array([dt, np.median(ts), ts.min()]), stats, op=MPI.MAX)
    return float(stats[0]), iters, float(stats[1]), float(stats[2])


# --------------------------------------------------------------------------- output
def _fmt_time(us: float) -> str:
    return f"{us:9.2f}" if us < 1e5 else f"{us:9.0f}"


class Table:
    """nccl-tests' columns, out-of-place and in-place side by side: ``size count type
    redop root``, then for each ``time algbw busbw #wrong`` (with --limits ``frac``,
    then per baseline its time and ratio); a form not measured shows ``-``."""

    def __init__(self, baselines: list[str], limits: bool, show_algo: bool) -> None:
        self.baselines = baselines
        self.limits = limits
        self.show_algo = show_algo

    def _half_header(self) -> tuple[str, str]:
        h1 = f" {'time':>9s} {'algbw':>7s} {'busbw':>7s} {'#wrong':>6s}"
        h2 = f" {'(us)':>9s} {'(GB/s)':>7s} {'(GB/s)':>7s} {'':>6s}"
        if self.limits:
            h1 += f" {'frac':>5s}"
            h2 += f" {'':>5s}"
        for b in self.baselines:
            h1 += f" {b + '(us)':>10s} {'x' + b:>6s}"
            h2 += f" {'':>10s} {'':>6s}"
        return h1, h2

    def header(self) -> str:
        h1, h2 = self._half_header()
        lead = f"#{'':>11s} {'':>12s} {'':>8s} {'':>6s} {'':>5s}"
        groups = lead + f" {'out-of-place':^{len(h1) - 1}s} {'in-place':^{len(h1) - 1}s}"
        h1 = f"#{'size':>11s} {'count':>12s} {'type':>8s} {'redop':>6s} {'root':>5s}" + h1 + h1
        h2 = f"#{'(B)':>11s} {'(elements)':>12s} {'':>8s} {'':>6s} {'':>5s}" + h2 + h2
        if self.show_algo:
            h1 += "  algo"
        return groups + "\n" + h1 + "\n" + h2

    def _half(self, rec: dict[str, Any] | None, base: dict[str, float | str]) -> str:
        if rec is None:  # a form this collective does not have, or not asked for
            widths = [9, 7, 7, 6] + [5] * self.limits + [10, 6] * len(self.baselines)
            return "".join(f" {'-':>{w}s}" for w in widths)
        line = (
            f" {_fmt_time(rec['time_us'])} {rec['algbw']:7.2f} {rec['busbw']:7.2f} "
            f"{rec['wrong'] if rec['wrong'] is not None else 'N/A':>6}"
        )
        if self.limits:
            fr = rec.get("frac_of_bound")
            line += f" {fr:5.2f}" if fr is not None else f" {'-':>5s}"
        for b in self.baselines:
            t = base.get(b)
            if isinstance(t, float):
                line += f" {_fmt_time(t):>10s} {t / rec['time_us']:6.2f}"
            else:
                line += f" {'skip':>10s} {'-':>6s}"
        return line

    def row(self, halves: dict[bool, tuple[dict[str, Any], dict[str, float | str]]]) -> str:
        """One size: ``halves[inplace] = (record, baseline times)``."""
        rec = halves.get(False, halves.get(True))
        assert rec is not None
        r0 = rec[0]
        root = r0["root"] if r0["collective"] in ROOTED else -1
        redop = r0["op"] if r0["collective"] in REDUCING else "none"
        line = f" {r0['size']:>11d} {r0['count']:>12d} {r0['type']:>8s} {redop:>6s} {root:>5d}"
        for inplace in (False, True):
            h = halves.get(inplace)
            line += self._half(None, {}) if h is None else self._half(*h)
        if self.show_algo:
            line += f"  {r0['resolved_algorithm']}"
            ran = r0.get("auto_ran")
            if ran and len(ran) > 1:
                line += " (tuned: " + ", ".join(f"{a} {c}" for a, c in ran.items()) + ")"
        return line


def plot(records: list[dict[str, Any]], outdir: str) -> list[Path]:
    """One PNG per collective: busbw and latency vs size, a line per system/algorithm."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = []
    Path(outdir).mkdir(parents=True, exist_ok=True)
    for coll in sorted({r["collective"] for r in records}):
        rs = [r for r in records if r["collective"] == coll]
        fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
        groups: dict[str, dict[int, list[dict[str, Any]]]] = {}
        for r in rs:
            key = r["system"] if r["system"] != "pycoll" else f"pycoll {r['algorithm']}"
            key += f" n={r['nranks']}"
            groups.setdefault(key, {}).setdefault(r["size"], []).append(r)
        for key, by in sorted(groups.items()):
            sizes = sorted(by)
            bw = [statistics.median(x["busbw"] for x in by[s]) for s in sizes]
            lat = [statistics.median(x["time_us"] for x in by[s]) for s in sizes]
            style = "-o" if key.startswith("pycoll") else "--s"
            ax1.plot(sizes, bw, style, label=key, markersize=3)
            ax2.plot(sizes, lat, style, label=key, markersize=3)
        for ax, yl in ((ax1, "busbw (GB/s)"), (ax2, "time (us)")):
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xlabel("size (bytes)")
            ax.set_ylabel(yl)
            ax.grid(True, which="both", alpha=0.3)
        ax1.legend(fontsize=7)
        r0 = rs[0]
        fig.suptitle(
            f"{coll}: {r0['dtype']} {r0['op'] if coll != 'allgather' and coll != 'broadcast' else ''} "
            f"transport={r0['transport']} host={r0['host']}"
        )
        fig.tight_layout()
        p = Path(outdir) / f"{coll}.png"
        fig.savefig(p, dpi=100)
        plt.close(fig)
        out.append(p)
    return out


# --------------------------------------------------------------------------- main
def _xp(device: str, mpi_comm: Any) -> tuple[Any, str | None]:
    if device == "host":
        return np, None
    try:
        import cupy
    except Exception as exc:
        return None, f"CuPy is not importable ({type(exc).__name__}: {exc})"
    try:
        ndev = cupy.cuda.runtime.getDeviceCount()
    except Exception as exc:
        return None, f"no CUDA device ({type(exc).__name__}: {exc})"
    if ndev == 0:
        return None, "no CUDA device"
    from mpi4py import MPI

    local = mpi_comm.Split_type(MPI.COMM_TYPE_SHARED).Get_rank()
    cupy.cuda.Device(local % ndev).use()
    return cupy, None


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    from mpi4py import MPI

    import pycoll
    from pycoll import algorithms

    w = MPI.COMM_WORLD
    rank, n = w.Get_rank(), w.Get_size()
    out = sys.stdout if rank == 0 else None

    def say(msg: str) -> None:
        if out is not None:
            print(msg, file=out, flush=True)

    from pycoll.reduce import ReduceOp, supports

    xp, why = _xp(args.device, w)
    if xp is None:
        say(f"# --device cuda: skipped: {why}")
        return []
    if not 0 <= args.root < n:
        raise SystemExit(f"--root {args.root} is not in [0, {n})")

    cfg: dict[str, Any] = {"timeout": args.timeout}
    if args.transport:
        cfg["transports"] = tuple(t.strip() for t in args.transport.split(",") if t.strip())
    if args.chunk_bytes:
        cfg["chunk_bytes"] = parse_size(args.chunk_bytes)
    comm = pycoll.init(w, **cfg)
    kinds = sorted({comm.transport_of(p) for p in range(n) if p != rank} or {"self"})
    transport = "+".join(sorted({k for ks in w.allgather(kinds) for k in ks}))
    chunk = comm.config.chunk_bytes

    collectives = list(COLLECTIVES) if args.collective == "all" else [args.collective]
    # every (collective, dtype, op) of -d and -o (all: each); an op a dtype does not
    # take is skipped with a line
    combos = []
    refused = []
    for coll in collectives:
        for dt in args.dtypes:
            for op in args.ops if coll in REDUCING else args.ops[:1]:
                if coll in REDUCING and not supports(ReduceOp(op), dt[0]):
                    refused.append(
                        f"# {coll} {dt[1]} {op}: skipped: {op} does not apply to {dt[1]}"
                    )
                else:
                    combos.append((coll, dt, op))
    if not combos:
        raise SystemExit("; ".join(r.removeprefix("# ") for r in refused))
    meta = host_meta()
    meta["hosts"] = sorted(set(w.allgather(socket.gethostname())))

    runner = Runner(args, w, comm, xp)
    baselines: list[str] = []
    torch_reason: str | None = None
    if any(b in TORCH_BASELINES for b in args.baselines):
        want_nccl = "nccl" in args.baselines and args.device == "cuda"
        if want_nccl:
            try:
                import torch

                if torch.cuda.is_available():
                    torch.cuda.set_device(xp.cuda.Device().id)
                else:
                    want_nccl = False
            except Exception:
                want_nccl = False
        torch_reason = runner.init_torch(want_nccl, "torch-pycoll" in args.baselines)
    for b in args.baselines:
        reason = None
        if b == "nccl" and args.device != "cuda":
            reason = "needs --device cuda (and torch with CUDA)"
        elif b in TORCH_BASELINES and torch_reason:
            reason = torch_reason
        elif b == "nccl" and runner.nccl_group is None:
            reason = "torch has no CUDA/NCCL here"
        if reason:
            say(f"# baseline {b}: skipped: {reason}")
        else:
            baselines.append(b)

    lim = None
    if args.limits:
        import limits as limits_mod

        if xp is not np:
            say("# --limits: host memory only; skipped for --device cuda")
        else:
            lim = limits_mod.measure(w, parse_size(args.limits_bytes), 3)
            say(
                f"# limits: copy {lim.copy / 1e9:.2f} GB/s (1 proc), {lim.copy_conc / 1e9:.2f} "
                f"GB/s ({n} at once); np.add {lim.add / 1e9:.2f} GB/s (1 proc), "
                f"{lim.add_conc / 1e9:.2f} GB/s ({n} at once)"
            )

    say(
        f"# pycoll sweep: nranks {n}  transport {transport}  chunk_bytes {chunk}  device {args.device}"
    )
    say(
        f"# minBytes {args.minbytes} maxBytes {args.maxbytes} "
        + (
            f"step: {args.stepbytes}(bytes)"
            if args.stepbytes
            else f"step: {args.stepfactor:g}(factor)"
        )
        + f"  warmup iters: {args.warmup_iters}  iters: {args.iters}  reps: {args.reps}"
        f"  validation: {args.check}  inplace: {args.inplace}"
    )
    say(f"# host(s): {', '.join(meta['hosts'])}  {meta.get('mpi', '')}")
    say("# time: per-call mean on the slowest rank; x<baseline> = baseline time / pycoll time")
    for line in refused:
        say(line)
    if xp is np:
        say(
            f"# host buffers: one mapping each, hugepages {args.hugepages} "
            "(2 MiB pages: numpy = from 4 MiB, as NumPy asks; JSON hugepage_frac)"
        )

    sync = sync_fn(xp, runner)
    # A dry run of the timing loop: the first timed loop of a process came out
    # slow whatever was timed, and the first system timed would pay for it.
    timed(lambda: None, args, w, sync)
    sizes = size_list(args.minbytes, args.maxbytes, args.stepfactor, args.stepbytes)
    records: list[dict[str, Any]] = []
    total_wrong = 0

    bar = None
    if rank == 0 and not args.no_progress and sys.stderr.isatty():
        try:
            from tqdm import tqdm

            bar = tqdm(total=0, file=sys.stderr, unit="meas", leave=False)
        except ImportError:
            bar = None

    after_gloo = False  # the last system timed (or tried) was Gloo
    for coll, (dtype, dname, nccl_name), op in combos:
        reg = algorithms.names(coll)
        # "all": auto (which may run several, see pycoll.tune) and each algorithm
        algos = [x.strip().lower() for x in args.algorithm.split(",") if x.strip()]
        if "all" in algos:
            algos = [a for a in algos if a != "all"]
            algos += [a for a in ("auto", *reg) if a not in algos]
        for a_ in algos:
            if a_ != "auto" and a_ not in reg:
                raise SystemExit(f"{coll}: algorithm {a_!r} is not one of auto, {', '.join(reg)}")
        systems = [System("pycoll", a_) for a_ in algos] + [System(b) for b in baselines]
        groups = []  # per size, a case per form (out of place, in place)
        seen = set()
        for s in sizes:
            sc, rc, tc = geometry(coll, s, dtype.itemsize, n)
            nbytes = max(sc, rc) * dtype.itemsize  # nccl-tests' size: the larger buffer
            if nbytes in seen:
                continue
            seen.add(nbytes)
            groups.append(
                [
                    Case(coll, nbytes, sc, rc, tc, dtype, dname, op, args.root, ip)
                    for ip in forms(coll, args.variants)
                ]
            )
        if bar is not None:
            bar.total += sum(map(len, groups)) * len(systems) * args.reps
            bar.refresh()
        table = Table(baselines, lim is not None, show_algo=False)
        live = len(algos) == 1
        say(
            f"#\n# {coll}  dtype {dname}  op {op if coll in REDUCING else 'none'}  "
            f"root {args.root if coll in ROOTED else -1}  algorithm(s) {', '.join(algos)}"
        )
        if live:
            say(f"# pycoll algorithm: {algos[0]}")
            table.show_algo = algos[0] == "auto" and bool(reg)
            say(table.header())
        rows: dict[str, list[str]] = {a_: [] for a_ in algos}
        busbws: dict[str, list[float]] = {a_: [] for a_ in algos}
        skip_said: set[tuple[str, str]] = set()
        for group in groups:
            halves: dict[str, dict[bool, Any]] = {a_: {} for a_ in algos}
            for case in group:
                bufs = make_buffers(case, xp, args.hugepages, rank)
                ref = expected(case, rank, n) if args.check else None
                # the model's pick, by the bytes each rank passes in (an allgather's
                # block, not nccl-tests' size, which is the whole output): auto's
                # first; where the model sees close contenders auto times them as it
                # runs (pycoll.tune), and the records say what it ran ("auto_ran")
                nbytes = input_bytes(case)  # (sendrecv has no algorithms to choose)
                auto_choice = comm._policy.algorithm(coll, "auto", nbytes) if reg else None
                per_sys: dict[str, list[dict[str, Any]]] = {}
                prepared: dict[str, Prepared | None] = {}
                for sysm in systems:
                    try:
                        p: Prepared | None = runner.prepare(sysm, case, bufs)
                        err = ""
                    except Skip as exc:
                        p, err = None, str(exc)
                    # a baseline may refuse a dtype/op only when called: try once, agree
                    wrong = None
                    if p is not None:
                        try:
                            p.load()
                            p.call()
                            sync()
                            after_gloo = sysm.kind == "gloo"
                            if args.check:
                                wrong = count_wrong(p.output(), ref, case)
                        except Exception as exc:
                            if sysm.kind == "pycoll":
                                raise
                            err = f"{type(exc).__name__}: {str(exc).splitlines()[0][:120]}"
                    errs = w.allgather(err)
                    err = next((e for e in errs if e), "")
                    if err:
                        prepared[sysm.label] = None
                        if (sysm.label, err) not in skip_said:
                            skip_said.add((sysm.label, err))
                            say(f"# {sysm.label}: skipped for {coll} {dname} {op}: {err}")
                        continue
                    assert p is not None
                    prepared[sysm.label] = p
                    wsum = w.allreduce(wrong, op=MPI.SUM) if args.check else None
                    per_sys[sysm.label] = [{"wrong": wsum}]
                # what the kernel gave the (now touched) buffers, mean over ranks
                huge = None
                if xp is np:
                    own = (bufs.send,) if bufs.send is bufs.recv else (bufs.send, bufs.recv)
                    own = tuple(b for b in own if b is not None)
                    fr = [f for f in w.allgather(hostmem.hugepage_fraction(*own)) if f is not None]
                    huge = round(statistics.mean(fr), 3) if fr else None
                for rep in range(args.reps):
                    # a new order each repetition, the same on every rank: whatever one
                    # system leaves behind (a cold cache, a scheduler's placement) falls
                    # on a different one each time, not always on the next
                    order = list(systems)
                    random.Random(f"{coll} {case.size} {rep}").shuffle(order)
                    for slot, sysm in enumerate(order):
                        p = prepared.get(sysm.label)
                        if p is None:
                            if bar is not None:
                                bar.update(1)
                            continue
                        tuned = sysm.kind == "pycoll" and sysm.algorithm == "auto"
                        before = tuned_calls(comm, coll, nbytes) if tuned else {}
                        # Gloo's ranks wait for milliseconds a call, asleep; the calls
                        # after it ran up to 2x slower (n = 4: 30-35 against 16-18 us at
                        # 32 B) for 100-250 ms on the 2-core VM, so the next system
                        # warms up for --settle seconds
                        settle = args.settle if after_gloo and sysm.kind != "gloo" else 0.0
                        after_gloo = sysm.kind == "gloo"
                        sec, iters, med_s, min_s = timed(p.call, args, w, sync, settle)
                        algbw = case.size / sec / 1e9
                        resolved = auto_choice if sysm.algorithm == "auto" else sysm.algorithm
                        ran = None
                        if tuned:  # what auto ran in this measurement; the most-run is "resolved"
                            after = tuned_calls(comm, coll, nbytes)
                            ran = {a: c - before.get(a, 0) for a, c in after.items()}
                            ran = {a: c for a, c in ran.items() if c} or None
                            if ran:
                                resolved = max(ran, key=ran.__getitem__)
                        rec = {
                            "system": sysm.kind,
                            "collective": coll,
                            "size": case.size,
                            "count": case.count,
                            "nranks": n,
                            "rep": rep,
                            "slot": slot,
                            "settled": settle > 0,
                            "time_us": sec * 1e6,
                            "time_us_median": med_s * 1e6,
                            "time_us_min": min_s * 1e6,
                            "algbw": algbw,
                            "busbw": algbw * BUSBW_FACTOR[coll](n),
                            "wrong": per_sys[sysm.label][0]["wrong"],
                            "algorithm": sysm.algorithm if sysm.kind == "pycoll" else None,
                            "resolved_algorithm": resolved if sysm.kind == "pycoll" else None,
                            "auto_choice": auto_choice,
                            "auto_ran": ran,
                            "transport": transport if sysm.kind == "pycoll" else sysm.kind,
                            "dtype": dname,
                            "type": nccl_name,
                            "op": op,
                            "root": case.root,
                            "inplace": case.inplace,
                            "device": args.device,
                            "hugepages": args.hugepages if xp is np else None,
                            "hugepage_frac": huge,
                            "iters": iters,
                            "warmup": args.warmup_iters,
                            "chunk_bytes": chunk,
                            "host": meta["host"],
                            "hosts": meta["hosts"],
                            "date": meta["date"],
                        }
                        if lim is not None and sysm.kind == "pycoll":
                            import limits as limits_mod

                            tb = limits_mod.bound_time(coll, resolved, n, case.size, lim, case.root)
                            if tb is not None:
                                rec["bound_time_us"] = tb * 1e6
                                rec["frac_of_bound"] = tb / sec
                        records.append(rec)
                        per_sys[sysm.label].append(rec)
                        if bar is not None:
                            bar.update(1)
                # one row per pycoll algorithm: medians over reps
                base_t: dict[str, float | str] = {}
                for b in baselines:
                    rs = per_sys.get(b, [None])[1:]
                    base_t[b] = statistics.median(r["time_us"] for r in rs) if rs else "skip"
                    bw = per_sys.get(b, [{}])[0].get("wrong")
                    if bw:
                        say(f"# WARNING: baseline {b} got {bw} wrong elements at size {case.size}")
                for a_ in algos:
                    rs = per_sys.get(f"pycoll:{a_}", [None])[1:]
                    if not rs:
                        continue
                    med = dict(rs[0])
                    med["time_us"] = statistics.median(r["time_us"] for r in rs)
                    med["algbw"] = case.size / med["time_us"] / 1e3
                    med["busbw"] = med["algbw"] * BUSBW_FACTOR[coll](n)
                    if "bound_time_us" in med:
                        med["frac_of_bound"] = med["bound_time_us"] / med["time_us"]
                    total_wrong += med["wrong"] or 0
                    busbws[a_].append(med["busbw"])
                    halves[a_][case.inplace] = (med, base_t)
                del bufs
            for a_ in algos:
                if halves[a_]:
                    line = table.row(halves[a_])
                    if live:
                        say(line)
                    else:
                        rows[a_].append(line)
        if not live:
            for a_ in algos:
                say(f"#\n# pycoll algorithm: {a_}")
                table.show_algo = a_ == "auto" and bool(reg)
                say(table.header())
                for line in rows[a_]:
                    say(line)
        for a_ in algos:
            if busbws[a_]:
                say(f"# {coll} {a_}: Avg bus bandwidth    : {statistics.mean(busbws[a_]):.4g}")
    if bar is not None:
        bar.close()
    if args.check:
        say(f"# Out of bounds values : {total_wrong} {'OK' if total_wrong == 0 else 'FAILED'}")
    say("#")
    if runner.dist is not None:
        runner.dist.destroy_process_group()
    comm.close()
    if rank == 0:
        if args.json:
            Path(args.json).parent.mkdir(parents=True, exist_ok=True)
            doc = {"meta": {**meta, "argv": sys.argv, "nranks": n, "transport": transport}}
            if lim is not None:
                from dataclasses import asdict

                doc["meta"]["limits"] = asdict(lim)
            doc["records"] = records
            Path(args.json).write_text(json.dumps(doc, indent=1))
            say(f"# wrote {len(records)} records to {args.json}")
        if args.plot and records:
            for p in plot(records, args.plot):
                say(f"# wrote {p}")
    return records


def main(argv: list[str] | None = None) -> int:
    records = run_or_abort(run, parse_args(argv))
    wrong = sum(r["wrong"] or 0 for r in records if r["system"] == "pycoll")
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
