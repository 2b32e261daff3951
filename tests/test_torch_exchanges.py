"""Point-to-point, all_to_all, gather, scatter, the object collectives, coalesced
all_reduce and subgroups split from the world, through torch.distributed on the
pycoll backend, at n = 2 and 3, under mpiexec and torchrun
(tests/torchdist/exchanges.py checks every result against torch)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.launch import mpiexec, reports

pytest.importorskip(
    "torch", reason="torch is not installed (pip install 'pycoll-collectives[torch]')"
)

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = str(ROOT / "tests" / "torchdist" / "exchanges.py")

#: What every rank of tests/torchdist/exchanges.py reports, in order.
CHECKS = [
    "send/recv",
    "isend/irecv",
    "recv_anysource",
    "batch_isend_irecv ring",
    "coalesced send/recv",
    "non-contiguous, self",
    "all_to_all_single even",
    "all_to_all_single uneven",
    "all_to_all_single zero splits",
    "all_to_all",
    "gather",
    "scatter",
    "gather_object",
    "scatter_object_list",
    "all_reduce coalesced, one per dtype",
    "barrier async",
    "subgroups interleaved with the world",
]


def _env() -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    }
    env["PYTHONPATH"] = str(ROOT)
    env["EXCHANGES_TIMEOUT"] = "60"
    return env


@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    ("launcher", "n"), [("mpiexec", 2), ("mpiexec", 3), ("torchrun", 3)], ids=str
)
def test_exchanges_match_torch(launcher: str, n: int) -> None:
    if launcher == "mpiexec":
        cmd = [*mpiexec(n), sys.executable, SCRIPT]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
        cmd += ["--nproc-per-node", str(n), SCRIPT]
    proc = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=220)
    res = reports(proc.stdout)
    assert proc.returncode == 0 and set(res) == set(range(n)), (
        f"rc={proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    )
    for r, o in res.items():
        assert o["size"] == n and o["checks"] == CHECKS, (r, o)
