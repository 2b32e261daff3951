"""Choose the verbs provider: real pyverbs or the soft provider, one API.

``options.get("rdma_provider", "auto")`` (pycoll fills it from
``PYCOLL_RDMA_PROVIDER``):

* ``pyverbs``: import rdma-core's pyverbs and open an HCA; fail loudly if none.
* ``soft``: :mod:`transports.rdma.soft`, the software emulation over TCP.
* ``auto``: pyverbs when it imports and lists a device; otherwise the transport
  is unavailable (the soft provider is an emulation, slower than tcp, used only
  when asked for), so transport selection moves on to tcp.

Both expose the same names (``Context``, ``PD``, ``MR``, ``QP`` ...); the
``IBV_*`` constants come through :class:`Enums`, which reads either enum
layout of pyverbs (``pyverbs.libibverbs_enums`` from rdma-core 59, module
constants of ``pyverbs.enums`` before).
"""

from __future__ import annotations

import enum
import fcntl
import hashlib
import ipaddress
import logging
import os
import socket
import struct
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

from transports.base import TransportError, TransportOptions

log = logging.getLogger(__name__)

PROVIDERS = ("auto", "pyverbs", "soft")


class RdmaUnavailableError(TransportError):
    """No usable verbs provider (pyverbs missing, no HCA, bad provider name)."""


class Enums:
    """``IBV_*`` constants by name, whichever module layout holds them."""

    def __init__(self, *modules: ModuleType) -> None:
        self._modules = modules
        self._cache: dict[str, int] = {}

    def __getattr__(self, name: str) -> int:
        if name.startswith("_"):
            raise AttributeError(name)
        try:
            return self._cache[name]
        except KeyError:
            pass
        for mod in self._modules:
            val: Any = getattr(mod, name, None)
            if val is None:  # rdma-core 59+: members of enum classes such as ibv_wr_opcode
                for obj in vars(mod).values():
                    if (
                        isinstance(obj, type)
                        and issubclass(obj, enum.Enum)
                        and name in obj.__members__
                    ):
                        val = obj.__members__[name]
                        break
            if val is not None:
                self._cache[name] = int(val)
                return int(val)
        raise AttributeError(f"no verbs constant {name}")

    def name_of(self, prefix: str, value: int, suffixes: tuple[str, ...] = ("",)) -> str:
        """The constant name of ``value`` among those starting with ``prefix`` (and
        ending with one of ``suffixes``: opcodes and statuses share a prefix)."""
        for mod in self._modules:
            names = list(dir(mod))
            for obj in vars(mod).values():  # rdma-core 59+: members of enum classes
                if isinstance(obj, type) and issubclass(obj, enum.Enum):
                    names.extend(k for k in obj.__members__ if k not in names)
            for key in names:
                if key.startswith(prefix) and key.endswith(suffixes):
                    try:
                        if int(getattr(self, key)) == value:
                            return key
                    except (AttributeError, TypeError, ValueError):
                        continue
        return f"{prefix}{value}"


@dataclass
class Verbs:
    """One provider's classes, constants and context options."""

    name: str  # "pyverbs" or "soft"
    ns: dict[str, Any]
    e: Enums
    context_kwargs: dict[str, Any] = field(default_factory=dict)
    device: str | None = None

    def __getattr__(self, item: str) -> Any:
        try:
            return self.ns[item]
        except KeyError:
            raise AttributeError(item) from None

    def open_context(self) -> Any:
        return self.ns["Context"](name=self.device, **self.context_kwargs)

    def wc_status_name(self, status: int) -> str:
        return self.e.name_of("IBV_WC_", status, ("_ERR", "SUCCESS"))


def _load_pyverbs() -> Verbs:
    """Import pyverbs; raise ImportError with the reason when it cannot be used."""
    import pyverbs.pyverbs_error as err
    from pyverbs import addr, cq, device, mr, pd, qp, wr

    mods: list[ModuleType] = []
    for modname in ("pyverbs.libibverbs_enums", "pyverbs.enums"):
        try:
            mods.append(__import__(modname, fromlist=["_"]))
        except ImportError:
            continue
    if not mods:
        raise ImportError("pyverbs has neither pyverbs.libibverbs_enums nor pyverbs.enums")
    ns = {
        "Context": device.Context,
        "get_device_list": device.get_device_list,
        "PD": pd.PD,
        "MR": mr.MR,
        "DmaBufMR": getattr(mr, "DmaBufMR", None),
        "CQ": cq.CQ,
        "QP": qp.QP,
        "QPInitAttr": qp.QPInitAttr,
        "QPCap": qp.QPCap,
        "QPAttr": qp.QPAttr,
        "AHAttr": addr.AHAttr,
        "GlobalRoute": addr.GlobalRoute,
        "GID": addr.GID,
        "SendWR": wr.SendWR,
        "RecvWR": wr.RecvWR,
        "SGE": wr.SGE,
        "PyverbsRDMAError": err.PyverbsRDMAError,
        "PyverbsError": err.PyverbsError,
    }
    return Verbs("pyverbs", ns, Enums(*mods))


def _load_soft(options: TransportOptions) -> Verbs:
    from transports.rdma import soft

    ns = {name: getattr(soft, name) for name in soft.__all__ if name != "enums"}
    caps = {c.strip() for c in (options.get("soft_caps", "") or "").split(",") if c.strip()}
    kwargs = {"soft_addr": soft_address(options), "soft_caps": caps, "soft_secret": options.secret}
    return Verbs("soft", ns, Enums(soft.enums), kwargs, device=soft.device.DEVICE_NAME)


# ----------------------------------------------------------- soft addressing
_SOFT_NETS = (
    ipaddress.ip_network("127.0.0.0/8"),
    ipaddress.ip_network("198.18.0.0/15"),
)
_BENCH_NET = ipaddress.ip_network("198.18.0.0/15")


def _ipv4_of(ifname: str) -> str | None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            res = fcntl.ioctl(
                s.fileno(), 0x8915, struct.pack("256s", ifname.encode()[:15])
            )  # SIOCGIFADDR
        except OSError:
            return None
    return socket.inet_ntoa(res[20:24])


def _interfaces() -> list[tuple[str, str]]:
    out = []
    for _, name in socket.if_nameindex():
        addr = _ipv4_of(name)
        if addr is not None:
            out.append((name, addr))
    return out


def _match_ifname(spec: str, name: str) -> bool:
    """NCCL-style interface selection: ``eth`` (prefix), ``=eth0`` (exact), ``^docker`` (exclude)."""
    if spec.startswith("^"):
        return not any(name.startswith(p) for p in spec[1:].split(","))
    if spec.startswith("="):
        return name in spec[1:].split(",")
    return any(name.startswith(p) for p in spec.split(","))


def soft_address(options: TransportOptions) -> str:
    """The address the soft provider binds: ``soft_addr``, else the interface
    chosen by ``socket_ifname``, else a 198.18.0.0/15 address if one exists (ranks
    in separate network namespaces), else 127.0.0.1.  Only loopback and
    198.18.0.0/15 are ever used."""
    explicit = options.get("soft_addr")
    if explicit:
        return explicit
    ifaces = [
        (n, a)
        for n, a in _interfaces()
        if any(ipaddress.ip_address(a) in net for net in _SOFT_NETS)
    ]
    if options.socket_ifname:
        chosen = [a for n, a in ifaces if _match_ifname(options.socket_ifname, n)]
        if chosen:
            return chosen[0]
    bench = [a for _, a in ifaces if ipaddress.ip_address(a) in _BENCH_NET]
    return bench[0] if bench else "127.0.0.1"


def soft_fabric(addr: str) -> bytes:
    """16 bytes naming who can reach ``addr``: anyone for 198.18.0.0/15, else only
    processes in this network namespace of this boot."""
    if ipaddress.ip_address(addr) in _BENCH_NET:
        return b"soft:198.18/15".ljust(16, b"\0")
    try:
        with open("/proc/sys/kernel/random/boot_id", "rb") as f:
            boot = f.read().strip()
        netns = str(os.stat("/proc/self/ns/net").st_ino).encode()
    except OSError:
        boot, netns = socket.gethostname().encode(), b""
    return hashlib.sha256(b"soft:lo:" + boot + b":" + netns).digest()[:16]


# ----------------------------------------------------------- selection
def open_verbs(options: TransportOptions) -> Verbs:
    """The provider named by ``options.get("rdma_provider", "auto")``.

    Raises:
        RdmaUnavailableError: the provider is unknown, pyverbs does not import,
            or it finds no RDMA device; the message says what was tried and the
            ways on.
    """
    choice = (options.get("rdma_provider", "auto") or "auto").strip().lower()
    if choice not in PROVIDERS:
        raise RdmaUnavailableError(
            f"unknown RDMA provider {choice!r}; use one of {', '.join(PROVIDERS)}",
            transport="rdma",
        )
    if choice == "soft":
        return _load_soft(options)
    try:
        verbs = _load_pyverbs()
        devices = [
            d.name.decode() if isinstance(d.name, bytes) else str(d.name)
            for d in verbs.get_device_list()
        ]
    except Exception as exc:  # ImportError, or pyverbs failing to list devices
        if choice == "pyverbs":
            raise RdmaUnavailableError(
                f"RDMA provider 'pyverbs' requested but it cannot be used ({type(exc).__name__}: {exc}). "
                "Install rdma-core's python3-pyverbs matching this host, or set PYCOLL_RDMA_PROVIDER=soft "
                "(software emulation) or PYCOLL_TRANSPORT=tcp.",
                transport="rdma",
            ) from exc
        raise RdmaUnavailableError(
            f"no RDMA hardware: pyverbs cannot be used ({type(exc).__name__}: {exc}); "
            "PYCOLL_RDMA_PROVIDER=soft emulates verbs in software",
            transport="rdma",
        ) from exc
    wanted = options.get("rdma_device")
    if wanted:
        devices = [d for d in devices if d == wanted]
    if not devices:
        if choice == "pyverbs":
            where = "/sys/class/infiniband"
            seen = sorted(os.listdir(where)) if os.path.isdir(where) else []
            raise RdmaUnavailableError(
                "RDMA provider 'pyverbs' found no RDMA device"
                + (f" named {wanted!r}" if wanted else "")
                + f" (pyverbs.device.get_device_list() is empty; {where}: {seen or 'absent'}). "
                "Load the HCA driver (and rdma_rxe/siw for software RoCE), or set "
                "PYCOLL_RDMA_PROVIDER=soft or PYCOLL_TRANSPORT=tcp.",
                transport="rdma",
            )
        raise RdmaUnavailableError(
            "no RDMA hardware: pyverbs lists no device; PYCOLL_RDMA_PROVIDER=soft "
            "emulates verbs in software",
            transport="rdma",
        )
    verbs.device = devices[0]
    return verbs
