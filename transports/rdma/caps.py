"""What this machine offers RDMA: GPUs, NICs, peer memory, dma-buf, PCIe distances.

Everything returns plain data (dataclasses); ``pycoll.info`` renders it as text
(``python -m pycoll info``).  Nothing here changes state, and CUDA and pyverbs
are imported only inside the functions that need them.
"""

from __future__ import annotations

import errno
import os
from dataclasses import dataclass, field
from typing import Any

PEERMEM_FILES = (
    "/sys/kernel/mm/memory_peers/nv_mem/version",
    "/sys/module/nvidia_peermem/version",
)
#: PCIe distance classes, nearest first (NCCL's topology names).
DISTANCES = ("PIX", "PXB", "PHB", "NODE", "SYS")


@dataclass
class GpuInfo:
    index: int
    name: str
    pci_bus_id: str
    dmabuf_supported: bool


@dataclass
class NicInfo:
    name: str
    pci_path: str | None
    dmabuf: bool | None = None  # None: not probed (no pyverbs)
    dmabuf_why: str = ""


@dataclass
class PathStatus:
    name: str  # "dmabuf", "gdr", "host"
    usable: bool
    reason: str


@dataclass
class Capabilities:
    gpus: list[GpuInfo] = field(default_factory=list)
    gpu_error: str = ""
    nics: list[NicInfo] = field(default_factory=list)
    pyverbs: str = ""  # "" when it imports, else why not
    peermem: str | None = None  # the file that proves it, or None
    distances: dict[tuple[int, str], str] = field(default_factory=dict)  # (gpu, nic) -> class
    paths: list[PathStatus] = field(default_factory=list)


# ------------------------------------------------------------------ pieces
def peermem_file() -> str | None:
    """The sysfs file showing an NVIDIA peer-memory client, or None."""
    for path in PEERMEM_FILES:
        if os.path.exists(path):
            return path
    return None


def detect_gpus() -> tuple[list[GpuInfo], str]:
    """CUDA devices through ``cuda.bindings`` (absent or failing: empty, with why)."""
    try:
        from cuda.bindings import driver as drv
    except ImportError:
        return [], "cuda.bindings is not installed"
    try:
        (err,) = drv.cuInit(0)
        if int(err):
            return [], f"cuInit failed: {err}"
        err, count = drv.cuDeviceGetCount()
        gpus = []
        for i in range(int(count)):
            _, dev = drv.cuDeviceGet(i)
            _, raw = drv.cuDeviceGetName(64, dev)
            name = bytes(raw).split(b"\0", 1)[0].decode(errors="replace")
            _, bus = drv.cuDeviceGetPCIBusId(32, dev)
            bus_id = (
                bus if isinstance(bus, str) else bytes(bus).split(b"\0", 1)[0].decode()
            ).lower()
            attr = drv.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED
            _, dmabuf = drv.cuDeviceGetAttribute(attr, dev)
            gpus.append(GpuInfo(i, name, bus_id, bool(dmabuf)))
        return gpus, ""
    except Exception as exc:  # driver present but broken: report, do not crash `info`
        return [], f"{type(exc).__name__}: {exc}"


def detect_nics() -> list[NicInfo]:
    """RDMA devices listed in /sys/class/infiniband."""
    root = "/sys/class/infiniband"
    if not os.path.isdir(root):
        return []
    out = []
    for name in sorted(os.listdir(root)):
        dev = os.path.join(root, name, "device")
        out.append(NicInfo(name, os.path.realpath(dev) if os.path.exists(dev) else None))
    return out


def probe_nic_dmabuf(verbs: Any, ctx: Any, pd: Any) -> tuple[bool, str]:
    """Ask the NIC whether ``ibv_reg_dmabuf_mr`` works: register fd -1.

    EBADF means the call reached a driver that handles dma-buf; EOPNOTSUPP or
    EPROTONOSUPPORT mean it does not.
    """
    cls = getattr(verbs, "DmaBufMR", None) if not isinstance(verbs, dict) else verbs.get("DmaBufMR")
    if cls is None:
        return False, "this pyverbs has no DmaBufMR"
    access = verbs.e.IBV_ACCESS_LOCAL_WRITE
    try:
        mr = cls(pd, 4096, access, -1, 0)
    except TypeError as exc:  # this pyverbs only takes its own DmaBuf objects
        return False, f"DmaBufMR does not accept an external fd ({exc})"
    except Exception as exc:
        code = getattr(exc, "error_code", None)
        if code == errno.EBADF:
            return True, "ibv_reg_dmabuf_mr(fd=-1) -> EBADF: supported"
        if code in (errno.EOPNOTSUPP, errno.EPROTONOSUPPORT):
            return (
                False,
                f"ibv_reg_dmabuf_mr(fd=-1) -> {errno.errorcode[code]}: not supported",
            )
        return False, f"ibv_reg_dmabuf_mr(fd=-1) failed unexpectedly: {exc}"
    mr.close()
    return False, "ibv_reg_dmabuf_mr(fd=-1) unexpectedly succeeded"


def _pci_chain(path: str) -> tuple[str, list[str]]:
    """(root complex, PCI devices from it down to ``path``'s device)."""
    parts = [p for p in os.path.realpath(path).split("/") if p]
    root = next((p for p in parts if p.startswith("pci")), "")
    devs = [p for p in parts if len(p) == 12 and p[4] == ":" and p[7] == ":" and p[10] == "."]
    return root, devs


def _numa(devpath: str) -> int:
    try:
        with open(os.path.join(devpath, "numa_node")) as f:
            return int(f.read().strip())
    except (OSError, ValueError):
        return -1


def pci_distance(gpu_path: str, nic_path: str) -> str:
    """NCCL-style distance between two PCI device paths: PIX, PXB, PHB, NODE or SYS.

    PIX: one PCIe switch between them; PXB: several switches, no host bridge;
    PHB: through the CPU's host bridge; NODE: different host bridges of one
    NUMA node; SYS: across the CPU interconnect.
    """
    groot, gchain = _pci_chain(gpu_path)
    nroot, nchain = _pci_chain(nic_path)
    if groot != nroot:
        same_node = _numa(gpu_path) == _numa(nic_path) != -1
        return "NODE" if same_node else "SYS"
    common = 0
    for a, b in zip(gchain, nchain, strict=False):
        if a != b:
            break
        common += 1
    if common == 0:
        return "PHB"
    if len(gchain) - common <= 2 and len(nchain) - common <= 2:
        return "PIX"
    return "PXB"


def distance_ok(dist: str, level: str) -> bool:
    """True when ``dist`` is at most ``level`` (``NCCL_NET_GDR_LEVEL`` semantics)."""
    level = level.upper()
    if level not in DISTANCES:
        level = "PXB"
    return DISTANCES.index(dist) <= DISTANCES.index(level)


# ------------------------------------------------------------------ the whole
def memory_paths(
    caps: Capabilities,
    *,
    provider: str = "pyverbs",
    soft_caps: frozenset[str] = frozenset(),
    gdr_level: str = "PXB",
    gpu: int = 0,
) -> list[PathStatus]:
    """Whether dmabuf, gdr and host can be used for GPU ``gpu``, and why not."""
    soft = provider == "soft"
    out = []
    g = next((x for x in caps.gpus if x.index == gpu), None)
    # dmabuf
    if g is None:
        out.append(
            PathStatus("dmabuf", False, f"no CUDA GPU {gpu} ({caps.gpu_error or 'none found'})")
        )
    elif not g.dmabuf_supported:
        out.append(
            PathStatus("dmabuf", False, "GPU reports CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED = 0")
        )
    elif soft:
        ok = "dmabuf" in soft_caps
        why = (
            "soft provider claims dma-buf import (emulated with CUDA copies)"
            if ok
            else ("soft provider does not claim dma-buf (set soft_caps=dmabuf)")
        )
        out.append(PathStatus("dmabuf", ok, why))
    elif not caps.nics:
        out.append(PathStatus("dmabuf", False, "no RDMA NIC"))
    else:
        nic_ok = [n for n in caps.nics if n.dmabuf]
        why = (
            nic_ok[0].dmabuf_why
            if nic_ok
            else (caps.nics[0].dmabuf_why or "NIC dma-buf support not probed")
        )
        out.append(PathStatus("dmabuf", bool(nic_ok), why))
    # gdr
    if g is None:
        out.append(PathStatus("gdr", False, f"no CUDA GPU {gpu}"))
    elif soft:
        ok = "peermem" in soft_caps
        why = (
            "soft provider claims peer memory (emulated with CUDA copies; PCIe distance not applicable)"
            if ok
            else ("soft provider does not claim peermem (set soft_caps=peermem)")
        )
        out.append(PathStatus("gdr", ok, why))
    elif caps.peermem is None:
        out.append(
            PathStatus(
                "gdr",
                False,
                f"no peer-memory module ({' or '.join(PEERMEM_FILES)} absent)",
            )
        )
    else:
        dists = [d for (gi, _), d in caps.distances.items() if gi == gpu]
        best = min(dists, key=DISTANCES.index) if dists else None
        if best is None:
            out.append(PathStatus("gdr", False, "GPU-NIC PCIe distance unknown"))
        elif not distance_ok(best, gdr_level):
            out.append(
                PathStatus(
                    "gdr",
                    False,
                    f"GPU-NIC distance {best} is beyond the GDR level {gdr_level}",
                )
            )
        else:
            out.append(
                PathStatus(
                    "gdr",
                    True,
                    f"peermem ({caps.peermem}), GPU-NIC distance {best} <= {gdr_level}",
                )
            )
    out.append(PathStatus("host", True, "always available (pinned host staging)"))
    return out


def detect(
    provider: str = "auto",
    soft_caps: frozenset[str] = frozenset(),
    gdr_level: str = "PXB",
) -> Capabilities:
    """Probe the machine.  ``provider`` as in ``PYCOLL_RDMA_PROVIDER``."""
    caps = Capabilities()
    caps.gpus, caps.gpu_error = detect_gpus()
    caps.nics = detect_nics()
    caps.peermem = peermem_file()
    try:
        from transports.rdma.verbs import _load_pyverbs

        verbs = _load_pyverbs()
        for nic in caps.nics:
            try:
                ctx = verbs.Context(name=nic.name)
                pd = verbs.PD(ctx)
                nic.dmabuf, nic.dmabuf_why = probe_nic_dmabuf(verbs, ctx, pd)
                pd.close()
                ctx.close()
            except Exception as exc:
                nic.dmabuf, nic.dmabuf_why = False, f"could not open {nic.name}: {exc}"
    except Exception as exc:
        caps.pyverbs = f"{type(exc).__name__}: {exc}"
    for g in caps.gpus:
        gpath = f"/sys/bus/pci/devices/{g.pci_bus_id}"
        for nic in caps.nics:
            if nic.pci_path and os.path.exists(gpath):
                caps.distances[(g.index, nic.name)] = pci_distance(gpath, nic.pci_path)
    effective = provider
    if provider == "auto":
        effective = "pyverbs" if not caps.pyverbs and caps.nics else "soft"
    caps.paths = memory_paths(caps, provider=effective, soft_caps=soft_caps, gdr_level=gdr_level)
    return caps
