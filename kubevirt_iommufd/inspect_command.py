"""`kubevirt-iommufd inspect`: scan a host (or a simulated one) and print the report."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from hostdev.bdf import Bdf
from hostdev.errors import HostdevError
from hostdev.labels.node_labels import build_node_labels, count_iommufd_devices
from kubevirt_iommufd.inspect_report import SCHEMA, build_report, render_table
from kubevirt_iommufd.options import read_config_option, read_pci_ids_option, scan_node_option
from sim.host import SCENARIOS

DRA_STATE_DIR = "var/lib/kubevirt-iommufd/dra"


def add_parser(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    inspect = commands.add_parser(
        "inspect",
        help="list the node's PCI functions by IOMMU group and whether each can be assigned",
        description=(
            "List the node's PCI functions grouped by IOMMU group: ids and names, driver, VFIO"
            " cdev, NUMA node, and whether each can be assigned to a VM (over iommufd or legacy"
            " VFIO) with the reason when it cannot, and the kubevirt-iommufd.io/ node labels the"
            " device plugin would give the node. Exit 0 on success, 1 on an error."
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
        help=f"print the JSON document ({SCHEMA}, see docs/inspect-json.md)",
    )
    inspect.add_argument(
        "--pci-ids",
        metavar="FILE",
        help="pci.ids database for names; 'none' for ids only (default: the system's copy)",
    )
    inspect.add_argument(
        "--config",
        metavar="FILE",
        help="the device plugin's configuration, for the node labels (default: the built-in"
        " one: NVIDIA GPUs and NVSwitches on VFIO drivers)",
    )
    inspect.add_argument(
        "--dra-state-dir",
        metavar="DIR",
        help="the DRA driver's --state-dir, to show which claim each device is prepared for"
        " (default: var/lib/kubevirt-iommufd/dra under --root, when it exists)",
    )
    inspect.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    only = [Bdf.parse(text) for text in args.bdfs]
    config = read_config_option(args.config)
    names = read_pci_ids_option(args.pci_ids)
    inventory = scan_node_option(args.root, args.example, reset_methods=True)
    missing = [bdf for bdf in only if inventory.function(bdf) is None]
    if missing:
        listed = ", ".join(str(b) for b in missing)
        raise HostdevError(
            f"no PCI function {listed} on this host; run `kubevirt-iommufd inspect` to list them"
        )
    counts = count_iommufd_devices(inventory, config, names)
    labels = build_node_labels(inventory.capabilities, counts)
    report = build_report(inventory, names, only, labels, _prepared(args))
    if args.json:
        json.dump(report, sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        sys.stdout.write(render_table(report))
    return 0


def _prepared(args: argparse.Namespace) -> dict[Bdf, str] | None:
    """Which claim the DRA driver prepared each function for, from its state directory; None
    when there is none to read (no DRA driver on this node, or a simulated node). A record that
    cannot be read is left out, with a warning naming it."""
    from dra.state import StateError, read_prepared_claims

    if args.dra_state_dir is not None:
        state_dir = Path(args.dra_state_dir)
        if not state_dir.is_dir():
            raise HostdevError(f"--dra-state-dir {state_dir} is not a directory")
    elif args.example:
        return None
    else:
        state_dir = Path(args.root) / DRA_STATE_DIR
        if not state_dir.is_dir():
            return None

    def skip(path: Path, problem: str) -> None:
        # A report without one claim is still what a person needs to mend the record by.
        print(
            f"kubevirt-iommufd: warning: unreadable prepared-claim record {path}: {problem};"
            " the devices it names are shown as not prepared",
            file=sys.stderr,
        )

    try:
        claims = read_prepared_claims(state_dir, skip)
    except StateError as error:
        raise HostdevError(str(error)) from None
    return {d.bdf: f"claim {c.namespace}/{c.name} (uid {c.uid})" for c in claims for d in c.devices}
