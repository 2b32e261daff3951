"""The examples README points to run as written, under mpiexec."""

from __future__ import annotations

import json
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


@pytest.mark.timeout(240)
def test_ddp_example_under_mpiexec_and_torchrun(tmp_path: Path) -> None:
    """examples/ddp.py under both launchers: replicas bitwise equal within each
    run (the example checks), and the same losses and parameters in both."""
    pytest.importorskip("torch", reason="torch is not installed")
    script = str(ROOT / "examples" / "ddp.py")
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    }
    env["PYTHONPATH"] = str(ROOT)
    runs = {
        "mpiexec": mpiexec(2) + [sys.executable, script],
        "torchrun": [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "2",
            script,
        ],
    }
    got = {}
    for name, cmd in runs.items():
        out = tmp_path / name
        proc = subprocess.run(
            [*cmd, "--steps", "4", "--json", str(out)],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=200,
        )
        assert proc.returncode == 0, (
            f"{name}: rc={proc.returncode}\n{proc.stdout}\n{proc.stderr[-4000:]}"
        )
        ranks = [json.loads(Path(f"{out}.{r}").read_text()) for r in range(2)]
        assert ranks[0]["params"] == ranks[1]["params"], (name, ranks)
        got[name] = ranks[0]
    assert got["mpiexec"] == got["torchrun"], got
