"""Wire up a communicator over its bootstrap: secrets, endpoint blobs, transports.

The bootstrap (:mod:`pycoll.rendezvous`: mpi4py, or a key-value store) moves the
few objects below; every exchange is bounded by ``PYCOLL_TIMEOUT`` and names
the ranks that did not answer.

0. Every rank arrives, and the settings that must agree (:data:`AGREED`) are
   compared: a difference raises on every rank, naming each rank's value.
1. Rank 0 draws the job's secret and broadcasts it (network transports drop
   peers that cannot present it).
2. Each transport allowed by ``PYCOLL_TRANSPORT`` is created and ``listen``\\ s;
   the endpoint blobs are allgathered.  A transport that cannot be created
   (missing library, no device) is skipped with its reason.
3. Each rank asks every transport, in priority order, whether it can reach each
   peer; the verdicts are allgathered too, and a pair uses the first transport
   that *both* ends accept, so the two sides always agree.
4. Connections are made; a pair with no common transport fails loudly, naming
   every refusal (like NCCL's "No transport found for rank a -> rank b").  A
   pair whose connection fails (say, /dev/shm is full) falls back to the next
   transport both ends accept.  Once every pair is connected, each transport is
   sealed (tcp closes its listeners).
5. When every pair of ranks chose shm (one host, shared memory allowed there and
   by ``PYCOLL_TRANSPORT``), the ranks also share one group segment
   (:mod:`transports.shm_group`), which the ``direct`` algorithms use.
"""

from __future__ import annotations

import errno
import logging
import secrets
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import transports.base as tb
from pycoll.config import Config
from pycoll.errors import ConnectError, InvalidArgumentError, PycollError, translate
from pycoll.rendezvous import Bootstrap
from transports.base import Connection, Transport, TransportOptions
from transports.registry import transport_class
from transports.shm_group import ShmGroup

log = logging.getLogger(__name__)


@dataclass
class Wiring:
    """What the bootstrap built: connections per peer and the transports behind them."""

    rank: int
    size: int
    conns: dict[int, Connection] = field(default_factory=dict)
    kind: dict[int, str] = field(default_factory=dict)  # peer -> "shm", "tcp", "rdma:host"...
    why: dict[int, str] = field(default_factory=dict)
    transports: list[Transport] = field(default_factory=list)
    group: ShmGroup | None = None  # the segment every rank shares, when on one host
    group_why: str = "not built"

    def close(self, cause: int | None = None) -> None:
        """Close the group segment, the connections and the transports.

        ``cause``: the rank (as the transports number it) whose failure this rank
        closes because of; every peer is told (``close_because``) and names it.
        """
        if self.group is not None:
            try:
                if cause is None:
                    self.group.close()
                else:
                    self.group.close_because(cause)
            except Exception as exc:
                log.warning("closing the group segment: %s", exc)
            self.group = None
        for c in reversed(list(self.conns.values())):
            try:
                if cause is None:
                    c.close()
                else:
                    c.close_because(cause)
            except Exception as exc:
                log.warning("closing connection to %d: %s", c.peer, exc)
        self.conns.clear()
        for t in reversed(self.transports):
            try:
                t.close()
            except Exception as exc:
                log.warning("closing transport %s: %s", t.name, exc)
        self.transports.clear()


def _options(
    cfg: Config, rank: int, size: int, secret: bytes, device: bool = False
) -> TransportOptions:
    return TransportOptions(
        rank=rank,
        size=size,
        timeout=cfg.timeout,
        secret=secret,
        socket_ifname=cfg.socket_ifname,
        slot_bytes=cfg.device_chunk_bytes if device else cfg.chunk_bytes,
        nslots=4,
        extra=(
            ("rdma_memory", cfg.rdma_memory),
            ("rdma_provider", cfg.rdma_provider),
            ("soft_caps", cfg.rdma_soft_caps),
        ),
    )


#: The settings every rank must share: they change what goes on the wire or which
#: algorithm runs (field of :class:`Config` -> its variable).
AGREED = {
    "transports": "PYCOLL_TRANSPORT",
    "algo": "PYCOLL_ALGO",
    "chunk_bytes": "PYCOLL_CHUNK_BYTES",
    "check": "PYCOLL_CHECK",
    "tune": "PYCOLL_TUNE",
    "group_slot_bytes": "PYCOLL_GROUP_SLOT_BYTES",
    "rdma_memory": "PYCOLL_RDMA_MEMORY",
    "rdma_provider": "PYCOLL_RDMA_PROVIDER",
    "rdma_soft_caps": "PYCOLL_RDMA_SOFT_CAPS",
    "device_transports": "PYCOLL_DEVICE_TRANSPORT",
    "device_chunk_bytes": "PYCOLL_DEVICE_CHUNK_BYTES",
    "device_host_bytes": "PYCOLL_DEVICE_HOST_BYTES",
    "device_async_host_bytes": "PYCOLL_DEVICE_ASYNC_HOST_BYTES",
}


def _agree(boot: Bootstrap, cfg: Config) -> None:
    """Raise on every rank when the ranks' :data:`AGREED` settings differ.

    Raises:
        InvalidArgumentError: names each setting that differs and every rank's value.
    """
    mine = {f: _plain(getattr(cfg, f)) for f in AGREED}
    theirs = boot.allgather(mine, cfg.timeout, "pycoll.init: comparing settings")
    bad = []
    for f, var in AGREED.items():
        vals = [t.get(f) if isinstance(t, dict) else None for t in theirs]
        if all(v == vals[0] for v in vals):
            continue
        by_value: dict[str, list[int]] = {}
        for r, v in enumerate(vals):
            by_value.setdefault(_shown(v), []).append(r)
        bad.append(f"{var} ({f}): " + "; ".join(f"ranks {rs}: {v}" for v, rs in by_value.items()))
    if bad:
        raise InvalidArgumentError(
            f"rank {boot.rank}: pycoll.init: settings that must be equal on every rank differ: "
            + " | ".join(bad)
        )


def _plain(v: Any) -> Any:
    if isinstance(v, Mapping):
        return tuple(sorted(v.items()))
    return v


def _shown(v: Any) -> str:
    if isinstance(v, tuple) and all(isinstance(x, str) for x in v):
        return ",".join(v) or "(none)"
    if isinstance(v, tuple):
        return ",".join(f"{a}:{b}" for a, b in v) or "(auto)"
    return "(default)" if v is None else str(v)


def wire(boot: Bootstrap, cfg: Config, *, device: bool = False) -> Wiring:
    """Build every connection of this rank.

    With ``device=True`` it builds the second table, for GPU buffers, from
    ``cfg.device_transports`` (cuda_ipc); a pair that none of them reaches is
    left out (its device bytes are staged through the host connection).

    Every exchange is bounded by ``cfg.timeout`` and names the ranks that did
    not answer.  A pair whose chosen transport fails to connect falls back to
    the next transport both ends accept (both ends learn of the failure through
    the bootstrap, so they agree), with a warning that says why.

    Raises:
        ConnectError: no transport reaches some peer, a connection failed with no
            transport left to try, or a rank did not answer in time.
        InvalidArgumentError: a setting of :data:`AGREED` differs between ranks.
    """
    rank, size = boot.rank, boot.size
    w = Wiring(rank, size)
    t = cfg.timeout
    if not device:
        boot.arrive(t)
        _agree(boot, cfg)
    if size == 1:
        return w
    what = "pycoll.init: " + ("device " if device else "")
    secret = boot.bcast(secrets.token_bytes(32) if rank == 0 else None, 0, t, what + "secret")
    opts = _options(cfg, rank, size, secret, device)
    names = cfg.device_transports if device else cfg.transports

    # 2. create and listen
    mine: list[tuple[str, Transport | None, bytes | None, str]] = []
    for name in names:
        try:
            tr = transport_class(name)(opts)
            try:
                blob = tr.listen()
            except BaseException:
                tr.close()
                raise
            mine.append((name, tr, blob, ""))
            w.transports.append(tr)
        except Exception as exc:
            full = isinstance(exc, tb.TransportError) and exc.errno == errno.ENOSPC
            (log.warning if full else log.info)(
                "transport %s unavailable on rank %d: %s%s",
                name,
                rank,
                exc,
                "; peers on this host use the next allowed transport" if full else "",
            )
            mine.append((name, None, None, f"{type(exc).__name__}: {exc}"))
    try:
        return _connect_all(boot, cfg, w, mine, device, what)
    except BaseException:
        w.close()
        raise


def _connect_all(
    boot: Bootstrap,
    cfg: Config,
    w: Wiring,
    mine: list[tuple[str, Transport | None, bytes | None, str]],
    device: bool,
    what: str,
) -> Wiring:
    rank, size, t = w.rank, w.size, cfg.timeout
    blobs = boot.allgather([b for _, _, b, _ in mine], t, what + "endpoints")

    # 3. verdicts: mine[i] accepts peer p?
    verdict: dict[int, list[bool]] = {}
    reasons: dict[int, list[str]] = {}
    for p in range(size):
        if p == rank:
            continue
        ok_list, why_list = [], []
        for i, (_name, tr, my_blob, err) in enumerate(mine):
            peer_blob = blobs[p][i]
            if tr is None or my_blob is None:
                ok, why = False, f"not available here ({err})"
            elif peer_blob is None:
                ok, why = False, f"not available on rank {p}"
            else:
                try:
                    ok, why = tr.can_connect(my_blob, peer_blob)
                except Exception as exc:
                    ok, why = False, f"{type(exc).__name__}: {exc}"
            ok_list.append(ok)
            why_list.append(why)
        verdict[p] = ok_list
        reasons[p] = why_list
    table = boot.allgather(dict(verdict), t, what + "verdicts")

    def first(p: int, start: int) -> int | None:
        """The first transport from ``start`` on that both ends accept (refusals logged)."""
        theirs = table[p][rank]
        for i in range(start, len(mine)):
            if verdict[p][i] and theirs[i]:
                return i
            log.info(
                "rank %d -> %d: %s refused %s: %s",
                rank,
                p,
                mine[i][0],
                "here" if not verdict[p][i] else f"on rank {p}",
                reasons[p][i] if not verdict[p][i] else "(see that rank's log)",
            )
        return None

    # 4. connect; a pair that fails falls back to the next transport both accept
    errors: list[str] = []
    choice: dict[int, int] = {}
    for p in range(size):
        if p == rank:
            continue
        pick = first(p, 0)
        if pick is not None:
            choice[p] = pick
        elif not device:
            detail = "; ".join(f"{mine[j][0]}: {reasons[p][j]}" for j in range(len(mine)))
            errors.append(f"No transport found for rank {rank} -> rank {p} ({detail})")
    todo = sorted(choice)
    for _round in range(len(mine)):
        failed: dict[int, str] = {}
        for p in todo:
            name, chosen_t, _, _ = mine[choice[p]]
            assert chosen_t is not None
            try:
                with translate(rank, f"connecting to rank {p} over {name}", {p: name}):
                    conn = chosen_t.connect(p, blobs[p][choice[p]])
            except PycollError as exc:
                failed[p] = str(exc).removeprefix(f"rank {rank}: ")
                continue
            w.conns[p] = conn
            w.kind[p] = conn.transport
            w.why[p] = reasons[p][choice[p]]
            log.info("rank %d -> %d: using %s (%s)", rank, p, conn.transport, w.why[p])
        # Both ends must learn of a failure on either side, to move on together.
        # Each connect may take up to the timeout (an attacher waits that long for
        # a segment its creator failed to make), so a live rank may arrive here
        # up to one timeout per peer after the others.
        seen = boot.allgather(failed, t * size, what + "connection results")
        again = []
        for p in todo:
            why = failed.get(p) or seen[p].get(rank)
            if why is None:
                continue
            name = mine[choice[p]][0]
            if p in w.conns:  # it failed on the other end
                why = f"rank {p}: {why}"
                w.conns.pop(p).close()
                w.kind.pop(p, None)
                w.why.pop(p, None)
            nxt = first(p, choice[p] + 1)
            if nxt is None:
                if not device:
                    errors.append(why)
                continue
            log.warning(
                "rank %d -> %d: %s failed (%s); falling back to %s",
                rank,
                p,
                name,
                why,
                mine[nxt][0],
            )
            choice[p] = nxt
            again.append(p)
        if not again:
            break
        todo = again
    failed_ranks = [r for r, n in enumerate(boot.allgather(len(errors), t, what + "results")) if n]
    if failed_ranks:
        msg = (
            "; ".join(errors)
            if errors
            else f"connection set-up failed on rank(s) {failed_ranks} (see their errors)"
        )
        raise ConnectError(f"rank {rank}: {msg}", rank=rank)
    if not device:
        try:
            _group(boot, cfg, w)
        except BaseException:
            w.close()
            raise
    # nobody may leave until every segment is attached (its creator holds it until then)
    boot.barrier(t, what + "final barrier")
    for tr in w.transports:
        tr.seal()
    return w


def _group(boot: Bootstrap, cfg: Config, w: Wiring) -> None:
    """Build the group segment when every pair of ranks uses shm (step 5).

    Its absence is no error: the ``direct`` algorithms are then not candidates.
    Every rank takes the same decision (each verdict is allgathered).
    """
    rank, size = w.rank, w.size
    why = ""
    if cfg.group_slot_bytes <= 0:
        why = "PYCOLL_GROUP_SLOT_BYTES=0"
    else:
        off = sorted(p for p, k in w.kind.items() if k != "shm")
        if off:
            why = f"rank {rank} reaches rank(s) {off} by {w.kind[off[0]]}, not shm"
    t, what = cfg.timeout, "pycoll.init: group segment"
    whys = boot.allgather(why, t, what)
    refused = [(r, y) for r, y in enumerate(whys) if y]
    if refused:
        w.group_why = f"not every rank is on one host with shared memory ({refused[0][1]})"
        log.info("rank %d: no group segment: %s", rank, w.group_why)
        return
    token = boot.bcast(secrets.token_bytes(8) if rank == 0 else None, 0, t, what)
    group: ShmGroup | None = None
    err = ""
    if rank == 0:
        try:
            group = ShmGroup.create(token, rank, size, cfg.group_slot_bytes)
        except Exception as exc:
            err = f"rank {rank}: {type(exc).__name__}: {exc}"
    # the others open the segment through rank 0's handle, once it exists
    err, handle = boot.bcast((err, group.handle if group is not None else b""), 0, t, what)
    if rank != 0 and not err:
        try:
            group = ShmGroup.attach(handle, rank, size)
        except Exception as exc:
            err = f"rank {rank}: {type(exc).__name__}: {exc}"
    errs = [e for e in boot.allgather(err, t, what) if e]
    if errs:  # everyone saw the same list: drop the group on every rank
        if group is not None:
            group.close()
        w.group_why = f"group segment failed ({errs[0]})"
        log.info("rank %d: no group segment: %s", rank, w.group_why)
        return
    assert group is not None
    group.release_handle()  # every rank has attached
    ok, cma_why = group.probe()
    verdicts = boot.allgather((ok, cma_why), t, what)
    group.cma = all(v for v, _ in verdicts)
    if not group.cma:
        cma_why = next(f"rank {r}: {y}" for r, (v, y) in enumerate(verdicts) if not v)
    w.group = group
    w.group_why = f"all {size} ranks share memory on one host; " + (
        "large messages by direct reads" if group.cma else f"no direct reads ({cma_why})"
    )
    log.info("rank %d: group segment %s: %s", rank, group.name, w.group_why)
