"""Several simulated hosts on this machine: tcp between hosts, shm inside one.

Each test builds hosts with :mod:`tests.netns` (network, UTS and IPC namespaces
joined by a bridge on 198.18.0.0/24) and runs a script from
``tests/multihost/`` under MPICH's ``mpiexec``, one MPMD block per host.  Skipped
with the reason when namespaces cannot be created (not root, no ``ip``...).
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests import netns

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = Path(__file__).resolve().parent / "multihost"

pytestmark = pytest.mark.timeout(300)

LAYOUTS = {"2x2": [2, 2], "4x1": [1, 1, 1, 1]}


def _host_of(rank: int, layout: list[int]) -> int:
    for h, n in enumerate(layout):
        if rank < n:
            return h
        rank -= n
    raise ValueError(rank)


def _run(layout: list[int], script: str, env: dict[str, str], tmp_path: Path) -> str:
    """Run ``script`` on simulated hosts; return its stderr (the logs), or fail loudly."""
    netns.require()
    base = {
        "PYTHONPATH": str(ROOT),
        "PYCOLL_TEST_HOSTS": ",".join(map(str, layout)),
        "PYCOLL_TIMEOUT": "60",
        "PYCOLL_DEBUG": "INFO",
    }
    base.update(env)
    argv = [sys.executable, "-m", "mpi4py", str(SCRIPTS / script)]
    with netns.SimulatedHosts(len(layout)) as sim:
        try:
            res = sim.run(layout, argv, env=base, timeout=240, cwd=str(ROOT))
        except subprocess.TimeoutExpired as exc:
            (tmp_path / "stderr.log").write_text(str(exc.stderr or ""))
            pytest.fail(f"{script} on {layout} hung; logs in {tmp_path / 'stderr.log'}")
    (tmp_path / "stdout.log").write_text(res.stdout)
    (tmp_path / "stderr.log").write_text(res.stderr)
    nranks = sum(layout)
    # Ranks share one stdout pipe, so lines may interleave: no anchors.
    oks = set(re.findall(r"OK rank (\d+)", res.stdout))
    assert res.returncode == 0 and len(oks) == nranks, (
        f"{script} on {layout} failed (rc {res.returncode}, {len(oks)}/{nranks} ranks OK)\n"
        f"--- stdout\n{res.stdout[-3000:]}\n--- stderr\n{res.stderr[-6000:]}"
    )
    return res.stderr


@pytest.mark.parametrize("layout", LAYOUTS.values(), ids=LAYOUTS.keys())
def test_tcp_transport_across_hosts(layout: list[int], tmp_path: Path) -> None:
    """The transport alone (no pycoll): every pair connects and swaps data."""
    _run(layout, "tcp_ring.py", {}, tmp_path)


@pytest.mark.parametrize("algo", ["ring", "tree"])
@pytest.mark.parametrize("layout", LAYOUTS.values(), ids=LAYOUTS.keys())
def test_collectives_across_hosts(layout: list[int], algo: str, tmp_path: Path) -> None:
    """Every collective against NumPy; shm inside a host, tcp between hosts."""
    logs = _run(
        layout,
        "collectives.py",
        {"PYCOLL_TRANSPORT": "shm,tcp", "PYCOLL_ALGO": algo},
        tmp_path,
    )
    # The per-peer choice is logged at INFO by every rank; check all of it.
    chosen = {
        (int(a), int(b)): kind
        for a, b, kind in re.findall(r"rank (\d+) -> (\d+): using ([\w:]+)", logs)
    }
    n = sum(layout)
    for a in range(n):
        for b in range(n):
            if a != b:
                want = "shm" if _host_of(a, layout) == _host_of(b, layout) else "tcp"
                assert chosen.get((a, b)) == want, (a, b, chosen.get((a, b)), want)


@pytest.mark.parametrize("layout", LAYOUTS.values(), ids=LAYOUTS.keys())
def test_rdma_soft_across_hosts(layout: list[int], tmp_path: Path) -> None:
    """shm inside a host, RDMA (soft provider) between hosts, bound to 198.18.0.x."""
    logs = _run(
        layout,
        "collectives.py",
        {
            "PYCOLL_TRANSPORT": "shm,rdma",
            "PYCOLL_RDMA_PROVIDER": "soft",
            "PYCOLL_SOCKET_IFNAME": "eth0",
            "PYCOLL_TEST_OTHER_HOST": "rdma:host",
        },
        tmp_path,
    )
    # Each rank's soft NIC listens on its own host's bench address, nothing else.
    bound = {
        int(r): addr
        for r, addr in re.findall(
            r"rdma: rank (\d+) listening via soft \(soft0\) at ([\d.]+)", logs
        )
    }
    assert sorted(bound) == list(range(sum(layout))), bound
    for r, addr in bound.items():
        assert addr == f"{netns.SUBNET}.{_host_of(r, layout) + 1}", (r, addr)


#: README's multi-node recipe: the lines a user types, host names aside.
RECIPE = "PYCOLL_SOCKET_IFNAME=eth0 .venv/bin/mpiexec -f hosts -iface eth0 -n 8"


@pytest.mark.parametrize("how", ["hostfile", "hosts"])
def test_readme_multinode_recipe(how: str, tmp_path: Path) -> None:
    """README's recipe on two simulated hosts, as a user runs it on two machines:
    mpiexec on the first host starts the second's ranks through its ssh launcher
    (here ``multihost/netns_ssh.sh``, which enters that host's namespaces), with
    a hostfile or ``-hosts``; ranks of a host pair over shm, the others over tcp
    on the interface PYCOLL_SOCKET_IFNAME names."""
    netns.require()
    readme = (ROOT / "README.md").read_text()
    assert RECIPE in readme and "-hosts node1:4,node2:4" in readme
    layout = [2, 2]
    with netns.SimulatedHosts(len(layout)) as sim:
        if how == "hostfile":
            hostfile = tmp_path / "hosts"
            hostfile.write_text("".join(f"{h.hostname}:{n}\n" for h, n in zip(sim.hosts, layout)))
            where = ["-f", str(hostfile)]
        else:
            where = ["-hosts", ",".join(f"{h.hostname}:{n}" for h, n in zip(sim.hosts, layout))]
        mpiexec = netns.mpiexec_path()
        assert mpiexec is not None
        launcher = ["-launcher", "ssh", "-launcher-exec", str(SCRIPTS / "netns_ssh.sh")]
        argv = [mpiexec, *launcher, *where, "-iface", "eth0", "-n", str(sum(layout))]
        argv += [sys.executable, str(ROOT / "examples" / "example.py")]
        env = {
            "PYTHONPATH": str(ROOT),
            "PYCOLL_SOCKET_IFNAME": "eth0",
            "PYCOLL_TIMEOUT": "60",
            "PYCOLL_TEST_SIM_TAG": sim.tag,
        }
        try:
            res = netns.run_command(sim.hosts[0].wrap(argv, str(ROOT)), env=env, timeout=240)
        except subprocess.TimeoutExpired as exc:
            pytest.fail(f"the recipe hung:\n{str(exc.stdout or '')[-3000:]}\n{exc.stderr!s}")
    assert res.returncode == 0, f"{res.stdout[-3000:]}\n{res.stderr[-3000:]}"
    n = sum(layout)
    for r in range(n):
        kinds = [
            "self" if p == r else "shm" if _host_of(p, layout) == _host_of(r, layout) else "tcp"
            for p in range(n)
        ]
        line = f"{r} {n * (n - 1) / 2} [{' '.join(map(str, range(n)))}] {kinds}\n"
        assert line in res.stdout, (line, res.stdout)  # ranks share stdout: no anchors
