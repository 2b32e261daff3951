"""One frozen configuration, read from ``PYCOLL_*`` once per communicator."""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from pycoll import algorithms
from pycoll.errors import InvalidArgumentError

DEFAULT_TRANSPORTS = ("shm", "rdma", "tcp")
KNOWN_TRANSPORTS = ("shm", "rdma", "tcp")
#: transports for device (GPU) buffers, wired in a second table when a GPU is present
DEVICE_TRANSPORTS = ("cuda_ipc",)
COLLECTIVES = ("allreduce", "allgather", "broadcast", "reduce_scatter", "reduce")
RDMA_MEMORY = ("auto", "dmabuf", "gdr", "host")
RDMA_PROVIDERS = ("auto", "pyverbs", "soft")
SOFT_CAPS = ("peermem", "dmabuf")
#: PYCOLL_DEBUG's levels (WARNING is taken for WARN).
LEVELS = ("WARN", "INFO", "DEBUG", "TRACE")
#: The spellings of a switch in the environment: on, and off.
ON = ("1", "true", "yes", "on")
OFF = ("0", "false", "no", "off")
TRACE = 5
logging.addLevelName(TRACE, "TRACE")


def parse_bytes(text: str) -> int:
    """``8``, ``64K``, ``256M``, ``1G`` (binary multiples, optional ``B``) -> bytes."""
    t = text.strip().upper().removesuffix("B")
    mult = 1
    for suffix, m in (("K", 1 << 10), ("M", 1 << 20), ("G", 1 << 30)):
        if t.endswith(suffix):
            t, mult = t[:-1], m
            break
    return int(float(t) * mult)


#: Per collective, the input bytes per rank up to which device buffers go through
#: the host by default: where the one-sided device path (a fixed cost of about
#: 55-130 us at n = 2 and 4 ranks on an H200 they share, 160-430 us for allgather)
#: overtakes pinned copies plus the host collective, measured with
#: ``benchmarks/gpu_sweep.py -b 32K -e 1M -f 2`` and ``PYCOLL_DEVICE_HOST_BYTES``
#: set to 0 and to 1M (benchmarks/RESULTS.md).
DEVICE_HOST_BYTES = {
    "allreduce": 128 << 10,
    "broadcast": 256 << 10,
    "reduce": 128 << 10,
    "reduce_scatter": 256 << 10,
    "allgather": 128 << 10,
}

#: Below this many bytes, a pinned copy to a GPU that other processes share waits
#: about one time slice per other process (benchmarks/RESULTS.md, "Small copies to
#: the device": on the H200, 271-278 us at n = 2 and 555 us at n = 4 up to 24 KiB,
#: 9-14 us from 28 KiB); on such a GPU the host path is not taken when a rank's
#: copy back would be that small, and the one-sided device path, which makes no
#: such copy, runs instead.
SLICED_COPY_BYTES = 28 << 10


@dataclass(frozen=True)
class Config:
    """Settings; environment first, arguments of :func:`pycoll.init` win.

    Attributes:
        transports: allowed transports in priority order (``PYCOLL_TRANSPORT``).
        rdma_memory: ``auto``, ``dmabuf``, ``gdr`` or ``host`` (``PYCOLL_RDMA_MEMORY``).
        rdma_provider: ``auto``, ``pyverbs`` or ``soft`` (``PYCOLL_RDMA_PROVIDER``).
        rdma_soft_caps: NIC capabilities the soft RDMA provider claims, a comma list
            of ``peermem`` and ``dmabuf`` (``PYCOLL_RDMA_SOFT_CAPS``), so the gdr and
            dmabuf paths can run on a GPU machine without an RDMA NIC.
        socket_ifname: interface selection for tcp and soft RDMA (``PYCOLL_SOCKET_IFNAME``).
        algo: forced algorithm per collective; key ``"*"`` for every collective
            that has an algorithm of that name (the others stay on ``auto``)
            (``PYCOLL_ALGO``).
        chunk_bytes: pipeline chunk size (``PYCOLL_CHUNK_BYTES``).
        timeout: seconds before a blocked collective raises (``PYCOLL_TIMEOUT``).
        check: verify that ranks call matching collectives (``PYCOLL_CHECK``).
        debug: logging level name (``PYCOLL_DEBUG``): WARN, INFO, DEBUG or TRACE.
        device_transports: transports for GPU buffers (``PYCOLL_DEVICE_TRANSPORT``:
            ``auto`` or ``cuda_ipc``, or ``none`` (also ``host`` or ``staged``) to
            stage every device byte through the host connections).
        device_chunk_bytes: pipeline chunk and device slot size for GPU buffers
            (``PYCOLL_DEVICE_CHUNK_BYTES``).
        device_host_bytes: device collectives of at most this many input bytes per
            rank go through pinned host memory and the host algorithms, when
            ``auto`` picks (``PYCOLL_DEVICE_HOST_BYTES``; 0: never).  None: per
            collective, :data:`DEVICE_HOST_BYTES`, the crossovers measured on an
            H200 shared by 2 and 4 ranks.
        group_slot_bytes: bytes of each rank's slots in the group segment that ranks
            on one host share (``PYCOLL_GROUP_SLOT_BYTES``); 0 turns the segment, and
            with it the ``direct`` algorithms, off.
        tune: let ``auto`` time its close contenders while it runs and keep the
            fastest, where they give identical results (``PYCOLL_TUNE``; see
            :mod:`pycoll.tune`); off, it takes the cost model's choice alone.

    Every field is checked when a Config is made, so an override of
    :func:`pycoll.init` is held to the rules its environment variable is.
    """

    transports: tuple[str, ...] = DEFAULT_TRANSPORTS
    rdma_memory: str = "auto"
    rdma_provider: str = "auto"
    rdma_soft_caps: str = ""
    socket_ifname: str | None = None
    algo: Mapping[str, str] = field(default_factory=dict)
    chunk_bytes: int = 1 << 20
    timeout: float = 600.0
    check: bool = False
    debug: str = "WARN"
    device_transports: tuple[str, ...] = DEVICE_TRANSPORTS
    device_chunk_bytes: int = 16 << 20  # 4 MiB reached 10 GB/s at 256 MiB on an H200, 16 MiB 35
    device_host_bytes: int | None = None
    group_slot_bytes: int = 256 << 10  # 64K: 2-4x slower at 128-256 KiB by address
    tune: bool = True

    def __post_init__(self) -> None:
        def bad(name: str, why: str) -> InvalidArgumentError:
            return InvalidArgumentError(f"config {name}={getattr(self, name)!r}: {why}")

        def names(name: str, allowed: tuple[str, ...], empty: bool) -> tuple[str, ...]:
            v = getattr(self, name)
            got = (v,) if isinstance(v, str) else v
            if not isinstance(got, (tuple, list)) or not all(isinstance(x, str) for x in got):
                raise bad(name, "a sequence of names")
            got = tuple(x.lower() for x in got)
            if any(x not in allowed for x in got) or not (got or empty):
                raise bad(name, f"choose from {', '.join(allowed)}")
            return got

        def size(name: str, least: int, none: bool = False) -> None:
            v = getattr(self, name)
            if v is None and none:
                return
            if isinstance(v, bool) or not isinstance(v, int):
                raise bad(name, "a number of bytes (an int)")
            if v < least:
                raise bad(name, f"must be at least {least}")

        def switch(name: str) -> None:
            if not isinstance(getattr(self, name), bool):
                raise bad(name, "True or False")

        def one_of(name: str, allowed: tuple[str, ...]) -> str:
            v = getattr(self, name)
            if not isinstance(v, str) or v.lower() not in allowed:
                raise bad(name, f"choose from {', '.join(allowed)}")
            return v.lower()

        put = object.__setattr__  # frozen: normalise the spellings once, here
        put(self, "transports", names("transports", KNOWN_TRANSPORTS, empty=False))
        put(self, "device_transports", names("device_transports", DEVICE_TRANSPORTS, empty=True))
        put(self, "rdma_memory", one_of("rdma_memory", RDMA_MEMORY))
        put(self, "rdma_provider", one_of("rdma_provider", RDMA_PROVIDERS))
        if not isinstance(self.rdma_soft_caps, str) or any(
            x.strip() not in SOFT_CAPS for x in self.rdma_soft_caps.split(",") if x.strip()
        ):
            raise bad("rdma_soft_caps", f"a comma list of {', '.join(SOFT_CAPS)}")
        if self.socket_ifname is not None and not (
            isinstance(self.socket_ifname, str) and self.socket_ifname.strip()
        ):
            raise bad("socket_ifname", "an interface name or address, or None")
        if not isinstance(self.algo, Mapping):
            raise bad("algo", 'a mapping of collective (or "*") to algorithm')
        put(self, "algo", check_algo(self.algo, "config algo"))
        size("chunk_bytes", 64)
        size("device_chunk_bytes", 64)
        size("device_host_bytes", 0, none=True)
        size("group_slot_bytes", 0)
        t = self.timeout
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not t > 0:
            raise bad("timeout", "a positive number of seconds")
        switch("check")
        switch("tune")
        level = self.debug.upper() if isinstance(self.debug, str) else self.debug
        put(self, "debug", "WARN" if level == "WARNING" else level)
        if self.debug not in LEVELS:
            raise bad("debug", f"choose from {', '.join(LEVELS)}")

    def device_host_limit(self, collective: str) -> int:
        """The input bytes per rank up to which ``auto`` sends a device collective
        through the host."""
        if self.device_host_bytes is not None:
            return self.device_host_bytes
        return DEVICE_HOST_BYTES.get(collective, 128 << 10)

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, **overrides: object) -> Config:
        """Read ``PYCOLL_*`` from ``env`` (default ``os.environ``); overrides win.

        Raises:
            InvalidArgumentError: a variable has a value pycoll does not understand.
        """
        e = os.environ if env is None else env
        kw: dict[str, object] = {}

        def bad(var: str, why: str) -> InvalidArgumentError:
            return InvalidArgumentError(f"{var}={e.get(var)!r}: {why}")

        if v := e.get("PYCOLL_TRANSPORT", "").strip():
            if v.lower() != "auto":
                names = tuple(x.strip().lower() for x in v.split(",") if x.strip())
                unknown = [x for x in names if x not in KNOWN_TRANSPORTS]
                if unknown or not names:
                    raise bad(
                        "PYCOLL_TRANSPORT",
                        f"unknown transport(s) {unknown}; "
                        f"choose from {', '.join(KNOWN_TRANSPORTS)}",
                    )
                kw["transports"] = names
        for var, key, allowed in (
            ("PYCOLL_RDMA_MEMORY", "rdma_memory", RDMA_MEMORY),
            ("PYCOLL_RDMA_PROVIDER", "rdma_provider", RDMA_PROVIDERS),
        ):
            if v := e.get(var, "").strip().lower():
                if v not in allowed:
                    raise bad(var, f"choose from {', '.join(allowed)}")
                kw[key] = v
        if v := e.get("PYCOLL_RDMA_SOFT_CAPS", "").strip().lower():
            soft_caps = [x.strip() for x in v.split(",") if x.strip()]
            if any(x not in SOFT_CAPS for x in soft_caps):
                raise bad("PYCOLL_RDMA_SOFT_CAPS", f"a comma list of {', '.join(SOFT_CAPS)}")
            kw["rdma_soft_caps"] = ",".join(soft_caps)
        if v := e.get("PYCOLL_SOCKET_IFNAME", "").strip():
            kw["socket_ifname"] = v
        if v := e.get("PYCOLL_ALGO", "").strip():
            kw["algo"] = parse_algo(v)
        if v := e.get("PYCOLL_CHUNK_BYTES", "").strip():
            try:
                n = parse_bytes(v)
            except ValueError:
                raise bad("PYCOLL_CHUNK_BYTES", "not a size (e.g. 1M, 65536)") from None
            if n < 64:
                raise bad("PYCOLL_CHUNK_BYTES", "must be at least 64 bytes")
            kw["chunk_bytes"] = n
        if v := e.get("PYCOLL_TIMEOUT", "").strip():
            try:
                t = float(v)
            except ValueError:
                raise bad("PYCOLL_TIMEOUT", "not a number of seconds") from None
            if not t > 0:
                raise bad("PYCOLL_TIMEOUT", "must be positive")
            kw["timeout"] = t
        for var, key in (("PYCOLL_CHECK", "check"), ("PYCOLL_TUNE", "tune")):
            if v := e.get(var, "").strip().lower():
                if v not in ON + OFF:
                    raise bad(var, "choose from 1 (on) or 0 (off)")
                kw[key] = v in ON
        if v := e.get("PYCOLL_DEBUG", "").strip().upper():
            if v == "WARNING":
                v = "WARN"
            if v not in LEVELS:
                raise bad("PYCOLL_DEBUG", f"choose from {', '.join(LEVELS)}")
            kw["debug"] = v
        if v := e.get("PYCOLL_DEVICE_TRANSPORT", "").strip().lower():
            if v in ("none", "host", "staged"):
                kw["device_transports"] = ()
            elif v != "auto":
                dnames = tuple(x.strip() for x in v.split(",") if x.strip())
                if not dnames or any(x not in DEVICE_TRANSPORTS for x in dnames):
                    raise bad(
                        "PYCOLL_DEVICE_TRANSPORT",
                        f"choose from auto, none, host, staged, {', '.join(DEVICE_TRANSPORTS)}",
                    )
                kw["device_transports"] = dnames
        if v := e.get("PYCOLL_DEVICE_CHUNK_BYTES", "").strip():
            try:
                n = parse_bytes(v)
            except ValueError:
                raise bad("PYCOLL_DEVICE_CHUNK_BYTES", "not a size (e.g. 4M)") from None
            if n < 64:
                raise bad("PYCOLL_DEVICE_CHUNK_BYTES", "must be at least 64 bytes")
            kw["device_chunk_bytes"] = n
        if v := e.get("PYCOLL_DEVICE_HOST_BYTES", "").strip():
            try:
                kw["device_host_bytes"] = parse_bytes(v)
            except ValueError:
                raise bad("PYCOLL_DEVICE_HOST_BYTES", "not a size (e.g. 1M, or 0)") from None
        if v := e.get("PYCOLL_GROUP_SLOT_BYTES", "").strip():
            try:
                n = parse_bytes(v)
            except ValueError:
                raise bad(
                    "PYCOLL_GROUP_SLOT_BYTES", "not a size (e.g. 64K), or 0 for off"
                ) from None
            if n < 0:
                raise bad("PYCOLL_GROUP_SLOT_BYTES", "must not be negative")
            kw["group_slot_bytes"] = n
        known = [f.name for f in fields(cls)]
        if unknown := sorted(k for k in overrides if k not in known):
            raise InvalidArgumentError(
                f"unknown setting(s) {unknown}; the settings are {', '.join(known)}"
            )
        kw.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**kw)  # type: ignore[arg-type]

    def algorithm_for(self, collective: str) -> str | None:
        """The algorithm forced for ``collective``, or None (``auto`` picks)."""
        name = self.algo.get(collective)
        if name is None and self.algo.get("*") in algorithms.names(collective):
            name = self.algo["*"]
        return None if name == "auto" else name


def parse_algo(text: str) -> dict[str, str]:
    """``tree`` or ``allreduce:tree,broadcast:ring`` -> {collective or "*": algorithm}."""
    out: dict[str, str] = {}
    for raw in text.split(","):
        part = raw.strip().lower()
        if part:
            coll, _, algo = part.rpartition(":")
            out[coll or "*"] = algo
    return check_algo(out, f"PYCOLL_ALGO={text!r}")


def check_algo(algo: Mapping[str, Any], what: str) -> dict[str, str]:
    """``algo`` (collective or ``"*"`` -> algorithm name), its names checked and
    lower-cased; ``"*"`` takes any name some collective has."""
    out: dict[str, str] = {}
    for coll, name in algo.items():
        if coll != "*" and coll not in COLLECTIVES:
            raise InvalidArgumentError(
                f"{what}: unknown collective {coll!r}; choose from *, {', '.join(COLLECTIVES)}"
            )
        have = (
            sorted({a for c in COLLECTIVES for a in algorithms.names(c)})
            if coll == "*"
            else list(algorithms.names(coll))
        )
        if not isinstance(name, str) or name.lower() not in ("auto", *have):
            raise InvalidArgumentError(
                f"{what}: {coll}: algorithm {name!r} is not one of {', '.join(('auto', *have))}"
            )
        out[coll] = name.lower()
    return out


_handler: logging.Handler | None = None


def setup_logging(level: str, rank: int) -> None:
    """Route pycoll's and transports' logs to stderr at ``level`` (PYCOLL_DEBUG)."""
    global _handler
    lv = {"WARN": logging.WARNING, "INFO": logging.INFO, "DEBUG": logging.DEBUG, "TRACE": TRACE}[
        level
    ]
    for name in ("pycoll", "transports"):
        lg = logging.getLogger(name)
        lg.setLevel(lv)
        if _handler is None:
            _handler = logging.StreamHandler(sys.stderr)
        _handler.setFormatter(
            logging.Formatter(f"%(asctime)s pycoll[{rank}] %(levelname)s %(name)s: %(message)s")
        )
        if _handler not in lg.handlers:
            lg.addHandler(_handler)
        lg.propagate = False
