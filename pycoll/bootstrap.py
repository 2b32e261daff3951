"""Wire up a communicator through mpi4py: secrets, endpoint blobs, transports.

1. Rank 0 draws the job's secret and broadcasts it (network transports drop
   peers that cannot present it).
2. Each transport allowed by ``PYCOLL_TRANSPORT`` is created and ``listen``\\ s;
   the endpoint blobs are allgathered.  A transport that cannot be created
   (missing library, no device) is skipped with its reason.
3. Each rank asks every transport, in priority order, whether it can reach each
   peer; the verdicts are allgathered too, and a pair uses the first transport
   that *both* ends accept, so the two sides always agree.
4. Connections are made; a pair with no common transport fails loudly, naming
   every refusal (like NCCL's "No transport found for rank a -> rank b").
5. When every pair of ranks chose shm (one host, shared memory allowed there and
   by ``PYCOLL_TRANSPORT``), the ranks also share one group segment
   (:mod:`transports.shm_group`), which the ``direct`` algorithms use.
"""

from __future__ import annotations

import logging
import secrets
import time
from dataclasses import dataclass, field
from typing import Any

from pycoll.config import Config
from pycoll.errors import ConnectError, PycollError, translate
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

    def close(self) -> None:
        if self.group is not None:
            try:
                self.group.close()
            except Exception as exc:
                log.warning("closing the group segment: %s", exc)
            self.group = None
        for c in reversed(list(self.conns.values())):
            try:
                c.close()
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


#: The tag of :func:`_arrive`'s messages on the caller's communicator (MPI
#: promises tags up to at least 32767).
ARRIVE_TAG = 32_123


def _arrive(mpi_comm: Any, timeout: float, rank: int) -> None:
    """Wait, at most ``timeout`` seconds, until every rank has entered ``pycoll.init``.

    MPI's own collectives wait forever, and a barrier cannot tell who is late;
    so each rank sends every other a byte and waits, polling against the
    deadline, until it has one from each.  A rank that never calls ``init``
    neither hangs the others nor goes unnamed.

    Raises:
        ConnectError: not every rank arrived in time; it names those that did not.
    """
    peers = [p for p in range(mpi_comm.Get_size()) if p != rank]
    token = bytearray(1)
    inbox = bytearray(len(peers))
    sends = [mpi_comm.Isend(token, dest=p, tag=ARRIVE_TAG) for p in peers]
    waiting = {
        p: mpi_comm.Irecv(memoryview(inbox)[i : i + 1], source=p, tag=ARRIVE_TAG)
        for i, p in enumerate(peers)
    }
    deadline = time.monotonic() + timeout
    nap = 1e-4
    while True:
        for p in [p for p, req in waiting.items() if req.Test()]:
            del waiting[p]
        if not waiting:
            break
        if time.monotonic() > deadline:
            late = sorted(waiting)
            for req in waiting.values():
                req.Cancel()
                req.Wait()
            for req in sends:
                if not req.Test():
                    req.Free()  # to a late rank: let MPI finish or drop it
            raise ConnectError(
                f"rank {rank}: pycoll.init: rank(s) {late} of the {mpi_comm.Get_size()} "
                f"did not call init within {timeout:g} s (PYCOLL_TIMEOUT)",
                rank=rank,
                peer=late[0],
            )
        time.sleep(nap)
        nap = min(2 * nap, 0.01)
    for req in sends:
        req.Wait()


def wire(mpi_comm: Any, cfg: Config, *, device: bool = False) -> Wiring:
    """Build every connection of this rank.

    With ``device=True`` it builds the second table, for GPU buffers, from
    ``cfg.device_transports`` (cuda_ipc); a pair that none of them reaches is
    left out (its device bytes are staged through the host connection).

    Raises:
        ConnectError: no transport reaches some peer, or a connection failed.
    """
    rank, size = mpi_comm.Get_rank(), mpi_comm.Get_size()
    w = Wiring(rank, size)
    if size == 1:
        return w
    if not device:
        _arrive(mpi_comm, cfg.timeout, rank)
    secret = mpi_comm.bcast(secrets.token_bytes(32) if rank == 0 else None, root=0)
    opts = _options(cfg, rank, size, secret, device)
    names = cfg.device_transports if device else cfg.transports

    # 2. create and listen
    mine: list[tuple[str, Transport | None, bytes | None, str]] = []
    for name in names:
        try:
            t = transport_class(name)(opts)
            blob = t.listen()
            mine.append((name, t, blob, ""))
            w.transports.append(t)
        except Exception as exc:
            log.info("transport %s unavailable on rank %d: %s", name, rank, exc)
            mine.append((name, None, None, f"{type(exc).__name__}: {exc}"))
    blobs = mpi_comm.allgather([b for _, _, b, _ in mine])

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
    table = mpi_comm.allgather({p: v for p, v in verdict.items()})

    # 4. connect
    errors: list[str] = []
    for p in range(size):
        if p == rank:
            continue
        theirs = table[p][rank]
        chosen = None
        for i, (name, _t, _, _) in enumerate(mine):
            if verdict[p][i] and theirs[i]:
                chosen = i
                break
            side = "here" if not verdict[p][i] else f"on rank {p}"
            log.info(
                "rank %d -> %d: %s refused %s: %s",
                rank,
                p,
                name,
                side,
                reasons[p][i] if not verdict[p][i] else "(see that rank's log)",
            )
        if chosen is None and device:
            continue
        if chosen is None:
            detail = "; ".join(f"{mine[i][0]}: {reasons[p][i]}" for i in range(len(mine)))
            errors.append(f"No transport found for rank {rank} -> rank {p} ({detail})")
            continue
        name, chosen_t, _, _ = mine[chosen]
        assert chosen_t is not None
        try:
            with translate(rank, f"connecting to rank {p} over {name}", {p: name}):
                conn = chosen_t.connect(p, blobs[p][chosen])
        except PycollError as exc:
            errors.append(str(exc))
            continue
        w.conns[p] = conn
        w.kind[p] = conn.transport
        w.why[p] = reasons[p][chosen]
        log.info("rank %d -> %d: using %s (%s)", rank, p, conn.transport, reasons[p][chosen])
    failed = mpi_comm.allreduce(1 if errors else 0)
    if errors or failed:
        w.close()
        msg = "; ".join(errors) if errors else f"connection set-up failed on {failed} other rank(s)"
        raise ConnectError(f"rank {rank}: {msg}", rank=rank)
    if not device:
        try:
            _group(mpi_comm, cfg, w)
        except BaseException:
            w.close()
            raise
    # nobody may leave until every segment is attached (its creator holds it until then)
    mpi_comm.Barrier()
    return w


def _group(mpi_comm: Any, cfg: Config, w: Wiring) -> None:
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
    whys = mpi_comm.allgather(why)
    refused = [(r, y) for r, y in enumerate(whys) if y]
    if refused:
        w.group_why = f"not every rank is on one host with shared memory ({refused[0][1]})"
        log.info("rank %d: no group segment: %s", rank, w.group_why)
        return
    token = mpi_comm.bcast(secrets.token_bytes(8) if rank == 0 else None, root=0)
    group: ShmGroup | None = None
    err = ""
    if rank == 0:
        try:
            group = ShmGroup.create(token, rank, size, cfg.group_slot_bytes)
        except Exception as exc:
            err = f"rank {rank}: {type(exc).__name__}: {exc}"
    # the others open the segment through rank 0's handle, once it exists
    err, handle = mpi_comm.bcast((err, group.handle if group is not None else b""), root=0)
    if rank != 0 and not err:
        try:
            group = ShmGroup.attach(handle, rank, size)
        except Exception as exc:
            err = f"rank {rank}: {type(exc).__name__}: {exc}"
    errs = [e for e in mpi_comm.allgather(err) if e]
    if errs:  # everyone saw the same list: drop the group on every rank
        if group is not None:
            group.close()
        w.group_why = f"group segment failed ({errs[0]})"
        log.info("rank %d: no group segment: %s", rank, w.group_why)
        return
    assert group is not None
    group.release_handle()  # every rank has attached
    ok, cma_why = group.probe()
    verdicts = mpi_comm.allgather((ok, cma_why))
    group.cma = all(v for v, _ in verdicts)
    if not group.cma:
        cma_why = next(f"rank {r}: {y}" for r, (v, y) in enumerate(verdicts) if not v)
    w.group = group
    w.group_why = f"all {size} ranks share memory on one host; " + (
        "large messages by direct reads" if group.cma else f"no direct reads ({cma_why})"
    )
    log.info("rank %d: group segment %s: %s", rank, group.name, w.group_why)
