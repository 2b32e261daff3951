"""Device and context of the soft provider (``pyverbs.device``).

One soft device, ``soft0``, with one port.  A :class:`Context` owns the
emulated NIC: a TCP listener on a loopback or 198.18.0.0/15 address and a
progress thread (:mod:`transports.rdma.soft.engine`).  The port's GID is the
IPv4-mapped address (as on a RoCE v2 port) and, unlike RoCE where it is 0, its
LID is the listener's TCP port: the emulation routes by (GID, LID, QPN).
"""

from __future__ import annotations

import ipaddress
import itertools
import weakref
from collections.abc import Iterable
from typing import TYPE_CHECKING

from transports.rdma.soft import enums as e
from transports.rdma.soft.addr import GID
from transports.rdma.soft.pyverbs_error import PyverbsRDMAError, PyverbsUserError

if TYPE_CHECKING:
    from typing import Self  # 3.11; annotations only (3.10 has none)

DEVICE_NAME = "soft0"

#: Capabilities a soft context may be told to claim (``soft_caps``): ``peermem``
#: (the NIC may register CUDA pointers, as with nvidia_peermem) and ``dmabuf``
#: (``ibv_reg_dmabuf_mr`` works).  Claimed, not real: see the package docstring.
SOFT_CAPS = frozenset({"peermem", "dmabuf"})

_ALLOWED_NETS = (
    ipaddress.ip_network("127.0.0.0/8"),
    ipaddress.ip_network("198.18.0.0/15"),
)


def check_address(addr: str) -> str:
    """Accept only loopback or 198.18.0.0/15 (benchmark-network) IPv4 addresses."""
    ip = ipaddress.ip_address(addr)
    if ip.version != 4 or not any(ip in net for net in _ALLOWED_NETS):
        raise PyverbsUserError(
            f"soft RDMA only binds loopback or 198.18.0.0/15 addresses, not {addr}"
        )
    return str(ip)


class Device:
    """An entry of :func:`get_device_list`; ``name`` is bytes, as in pyverbs."""

    def __init__(self, name: bytes) -> None:
        self.name = name
        self.node_type = e.IBV_NODE_CA
        self.transport_type = e.IBV_TRANSPORT_IB
        self.guid = 0x50636F6C6C000001
        self.index = 0


def get_device_list() -> list[Device]:
    return [Device(DEVICE_NAME.encode())]


class DeviceAttr:
    def __init__(self) -> None:
        self.fw_ver = "soft-1"
        self.node_guid = 0x50636F6C6C000001
        self.sys_image_guid = self.node_guid
        self.max_mr_size = 1 << 48
        self.page_size_cap = 4096
        self.vendor_id = 0
        self.vendor_part_id = 0
        self.hw_ver = 0
        self.max_qp = 1 << 16
        self.max_qp_wr = 1 << 15
        self.max_sge = 16
        self.max_cq = 1 << 16
        self.max_cqe = 1 << 22
        self.max_mr = 1 << 20
        self.max_pd = 1 << 16
        self.max_qp_rd_atom = 16
        self.max_qp_init_rd_atom = 16
        self.phys_port_cnt = 1


class PortAttr:
    def __init__(self, lid: int) -> None:
        self.state = e.IBV_PORT_ACTIVE
        self.max_mtu = e.IBV_MTU_4096
        self.active_mtu = e.IBV_MTU_4096
        self.gid_tbl_len = 1
        self.port_cap_flags = 0
        self.max_msg_sz = 1 << 31
        self.lid = lid
        self.sm_lid = 0
        self.lmc = 0
        self.link_layer = e.IBV_LINK_LAYER_ETHERNET
        self.active_width = 1
        self.active_speed = 1
        self.phys_state = 5


class Context:
    """An opened soft device: ``Context(name="soft0")``.

    Keyword-only extras of the soft provider (pyverbs has none of them):

    Args:
        soft_addr: IPv4 address to bind (loopback or 198.18.0.0/15); default
            127.0.0.1.
        soft_caps: capabilities to claim, a subset of :data:`SOFT_CAPS`.
        soft_secret: the job's secret; connections must prove they hold it.
    """

    _qpn_counter = itertools.count(0x100)
    _key_counter = itertools.count(0x1000)

    def __init__(
        self,
        name: str | None = None,
        *,
        soft_addr: str = "127.0.0.1",
        soft_caps: Iterable[str] = (),
        soft_secret: bytes = b"",
        **_kw: object,
    ) -> None:
        from transports.rdma.soft.engine import Engine

        if name is not None and name != DEVICE_NAME:
            raise PyverbsRDMAError(f"Failed to open device {name}", 19)  # ENODEV
        caps = frozenset(soft_caps)
        unknown = caps - SOFT_CAPS
        if unknown:
            raise PyverbsUserError(
                f"unknown soft capabilities {sorted(unknown)}; known: {sorted(SOFT_CAPS)}"
            )
        self.name = DEVICE_NAME
        self.soft_caps = caps
        self.secret = bytes(soft_secret)
        self.addr = check_address(soft_addr)
        self.gid = GID.from_ipv4(self.addr)
        self.mrs: dict[int, object] = {}  # lkey/rkey -> MR
        self.qps: dict[int, object] = {}  # qp_num -> QP
        self._children: weakref.WeakSet[object] = weakref.WeakSet()
        self.engine = Engine(self)
        self.lid = self.engine.port
        self._closed = False

    # --------------------------------------------------------------- queries
    def query_device(self) -> DeviceAttr:
        return DeviceAttr()

    def query_port(self, port_num: int = 1) -> PortAttr:
        if port_num != 1:
            raise PyverbsRDMAError(f"Failed to query port {port_num}", 22)
        return PortAttr(self.lid)

    def query_gid(self, port_num: int, index: int) -> GID:
        if port_num != 1 or index != 0:
            raise PyverbsRDMAError(f"Failed to query gid {index} of port {port_num}", 22)
        return GID(bytes(self.gid))

    # --------------------------------------------------------------- internals
    def _add_ref(self, obj: object) -> None:
        self._children.add(obj)

    def _new_qpn(self) -> int:
        return next(Context._qpn_counter) & 0xFFFFFF

    def _new_key(self) -> int:
        return next(Context._key_counter) & 0xFFFFFFFF

    def close(self) -> None:
        """Destroy every child object, stop the progress thread, close the port."""
        if self._closed:
            return
        self._closed = True
        for child in list(self._children):
            child.close()  # type: ignore[attr-defined]
        self.engine.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
