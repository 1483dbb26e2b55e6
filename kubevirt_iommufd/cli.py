"""Command line: parse arguments, dispatch to a subcommand, turn errors into one clear line."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from hostdev.errors import HostdevError
from hostdev.simhost import SCENARIOS
from kubevirt_iommufd import inspect_command

PROG = "kubevirt-iommufd"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG,
        description=(
            "PCI passthrough for KubeVirt VMs through iommufd and VFIO cdevs, with a safe"
            " fall-back to legacy VFIO groups."
        ),
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    inspect = commands.add_parser(
        "inspect",
        help="list the node's PCI functions by IOMMU group and whether each can be assigned",
        description=(
            "List the node's PCI functions grouped by IOMMU group: ids and names, driver, VFIO"
            " cdev, NUMA node, and whether each can be assigned to a VM (over iommufd or legacy"
            " VFIO) with the reason when it cannot. Exit 0 on success, 1 on an error."
        ),
    )
    inspect.add_argument(
        "bdfs",
        nargs="*",
        metavar="BDF",
        help="only these functions and the rest of their IOMMU groups (e.g. 0000:3b:00.0)",
    )
    source = inspect.add_mutually_exclusive_group()
    source.add_argument(
        "--root",
        default="/",
        metavar="DIR",
        help="directory holding the host's sys/ and dev/ (default: /)",
    )
    source.add_argument(
        "--example",
        choices=sorted(SCENARIOS),
        help="inspect a built-in simulated node instead of this host",
    )
    inspect.add_argument(
        "--json",
        action="store_true",
        help=f"print the JSON document ({inspect_command.SCHEMA}, see docs/inspect-json.md)",
    )
    inspect.add_argument(
        "--pci-ids",
        metavar="FILE",
        help="pci.ids database for names; 'none' for ids only (default: the system's copy)",
    )
    inspect.set_defaults(run=inspect_command.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        result: int = args.run(args)
    except HostdevError as error:
        print(f"{PROG}: error: {error}", file=sys.stderr)
        return 1
    except BrokenPipeError:
        return 0  # `inspect | head` closed the pipe: not an error of ours
    return result
