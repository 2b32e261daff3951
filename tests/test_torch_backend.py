"""pycoll as a torch.distributed backend: DDP over pycoll vs DDP over Gloo.

tests/torchdist/ddp_train.py runs under ``mpiexec -n 2``: it checks every
collective of the backend, then trains the same model with DDP on a pycoll
group and on a Gloo group (same seed, same shards).  With two ranks every
allreduce is one addition of two float32 values, which is commutative, so
both backends must produce bitwise-identical weights (tolerance: zero).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from tests.launch import mpiexec, reports
from tests.netns import run_command

pytest.importorskip(
    "torch", reason="torch is not installed (pip install 'pycoll-collectives[torch]')"
)

ROOT = Path(__file__).resolve().parent.parent


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _python(code: str, timeout: float) -> subprocess.CompletedProcess[str]:
    """Run ``code`` in a fresh interpreter (one rank, no launcher) on this tree."""
    return subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_import_pycoll_does_not_import_torch() -> None:
    code = "import sys, pycoll; assert 'torch' not in sys.modules, 'pycoll imported torch'"
    proc = _python(code, 60)
    assert proc.returncode == 0, proc.stderr


@pytest.mark.timeout(240)
def test_ddp_pycoll_matches_gloo(tmp_path: Path) -> None:
    out = tmp_path / "ddp.json"
    cmd = mpiexec(2) + [
        sys.executable,
        "-m",
        "mpi4py",
        str(ROOT / "tests" / "torchdist" / "ddp_train.py"),
        "--steps",
        "5",
        "--out",
        str(out),
    ]
    env = dict(
        os.environ, PYTHONPATH=str(ROOT), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port())
    )
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=220)
    assert proc.returncode == 0, (
        f"rc={proc.returncode}\n{proc.stdout[-4000:]}\n{proc.stderr[-6000:]}"
    )
    res = json.loads(out.read_text())
    assert res["replicas_identical"], res
    assert res["identical"], f"DDP over pycoll differs from DDP over gloo: {res}"
    assert res["max_abs_diff"] == 0.0, res


@pytest.mark.timeout(120)
def test_rank_mismatch_is_a_clear_error() -> None:
    """One process under mpiexec (MPI world of 1) that claims to be rank 1 of 2 must
    be refused."""
    code = (
        "import torch.distributed as dist, pycoll.torch_backend as tb\n"
        "tb.register()\n"
        "store = dist.HashStore()\n"
        "try:\n"
        "    dist.init_process_group('pycoll', store=store, rank=1, world_size=2)\n"
        "except RuntimeError as e:\n"
        "    assert 'mpiexec' in str(e) and 'rank 1 of 2' in str(e), e\n"
        "    print('refused:', e)\n"
        "else:\n"
        "    raise SystemExit('accepted a rank that MPI does not have')\n"
    )
    proc = subprocess.run(
        mpiexec(1) + [sys.executable, "-c", code],
        cwd=ROOT,
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
        capture_output=True,
        text=True,
        timeout=100,
    )
    assert proc.returncode == 0, f"{proc.stdout}\n{proc.stderr[-4000:]}"
    assert "refused" in proc.stdout


@pytest.mark.timeout(180)
def test_bitwise_ops_and_new_dtypes() -> None:
    """BAND, BOR, BXOR and bool, int16, uint16, complex all_reduce at n = 2, through
    torch.distributed (tests/torchdist/ops_dtypes.py)."""
    cmd = mpiexec(2) + [
        sys.executable,
        "-m",
        "mpi4py",
        str(ROOT / "tests" / "torchdist" / "ops_dtypes.py"),
    ]
    env = dict(
        os.environ, PYTHONPATH=str(ROOT), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port())
    )
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=160)
    assert proc.returncode == 0, (
        f"rc={proc.returncode}\n{proc.stdout[-4000:]}\n{proc.stderr[-6000:]}"
    )
    assert proc.stdout.count("ok") == 2, proc.stdout


# ----------------------------------------------------------------------------- failures
FAILURES = ROOT / "tests" / "torchdist" / "failures.py"
#: init_process_group's timeout in the failure scenarios (seconds)
TIMEOUT = 4
#: how long past the timeout a rank may take to raise: pycoll's status exchange
#: (grace_for) and the launch on a loaded two-core machine
SLACK = 10


def _failure(name: str, tmp_path: Path, **env: str) -> dict[int, dict]:
    """Run one scenario of tests/torchdist/failures.py at n = 2; each rank's outcome."""
    out: dict[int, dict] = {}
    for attempt in range(3):  # hydra now and then kills the survivors of a dead rank
        d = tmp_path / str(attempt)
        d.mkdir()
        cmd = mpiexec(2)
        cmd[1:1] = ["-disable-auto-cleanup"]
        cmd += [sys.executable, str(FAILURES), name, str(d)]
        e = dict(
            os.environ,
            PYTHONPATH=str(ROOT),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(_free_port()),
            FAILURES_TIMEOUT=str(TIMEOUT),
            **env,
        )
        proc = _run_scenario(cmd, e, d)
        out = {
            r: json.loads((d / f"rank{r}.json").read_text())
            for r in range(2)
            if (d / f"rank{r}.json").exists()
        }
        if 0 in out:
            return out
    logs = "\n".join(p.read_text()[-3000:] for p in sorted(tmp_path.glob("*/rank*.log")))
    raise AssertionError(
        f"rank 0 did not report (rc={proc.returncode})\n{proc.stderr[-2000:]}\n{logs}"
    )


def _run_scenario(
    cmd: list[str], env: dict[str, str], d: Path, limit: float = 150.0
) -> subprocess.CompletedProcess:
    """Run the launcher; one that has not ended after ``limit`` seconds (every
    scenario bounds its waits well below that) is killed with its ranks, each
    live rank first made to write its threads' stacks to its log (faulthandler,
    SIGABRT), so that the test's failure shows where it was.  What the ranks
    reported before stands: a launcher that outlives ranks that reported is not
    pycoll's."""

    def dump_stacks() -> None:
        for pid_file in d.glob("rank*.pid"):
            with contextlib.suppress(ProcessLookupError, ValueError):
                os.kill(int(pid_file.read_text()), signal.SIGABRT)
        time.sleep(1.0)

    try:
        return run_command(cmd, env=env, timeout=limit, cwd=str(ROOT), before_kill=dump_stacks)
    except subprocess.TimeoutExpired as exc:
        err = f"the launcher had not ended after {limit:g} s; killed\n{exc.stderr or ''}"
        return subprocess.CompletedProcess(cmd, -signal.SIGKILL, exc.output, err)


def _raised(o: dict, error: str, within: float) -> None:
    assert o["error"] == error, o
    assert o["runtime_error"], f"{error} is not a RuntimeError for torch: {o}"
    assert o["pycoll_error"], o
    assert o["elapsed"] < within, f"raised after {o['elapsed']:.1f} s, not within {within} s"


@pytest.mark.timeout(300)
@pytest.mark.parametrize("case", ["count", "dtype"])
def test_mismatched_calls_raise_on_every_rank(tmp_path: Path, case: str) -> None:
    """4 against 6 elements, float32 against float64: both ranks raise, the next call
    too.  Cross-rank mismatches need pycoll's check (PYCOLL_CHECK=1)."""
    res = _failure(case, tmp_path, PYCOLL_CHECK="1")
    assert set(res) == {0, 1}, res
    for r, o in res.items():
        _raised(o, "CollectiveMismatchError", SLACK)
        assert f"rank {r}:" in o["message"] and case in o["message"], o
        assert o["then"]["error"] == "CommunicatorClosedError", o


@pytest.mark.timeout(300)
@pytest.mark.parametrize("case", ["missing", "missing-wait", "missing-barrier"])
def test_missing_peer_raises_within_the_timeout(tmp_path: Path, case: str) -> None:
    """A peer that never calls: dist.all_reduce, work.wait() and dist.barrier raise
    CollectiveTimeout naming rank 1 within init_process_group's timeout (4 s)."""
    o = _failure(case, tmp_path)[0]
    _raised(o, "CollectiveTimeout", TIMEOUT + SLACK)
    assert o["elapsed"] >= TIMEOUT - 0.5, o
    assert "[1]" in o["message"], o
    assert o["value"] == [1.0] * 4, o


@pytest.mark.timeout(300)
def test_wait_with_a_timeout_raises_at_that_timeout(tmp_path: Path) -> None:
    o = _failure("missing-wait-timeout", tmp_path)[0]
    _raised(o, "CollectiveTimeout", 1 + SLACK)
    assert o["elapsed"] < TIMEOUT, o
    assert "still running after wait(timeout=1 s)" in o["message"], o


@pytest.mark.timeout(300)
def test_missing_peer_honours_pycoll_timeout(tmp_path: Path) -> None:
    """With torch's default timeout, PYCOLL_TIMEOUT bounds the collective."""
    o = _failure("missing-env", tmp_path, PYCOLL_TIMEOUT=str(TIMEOUT))[0]
    _raised(o, "CollectiveTimeout", TIMEOUT + SLACK)


@pytest.mark.timeout(300)
def test_missing_peer_fails_the_future(tmp_path: Path) -> None:
    """work.get_future().wait() raises (torch wraps the callback's error in a RuntimeError)."""
    o = _failure("missing-future", tmp_path)[0]
    assert o["error"] == "RuntimeError", o
    assert "CollectiveTimeout" in o["message"], o
    assert o["elapsed"] < TIMEOUT + SLACK, o


@pytest.mark.timeout(300)
def test_peer_that_exits_is_reported(tmp_path: Path) -> None:
    """A peer exits: the next all_reduce raises PeerAbortedError, the one after too."""
    o = _failure("exits", tmp_path)[0]
    _raised(o, "PeerAbortedError", SLACK)
    assert o["value"] == [1.0] * 4, o
    assert o["then"]["error"] == "CommunicatorClosedError", o
    assert o["destroy_s"] < SLACK, o


@pytest.mark.timeout(300)
def test_peer_killed_during_ddp_backward_raises(tmp_path: Path) -> None:
    """A peer killed in a DDP backward: the survivor's backward raises, no segfault."""
    o = _failure("ddp-dies", tmp_path)[0]
    assert o["error"] == "RuntimeError", o
    assert "PeerAbortedError" in o["message"] or "CollectiveTimeout" in o["message"], o
    assert o["elapsed"] < TIMEOUT + SLACK, o


@pytest.mark.timeout(300)
def test_monitored_barrier_names_the_missing_rank(tmp_path: Path) -> None:
    o = _failure("missing-monitored", tmp_path)[0]
    _raised(o, "CollectiveTimeout", 2 + SLACK)
    assert "Rank 1 failed to pass monitoredBarrier in 2000 ms" in o["message"], o


# ----------------------------------------------------------------------------- one rank
SINGLE = r"""
import json, torch, torch.distributed as dist
import pycoll, pycoll.torch_backend as tb
tb.register()
dist.init_process_group("pycoll", store=dist.HashStore(), rank=0, world_size=1)
out = {}
def raised(name, fn):
    try:
        fn()
        out[name] = None
    except Exception as e:
        out[name] = [type(e).__name__, isinstance(e, pycoll.UnsupportedError), isinstance(e, RuntimeError), str(e)]
t = torch.arange(4.0)
g = [torch.empty(4)]
dist.gather(t, g, dst=0)
s = torch.empty(4)
dist.scatter(s, [t + 1], src=0)
a = torch.empty(4)
dist.all_to_all_single(a, t + 2)
b = [torch.empty(4)]
dist.all_to_all([b[0]], [t + 3])
out["ops"] = [g[0].tolist(), s.tolist(), a.tolist(), b[0].tolist()]
raised("premul", lambda: dist.all_reduce(t, op=dist._make_nccl_premul_sum(2.0)))
pg = dist.distributed_c10d._get_default_group()
raised("merge_remote_group", lambda: pg.merge_remote_group(dist.HashStore(), 1, __import__("datetime").timedelta(1)))
raised("_get_backend", lambda: pg._get_backend(torch.device("cpu")))
out["name"], out["desc"] = pg.group_name, pg.group_desc
sub = dist.new_group([0], backend="pycoll")
out["sub_name"] = sub.group_name
dist.destroy_process_group(sub)
# the tensors' storage stays resizable (FSDP frees and regrows it)
t = torch.ones(8)
dist.all_reduce(t)
dist.broadcast(t, 0)
t.untyped_storage().resize_(0)
t.untyped_storage().resize_(32)
out["resized"] = True
work = dist.all_reduce(torch.ones(2), async_op=True)
out["work"] = [work.wait(), work.is_completed(), work.is_success(), work.exception() is None]
tb.monitored_barrier()
print(json.dumps(out))
dist.destroy_process_group()
"""


@pytest.mark.timeout(120)
def test_one_rank_group_names_errors_and_storage() -> None:
    """At n = 1 (no launcher): gather, scatter and the all_to_alls give their input;
    unsupported operations raise UnsupportedError naming the operation and what to
    use instead (a RuntimeError for torch); the group has its name; storage stays
    resizable."""
    proc = _python(SINGLE, 100)
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["ops"] == [[0, 1, 2, 3], [1, 2, 3, 4], [2, 3, 4, 5], [3, 4, 5, 6]], out["ops"]
    for op, said, instead in [
        ("merge_remote_group", "merge_remote_group", "gloo"),
        ("_get_backend", "_get_backend(cpu)", "its own backend"),
    ]:
        name, unsupported, runtime, msg = out[op]
        assert (name, unsupported, runtime) == ("UnsupportedError", True, True), out[op]
        assert f"rank 0: {said}" in msg and "is not supported" in msg, msg
        assert instead in msg.lower(), msg
    name, unsupported, _, msg = out["premul"]
    assert unsupported and "reduce op PREMUL_SUM is not supported" in msg and "0x" not in msg, msg
    assert "BAND" in msg, msg  # the ops pycoll offers, by name
    assert out["name"] == "0" and out["desc"] == "default_pg", out
    assert out["sub_name"], out
    assert out["resized"] and out["work"] == [True, True, True, True], out


# ----------------------------------------------------------------------------- sharded training
SHARDED = ROOT / "tests" / "torchdist" / "sharded_train.py"


def _sharded(backend: str, tmp_path: Path) -> dict:
    out = tmp_path / f"{backend}.json"
    cmd = mpiexec(2) + [sys.executable, "-m", "mpi4py", str(SHARDED), "--backend", backend]
    cmd += ["--out", str(out)]
    env = dict(
        os.environ,
        PYTHONPATH=str(ROOT),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(_free_port()),
        SHARDED_CKPT=str(tmp_path / f"ckpt-{backend}"),
    )
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=250)
    assert out.exists(), f"rc={proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    return json.loads(out.read_text())


@pytest.mark.timeout(600)
def test_fsdp2_fsdp1_device_mesh_match_gloo(tmp_path: Path) -> None:
    """DeviceMesh/DTensor (distribute_tensor scatters), FSDP2 (fully_shard), FSDP1 and
    a DCP save and load (which gathers) on CPU at n = 2: the same losses as over Gloo."""
    gloo = _sharded("gloo", tmp_path)
    mine = _sharded("pycoll", tmp_path)
    for part in ("mesh", "fsdp2", "fsdp1", "dcp"):
        assert "losses" in mine[part], (part, mine[part])
        assert mine[part]["losses"] == gloo[part]["losses"], (part, mine[part], gloo[part])


LAUNCH = str(ROOT / "tests" / "torchdist" / "launch_allreduce.py")


def _bare_env() -> dict[str, str]:
    """The environment without torch's rendezvous variables."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    }
    env["PYTHONPATH"] = str(ROOT)
    return env


@pytest.mark.timeout(120)
def test_torchrun_launch_bootstraps_from_torchs_store() -> None:
    """torchrun, no MPI: the backend bootstraps over the store torch hands it."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    proc = subprocess.run(
        [*cmd, LAUNCH], cwd=ROOT, env=_bare_env(), capture_output=True, text=True, timeout=100
    )
    res = reports(proc.stdout)
    assert set(res) == {0, 1}, f"rc={proc.returncode}\n{proc.stdout}\n{proc.stderr[-4000:]}"
    for o in res.values():
        assert o["sum"] == [1.0, 3.0, 5.0, 7.0] and o["sub"] == [2.0, 2.0, 2.0], o
        assert o["mpi4py"] is False, "the torchrun launch imported mpi4py"


@pytest.mark.timeout(120)
def test_mpiexec_launch_needs_neither_rank_nor_master_addr() -> None:
    proc = subprocess.run(
        mpiexec(3) + [sys.executable, LAUNCH],
        cwd=ROOT,
        env=_bare_env(),
        capture_output=True,
        text=True,
        timeout=100,
    )
    res = reports(proc.stdout)
    assert set(res) == {0, 1, 2}, f"rc={proc.returncode}\n{proc.stdout}\n{proc.stderr[-4000:]}"
    for r, o in res.items():
        assert o["env"] == {"RANK": None, "MASTER_ADDR": None}, o
        assert o["size"] == 3 and o["sum"] == [3.0, 6.0, 9.0, 12.0], o
        assert o["sub"] == ([2.0] * 3 if r < 2 else [1.0] * 3), o


def test_work_future_whenever_asked() -> None:
    """A Work's future completes with the outputs whether it is asked for before
    or after the call ran, and fails in C++ (torch's RuntimeError) on an error;
    no future is made for a call nobody asks one of."""
    import torch

    from pycoll.errors import PeerAbortedError
    from pycoll.torch_backend.work import Busy, Work

    def work() -> Work:
        return Work("allreduce", 0, 10.0, Busy())

    after = work()
    after._run(lambda: [torch.ones(2)])
    assert after._head is None and after.is_completed()
    assert after.get_future().wait()[0].tolist() == [1.0, 1.0]
    assert after.get_future() is after.get_future()

    before = work()
    fut = before.get_future()
    assert not fut.done()
    before._run(lambda: [torch.full((2,), 3.0)])
    assert fut.wait()[0].tolist() == [3.0, 3.0]

    def fails() -> None:
        raise PeerAbortedError("rank 1 exited", rank=0)

    for ask_first in (True, False):
        bad = work()
        early = bad.get_future() if ask_first else None
        bad._run(fails)
        with pytest.raises(RuntimeError, match="rank 1 exited"):
            (early or bad.get_future()).wait()
        with pytest.raises(PeerAbortedError):
            bad.wait()


def test_lane_runs_a_call_here_only_when_it_would_be_next() -> None:
    """``Lane.run_here`` runs a call on the caller's thread only while nothing is
    queued, running or posted, so calls keep their program order: while the
    worker runs one job and another waits behind it, a third is refused (and
    queued, it runs last); once the lane is idle it runs here, on this thread."""
    import threading

    from pycoll.torch_backend.work import Busy, Posted, Work
    from pycoll.torch_backend.worker import Lane

    lane = Lane("test-lane").join()
    order: list[tuple[str, str]] = []
    release = threading.Event()

    def job(name: str, block: bool = False) -> Any:
        def run() -> list[Any]:
            if block:
                assert release.wait(10)
            order.append((name, threading.current_thread().name))
            return []

        return run

    def work(name: str) -> Work:
        return Work(name, 0, 10.0, Busy())

    try:
        first, second, third = work("first"), work("second"), work("third")
        lane.put(job("first", block=True), first)
        lane.put(job("second"), second)
        assert not lane.run_here(job("third"), third)  # two ahead of it
        lane.put(job("third"), third)
        release.set()
        for w in (first, second, third):
            assert w.wait()
        assert [n for n, _ in order] == ["first", "second", "third"]
        assert {t for _, t in order} == {"test-lane"}
        assert lane.pending == 0

        here = work("here")
        assert lane.run_here(job("here"), here)
        assert here.is_completed() and order[-1] == ("here", threading.current_thread().name)

        # a posted point-to-point call keeps the caller off the thread too
        never = threading.Event()
        lane.posted.append((Posted(type("R", (), {"test": never.is_set})(), list), work("p2p")))
        assert not lane.run_here(job("late"), work("late"))
        lane.posted.clear()

        # a call run here that posts is progressed by the thread, which was asleep
        done = threading.Event()
        request = type("R", (), {"test": done.is_set, "wait": lambda self: True})()
        posts = work("posts")
        assert lane.run_here(lambda: Posted(request, lambda: ["out"]), posts)
        assert not posts.is_completed()
        done.set()
        assert posts.wait() and posts.result() == ["out"]
    finally:
        lane.leave()


def test_a_mirror_whose_copy_never_ends_is_held_not_handed_back(caplog) -> None:
    """The mirrors' copies go through the driver, which torch's host allocator
    does not see: a mirror dropped at shutdown (or from a full free list) goes
    back to torch only once its last copy is done.  One whose copy does not end
    within the group's timeout stays held, and a warning says so; one whose copy
    ended is let go."""
    import logging
    from types import SimpleNamespace

    import torch

    from pycoll.torch_backend.mirrors import Mirrors

    mirrors = Mirrors(SimpleNamespace(rank=1), 0.05)
    asked: list[str] = []

    def done(event: str) -> bool:
        asked.append(event)
        return event == "ended"

    mirrors._cu = SimpleNamespace(done=done)  # type: ignore[assignment]
    ended = SimpleNamespace(copied="ended", host=SimpleNamespace(nbytes=32))
    stuck = SimpleNamespace(copied="stuck", host=SimpleNamespace(nbytes=64))
    mirrors._free = {(8, torch.float32): [ended], (16, torch.float32): [stuck]}  # type: ignore[dict-item]
    with caplog.at_level(logging.WARNING, logger="pycoll.torch_backend.mirrors"):
        mirrors.clear()
    assert mirrors._stuck == [stuck]
    assert "ended" in asked and asked.count("stuck") > 1  # polled until the timeout
    assert "rank 1" in caplog.text and "64 bytes" in caplog.text, caplog.text
    assert mirrors._free == {}


def test_lane_lets_a_mirrored_call_queue_work_ahead_only_past_other_mirrored_calls() -> None:
    """``Lane.ahead_clear``: a mirrored allreduce may queue its copy in from the
    caller's thread only while every job queued or running is a mirrored
    allreduce (:mod:`pycoll.torch_backend.mirrors`) that will queue no more work
    in the caller's memory: never behind a job of another kind or a posted call,
    nor on memory a queued mirrored call has yet to write back, and again once
    that call has written it back."""
    import threading

    from pycoll.torch_backend.work import Busy, Posted, Work
    from pycoll.torch_backend.worker import Lane

    lane = Lane("test-lane").join()
    release = threading.Event()

    def work(name: str) -> Work:
        return Work(name, 0, 10.0, Busy())

    try:
        assert lane.ahead_clear(0, 100)  # idle
        first = work("first")

        def run_first() -> list[Any]:
            assert release.wait(10)
            lane.mirrored_done(first)
            return []

        lane.put_mirrored(run_first, first, (1000, 2000))
        assert lane.ahead_clear(0, 1000) and lane.ahead_clear(2000, 3000)  # beside it
        for lo, hi in ((999, 1001), (1500, 1600), (1999, 2500), (0, 5000)):
            assert not lane.ahead_clear(lo, hi), (lo, hi)  # on memory it writes back
        other = work("other")
        lane.put(lambda: [], other)  # a job of another kind behind it
        assert not lane.ahead_clear(0, 100)
        release.set()
        assert first.wait() and other.wait()
        end = threading.Event()
        while lane.pending:  # the thread counts a job done just after completing it
            end.wait(0.001)
        assert lane.ahead_clear(1000, 2000) and lane.mirrored == {}
        lane.posted.append((Posted(type("R", (), {"test": end.is_set})(), list), work("p2p")))
        assert not lane.ahead_clear(0, 100)
        lane.posted.clear()
    finally:
        lane.leave()


SYNC_HERE = r"""
import json, threading, torch, torch.distributed as dist
import pycoll.torch_backend as tb
from pycoll.torch_backend.work import Work
tb.register()
dist.init_process_group("pycoll", store=dist.HashStore(), rank=0, world_size=1)
pg = dist.distributed_c10d._get_default_group()
ran = []
real = pg.communicator.allreduce
def spy(*a, **k):
    ran.append(threading.current_thread().name)
    return real(*a, **k)
pg.communicator.allreduce = spy
sync, asyn = dist.AllreduceOptions(), dist.AllreduceOptions()
sync.asyncOp, asyn.asyncOp = False, True
out = {}
t = torch.ones(3)
w = pg.allreduce([t], sync)
out["sync_done_at_return"] = w.is_completed()
w = pg.allreduce([t], asyn)
w.wait()
# a job in the way: the synchronous call queues behind it and runs after it
release, order = threading.Event(), []
def blocker():
    release.wait(10)
    order.append("blocker")
    return []
pg._lane.put(blocker, Work("blocker", 0, 10.0, pg._lane.busy))
w = pg.allreduce([t], sync)
out["queued_done_early"] = w.is_completed()
release.set()
w.wait()
order.append("sync")
out["order"] = order
out["threads"] = ran
out["value"] = t.tolist()
print(json.dumps(out))
dist.destroy_process_group()
"""


@pytest.mark.timeout(120)
def test_a_synchronous_call_runs_on_the_callers_thread_when_the_worker_is_idle() -> None:
    """A synchronous call (``async_op=False``: torch waits at once) runs on the
    caller's thread when the group's worker is idle, and is done when it
    returns; an asynchronous host call goes to the worker; a synchronous call
    behind a running job queues and runs after it, on the worker (n = 1)."""
    proc = _python(SYNC_HERE, 100)
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["sync_done_at_return"] and not out["queued_done_early"], out
    assert out["order"] == ["blocker", "sync"], out
    main, worker, queued = out["threads"]
    assert main == "MainThread" and worker != "MainThread" and queued == worker, out
    assert out["value"] == [1.0, 1.0, 1.0], out
