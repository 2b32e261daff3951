"""The benchmark scripts run end to end at n = 2 on tiny sizes."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.launch import mpiexec

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "benchmarks"
COLLECTIVES = ("allreduce", "allgather", "broadcast", "reduce_scatter", "reduce")


def _run(cmd: list[str], timeout: float) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, (
        f"rc={proc.returncode}\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    )
    return proc


def _rows(stdout: str) -> list[list[str]]:
    return [
        line.split() for line in stdout.splitlines() if line.strip() and not line.startswith("#")
    ]


@pytest.mark.timeout(90)
def test_sweep_all_collectives_against_mpi(tmp_path: Path) -> None:
    out_json, plots = tmp_path / "sweep.json", tmp_path / "plots"
    cmd = mpiexec(2) + [
        sys.executable, str(BENCH / "sweep.py"), "all",
        "-b", "8", "-e", "64K", "-f", "8", "-n", "3", "-w", "1", "-c", "1", "--repetitions", "2",
        "--algorithm", "all", "--baselines", "mpi", "--limits", "--limits-bytes", "1M",
        "--timeout", "60", "--no-progress", "--json", str(out_json), "--plot", str(plots),
    ]  # fmt: skip
    proc = _run(cmd, 80)
    rows = _rows(proc.stdout)
    assert rows, proc.stdout
    # size count type redop root, then out-of-place and in-place side by side:
    # time algbw busbw #wrong frac mpi(us) xmpi each (a form not measured: "-")
    assert all(len(r) >= 5 + 2 * 7 for r in rows), proc.stdout  # (auto adds its algo)
    assert all({r[8], r[15]} <= {"0", "-"} and "0" in (r[8], r[15]) for r in rows), proc.stdout
    assert sum(r[8] == "0" and r[15] == "0" for r in rows) >= 3 * 3  # allreduce, allgather, reduce
    assert "Out of bounds values : 0 OK" in proc.stdout
    doc = json.loads(out_json.read_text())
    recs = doc["records"]
    assert {r["collective"] for r in recs} == set(COLLECTIVES)
    assert {r["system"] for r in recs} == {"pycoll", "mpi"}
    assert all(r["wrong"] == 0 for r in recs)
    for key in ("time_us", "algbw", "busbw", "algorithm", "transport", "dtype", "host", "date"):
        assert key in recs[0]
    assert all(r["hugepages"] == "numpy" and 0 <= r["hugepage_frac"] <= 1 for r in recs)
    for coll in COLLECTIVES:
        assert (plots / f"{coll}.png").stat().st_size > 0
    # each repetition, every system once, in an order of its own
    turns: dict[tuple[str, int, bool, int], list[tuple[int, str]]] = {}
    for r in recs:
        label = f"{r['system']}:{r['algorithm']}"
        key = (r["collective"], r["size"], r["inplace"], r["rep"])
        turns.setdefault(key, []).append((r["slot"], label))
    assert {rep for (*_, rep) in turns} == {0, 1}
    forms = {(r["collective"], r["inplace"]) for r in recs}
    assert {c for c, ip in forms if ip} == {"allreduce", "allgather", "broadcast", "reduce"}
    assert {c for c, ip in forms if not ip} == {
        "allreduce",
        "allgather",
        "reduce_scatter",
        "reduce",
    }
    orders = set()
    for t in turns.values():
        assert sorted(s for s, _ in t) == list(range(len(t)))
        orders.add(tuple(label for _, label in sorted(t)))
    assert len(orders) > 1
    # the tables and the fit run on the same JSON
    tab = _run([sys.executable, str(BENCH / "tables.py"), str(out_json)], 30)
    assert "| allreduce | 2 |" in tab.stdout
    assert "The same code measured twice" in tab.stdout
    assert "| 2 | per repetition |" in tab.stdout  # the paired judgement of the same code
    fit = _run([sys.executable, str(BENCH / "fit_cost.py"), str(out_json)], 30)
    assert "DEFAULT = Constants(" in fit.stdout


@pytest.mark.timeout(60)
def test_sweep_gloo_baseline(tmp_path: Path) -> None:
    if importlib.util.find_spec("torch") is None:
        pytest.skip("torch is not installed")
    cmd = mpiexec(2) + [
        sys.executable, str(BENCH / "sweep.py"), "allreduce",
        "-b", "8", "-e", "4K", "-f", "8", "-n", "3", "-w", "1", "-c", "1",
        "--baselines", "gloo", "--timeout", "60", "--no-progress", "--hugepages", "off",
        "--repetitions", "2", "--settle", "0.05", "--json", str(tmp_path / "g.json"),
    ]  # fmt: skip
    proc = _run(cmd, 50)
    assert "skipped" not in proc.stdout, proc.stdout
    rows = _rows(proc.stdout)
    # out-of-place: #wrong gloo(us) at 8, 9; in-place: at 14, 15
    assert rows and all(r[8] == r[14] == "0" for r in rows), proc.stdout
    assert all("skip" not in (r[9], r[15]) for r in rows), proc.stdout
    # pycoll's turn right after Gloo's, and only that, warms up for --settle seconds
    recs = json.loads((tmp_path / "g.json").read_text())["records"]
    seq = sorted(recs, key=lambda r: (r["size"], r["inplace"], r["rep"], r["slot"]))
    # before each case's first repetition (a size, in place or not) every system is
    # tried once, Gloo last
    case = lambda r: (r["size"], r["inplace"])
    prev = [
        "gloo" if i == 0 or case(seq[i - 1]) != case(r) else seq[i - 1]["system"]
        for i, r in enumerate(seq)
    ]
    assert [r["settled"] for r in seq] == [
        p == "gloo" and r["system"] != "gloo" for p, r in zip(prev, seq)
    ]


@pytest.mark.timeout(90)
def test_sweep_torch_pycoll_baseline() -> None:
    """The torch-pycoll baseline (torch.distributed's calls on a "pycoll" group)
    runs every case of a reduction and a gather, out of place and in place, and
    its outputs match the reference (#wrong 0)."""
    if importlib.util.find_spec("torch") is None:
        pytest.skip("torch is not installed")
    for coll in ("allreduce", "allgather"):
        cmd = mpiexec(2) + [
            sys.executable, str(BENCH / "sweep.py"), coll,
            "-b", "8", "-e", "4K", "-f", "8", "-n", "3", "-w", "1", "-c", "1",
            "--baselines", "torch-pycoll", "--timeout", "60", "--no-progress",
            "--hugepages", "off", "--repetitions", "1",
        ]  # fmt: skip
        proc = _run(cmd, 80)
        assert "skipped" not in proc.stdout, proc.stdout
        rows = _rows(proc.stdout)
        assert len(rows) == 4, proc.stdout  # 8 B, 64 B, 512 B and 4 KiB
        assert all(r[8] == r[14] == "0" for r in rows), proc.stdout
        assert all("skip" not in (r[9], r[15]) for r in rows), proc.stdout


@pytest.mark.timeout(60)
def test_sweep_root_agrees_in_header_and_rows() -> None:
    """-r is the root (as in nccl-tests): the header and the rows say the same
    root, -1 for collectives that have none."""
    cmd = mpiexec(2) + [
        sys.executable, str(BENCH / "sweep.py"), "all", "-b", "8", "-e", "64", "-f", "8",
        "-n", "2", "-w", "1", "-r", "1", "--no-progress", "--hugepages", "off",
    ]  # fmt: skip
    proc = _run(cmd, 50)
    heads = [
        line for line in proc.stdout.splitlines() if line.startswith("# ") and " dtype " in line
    ]
    roots = {h.split()[1]: int(h.split(" root ")[1].split()[0]) for h in heads}
    assert roots == {
        "allreduce": -1,
        "allgather": -1,
        "broadcast": 1,
        "reduce_scatter": -1,
        "reduce": 1,
    }
    blocks = proc.stdout.split("\n#\n# ")[1:]
    for block in blocks:
        coll = block.split()[0]
        rows = _rows(block.split("\n", 1)[1])  # past its header line
        assert rows and all(int(r[4]) == roots[coll] for r in rows), block


def test_sweep_flags_as_nccl_tests(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.syspath_prepend(str(BENCH))
    import sweep

    a = sweep.parse_args(["allreduce", "-r", "1", "--repetitions", "3"])
    assert a.root == 1 and a.reps == 3
    assert sweep.parse_args(["reduce", "--root", "2", "--reps", "2"]).reps == 2
    a = sweep.parse_args(["allreduce", "-d", "all", "-o", "all"])
    assert [d[1] for d in a.dtypes] == [
        "int8",
        "uint8",
        "int32",
        "uint32",
        "int64",
        "uint64",
        "float16",
        "bfloat16",
        "float32",
        "float64",
    ]
    assert a.ops == ["sum", "prod", "min", "max", "avg"]
    assert sweep.parse_args(["allreduce", "-c", "0"]).check == 0
    assert sweep.parse_args(["allreduce", "-c", "5"]).check == 1  # a count of checked calls
    assert sweep.parse_args(["allreduce"]).variants == [False, True]
    assert sweep.parse_args(["allreduce", "--inplace", "1"]).variants == [True]
    for argv, words in (
        (["-e", "64X"], "-e '64X' is not a size"),
        (["-b", "-8"], "-b '-8' is not a size"),
        (["-d", "float99"], "-d 'float99': unknown dtype"),
        (["-o", "mean"], "-o 'mean': choose from"),
        (["-c", "-1"], "-c -1"),
    ):
        with pytest.raises(SystemExit) as ei:
            sweep.parse_args(["allreduce", *argv])
        assert ei.value.code == 2
        err = capsys.readouterr().err
        assert words in err and "Traceback" not in err, err


def test_sweep_min_and_max_time_set_the_timed_calls(monkeypatch: pytest.MonkeyPatch) -> None:
    """--min-time stretches a quick system's turn, --max-time caps a slow one's;
    the warm-up's time per call decides how many calls either asks for."""
    import types

    class Comm:  # one rank: MPI's reductions return what they are given
        def allreduce(self, v: float, op: object = None) -> float:
            return v

        def Barrier(self) -> None:
            pass

        def Allreduce(self, a: np.ndarray, out: np.ndarray, op: object = None) -> None:
            out[...] = a

    monkeypatch.setitem(
        sys.modules, "mpi4py", types.SimpleNamespace(MPI=types.SimpleNamespace(MAX=None))
    )
    monkeypatch.syspath_prepend(str(BENCH))
    import sweep

    calls = []
    clock = iter(np.arange(0, 1e6, 1e-3))  # every clock read moves 1 ms ...
    monkeypatch.setattr(sweep.time, "perf_counter", lambda: float(next(clock)))

    def call() -> None:  # ... and so does every call: 1.25 ms a call in the warm-up
        calls.append(sweep.time.perf_counter())

    def turn(*argv: str) -> int:
        calls.clear()
        args = sweep.parse_args(["allreduce", "-n", "10", "-w", "4", *argv])
        _, iters, _, _ = sweep.timed(call, args, Comm(), lambda: None)
        assert len(calls) == 4 + iters
        return iters

    assert turn() == 10
    assert turn("--min-time", "0.1") in (79, 80)  # 0.1 s / 1.25 ms, give or take rounding
    assert turn("--min-time", "0.001") == 10  # -n calls take longer already
    assert turn("--max-time", "0.005") in (3, 4)
    assert turn("--min-time", "1", "--max-time", "0.02") in (15, 16)  # the cap wins


@pytest.mark.skipif(not Path("/proc/self/smaps").exists(), reason="needs /proc/self/smaps")
def test_host_buffers_follow_their_hugepage_policy() -> None:
    sys.path.insert(0, str(BENCH))
    try:
        import hostmem
    finally:
        sys.path.remove(str(BENCH))
    cases = [  # (policy, bytes, madvise flag wanted: hg huge pages, nh never)
        ("numpy", 8, None),
        ("numpy", 2 << 20, None),
        ("numpy", 4 << 20, "hg"),
        ("on", 8, "hg"),
        ("on", 3 << 20, "hg"),
        ("off", 8 << 20, "nh"),
    ]
    for policy, nbytes, want in cases:
        a = hostmem.empty(nbytes // 4, "float32", policy)
        assert a.dtype == np.float32 and a.shape == (nbytes // 4,) and a.flags.writeable
        addr = a.__array_interface__["data"][0]
        assert addr % hostmem.HUGE == 0, (policy, nbytes)
        a[...] = 7
        flags = next(f for lo, hi, f in hostmem.mappings() if lo <= addr < hi)["VmFlags"].split()
        for flag in ("hg", "nh"):
            assert (flag in flags) == (flag == want), (policy, nbytes, flags)
        frac = hostmem.hugepage_fraction(a)
        assert frac is not None and 0 <= frac <= 1
        if want == "nh":
            assert frac == 0
    assert hostmem.empty(0, "float64").size == 0
    with pytest.raises(ValueError, match="hugepages"):
        hostmem.empty(1, "float32", "always")


@pytest.mark.timeout(60)
def test_p2p_every_transport(tmp_path: Path) -> None:
    out_json = tmp_path / "p2p.json"
    cmd = mpiexec(2) + [
        sys.executable, str(BENCH / "p2p.py"), "-t", "shm,tcp,rdma",
        "-b", "8", "-e", "64K", "-f", "64", "-n", "5", "-w", "1", "--json", str(out_json),
    ]  # fmt: skip
    proc = _run(cmd, 50)
    assert "WRONG" not in proc.stdout
    recs = json.loads(out_json.read_text())["records"]
    assert {r["size"] for r in recs} == {8, 512, 32768}
    assert {"shm", "tcp"} <= {r["transport"] for r in recs}
    assert all(r["lat_us"] > 0 and r["bw_GBps"] > 0 for r in recs)


@pytest.mark.timeout(90)
@pytest.mark.parametrize("coll", ["reduce_scatter", "broadcast"])
def test_versus_takes_turns_and_checks_every_system(tmp_path: Path, coll: str) -> None:
    out_json = tmp_path / "v.json"
    cmd = mpiexec(3) + [
        sys.executable, str(BENCH / "versus.py"), coll, "8", "4099",
        "--systems", "auto,ring,direct,mpi", "--rounds", "4", "--block-time", "0.001",
        "--root", "2", "--json", str(out_json),
    ]  # fmt: skip
    proc = _run(cmd, 80)
    assert "Out of bounds values : 0 OK" in proc.stdout, proc.stdout
    assert "# auto within 10% of every other system at " in proc.stdout
    rows = _rows(proc.stdout)
    # size system calls time(us) xauto p10 p90 ran
    assert [r[1] for r in rows] == ["auto", "ring", "direct", "mpi"] * 2, proc.stdout
    assert all(r[4] == r[5] == r[6] == "1.000" for r in rows if r[1] == "auto")
    assert all(len(r) > 7 for r in rows if r[1] == "auto")  # what auto ran
    recs = json.loads(out_json.read_text())["records"]
    assert len(recs) == 2 * 4 * 4 and all(r["wrong"] == 0 and r["time_us"] > 0 for r in recs)
    assert {r["round"] for r in recs} == {0, 1, 2, 3}


@pytest.mark.timeout(90)
def test_versus_times_another_version_of_an_algorithm_module(tmp_path: Path) -> None:
    """--algorithms-from: a module file's algorithms join as NAME@STEM and are timed
    and checked like the others; a wrong one is counted wrong (exit status 1)."""
    shutil.copy(ROOT / "pycoll" / "algorithms" / "direct.py", tmp_path / "direct_copy.py")
    (tmp_path / "broken.py").write_text(
        "from pycoll.algorithms.registry import register\n\n\n"
        "@register('allgather', 'ring')\n"
        "def allgather(L, x, out):\n"
        "    out[...] = 0\n"
    )
    cmd = mpiexec(2) + [
        sys.executable, str(BENCH / "versus.py"), "allgather", "8", "2M",
        "--systems", "direct,direct@direct_copy", "--rounds", "2", "--block-time", "0.001",
        "--algorithms-from", str(tmp_path / "direct_copy.py"),
    ]  # fmt: skip
    proc = _run(cmd, 80)
    assert "Out of bounds values : 0 OK" in proc.stdout, proc.stdout
    assert [r[1] for r in _rows(proc.stdout)] == ["direct", "direct@direct_copy"] * 2
    cmd = mpiexec(2) + [
        sys.executable, str(BENCH / "versus.py"), "allgather", "4099",
        "--systems", "ring,ring@broken", "--rounds", "2", "--block-time", "0.001",
        "--algorithms-from", str(tmp_path / "broken.py"),
    ]  # fmt: skip
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=80)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "FAILED" in proc.stdout, proc.stdout


@pytest.mark.timeout(60)
def test_cma_pages_times_every_mix_of_page_kinds() -> None:
    cmd = mpiexec(2) + [sys.executable, str(BENCH / "cma_pages.py"), "2M",
                        "--reps", "2", "--warm", "1"]  # fmt: skip
    rows = _rows(_run(cmd, 50).stdout)
    # call from to copiers bytes us GB/s (...)
    assert len(rows) == 2 * 2 * 2 * 2, rows
    assert {(r[0], r[1], r[2], r[3]) for r in rows} == {
        (c, f, t, k)
        for c in ("read", "write")
        for f in ("off", "on")
        for t in ("off", "on")
        for k in ("one", "both")
    }
    assert all(int(r[4]) == 2 << 20 and float(r[5]) > 0 for r in rows)


@pytest.mark.timeout(60)
def test_stream_copy_times_both_copies_on_every_rank() -> None:
    pytest.importorskip("pycoll._step")
    cmd = mpiexec(2) + [sys.executable, str(BENCH / "stream_copy.py"), "--sizes", "1M,3K",
                        "--rounds", "1"]  # fmt: skip
    rows = _rows(_run(cmd, 50).stdout)
    assert [int(r[0]) for r in rows] == [1 << 20, 3 << 10], rows
    assert all(float(v.rstrip("x")) > 0 for r in rows for v in r[1:]), rows


@pytest.mark.timeout(60)
def test_skewed_copies_times_each_copy_and_checks_it() -> None:
    pytest.importorskip("pycoll._step")
    pytest.importorskip("transports._ring")
    cmd = [sys.executable, str(BENCH / "skewed_copies.py"), "--sizes", "5000,64K",
           "--skews", "0,16,4111", "--calls", "2", "--reps", "1"]  # fmt: skip
    rows = _rows(_run(cmd, 50).stdout)
    assert [(int(r[0]), int(r[1])) for r in rows] == [
        (n, k) for n in (5000, 64 << 10) for k in (0, 16, 15)
    ], rows
    assert all(float(v) > 0 for r in rows for v in r[2:]), rows


def test_versus_refuses_an_unknown_system() -> None:
    cmd = mpiexec(2) + [sys.executable, str(BENCH / "versus.py"), "allreduce", "8",
                        "--systems", "auto,nccl"]  # fmt: skip
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0
    assert "'nccl' is not auto, mpi, gloo, torch-pycoll or one of" in proc.stdout + proc.stderr


@pytest.mark.timeout(30)
def test_traffic_model_matches_ring_counts() -> None:
    sys.path.insert(0, str(BENCH))
    try:
        import limits
    finally:
        sys.path.remove(str(BENCH))
    n, N = 4, 1 << 20
    ring = limits.traffic("allreduce", "ring", n, N)
    assert ring[0] == {"sent": 1.5 * N, "copied": 0.75 * N, "reduced": 0.75 * N}
    lim = limits.Limits(copy=1e9, add=1e9, copy_conc=4e9, add_conc=4e9, nprocs=4, nbytes=N)
    assert limits.bound_time("allreduce", "ring", n, N, lim) == pytest.approx(3.0 * N / 1e9)
    assert limits.bound_time("allreduce", "nosuch", n, N, lim) is None
    # direct: the reader copies, nobody sends; 2 x 3/4 N copied and 3/4 N reduced
    assert limits.bound_time("allreduce", "direct", n, N, lim) == pytest.approx(2.25 * N / 1e9)
    bc = limits.traffic("broadcast", "direct", n, N, root=2)
    assert [c["copied"] for c in bc] == [N, N, 0.0, N]


# --------------------------------------------------------------------------- the exchanges
EXCHANGES = ("alltoall", "gather", "scatter", "sendrecv")


def test_exchange_geometry_and_factors_as_nccl_tests(monkeypatch: pytest.MonkeyPatch) -> None:
    """size is the larger buffer; count one block's elements for alltoall, gather and
    scatter (nccl-tests' paramcount), the message's for sendrecv; busbw factors
    (n-1)/n and 1."""
    monkeypatch.syspath_prepend(str(BENCH))
    import common

    # (send, recv, count column) of 4-byte elements at size 64 B, n = 4
    assert common.geometry("alltoall", 64, 4, 4) == (16, 16, 4)
    assert common.geometry("gather", 64, 4, 4) == (4, 16, 4)
    assert common.geometry("scatter", 64, 4, 4) == (16, 4, 4)
    assert common.geometry("sendrecv", 64, 4, 4) == (16, 16, 16)
    assert common.geometry("alltoall", 8, 4, 4) == (4, 4, 1)  # at least one element a block
    for coll in ("alltoall", "gather", "scatter"):
        assert common.BUSBW_FACTOR[coll](4) == pytest.approx(0.75)
    assert common.BUSBW_FACTOR["sendrecv"](4) == 1.0


def test_exchange_references_tell_a_misplaced_block(monkeypatch: pytest.MonkeyPatch) -> None:
    """The inputs make a block from the wrong rank, or the right rank's wrong
    block, differ from the reference in every element."""
    monkeypatch.syspath_prepend(str(BENCH))
    import exchanges

    n, k, dt = 3, 5, np.dtype(np.int8)
    ref = exchanges.expected("alltoall", 1, n, 0, n * k, n * k, dt)
    assert ref is not None
    swapped = np.concatenate([ref[k : 2 * k], ref[:k], ref[2 * k :]])
    assert np.count_nonzero(swapped != ref) == 2 * k
    from_rank_0 = exchanges.rank_data(0, n * k, dt)[0:k]  # rank 0's own block, not rank 1's
    assert np.all(from_rank_0 != ref[:k])
    g = exchanges.expected("gather", 2, n, 2, k, n * k, dt)
    assert g is not None and g.size == n * k
    assert exchanges.expected("gather", 0, n, 2, k, n * k, dt) is None
    s = exchanges.expected("scatter", 1, n, 2, n * k, k, dt)
    assert np.array_equal(s, exchanges.rank_data(2, n * k, dt)[k : 2 * k])
    r = exchanges.expected("sendrecv", 0, n, 0, k, k, dt)
    assert np.array_equal(r, exchanges.rank_data(2, k, dt))  # from rank - 1
    assert np.all(r != exchanges.rank_data(1, k, dt))
    assert int(exchanges.rank_data(7, 1000, dt).max()) < 0x5A  # never the poison byte


@pytest.mark.timeout(90)
@pytest.mark.parametrize("coll", EXCHANGES)
def test_sweep_exchanges_against_mpi(tmp_path: Path, coll: str) -> None:
    out_json = tmp_path / "x.json"
    rooted = coll in ("gather", "scatter")
    cmd = mpiexec(2) + [
        sys.executable, str(BENCH / "sweep.py"), coll,
        "-b", "8", "-e", "4K", "-f", "8", "-n", "3", "-w", "1", "-c", "1", "-r", "1",
        "--algorithm", "all", "--baselines", "mpi", "--timeout", "60", "--no-progress",
        "--hugepages", "off", "--json", str(out_json),
    ]  # fmt: skip
    proc = _run(cmd, 80)
    assert "skipped" not in proc.stdout, proc.stdout
    assert "Out of bounds values : 0 OK" in proc.stdout, proc.stdout
    assert f"# {coll}  dtype float32  op none  root {1 if rooted else -1}" in proc.stdout
    rows = _rows(proc.stdout)
    # size count type redop root | time algbw busbw #wrong mpi(us) xmpi | in place: "-"
    sizes = [8, 64, 512, 4096]
    algos = {"alltoall": 4, "gather": 4, "scatter": 4, "sendrecv": 1}[coll]  # auto + each
    assert len(rows) == len(sizes) * algos, proc.stdout
    for r in rows:
        size, count = int(r[0]), int(r[1])
        assert size in sizes and r[2] == "float" and r[3] == "none", r
        assert count == (size // 4 if coll == "sendrecv" else size // 4 // 2), r
        assert int(r[4]) == (1 if rooted else -1), r
        assert r[8] == "0" and r[9] != "skip", r  # #wrong, the MPI baseline's time
        assert set(r[11:17]) == {"-"}, r  # no in-place form
    recs = json.loads(out_json.read_text())["records"]
    assert {r["system"] for r in recs} == {"pycoll", "mpi"}
    assert all(r["wrong"] == 0 and not r["inplace"] and r["collective"] == coll for r in recs)
    factor = 1.0 if coll == "sendrecv" else 0.5
    assert all(r["busbw"] == pytest.approx(r["algbw"] * factor) for r in recs)
    assert all(r["algbw"] == pytest.approx(r["size"] / r["time_us"] / 1e3) for r in recs)


@pytest.mark.timeout(90)
def test_versus_alltoall_takes_turns_with_mpi_and_gloo(tmp_path: Path) -> None:
    gloo = importlib.util.find_spec("torch") is not None
    systems = ["auto", "pairwise", "mpi"] + ["gloo"] * gloo
    out_json = tmp_path / "v.json"
    cmd = mpiexec(2) + [
        sys.executable, str(BENCH / "versus.py"), "alltoall", "8", "4K",
        "--systems", ",".join(systems), "--rounds", "3", "--block-time", "0.002",
        "--settle", "0.02", "--json", str(out_json),
    ]  # fmt: skip
    proc = _run(cmd, 80)
    assert "Out of bounds values : 0 OK" in proc.stdout, proc.stdout
    assert "skipped" not in proc.stdout, proc.stdout
    rows = _rows(proc.stdout)
    assert [r[1] for r in rows] == systems * 2, proc.stdout
    assert [int(r[0]) for r in rows] == [8] * len(systems) + [4096] * len(systems)
    recs = json.loads(out_json.read_text())["records"]
    assert len(recs) == 2 * len(systems) * 3
    assert all(r["wrong"] == 0 and r["time_us"] > 0 for r in recs)
    assert {r["count"] for r in recs} == {1, 512}  # one block: size / n elements
    if gloo:  # only a block right after Gloo's settles
        assert not any(r["settled"] for r in recs if r["system"] == "gloo")


@pytest.mark.timeout(90)
def test_versus_pingpong_gives_time_and_bandwidth(tmp_path: Path) -> None:
    """Rank 0 to rank 1 and back; at n = 3 rank 2 idles; time is half the round
    trip and GB/s is size / time."""
    out_json = tmp_path / "p.json"
    cmd = mpiexec(3) + [
        sys.executable, str(BENCH / "versus.py"), "pingpong", "8", "64K",
        "--systems", "pycoll,mpi", "--rounds", "3", "--block-time", "0.002",
        "--json", str(out_json),
    ]  # fmt: skip
    proc = _run(cmd, 80)
    assert "Out of bounds values : 0 OK" in proc.stdout, proc.stdout
    assert "half the round trip" in proc.stdout
    rows = _rows(proc.stdout)
    # size system calls time(us) GB/s xpycoll p10 p90
    assert [(int(r[0]), r[1]) for r in rows] == [
        (8, "pycoll"),
        (8, "mpi"),
        (65536, "pycoll"),
        (65536, "mpi"),
    ], proc.stdout
    for r in rows:
        size, t, bw = int(r[0]), float(r[3]), float(r[4])
        assert t > 0 and bw == pytest.approx(size / t / 1e3, rel=0.01, abs=1e-3), r
    assert all(r[5] == "1.000" for r in rows if r[1] == "pycoll")
    recs = json.loads(out_json.read_text())["records"]
    assert len(recs) == 2 * 2 * 3 and all(r["wrong"] == 0 for r in recs)
    assert all(r["bw_GBps"] == pytest.approx(r["size"] / r["time_us"] / 1e3) for r in recs)


@pytest.mark.timeout(120)
def test_matrix_at_tiny_sizes(tmp_path: Path) -> None:
    out_json = tmp_path / "m.json"
    cmd = mpiexec(2) + [
        sys.executable, str(BENCH / "matrix.py"), "--sizes", "8,1K", "--rounds", "2",
        "--block-time", "0.002", "--json", str(out_json),
    ]  # fmt: skip
    proc = _run(cmd, 110)
    assert "Out of bounds values : 0 OK" in proc.stdout, proc.stdout
    colls = ("allreduce", "allgather", "broadcast", "reduce_scatter")
    table = proc.stdout.split("# MPI time / pycoll time")[1].split("\n", 1)[1]
    assert table.splitlines()[0].split()[1:] == ["collective", "8B", "1K"], table
    cells = {r[0]: r[1:] for r in _rows(table)}
    assert set(cells) == set(colls) and all(len(v) == 2 for v in cells.values()), table
    doc = json.loads(out_json.read_text())
    assert len(doc["matrix"]) == 8 and len(doc["records"]) == 8 * 2 * 2
    for c in doc["matrix"]:
        assert c["wrong"] == 0 and c["pycoll_us"] > 0 and c["mpi_us"] > 0
        assert c["ratio"] == pytest.approx(c["mpi_us"] / c["pycoll_us"])
        shown = cells[c["collective"]][[8, 1024].index(c["size_asked"])]
        assert float(shown) == pytest.approx(c["ratio"], abs=0.006)
        # each rank's share of huge pages (None where smaps cannot tell)
        fr = c["hugepage_frac"]
        assert len(fr) == 2 and all(f is None or 0 <= f <= 1 for f in fr), fr


@pytest.mark.timeout(120)
def test_matrix_of_every_collective_at_n3(tmp_path: Path) -> None:
    """``--collectives all``: the rooted and personalized collectives too (gather's
    output and scatter's input on the root alone), each checked against NumPy."""
    out_json = tmp_path / "m.json"
    cmd = mpiexec(3) + [
        sys.executable, str(BENCH / "matrix.py"), "--sizes", "8,1K", "--rounds", "2",
        "--block-time", "0.002", "--collectives", "all", "--json", str(out_json),
    ]  # fmt: skip
    proc = _run(cmd, 110)
    assert "Out of bounds values : 0 OK" in proc.stdout, proc.stdout
    doc = json.loads(out_json.read_text())
    colls = {c["collective"] for c in doc["matrix"]}
    assert len(doc["matrix"]) == 16 and len(colls) == 8, colls
    assert {"reduce", "alltoall", "gather", "scatter"} <= colls
    assert all(c["wrong"] == 0 and c["pycoll_us"] > 0 for c in doc["matrix"])


@pytest.mark.timeout(150)
def test_matrix_against_gloo_checks_its_outputs_too(tmp_path: Path) -> None:
    """``--gloo``: torch.distributed's Gloo as a third system on the same arrays,
    every collective checked against NumPy (its allreduce and reduce work in
    place, on arrays of their own), with its own table and ratio."""
    if importlib.util.find_spec("torch") is None:
        pytest.skip("torch is not installed")
    out_json = tmp_path / "m.json"
    cmd = mpiexec(3) + [
        sys.executable, str(BENCH / "matrix.py"), "--sizes", "8,1K", "--rounds", "2",
        "--block-time", "0.002", "--settle", "0", "--collectives", "all", "--gloo",
        "--json", str(out_json),
    ]  # fmt: skip
    proc = _run(cmd, 140)
    assert "Out of bounds values : 0 OK" in proc.stdout, proc.stdout
    assert "# Gloo time / pycoll time, n = 3" in proc.stdout, proc.stdout
    doc = json.loads(out_json.read_text())
    assert len(doc["matrix"]) == 16
    assert {r["system"] for r in doc["records"]} == {"pycoll", "mpi", "gloo"}
    for c in doc["matrix"]:
        assert c["wrong"] == 0 and c["gloo_us"] > 0, c
        assert c["ratio_gloo"] == pytest.approx(c["gloo_us"] / c["pycoll_us"])


@pytest.mark.parametrize(
    "args, said",
    [
        (["--gloo", "--persistent"], "one at a time"),
        (["--persistent", "--collectives", "alltoall"], "the first five collectives"),
    ],
)
def test_matrix_refuses_what_it_cannot_time(args: list[str], said: str) -> None:
    """Refused before any rank starts (argparse): Gloo has no persistent calls,
    and MPI none of alltoall, gather or scatter."""
    cmd = [sys.executable, str(BENCH / "matrix.py"), *args]
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and said in proc.stderr, proc.stderr


@pytest.mark.timeout(120)
def test_matrix_persistent_times_prepared_calls_against_both_mpi_forms(tmp_path: Path) -> None:
    """``--persistent``: pycoll's prepared calls against MPI's plain and persistent
    calls, each checked against NumPy (no wrong element), with both tables."""
    out_json = tmp_path / "m.json"
    cmd = mpiexec(2) + [
        sys.executable, str(BENCH / "matrix.py"), "--sizes", "8,1K", "--rounds", "2",
        "--block-time", "0.002", "--collectives", "allreduce,broadcast",
        "--persistent", "--json", str(out_json),
    ]  # fmt: skip
    proc = _run(cmd, 110)
    assert "Out of bounds values : 0 OK" in proc.stdout, proc.stdout
    assert "# MPI persistent time / pycoll prepared time" in proc.stdout, proc.stdout
    doc = json.loads(out_json.read_text())
    assert len(doc["matrix"]) == 4 and len(doc["records"]) == 4 * 4 * 2
    systems = {r["system"] for r in doc["records"]}
    assert systems == {"pycoll-prepared", "pycoll", "mpi", "mpi-persistent"}, systems
    for c in doc["matrix"]:
        assert c["wrong"] == 0 and c["pycoll_us"] > 0 and c["mpi_persistent_us"] > 0
        assert c["pycoll_plain_us"] > 0


@pytest.mark.timeout(120)
@pytest.mark.parametrize("coll", ["allreduce", "broadcast"])
def test_replay_layers_times_each_layer_of_a_replayed_call(coll: str) -> None:
    cmd = mpiexec(2) + [
        sys.executable, str(BENCH / "replay_layers.py"), coll, "--calls", "200", "--repeats", "2",
    ]  # fmt: skip
    proc = _run(cmd, 110)
    rows = [ln.rsplit(None, 2) for ln in proc.stdout.splitlines() if ln.endswith(" us")]
    names = [r[0].strip() for r in rows]
    assert names == ["mpi", f"comm.{coll}", "prepared", "Engine.replay", "plan.go (step)",
                     "mpi again"], proc.stdout  # fmt: skip
    assert all(float(r[1]) > 0 for r in rows), proc.stdout


@pytest.mark.timeout(120)
def test_fresh_arrays_checks_and_times_every_collective() -> None:
    """benchmarks/fresh_arrays.py at n = 3 and an odd size: every collective's
    output right on both systems, and a time for each."""
    cmd = mpiexec(3) + [
        sys.executable, str(BENCH / "fresh_arrays.py"), "--sizes", "8,4099", "--rounds", "2",
        "--block-time", "0.002",
    ]  # fmt: skip
    proc = _run(cmd, 110)
    rows = [ln.split() for ln in proc.stdout.splitlines() if " pycoll " in ln]
    colls = ("allreduce", "reduce_scatter", "allgather", "broadcast")
    assert sorted((r[0], r[1]) for r in rows) == sorted(
        (c, s) for c in colls for s in ("8B", "4.0K")
    ), proc.stdout
    for r in rows:
        assert r[-1] == "0" and float(r[3]) > 0 and float(r[6]) > 0, r


@pytest.mark.timeout(120)
def test_allgather_floor_checks_and_times_every_order() -> None:
    """benchmarks/allgather_floor.py at n = 3 and an odd size over two pieces:
    every system's output right, and a time for each."""
    cmd = mpiexec(3) + [
        sys.executable, str(BENCH / "allgather_floor.py"), "--sizes", "1572876", "--rounds", "2",
        "--block-time", "0.002",
    ]  # fmt: skip
    proc = _run(cmd, 110)
    rows = [ln for ln in proc.stdout.splitlines() if ln.startswith("n = 3 allgather")]
    assert len(rows) == 1 and rows[0].endswith("wrong 0"), proc.stdout
    for name in ("two-pass-write", "two-pass-read", "one-pass", "pycoll", "mpi"):
        assert f"{name} " in rows[0], rows[0]


def _layout_rows(n: int, script: str, prefix: str, *args: str) -> list[str]:
    """The rows starting with ``prefix`` that ``script`` prints at ``n`` ranks,
    each with every rank's output right (``wrong 0``)."""
    proc = _run(mpiexec(n) + [sys.executable, str(BENCH / script), *args], 110)
    rows = [ln for ln in proc.stdout.splitlines() if ln.startswith(prefix)]
    assert rows and all(r.endswith("wrong 0") for r in rows), proc.stdout
    return rows


@pytest.mark.timeout(120)
def test_allgather_layout_times_each_gap_and_checks_the_output() -> None:
    """benchmarks/allgather_layout.py at n = 2 on small blocks: a row a gap, a
    time for each algorithm, and every rank's output right."""
    args = ("--block", "1M", "--gaps", "16,4K", "--calls", "2", "--turns", "1")
    rows = _layout_rows(2, "allgather_layout.py", "gap ", *args)
    assert len(rows) == 2 and all(" direct " in r and " ring " in r for r in rows), rows


@pytest.mark.timeout(120)
def test_broadcast_offsets_times_each_pair_and_checks_the_readers() -> None:
    """benchmarks/broadcast_offsets.py at n = 3 on a small buffer: a row a pair of
    offsets, a time for pycoll and MPI, and every reader's buffer right."""
    args = ("--bytes", "300K", "--offsets", "0:0,0:16", "--calls", "3", "--turns", "1")
    rows = _layout_rows(3, "broadcast_offsets.py", "root ", *args)
    assert len(rows) == 2 and all(" pycoll " in r and " mpi " in r for r in rows), rows
