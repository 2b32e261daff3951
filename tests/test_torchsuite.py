"""torch's own distributed test suite (``_DistTestBase``) on the pycoll backend.

A handful of its tests run in the default test run; the whole suite, for Gloo
and pycoll at world sizes 2 and 3, runs with ``-m torchsuite`` (hours on two
cores) and must lose no test that passes on Gloo beyond :data:`KNOWN`.  The
driver is tests/torchsuite/run.py; benchmarks/RESULTS.md has the last table.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip(
    "torch", reason="torch is not installed (pip install 'pycoll-collectives[torch]')"
)
pytest.importorskip("expecttest", reason="torch's test suite needs expecttest (the test extra)")

ROOT = Path(__file__).resolve().parent.parent

#: The quick subset (about 30 s on an idle two-core machine): a reduction, a
#: broadcast, point-to-point and a rooted exchange.
QUICK = [
    "test_all_reduce_sum",
    "test_broadcast",
    "test_send_recv",
    "test_gather",
]

#: Tests that pass on Gloo and fail on pycoll, with the reason (benchmarks/RESULTS.md).
KNOWN: dict[str, str] = {}


def _suite(backend: str, n: int, out: Path, timeout: float, *extra: str) -> dict:
    cmd = [sys.executable, "-m", "tests.torchsuite.run", "--backend", backend]
    cmd += ["--world-size", str(n), "--out", str(out), *extra]
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    for var in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "BACKEND"):
        env.pop(var, None)
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0 and out.exists(), (
        f"rc={proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    )
    return json.loads(out.read_text())


@pytest.mark.timeout(240)
def test_quick_subset_passes_on_pycoll(tmp_path: Path) -> None:
    res = _suite("pycoll", 2, tmp_path / "quick.json", 220, "--tests", ",".join(QUICK))
    got = {name: o["status"] for name, o in res["tests"].items()}
    assert got == dict.fromkeys(QUICK, "pass"), res["tests"]


@pytest.mark.torchsuite
@pytest.mark.timeout(6 * 3600)
@pytest.mark.parametrize("n", [2, 3])
def test_whole_suite_loses_nothing_gloo_passes(n: int, tmp_path: Path) -> None:
    gloo = _suite("gloo", n, tmp_path / f"gloo-{n}.json", 3 * 3600)
    mine = _suite("pycoll", n, tmp_path / f"pycoll-{n}.json", 3 * 3600)
    lost = {
        name: mine["tests"][name]["reason"]
        for name, o in gloo["tests"].items()
        if o["status"] == "pass" and mine["tests"][name]["status"] != "pass"
    }
    assert set(lost) <= set(KNOWN), {k: v for k, v in lost.items() if k not in KNOWN}
