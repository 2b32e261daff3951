"""Find an mpiexec that can launch ranks of this Python."""

from __future__ import annotations

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
