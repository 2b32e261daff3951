"""``python -m pycoll info``: the machine report, its flags and its JSON."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from pycoll import info
from pycoll.config import Config
from transports.rdma import caps

ROOT = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.timeout(120)


def _cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    full = {k: v for k, v in os.environ.items() if not k.startswith("PYCOLL_")}
    full["PYTHONPATH"] = str(ROOT)
    full.update(env or {})
    return subprocess.run(
        [sys.executable, "-m", "pycoll", *args],
        cwd=ROOT,
        env=full,
        capture_output=True,
        text=True,
        timeout=90,
    )


def test_info_json_has_every_section() -> None:
    proc = _cli("info", "--json")
    assert proc.returncode == 0, proc.stderr
    r = json.loads(proc.stdout)
    for key in ("pycoll", "numpy", "mpi4py", "MPI library", "cupy", "torch", "pyverbs"):
        assert r["versions"][key], key
    assert r["versions"]["pycoll"].startswith("0.")
    assert "MPI" in r["versions"]["MPI library"] or "unavailable" in r["versions"]["MPI library"]
    assert [t["name"] for t in r["transports"]] == ["shm", "rdma", "tcp", "cuda_ipc"]
    for t in r["transports"]:
        assert isinstance(t["usable"], bool) and t["why"], t
    assert r["tcp"]["usable"] and r["tcp"]["interfaces"]
    assert r["shm"]["size"] > 0 and r["shm"]["path"] == "/dev/shm"
    assert isinstance(r["cma"]["between_ranks"], bool) and r["cma"]["why"]
    assert "gpus" in r["topology"] and "nics" in r["topology"] and "pairs" in r["topology"]


def test_info_text_says_plainly_when_there_is_no_gpu_or_nic() -> None:
    proc = _cli("info")
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    for heading in ("versions:", "transports", "tcp interface:", "shared memory:", "GPUs:"):
        assert heading in out, heading
    assert "cross-memory attach" in out and "ptrace_scope" in out
    if not os.path.isdir("/sys/class/infiniband"):
        assert "RDMA NICs:\n  none" in out
        assert "no RDMA NIC here" in out, out
    if "GPUs:\n  none" in out:
        assert "no GPU" in out


def test_info_reads_versions_without_importing_torch_or_cupy() -> None:
    code = (
        "import sys; from pycoll import info; r = info.gather(); "
        "assert 'torch' not in sys.modules and 'cupy' not in sys.modules, "
        "[m for m in sys.modules if m.split('.')[0] in ('torch', 'cupy')]; "
        "assert 'mpi4py.MPI' in sys.modules; "
        "from mpi4py import MPI; assert not MPI.Is_initialized(), 'MPI_Init was called'; "
        "print(r['versions']['torch'])"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
        capture_output=True,
        text=True,
        timeout=90,
    )
    assert proc.returncode == 0, proc.stderr
    try:
        import importlib.metadata

        want = importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        want = "not installed"
    assert proc.stdout.strip() == want


def test_version_flag() -> None:
    proc = _cli("--version")
    assert proc.returncode == 0
    import pycoll

    assert proc.stdout.strip() == f"pycoll {pycoll.__version__} (distribution pycoll-collectives)"


@pytest.mark.parametrize(
    "args,says",
    [
        (["info", "--provider", "bogus"], "--provider: invalid choice"),
        (["info", "--soft-caps", "magic"], "--soft-caps: invalid choice"),
        (["info", "--gdr-level", "far"], "--gdr-level: invalid choice"),
        (["info", "--jsn"], "unrecognized arguments"),
        (["inof"], "invalid choice"),
    ],
)
def test_unknown_flag_values_are_rejected(args: list[str], says: str) -> None:
    proc = _cli(*args)
    assert proc.returncode == 2 and says in proc.stderr, proc.stderr


def test_a_bad_variable_is_an_error_not_a_traceback() -> None:
    proc = _cli("info", env={"PYCOLL_TRANSPORT": "pigeon"})
    assert proc.returncode == 2 and "PYCOLL_TRANSPORT='pigeon'" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize("args", [["--help"], ["info", "--help"]])
def test_help_has_no_rst_markup(args: list[str]) -> None:
    proc = _cli(*args)
    assert proc.returncode == 0
    for mark in ("``", ":mod:", ":func:", ":class:"):
        assert mark not in proc.stdout, (mark, proc.stdout)
    if "info" in args:
        assert "--json" in proc.stdout and "--provider {auto,pyverbs,soft}" in proc.stdout


def test_soft_provider_makes_rdma_usable_and_flags_win_over_the_environment() -> None:
    proc = _cli(
        "info",
        "--json",
        "--provider",
        "soft",
        "--soft-caps",
        "DMABUF",
        env={"PYCOLL_RDMA_PROVIDER": "pyverbs"},
    )
    assert proc.returncode == 0, proc.stderr
    r = json.loads(proc.stdout)
    rdma = next(t for t in r["transports"] if t["name"] == "rdma")
    assert rdma["usable"] and "soft provider" in rdma["why"], rdma
    assert r["config"]["rdma_provider"] == "soft" and r["config"]["rdma_soft_caps"] == "dmabuf"


def test_transport_off_in_the_environment_is_marked() -> None:
    proc = _cli("info", env={"PYCOLL_TRANSPORT": "tcp"})
    assert proc.returncode == 0, proc.stderr
    shm = next(line for line in proc.stdout.splitlines() if line.startswith("  shm "))
    assert "[off: not in PYCOLL_TRANSPORT" in shm, shm


def test_tcp_interface_follows_socket_ifname() -> None:
    r = info.tcp_status(Config(socket_ifname="lo"))
    assert r["usable"] and r["interfaces"] == ["lo"] and r["loopback_only"]
    assert "loopback only" in r["why"]
    bad = info.tcp_status(Config(socket_ifname="=nosuchif0"))
    assert not bad["usable"] and "matches no up interface" in bad["why"]


def test_each_gpu_nic_pair_gets_its_distance_and_memory_path(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Two NICs, one near GPU 0 with dma-buf, one across the sockets without."""

    def fake_detect(provider: str, soft_caps: Any, gdr_level: str) -> caps.Capabilities:
        c = caps.Capabilities(
            gpus=[caps.GpuInfo(0, "H200", "0000:1b:00.0", True)],
            nics=[
                caps.NicInfo("mlx5_0", "/sys/x/mlx5_0", True, "EBADF: supported"),
                caps.NicInfo("mlx5_1", "/sys/y/mlx5_1", False, "EOPNOTSUPP: not supported"),
            ],
            peermem="/sys/module/nvidia_peermem/version",
            distances={(0, "mlx5_0"): "PIX", (0, "mlx5_1"): "SYS"},
        )
        c.paths = caps.memory_paths(c, provider="pyverbs", gdr_level=gdr_level)
        return c

    monkeypatch.setattr(caps, "detect", fake_detect)
    topo = info.topology("pyverbs", frozenset(), "PXB")
    pairs = {(p["gpu"], p["nic"]): p for p in topo["pairs"]}
    assert pairs[(0, "mlx5_0")]["distance"] == "PIX" and pairs[(0, "mlx5_0")]["path"] == "dmabuf"
    far = pairs[(0, "mlx5_1")]
    assert far["distance"] == "SYS" and far["path"] == "host", far
    assert "beyond the GDR level PXB" in far["refused"]["gdr"]
    text = info.render(
        {
            "host": "h",
            "versions": {"pycoll": "0"},
            "config": {"transports": ["shm"]},
            "transports": [],
            "tcp": {"usable": False, "why": "x"},
            "shm": {"path": "/dev/shm", "size": 1 << 30, "free": 1 << 30, "writable": True},
            "cma": {
                "between_ranks": True,
                "why": "w",
                "ptrace_scope": 1,
                "cap_sys_ptrace": True,
                "syscall_why": "works",
            },
            "topology": topo,
        }
    )
    assert "GPU0" in text and "mlx5_0" in text and "PIX" in text and "SYS" in text
    assert "GPU0 - mlx5_0: dmabuf" in text and "GPU0 - mlx5_1: host" in text


def test_cma_verdict_follows_ptrace_scope(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    scope = tmp_path / "ptrace_scope"
    monkeypatch.setattr(info, "YAMA_SCOPE", str(scope))
    for value, cap, permitted in [
        ("0", False, True),
        ("1", False, False),
        ("1", True, True),
        ("2", True, True),
        ("3", True, False),
    ]:
        scope.write_text(value + "\n")
        monkeypatch.setattr(info, "_cap_sys_ptrace", lambda cap=cap: cap)
        r = info.cma_status()
        assert r["ptrace_scope"] == int(value)
        if r["syscall"]:
            assert r["between_ranks"] is permitted, (value, cap, r)
