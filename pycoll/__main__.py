"""``python -m pycoll``: small command-line tools.

``python -m pycoll info`` reports what this machine offers pycoll (see
:mod:`pycoll.info`); ``python -m pycoll --version`` prints the version.
"""

from __future__ import annotations

import argparse
import json
import sys

from pycoll.config import RDMA_PROVIDERS, SOFT_CAPS, Config
from pycoll.errors import InvalidArgumentError
from transports.rdma.caps import DISTANCES

# Plain text: argparse prints these as they are.
DESCRIPTION = "pycoll's command-line tools."
INFO_HELP = "report versions, usable transports, shm, GPUs, NICs and RDMA memory paths"
INFO_DESCRIPTION = (
    "Report what this machine offers pycoll: versions of pycoll, NumPy, mpi4py and "
    "the MPI library, CuPy, torch and pyverbs; which transports are usable and why "
    "not; the tcp interface; the /dev/shm size and whether cross-memory attach is "
    "permitted; GPUs and RDMA NICs with their PCIe distance and the RDMA memory "
    "path of each GPU-NIC pair.  The defaults come from PYCOLL_* variables."
)


def _soft_caps(text: str) -> str:
    """argparse type: a comma list of SOFT_CAPS (empty allowed)."""
    caps = [c.strip().lower() for c in text.split(",") if c.strip()]
    bad = [c for c in caps if c not in SOFT_CAPS]
    if bad:
        raise argparse.ArgumentTypeError(
            f"invalid choice: {', '.join(map(repr, bad))} (choose a comma list of "
            f"{', '.join(SOFT_CAPS)})"
        )
    return ",".join(caps)


def _info(args: argparse.Namespace) -> int:
    from pycoll import info

    report = info.gather(
        args.config, provider=args.provider, soft_caps=args.soft_caps, gdr_level=args.gdr_level
    )
    if args.json:
        print(json.dumps(report, indent=2, sort_keys=False, default=str))
    else:
        print(info.render(report))
    return 0


def _version() -> str:
    import pycoll

    return f"pycoll {pycoll.__version__} (distribution pycoll-collectives)"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pycoll", description=DESCRIPTION)
    parser.add_argument("--version", action="version", version=_version())
    sub = parser.add_subparsers(dest="command", required=True, metavar="command")
    info = sub.add_parser("info", help=INFO_HELP, description=INFO_DESCRIPTION)
    info.add_argument("--json", action="store_true", help="print the report as JSON")
    info.add_argument(
        "--provider",
        choices=RDMA_PROVIDERS,
        type=str.lower,
        help="RDMA provider to probe (default: PYCOLL_RDMA_PROVIDER, else auto)",
    )
    info.add_argument(
        "--soft-caps",
        type=_soft_caps,
        help="capabilities the soft provider claims, a comma list of "
        f"{', '.join(SOFT_CAPS)} (default: PYCOLL_RDMA_SOFT_CAPS)",
    )
    info.add_argument(
        "--gdr-level",
        default="PXB",
        choices=DISTANCES,
        type=str.upper,
        help="farthest GPU-NIC PCIe distance for GPUDirect RDMA (default: PXB)",
    )
    args = parser.parse_args(argv)
    try:
        args.config = Config.from_env()  # PYCOLL_* checked as a communicator would
    except InvalidArgumentError as exc:
        parser.error(str(exc))
    return int(_info(args))


if __name__ == "__main__":
    sys.exit(main())
