"""Device collectives through one-sided windows: each rank reads (and writes) its
peers' buffers itself, and the host never waits for the device.

When every pair of ranks has a one-sided connection (CUDA IPC between ranks of
one host; :attr:`transports.base.Cap.ONE_SIDED`), a collective is:

1. *expose*: each rank shows its peers its input (and, for allreduce, its
   output) once the work already queued on its stream is done;
2. *open*: each rank maps its peers' buffers (cached per allocation) and makes
   its stream wait for their "ready" events;
3. the data movement, as kernels and copies on its own stream, straight between
   the ranks' buffers, with no staging slots and no pipeline chunks;
4. *release* / *wait released*: each rank records "done with your buffers", and
   its stream waits until its peers are done with its own buffers.

Every step is an event on a stream, so the call only enqueues work (like
NCCL): the handshakes are host-side counters in shared memory that move as soon
as each rank's host has *enqueued* its part.  Reductions combine the ranks'
contributions in rank order, ``((x0 OP x1) OP x2) ...``, and each block is
computed once and copied, so every rank holds the same bits.

Per collective on n ranks, with N the per-rank input:

* allreduce: rank r reduces block r (N/n elements) of every input into its
  output, then copies that block into each peer's output.  Device traffic per
  rank: about (n + 1) N/n read and (n) N/n written with the fused kernel.  When
  every rank uses the same GPU, rank 0 alone runs one kernel that reads every
  input and writes every output (the ranks' contexts time-slice the GPU, so
  splitting the work gains nothing and costs context switches).
* allgather: rank r copies every peer's input into its output.
* reduce_scatter: rank r reduces block r of every input into its output.
* broadcast: every non-root copies the root's buffer.
* reduce: the root reduces every input into its output.

On a shared GPU the one rank that does the work does it in one launch: the
allgather's n**2 block copies and a broadcast's copies to two or more peers
are one fan-out kernel, the reduce_scatter's n block reductions one kernel.  At
n = 4 on an H200, 32 KiB-1 MiB, that took allgather from 294-404 us to 128-191 us
and reduce_scatter from 201-294 us to 116-187 us (benchmarks/RESULTS.md).
"""

from __future__ import annotations

from typing import Any

from pycoll.gpu import reduce as dreduce
from pycoll.reduce import ReduceOp, reduce_rows
from transports.base import (
    Connection,
    Deadline,
    DeviceSpan,
    TagMismatchError,
    UnshareableMemoryError,
)

_D2D = 3  # cudaMemcpyDeviceToDevice


class Windows:
    """The one-sided side of one device collective on ``stream``.

    Args:
        rank, size: this rank and the number of ranks.
        conns: peer -> one-sided connection (every peer).
        stream: the CuPy stream all the collective's device work goes on.
        deadline: when a host-side handshake gives up.
        scratch: shareable device memory for buffers that cannot be exposed as
            they are (see :class:`Scratch`).
    """

    def __init__(
        self,
        rank: int,
        size: int,
        conns: dict[int, Connection],
        stream: Any,
        deadline: Deadline,
        scratch: Scratch,
        shared_device: bool = False,
    ) -> None:
        import cupy

        self._cp = cupy
        self._rt = cupy.cuda.runtime
        self.rank = rank
        self.size = size
        self.conns = conns
        self.stream = stream
        self._sptr = int(stream.ptr)
        self.deadline = deadline
        self._scratch = scratch
        self.shared_device = shared_device
        self._copy_back: list[tuple[int, int, int]] = []  # (dst, src, nbytes) after the end
        #: the running call's tag (its sequence number and fingerprint, as its
        #: messages carry: pycoll.guard): exposures carry it, openings check it
        self.tag = 0

    @property
    def peers(self) -> list[int]:
        return [p for p in range(self.size) if p != self.rank]

    # ------------------------------------------------------------------ spans
    def expose(
        self, peers: list[int], arrays: list[Any], written: tuple[bool, ...] = ()
    ) -> list[Any]:
        """Expose ``arrays`` to ``peers`` (``written[i]``: peers write into array i);
        returns the arrays to use locally: each one itself, or, when its memory
        cannot be shared, a scratch copy that is copied back at the end."""
        spans, local = self._spans(arrays, written)
        for p in peers:
            self.conns[p].expose(spans, self._sptr, self.deadline, self.tag)
        return local

    def _spans(self, arrays: list[Any], written: tuple[bool, ...]) -> tuple[list, list]:
        """The spans to expose for ``arrays``, and the arrays to use locally."""
        spans, local = [], []
        for i, a in enumerate(arrays):
            ptr, n, dev = int(a.data.ptr), int(a.nbytes), int(a.device.id)
            out = i < len(written) and written[i]
            use = a
            if n and not self._scratch.shareable(ptr):
                tmp = self._scratch.get(i, n, self._sptr)
                self._rt.memcpyAsync(tmp, ptr, n, _D2D, self._sptr)
                if out:
                    self._copy_back.append((ptr, tmp, n))
                ptr = tmp
                use = self._as_array(ptr, n, a.dtype, dev)
            spans.append(DeviceSpan(ptr, n, dev, self._sptr, written=out))
            local.append(use)
        return spans, local

    def _as_array(self, ptr: int, nbytes: int, dtype: Any, device: int) -> Any:
        cp = self._cp
        mem = cp.cuda.UnownedMemory(ptr, nbytes, self, device)
        return cp.ndarray((nbytes // dtype.itemsize,), dtype, cp.cuda.MemoryPointer(mem, 0))

    def open(self, peer: int, dtype: Any, first: int, last: int | None = None) -> list[Any]:
        """The peer's exposed arrays (flat, ``dtype``), readable on our stream.

        ``first`` (and ``last``): the bytes this rank's part of the call makes the
        first (and last) array the peer exposes.

        Raises:
            TagMismatchError: the peer's exposure carries another call's tag, or
                other sizes (a caller that sets no tag): no byte moves.
        """
        spans = self.conns[peer].open_window(self._sptr, self.deadline, self.tag)
        return self._views(peer, spans, dtype, first, last)

    def _views(
        self, peer: int, spans: list[DeviceSpan], dtype: Any, first: int, last: int | None
    ) -> list[Any]:
        """:meth:`open`'s arrays of the spans ``peer`` exposed, their sizes checked."""
        got = [sp.nbytes for sp in spans]
        if not got or got[0] != first or (last is not None and got[-1] != last):
            want = [first] if last is None else [first, last]
            raise TagMismatchError(
                f"windows: rank {peer} exposed buffers of {got} bytes where this rank's "
                f"call needs {want}: the ranks' calls differ (counts, dtypes or collectives)",
                got=got[0] if got else -1,
                expected=first,
                of="sizes",
                peer=peer,
            )
        return [self._as_array(sp.ptr, sp.nbytes, dtype, sp.device) for sp in spans]

    def release(self, peers: list[int]) -> None:
        for p in peers:
            self.conns[p].release(self._sptr)

    def wait_released(self, peers: list[int]) -> None:
        for p in peers:
            self.conns[p].wait_released(self._sptr, self.deadline)
        for dst, src, n in self._copy_back:
            self._rt.memcpyAsync(dst, src, n, _D2D, self._sptr)
        self._copy_back.clear()

    def reduce_all(self, op: ReduceOp, dtype: Any, inputs: list[Any], outputs: list[Any]) -> bool:
        """Every output ``= ((inputs[0] OP inputs[1]) OP ...)`` in one kernel
        (:func:`pycoll.gpu.reduce.nary`); False, enqueuing nothing, where no one
        kernel gives the bits of the pairwise chain."""
        fused = dreduce.nary(op, dtype, len(inputs), len(outputs))
        if fused is None:
            return False
        fused(inputs, outputs)
        return True

    def copy(self, dst: Any, src: Any) -> None:
        if dst.nbytes:
            self._rt.memcpyAsync(
                int(dst.data.ptr), int(src.data.ptr), int(dst.nbytes), _D2D, self._sptr
            )


class KeptWindows(Windows):
    """The windows of one device plan (:mod:`pycoll.gpu.replay`): the same arrays
    and stream at every call, so what an exposure and an opening work out is
    kept.  An exposure of arrays seen before reuses their spans with the IPC
    handles worked out the first time (the plan holds the arrays, so their
    memory stays allocated); an opening whose peer exposed the very spans it
    exposed last time reuses the arrays made of them, their sizes checked then;
    a reduction of the same arrays reuses its packed launch.
    A peer that exposes anything else is opened afresh, and checked as ever.
    Memory that cannot be shared (a scratch copy each call) is never kept."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._exposed: dict[tuple[int, ...], tuple[list, list]] = {}
        self._opened: dict[tuple[Any, ...], tuple[list, list]] = {}
        self._launches: dict[tuple[Any, ...], Any] = {}

    def _spans(self, arrays: list[Any], written: tuple[bool, ...]) -> tuple[list, list]:
        key = tuple(map(id, arrays))  # the plan's own arrays: alive, ids stable
        kept = self._exposed.get(key)
        if kept is not None:
            return kept
        spans, local = super()._spans(arrays, written)
        if any(u is not a for u, a in zip(local, arrays, strict=True)):
            return spans, local  # scratch copies: made afresh at each call
        from transports.cuda_driver import export

        spans = [
            DeviceSpan(sp.ptr, sp.nbytes, sp.device, sp.stream, *export(sp.ptr), sp.written)
            if sp.nbytes
            else sp
            for sp in spans
        ]
        if len(self._exposed) < 8:
            self._exposed[key] = (spans, local)
        return spans, local

    def reduce_all(self, op: ReduceOp, dtype: Any, inputs: list[Any], outputs: list[Any]) -> bool:
        """As :meth:`Windows.reduce_all`, through a launch packed once for these
        arrays (:func:`pycoll.gpu.reduce.nary_launch`): the kept ones again
        and again."""
        key = (op, dtype, *map(id, inputs), *map(id, outputs))
        launch = self._launches.get(key)
        if launch is None:
            launch = dreduce.nary_launch(op, dtype, inputs, outputs, self._sptr)
            if launch is None:
                return super().reduce_all(op, dtype, inputs, outputs)
            if len(self._launches) < 8:
                self._launches[key] = (launch, inputs, outputs)  # holds what the ids name
        else:
            launch = launch[0]
        launch()
        return True

    def _views(
        self, peer: int, spans: list[DeviceSpan], dtype: Any, first: int, last: int | None
    ) -> list[Any]:
        key = (peer, dtype, first, last)
        kept = self._opened.get(key)
        if kept is not None and kept[0] == spans:
            return kept[1]
        views = super()._views(peer, spans, dtype, first, last)
        self._opened[key] = (spans, views)
        return views


class Scratch:
    """Device memory that can always be exposed (plain ``cudaMalloc``), kept and
    grown per slot, for buffers whose own memory cannot be shared (say, from a
    stream-ordered ``cudaMallocAsync`` pool).  Which allocations are shareable is
    remembered per allocation base."""

    def __init__(self, device: int) -> None:
        import cupy

        self._rt = cupy.cuda.runtime
        self.device = device
        self._bufs: dict[int, tuple[int, int]] = {}  # slot -> (ptr, nbytes)
        self._verdict: dict[int, bool] = {}

    def shareable(self, ptr: int) -> bool:
        from transports import cuda_driver

        base = cuda_driver.allocation_base(ptr)
        ok = self._verdict.get(base)
        if ok is None:
            try:
                cuda_driver.export(ptr)
                ok = True
            except UnshareableMemoryError:
                ok = False
            if len(self._verdict) > 4096:
                self._verdict.clear()
            self._verdict[base] = ok
        return ok

    def get(self, slot: int, nbytes: int, stream: int) -> int:
        """Scratch of at least ``nbytes`` for ``slot``, used on ``stream`` only (its
        peers' reads are ordered before that stream's end, by the windows)."""
        ptr, have = self._bufs.get(slot, (0, 0))
        if have < nbytes:
            if ptr:
                # queued work may still use the old one; not the whole device, whose
                # callers' streams may wait for the very collective running this
                self._rt.streamSynchronize(stream)
                self._rt.free(ptr)
            ptr = int(self._rt.malloc(nbytes))
            self._bufs[slot] = (ptr, nbytes)
        return ptr

    def close(self) -> None:
        if self._bufs:
            self._rt.deviceSynchronize()
        for ptr, _ in self._bufs.values():
            self._rt.free(ptr)
        self._bufs.clear()


def _block(count: int, n: int, p: int) -> tuple[int, int]:
    return p * count // n, (p + 1) * count // n


def _reduce_into(
    W: Windows, op: ReduceOp, dtype: Any, inputs: list[Any], out: Any, aliased: int
) -> None:
    """``out = ((inputs[0] OP inputs[1]) OP ...)``; ``out`` may alias ``inputs[aliased]``
    (-1: none)."""
    if len(inputs) == 1:
        W.copy(out, inputs[0])
        return
    fused = dreduce.nary(op, dtype, len(inputs))
    if fused is not None:
        fused(inputs, [out])
        return
    f = dreduce.reducer(op, dtype)
    if aliased >= 2:  # the chain writes out before it reads that input
        inputs = list(inputs)
        inputs[aliased] = inputs[aliased].copy()
    reduce_rows(f, inputs, out)


def allreduce(W: Windows, op: ReduceOp, dtype: Any, x: Any, out: Any) -> None:
    if W.shared_device:
        _allreduce_one_gpu(W, op, dtype, x, out)
        return
    n, r, peers = W.size, W.rank, W.peers
    lo, hi = _block(x.size, n, r)
    in_place = int(x.data.ptr) == int(out.data.ptr)
    if in_place:
        (x,) = W.expose(peers, [x], written=(True,))
        out = x
    else:
        x, out = W.expose(peers, [x, out], written=(False, True))
    views = {p: W.open(p, x.dtype, x.nbytes, x.nbytes) for p in peers}
    inputs = [x[lo:hi] if p == r else views[p][0][lo:hi] for p in range(n)]
    _reduce_into(W, op, dtype, inputs, out[lo:hi], r if in_place else -1)
    for p in peers:
        W.copy(views[p][-1][lo:hi], out[lo:hi])
    W.release(peers)
    W.wait_released(peers)


def _follow(W: Windows, leader: int, arrays: list[Any], written: tuple[bool, ...]) -> None:
    """A non-leader's whole part on a shared GPU: expose, wait until the leader is done."""
    W.expose([leader], arrays, written=written)
    W.wait_released([leader])


def _lead(W: Windows, x: Any, out: Any, in_place: bool = False) -> tuple[list, list] | None:
    """On a shared GPU, rank 0 gets every rank's input and output, in rank order;
    the other ranks expose theirs to it, wait until it is done, and get None."""
    if W.rank != 0:
        if in_place:
            _follow(W, 0, [x], (True,))
        else:
            _follow(W, 0, [x, out], (False, True))
        return None
    views = {p: W.open(p, x.dtype, x.nbytes, out.nbytes) for p in W.peers}
    return [x] + [views[p][0] for p in W.peers], [out] + [views[p][-1] for p in W.peers]


def _allreduce_one_gpu(W: Windows, op: ReduceOp, dtype: Any, x: Any, out: Any) -> None:
    """Every rank on one GPU: rank 0 reduces all inputs into all outputs.

    Ranks that share a GPU time-slice it, so splitting the work between their
    contexts buys no parallelism and adds a context switch per hand-off; one
    kernel in one context reads each input once and writes each output once.
    """
    in_place = int(x.data.ptr) == int(out.data.ptr)
    both = _lead(W, x, out, in_place)
    if both is None:
        return
    inputs, outputs = both
    if not W.reduce_all(op, dtype, inputs, outputs):
        _reduce_into(W, op, dtype, inputs, out, 0 if in_place else -1)
        for o in outputs[1:]:
            W.copy(o, out)
    W.release(W.peers)


def allgather(W: Windows, x: Any, out: Any) -> None:
    k, r, peers = x.size, W.rank, W.peers
    if W.shared_device:  # rank 0 makes every copy, in one kernel (see _allreduce_one_gpu)
        # a follower runs nothing on the device: a kernel there would cost rank 0
        # a time slice of the shared GPU before it could start
        both = _lead(W, x, out)
        if both is None:
            return
        srcs, outs = both
        dreduce.fan_out(srcs, outs)  # in place too: a block copied onto itself is unchanged
        W.release(peers)
        return
    if int(out[r * k :].data.ptr) != int(x.data.ptr):
        W.copy(out[r * k : (r + 1) * k], x)
    (x,) = W.expose(peers, [x])
    for p in peers:
        (xp,) = W.open(p, x.dtype, x.nbytes)
        W.copy(out[p * k : (p + 1) * k], xp)
    W.release(peers)
    W.wait_released(peers)


def reduce_scatter(W: Windows, op: ReduceOp, dtype: Any, x: Any, out: Any) -> None:
    n, r, peers = W.size, W.rank, W.peers
    k = out.size
    if W.shared_device:  # rank 0 reduces every block, in one kernel (see _allreduce_one_gpu)
        both = _lead(W, x, out)
        if both is None:
            return
        xs, outs = both
        fused = dreduce.block_reduce(op, dtype, n)
        if fused is not None:
            fused(xs, outs)
        else:
            for q in range(n):
                _reduce_into(W, op, dtype, [xp[q * k : (q + 1) * k] for xp in xs], outs[q], -1)
        W.release(peers)
        return
    (x,) = W.expose(peers, [x])
    views = {p: W.open(p, x.dtype, x.nbytes)[0] for p in peers}
    inputs = [(x if p == r else views[p])[r * k : (r + 1) * k] for p in range(n)]
    _reduce_into(W, op, dtype, inputs, out, -1)
    W.release(peers)
    W.wait_released(peers)


def broadcast(W: Windows, buf: Any, root: int) -> None:
    if W.shared_device:  # the root makes every copy, in one kernel (see _allreduce_one_gpu)
        if W.rank != root:
            _follow(W, root, [buf], (True,))
            return
        dsts = [W.open(p, buf.dtype, buf.nbytes)[0] for p in W.peers]
        if len(dsts) == 1:
            W.copy(dsts[0], buf)  # one copy: cudaMemcpy's own is faster than a kernel's
        else:
            dreduce.fan_out([buf], dsts)
        W.release(W.peers)
        return
    if W.rank == root:
        W.expose(W.peers, [buf])  # a scratch copy, if any, is not copied back: unchanged
        W.wait_released(W.peers)
        return
    (src,) = W.open(root, buf.dtype, buf.nbytes)
    W.copy(buf, src)
    W.release([root])


def reduce(W: Windows, op: ReduceOp, dtype: Any, x: Any, out: Any, root: int) -> None:
    if W.rank != root:
        W.expose([root], [x])
        W.wait_released([root])
        return
    n, peers = W.size, W.peers
    views = {p: W.open(p, x.dtype, x.nbytes)[0] for p in peers}
    in_place = int(x.data.ptr) == int(out.data.ptr)
    inputs = [x if p == root else views[p] for p in range(n)]
    _reduce_into(W, op, dtype, inputs, out, root if in_place else -1)
    W.release(peers)
