"""The node's devices as plain data: PCI functions, IOMMU groups, cdevs and iommufd support.

Discovery (`scan_host`) reads a rooted sysfs/dev; everything else here is a pure function of what
it found. Used by every component; imports none of them.
"""

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
