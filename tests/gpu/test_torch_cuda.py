"""The torch backend on CUDA tensors: on the device, stream-ordered, loud.

CUDA tensors of the communicator's device go to pycoll's device path with no
copy to the host; an asynchronous call runs on the group's stream after the
caller's current stream, ``Work.wait()`` makes the current stream wait on the
device, and the Work's future is CUDA-aware; a synchronous one runs on the
caller's current stream, as ProcessGroupNCCL does.  Checked here: every
collective against values every rank can compute (dtypes, ops, non-contiguous
tensors), no host copy, the host not held by the GPU, two streams, the stream
each kind of call runs on, futures chained with ``then``, tensors the caller
drops, groups that share the worker thread, a failure that reaches the
caller, and DDP on CUDA over pycoll against
DDP over Gloo.
Runs at n = 1 and under mpiexec (ranks share the GPU).
"""

from __future__ import annotations

import time

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("cupy", reason="GPU tests need CuPy")
import torch.distributed as dist  # noqa: E402
from mpi4py import MPI  # noqa: E402
from torch import nn  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402

import pycoll.torch_backend  # noqa: E402
from pycoll.gpu import present  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.mpi,
    pytest.mark.timeout(600),
    pytest.mark.skipif(not present() or not torch.cuda.is_available(), reason="no CUDA device"),
]

WORLD = MPI.COMM_WORLD
RANK, SIZE = WORLD.Get_rank(), WORLD.Get_size()
TOTAL = SIZE * (SIZE + 1) / 2  # the sum of rank + 1 over the ranks


@pytest.fixture(scope="module")
def dev():
    d = torch.device("cuda", RANK % torch.cuda.device_count())
    torch.cuda.set_device(d)  # before init: the communicator's device
    pycoll.torch_backend.register(timeout=120)
    dist.init_process_group("pycoll", init_method="mpi://")
    yield d
    torch.cuda.synchronize()
    dist.destroy_process_group()


def _on_device(work) -> bool:
    return work._cuda is not None


def test_collectives_match_numpy(dev):
    """Every collective of the backend on CUDA tensors, on the device."""
    for dtype in (torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64):
        t = torch.full((7,), RANK + 1, dtype=dtype, device=dev)
        w = dist.all_reduce(t, async_op=True)
        assert _on_device(w)
        w.wait()
        assert torch.equal(t, torch.full((7,), TOTAL, dtype=dtype, device=dev)), (dtype, t)
    for op, fn in ((dist.ReduceOp.MAX, max), (dist.ReduceOp.MIN, min)):
        t = torch.tensor([1.0 + RANK, 5.0 - RANK], device=dev)
        dist.all_reduce(t, op=op)
        want = [fn(1.0 + r for r in range(SIZE)), fn(5.0 - r for r in range(SIZE))]
        assert t.tolist() == want, (op, t)
    t = torch.full((5,), float(RANK + 1), device=dev)
    dist.all_reduce(t, op=dist.ReduceOp.AVG)
    assert torch.allclose(t, torch.full((5,), TOTAL / SIZE, device=dev)), t
    nc = (torch.arange(12.0, device=dev).reshape(3, 4) * (RANK + 1)).t()  # non-contiguous
    dist.all_reduce(nc)
    assert torch.equal(nc, torch.arange(12.0, device=dev).reshape(3, 4).t() * TOTAL)
    # coalesced: packed into one flat tensor, reduced, unpacked
    a, b = torch.ones(3, device=dev) * (RANK + 1), torch.ones(4, device=dev)
    dist.all_reduce_coalesced([a, b])
    assert torch.equal(a, torch.full((3,), TOTAL, device=dev)), a
    assert torch.equal(b, torch.full((4,), float(SIZE), device=dev)), b
    t = torch.tensor([RANK, 7, 7], device=dev) if RANK == SIZE - 1 else torch.zeros(3, device=dev)
    t = t.to(torch.int64)
    dist.broadcast(t, src=SIZE - 1)
    assert t.tolist() == [SIZE - 1, 7, 7], t
    t = torch.full((2,), float(RANK + 1), device=dev)
    dist.reduce(t, dst=0)
    if RANK == 0:
        assert t.tolist() == [TOTAL, TOTAL], t
    outs = [torch.empty(2, dtype=torch.int32, device=dev) for _ in range(SIZE)]
    dist.all_gather(outs, torch.tensor([RANK, -RANK], dtype=torch.int32, device=dev))
    assert [o.tolist() for o in outs] == [[r, -r] for r in range(SIZE)], outs
    big = torch.empty(SIZE * 3, device=dev)
    dist.all_gather_into_tensor(big, torch.full((3,), float(RANK), device=dev))
    assert torch.equal(big, torch.arange(SIZE, device=dev).float().repeat_interleave(3)), big
    out = torch.empty(2, device=dev)
    dist.reduce_scatter(out, [torch.full((2,), float(r + RANK), device=dev) for r in range(SIZE)])
    assert out.tolist() == [SIZE * RANK + SIZE * (SIZE - 1) / 2] * 2, out
    out = torch.empty(2, device=dev, dtype=torch.bfloat16)
    dist.reduce_scatter_tensor(out, torch.arange(2 * SIZE, device=dev).to(torch.bfloat16))
    want = torch.arange(2 * RANK, 2 * RANK + 2, device=dev).to(torch.bfloat16) * SIZE
    assert torch.equal(out, want), out
    outs = [[torch.empty(2, device=dev), torch.empty(3, device=dev)] for _ in range(SIZE)]
    dist.all_gather_coalesced(
        outs, [torch.tensor([RANK, 5.0], device=dev), torch.full((3,), RANK + 0.5, device=dev)]
    )
    assert [o[0].tolist() for o in outs] == [[r, 5] for r in range(SIZE)], outs
    assert [o[1].tolist() for o in outs] == [[r + 0.5] * 3 for r in range(SIZE)], outs


def test_no_copy_to_the_host(dev, monkeypatch):
    """The tensors pycoll gets are the caller's CUDA tensors themselves."""
    seen = []
    comm = dist.distributed_c10d._get_default_group().communicator
    real = comm.allreduce

    def spy(x, *a, **kw):  # a CUDA tensor, or the backend's CuPy view of one (.kept)
        ptr = x.data_ptr() if isinstance(x, torch.Tensor) else x.data.ptr
        seen.append((x.device.index if isinstance(x, torch.Tensor) else x.device.id, ptr))
        return real(x, *a, **kw)

    monkeypatch.setattr(comm, "allreduce", spy)
    t = torch.ones(1 << 20, device=dev)
    dist.all_reduce(t)
    assert seen == [(t.device.index, t.data_ptr())], seen
    assert float(t[0]) == SIZE


@pytest.mark.parametrize("async_op", [False, True])
def test_the_same_tensor_again_replays_a_device_plan(dev, replays, async_op):
    """An allreduce of the same CUDA tensor, again and again with new contents:
    the backend hands pycoll the view it kept (pycoll/torch_backend/kept.py), so
    pycoll replays its device plan, and every result is right."""
    t = torch.empty(1 << 20, device=dev)  # 4 MiB: the device path, not the host mirrors
    for rnd in range(6):
        t.fill_(RANK + 1 + rnd)
        work = dist.all_reduce(t, async_op=async_op)
        if work is not None:
            work.wait()
        got = t * 1
        torch.cuda.synchronize()
        want = TOTAL + SIZE * rnd
        assert float(got.min()) == float(got.max()) == want, (rnd, float(got.min()))
    comm = dist.distributed_c10d._get_default_group().communicator
    if SIZE > 1 and comm._gpu.shared_device and not async_op:
        assert replays[0] >= 4, f"rank {RANK}: {replays[0]} replays of 6 calls"
    WORLD.Barrier()


def _spin(ms: float) -> torch.cuda.Event:
    """A kernel of about ``ms`` on the current stream; the event after it."""
    torch.cuda._sleep(int(ms * 2e6))  # cycles, about 2 GHz
    return torch.cuda.current_stream().record_event()


@pytest.mark.parametrize("async_op", [False, True])
def test_the_host_does_not_wait_for_the_gpu(dev, async_op):
    """A 256 MiB allreduce queued behind a long kernel: the call (and, synchronous,
    its wait) returns while that kernel runs; work after it on the stream sees
    the sum of the inputs written after the kernel."""
    x = torch.zeros(64 << 20, device=dev)
    dist.all_reduce(x)  # loads the kernels (a module load synchronizes the context)
    torch.cuda.synchronize()
    WORLD.Barrier()
    spun = _spin(400.0)
    x.fill_(RANK + 1)  # written only after the spin
    t0 = time.perf_counter()
    work = dist.all_reduce(x, async_op=async_op)
    if work is not None:
        work.wait()
    dt = time.perf_counter() - t0
    running = not spun.query()
    y = x * 2
    torch.cuda.synchronize()
    print(
        f"rank {RANK} n={SIZE} async={async_op}: returned in {dt * 1e3:.1f} ms, kernel running: {running}"
    )
    assert running, f"rank {RANK}: the call waited {dt * 1e3:.0f} ms for the GPU"
    assert float(y.min()) == float(y.max()) == 2 * TOTAL


def test_two_streams(dev):
    """Calls on two streams: each after its own stream's work and before its later
    work; a third stream ordered after both sees both."""
    s1, s2, s3 = (torch.cuda.Stream(dev) for _ in range(3))
    a = torch.zeros(1 << 22, device=dev)
    b = torch.zeros(1 << 22, device=dev)
    torch.cuda.synchronize()
    with torch.cuda.stream(s1):
        _spin(50.0)
        a.fill_(RANK + 1)
        dist.all_reduce(a)
        a2 = a + 1
    with torch.cuda.stream(s2):
        _spin(100.0)
        b.fill_(10 * (RANK + 1))
        w = dist.all_reduce(b, async_op=True)
        w.wait()
        b2 = b + 1
    s3.wait_stream(s1)
    s3.wait_stream(s2)
    with torch.cuda.stream(s3):
        ab = a + b
    torch.cuda.synchronize()
    assert float(a2.min()) == float(a2.max()) == TOTAL + 1
    assert float(b2.min()) == float(b2.max()) == 10 * TOTAL + 1
    assert float(ab.min()) == float(ab.max()) == 11 * TOTAL


def test_a_synchronous_call_runs_on_the_current_stream(dev):
    """As ProcessGroupNCCL: ``async_op=False`` runs on the caller's current stream,
    with no event to the group's stream and back, and on the caller's thread
    while the worker is idle; ``async_op=True`` runs on the group's stream, ordered
    after the current one.  Both see what the current stream wrote before them."""
    pg = dist.distributed_c10d._get_default_group()
    side = torch.cuda.Stream(dev)
    t = torch.zeros(1 << 20, device=dev)
    torch.cuda.synchronize()
    opts = dist.AllreduceOptions()
    with torch.cuda.stream(side):
        _spin(50.0)
        t.fill_(RANK + 1)
        opts.asyncOp = False
        w = pg.allreduce([t], opts)
        assert w._done.is_set()  # its host part ran in the call, on this thread
        w.wait()
        assert w._cuda.stream == side and w._cuda.ready is None, w._cuda.stream
        sync_work = w
        first = t + 0
        opts.asyncOp = True
        w = pg.allreduce([t], opts)
        w.wait()
        assert w._cuda.stream != side and w._cuda.caller is None
        second = t + 0
    torch.cuda.synchronize()
    assert float(first.min()) == float(first.max()) == TOTAL
    assert float(second.min()) == float(second.max()) == TOTAL * SIZE
    # its end event, recorded on request, fires once the stream is past it
    end = time.monotonic() + 10
    while not sync_work.is_completed():
        assert time.monotonic() < end, "a synchronous call never completed"
        time.sleep(0.001)


def test_future_chains_on_the_device(dev):
    """get_future().then(...): the callback sees the reduced tensor, and a wait on
    the chained future orders the current stream after it (DDP's comm hooks)."""
    x = torch.zeros(1 << 20, device=dev)
    torch.cuda.synchronize()
    _spin(100.0)
    x.fill_(RANK + 1)
    fut = dist.all_reduce(x, async_op=True).get_future().then(lambda f: f.value()[0] * 2)
    got = fut.wait()
    y = got + 1
    torch.cuda.synchronize()
    assert float(y.min()) == float(y.max()) == 2 * TOTAL + 1


def test_a_dropped_tensor_is_not_reused_before_its_work_is_done(dev):
    """The caller drops the tensor of a call still queued on the device: its memory
    is not handed out again while the group's stream may still use it."""
    x = torch.zeros(1 << 22, device=dev)
    torch.cuda.synchronize()
    _spin(200.0)
    x.fill_(RANK + 1)
    work = dist.all_reduce(x, async_op=True)
    work.wait()  # the current stream waits; the GPU is still spinning
    ptr = x.data_ptr()
    del x
    y = torch.empty(1 << 22, device=dev)
    assert y.data_ptr() != ptr
    torch.cuda.synchronize()


def test_async_allreduces_through_host_mirrors_on_a_shared_gpu(dev, monkeypatch):
    """Where every rank shares the GPU, asynchronous allreduces up to
    PYCOLL_DEVICE_ASYNC_HOST_BYTES go through pinned host mirrors, as Gloo's do,
    ordered on the group's stream after the caller's queued work and before
    what ``Work.wait()`` orders after it; they match NumPy on every rank's
    random data at odd sizes, for several dtypes and ops, also through a
    mirror reused by the next call of its size.  A bad op for the dtype raises
    at ``wait()`` on every rank, and the group goes on."""
    pg = dist.distributed_c10d._get_default_group()
    shared = pg.communicator.async_via_host("allreduce", 4)
    assert shared == (SIZE > 1)  # every rank shares the one GPU here
    seen: list[int] = []
    real = pg._mirrors.copy_in

    def spy(flat, *rest):
        seen.append(flat.numel())
        return real(flat, *rest)

    monkeypatch.setattr(pg._mirrors, "copy_in", spy)
    cases = [
        (torch.float32, dist.ReduceOp.SUM, np.sum, 1),
        (torch.float64, dist.ReduceOp.SUM, np.sum, 997),
        (torch.bfloat16, dist.ReduceOp.SUM, np.sum, 4099),
        (torch.int64, dist.ReduceOp.MAX, np.max, (1 << 18) + 3),
        (torch.float16, dist.ReduceOp.MIN, np.min, 262147),
        (torch.float32, dist.ReduceOp.SUM, np.sum, 1),  # the first mirror again
        (torch.float32, dist.ReduceOp.AVG, np.mean, (1 << 20) - 5),  # just under 4 MiB
        (torch.float32, dist.ReduceOp.SUM, np.sum, 3 << 20),  # over the limit: on the device
    ]
    limit = pg.communicator.config.device_async_host_bytes
    assert 4 * ((1 << 20) - 5) <= limit < 4 * (3 << 20)
    for dtype, op, fn, count in cases:
        xs = [np.random.default_rng(100 * r + count).integers(-8, 8, count) for r in range(SIZE)]
        want = fn(np.stack(xs).astype(np.float64), axis=0)
        src = torch.from_numpy(xs[RANK]).to(device=dev, dtype=dtype)
        t = torch.full((count,), -99, dtype=dtype, device=dev)  # poisoned
        torch.cuda.synchronize()
        _spin(20.0)
        t.copy_(src)  # written only after the spin
        w = dist.all_reduce(t, op=op, async_op=True)
        w.wait()
        got = t.double() + 0  # on the current stream, after the wait
        torch.cuda.synchronize()
        assert np.allclose(got.cpu().numpy(), want, rtol=1e-6, atol=0), (dtype, op, count)
    want_seen = [c for dt, *_, c in cases if shared and c * dt.itemsize <= limit]
    assert seen == want_seen, seen
    with pytest.raises(Exception, match="band"):
        dist.all_reduce(torch.ones(5, device=dev), op=dist.ReduceOp.BAND, async_op=True).wait()
    t = torch.full((3,), float(RANK + 1), device=dev)
    dist.all_reduce(t, async_op=True).wait()
    assert t.tolist() == [TOTAL] * 3, t
    pinned = torch.full((4,), RANK + 1, dtype=torch.bfloat16).pin_memory()  # a user's, on the host
    dist.all_reduce(pinned)
    assert pinned.tolist() == [TOTAL] * 4, pinned


def test_mirrored_allreduces_keep_program_order(dev, monkeypatch):
    """The caller's thread queues a mirrored allreduce's copy in (as Gloo's does)
    only past queued calls that will write nothing more in its memory: a call on
    a tensor a queued call has yet to write back, on an overlapping view, or
    behind a queued broadcast reduces what those calls leave, as the worker's
    program order gives; a call on other memory goes ahead, and so does a call
    behind one whose host part is over, after that one's device work.  Every
    rank checks the values every rank can compute."""
    pg = dist.distributed_c10d._get_default_group()
    if not pg.communicator.async_via_host("allreduce", 4):
        pytest.skip("the host mirrors serve ranks that share the GPU")
    ahead: list[int] = []
    real = pg._lane.put_mirrored

    def spy(run, work, span):
        ahead.append(span[1] - span[0])
        return real(run, work, span)

    monkeypatch.setattr(pg._lane, "put_mirrored", spy)
    t = torch.empty(1000, device=dev)
    u = torch.empty(3, device=dev)
    b = torch.empty(5, device=dev)
    for rnd in range(3):
        ahead.clear()
        torch.cuda.synchronize()
        _spin(20.0)  # the calls below queue up behind it
        t.fill_(RANK + 1)
        u.fill_(10.0 * (RANK + 1))
        b.fill_(100.0 * (RANK + 1))
        works = [dist.all_reduce(t, async_op=True)]  # goes ahead: nothing queued
        works.append(dist.all_reduce(u, async_op=True))  # other memory: goes ahead
        works.append(dist.all_reduce(t, async_op=True))  # after the first's write back
        works.append(dist.all_reduce(t[250:750], async_op=True))  # overlaps
        works.append(dist.broadcast(b, src=SIZE - 1, async_op=True))  # the device path
        works.append(dist.all_reduce(b, async_op=True))  # after the broadcast
        for w in works:
            w.wait()
        got_t, got_u, got_b = t * 1, u * 1, b * 1
        torch.cuda.synchronize()
        want = np.full(1000, TOTAL * SIZE)
        want[250:750] *= SIZE
        assert np.array_equal(got_t.cpu().numpy(), want), (rnd, got_t[::250].tolist())
        assert got_u.tolist() == [10.0 * TOTAL] * 3, (rnd, got_u)
        assert got_b.tolist() == [100.0 * SIZE * SIZE] * 5, (rnd, got_b)
        assert ahead[:2] == [4000, 12], (rnd, ahead)  # the first two went ahead
    # a call whose host part is over while its copy back still waits on the
    # group's stream (behind a kernel there): the next call on the tensor goes
    # ahead, and its copy in still follows that copy back
    real_reduce = pg._mirrors.reduce

    def late_copy_back(m, flat, op, stream):  # on the worker
        _spin(50.0)
        return real_reduce(m, flat, op, stream)

    monkeypatch.setattr(pg._mirrors, "reduce", late_copy_back)
    t.fill_(RANK + 1)
    first = dist.all_reduce(t, async_op=True)
    end = time.monotonic() + 30
    while pg._lane.pending:
        assert time.monotonic() < end, "the first call's host part never ended"
        time.sleep(0.001)
    monkeypatch.setattr(pg._mirrors, "reduce", real_reduce)
    ahead.clear()
    dist.all_reduce(t, async_op=True).wait()
    first.wait()
    got = t * 1
    torch.cuda.synchronize()
    assert ahead == [4000], ahead
    assert float(got.min()) == float(got.max()) == TOTAL * SIZE, float(got.min())


def test_groups_sharing_the_worker_each_run_on_their_own_stream(dev):
    """Calls of two groups that share the worker thread (the world and a group
    split from it) alternate, on a side stream of the caller's, mirrored and on
    the device: each group's calls run on its own stream, after the caller's
    queued work, and the caller's ``wait()``, ``is_completed()`` and futures see
    the end of each.  The caller's current stream is never changed."""
    world = dist.distributed_c10d._get_default_group()
    sub = dist.new_group(list(range(SIZE)), backend="pycoll")
    side = torch.cuda.Stream(dev)
    with torch.cuda.stream(side):
        for rnd in range(4):
            ts = [torch.empty(1 << 10, device=dev) for _ in range(4)]
            big = torch.empty(3 << 20, device=dev)  # over the mirrors' limit: on the device
            _spin(10.0)  # on the side stream: the calls queue behind it
            for i, t in enumerate(ts):
                t.fill_(RANK + 1 + i)
            big.fill_(RANK + 1)
            works = []
            for i, t in enumerate(ts):
                g = world if i % 2 == 0 else sub
                works.append(dist.all_reduce(t, group=g, async_op=True))
            works.append(dist.all_reduce(big, group=sub, async_op=True))
            fut = works[0].get_future().then(lambda f: f.value()[0] * 2)
            for w in works:
                w.wait()
                assert torch.cuda.current_stream(dev) == side
            doubled = fut.wait()
            got = [t * 1 for t in ts]
            got_big = big[::4096] * 1
            side.synchronize()
            assert all(w.is_completed() for w in works)
            for i, g in enumerate(got):
                want = TOTAL + SIZE * i
                assert float(g.min()) == float(g.max()) == want, (rnd, i, g[:3].tolist())
            assert float(doubled.min()) == float(doubled.max()) == 2 * TOTAL, rnd
            assert float(got_big.min()) == float(got_big.max()) == TOTAL, rnd
    assert torch.cuda.current_stream(dev) == torch.cuda.default_stream(dev)
    dist.destroy_process_group(sub)


def test_a_failure_reaches_the_caller(dev):
    """An input of a dtype pycoll does not reduce raises at the call, naming it."""
    with pytest.raises(pycoll.InvalidArgumentError, match="float8"):
        dist.all_reduce(torch.zeros(4, device=dev).to(torch.float8_e4m3fn))


def _train(pg, dev, steps: int = 6, batch: int = 8):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 4)).to(dev)
    if RANK:  # other initial weights: DDP's broadcast from rank 0 fixes them
        with torch.no_grad():
            for p in model.parameters():
                p.add_(RANK)
    ddp = DDP(model, device_ids=[dev.index], process_group=pg, bucket_cap_mb=0.01)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    rng = np.random.default_rng(0)
    x = torch.from_numpy(rng.standard_normal((steps, batch * SIZE, 32), dtype=np.float32)).to(dev)
    y = torch.from_numpy(rng.integers(0, 4, (steps, batch * SIZE))).to(dev)
    mine = slice(RANK * batch, (RANK + 1) * batch)
    for step in range(steps):
        opt.zero_grad()
        nn.functional.cross_entropy(ddp(x[step, mine]), y[step, mine]).backward()
        opt.step()
    torch.cuda.synchronize()
    return model


def test_ddp_on_cuda_matches_gloo(dev):
    """DDP on CUDA over pycoll, then over Gloo, from the same start: the replicas
    are bitwise identical, and so are the two (two ranks sum in one order)."""
    gloo = dist.new_group(backend="gloo")
    a = _train(None, dev)
    b = _train(gloo, dev)
    flat = torch.cat([p.detach().reshape(-1) for p in a.parameters()]).cpu().numpy()
    every = WORLD.allgather(flat.tobytes())
    assert all(e == every[0] for e in every), "replicas differ"
    diff = max(float((p - q).detach().abs().max()) for p, q in zip(a.parameters(), b.parameters()))
    print(f"rank {RANK} n={SIZE}: DDP on CUDA, pycoll against Gloo: max |diff| {diff:.3g}")
    if SIZE <= 2:
        assert diff == 0.0
    else:
        assert diff < 1e-5
    dist.destroy_process_group(gloo)
