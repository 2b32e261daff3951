"""Run ``sweep.py`` across simulated hosts: network namespaces joined by veth links.

Each host is its own network, UTS and IPC namespace (``tests/netns.py``) with
``eth0`` at 198.18.0.<i+1>; an optional ``tc`` rate limit shapes every host link.
pycoll picks tcp between hosts by itself (shm inside a host); Gloo is pointed
at ``eth0``, and MPICH is told to treat every rank as remote
(``MPIR_CVAR_NOLOCAL=1``, libfabric's tcp provider on ``eth0``) so that all
three systems cross the same links.  Needs root.

    python benchmarks/multihost.py --hosts 2 [--rate 1gbit] -- allreduce -b 8 -e 64M ...
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests import netns  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--hosts", type=int, default=2)
    ap.add_argument("--ranks-per-host", type=int, default=1)
    ap.add_argument("--rate", default=None, help="tc rate per host link, e.g. 1gbit")
    ap.add_argument("--timeout", type=float, default=1200.0)
    ap.add_argument(
        "sweep_args", nargs=argparse.REMAINDER, help="arguments for sweep.py (after --)"
    )
    a = ap.parse_args()
    args = [x for x in a.sweep_args if x != "--"]
    reason = netns.unavailable_reason()
    if reason:
        print(f"cannot build simulated hosts: {reason}", file=sys.stderr)
        return 2
    env = {
        "PYTHONPATH": str(ROOT),
        "PYCOLL_SOCKET_IFNAME": "eth0",
        "GLOO_SOCKET_IFNAME": "eth0",
        "MASTER_ADDR": f"{netns.SUBNET}.1",
        # MPICH: no shared memory between "hosts"; libfabric tcp on the veth
        "MPIR_CVAR_NOLOCAL": "1",
        "FI_PROVIDER": "tcp",
        "FI_TCP_IFACE": "eth0",
    }
    argv = [sys.executable, str(ROOT / "benchmarks" / "sweep.py"), *args]
    with netns.SimulatedHosts(a.hosts, rate=a.rate) as sim:
        res = sim.run(a.ranks_per_host, argv, env=env, timeout=a.timeout, cwd=str(ROOT))
    sys.stdout.write(res.stdout)
    sys.stderr.write(res.stderr[-4000:] if res.returncode else "")
    return res.returncode


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
