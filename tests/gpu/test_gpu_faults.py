"""A peer that exits without ``close()`` before or during a device collective,
on every device path: the survivor's call raises PeerAbortedError (or
CollectiveTimeout) within the communicator's timeout, never hangs and never
returns a wrong sum, and ``close()`` returns and leaves nothing in /dev/shm.

Two ranks share the GPU, bootstrapped over a FileStore without MPI (a rank
that exits would make mpiexec end the job); tests/gpu/faults/device_rank.py is
one rank.  Run: ``python -m pytest tests/gpu/test_gpu_faults.py``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("cupy", reason="GPU tests need CuPy")

from pycoll.gpu import present

ROOT = Path(__file__).resolve().parents[2]
RANK = ROOT / "tests" / "gpu" / "faults" / "device_rank.py"
TIMEOUT = 8.0  # device_rank.py's
SLACK = 20.0

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.timeout(180),
    pytest.mark.skipif(not present(), reason="no CUDA device"),
]


@pytest.mark.parametrize("when", ["before", "during"])
@pytest.mark.parametrize("path", ["direct", "ring", "host", "staged"])
def test_peer_exits_in_a_device_collective(path: str, when: str, tmp_path: Path) -> None:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    for k in ("OMPI_COMM_WORLD_RANK", "PMI_RANK", "PYCOLL_TRANSPORT"):
        env.pop(k, None)
    procs = [
        subprocess.Popen(
            [sys.executable, str(RANK), str(tmp_path / "store"), str(r), "2", path, when],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in range(2)
    ]
    outs = [p.communicate(timeout=150) for p in procs]
    survivor = procs[0]
    report = [json.loads(line) for line in outs[0][0].splitlines() if line.startswith("{")]
    assert report, f"rank 0 reported nothing (rc {survivor.returncode}): {outs[0][1][-3000:]}"
    res = report[-1]
    print(path, when, json.dumps(res))  # the device log keeps what each path raised
    assert res["first"] == 3.0, res
    # only a call rank 1 took part in may complete, and then with the right sum
    assert res["completed"] in ([], [[3.0, 3.0]]), res
    assert when == "during" or res["completed"] == [], res
    assert res["error"] in ("PeerAbortedError", "CollectiveTimeout"), res
    if when == "during" and not res["completed"]:
        assert res["elapsed"] > 0.3, res  # it was inside the call when rank 1 died
    assert res["elapsed"] < TIMEOUT + SLACK, res
    assert res["close_s"] < SLACK, res
    assert res["segments"] == [], res
    assert procs[1].returncode == 3, outs[1][1][-2000:]
