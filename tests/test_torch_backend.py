"""pycoll as a torch.distributed backend: DDP over pycoll vs DDP over Gloo.

tests/torchdist/ddp_train.py runs under ``mpiexec -n 2``: it checks every
collective of the backend, then trains the same model with DDP on a pycoll
group and on a Gloo group (same seed, same shards).  With two ranks every
allreduce is one addition of two float32 values, which is commutative, so
both backends must produce bitwise-identical weights (tolerance: zero).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests.launch import mpiexec, reports

pytest.importorskip(
    "torch", reason="torch is not installed (pip install 'pycoll-collectives[torch]')"
)

ROOT = Path(__file__).resolve().parent.parent


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_import_pycoll_does_not_import_torch() -> None:
    code = "import sys, pycoll; assert 'torch' not in sys.modules, 'pycoll imported torch'"
    proc = subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr


@pytest.mark.timeout(240)
def test_ddp_pycoll_matches_gloo(tmp_path: Path) -> None:
    out = tmp_path / "ddp.json"
    cmd = mpiexec(2) + [
        sys.executable,
        "-m",
        "mpi4py",
        str(ROOT / "tests" / "torchdist" / "ddp_train.py"),
        "--steps",
        "5",
        "--out",
        str(out),
    ]
    env = dict(
        os.environ, PYTHONPATH=str(ROOT), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port())
    )
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=220)
    assert proc.returncode == 0, (
        f"rc={proc.returncode}\n{proc.stdout[-4000:]}\n{proc.stderr[-6000:]}"
    )
    res = json.loads(out.read_text())
    assert res["replicas_identical"], res
    assert res["identical"], f"DDP over pycoll differs from DDP over gloo: {res}"
    assert res["max_abs_diff"] == 0.0, res


@pytest.mark.timeout(120)
def test_rank_mismatch_is_a_clear_error() -> None:
    """One process under mpiexec (MPI world of 1) that claims to be rank 1 of 2 must
    be refused."""
    code = (
        "import torch.distributed as dist, pycoll.torch_backend as tb\n"
        "tb.register()\n"
        "store = dist.HashStore()\n"
        "try:\n"
        "    dist.init_process_group('pycoll', store=store, rank=1, world_size=2)\n"
        "except RuntimeError as e:\n"
        "    assert 'mpiexec' in str(e) and 'rank 1 of 2' in str(e), e\n"
        "    print('refused:', e)\n"
        "else:\n"
        "    raise SystemExit('accepted a rank that MPI does not have')\n"
    )
    proc = subprocess.run(
        mpiexec(1) + [sys.executable, "-c", code],
        cwd=ROOT,
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
        capture_output=True,
        text=True,
        timeout=100,
    )
    assert proc.returncode == 0, f"{proc.stdout}\n{proc.stderr[-4000:]}"
    assert "refused" in proc.stdout


@pytest.mark.timeout(180)
def test_bitwise_ops_and_new_dtypes() -> None:
    """BAND, BOR, BXOR and bool, int16, uint16, complex all_reduce at n = 2, through
    torch.distributed (tests/torchdist/ops_dtypes.py)."""
    cmd = mpiexec(2) + [
        sys.executable,
        "-m",
        "mpi4py",
        str(ROOT / "tests" / "torchdist" / "ops_dtypes.py"),
    ]
    env = dict(
        os.environ, PYTHONPATH=str(ROOT), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port())
    )
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=160)
    assert proc.returncode == 0, (
        f"rc={proc.returncode}\n{proc.stdout[-4000:]}\n{proc.stderr[-6000:]}"
    )
    assert proc.stdout.count("ok") == 2, proc.stdout


LAUNCH = str(ROOT / "tests" / "torchdist" / "launch_allreduce.py")


def _bare_env() -> dict[str, str]:
    """The environment without torch's rendezvous variables."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    }
    env["PYTHONPATH"] = str(ROOT)
    return env


@pytest.mark.timeout(120)
def test_torchrun_launch_bootstraps_from_torchs_store() -> None:
    """torchrun, no MPI: the backend bootstraps over the store torch hands it."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    proc = subprocess.run(
        [*cmd, LAUNCH], cwd=ROOT, env=_bare_env(), capture_output=True, text=True, timeout=100
    )
    res = reports(proc.stdout)
    assert set(res) == {0, 1}, f"rc={proc.returncode}\n{proc.stdout}\n{proc.stderr[-4000:]}"
    for o in res.values():
        assert o["sum"] == [1.0, 3.0, 5.0, 7.0] and o["sub"] == [2.0, 2.0, 2.0], o
        assert o["mpi4py"] is False, "the torchrun launch imported mpi4py"


@pytest.mark.timeout(120)
def test_mpiexec_launch_needs_neither_rank_nor_master_addr() -> None:
    proc = subprocess.run(
        mpiexec(3) + [sys.executable, LAUNCH],
        cwd=ROOT,
        env=_bare_env(),
        capture_output=True,
        text=True,
        timeout=100,
    )
    res = reports(proc.stdout)
    assert set(res) == {0, 1, 2}, f"rc={proc.returncode}\n{proc.stdout}\n{proc.stderr[-4000:]}"
    for r, o in res.items():
        assert o["env"] == {"RANK": None, "MASTER_ADDR": None}, o
        assert o["size"] == 3 and o["sum"] == [3.0, 6.0, 9.0, 12.0], o
        assert o["sub"] == ([2.0] * 3 if r < 2 else [1.0] * 3), o
