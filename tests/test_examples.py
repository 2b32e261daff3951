"""The examples README points to run as written, under mpiexec."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.launch import mpiexec

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.timeout(180)
@pytest.mark.parametrize("n", [1, 2, 4])
def test_readme_example_runs(n: int) -> None:
    """README's ``mpiexec -n 4 python examples/example.py``, checked line by line."""
    readme = (ROOT / "README.md").read_text()
    assert "mpiexec -n 4 python examples/example.py" in readme
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    env.pop("PYCOLL_DEBUG", None)
    proc = subprocess.run(
        [*mpiexec(n), sys.executable, str(ROOT / "examples" / "example.py")],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=150,
    )
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    total = n * (n - 1) / 2  # the ranks' average, then summed over the ranks
    ranks = " ".join(map(str, range(n)))
    for r in range(n):
        kinds = ", ".join(repr("self" if p == r else "shm") for p in range(n))
        line = f"{r} {total} [{ranks}] [{kinds}]\n"  # ranks share stdout: no anchors
        assert line in proc.stdout, (line, proc.stdout)
    assert proc.stdout.count("\n") == n, proc.stdout
