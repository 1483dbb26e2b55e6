"""build_device_nodes: which nodes open a VFIO function to a VM, as a table of hosts and modes."""

from __future__ import annotations

from dataclasses import replace

import pytest

from hostdev.bdf import Bdf
from hostdev.config import DeviceMode
from hostdev.device_nodes import build_device_nodes
from hostdev.model import GroupMember, HostCapabilities, IommuGroup, PciFunction
from hostdev_kit import AUDIO, FULL, GPU, function

CDEV, IOMMU, CONTAINER, GROUP = (
    "/dev/vfio/devices/vfio0",
    "/dev/iommu",
    "/dev/vfio/vfio",
    "/dev/vfio/14",
)
BOTH = (CDEV, IOMMU, CONTAINER, GROUP)


def group(node_present: bool = True) -> IommuGroup:
    members = (
        GroupMember(str(GPU), GPU, "vfio-pci"),
        GroupMember(str(AUDIO), AUDIO, "vfio-pci"),
    )
    return IommuGroup(14, members, node_present)


@pytest.mark.parametrize(
    ("subject", "caps", "group_node", "mode", "expected"),
    [
        pytest.param(function(), FULL, True, DeviceMode.BOTH, BOTH, id="both"),
        pytest.param(function(), FULL, True, DeviceMode.IOMMUFD, (CDEV, IOMMU), id="iommufd-mode"),
        pytest.param(
            function(), FULL, True, DeviceMode.LEGACY, (CONTAINER, GROUP), id="legacy-mode"
        ),
        pytest.param(
            function(vfio_cdev=None, vfio_sysfs_without_cdev=True),
            replace(FULL, vfio_cdev=False),
            True,
            DeviceMode.BOTH,
            (CONTAINER, GROUP),
            id="kernel-without-cdevs",
        ),
        pytest.param(
            function(vfio_cdev_present=False),
            FULL,
            True,
            DeviceMode.BOTH,
            (CONTAINER, GROUP),
            id="cdev-node-missing",
        ),
        pytest.param(
            function(),
            replace(FULL, iommufd=False, iommufd_node_present=False),
            True,
            DeviceMode.BOTH,
            (CONTAINER, GROUP),
            id="kernel-without-iommufd",
        ),
        pytest.param(
            function(),
            replace(FULL, iommufd_node_present=False),
            True,
            DeviceMode.BOTH,
            (CONTAINER, GROUP),
            id="dev-iommu-missing",
        ),
        pytest.param(
            function(), FULL, False, DeviceMode.BOTH, (CDEV, IOMMU), id="group-node-missing"
        ),
        pytest.param(
            function(),
            replace(FULL, legacy_vfio_node_present=False),
            True,
            DeviceMode.BOTH,
            (CDEV, IOMMU),
            id="container-missing",
        ),
        pytest.param(
            function(vfio_cdev_present=False),
            FULL,
            False,
            DeviceMode.BOTH,
            (),
            id="neither",
        ),
        pytest.param(
            function(vfio_cdev_present=False),
            FULL,
            True,
            DeviceMode.IOMMUFD,
            (),
            id="iommufd-mode-without-iommufd",
        ),
        pytest.param(
            function(), FULL, False, DeviceMode.LEGACY, (), id="legacy-mode-without-legacy"
        ),
    ],
)
def test_nodes_follow_what_the_host_offers_and_the_mode(
    subject: PciFunction,
    caps: HostCapabilities,
    group_node: bool,
    mode: DeviceMode,
    expected: tuple[str, ...],
) -> None:
    assert build_device_nodes(subject, group(group_node), caps, mode) == expected


def test_the_cdevs_of_every_given_owner_whose_node_exists_in_order() -> None:
    audio = function(bdf=AUDIO, vfio_cdev="vfio1")
    gone = function(bdf=Bdf.parse("0000:3b:00.2"), vfio_cdev="vfio2", vfio_cdev_present=False)
    bridge_side = function(bdf=Bdf.parse("0000:3b:00.3"), vfio_cdev=None)
    owners = (function(), audio, None, gone, bridge_side)
    assert build_device_nodes(function(), group(), FULL, cdev_owners=owners) == (
        CDEV,
        "/dev/vfio/devices/vfio1",
        IOMMU,
        CONTAINER,
        GROUP,
    )


def test_owners_do_not_make_iommufd_usable_for_a_function_that_cannot_use_it() -> None:
    subject = function(vfio_cdev_present=False)
    owners = (subject, function(bdf=AUDIO, vfio_cdev="vfio1"))
    assert build_device_nodes(subject, group(), FULL, cdev_owners=owners) == (CONTAINER, GROUP)
