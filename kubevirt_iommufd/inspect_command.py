"""`kubevirt-iommufd inspect`: scan a host (or a simulated one) and print the report."""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

from hostdev.bdf import Bdf
from hostdev.errors import HostdevError
from hostdev.pciids import PciIds
from hostdev.report import SCHEMA, build_report, render_table
from hostdev.scan import scan_host
from hostdev.simhost import SCENARIOS, build_tree

__all__ = ["SCHEMA", "run"]


def run(args: argparse.Namespace) -> int:
    only = [Bdf.parse(text) for text in args.bdfs]
    names = _pci_ids(args.pci_ids)
    if args.example:
        with tempfile.TemporaryDirectory(prefix="kubevirt-iommufd-example-") as tree:
            inventory = scan_host(build_tree(SCENARIOS[args.example](), Path(tree)))
    else:
        inventory = scan_host(args.root)
    missing = [bdf for bdf in only if inventory.function(bdf) is None]
    if missing:
        listed = ", ".join(str(b) for b in missing)
        raise HostdevError(
            f"no PCI function {listed} on this host; run `kubevirt-iommufd inspect` to list them"
        )
    report = build_report(inventory, names, only)
    if args.json:
        json.dump(report, sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        sys.stdout.write(render_table(report))
    return 0


def _pci_ids(option: str | None) -> PciIds:
    if option is None:
        return PciIds.find()
    if option == "none":
        return PciIds(None)
    path = Path(option)
    if not path.is_file():
        raise HostdevError(f"pci.ids file {option!r} not found; pass an existing file or 'none'")
    return PciIds(path)
