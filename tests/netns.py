"""Simulated hosts on one machine: network, UTS and IPC namespaces.

Each simulated host ``h<i>`` is

* a network namespace ``pycoll-h<i>-<tag>`` with loopback up and one ``eth0``
  (a veth pair) at ``198.18.0.<i+1>/24`` (RFC 2544 benchmarking space: no real
  network uses it), optionally shaped by ``tc qdisc ... tbf``;
* persistent UTS and IPC namespaces (bind-mounted under
  ``/run/pycoll-sim-<tag>``) holding its hostname and its System V / POSIX IPC.

All ranks of one host enter the *same* namespaces (``nsenter``), so they look
like one host to each other and like different hosts to everyone else.  The
filesystem, ``/dev/shm`` included, stays shared: MPICH's ``mpiexec`` runs every
rank under one local proxy, so MPICH itself treats them as one node and needs a
common ``/dev/shm`` for its own channel (a private tmpfs per host hangs
``MPI_Init``).  pycoll's shm transport must therefore tell hosts apart by the
IPC and network namespaces, not by ``/dev/shm`` alone.
The veth peers sit on a bridge in a namespace of their own
(``pycoll-br-<tag>``), so nothing touches the machine's own interfaces.  The tag
is random, so parallel runs do not collide, and :class:`SimulatedHosts` always
tears everything down (context manager, ``try``/``finally``).

Ranks are launched with MPICH's ``mpiexec`` in MPMD form, one block per host::

    mpiexec -n 2 nsenter --net=... --uts=... --ipc=... -- python x.py \
          : -n 2 nsenter ... -- python x.py

MPICH's own wire-up (PMI over the fd it hands each rank) works across them.

Needs root, ``ip``, ``tc`` (only when shaping), ``unshare`` and ``nsenter``.
:func:`unavailable_reason` says why not, for a pytest skip.
"""

from __future__ import annotations

import contextlib
import functools
import os
import secrets
import shutil
import signal
import subprocess
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from typing import Self  # 3.11; annotations only (3.10 has none)

#: The only addresses the harness assigns (besides loopback): 198.18.0.0/24,
#: inside the benchmarking range 198.18.0.0/15.
SUBNET = "198.18.0"
PREFIX = 24
MAX_HOSTS = 200

_TOOLS = ("ip", "unshare", "nsenter", "mount", "umount")


def _run(*argv: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, check=check, capture_output=True, text=True, timeout=30)


def mpiexec_path() -> str | None:
    """MPICH's ``mpiexec`` next to this Python, else the one on PATH."""
    here = Path(sys.executable).with_name("mpiexec")
    return str(here) if here.exists() else shutil.which("mpiexec")


@functools.cache
def unavailable_reason() -> str | None:
    """None when simulated hosts can be built here, else why not (for a skip)."""
    if sys.platform != "linux":
        return "simulated hosts need Linux namespaces"
    if os.geteuid() != 0:
        return "simulated hosts need root (ip netns, unshare, mount)"
    missing = [t for t in _TOOLS if shutil.which(t) is None]
    if missing:
        return f"simulated hosts need {', '.join(missing)} on PATH"
    if mpiexec_path() is None:
        return "simulated hosts need MPICH's mpiexec (pip install mpich)"
    probe = f"pycoll-probe-{secrets.token_hex(4)}"
    try:
        r = _run("ip", "netns", "add", probe, check=False)
        if r.returncode != 0:
            return f"'ip netns add' fails here: {r.stderr.strip()}"
        r = _run(
            "ip",
            "-n",
            probe,
            "link",
            "add",
            "p0",
            "type",
            "veth",
            "peer",
            "name",
            "p1",
            check=False,
        )
        if r.returncode != 0:
            return f"cannot create veth pairs here: {r.stderr.strip()}"
    finally:
        _run("ip", "netns", "del", probe, check=False)
    return None


def require() -> None:
    """Skip the calling test when simulated hosts are unavailable."""
    import pytest

    reason = unavailable_reason()
    if reason is not None:
        pytest.skip(reason)


@dataclass(frozen=True)
class SimHost:
    """One simulated host.

    Attributes:
        index: position in the topology.
        hostname: its UTS hostname (``h<index>``).
        netns: the network namespace's name.
        address: its IPv4 address on the shared bridge.
        nsdir: where its UTS and IPC namespace files live.
    """

    index: int
    hostname: str
    netns: str
    address: str
    nsdir: Path

    def ns_file(self, kind: str) -> Path:
        return self.nsdir / f"{self.hostname}.{kind}"

    def wrap(self, argv: Sequence[str], cwd: str | None = None) -> list[str]:
        """``argv`` run inside this host's namespaces, in ``cwd`` (default: ours).

        ``nsenter`` is told the directory explicitly so the ranks do not
        depend on where it happens to start them.
        """
        return [
            "nsenter",
            f"--net=/run/netns/{self.netns}",
            f"--uts={self.ns_file('uts')}",
            f"--ipc={self.ns_file('ipc')}",
            f"--wd={cwd or os.getcwd()}",
            "--",
            *argv,
        ]


class SimulatedHosts:
    """N simulated hosts on one bridge; a context manager that always cleans up.

    Args:
        nhosts: how many hosts.
        rate: optional ``tc`` rate per host link, e.g. ``"1gbit"``.
        delay: optional one-way delay per host link, e.g. ``"100us"`` (netem).
    """

    def __init__(
        self,
        nhosts: int,
        *,
        rate: str | None = None,
        delay: str | None = None,
    ) -> None:
        if not 1 <= nhosts <= MAX_HOSTS:
            raise ValueError(f"nhosts must be in 1..{MAX_HOSTS}, got {nhosts}")
        self.tag = secrets.token_hex(4)
        self.bridge_ns = f"pycoll-br-{self.tag}"
        self.nsdir = Path(f"/run/pycoll-sim-{self.tag}")
        self.rate = rate
        self.delay = delay
        self.hosts = [
            SimHost(i, f"h{i}", f"pycoll-h{i}-{self.tag}", f"{SUBNET}.{i + 1}", self.nsdir)
            for i in range(nhosts)
        ]
        self._netns: list[str] = []
        self._mounts: list[Path] = []

    # ----------------------------------------------------------------- setup
    def __enter__(self) -> Self:
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _add_netns(self, name: str) -> None:
        _run("ip", "netns", "add", name)
        self._netns.append(name)
        _run("ip", "-n", name, "link", "set", "lo", "up")

    def _build(self) -> None:
        # A private mount point for the namespace files, as `ip netns` does for
        # /run/netns: binding a namespace file onto a shared mount would loop.
        self.nsdir.mkdir(mode=0o700)
        _run("mount", "--bind", str(self.nsdir), str(self.nsdir))
        self._mounts.append(self.nsdir)
        _run("mount", "--make-private", str(self.nsdir))

        self._add_netns(self.bridge_ns)
        br = self.bridge_ns
        _run("ip", "-n", br, "link", "add", "br0", "type", "bridge")
        _run("ip", "-n", br, "link", "set", "br0", "up")
        for h in self.hosts:
            self._add_netns(h.netns)
            # Both veth ends are born outside the root namespace.
            port = f"p{h.index}"
            _run("ip", "-n", br, "link", "add", port, "type", "veth", "peer", "name", "eth0",
                 "netns", h.netns)  # fmt: skip
            _run("ip", "-n", br, "link", "set", port, "master", "br0", "up")
            _run(
                "ip",
                "-n",
                h.netns,
                "addr",
                "add",
                f"{h.address}/{PREFIX}",
                "dev",
                "eth0",
            )
            _run("ip", "-n", h.netns, "link", "set", "eth0", "up")
            self._shape(h)
            self._host_namespaces(h)

    def _shape(self, h: SimHost) -> None:
        if self.rate is None and self.delay is None:
            return
        cmd = ["tc", "-n", h.netns, "qdisc", "add", "dev", "eth0", "root"]
        if self.delay is not None:
            cmd += ["handle", "1:", "netem", "delay", self.delay]
            if self.rate is not None:
                cmd += ["rate", self.rate]
        else:
            assert self.rate is not None
            cmd += ["tbf", "rate", self.rate, "burst", "256kb", "latency", "50ms"]
        _run(*cmd)

    def _host_namespaces(self, h: SimHost) -> None:
        files = [h.ns_file(k) for k in ("uts", "ipc")]
        for f in files:
            f.touch()
        self._mounts[:0] = files  # unmounted before the directory
        _run("unshare", f"--uts={files[0]}", f"--ipc={files[1]}", "hostname", h.hostname)

    # ----------------------------------------------------------------- teardown
    def close(self) -> None:
        """Remove every namespace, mount and directory made here; idempotent."""
        errors = []
        for m in self._mounts:
            r = _run("umount", "-l", str(m), check=False)
            if r.returncode != 0 and "not mounted" not in r.stderr:
                errors.append(f"umount {m}: {r.stderr.strip()}")
        self._mounts.clear()
        for name in reversed(self._netns):
            r = _run("ip", "netns", "del", name, check=False)
            if r.returncode != 0:
                errors.append(f"ip netns del {name}: {r.stderr.strip()}")
        self._netns.clear()
        if self.nsdir.exists():
            shutil.rmtree(self.nsdir, ignore_errors=True)
        if errors:
            print("netns teardown: " + "; ".join(errors), file=sys.stderr)

    # ----------------------------------------------------------------- launching
    def mpiexec_argv(
        self,
        ranks_per_host: int | Sequence[int],
        argv: Sequence[str],
        cwd: str | None = None,
    ) -> list[str]:
        """An MPMD ``mpiexec`` command line: ranks fill hosts in order.

        Args:
            ranks_per_host: one count for every host, or one per host.
            argv: the program each rank runs, e.g. ``[sys.executable, "x.py"]``.
            cwd: the ranks' working directory (default: ours).
        """
        counts = (
            [ranks_per_host] * len(self.hosts)
            if isinstance(ranks_per_host, int)
            else list(ranks_per_host)
        )
        if len(counts) != len(self.hosts) or min(counts) < 0 or sum(counts) == 0:
            raise ValueError(f"bad ranks_per_host {ranks_per_host!r} for {len(self.hosts)} hosts")
        mpiexec = mpiexec_path()
        if mpiexec is None:
            raise RuntimeError("MPICH's mpiexec is not installed")
        out = [mpiexec]
        for h, n in zip(self.hosts, counts, strict=True):
            if n == 0:
                continue
            if len(out) > 1:
                out.append(":")
            out += ["-n", str(n), *h.wrap(argv, cwd)]
        return out

    def run(
        self,
        ranks_per_host: int | Sequence[int],
        argv: Sequence[str],
        *,
        env: Mapping[str, str] | None = None,
        timeout: float = 120.0,
        cwd: str | None = None,
    ) -> subprocess.CompletedProcess[str]:
        """Run ``argv`` under ``mpiexec`` across the hosts; kill it all on timeout.

        ``env`` is added to this process's environment; MPICH passes the whole
        environment on to every rank.

        Raises:
            subprocess.TimeoutExpired: after killing the whole process group.
        """
        cmd = self.mpiexec_argv(ranks_per_host, argv, cwd)
        return run_command(cmd, env=env, timeout=timeout, cwd=cwd)


def run_command(
    cmd: Sequence[str],
    *,
    env: Mapping[str, str] | None = None,
    timeout: float = 120.0,
    cwd: str | None = None,
    before_kill: Callable[[], None] | None = None,
) -> subprocess.CompletedProcess[str]:
    """Run ``cmd`` (a launcher and its ranks) with ``env`` added to ours; on a
    timeout kill its whole process group (``before_kill`` first, say to make
    the ranks write their stacks).

    Raises:
        subprocess.TimeoutExpired: after killing the whole process group.
    """
    full_env = dict(os.environ)
    full_env.update(env or {})
    proc = subprocess.Popen(
        cmd,
        env=full_env,
        cwd=cwd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # so a timeout can kill every rank at once
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        if before_kill is not None:
            before_kill()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        raise subprocess.TimeoutExpired(cmd, timeout, out, err) from None
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)
