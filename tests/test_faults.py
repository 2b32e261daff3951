"""Faults under mpiexec: a killed rank, a rank that never arrives, abort(), PYCOLL_CHECK.

Each scenario (tests/faults/scenario.py) runs under ``mpiexec
-disable-auto-cleanup`` so that the survivors of a killed rank keep running;
every rank writes its outcome to a JSON file that the test then judges.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.launch import mpiexec, reports

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "tests" / "faults" / "scenario.py"

pytestmark = pytest.mark.skipif(
    "openmpi" in os.path.realpath(mpiexec(1)[0]).lower(), reason="needs MPICH's hydra"
)


def run(name: str, n: int, tmp_path: Path, **env: str) -> dict[int, dict]:
    cmd = mpiexec(n)
    cmd[1:1] = ["-disable-auto-cleanup"]
    cmd += [sys.executable, str(SCRIPT), name, str(tmp_path)]
    e = dict(os.environ, PYTHONPATH=str(ROOT), **env)
    e.pop("PYCOLL_TRANSPORT", None)
    # (MPICH's segments that a killed rank leaves: tests/conftest.py removes them)
    proc = subprocess.run(cmd, cwd=ROOT, env=e, capture_output=True, text=True, timeout=150)
    out = {}
    for r in range(n):
        p = tmp_path / f"rank{r}.json"
        if p.exists():
            out[r] = json.loads(p.read_text())
    assert out, (
        f"no rank reported (rc={proc.returncode})\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    )
    return out


def assert_clean(res: dict) -> None:
    assert res["threads"] == [], res["threads"]
    assert res["sockets"] == [], res["sockets"]
    assert res["new_fds"] == {}, res["new_fds"]
    assert res["segments"] == [], res["segments"]


def run_kill(transport: str, n: int, victim: int, tmp_path: Path) -> dict[int, dict]:
    """The kill scenario (rank ``victim`` dies mid-loop) at ``n`` ranks: every report.

    Hydra, even with -disable-auto-cleanup, now and then kills the survivors
    shortly after a rank dies; try again before judging.
    """
    res: dict[int, dict] = {}
    for attempt in range(4):
        d = tmp_path / str(attempt)
        d.mkdir()
        try:
            res = run(f"kill-{transport}", n, d, SCENARIO_VICTIM=str(victim))
        except AssertionError:
            continue
        if set(range(n)) - {victim} <= set(res):
            break
    return res


@pytest.mark.timeout(180)
@pytest.mark.parametrize("transport", ["shm", "tcp", "direct"])  # direct: the group segment
def test_killed_rank_is_reported_fast(tmp_path, transport):
    res = run_kill(transport, 3, 1, tmp_path)
    assert 1 not in res, "the victim survived"
    for r in (0, 2):
        o = res[r]
        assert o["error"] in ("PeerAbortedError", "CollectiveTimeout"), o
        assert o["elapsed"] < 15, f"rank {r} took {o['elapsed']:.1f}s to notice (timeout is 60s)"
        assert o["peer"] is not None
        assert o["recorder"] and "failed" in o["recorder"][-1]
        assert_clean(o)
    # a direct neighbour of the victim names it
    assert any(res[r]["peer"] == 1 for r in (0, 2)), res


@pytest.mark.timeout(180)
def test_killed_rank_mid_point_to_point_is_reported_fast_and_nothing_wrong_lands(tmp_path):
    """Rank 1 dies while the two ping-pong 8 MiB messages (shm copies them from
    both ends): rank 0 raises PeerAbortedError within seconds, and every
    message it received before was whole."""
    res: dict[int, dict] = {}
    for attempt in range(4):  # (hydra now and then takes the survivor down too)
        d = tmp_path / str(attempt)
        d.mkdir()
        try:
            res = run("kill-p2p", 2, d, SCENARIO_VICTIM="1")
        except AssertionError:
            continue
        if 0 in res:
            break
    assert 1 not in res, "the victim survived"
    o = res[0]
    assert o["error"] == "PeerAbortedError", o
    assert o["elapsed"] < 15, o
    assert o["wrong"] == 0 and o["right"] > 0, o
    assert_clean(o)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("how", ["raise", "exit"])
@pytest.mark.parametrize("transport", ["shm", "direct", "rdma"])  # rdma: the soft provider
def test_rank_that_exits_without_close_is_reported_at_once(tmp_path, transport, how):
    """Rank 1 raises (or sys.exit()s) mid-job without close(): it then waits in
    MPI_Finalize, alive, so only its exit hook can tell the others (timeout 60 s)."""
    res = run(f"exit-{transport}-{how}", 3, tmp_path)
    assert res.get(1) == {"left": how}, res
    for r in (0, 2):
        o = res[r]
        assert o["error"] == "PeerAbortedError", o
        assert o["transport"] == ("rdma:host" if transport == "rdma" else "shm"), o
        assert o["after_exit_s"] is not None and o["after_exit_s"] < 1.0, (
            f"rank {r} took {o['after_exit_s']}s after rank 1 left to notice (timeout 60s)"
        )


@pytest.mark.timeout(180)
def test_timeout_names_the_rank_that_did_not_arrive(tmp_path):
    res = run("timeout", 3, tmp_path)
    for r in (0, 1):
        o = res[r]
        assert o["error"] == "CollectiveTimeout", o
        assert o["missing"] == [2], o
        assert o["elapsed"] < 2 + 10, o["elapsed"]
        msg = o["message"]
        assert "allreduce #3" in msg and "PYCOLL_TIMEOUT" in msg
        assert "rank 2: no answer" in msg
        other = 1 - r
        assert o["status"][str(other)].startswith(f"rank {other}: #3 allreduce"), o["status"]
        assert "last completed #2 broadcast" in o["status"][str(other)]
        assert any("#3 allreduce" in line for line in o["recorder"])


@pytest.mark.timeout(180)
def test_abort_tears_down_without_waiting(tmp_path):
    res = run("abort", 2, tmp_path)
    o = res[0]
    assert o["abort_s"] < 0.5, o
    assert o["request"] != "completed"
    for r in (0, 1):
        assert_clean(res[r])


@pytest.mark.timeout(180)
def test_check_mismatches_raise_on_every_rank(tmp_path):
    res = run("check", 3, tmp_path)
    assert set(res) == {0, 1, 2}
    for r, o in res.items():
        for field, got in o.items():
            assert got["error"] == "CollectiveMismatchError", (r, field, got)
            assert f"rank {r}:" in got["message"] and field in got["message"], got
            assert got["ranks"], got
    # values are named: e.g. the counts of every rank
    assert "ranks [0]: 4; ranks [1]: 5; ranks [2]: 6" in res[0]["count"]["message"]
    assert "float64" in res[1]["dtype"]["message"] and "float32" in res[1]["dtype"]["message"]


@pytest.mark.timeout(120)
def test_init_does_not_wait_forever_for_a_missing_rank() -> None:
    """A rank that never calls init: the others raise ConnectError after PYCOLL_TIMEOUT,
    naming it."""
    root = Path(__file__).resolve().parent.parent
    cmd = mpiexec(3) + [sys.executable, str(root / "tests" / "faults" / "late_init.py"), "6", "1.5"]
    t0 = time.monotonic()
    proc = subprocess.run(
        cmd,
        cwd=root,
        capture_output=True,
        text=True,
        timeout=100,
        env={**os.environ, "PYTHONPATH": str(root)},
    )
    # (the launcher may join the two ranks' lines)
    for r in (0, 2):
        said = (
            f"RAISED {r} rank {r}: pycoll.init: rank(s) [1] of the 3 did not call init within 1.5 s"
        )
        assert said in proc.stdout, proc.stdout + proc.stderr
    assert proc.stdout.count("(peer 1)") == 2 and "NOT RAISED" not in proc.stdout, proc.stdout
    assert time.monotonic() - t0 < 60


def _private_shm() -> list[str] | None:
    """A command prefix that gives what follows its own, empty /dev/shm (a mount
    namespace with a fresh tmpfs), or None where that is not allowed."""
    if os.geteuid() != 0 or not shutil.which("unshare"):
        return None
    probe = subprocess.run(
        ["unshare", "-m", "sh", "-c", "mount -t tmpfs -o size=4g tmpfs /dev/shm"],
        capture_output=True,
    )
    return None if probe.returncode else ["unshare", "-m", "sh", "-c"]


@pytest.mark.timeout(600)
def test_kill_during_init_leaks_no_segment(tmp_path):
    """SIGKILL one rank at random moments of init, 24 times: no pycoll segment may
    stay in /dev/shm (judged in a /dev/shm of these runs' own, since other jobs
    on the machine make pycoll segments too)."""
    prefix = _private_shm()
    if prefix is None:
        pytest.skip("needs root and unshare for a private /dev/shm")
    script = ROOT / "tests" / "faults" / "init_kill.py"
    inner = (
        "mount -t tmpfs -o size=4g tmpfs /dev/shm && "
        f"exec {shlex.quote(sys.executable)} {shlex.quote(str(script))} 24 {shlex.quote(str(tmp_path))}"
    )
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.run(
        [*prefix, inner], cwd=ROOT, env=env, capture_output=True, text=True, timeout=550
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads((tmp_path / "result.json").read_text())
    runs = res["runs"][1:]
    assert res["runs"][0]["leaked"] == [], res["runs"][0]
    during = [r for r in runs if "victim" in r and not r["victim_inited"]]
    assert len(during) >= len(runs) // 3, f"too few kills landed inside init: {runs}"
    leaky = [r for r in runs if r["leaked"]]
    assert not leaky, f"{len(leaky)} of {len(runs)} killed runs left segments: {leaky}"


# ----------------------------------------------------------------------------- init (issue 33, 3 and 5)
def _init_mpi(cmd: list[str], out: Path, timeout: float = 90) -> dict[int, dict]:
    subprocess.run(
        cmd,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    return {int(p.stem[4:]): json.loads(p.read_text()) for p in out.glob("rank*.json")}


INIT_MPI = str(ROOT / "tests" / "faults" / "init_mpi.py")


@pytest.mark.timeout(120)
def test_a_rank_stalled_in_setup_is_named_within_the_timeout(tmp_path: Path) -> None:
    """Rank 1 hangs in tcp's listen: the others raise after PYCOLL_TIMEOUT (3 s), naming it."""
    res = _init_mpi(mpiexec(3) + [sys.executable, INIT_MPI, str(tmp_path), "3", "stall"], tmp_path)
    for r in (0, 2):
        o = res[r]
        assert o.get("error") == "ConnectError", o
        assert o["peer"] == 1 and "rank(s) [1] of the 3 did not answer" in o["message"], o
        assert o["elapsed"] < 3 + 5, o


@pytest.mark.timeout(120)
def test_settings_that_differ_between_ranks_raise_on_every_rank(tmp_path: Path) -> None:
    exe = mpiexec(1)
    cmd = exe[:1] + ["-n", "1", "-env", "PYCOLL_TRANSPORT", "tcp", "-env", "PYCOLL_TUNE", "0"]
    args = [sys.executable, INIT_MPI, str(tmp_path), "10"]
    cmd += [*args, ":", "-n", "2", *args]
    res = _init_mpi(cmd, tmp_path)
    assert set(res) == {0, 1, 2}, res
    for r, o in res.items():
        assert o.get("error") == "InvalidArgumentError", o
        msg = o["message"]
        assert msg.startswith(f"rank {r}: pycoll.init: settings"), msg
        assert "PYCOLL_TRANSPORT (transports): ranks [0]: tcp; ranks [1, 2]: shm,rdma,tcp" in msg
        assert "PYCOLL_TUNE (tune): ranks [0]: False; ranks [1, 2]: True" in msg
        assert o["elapsed"] < 8, o


STORE_RANK = str(ROOT / "tests" / "faults" / "store_rank.py")


def _store_job(
    tmp_path: Path, n: int, *args: str, wrap: str = "", launcher: tuple[str, ...] = ()
) -> dict[int, dict]:
    """``n`` ranks of tests/faults/store_rank.py over one FileStore, no MPI; ``wrap``
    runs first in their shell, ``launcher`` starts that shell.  ``res[-1]`` holds
    the jobs' stderr."""
    store = tmp_path / "store"
    ranks = " & ".join(
        f"{sys.executable} {STORE_RANK} {store} {r} {n} " + " ".join(f"'{a}'" for a in args)
        for r in range(n)
    )
    script = f"{wrap}{ranks} & wait"
    proc = subprocess.run(
        [*launcher, "sh", "-c", script],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PYTHONPATH": str(ROOT), "PYCOLL_DEBUG": "WARN"},
    )
    res = reports(proc.stdout)
    assert set(res) == set(range(n)), proc.stdout + proc.stderr
    res[-1] = {"stderr": proc.stderr}
    return res


@pytest.mark.timeout(90)
def test_init_over_a_store_needs_no_mpi(tmp_path: Path) -> None:
    res = _store_job(tmp_path, 3, "timeout=10")
    for r in range(3):
        assert res[r]["sum"] == [6.0] * 5, res[r]
        assert res[r]["mpi4py"] is False, "pycoll.init(store=...) imported mpi4py"


def _can_unshare() -> bool:
    if os.geteuid() != 0 or not shutil.which("unshare"):
        return False
    probe = subprocess.run(
        ["unshare", "-m", "sh", "-c", "mount -t tmpfs -o size=1m tmpfs /dev/shm"],
        capture_output=True,
        timeout=20,
    )
    return probe.returncode == 0


@pytest.mark.timeout(90)
@pytest.mark.skipif(not _can_unshare(), reason="needs root and unshare -m (a private /dev/shm)")
def test_full_dev_shm_falls_back_to_tcp_at_once(tmp_path: Path) -> None:
    """A 1 MiB tmpfs on /dev/shm, full, in a private mount namespace: init must
    pick tcp at once (not wait out the timeout), say why, and not repeat its prefix."""
    wrap = (
        "mount -t tmpfs -o size=1m tmpfs /dev/shm && "
        "dd if=/dev/zero of=/dev/shm/fill bs=64k count=100 2>/dev/null; "
    )
    args = ("timeout=5", 'transports=("shm","tcp")')
    res = _store_job(tmp_path, 3, *args, wrap=wrap, launcher=("unshare", "-m"))
    stderr = res.pop(-1)["stderr"]
    for r, o in res.items():
        assert "error" not in o, o
        assert o["sum"] == [6.0] * 5
        assert all(v == "tcp" for p, v in o["via"].items() if int(p) != r), o
        assert o["init_s"] < 5, o  # less than one timeout
    assert "shm unavailable" in stderr and "/dev/shm has only" in stderr, stderr
    assert "rank 0: rank 0:" not in stderr + str(res)


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("transport", "algorithm"), [("shm", "ring"), ("shm", "direct"), ("tcp", "ring")]
)
def test_abort_raises_one_class_whatever_the_transport(transport: str, algorithm: str) -> None:
    """What abort() interrupts on its own rank (a running request, a queued one, a
    blocking call on another thread) raises CommunicatorClosedError on every
    transport; the peer that then calls raises PeerAbortedError."""
    import threading

    import numpy as np

    import pycoll
    from tests.inproc import communicators

    with communicators(2, transports=(transport,), timeout=20) as comms:
        c = comms[0]
        x = np.ones(1 << 16, np.float32)
        running = c.allreduce(x, async_op=True, algorithm=algorithm)  # rank 1 never joins
        queued = c.allreduce(np.ones(4, np.float32), async_op=True, algorithm=algorithm)
        time.sleep(0.3)
        c.abort()
        for req in (running, queued):
            with pytest.raises(pycoll.CommunicatorClosedError, match="aborted"):
                req.wait(10)
            assert isinstance(req.exception(), pycoll.CommunicatorClosedError)
        with pytest.raises(pycoll.PeerAbortedError) as info:
            for _ in range(3):  # the first may pair with what rank 0 had posted
                comms[1].allreduce(x, algorithm=algorithm)
        assert info.value.peer == 0, info.value

    with communicators(2, transports=(transport,), timeout=20) as comms:
        got: list[BaseException] = []

        def blocked() -> None:
            try:
                comms[0].allreduce(np.ones(1 << 16, np.float32), algorithm=algorithm)
            except BaseException as exc:
                got.append(exc)

        t = threading.Thread(target=blocked)
        t.start()
        time.sleep(0.3)
        comms[0].abort()
        t.join(10)
        assert len(got) == 1 and isinstance(got[0], pycoll.CommunicatorClosedError), got


@pytest.mark.timeout(120)
@pytest.mark.parametrize("k", [100, (1 << 16) + 3], ids=["slots", "by-address"])
@pytest.mark.parametrize(
    ("coll", "waiter"), [("gather", 0), ("gather", 1), ("scatter", 0), ("scatter", 1)]
)
def test_direct_gather_and_scatter_raise_when_the_peer_aborts(
    coll: str, waiter: int, k: int
) -> None:
    """direct's gather and scatter (root 0), through the slots and by address:
    the rank in the call while the other aborts instead of joining raises
    PeerAbortedError well within the timeout, and no output it had is
    touched: the root waiting for a block, a sender keeping its input posted
    for the root, the root keeping its input posted for a reader, a reader.
    A sender through the slots (gather's ranks, scatter's root) has copied its
    part into its slot and returns: it waits for no one."""
    import threading

    import numpy as np

    import pycoll
    from tests.inproc import communicators

    with communicators(2, transports=("shm",), timeout=20) as comms:
        c, r = comms[waiter], waiter
        x = np.ones(2 * k if coll == "scatter" else k, np.float32)
        out = np.full(2 * k if coll == "gather" else k, 7.0, np.float32)
        if coll == "gather" and r != 0:
            out = None  # (the root's alone)
        got: list[BaseException] = []

        def call() -> None:
            try:
                if coll == "gather":
                    c.gather(x, out, root=0, algorithm="direct")
                else:
                    c.scatter(x if r == 0 else None, out, root=0, algorithm="direct")
            except BaseException as exc:
                got.append(exc)

        t0 = time.monotonic()
        t = threading.Thread(target=call)
        t.start()
        time.sleep(0.3)
        comms[1 - waiter].abort()
        t.join(15)
        assert not t.is_alive()
        if k <= 100 and waiter == (1 if coll == "gather" else 0):
            assert not got, got
            return
        assert len(got) == 1 and isinstance(got[0], pycoll.PeerAbortedError), got
        assert time.monotonic() - t0 < 10
        if out is not None:  # the peer's part never arrived: nothing wrote there
            mine = slice(0, k) if coll == "gather" else slice(0, 0)
            rest = np.delete(out, np.arange(out.size)[mine])
            assert (rest == 7.0).all() or (coll == "scatter" and r == 0)


#: What a thread may see when two threads share a communicator at once: the
#: overlap itself, the communicator it left unusable, a peer that failed of it,
#: or the guard seeing that the ranks' calls no longer pair (one rank's threads
#: took turns in another order than the other's, or a rejected overlap there
#: took a sequence number).
_THREAD_ERRORS = {
    "ConcurrentCallError",
    "CollectiveMismatchError",
    "CommunicatorClosedError",
    "PeerAbortedError",
    "CollectiveTimeout",
}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("transport", ["shm", "tcp", "gather-shm"])
def test_two_threads_at_once_never_return_a_wrong_result(tmp_path, transport):
    """Two threads x 200 allreduces on one communicator, at once: every result
    a thread gets is right, and a thread that stops says why with a pycoll error.
    ``gather-shm``: allgathers whose own-block copies release the GIL (the
    streaming copy), where the other thread's call can come in mid-copy."""
    res = run(f"threads-{transport}", 2, tmp_path)
    assert set(res) == {0, 1}, res
    errors = set()
    for r, o in res.items():
        assert not o["hung"], (r, o)
        for t, got in o["threads"].items():
            assert got["wrong"] == 0, (r, t, got)
            assert got["ok"] == 200 or got["error"] in _THREAD_ERRORS, (r, t, got)
            errors.add(got["error"])
    # they did overlap (200 calls each): it was seen, and named
    assert "ConcurrentCallError" in errors, res


@pytest.mark.timeout(300)
@pytest.mark.parametrize("transport", ["shm", "tcp", "gather-shm"])
def test_two_threads_taking_turns_share_a_communicator(tmp_path, transport):
    """The same calls, each after the other thread's returned: all 400 are right
    (``gather-shm``: allgathers through the streaming copy, see above)."""
    res = run(f"turns-{transport}", 2, tmp_path)
    assert set(res) == {0, 1}, res
    for r, o in res.items():
        for t, got in o["threads"].items():
            assert (got["ok"], got["wrong"], got["error"]) == (200, 0, None), (r, t, got)


@pytest.mark.timeout(300)
def test_timeout_is_inactivity_not_a_deadline_per_collective(tmp_path):
    """PYCOLL_TIMEOUT=1: a 1.5 GiB tcp allreduce that takes longer than 1 s but
    keeps moving completes, right; a peer stopped by SIGSTOP is named within
    about the timeout (plus the status exchange's grace)."""
    res = run("progress-tcp", 2, tmp_path, SCENARIO_MIB="1536")
    assert set(res) == {0, 1}, res
    for r, o in res.items():
        assert o["large"]["error"] is None and o["large"]["right"], (r, o["large"])
    o = res[0]["stopped"]
    assert o["error"] == "CollectiveTimeout" and o["missing"] == [1], o
    assert "no progress for 1 s" in o["message"], o
    assert o["elapsed"] < 6, o


@pytest.mark.timeout(600)
@pytest.mark.parametrize("transport", ["shm", "tcp", "direct", "rdma"])  # rdma: the soft provider
def test_every_survivor_names_the_rank_that_died(tmp_path, transport):
    """n = 4, rank 2 killed mid-loop; rank 0 is no neighbour of it in the ring.
    Every survivor names rank 2 (``peer``, and first in its message), and a live
    rank that closed its connections because of it is said to have (``via``),
    never blamed."""
    dead, n = 2, 4
    live = set(range(n)) - {dead}
    res = run_kill(transport, n, dead, tmp_path)
    assert dead not in res and live <= set(res), res
    for r in sorted(live):
        o = res[r]
        assert o["error"] == "PeerAbortedError", (r, o)
        assert o["peer"] == dead, (r, o)
        assert o.get("via") in (None, *(live - {r})), (r, o)
        # "rank r: allreduce #k: " and then what happened, which names rank 2 first
        # or says that a live rank closed because of it
        said = o["message"].split(": ", 2)[2]
        first = re.search(r"\b(?:rank|peer) (\d+)\b", said)
        because = f"rank {o.get('via')} closed its connections because rank {dead} failed"
        assert first is not None, (r, o)
        assert int(first[1]) == dead or said.startswith(because), (r, o)
        assert o["elapsed"] < 15, (r, o)
