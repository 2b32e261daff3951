"""One frozen configuration, read from ``PYCOLL_*`` once per communicator."""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
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
        def bad(name: str, why: str) -> _BadSetting:
            return _BadSetting(name, getattr(self, name), why)

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
        raw = self.rdma_soft_caps
        caps = (
            [x.strip().lower() for x in raw.split(",") if x.strip()]
            if isinstance(raw, str)
            else [""]
        )
        if any(x not in SOFT_CAPS for x in caps):
            raise bad("rdma_soft_caps", f"a comma list of {', '.join(SOFT_CAPS)}")
        put(self, "rdma_soft_caps", ",".join(caps))
        if self.socket_ifname is not None and not (
            isinstance(self.socket_ifname, str) and self.socket_ifname.strip()
        ):
            raise bad("socket_ifname", "an interface name or address, or None")
        if not isinstance(self.algo, Mapping):
            raise bad("algo", 'a mapping of collective (or "*") to algorithm')
        try:
            put(self, "algo", check_algo(self.algo))
        except InvalidArgumentError as exc:
            raise bad("algo", str(exc)) from None
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

        Here the variables are parsed; :meth:`__post_init__` checks the values
        (a value from a variable is blamed on the variable).

        Raises:
            InvalidArgumentError: a variable has a value pycoll does not understand.
        """
        e = os.environ if env is None else env
        kw: dict[str, object] = {}
        var_of: dict[str, str] = {}  # field -> the variable it was read from

        def bad(var: str, why: str) -> InvalidArgumentError:
            return InvalidArgumentError(f"{var}={e.get(var)!r}: {why}")

        def read(var: str, key: str, case: str = "lower") -> str:
            v = e.get(var, "").strip()
            if v:
                var_of[key] = var
            return v.upper() if case == "upper" else v.lower() if case == "lower" else v

        def nbytes(var: str, key: str, example: str) -> None:
            if v := read(var, key):
                try:
                    kw[key] = parse_bytes(v)
                except ValueError:
                    raise bad(var, f"not a size (e.g. {example})") from None

        def names(v: str) -> tuple[str, ...]:
            return tuple(x.strip() for x in v.split(",") if x.strip())

        if (v := read("PYCOLL_TRANSPORT", "transports")) and v != "auto":
            kw["transports"] = names(v)
        for var, key in (
            ("PYCOLL_RDMA_MEMORY", "rdma_memory"),
            ("PYCOLL_RDMA_PROVIDER", "rdma_provider"),
            ("PYCOLL_RDMA_SOFT_CAPS", "rdma_soft_caps"),
        ):
            if v := read(var, key):
                kw[key] = v
        if v := read("PYCOLL_SOCKET_IFNAME", "socket_ifname", case="keep"):
            kw["socket_ifname"] = v
        if v := read("PYCOLL_ALGO", "algo"):
            kw["algo"] = parse_algo(v)
        nbytes("PYCOLL_CHUNK_BYTES", "chunk_bytes", "1M, 65536")
        if v := read("PYCOLL_TIMEOUT", "timeout"):
            try:
                kw["timeout"] = float(v)
            except ValueError:
                raise bad("PYCOLL_TIMEOUT", "not a number of seconds") from None
        for var, key in (("PYCOLL_CHECK", "check"), ("PYCOLL_TUNE", "tune")):
            if v := read(var, key):
                if v not in ON + OFF:
                    raise bad(var, "choose from 1 (on) or 0 (off)")
                kw[key] = v in ON
        if v := read("PYCOLL_DEBUG", "debug", case="upper"):
            kw["debug"] = v
        if (v := read("PYCOLL_DEVICE_TRANSPORT", "device_transports")) and v != "auto":
            if v in ("none", "host", "staged"):
                kw["device_transports"] = ()
            elif not names(v):  # "," is no transport, not "none"
                raise bad(
                    "PYCOLL_DEVICE_TRANSPORT",
                    "choose from auto, none, host, staged, " + ", ".join(DEVICE_TRANSPORTS),
                )
            else:
                kw["device_transports"] = names(v)
        nbytes("PYCOLL_DEVICE_CHUNK_BYTES", "device_chunk_bytes", "4M")
        nbytes("PYCOLL_DEVICE_HOST_BYTES", "device_host_bytes", "1M, or 0")
        nbytes("PYCOLL_GROUP_SLOT_BYTES", "group_slot_bytes", "64K, or 0 for off")
        try:
            cfg = cls(**kw)  # type: ignore[arg-type]
        except _BadSetting as exc:
            if exc.setting in var_of:
                raise bad(var_of[exc.setting], exc.why) from None
            raise
        known = [f.name for f in fields(cls)]
        if unknown := sorted(k for k in overrides if k not in known):
            raise InvalidArgumentError(
                f"unknown setting(s) {unknown}; the settings are {', '.join(known)}"
            )
        given = {k: v for k, v in overrides.items() if v is not None}
        return replace(cfg, **given) if given else cfg  # type: ignore[arg-type]

    def algorithm_for(self, collective: str) -> str | None:
        """The algorithm forced for ``collective``, or None (``auto`` picks)."""
        name = self.algo.get(collective)
        if name is None and self.algo.get("*") in algorithms.names(collective):
            name = self.algo["*"]
        return None if name == "auto" else name


def parse_algo(text: str) -> dict[str, str]:
    """``tree`` or ``allreduce:tree,broadcast:ring`` -> {collective or "*": algorithm}
    (the names are checked when a :class:`Config` holds them)."""
    out: dict[str, str] = {}
    for raw in text.split(","):
        part = raw.strip().lower()
        if part:
            coll, _, algo = part.rpartition(":")
            out[coll or "*"] = algo
    return out


def check_algo(algo: Mapping[str, Any]) -> dict[str, str]:
    """``algo`` (collective or ``"*"`` -> algorithm name), its names checked and
    lower-cased; ``"*"`` takes any name some collective has."""
    out: dict[str, str] = {}
    for coll, name in algo.items():
        if coll != "*" and coll not in COLLECTIVES:
            raise InvalidArgumentError(
                f"unknown collective {coll!r}; choose from *, {', '.join(COLLECTIVES)}"
            )
        have = (
            sorted({a for c in COLLECTIVES for a in algorithms.names(c)})
            if coll == "*"
            else list(algorithms.names(coll))
        )
        if not isinstance(name, str) or name.lower() not in ("auto", *have):
            raise InvalidArgumentError(
                f"{coll}: algorithm {name!r} is not one of {', '.join(('auto', *have))}"
            )
        out[coll] = name.lower()
    return out


class _BadSetting(InvalidArgumentError):
    """A field of :class:`Config` that its checks refuse (``from_env`` blames
    the variable it came from)."""

    def __init__(self, setting: str, value: object, why: str) -> None:
        super().__init__(f"config {setting}={value!r}: {why}")
        self.setting = setting
        self.why = why


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
