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
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("cupy", reason="GPU tests need CuPy")

from pycoll.gpu import present

ROOT = Path(__file__).resolve().parents[2]
RANK = ROOT / "tests" / "gpu" / "faults" / "device_rank.py"
MISMATCH = ROOT / "tests" / "gpu" / "faults" / "mismatch_rank.py"
TIMEOUT = 8.0  # device_rank.py's
SLACK = 20.0

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.timeout(180),
    pytest.mark.skipif(not present(), reason="no CUDA device"),
]


@pytest.mark.parametrize(
    "path,exits",
    [("direct", 1), ("direct", 0), ("ring", 1), ("ring", 0), ("host", 1), ("staged", 1)],
)
@pytest.mark.parametrize("when", ["before", "during"])
def test_peer_exits_in_a_device_collective(
    path: str, exits: int, when: str, tmp_path: Path
) -> None:
    """``exits`` = 0 on ``direct``: the leader goes, and the survivor's call has
    already returned with its stream waiting for the leader's "done" word.
    The watchdog lets that stream go once it sees the leader gone, the output
    filled with NaN, and the next call raises."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    for k in ("OMPI_COMM_WORLD_RANK", "PMI_RANK", "PYCOLL_TRANSPORT"):
        env.pop(k, None)
    store = str(tmp_path / "store")
    procs = [
        subprocess.Popen(
            [sys.executable, str(RANK), store, str(r), "2", path, when, str(exits)],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in range(2)
    ]
    outs = [p.communicate(timeout=150) for p in procs]
    s = 1 - exits
    lines = outs[s][0].splitlines()
    report = [json.loads(line) for line in lines if line.startswith("{")]
    assert report, f"rank {s} reported nothing (rc {procs[s].returncode}): {outs[s][1][-3000:]}"
    res = report[-1]
    print(path, when, exits, json.dumps(res))  # the device log keeps what each path raised
    assert res["first"] == 3.0, res
    # only a call the exiting rank took part in may complete, with the right sum;
    # one whose stream was let go (the leader exited) holds NaN, never a stale value
    done = res["completed"]
    poisoned = [c for c in done if all(math.isnan(v) for v in c)]
    assert len(done) <= 1 and all(c == [3.0, 3.0] or c in poisoned for c in done), res
    assert not poisoned or (path, exits) == ("direct", 0), res
    assert when == "during" or exits == 0 or done == [], res
    assert res["error"] in ("PeerAbortedError", "CollectiveTimeout"), res
    if when == "during" and exits == 1 and not done:
        assert res["elapsed"] > 0.3, res  # it was inside the call when rank 1 died
    assert res["elapsed"] < TIMEOUT + SLACK, res
    assert max(res["sync_s"], default=0.0) < TIMEOUT + SLACK, res
    assert res["close_s"] < SLACK and "close_error" not in res, res  # a call raised it
    assert res["segments"] == [], res
    assert procs[exits].returncode == 3, outs[exits][1][-2000:]


@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.parametrize("path", ["direct", "ring", "staged"])
def test_mismatched_device_calls_raise(path: str, n: int, tmp_path: Path) -> None:
    """Rank 0 calls an allreduce where the others call a broadcast of the same
    bytes, every rank on the one GPU (tests/gpu/faults/mismatch_rank.py): the
    calls never pair.  ``direct``: rank 0 raises CollectiveMismatchError
    before any byte moves, and every other rank raises within a few calls and
    the timeout.  ``ring`` and ``staged``: every rank raises, one of them the
    mismatch, and no byte reaches an array."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    for k in ("OMPI_COMM_WORLD_RANK", "PMI_RANK", "PYCOLL_TRANSPORT"):
        env.pop(k, None)
    procs = [
        subprocess.Popen(
            [sys.executable, str(MISMATCH), str(tmp_path / "store"), str(r), str(n), path],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in range(n)
    ]
    outs = [p.communicate(timeout=150) for p in procs]
    res = []
    for r, (o, e) in enumerate(outs):
        lines = [json.loads(line) for line in o.splitlines() if line.startswith("{")]
        assert lines, f"rank {r} reported nothing (rc {procs[r].returncode}): {e[-3000:]}"
        res.append(lines[-1])
        print(path, json.dumps(lines[-1]))  # the device log keeps what each rank raised
    raised = ("CollectiveMismatchError", "PeerAbortedError", "CollectiveTimeout")
    for r, got in enumerate(res):
        assert got["first"] == n * (n + 1) / 2, got
        assert got["error"] in raised, got
        assert got["elapsed"] < TIMEOUT + SLACK, got
        if "kept" in got:
            assert got["kept"] == [r + 1.0, r + 1.0], got
            assert got["close_s"] < SLACK, got
    if path == "direct":
        # rank 0 opens the others' windows; its calls name a peer's by fingerprint
        assert res[0]["error"] == "CollectiveMismatchError", res[0]
        assert "exposed its buffers for its call #2" in res[0]["message"], res[0]
    else:
        assert any(got["error"] == "CollectiveMismatchError" for got in res), res
