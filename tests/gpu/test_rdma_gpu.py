"""The RDMA transport's GPU memory paths (rdma:dmabuf, rdma:gdr) with real CUDA.

There is no RDMA NIC on the GPU machine: the soft provider is told to claim
the NIC capabilities (``soft_caps=dmabuf,peermem``) and performs the "DMA"
into and out of GPU memory with CUDA copies.  What is real here: CUDA
allocations of the device slots, the dma-buf export of GPU memory
(``cuMemGetHandleForAddressRange``), its registration as a dma-buf MR with
the sub-page offset, the fd closed afterwards, the gdr flush READ, DeviceSpan
sinks on CuPy arrays, and pycoll choosing ``rdma:dmabuf``/``rdma:gdr`` by itself.
What is not: a NIC reaching GPU memory over PCIe.

Not marked ``mpi``: runs once (n = 1); the two-rank case starts its own mpiexec.
``python -m pycoll info`` output and the measured rates go to ``$OUT`` when set.
"""

from __future__ import annotations

import mmap
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

cp = pytest.importorskip("cupy", reason="GPU tests need CuPy")
pytest.importorskip("cuda.bindings", reason="the rdma device paths need cuda-bindings")

from transports.base import Cap, Deadline, DeviceSpan, TransportOptions, wait_all  # noqa: E402
from transports.rdma import RdmaTransport, dmabuf  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(300)]

ROOT = Path(__file__).resolve().parents[2]
PATHS = ["dmabuf", "gdr"]


def _artifact(name: str, text: str) -> None:
    print(text)
    out = os.environ.get("OUT")
    if out:
        Path(out).mkdir(parents=True, exist_ok=True)
        with open(Path(out) / name, "a") as f:
            f.write(text + "\n")


def options(rank: int, path: str, slot_bytes: int = 64 << 10) -> TransportOptions:
    return TransportOptions(
        rank=rank,
        size=2,
        timeout=60.0,
        slot_bytes=slot_bytes,
        nslots=4,
        extra=(
            ("rdma_provider", "soft"),
            ("rdma_memory", path),
            ("soft_caps", "dmabuf,peermem"),
            ("rdma_gpu", str(cp.cuda.runtime.getDevice())),
        ),
    )


@pytest.fixture(params=PATHS)
def pair(request):
    path = request.param
    ts = [RdmaTransport(options(r, path)) for r in range(2)]
    try:
        blobs = [t.listen() for t in ts]
        conns = [ts[0].connect(1, blobs[1]), ts[1].connect(0, blobs[0])]
        yield path, ts, conns
        for c in conns:
            c.close()
    finally:
        for t in ts:
            t.close()


def test_dmabuf_export_of_a_pool_suballocation_is_a_real_fd():
    a = cp.empty((1 << 20) + 8192, cp.uint8)
    ptr = int(a.data.ptr) + 100  # inside a page, as memory-pool allocations are
    fd, base, offset, length = dmabuf.export_range(ptr, 4096)
    try:
        assert base % mmap.PAGESIZE == 0 and length % mmap.PAGESIZE == 0
        assert offset == ptr - base and 0 <= offset < mmap.PAGESIZE
        assert length >= offset + 4096
        os.fstat(fd)
        link = os.readlink(f"/proc/self/fd/{fd}")
        assert "dmabuf" in link, link
        _artifact("rdma-gpu.txt", f"dma-buf export: fd {fd} -> {link}, offset {offset}")
    finally:
        os.close(fd)


def test_device_registration(pair):
    path, ts, conns = pair
    for t, c in zip(ts, conns, strict=True):
        assert c.transport == f"rdma:{path}" and Cap.DEVICE in c.caps
        reg = t.dev_recv_reg
        assert reg is not None and reg.path == path
        if path == "dmabuf":
            assert type(reg.mr).__name__ == "DmaBufMR"
            assert reg.addr == t.dev_recv_ptr % mmap.PAGESIZE  # iova = offset
        else:
            assert reg.addr == t.dev_recv_ptr and t.flusher is not None


@pytest.mark.parametrize("named_stream", [False, True], ids=["legacy-stream", "own-stream"])
@pytest.mark.parametrize("count", [1, 1000, 300_001])
def test_cupy_arrays_both_ways(pair, count, named_stream):
    path, _, (c0, c1) = pair
    rng = cp.random.default_rng(count)
    a = rng.random(count, dtype=cp.float32)
    b = rng.random(count, dtype=cp.float32)
    ra, rb = cp.full_like(a, -1), cp.full_like(b, -1)
    stream = cp.cuda.get_current_stream()
    if named_stream:  # as pycoll's DeviceLinks does: sinks run on the collective's stream
        stream = cp.cuda.Stream(non_blocking=True)
        c0.set_sink_stream(int(stream.ptr))
        c1.set_sink_stream(int(stream.ptr))
    cp.cuda.runtime.deviceSynchronize()  # the inputs are ready before other streams use them

    def sink_into(out):
        optr = int(out.data.ptr)

        def sink(off: int, span: DeviceSpan) -> None:
            assert isinstance(span, DeviceSpan)
            cp.cuda.runtime.memcpyAsync(optr + off, span.ptr, span.nbytes, 3, span.stream)

        return sink

    def span(x):
        return DeviceSpan(int(x.data.ptr), int(x.nbytes), x.device.id, int(stream.ptr))

    reqs = [
        c0.isend_device(span(a)),
        c1.isend_device(span(b)),
        c0.irecv_device(int(rb.nbytes), sink_into(rb), a.device.id),
        c1.irecv_device(int(ra.nbytes), sink_into(ra), a.device.id),
    ]
    wait_all(reqs, Deadline.after(120))
    cp.cuda.runtime.deviceSynchronize()
    assert bool((ra == a).all()) and bool((rb == b).all()), path


def test_device_path_rate(pair):
    path, _, (c0, c1) = pair
    n = 32 << 20
    a = cp.arange(n, dtype=cp.uint8)
    out = cp.zeros_like(a)
    optr = int(out.data.ptr)

    def sink(off: int, span: DeviceSpan) -> None:
        cp.cuda.runtime.memcpyAsync(optr + off, span.ptr, span.nbytes, 3, span.stream)

    t0 = time.perf_counter()
    wait_all(
        [
            c0.isend_device(DeviceSpan(int(a.data.ptr), n, a.device.id)),
            c1.irecv_device(n, sink, a.device.id),
        ],
        Deadline.after(120),
    )
    cp.cuda.runtime.deviceSynchronize()
    dt = time.perf_counter() - t0
    assert bool((out == a).all())
    _artifact(
        "rdma-gpu.txt",
        f"rdma:{path} (soft provider, CUDA copies) one-way {n >> 20} MiB: "
        f"{dt * 1e3:.1f} ms, {n / dt / 1e6:.0f} MB/s",
    )


def test_pycoll_info_reports_the_paths():
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    res = subprocess.run(
        [sys.executable, "-m", "pycoll", "info", "--provider", "soft", "--soft-caps", "dmabuf,peermem"],
        capture_output=True, text=True, timeout=60, env=env, cwd=ROOT,
    )  # fmt: skip
    _artifact("pycoll-info.txt", res.stdout + res.stderr)
    assert res.returncode == 0
    assert "dma-buf yes" in res.stdout  # the GPU can export
    assert "dmabuf  usable" in res.stdout and "gdr     usable" in res.stdout
    assert "rdma_memory=auto would use: dmabuf" in res.stdout


# ------------------------------------------------------------------ two ranks, pycoll
RANKS = textwrap.dedent(
    """
    import os, sys
    import cupy as cp
    import numpy as np
    import pycoll

    want = "rdma:" + os.environ["PYCOLL_RDMA_MEMORY"]
    with pycoll.init(timeout=120) as comm:
        r, n = comm.rank, comm.size
        peer = 1 - r
        kinds = (comm.transport_of(peer), comm.transport_of(peer, device=True))
        assert kinds == (want, want), (r, kinds, want)
        for count in (1, 4097, 1 << 20):
            x = cp.arange(count, dtype=cp.float32) + r
            comm.allreduce(x)
            ref = np.arange(count, dtype=np.float32) * n + sum(range(n))
            assert np.array_equal(cp.asnumpy(x), ref), (r, count)
        g = comm.allgather(cp.full(1000, r, cp.int32))
        assert np.array_equal(cp.asnumpy(g), np.repeat(np.arange(n), 1000).reshape(n, 1000))
        h = comm.allreduce(np.ones(10, np.float64))  # host buffers on the same connections
        assert (h == n).all()
        comm.barrier()
    print(f"OK rank {r} {kinds[0]}", flush=True)
    """
)

_LAUNCHER_VARS = ("PMI_", "PMIX_", "HYDRA_", "OMPI_COMM_WORLD", "OMPI_MCA_ess", "OMPI_MCA_orte",
                  "OMPI_MCA_pmix", "OMPI_UNIVERSE", "OMPI_FILE_LOCATION", "MPI_LOCALRANKID",
                  "MPI_LOCALNRANKS")  # fmt: skip


@pytest.mark.parametrize("path", PATHS)
def test_two_ranks_pick_the_device_path(path, tmp_path):
    from tests.launch import mpiexec

    script = tmp_path / "ranks.py"
    script.write_text(RANKS)
    env = {k: v for k, v in os.environ.items() if not k.startswith(_LAUNCHER_VARS)}
    env.update(
        PYTHONPATH=str(ROOT),
        PYCOLL_TRANSPORT="rdma",
        PYCOLL_RDMA_PROVIDER="soft",
        PYCOLL_RDMA_SOFT_CAPS="dmabuf,peermem",
        PYCOLL_RDMA_MEMORY=path,
        PYCOLL_DEVICE_TRANSPORT="none",  # device bytes over the RDMA connection, not CUDA IPC
        PYCOLL_CHUNK_BYTES="256K",
        PYCOLL_DEBUG="INFO",
    )
    exe = os.environ.get("MPIEXEC")
    cmd = ([exe, "-n", "2"] if exe else mpiexec(2)) + [sys.executable, "-m", "mpi4py", str(script)]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env, cwd=ROOT)
    _artifact(f"rdma-gpu-mpiexec-{path}.log", res.stdout + res.stderr[-4000:])
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-6000:]
    assert res.stdout.count(f"rdma:{path}") == 2
    assert "emulated, not DMA" in res.stderr  # the soft provider says what it does
