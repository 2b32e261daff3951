"""examples/train_dp.py under mpiexec at n = 1, 2, 4: its own checks must pass.

The example raises (aborting the job through ``python -m mpi4py``) when the
replicas' parameter hashes differ or when the final weights differ from the
single-process full-batch reference beyond atol=1e-5, rtol=1e-4 (bitwise
equality at n=1).  Here we also read its JSON summary.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.launch import mpiexec

pytest.importorskip(
    "torch", reason="torch is not installed (pip install 'pycoll-collectives[torch]')"
)
pytest.importorskip("tqdm", reason="tqdm is not installed")

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.timeout(240)
@pytest.mark.parametrize("n", [1, 2, 4])
def test_train_dp(n: int, tmp_path: Path) -> None:
    out = tmp_path / "result.json"
    cmd = mpiexec(n) + [
        sys.executable,
        "-m",
        "mpi4py",
        str(ROOT / "examples" / "train_dp.py"),
        "--steps",
        "12",
        "--batch",
        "64",
        "--hidden",
        "64",
        "--layers",
        "2",
        "--samples",
        "512",
        "--bucket-mb",
        "0.01",
        "--hash-every",
        "4",
        "--warmup",
        "2",
        "--comm-reps",
        "2",
        "--check-single",
        "--no-progress",
        "--json",
        str(out),
    ]
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=220)
    assert proc.returncode == 0, (
        f"rc={proc.returncode}\n{proc.stdout[-4000:]}\n{proc.stderr[-6000:]}"
    )
    res = json.loads(out.read_text())
    assert res["n"] == n
    assert res["buckets"] > 1, "the test model should span several buckets"
    assert res["replicas_identical"] and res["hash_checks"] == 3, res
    assert res["single_ok"], res
    # the reference averages the shards' gradients in rank order, as the host
    # allreduce does (sum, then divide): the same bits
    assert res["single_identical"], res
