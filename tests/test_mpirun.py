"""Tier 4: the collective suite under mpiexec at n = 1, 2, 3, 4.

``python -m mpi4py`` aborts the whole job when one rank raises, so a failure
on one rank ends the run instead of hanging the others.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.launch import mpiexec

ROOT = Path(__file__).resolve().parent.parent


#: RDMA alone on the software provider: every pair over rdma:host, even on one host.
#: One dtype of each family there (tests/mpi/test_collectives.py's FEW): the
#: full dtype x op matrix runs over shm, and the wire does not see the dtype.
RDMA_SOFT = {
    "PYCOLL_TRANSPORT": "rdma",
    "PYCOLL_RDMA_PROVIDER": "soft",
    "PYCOLL_TEST_DTYPES": "few",
}
#: tcp alone, for the collectives of tests/mpi/test_exchange.py (the others run
#: over tcp in tests/test_multihost.py, between simulated hosts).
TCP = {"PYCOLL_TRANSPORT": "tcp", "PYCOLL_TEST_DTYPES": "few"}
CASES = (
    [pytest.param(n, {}, "", id=f"{n}") for n in (1, 2, 3, 4)]
    + [pytest.param(n, RDMA_SOFT, "", id=f"{n}-rdma-soft") for n in (2, 3, 4)]
    + [pytest.param(n, TCP, "test_exchange.py", id=f"{n}-tcp") for n in (2, 3, 4)]
)


@pytest.mark.timeout(1500)
@pytest.mark.parametrize(("n", "variant", "only"), CASES)
def test_collectives_under_mpiexec(n: int, variant: dict[str, str], only: str) -> None:
    cmd = mpiexec(n) + [
        sys.executable,
        "-m",
        "mpi4py",
        "-m",
        "pytest",
        "-q",
        "-x",
        "-p",
        "no:cacheprovider",
        "--with-mpi",
        str(ROOT / "tests" / "mpi" / only),
    ]
    env = dict(os.environ, PYTHONPATH=str(ROOT), **variant)
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1450)
    assert proc.returncode == 0, (
        f"rc={proc.returncode}\n{proc.stdout[-6000:]}\n{proc.stderr[-6000:]}"
    )
