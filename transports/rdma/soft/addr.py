"""Addressing objects of pyverbs (``pyverbs.addr``): GID, GlobalRoute, AHAttr."""

from __future__ import annotations

import ipaddress


class GID:
    """A 128-bit port GID.  ``gid`` is the colon form pyverbs prints (8 groups of 4 hex)."""

    def __init__(self, val: str | bytes | None = None) -> None:
        self._raw = bytes(16)
        if isinstance(val, bytes | bytearray):
            if len(val) != 16:
                raise ValueError("a GID is 16 bytes")
            self._raw = bytes(val)
        elif val:
            self.gid = val

    @property
    def gid(self) -> str:
        h = self._raw.hex()
        return ":".join(h[i : i + 4] for i in range(0, 32, 4))

    @gid.setter
    def gid(self, val: str) -> None:
        self._raw = (
            bytes.fromhex(val.replace(":", ""))
            if val.count(":") == 7
            else ipaddress.IPv6Address(val).packed
        )

    def __bytes__(self) -> bytes:
        return self._raw

    def __eq__(self, other: object) -> bool:
        return isinstance(other, GID) and other._raw == self._raw

    def __hash__(self) -> int:
        return hash(self._raw)

    def __str__(self) -> str:
        return self.gid

    @classmethod
    def from_ipv4(cls, addr: str) -> GID:
        """The IPv4-mapped GID a RoCE v2 port shows for ``addr`` (``::ffff:a.b.c.d``)."""
        return cls(ipaddress.IPv6Address(f"::ffff:{addr}").packed)

    def ipv4(self) -> str | None:
        """The IPv4 address of an IPv4-mapped GID, else None."""
        mapped = ipaddress.IPv6Address(self._raw).ipv4_mapped
        return None if mapped is None else str(mapped)


class GlobalRoute:
    """``ibv_global_route``: where a GRH-routed packet goes."""

    def __init__(
        self,
        dgid: GID | None = None,
        flow_label: int = 0,
        sgid_index: int = 0,
        hop_limit: int = 1,
        traffic_class: int = 0,
    ) -> None:
        self.dgid = dgid if dgid is not None else GID()
        self.flow_label = flow_label
        self.sgid_index = sgid_index
        self.hop_limit = hop_limit
        self.traffic_class = traffic_class


class AHAttr:
    """``ibv_ah_attr``: the address vector of a connected QP's peer."""

    def __init__(
        self,
        port_num: int = 1,
        is_global: int = 0,
        sl: int = 0,
        src_path_bits: int = 0,
        dlid: int = 0,
        gr: GlobalRoute | None = None,
    ) -> None:
        self.port_num = port_num
        self.is_global = 1 if gr is not None else is_global
        self.sl = sl
        self.src_path_bits = src_path_bits
        self.dlid = dlid
        self.gr = gr if gr is not None else GlobalRoute()

    @property
    def dgid(self) -> GID:
        return self.gr.dgid

    @dgid.setter
    def dgid(self, val: GID) -> None:
        self.gr.dgid = val

    @property
    def sgid_index(self) -> int:
        return self.gr.sgid_index

    @sgid_index.setter
    def sgid_index(self, val: int) -> None:
        self.gr.sgid_index = val
