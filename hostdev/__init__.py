"""The ground floor every component stands on: the node's devices and what may be done to them.

- The model and discovery (this package's modules): `scan_host` reads a rooted sysfs/dev into
  plain immutable data (`model`: PCI functions, IOMMU groups, cdevs, iommufd support);
  `assess`, `device_nodes`, `selection`, `naming` and `config` are pure functions of it and of the
  node's configuration; `device_events`, `unix_socket` and `grpc_socket` are the small IO pieces
  two components share.
- `hostdev.binding`: moving functions between drivers (plan, sysfs writes, lock, reset) — IO.
- `hostdev.labels`: the node's `kubevirt-iommufd.io/` labels, computed purely and published
  through NFD's feature file or a Node patch — IO.

Imports no component, no CLI and no simulation (tests/test_import_contracts.py).

The names below load with their first use: a daemon importing one small module of this package
(`hostdev.atomic_file`, `hostdev.errors`) does not pay for discovery.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from hostdev.assess import Assessment, Backend, assess_function
    from hostdev.bdf import Bdf
    from hostdev.errors import HostdevError, HostReadError, InvalidBdf, PciIdsError, RootNotFound
    from hostdev.model import (
        GroupMember,
        HostCapabilities,
        HostInventory,
        IommuGroup,
        PciFunction,
        Sriov,
    )
    from hostdev.pciids import PciIds
    from hostdev.scan import scan_host

_MODULES = {
    "Assessment": "assess",
    "Backend": "assess",
    "assess_function": "assess",
    "Bdf": "bdf",
    "HostdevError": "errors",
    "HostReadError": "errors",
    "InvalidBdf": "errors",
    "PciIdsError": "errors",
    "RootNotFound": "errors",
    "GroupMember": "model",
    "HostCapabilities": "model",
    "HostInventory": "model",
    "IommuGroup": "model",
    "PciFunction": "model",
    "Sriov": "model",
    "PciIds": "pciids",
    "scan_host": "scan",
}

__all__ = [
    "Assessment",
    "Backend",
    "Bdf",
    "GroupMember",
    "HostCapabilities",
    "HostInventory",
    "HostReadError",
    "HostdevError",
    "InvalidBdf",
    "IommuGroup",
    "PciFunction",
    "PciIds",
    "PciIdsError",
    "RootNotFound",
    "Sriov",
    "assess_function",
    "scan_host",
]


def __getattr__(name: str) -> object:
    if name not in _MODULES:
        raise AttributeError(f"module 'hostdev' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"hostdev.{_MODULES[name]}"), name)
    globals()[name] = value
    return value
