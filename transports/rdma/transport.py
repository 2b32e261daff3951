"""The RDMA transport: RC queue pairs over verbs, set up once per rank.

Per rank: one device context, protection domain and completion queue; one RC QP
per peer, created at :meth:`RdmaTransport.listen` so that the endpoint blob can
carry every QP number.  Each rank also registers a receive area: for every peer,
``nslots`` slots of ``slot_bytes`` that only that peer writes into.  What moves
on a connection, and how, is in :mod:`transports.rdma.connection`.

The memory path (``rdma_memory``: dmabuf, gdr, host) decides how *GPU* memory
becomes visible to the NIC (:meth:`RdmaTransport._register_device`: the device
slots and device staging); host slots and staging are host memory on every path.
"""

from __future__ import annotations

import logging
import random
import struct
import threading
import time
import zlib
from dataclasses import dataclass
from typing import Any

from transports import _exit
from transports.base import (
    PIECE_ALIGN,
    BlobError,
    ConnectError,
    Connection,
    Transport,
    TransportError,
    TransportOptions,
)
from transports.rdma import dmabuf, gdr, host
from transports.rdma.connection import GOODBYE_WAIT, WR_RECV, RdmaConnection
from transports.rdma.host import HostBuffer, Registration
from transports.rdma.verbs import open_verbs, soft_fabric

__all__ = ["BLOB_CRC", "BLOB_HEADER", "Endpoint", "RdmaConnection", "RdmaTransport"]

log = logging.getLogger(__name__)

# ------------------------------------------------------------------ blob format
#: Endpoint blob, little-endian, version 3 (3: host slots carry a head with the
#: message's tag, see transports.rdma.connection.HOST_HEAD):
#:   header  BLOB_HEADER  magic b"PCRD", version, provider (0 pyverbs, 1 soft),
#:           port, mtu (ibv_mtu), lid, rank, size, nslots, slot_bytes, rkey,
#:           slots base address, gid[16], fabric[16], device slots' rkey and
#:           base address (zeros when this rank has no device slots)
#:   entries BLOB_ENTRY x size: (qp_num, psn) of the QP this rank made for peer i
#:           (zeros for its own rank)
#:   trailer CRC-32 of everything before it
BLOB_MAGIC = b"PCRD"
BLOB_VERSION = 4  # 4: a goodbye names the rank it closed because of
BLOB_HEADER = struct.Struct("<4sBBBBHxxIIIIIQ16s16sIxxxxQ")
BLOB_ENTRY = struct.Struct("<II")
BLOB_CRC = struct.Struct("<I")
PROVIDER_CODE = {"pyverbs": 0, "soft": 1}

MEMORY_PATHS = ("dmabuf", "gdr", "host")


@dataclass
class Endpoint:
    """A parsed endpoint blob (see the format above)."""

    provider: int
    port: int
    mtu: int
    lid: int
    rank: int
    size: int
    nslots: int
    slot_bytes: int
    rkey: int
    slots_addr: int
    gid: bytes
    fabric: bytes
    qps: list[tuple[int, int]]
    dev_rkey: int = 0
    dev_addr: int = 0

    def pack(self) -> bytes:
        head = BLOB_HEADER.pack(
            BLOB_MAGIC, BLOB_VERSION, self.provider, self.port, self.mtu, self.lid, self.rank, self.size,
            self.nslots, self.slot_bytes, self.rkey, self.slots_addr, self.gid, self.fabric,
            self.dev_rkey, self.dev_addr,
        )  # fmt: skip
        body = head + b"".join(BLOB_ENTRY.pack(q, p) for q, p in self.qps)
        return body + BLOB_CRC.pack(zlib.crc32(body))

    @classmethod
    def unpack(cls, blob: bytes) -> Endpoint:
        """Parse strictly; anything off raises :class:`BlobError`."""
        if not isinstance(blob, bytes | bytearray | memoryview):
            raise BlobError(
                f"rdma endpoint blob must be bytes, not {type(blob).__name__}",
                transport="rdma",
            )
        blob = bytes(blob)
        if len(blob) < BLOB_HEADER.size + BLOB_CRC.size:
            raise BlobError(f"rdma endpoint blob truncated ({len(blob)} bytes)", transport="rdma")
        fields = BLOB_HEADER.unpack_from(blob)
        magic, version = fields[0], fields[1]
        if magic != BLOB_MAGIC:
            raise BlobError(f"not an rdma endpoint blob (magic {magic!r})", transport="rdma")
        if version != BLOB_VERSION:
            raise BlobError(
                f"rdma endpoint blob version {version}, expected {BLOB_VERSION}",
                transport="rdma",
            )
        (
            _,
            _,
            provider,
            port,
            mtu,
            lid,
            rank,
            size,
            nslots,
            slot_bytes,
            rkey,
            slots_addr,
            gid,
            fabric,
            dev_rkey,
            dev_addr,
        ) = fields
        want = BLOB_HEADER.size + size * BLOB_ENTRY.size + BLOB_CRC.size
        if len(blob) != want:
            raise BlobError(
                f"rdma endpoint blob is {len(blob)} bytes, expected {want}",
                transport="rdma",
            )
        (crc,) = BLOB_CRC.unpack_from(blob, want - BLOB_CRC.size)
        if crc != zlib.crc32(blob[: want - BLOB_CRC.size]):
            raise BlobError("rdma endpoint blob checksum mismatch (corrupted)", transport="rdma")
        if (
            provider not in PROVIDER_CODE.values()
            or not 1 <= mtu <= 5
            or rank >= size
            or nslots < 1
            or slot_bytes < 2 * PIECE_ALIGN
            or slot_bytes % PIECE_ALIGN
        ):
            raise BlobError("rdma endpoint blob has out-of-range fields", transport="rdma")
        qps = [
            BLOB_ENTRY.unpack_from(blob, BLOB_HEADER.size + i * BLOB_ENTRY.size)
            for i in range(size)
        ]
        return cls(
            provider=provider, port=port, mtu=mtu, lid=lid, rank=rank, size=size, nslots=nslots,
            slot_bytes=slot_bytes, rkey=rkey, slots_addr=slots_addr, gid=gid, fabric=fabric, qps=qps,
            dev_rkey=dev_rkey, dev_addr=dev_addr,
        )  # fmt: skip


# ------------------------------------------------------------------ transport
class RdmaTransport(Transport):
    """RDMA over verbs (pyverbs or the soft provider).

    Options read from ``options.extra``: ``rdma_provider`` (auto, pyverbs, soft),
    ``rdma_memory`` (auto, dmabuf, gdr, host), ``rdma_device``, ``rdma_port``,
    ``rdma_gid_index``, ``rdma_gdr_level`` (PIX, PXB, PHB, NODE, SYS),
    ``rdma_gpu`` (CUDA device of this rank's device slots; default: the current
    CUDA context's device, else 0), ``soft_addr``,
    ``soft_caps`` (comma list: peermem, dmabuf).

    With the dmabuf or gdr path, :meth:`listen` also allocates device receive
    slots (``nslots`` x ``slot_bytes`` per peer, ``cuMemAlloc``) and registers
    them through that path; their rkey and address travel in the blob, and
    connections declare :attr:`~transports.base.Cap.DEVICE`.

    Args:
        options: as every transport.
        cuda: the CUDA access object (:class:`~transports.rdma.cuda.CudaDriver`
            or a stand-in with its methods); default: a CudaDriver, made only
            when a device path is chosen.
    """

    name = "rdma"

    def __init__(self, options: TransportOptions, *, cuda: Any = None) -> None:
        super().__init__(options)
        #: CUDA device of the device slots: ``rdma_gpu``, else the device of the
        #: CUDA context current when the path is chosen, else 0
        self.device = int(options.get("rdma_gpu", "0") or 0)
        self.cuda: Any = cuda
        self._own_cuda = cuda is None
        self.dev_recv_ptr = 0
        self.dev_recv_reg: Registration | None = None
        self.flusher: gdr.Flusher | None = None
        self.rank = options.rank
        self.size = options.size
        # a host slot holds its head (the tag) and at least one aligned piece of data
        self.slot_bytes = max(2 * PIECE_ALIGN, options.slot_bytes // PIECE_ALIGN * PIECE_ALIGN)
        self.nslots = max(1, min(options.nslots, 0x7FFF))
        self.max_send_wr = 2 * self.nslots + 8
        self.max_recv_wr = 2 * self.nslots + 8
        self.verbs: Any = None  # a Verbs once listen() ran
        self._blob: bytes | None = None
        self._conns: dict[int, RdmaConnection] = {}
        self._lock = threading.RLock()
        self._closed = False
        self.memory_path = "host"

    # ------------------------------------------------------------ setup
    def listen(self) -> bytes:
        if self._blob is not None:
            return self._blob
        opts = self.options
        try:
            verbs = self.verbs = open_verbs(opts)
            e = verbs.e
            self.ctx = verbs.open_context()
            self.pd = verbs.PD(self.ctx)
            cqe = (self.max_send_wr + self.max_recv_wr) * max(1, self.size - 1) + 16
            self.cq = verbs.CQ(self.ctx, cqe)
            self.port_num = int(opts.get("rdma_port", "1") or 1)
            port = self.ctx.query_port(self.port_num)
            self.lid = int(port.lid)
            self.mtu = int(port.active_mtu)
            self.gid_index = self._gid_index()
            self.gid = self.ctx.query_gid(self.port_num, self.gid_index)
            npeers = max(0, self.size - 1)
            area = npeers * self.nslots * self.slot_bytes
            self.recv_area = HostBuffer(area)
            access = e.IBV_ACCESS_LOCAL_WRITE | e.IBV_ACCESS_REMOTE_WRITE
            self.recv_mr = host.register(verbs, self.pd, self.recv_area.addr, max(area, 1), access)
            self.qps: dict[int, Any] = {}
            self.psns: dict[int, int] = {}
            rng = random.Random()
            for peer in range(self.size):
                if peer == self.rank:
                    continue
                cap = verbs.QPCap(
                    max_send_wr=self.max_send_wr,
                    max_recv_wr=self.max_recv_wr,
                    max_send_sge=1,
                    max_recv_sge=1,
                )
                init = verbs.QPInitAttr(
                    qp_type=e.IBV_QPT_RC,
                    scq=self.cq,
                    rcq=self.cq,
                    cap=cap,
                    sq_sig_all=1,
                )
                qp = verbs.QP(self.pd, init)
                attr = verbs.QPAttr()
                attr.qp_access_flags = access
                attr.port_num = self.port_num
                attr.pkey_index = 0
                qp.to_init(attr)
                for _ in range(self.max_recv_wr):
                    qp.post_recv(verbs.RecvWR(wr_id=WR_RECV | int(qp.qp_num), num_sge=0))
                self.qps[peer] = qp
                self.psns[peer] = rng.randrange(1 << 24)
        except TransportError:
            self.close()
            raise
        except Exception as exc:
            self.close()
            raise ConnectError(f"rdma setup failed: {exc}", transport="rdma") from exc
        self.memory_path = self._choose_memory_path()
        if self.memory_path in ("dmabuf", "gdr"):
            try:
                self._setup_device_slots()
            except Exception as exc:
                self.close()
                if isinstance(exc, TransportError):
                    raise
                raise ConnectError(
                    f"rdma:{self.memory_path} device slots could not be set up: {exc}",
                    transport="rdma",
                ) from exc
        fabric = (
            soft_fabric(verbs.context_kwargs["soft_addr"])
            if verbs.name == "soft"
            else self._hw_fabric()
        )
        ep = Endpoint(
            provider=PROVIDER_CODE[verbs.name], port=self.port_num, mtu=self.mtu, lid=self.lid, rank=self.rank,
            size=self.size, nslots=self.nslots, slot_bytes=self.slot_bytes, rkey=self.recv_mr.rkey,
            slots_addr=self.recv_mr.addr, gid=_gid_bytes(self.gid), fabric=fabric,
            qps=[(int(self.qps[p].qp_num), self.psns[p]) if p != self.rank else (0, 0) for p in range(self.size)],
            dev_rkey=self.dev_recv_reg.rkey if self.dev_recv_reg else 0,
            dev_addr=self.dev_recv_reg.addr if self.dev_recv_reg else 0,
        )  # fmt: skip
        self._blob = ep.pack()
        _exit.watch(self)
        where = f" at {verbs.context_kwargs['soft_addr']}" if verbs.name == "soft" else ""
        log.info(
            "rdma: rank %d listening via %s (%s)%s, lid %d, gid %s, memory path %s",
            self.rank, verbs.name, verbs.device, where, self.lid, _gid_bytes(self.gid).hex(),
            self.memory_path,
        )  # fmt: skip
        return self._blob

    def _setup_device_slots(self) -> None:
        """Device receive slots for every peer, registered through the memory path."""
        if self.cuda is None:
            from transports.rdma.cuda import CudaDriver

            self.cuda = CudaDriver(self.device)
        e = self.verbs.e
        area = max(0, self.size - 1) * self.nslots * self.slot_bytes
        self.dev_recv_ptr = self.cuda.alloc(area)
        access = e.IBV_ACCESS_LOCAL_WRITE | e.IBV_ACCESS_REMOTE_WRITE | e.IBV_ACCESS_REMOTE_READ
        self.dev_recv_reg = self._register_device(self.dev_recv_ptr, max(area, 1), access)
        if self.memory_path == "gdr":
            timeout = float(self.options.timeout)
            self.flusher = gdr.Flusher(
                self.verbs, self.ctx, self.pd, self.port_num, self.gid, self.lid, timeout
            )
        if self.verbs.name == "soft":
            log.info(
                "rdma: soft provider moves bytes to and from GPU %d with CUDA copies "
                "(rdma:%s is emulated, not DMA)",
                self.device,
                self.memory_path,
            )

    def _register_device(self, ptr: int, nbytes: int, access: int) -> Registration:
        """Register device memory: a dma-buf MR (dmabuf) or an MR on the CUDA pointer (gdr)."""
        if self.memory_path == "dmabuf":
            return dmabuf.register(self.verbs, self.pd, ptr, nbytes, access, self.cuda)
        return gdr.register(self.verbs, self.pd, ptr, nbytes, access)

    def _gid_index(self) -> int:
        wanted = self.options.get("rdma_gid_index", "auto")
        if wanted and wanted != "auto":
            return int(wanted)
        # prefer an IPv4-mapped (RoCE v2) GID, as NCCL does, else index 0
        for idx in range(16):
            try:
                raw = _gid_bytes(self.ctx.query_gid(self.port_num, idx))
            except Exception:
                break
            if raw[:12] == b"\0" * 10 + b"\xff\xff":
                return idx
        return 0

    def _hw_fabric(self) -> bytes:
        raw = _gid_bytes(self.gid)
        return (b"ib:" + raw[:8]).ljust(16, b"\0") if self.lid else b"roce".ljust(16, b"\0")

    def _choose_memory_path(self) -> str:
        """dmabuf, then gdr, then host (``rdma_memory=auto``), logging every refusal."""
        from transports.rdma import caps as capmod

        wanted = (self.options.get("rdma_memory", "auto") or "auto").lower()
        if wanted not in (*MEMORY_PATHS, "auto"):
            raise ConnectError(
                f"unknown rdma_memory {wanted!r}; use auto, dmabuf, gdr or host",
                transport="rdma",
            )
        if wanted == "host":
            return "host"
        verbs = self.verbs
        c = capmod.Capabilities()
        c.gpus, c.gpu_error = self.cuda.gpus() if self.cuda is not None else capmod.detect_gpus()
        if c.gpus and not self.options.get("rdma_gpu"):
            from transports.rdma.cuda import current_device

            self.device = current_device()
        soft_caps = (
            frozenset(verbs.context_kwargs.get("soft_caps", ()))
            if verbs.name == "soft"
            else frozenset()
        )
        if verbs.name == "pyverbs" and c.gpus:
            c.nics = [n for n in capmod.detect_nics() if n.name == verbs.device]
            for nic in c.nics:
                nic.dmabuf, nic.dmabuf_why = capmod.probe_nic_dmabuf(verbs, self.ctx, self.pd)
            c.peermem = capmod.peermem_file()
            for g in c.gpus:
                for nic in c.nics:
                    if nic.pci_path:
                        gpath = f"/sys/bus/pci/devices/{g.pci_bus_id}"
                        c.distances[(g.index, nic.name)] = capmod.pci_distance(gpath, nic.pci_path)
        statuses = capmod.memory_paths(
            c,
            provider=verbs.name,
            soft_caps=soft_caps,
            gdr_level=self.options.get("rdma_gdr_level", "PXB") or "PXB",
            gpu=self.device,
        )
        order = MEMORY_PATHS if wanted == "auto" else (wanted,)
        for st in statuses:
            if st.name not in order:
                continue
            if st.usable:
                log.info("rdma: memory path %s chosen: %s", st.name, st.reason)
                return st.name
            log.info("rdma: memory path %s refused: %s", st.name, st.reason)
        if wanted != "auto":
            raise ConnectError(
                f"rdma_memory={wanted} requested but unusable (see log)",
                transport="rdma",
            )
        return "host"

    def can_connect(self, local: bytes, peer: bytes) -> tuple[bool, str]:
        try:
            a, b = Endpoint.unpack(local), Endpoint.unpack(peer)
        except BlobError as exc:
            return False, str(exc)
        if a.provider != b.provider:
            return False, "one side uses pyverbs, the other the soft provider"
        if a.fabric != b.fabric:
            return (
                False,
                "the peer's RDMA port is on another fabric (or another network namespace)",
            )
        if (a.nslots, a.slot_bytes) != (b.nslots, b.slot_bytes):
            return False, "slot geometry differs between the ranks"
        if a.size != b.size:
            return False, "the blobs disagree on the job size"
        return True, "same RDMA fabric"

    def connect(self, peer_rank: int, peer: bytes) -> Connection:
        if self._blob is None:
            self.listen()
        remote = Endpoint.unpack(peer)
        if remote.rank != peer_rank or remote.size != self.size or peer_rank == self.rank:
            raise ConnectError(
                f"rdma blob of rank {remote.rank}/{remote.size} given for peer {peer_rank}/{self.size}",
                peer=peer_rank,
                transport="rdma",
            )
        ok, why = self.can_connect(self._blob, peer)  # type: ignore[arg-type]
        if not ok:
            raise ConnectError(
                f"rdma cannot reach peer {peer_rank}: {why}",
                peer=peer_rank,
                transport="rdma",
            )
        dest_qpn, dest_psn = remote.qps[self.rank]
        if dest_qpn == 0:
            raise BlobError(
                f"rdma blob of peer {peer_rank} has no QP for rank {self.rank}",
                peer=peer_rank,
            )
        verbs = self.verbs
        e = verbs.e
        qp = self.qps[peer_rank]
        attr = verbs.QPAttr()
        attr.qp_access_flags = e.IBV_ACCESS_LOCAL_WRITE | e.IBV_ACCESS_REMOTE_WRITE
        attr.port_num = self.port_num
        attr.path_mtu = min(self.mtu, remote.mtu)
        attr.dest_qp_num = dest_qpn
        attr.rq_psn = dest_psn
        attr.sq_psn = self.psns[peer_rank]
        attr.max_dest_rd_atomic = 1
        attr.max_rd_atomic = 1
        attr.min_rnr_timer = 12  # 0.64 ms
        attr.timeout = int(
            self.options.get("rdma_timeout", "20") or 20
        )  # 4.096 us * 2**20 ~ 4 s per try
        attr.retry_cnt = 7
        attr.rnr_retry = 7  # credits make RNR impossible; retry forever if it happens anyway
        gr = verbs.GlobalRoute(dgid=verbs.GID(_gid_str(remote.gid)), sgid_index=self.gid_index)
        attr.ah_attr = verbs.AHAttr(port_num=self.port_num, is_global=1, dlid=remote.lid, gr=gr)
        try:
            qp.to_rtr(attr)
            qp.to_rts(attr)
        except Exception as exc:
            raise ConnectError(
                f"rdma: QP to peer {peer_rank} failed to reach RTS: {exc}",
                peer=peer_rank,
                transport="rdma",
            ) from exc
        conn = RdmaConnection(self, peer_rank, qp, remote)
        with self._lock:
            self._conns[conn.qp_num] = conn
        return conn

    # ------------------------------------------------------------ progress
    def _poll(self) -> None:
        with self._lock:
            while True:
                n, wcs = self.cq.poll(32)
                for wc in wcs:
                    conn = self._conns.get(int(wc.qp_num))
                    if conn is not None:
                        conn._on_wc(wc)
                if n < 32:
                    return

    def block(self, seconds: float) -> None:
        """Wait up to ``seconds`` for the CQ to have something (requests' idle hook).

        The soft provider's CQ can be waited on (its NIC work then runs in this
        thread); with pyverbs this is a plain sleep.
        """
        cq = getattr(self, "cq", None)
        if cq is None or self._closed or self.verbs.name != "soft":
            time.sleep(seconds)
        else:
            cq.wait(seconds)

    def await_goodbyes(self, conns: list[RdmaConnection], seconds: float) -> None:
        """Progress until the goodbyes of ``conns`` have left, at most ``seconds``."""
        end = time.monotonic() + seconds
        while any(c._bye == 1 and c.error is None for c in conns) and time.monotonic() < end:
            self._poll()
            self.block(1e-3)

    def mark_exiting(self) -> None:
        """At interpreter exit without close(): every peer gets our goodbye
        (:mod:`transports._exit`); nothing is freed."""
        if self._closed:
            return
        conns = [c for c in list(self._conns.values()) if c.post_goodbye()]
        self.await_goodbyes(conns, GOODBYE_WAIT)

    def _forget(self, conn: RdmaConnection) -> None:
        with self._lock:
            self._conns.pop(conn.qp_num, None)
            self.qps.pop(conn.peer, None)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        _exit.forget(self)
        for conn in list(self._conns.values()):
            conn.close()
        for name in ("qps",):
            for qp in getattr(self, name, {}).values():
                qp.close()
        for name in ("flusher", "dev_recv_reg", "recv_mr", "cq", "pd", "ctx"):
            obj = getattr(self, name, None)
            if obj is not None:
                try:
                    obj.close()
                except Exception as exc:  # keep releasing the rest
                    log.debug("rdma: closing %s: %s", name, exc)
        area = getattr(self, "recv_area", None)
        if area is not None:
            area.close()
        if self.cuda is not None:
            try:
                if self.dev_recv_ptr:
                    self.cuda.free(self.dev_recv_ptr)
                    self.dev_recv_ptr = 0
                if self._own_cuda:
                    self.cuda.close()
            except Exception as exc:
                log.debug("rdma: releasing CUDA memory: %s", exc)


def _gid_bytes(gid: Any) -> bytes:
    """16 raw bytes of a pyverbs or soft GID (its ``gid`` is the colon hex form)."""
    text = str(gid.gid if hasattr(gid, "gid") else gid)
    raw = bytes.fromhex(text.replace(":", ""))
    if len(raw) != 16:
        raise BlobError(f"unexpected GID {text!r}")
    return raw


def _gid_str(raw: bytes) -> str:
    h = raw.hex()
    return ":".join(h[i : i + 4] for i in range(0, 32, 4))
