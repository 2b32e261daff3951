"""One frozen configuration, read from ``PYCOLL_*`` once per communicator."""

from __future__ import annotations

import logging
import math
import os
import socket
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields, replace
from typing import Any

from pycoll.errors import InvalidArgumentError
from transports import shm_group

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
#: The spellings of a switch: on, and off.
ON = ("1", "true", "yes", "on")
OFF = ("0", "false", "no", "off")
#: Spellings of PYCOLL_DEVICE_TRANSPORT that stage every GPU collective through the host.
DEVICE_NONE = ("none", "host", "staged")
#: The group segment's slots are whole pages (transports/shm_group.py maps each
#: rank's slots page-aligned), so PYCOLL_GROUP_SLOT_BYTES is 0 or a multiple of this.
GROUP_SLOT_ALIGN = 4096
#: The group segment's default slot (64 KiB ran 2-4x slower at 128-256 KiB by address).
GROUP_SLOT_BYTES = shm_group.SLOT_BYTES
TRACE = 5
logging.addLevelName(TRACE, "TRACE")
# A library attaches no handler of its own: without PYCOLL_DEBUG, the
# application's logging configuration decides what is shown (setup_logging).
logging.getLogger("pycoll").addHandler(logging.NullHandler())


def parse_bytes(text: str) -> int:
    """``8``, ``64K``, ``1.5M``, ``1G``, ``64KiB``, ``1MB`` (binary multiples) -> bytes.

    Raises:
        ValueError: not a size, or not a whole number of bytes.
    """
    t = text.strip().upper().removesuffix("B").removesuffix("I")
    mult = 1
    for suffix, m in (("K", 1 << 10), ("M", 1 << 20), ("G", 1 << 30), ("T", 1 << 40)):
        if t.endswith(suffix):
            t, mult = t[:-1], m
            break
    v = float(t) * mult  # ValueError when t is not a number
    if not math.isfinite(v) or v != int(v):
        raise ValueError(f"{text!r} is not a whole number of bytes")
    return int(v)


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

#: Where every rank shares one GPU, the torch backend's asynchronous allreduces
#: of CUDA tensors up to this many bytes go through pinned host mirrors (see
#: :mod:`pycoll.torch_backend.mirrors`): ranks that share a GPU time-slice it,
#: and the device path's waits for another process cost a slice each.  On an
#: H200 shared by 2 and 4 ranks, DDP's 1 MiB buckets took a step of 6.45 and
#: 7.41 ms through the mirrors against 6.00 and 11.64 on the device, and 25 MiB
#: buckets (a 25M-parameter model, n = 2) 41.1 ms against 10.2
#: (benchmarks/RESULTS.md, "Data-parallel training").
DEVICE_ASYNC_HOST_BYTES = 4 << 20

#: Below this many bytes, a pinned copy to a GPU that other processes share waits
#: about one time slice per other process (benchmarks/RESULTS.md, "Small copies to
#: the device": on the H200, 271-278 us at n = 2 and 555 us at n = 4 up to 24 KiB,
#: 9-14 us from 28 KiB); on such a GPU the host path is not taken when a rank's
#: copy back would be that small, and the one-sided device path, which makes no
#: such copy, runs instead.
SLICED_COPY_BYTES = 28 << 10


def _names(text: str) -> tuple[str, ...]:
    return tuple(x.strip() for x in text.split(",") if x.strip())


def _transports(text: str) -> tuple[str, ...]:
    return DEFAULT_TRANSPORTS if text.strip().lower() == "auto" else _names(text)


def _device_transports(text: str) -> tuple[str, ...]:
    t = text.strip().lower()
    if t == "auto":
        return DEVICE_TRANSPORTS
    if t in DEVICE_NONE:
        return ()
    if not _names(t):  # "," is no transport, not "none"
        raise ValueError(_DEVICE_CHOICES)
    return _names(t)


def _size(text: str) -> int:
    try:
        return parse_bytes(text)
    except ValueError:
        raise ValueError("not a size (e.g. 1M, 64K, 65536)") from None


def _seconds(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise ValueError("not a number of seconds") from None


def _switch(text: str) -> bool:
    t = text.strip().lower()
    if t not in ON + OFF:
        raise ValueError(f"choose from {', '.join(ON)} (on) or {', '.join(OFF)} (off)")
    return t in ON


_DEVICE_CHOICES = (
    f"choose from auto, {', '.join(DEVICE_NONE)} (no device transport: stage through "
    f"the host), or a comma list of {', '.join(DEVICE_TRANSPORTS)}"
)
#: How a field given as a string is read: the spellings of its variable, so that
#: ``init(chunk_bytes="1M")`` means what ``PYCOLL_CHUNK_BYTES=1M`` does.  Fields
#: that are strings anyway (names, levels) are checked as they are.
_SPELLINGS: dict[str, Callable[[str], object]] = {
    "transports": _transports,
    "algo": lambda text: parse_algo(text),
    "chunk_bytes": _size,
    "timeout": _seconds,
    "check": _switch,
    "device_transports": _device_transports,
    "device_chunk_bytes": _size,
    "device_host_bytes": _size,
    "device_async_host_bytes": _size,
    "group_slot_bytes": _size,
    "tune": _switch,
    "compiled": _switch,
}
#: The environment variable of each field (all of Config's fields have one).
ENV = {
    "transports": "PYCOLL_TRANSPORT",
    "rdma_memory": "PYCOLL_RDMA_MEMORY",
    "rdma_provider": "PYCOLL_RDMA_PROVIDER",
    "rdma_soft_caps": "PYCOLL_RDMA_SOFT_CAPS",
    "socket_ifname": "PYCOLL_SOCKET_IFNAME",
    "algo": "PYCOLL_ALGO",
    "chunk_bytes": "PYCOLL_CHUNK_BYTES",
    "timeout": "PYCOLL_TIMEOUT",
    "check": "PYCOLL_CHECK",
    "debug": "PYCOLL_DEBUG",
    "device_transports": "PYCOLL_DEVICE_TRANSPORT",
    "device_chunk_bytes": "PYCOLL_DEVICE_CHUNK_BYTES",
    "device_host_bytes": "PYCOLL_DEVICE_HOST_BYTES",
    "device_async_host_bytes": "PYCOLL_DEVICE_ASYNC_HOST_BYTES",
    "group_slot_bytes": "PYCOLL_GROUP_SLOT_BYTES",
    "tune": "PYCOLL_TUNE",
    "compiled": "PYCOLL_COMPILED",
}


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
        debug: logging level name (``PYCOLL_DEBUG``): WARN, INFO, DEBUG or TRACE;
            None (unset): pycoll attaches no handler and sets no level, so the
            application's logging configuration decides what is shown.
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
        device_async_host_bytes: where every rank shares one GPU, the torch
            backend's asynchronous allreduces of CUDA tensors of at most this many
            bytes go through pinned host mirrors on the group's worker thread,
            as Gloo's do (``PYCOLL_DEVICE_ASYNC_HOST_BYTES``; 0: never; see
            :mod:`pycoll.torch_backend.mirrors`).
        group_slot_bytes: bytes of each rank's slots in the group segment that ranks
            on one host share (``PYCOLL_GROUP_SLOT_BYTES``), a multiple of
            :data:`GROUP_SLOT_ALIGN`; 0 turns the segment, and with it the
            ``direct`` algorithms, off.
        tune: let ``auto`` time its close contenders while it runs and keep the
            fastest, where they give identical results (``PYCOLL_TUNE``; see
            :mod:`pycoll.tune`); off, it takes the cost model's choice alone.
        compiled: run small direct steps and direct's allreduce,
            reduce_scatter and broadcast by address through the compiled ``pycoll._step``,
            replayed calls on NumPy arrays through ``pycoll._replay``'s entry,
            and replayed small point-to-point calls over shm through
            ``transports._ring``, where the install built them
            (``PYCOLL_COMPILED``); off, or without them, the same runs in
            Python (docs/algorithms.md, "The compiled step and the compiled
            entry").

    Every field is checked when a Config is made, so an override of
    :func:`pycoll.init` is held to the rules its environment variable is, and a
    string is read as the variable's spellings (``chunk_bytes="1M"``,
    ``check="on"``, ``transports="tcp,shm"``).
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
    debug: str | None = None
    device_transports: tuple[str, ...] = DEVICE_TRANSPORTS
    device_chunk_bytes: int = 16 << 20  # 4 MiB reached 10 GB/s at 256 MiB on an H200, 16 MiB 35
    device_host_bytes: int | None = None
    device_async_host_bytes: int = DEVICE_ASYNC_HOST_BYTES
    group_slot_bytes: int = GROUP_SLOT_BYTES
    tune: bool = True
    compiled: bool = True

    def __post_init__(self) -> None:
        def bad(name: str, why: str) -> _BadSetting:
            return _BadSetting(name, getattr(self, name), why)

        put = object.__setattr__  # frozen: normalise the spellings once, here
        for name, spelling in _SPELLINGS.items():
            v = getattr(self, name)
            if isinstance(v, str):
                try:
                    put(self, name, spelling(v))
                except ValueError as exc:
                    raise bad(name, str(exc)) from None

        def names(name: str, allowed: tuple[str, ...], empty: bool, why: str) -> tuple[str, ...]:
            v = getattr(self, name)
            if not isinstance(v, (tuple, list)) or not all(isinstance(x, str) for x in v):
                raise bad(name, "a sequence of names")
            got = tuple(x.lower() for x in v)
            if any(x not in allowed for x in got) or not (got or empty):
                raise bad(name, why)
            return got

        def size(name: str, least: int, none: bool = False) -> None:
            v = getattr(self, name)
            if v is None and none:
                return
            if isinstance(v, bool) or not isinstance(v, int):
                raise bad(name, 'a number of bytes (an int, or a string such as "1M")')
            if v < least:
                raise bad(name, f"must be at least {least}")

        def switch(name: str) -> None:
            if not isinstance(getattr(self, name), bool):
                raise bad(name, f"True or False (or {', '.join(ON + OFF)})")

        def one_of(name: str, allowed: tuple[str, ...]) -> str:
            v = getattr(self, name)
            if not isinstance(v, str) or v.lower() not in allowed:
                raise bad(name, f"choose from {', '.join(allowed)}")
            return v.lower()

        put(
            self,
            "transports",
            names(
                "transports",
                KNOWN_TRANSPORTS,
                empty=False,
                why=f"choose from auto, or a comma list of {', '.join(KNOWN_TRANSPORTS)}",
            ),
        )
        put(
            self,
            "device_transports",
            names("device_transports", DEVICE_TRANSPORTS, empty=True, why=_DEVICE_CHOICES),
        )
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
        size("device_async_host_bytes", 0)
        size("group_slot_bytes", 0)
        if self.group_slot_bytes % GROUP_SLOT_ALIGN:
            raise bad(
                "group_slot_bytes",
                f"0 (off) or a multiple of {GROUP_SLOT_ALIGN} (the segment's slots are "
                "whole pages)",
            )
        t = self.timeout
        if (
            isinstance(t, bool)
            or not isinstance(t, (int, float))
            or not t > 0
            or not math.isfinite(t)
        ):
            raise bad("timeout", "a positive, finite number of seconds")
        switch("check")
        switch("tune")
        switch("compiled")
        if self.debug is not None:
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

        The variables' strings are read and checked by :meth:`__post_init__`, as
        strings given to :func:`pycoll.init` are (a bad value from a variable is
        blamed on the variable).

        Raises:
            InvalidArgumentError: a variable or an override has a value pycoll
                does not understand, or an override is not a field.
        """
        e = os.environ if env is None else env
        kw = {key: v for key, var in ENV.items() if (v := e.get(var, "").strip())}
        try:
            cfg = cls(**kw)  # type: ignore[arg-type]
        except _BadSetting as exc:
            var = ENV[exc.setting]
            raise InvalidArgumentError(f"{var}={e.get(var)!r}: {exc.why}") from None
        known = [f.name for f in fields(cls)]
        if unknown := sorted(k for k in overrides if k not in known):
            raise InvalidArgumentError(
                f"unknown setting(s) {unknown}; the settings are {', '.join(known)}"
            )
        given = {k: v for k, v in overrides.items() if v is not None}
        return replace(cfg, **given) if given else cfg  # type: ignore[arg-type]

    def algorithm_for(self, collective: str) -> str | None:
        """The algorithm forced for ``collective``, or None (``auto`` picks)."""
        from pycoll import algorithms

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
    from pycoll import algorithms  # here, not at import: config sits below the algorithms

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
#: PYCOLL_DEBUG's format: time, host and pid (several hosts' ranks share one
#: terminal or file under mpirun), the rank, then the level and the module.
LOG_FORMAT = "%(asctime)s {host}:%(process)d pycoll[{rank}] %(levelname)s %(name)s: %(message)s"


def setup_logging(level: str | None, rank: int) -> None:
    """Route pycoll's and transports' logs to stderr at ``level`` (PYCOLL_DEBUG).

    With ``level`` None (PYCOLL_DEBUG unset) nothing is attached or changed:
    the loggers keep their NullHandler and the application decides.  Otherwise
    one stderr handler (shared by both loggers, and by every communicator of
    the process) is attached, and the loggers stop propagating so that a root
    handler does not print each line twice.
    """
    global _handler
    if level is None:
        return
    lv = {"WARN": logging.WARNING, "INFO": logging.INFO, "DEBUG": logging.DEBUG, "TRACE": TRACE}[
        level
    ]
    if _handler is None:
        _handler = logging.StreamHandler(sys.stderr)
    _handler.setFormatter(
        logging.Formatter(LOG_FORMAT.format(host=socket.gethostname(), rank=rank))
    )
    for name in ("pycoll", "transports"):
        lg = logging.getLogger(name)
        lg.setLevel(lv)
        if _handler not in lg.handlers:
            lg.addHandler(_handler)
        lg.propagate = False
