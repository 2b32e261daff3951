"""``python -m pycoll``: small command-line tools.

``python -m pycoll info`` prints what this machine offers pycoll's RDMA
transport: GPUs, RDMA NICs, peer memory, dma-buf support, PCIe distances and
which memory path (dmabuf, gdr, host) can be used, with the reason.
"""

from __future__ import annotations

import argparse
import sys

from pycoll.config import RDMA_PROVIDERS, Config


def _info(args: argparse.Namespace) -> int:
    from transports.base import TransportOptions
    from transports.rdma import caps
    from transports.rdma.verbs import soft_address

    soft_caps = frozenset(c.strip() for c in (args.soft_caps or "").split(",") if c.strip())
    found = caps.detect(provider=args.provider, soft_caps=soft_caps, gdr_level=args.gdr_level)
    print(caps.report(found))
    chosen = next((p.name for p in found.paths if p.usable), "host")
    print(f"rdma_memory=auto would use: {chosen}")
    if args.provider == "soft" or (args.provider == "auto" and (found.pyverbs or not found.nics)):
        opts = TransportOptions(rank=0, size=1, socket_ifname=args.config.socket_ifname)
        claims = ",".join(sorted(soft_caps)) or "none"
        print(f"soft provider: binds {soft_address(opts)}, claims {claims} (emulation, no DMA)")
    return 0


def main(argv: list[str] | None = None) -> int:
    cfg = Config.from_env()  # PYCOLL_* checked as a communicator would
    parser = argparse.ArgumentParser(prog="python -m pycoll", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    info = sub.add_parser("info", help="report GPUs, RDMA devices and usable memory paths")
    info.add_argument(
        "--provider",
        default=cfg.rdma_provider,
        choices=RDMA_PROVIDERS,
        help="RDMA provider to probe (PYCOLL_RDMA_PROVIDER)",
    )
    info.add_argument(
        "--soft-caps",
        default=cfg.rdma_soft_caps,
        help="capabilities the soft provider claims (peermem,dmabuf; PYCOLL_RDMA_SOFT_CAPS)",
    )
    info.add_argument(
        "--gdr-level",
        default="PXB",
        help="farthest GPU-NIC distance for GDR (PIX..SYS)",
    )
    info.set_defaults(func=_info, config=cfg)
    args = parser.parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
