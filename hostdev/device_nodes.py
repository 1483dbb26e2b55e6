"""Which device nodes give a VM a VFIO function: one rule for the device plugin's Allocate and the
DRA driver's CDI specs alike."""

from __future__ import annotations

from collections.abc import Sequence

from hostdev.assess import iommufd_gaps, legacy_gaps
from hostdev.config import DeviceMode
from hostdev.model import HostCapabilities, IommuGroup, PciFunction

IOMMU_NODE = "/dev/iommu"
VFIO_CONTAINER_NODE = "/dev/vfio/vfio"


def build_device_nodes(
    function: PciFunction,
    group: IommuGroup,
    caps: HostCapabilities,
    mode: DeviceMode = DeviceMode.BOTH,
    cdev_owners: Sequence[PciFunction | None] | None = None,
) -> tuple[str, ...]:
    """The nodes that open `function` (a member of `group`) to a VM, in the order handed out.

    Over iommufd, where the function can use it: the VFIO cdevs of `cdev_owners` whose nodes
    exist (the function's own by default; the device plugin hands out its whole group's), then
    `/dev/iommu`. Over legacy VFIO, where the group can use it: `/dev/vfio/vfio`, then the group
    node. `mode` leaves one of the two out; empty when nothing is left.
    """
    nodes: list[str] = []
    if mode is not DeviceMode.LEGACY and not iommufd_gaps(function, caps):
        owners = (function,) if cdev_owners is None else cdev_owners
        nodes.extend(f.cdev_path for f in owners if f and f.cdev_path and f.vfio_cdev_present)
        nodes.append(IOMMU_NODE)
    if mode is not DeviceMode.IOMMUFD and not legacy_gaps(group, caps):
        nodes.extend((VFIO_CONTAINER_NODE, group.legacy_node))
    return tuple(nodes)
