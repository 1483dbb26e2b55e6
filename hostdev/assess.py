"""Whether a PCI function can be handed to a VM, over which VFIO interface, and why not."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from hostdev.model import HostCapabilities, HostInventory, IommuGroup, PciFunction, is_vfio_driver


class Backend(Enum):
    """How a VM would reach the device."""

    IOMMUFD = "iommufd"
    """Through its VFIO cdev `/dev/vfio/devices/vfioN` and `/dev/iommu`."""
    LEGACY = "legacy"
    """Through the group node `/dev/vfio/<group>` and the container `/dev/vfio/vfio`."""


@dataclass(frozen=True, slots=True)
class Assessment:
    """The verdict on one function: assignable over `backend`, or not, for `reasons`."""

    backend: Backend | None
    reasons: tuple[str, ...]
    """Why it is not assignable at all (backend None), or why it is legacy-only."""

    @property
    def assignable(self) -> bool:
        return self.backend is not None


def assess_function(function: PciFunction, inventory: HostInventory) -> Assessment:
    """Decide from discovered data alone; no IO."""
    caps = inventory.capabilities
    group = inventory.group_of(function)
    blocked = blockers(function, group, caps)
    if blocked or group is None:
        return Assessment(None, blocked)
    no_iommufd = iommufd_gaps(function, caps)
    if not no_iommufd:
        return Assessment(Backend.IOMMUFD, ())
    no_legacy = legacy_gaps(group, caps)
    if no_legacy:
        return Assessment(None, no_iommufd + no_legacy)
    return Assessment(Backend.LEGACY, no_iommufd)


def blockers(
    function: PciFunction, group: IommuGroup | None, caps: HostCapabilities
) -> tuple[str, ...]:
    """Why the function cannot be assigned over any VFIO interface; empty when it can."""
    if not caps.iommu:
        return (
            "no IOMMU: enable VT-d/AMD-Vi in the firmware and boot with intel_iommu=on"
            " (or amd_iommu=on)",
        )
    if function.is_bridge:
        return (
            f"a bridge (class {function.class_code >> 8:04x}): bridges cannot be assigned,"
            " only the devices behind them",
        )
    reasons: list[str] = []
    if function.driver is None:
        reasons.append("bound to no driver: bind it to vfio-pci to assign it")
    elif not is_vfio_driver(function.driver):
        reasons.append(f"bound to {function.driver}, not to a VFIO driver")
    if group is None:
        reasons.append("in no IOMMU group: the IOMMU does not cover it")
    else:
        # The function's own driver is already named above; the group line names the others.
        others = [m for m in group.blockers if m.bdf != function.bdf]
        if others:
            named = ", ".join(f"{member.name} is bound to {member.driver}" for member in others)
            reasons.append(f"group {group.number} not viable: {named}")
    return tuple(reasons)


def iommufd_gaps(function: PciFunction, caps: HostCapabilities) -> tuple[str, ...]:
    """What the function lacks for iommufd (its cdev and /dev/iommu); empty when nothing."""
    gaps: list[str] = []
    if function.vfio_cdev is None:
        if function.vfio_sysfs_without_cdev or caps.vfio_cdev is False:
            gaps.append("no VFIO cdev: the kernel lacks CONFIG_VFIO_DEVICE_CDEV")
        else:
            gaps.append("no VFIO cdev: the kernel gave the device none (needs Linux >= 6.6)")
    elif not function.vfio_cdev_present:
        gaps.append(f"no VFIO cdev node: {function.cdev_path} is missing")
    if not caps.iommufd:
        gaps.append("no iommufd: the kernel lacks CONFIG_IOMMUFD")
    elif not caps.iommufd_node_present:
        gaps.append("no iommufd node: /dev/iommu is missing")
    return tuple(gaps)


def legacy_gaps(group: IommuGroup, caps: HostCapabilities) -> tuple[str, ...]:
    """What the group lacks for legacy VFIO (its group node and the container)."""
    gaps: list[str] = []
    if not group.legacy_node_present:
        gaps.append(f"no legacy VFIO group node: {group.legacy_node} is missing")
    if not caps.legacy_vfio_node_present:
        gaps.append("no legacy VFIO container: /dev/vfio/vfio is missing")
    return tuple(gaps)


def on_demand_gaps(
    function: PciFunction, group: IommuGroup | None, caps: HostCapabilities
) -> tuple[str, ...]:
    """Why a function on its host driver could not be bound to VFIO for a claim, as far as the
    host shows without trying; what only the attempt shows (a process holding the device, a
    driver refusing to let go) is found when a claim is prepared."""
    if not caps.iommu:
        return ("no IOMMU: enable VT-d/AMD-Vi in the firmware and boot with intel_iommu=on",)
    if function.is_bridge:
        return ("a bridge: bridges cannot be assigned, only the devices behind them",)
    if group is None:
        return ("in no IOMMU group: the IOMMU does not cover it",)
    if function.sriov is not None and function.sriov.num_vfs > 0:
        return (
            f"has {function.sriov.num_vfs} SR-IOV virtual functions enabled: set sriov_numvfs"
            " to 0 to give the physical function to a VM",
        )
    return ()


def iommufd_once_bound(caps: HostCapabilities) -> bool:
    """Whether a function bound to VFIO on demand will be usable over iommufd: the kernel has
    iommufd and does not lack VFIO cdevs (whether it gives them shows only once one is bound)."""
    return caps.iommufd and caps.vfio_cdev is not False
