"""Local reductions on device (CuPy), the GPU side of :mod:`pycoll.reduce`.

``reducer(op, dtype)`` gives ``f(a, b, out=c)`` (or ``f(a, b, c)``) computing ``c = a OP b``
elementwise on CuPy arrays, enqueued on the current CuPy stream.  Standard
dtypes use CuPy's ufuncs.  bfloat16 travels as ``uint16`` (CuPy has no bfloat16
type): an ElementwiseKernel widens both operands to float32 (exact), applies
the op in float32 and narrows with round-to-nearest-even, which is what
ml_dtypes does on the host, so device and host results agree bit for bit.
min and max return one operand's bits (NaNs propagate), as ml_dtypes does.
The bitwise ops (integers and bools) are CuPy's bitwise ufuncs; bools, complex
numbers and the 16-bit integers need nothing of their own.

Every reduction is a pure elementwise function of its two operands, so the
result depends only on the order the algorithms combine contributions in,
which is fixed: all ranks get the same bits, run after run.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import numpy as np

from pycoll.reduce import DTYPES, ReduceOp

BF16 = DTYPES["bfloat16"]

_PREAMBLE = r"""
__device__ __forceinline__ float pc_bf2f(unsigned short h) {
    return __uint_as_float(((unsigned int)h) << 16);
}
__device__ __forceinline__ unsigned short pc_f2bf(float f) {
    unsigned int u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) {
        return (unsigned short)((u >> 16) | 0x40u);  /* NaN stays a (quiet) NaN */
    }
    u += 0x7fffu + ((u >> 16) & 1u);  /* round to nearest, ties to even */
    return (unsigned short)(u >> 16);
}
"""

# min and max pick one operand's bits, as ml_dtypes does (``isnan(a) || a < b ? a : b``),
# so signed zeros and NaN payloads come out exactly as on the host.
_BF16_BODY = {
    ReduceOp.SUM: "c = pc_f2bf(x + y);",
    ReduceOp.AVG: "c = pc_f2bf(x + y);",
    ReduceOp.PROD: "c = pc_f2bf(x * y);",
    ReduceOp.MIN: "c = (x != x || x < y) ? a : b;",
    ReduceOp.MAX: "c = (x != x || x > y) ? a : b;",
}


# keep subnormals and exact division: the host (ml_dtypes) does
_EXACT = ("--ftz=false", "--prec-div=true", "--fmad=false")


def _cupy() -> Any:
    import cupy

    return cupy


@functools.cache
def _bf16_kernel(op: ReduceOp) -> Any:
    cp = _cupy()
    return cp.ElementwiseKernel(
        "uint16 a, uint16 b",
        "uint16 c",
        f"float x = pc_bf2f(a); float y = pc_bf2f(b); {_BF16_BODY[op]}",
        f"pycoll_bf16_{op.value}",
        preamble=_PREAMBLE,
        options=_EXACT,
    )


@functools.cache
def _bf16_div_kernel() -> Any:
    cp = _cupy()
    return cp.ElementwiseKernel(
        "uint16 a, float32 n",
        "uint16 c",
        "c = pc_f2bf(pc_bf2f(a) / n);",
        "pycoll_bf16_div",
        preamble=_PREAMBLE,
        options=_EXACT,
    )


def reducer(op: ReduceOp, dtype: np.dtype[Any]) -> Callable[..., Any]:
    """``f(a, b, c)`` or ``f(a, b, out=c)``: ``c = a OP b`` on device for the
    logical ``dtype``."""
    cp = _cupy()
    if dtype == BF16:
        k = _bf16_kernel(op)

        def bf16(a: Any, b: Any, out: Any) -> Any:
            return k(a, b, out)

        return bf16
    return {  # type: ignore[no-any-return]
        ReduceOp.SUM: cp.add,
        ReduceOp.AVG: cp.add,
        ReduceOp.PROD: cp.multiply,
        ReduceOp.MIN: cp.minimum,
        ReduceOp.MAX: cp.maximum,
        ReduceOp.BAND: cp.bitwise_and,
        ReduceOp.BOR: cp.bitwise_or,
        ReduceOp.BXOR: cp.bitwise_xor,
    }[op]


def finish_avg(out: Any, n: int, dtype: np.dtype[Any]) -> None:
    """Turn a sum into an average in place (the same operation on every rank)."""
    cp = _cupy()
    if out.size == 0:
        return
    if dtype == BF16:
        _bf16_div_kernel()(out, np.float32(n), out)
        return
    cp.divide(out, dtype.type(n), out=out)


_NARY_BODY = {ReduceOp.SUM: "acc = acc + {x};", ReduceOp.AVG: "acc = acc + {x};"}
_NARY_BODY[ReduceOp.PROD] = "acc = acc * {x};"
_NARY_BODY[ReduceOp.BAND] = "acc = acc & {x};"
_NARY_BODY[ReduceOp.BOR] = "acc = acc | {x};"
_NARY_BODY[ReduceOp.BXOR] = "acc = acc ^ {x};"


def _fusable(op: ReduceOp, dtype: np.dtype[Any], n: int) -> bool:
    """Whether :func:`nary` gives the bits of the chain of :func:`reducer` calls:
    not for min and max (NaNs), bfloat16 (its own kernel), nor complex products,
    which a compiler may contract into fused multiply-adds differently in CuPy's
    ufunc and in a kernel of ours (sums of either are exact elementwise adds)."""
    if dtype == BF16 or op not in _NARY_BODY or n < 2:
        return False
    return not (op is ReduceOp.PROD and dtype.kind == "c")


@functools.cache
def nary(op: ReduceOp, dtype: np.dtype[Any], n: int, outs: int = 1) -> Callable[..., Any] | None:
    """``f(inputs, outputs)``: every output ``= ((in0 OP in1) OP in2) ...`` in one
    kernel, or None where only the pairwise :func:`reducer` is exact (min, max,
    bfloat16).

    One pass reads every input once and writes each output once (the chain of
    pairwise kernels rereads and rewrites the partial sum n - 2 times, and copies
    would reread the result), and since each element is read before it is
    written, an output may alias any input.  The operands combine in the same
    order, with the same per-step rounding, as the chain, so the bits match it.
    """
    if not _fusable(op, dtype, n):
        return None
    k = _nary_kernel(op, n, outs)

    def f(inputs: list[Any], outputs: list[Any]) -> Any:
        return k(*inputs, *outputs)

    return f


def _chain(op: ReduceOp, n: int, at: str = "") -> str:
    """``T acc = x0<at>; acc = acc OP x1<at>; ...``: the n inputs in rank order."""
    step = _NARY_BODY[op]
    return f"T acc = x0{at}; " + " ".join(step.format(x=f"x{i}{at}") for i in range(1, n))


@functools.cache
def _nary_kernel(op: ReduceOp, n: int, outs: int) -> Any:
    cp = _cupy()
    body = _chain(op, n) + " " + " ".join(f"y{j} = acc;" for j in range(outs))
    return cp.ElementwiseKernel(
        ", ".join(f"T x{i}" for i in range(n)),
        ", ".join(f"T y{j}" for j in range(outs)),
        body,
        f"pycoll_nary_{op.value}_{n}_{outs}",
        options=_EXACT,
    )


def _grid(k: int) -> tuple[int, int]:
    """``(blocks, threads)`` of a :func:`_grid_stride` kernel over ``k`` indices
    (at most 4096 blocks: the loop does the rest)."""
    threads = 256
    return max(1, min((k + threads - 1) // threads, 4096)), threads


def _grid_stride(name: str, ctype: str, params: list[str], body: str, t: str = "T") -> str:
    """The source of kernel ``name(params..., long long k)`` that runs ``body`` for
    every index ``i`` below ``k`` in a grid-stride loop, ``t`` naming ``ctype``."""
    return (
        f"typedef {ctype} {t};\n"
        f'extern "C" __global__ void {name}({", ".join(params)}, long long k) {{\n'
        "  long long stride = (long long)blockDim.x * gridDim.x;\n"
        "  for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < k;"
        " i += stride) {\n"
        f"    {body}\n"
        "  }\n"
        "}\n"
    )


#: C types of the dtypes :func:`nary_launch` reduces (CuPy's own types elsewhere).
_C_TYPES = {
    "float32": "float",
    "float64": "double",
    "int8": "signed char",
    "uint8": "unsigned char",
    "int16": "short",
    "uint16": "unsigned short",
    "int32": "int",
    "uint32": "unsigned int",
    "int64": "long long",
    "uint64": "unsigned long long",
}


def nary_launch(
    op: ReduceOp, dtype: np.dtype[Any], inputs: list[Any], outputs: list[Any], stream: int
) -> Callable[[], None] | None:
    """What :func:`nary` does for these very arrays on ``stream``, as a launch
    whose arguments are packed once (:class:`transports.cuda_driver.Launch`),
    for a device plan that runs it again and again; None where :func:`nary` is
    None, or for dtypes other than the real and integer ones of ``_C_TYPES``.
    The same chain of operations, compiled with the same options, so the bits
    are :func:`nary`'s."""
    if not _fusable(op, dtype, len(inputs)) or dtype.name not in _C_TYPES:
        return None
    import ctypes

    from transports.cuda_driver import Launch

    count = outputs[0].size
    kern = _nary_raw(op, dtype.name, len(inputs), len(outputs))
    args: list[Any] = [ctypes.c_uint64(int(a.data.ptr)) for a in (*inputs, *outputs)]
    args.append(ctypes.c_int64(count))
    return Launch(int(kern.kernel.ptr), *_grid(count), stream, args)


@functools.cache
def _nary_raw(op: ReduceOp, dtype: str, n: int, outs: int) -> Any:
    cp = _cupy()
    name = f"pycoll_nary_raw_{op.value}_{dtype}_{n}_{outs}"
    params = [f"const T* x{i}" for i in range(n)] + [f"T* y{j}" for j in range(outs)]
    body = _chain(op, n, "[i]") + " " + " ".join(f"y{j}[i] = acc;" for j in range(outs))
    src = _grid_stride(name, _C_TYPES[dtype], params, body)
    kern = cp.RawKernel(src, name, options=_EXACT)
    kern.kernel  # noqa: B018  (compiled and loaded now: loading synchronizes the context)
    return kern


def nary_load(op: ReduceOp, dtype: np.dtype[Any], n: int, outs: int) -> None:
    """Compile and load now the kernel of :func:`nary_launch` for ``n`` inputs and
    ``outs`` outputs: loading a module synchronizes the context, so a device plan
    does it when it is made, right after a call, not in a later call that should
    return before the GPU is done."""
    if _fusable(op, dtype, n) and dtype.name in _C_TYPES:
        _nary_raw(op, dtype.name, n, outs)


# ------------------------------------------------------------ one kernel per call
# On a GPU that several ranks share, one rank makes every copy and runs every
# reduction of a collective (see pycoll.gpu.windows).  Each launch there costs
# microseconds of host time and a slot in the device's queue, and n blocks of n
# ranks make n**2 copies; these kernels do a collective's work in one launch.
# Each thread handles one element index of every block.


def block_reduce(op: ReduceOp, dtype: np.dtype[Any], n: int) -> Callable[..., Any] | None:
    """``f(inputs, outputs)``: ``outputs[q] = inputs[0][q*k:(q+1)*k] OP inputs[1][...] ...``
    for every block q in one kernel (k = outputs[q].size; the reduce_scatter of ranks
    that share a GPU), combined in the order and with the rounding of :func:`nary`;
    None where :func:`nary` is.
    """
    if not _fusable(op, dtype, n):
        return None
    kern = _block_reduce_kernel(op, n)

    def f(inputs: list[Any], outputs: list[Any]) -> Any:
        k = outputs[0].size
        return kern(*inputs, k, *outputs, size=k)

    return f


@functools.cache
def _block_reduce_kernel(op: ReduceOp, n: int) -> Any:
    cp = _cupy()
    blocks = [
        "{ " + _chain(op, n, f"[{q} * k + i]" if q else "[i]") + f" y{q}[i] = acc; }}"
        for q in range(n)
    ]
    return cp.ElementwiseKernel(
        ", ".join(f"raw T x{p}" for p in range(n)) + ", int64 k",
        ", ".join(f"raw T y{q}" for q in range(n)),
        " ".join(blocks),
        f"pycoll_block_{op.value}_{n}",
        options=_EXACT,
    )


def fan_out(sources: list[Any], outputs: list[Any]) -> None:
    """``outputs[o][p*k:(p+1)*k] = sources[p]`` for every o and p, in one kernel on
    the current stream (k = sources[p].size; one source is a broadcast, n sources
    an allgather).  The bytes move as the widest words (up to 16 bytes) that every
    address and the block length allow.  A thread reads all its words before it
    writes any, so ``sources[p]`` may be block p of ``outputs[p]`` (in place).
    """
    nbytes = sources[0].nbytes
    if not nbytes:
        return
    ptrs = [int(a.data.ptr) for a in (*sources, *outputs)]
    word = 16
    while any(p % word for p in ptrs) or nbytes % word:
        word //= 2
    k = nbytes // word
    kern = _fan_out_kernel(len(sources), len(outputs), word)
    blocks, threads = _grid(k)
    kern((blocks,), (threads,), (*(np.uint64(p) for p in ptrs), np.int64(k)))


_WORDS = {
    16: "ulonglong2",
    8: "unsigned long long",
    4: "unsigned int",
    2: "unsigned short",
    1: "unsigned char",
}


@functools.cache
def _fan_out_kernel(n: int, m: int, word: int) -> Any:
    cp = _cupy()
    w = _WORDS[word]
    params = [f"const W* x{p}" for p in range(n)] + [f"W* y{o}" for o in range(m)]
    reads = " ".join(f"W v{p} = x{p}[i];" for p in range(n))  # every read before a write
    writes = " ".join(
        f"y{o}[{p} * k + i] = v{p};" if p else f"y{o}[i] = v0;" for p in range(n) for o in range(m)
    )
    name = f"pycoll_fan_out_{n}_{m}_{word}"
    return cp.RawKernel(_grid_stride(name, w, params, f"{reads} {writes}", "W"), name)
