"""A shortened soak (tests/soak.py) at n = 4 over shm and over tcp."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.launch import mpiexec

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.timeout(150)
@pytest.mark.parametrize(("transport", "iters"), [("shm", 1500), ("tcp", 800)])
def test_short_soak(tmp_path, transport, iters):
    out = tmp_path / "soak.json"
    cmd = mpiexec(4) + [
        sys.executable, str(ROOT / "tests" / "soak.py"), "--iters", str(iters),
        "--max-count", "20000", "--chunk-bytes", "16384", "--json", str(out),
    ]  # fmt: skip
    env = dict(os.environ, PYTHONPATH=str(ROOT), PYCOLL_TRANSPORT=transport)
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=140)
    assert proc.returncode == 0, f"{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    s = json.loads(out.read_text())
    assert s["collectives"] == iters and s["transports"] == [transport]
    assert s["max_fd_growth"] <= 0, s
    assert s["max_rss_growth"] < 48 << 20, s
