"""Find an mpiexec that can launch ranks of this Python."""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from pathlib import Path


def mpiexec(n: int) -> list[str]:
    exe = os.environ.get("PYCOLL_MPIEXEC")
    if not exe:
        here = Path(sys.executable).parent / "mpiexec"
        exe = str(here) if here.exists() else shutil.which("mpiexec") or "mpiexec"
    cmd = [exe, "-n", str(n)]
    if "openmpi" in os.path.realpath(exe).lower() or os.environ.get("OMPI_COMM_WORLD_SIZE"):
        cmd[1:1] = ["--oversubscribe", "--allow-run-as-root"]
    return cmd


def reports(text: str) -> dict[int, dict]:
    """The JSON reports (objects that start with ``{"rank"``) in a job's output, by
    rank; the launcher or a log line may share their line."""
    out = {}
    dec = json.JSONDecoder()
    at = text.find('{"rank"')
    while at >= 0:
        d, end = dec.raw_decode(text, at)
        out[d["rank"]] = d
        at = text.find('{"rank"', end)
    return out


SHM = Path("/dev/shm")


def mpich_segments() -> set[str]:
    """MPICH's shared-memory segments in /dev/shm now."""
    return {p.name for p in SHM.glob("mpich_shm_*")} if SHM.is_dir() else set()


def remove_orphans(names: set[str], wait: float = 15.0) -> set[str]:
    """Remove the segments of ``names`` that no process maps, once the processes
    still mapping them have exited (up to ``wait`` seconds: a killed job's
    survivors take a moment to go).  MPICH's own segments outlive a job one of
    whose ranks was killed; another job's stay mapped and stay, and so do
    those this process maps (a test's ``pycoll.init()`` as an MPI singleton),
    at once.  Returns the names left (still mapped)."""
    own = Path(f"/proc/{os.getpid()}/maps").read_text()
    kept = {n for n in names if n in own}
    names = names - kept
    end = time.monotonic() + wait
    while names:
        mapped = set()
        for maps in Path("/proc").glob("[0-9]*/maps"):
            try:
                text = maps.read_text()
            except OSError:
                continue
            mapped.update(n for n in names if n in text)
        for n in names - mapped:
            (SHM / n).unlink(missing_ok=True)
        names = mapped
        if not names or time.monotonic() > end:
            break
        time.sleep(0.2)
    return names | kept
