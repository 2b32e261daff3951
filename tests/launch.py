"""Find an mpiexec that can launch ranks of this Python."""

from __future__ import annotations

import json
import os
import shutil
import sys
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
