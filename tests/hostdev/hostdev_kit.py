"""Discovered host data written as values: a GPU on vfio-pci with its cdev on a host that offers
everything, for tests of the pure functions over it to vary one field at a time."""

from __future__ import annotations

from dataclasses import replace

from hostdev.bdf import Bdf
from hostdev.model import HostCapabilities, PciFunction

GPU = Bdf.parse("0000:3b:00.0")
AUDIO = Bdf.parse("0000:3b:00.1")

FULL = HostCapabilities(
    iommu=True,
    iommufd=True,
    iommufd_node_present=True,
    iommufd_devnum="10:257",
    vfio_cdev=True,
    legacy_vfio_node_present=True,
    kernel_release="6.12.0",
)


def function(**changes: object) -> PciFunction:
    base = PciFunction(
        bdf=GPU,
        vendor_id=0x10DE,
        device_id=0x2330,
        subsystem_vendor_id=0x10DE,
        subsystem_device_id=0x16C1,
        class_code=0x030200,
        revision=0xA1,
        driver="vfio-pci",
        iommu_group=14,
        numa_node=0,
        sriov=None,
        physfn=None,
        modalias=None,
        upstream=(),
        consumers=(),
        vfio_cdev="vfio0",
        vfio_cdev_present=True,
        vfio_sysfs_without_cdev=False,
    )
    return replace(base, **changes)  # type: ignore[arg-type]
