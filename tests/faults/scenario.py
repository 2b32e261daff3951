"""One fault scenario per run, on every rank; each rank writes its outcome as JSON.

Run under ``mpiexec -disable-auto-cleanup -n N python tests/faults/scenario.py
NAME OUTDIR`` (tests/test_faults.py does): with that flag MPICH's launcher keeps
the survivors running when one rank dies, and tells them with SIGUSR1, which
they ignore, so they can observe the fault and report it.
"""

from __future__ import annotations

import faulthandler
import json
import os
import signal
import sys
import threading
import time

import numpy as np
from mpi4py import MPI

import pycoll

NAME, OUTDIR = sys.argv[1], sys.argv[2]
WORLD = MPI.COMM_WORLD
RANK, SIZE = WORLD.Get_rank(), WORLD.Get_size()
#: The rank the kill scenarios kill.
VICTIM = int(os.environ.get("SCENARIO_VICTIM", "1"))
# The launcher stops forwarding output once a rank dies: log to a file instead,
# and never die of SIGPIPE (MPI_Init may have restored its default action).
signal.signal(signal.SIGPIPE, signal.SIG_IGN)
_log = os.open(os.path.join(OUTDIR, f"rank{RANK}.log"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
os.dup2(_log, 2)
os.close(_log)
faulthandler.enable()


def fds() -> dict[str, str]:
    out = {}
    for fd in os.listdir("/proc/self/fd"):
        try:
            out[fd] = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            pass
    return out


def segments() -> list[str]:
    return sorted(f for f in os.listdir("/dev/shm") if f.startswith("pycoll-"))


def report(**kw: object) -> None:
    path = os.path.join(OUTDIR, f"rank{RANK}.json")
    with open(path + ".tmp", "w") as f:
        json.dump(kw, f)
    os.replace(path + ".tmp", path)


def leaks(before: dict[str, str]) -> dict[str, object]:
    deadline = time.monotonic() + 5
    while threading.active_count() > 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    after = fds()
    new = {k: v for k, v in after.items() if k not in before or before[k] != v}
    return {
        "threads": [t.name for t in threading.enumerate() if t is not threading.main_thread()],
        "new_fds": new,
        "sockets": [v for v in new.values() if v.startswith("socket:")],
        "segments": segments(),
    }


def outcome(exc: BaseException | None, start: float) -> dict[str, object]:
    d: dict[str, object] = {"elapsed": time.monotonic() - start}
    if exc is None:
        d["error"] = None
        return d
    d["error"] = type(exc).__name__
    d["message"] = str(exc)
    for attr in ("missing", "waiting_on", "peer", "via", "ranks", "recorder"):
        if hasattr(exc, attr):
            v = getattr(exc, attr)
            d[attr] = list(v) if isinstance(v, tuple) else v
    if hasattr(exc, "status"):
        d["status"] = {str(k): v for k, v in exc.status.items()}
    return d


def kill(transport: str, algorithm: str = "auto") -> None:
    before = fds()
    extra = {"rdma_provider": "soft", "socket_ifname": "lo"} if transport == "rdma" else {}
    comm = pycoll.init(timeout=60, transports=(transport,), **extra)
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    x = np.ones(1 << 18, np.float32)
    small = np.ones(3, np.float32)
    comm.allreduce(x, algorithm=algorithm)
    WORLD.Barrier()
    if RANK == VICTIM:
        threading.Timer(0.05, lambda: os.kill(os.getpid(), signal.SIGKILL)).start()
        time.sleep(10)
    start = time.monotonic()
    err = None
    print(f"rank {RANK} looping", file=sys.stderr, flush=True)
    try:
        for _ in range(100000):  # mid-collective, whenever the victim dies
            comm.allreduce(x, algorithm=algorithm)
            comm.allreduce(small, algorithm=algorithm)
    except pycoll.PycollError as exc:
        err = exc
    print(f"rank {RANK} failed: {err!r}", file=sys.stderr, flush=True)
    res = outcome(err, start)
    comm.close()
    print(f"rank {RANK} closed", file=sys.stderr, flush=True)
    res.update(leaks(before))
    report(**res)
    # The launcher tears the job down once a survivor exits: wait for the others.
    end = time.monotonic() + 60
    while time.monotonic() < end and not all(
        os.path.exists(os.path.join(OUTDIR, f"rank{r}.json")) for r in range(SIZE) if r != VICTIM
    ):
        time.sleep(0.05)
    os._exit(0)  # a dead rank would make MPI_Finalize wait


def kill_p2p() -> None:
    """Two ranks ping-pong 8 MiB messages over shm (read in place, copied from
    both ends: the sender writes pieces into the receiver's buffer) until the
    victim dies; every message the survivor got before is checked."""
    before = fds()
    comm = pycoll.init(timeout=60, transports=("shm",))
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    x = np.full(2 << 20, RANK + 1, np.float32)
    got = np.empty_like(x)
    peer = 1 - RANK
    WORLD.Barrier()
    start = time.monotonic()
    err = None
    wrong = right = 0
    try:
        for i in range(100000):
            if i == 1 and RANK == VICTIM:  # after one whole round, however slow the host
                threading.Timer(0.05, lambda: os.kill(os.getpid(), signal.SIGKILL)).start()
            got[:] = 0
            if RANK == 0:
                comm.send(x, peer)
                comm.recv(got, peer)
            else:
                comm.recv(got, peer)
                comm.send(x, peer)
            if (got == peer + 1).all():
                right += 1
            else:
                wrong += 1
    except pycoll.PycollError as exc:
        err = exc
    res = outcome(err, start)
    res.update(wrong=wrong, right=right)
    comm.close()
    res.update(leaks(before))
    report(**res)
    os._exit(0)


def exit_early(transport: str, algorithm: str, how: str) -> None:
    """Rank 1 leaves mid-job without close() (an exception or sys.exit); the others,
    blocked in a collective with it, must hear of it at once, not after the timeout."""
    extra = {"rdma_provider": "soft", "socket_ifname": "lo"} if transport == "rdma" else {}
    comm = pycoll.init(timeout=60, transports=(transport,), **extra)
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    x = np.ones(1 << 16, np.float32)
    comm.allreduce(x, algorithm=algorithm)
    WORLD.Barrier()
    stamp = os.path.join(OUTDIR, "victim-left")
    if RANK == 1:
        time.sleep(0.3)  # the others are waiting for it inside a collective by now
        with open(stamp, "w") as f:
            f.write(repr(time.time()))
        report(left=how)
        if how == "raise":
            raise RuntimeError("rank 1 fails mid-job and never calls close()")
        sys.exit(3)
    start = time.monotonic()
    err = None
    try:
        for _ in range(100000):
            comm.allreduce(x, algorithm=algorithm)
    except pycoll.PycollError as exc:
        err = exc
    now = time.time()
    res = outcome(err, start)
    try:
        with open(stamp) as f:
            res["after_exit_s"] = now - float(f.read())
    except (OSError, ValueError):
        res["after_exit_s"] = None
    res["transport"] = comm.transport_of(1)
    comm.close()
    report(**res)
    # return normally: MPI_Finalize, in which rank 1 waits for us, then ends the job


def timeout() -> None:
    comm = pycoll.init(timeout=2)
    x = np.ones(1000, np.float32)
    comm.allreduce(x)
    comm.broadcast(x, root=1)
    start = time.monotonic()
    err = None
    if RANK == SIZE - 1:
        time.sleep(8)  # never arrives in time
    else:
        try:
            comm.allreduce(x)
        except pycoll.PycollError as exc:
            err = exc
    res = outcome(err, start)
    comm.close()
    report(**res)


def abort() -> None:
    before = fds()
    comm = pycoll.init(timeout=60)
    x = np.ones(1 << 16, np.float32)
    comm.allreduce(x)
    res: dict[str, object] = {}
    if RANK == 0:
        req = comm.allreduce(x, async_op=True)  # rank 1 never joins
        time.sleep(0.3)
        t = time.monotonic()
        comm.abort()
        res["abort_s"] = time.monotonic() - t
        try:
            req.wait(timeout=10)
            res["request"] = "completed"
        except BaseException as exc:
            res["request"] = type(exc).__name__
        comm.abort()
        comm.close()
    else:
        time.sleep(1.0)
        comm.close()
    res.update(leaks(before))
    report(**res)
    WORLD.Barrier()


def check() -> None:
    cases = {
        "collective": lambda c: (
            c.allreduce(np.ones(4, np.float32)) if RANK else c.broadcast(np.ones(4, np.float32))
        ),
        "count": lambda c: c.allreduce(np.ones(4 + RANK, np.float32)),
        "dtype": lambda c: c.allreduce(np.ones(4, np.float32 if RANK else np.float64)),
        "op": lambda c: c.allreduce(np.ones(4, np.float32), op="max" if RANK else "sum"),
        "root": lambda c: c.broadcast(np.ones(4, np.float32), root=RANK % 2),
        "algorithm": lambda c: c.allreduce(
            np.ones(4, np.float32), algorithm="ring" if RANK else "tree"
        ),
    }
    res: dict[str, object] = {}
    for name, fn in cases.items():
        comm = pycoll.init(timeout=20, check=True)
        comm.allreduce(np.ones(8, np.float32))  # matching calls pass
        try:
            fn(comm)
            res[name] = {"error": None}
        except pycoll.PycollError as exc:
            res[name] = {
                "error": type(exc).__name__,
                "message": str(exc),
                "ranks": list(getattr(exc, "ranks", ())),
            }
        comm.close()
    report(**res)


def threads(transport: str, turns: bool, gather: bool = False) -> None:
    """Two threads make 200 allreduces each on one communicator: at once, or
    taking turns (each call after the other thread's returned).  Each thread
    reports its correct and wrong results and the error that stopped it.
    ``gather``: allgathers instead, every own-block copy through the streaming
    copy, which runs without the GIL (its threshold lowered to 64 bytes)."""
    if gather:
        from pycoll import buffers

        buffers.STREAM_COPY_BYTES = 64
    comm = pycoll.init(timeout=10, transports=(transport,))
    calls, k = 200, 16
    weight = sum(r + 1 for r in range(SIZE))
    turn = threading.Condition()
    state = {"next": 0}
    out: dict[str, dict[str, object]] = {}

    def body(t: int) -> None:
        got: dict[str, object] = {"ok": 0, "wrong": 0, "error": None, "message": ""}
        out[str(t)] = got
        x = np.empty(k, np.float64)
        try:
            for i in range(calls):
                if turns:
                    with turn:
                        turn.wait_for(lambda: state["next"] == 2 * i + t, timeout=60)
                v = float(t * 100000 + i)
                # the same array each call replays a plan; every third call a fresh one
                a = x if i % 3 else np.empty(k, np.float64)
                a[:] = v * (RANK + 1)
                if gather:
                    res = comm.allgather(a).reshape(-1)
                    want = np.repeat(v * np.arange(1, SIZE + 1), k)
                else:
                    res, want = comm.allreduce(a), np.full(k, v * weight)
                if np.array_equal(res, want):
                    got["ok"] += 1  # type: ignore[operator]
                else:
                    got["wrong"] += 1  # type: ignore[operator]
                if turns:
                    with turn:
                        state["next"] += 1
                        turn.notify_all()
        except Exception as exc:
            got["error"] = type(exc).__name__
            got["message"] = str(exc)
            if turns:  # let the other thread go on to its own end
                with turn:
                    state["next"] = 1 << 30
                    turn.notify_all()

    start = time.monotonic()
    ths = [threading.Thread(target=body, args=(t,), name=f"user{t}") for t in (0, 1)]
    for th in ths:
        th.start()
    for th in ths:
        th.join(90)
    res: dict[str, object] = {"threads": out, "elapsed": time.monotonic() - start}
    res["hung"] = [th.name for th in ths if th.is_alive()]
    report(**res)
    os._exit(0)  # a peer may still wait on this rank: MPI_Finalize would wait for it


def progress(transport: str, mib: int) -> None:
    """PYCOLL_TIMEOUT=1 s: a large allreduce that takes longer but keeps moving
    completes; then rank 1 stops (SIGSTOP) and rank 0 raises within about 1 s."""
    pids = WORLD.allgather(os.getpid())
    comm = pycoll.init(timeout=1, transports=(transport,))
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    x = np.full((mib << 20) // 4, RANK + 1, np.float32)
    res: dict[str, object] = {}
    start = time.monotonic()
    try:
        comm.allreduce(x, algorithm="ring")
        res["large"] = outcome(None, start)
        res["large"]["right"] = bool((x == SIZE * (SIZE + 1) // 2).all())  # type: ignore[index]
    except pycoll.PycollError as exc:
        res["large"] = outcome(exc, start)
        report(**res)
        os._exit(0)
    del x
    WORLD.Barrier()
    y = np.ones(1 << 16, np.float32)
    if RANK == 1:
        threading.Timer(0.2, lambda: os.kill(os.getpid(), signal.SIGSTOP)).start()
    start = time.monotonic()
    err = None
    try:
        for _ in range(1000000):
            comm.allreduce(y)
    except pycoll.PycollError as exc:
        err = exc
    res["stopped"] = outcome(err, start)
    if RANK == 0:
        os.kill(pids[1], signal.SIGCONT)
    report(**res)
    os._exit(0)


{
    "progress-tcp": lambda: progress("tcp", int(os.environ.get("SCENARIO_MIB", "512"))),
    "threads-shm": lambda: threads("shm", False),
    "threads-tcp": lambda: threads("tcp", False),
    "turns-shm": lambda: threads("shm", True),
    "turns-tcp": lambda: threads("tcp", True),
    "threads-gather-shm": lambda: threads("shm", False, gather=True),
    "turns-gather-shm": lambda: threads("shm", True, gather=True),
    "kill-shm": lambda: kill("shm", "ring"),
    "kill-direct": lambda: kill("shm", "direct"),
    "kill-tcp": lambda: kill("tcp"),
    "kill-rdma": lambda: kill("rdma", "ring"),
    "kill-p2p": kill_p2p,
    "exit-shm-raise": lambda: exit_early("shm", "ring", "raise"),
    "exit-shm-exit": lambda: exit_early("shm", "ring", "exit"),
    "exit-direct-raise": lambda: exit_early("shm", "direct", "raise"),
    "exit-direct-exit": lambda: exit_early("shm", "direct", "exit"),
    "exit-rdma-raise": lambda: exit_early("rdma", "ring", "raise"),
    "exit-rdma-exit": lambda: exit_early("rdma", "ring", "exit"),
    "timeout": timeout,
    "abort": abort,
    "check": check,
}[NAME]()
