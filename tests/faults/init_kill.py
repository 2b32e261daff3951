"""Kill a rank with SIGKILL at a random moment of ``pycoll.init``, again and again;
report which ``pycoll-*`` names each run left in /dev/shm.

Run as ``python tests/faults/init_kill.py RUNS OUTDIR`` inside a mount namespace
whose /dev/shm is a fresh tmpfs (tests/test_faults.py arranges it), so that
every name found there was made by these runs.  Each run starts three ranks
(``rank`` mode of this script); once all of them are in ``main`` the driver
waits a random time within the length of an undisturbed init, kills one rank,
and lets the launcher kill the rest.  It writes ``OUTDIR/result.json``.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent.parent
sys.path.insert(0, str(ROOT))
SHM = Path("/dev/shm")
N = 3


def rank(outdir: str) -> None:
    import numpy as np
    from mpi4py import MPI

    import pycoll

    r = MPI.COMM_WORLD.Get_rank()
    Path(outdir, f"pid{r}").write_text(str(os.getpid()))
    MPI.COMM_WORLD.Barrier()
    t = time.monotonic()
    comm = pycoll.init(timeout=20, transports=("shm",))
    # written whole or not at all: the driver may kill this rank mid-write
    tmp = Path(outdir, f".inited{r}")
    tmp.write_text(repr(time.monotonic() - t))
    tmp.replace(Path(outdir, f"inited{r}"))
    comm.allreduce(np.ones(1 << 18, np.float32))  # the shared send buffers, if any
    comm.close()


def one_run(d: Path, delay: float | None) -> dict[str, object]:
    """One job; ``delay``: seconds after every rank started before the kill (None: no kill)."""
    from tests.launch import mpiexec

    d.mkdir()
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    env.pop("PYCOLL_TRANSPORT", None)
    cmd = [*mpiexec(N), sys.executable, __file__, "rank", str(d)]
    log = open(d / "log", "w")
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    res: dict[str, object] = {"delay": delay}
    end = time.monotonic() + 30
    pids = {}
    while len(pids) < N and time.monotonic() < end and proc.poll() is None:
        for r in range(N):
            try:
                pids[r] = int((d / f"pid{r}").read_text())
            except (OSError, ValueError):
                pass
        time.sleep(0.002)
    if delay is not None and len(pids) == N:
        time.sleep(delay)
        victim = random.randrange(N)
        res["victim"] = victim
        res["victim_inited"] = (d / f"inited{victim}").exists()
        try:
            os.kill(pids[victim], signal.SIGKILL)
        except ProcessLookupError:
            res["victim_gone"] = True
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    log.close()
    for r, pid in pids.items():  # the launcher kills the rest; make sure of it
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    time.sleep(0.05)
    res["init_s"] = [
        float((d / f"inited{r}").read_text()) for r in range(N) if (d / f"inited{r}").exists()
    ]
    names = sorted(p.name for p in SHM.iterdir())
    res["leaked"] = [n for n in names if n.startswith("pycoll-")]
    for n in names:  # the next run starts clean (MPICH's own leftovers too)
        (SHM / n).unlink(missing_ok=True)
    return res


def main(runs: int, outdir: str) -> None:
    out = Path(outdir)
    calib = one_run(out / "calibrate", None)
    init_s = max(calib["init_s"] or [1.0])  # type: ignore[type-var, arg-type]
    results = [calib]
    for i in range(runs):
        results.append(one_run(out / str(i), random.uniform(0, 1.2 * init_s)))
    (out / "result.json").write_text(json.dumps({"init_s": init_s, "runs": results}))


if __name__ == "__main__":
    if sys.argv[1] == "rank":
        rank(sys.argv[2])
    else:
        main(int(sys.argv[1]), sys.argv[2])
