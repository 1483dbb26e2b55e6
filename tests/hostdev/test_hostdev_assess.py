"""Assignability is a pure function of discovered data: every verdict and reason, from values."""

from __future__ import annotations

from dataclasses import replace

import pytest

from hostdev.assess import Assessment, Backend, assess_function
from hostdev.model import (
    GroupMember,
    HostCapabilities,
    HostInventory,
    IommuGroup,
    PciFunction,
    is_group_safe_driver,
    is_vfio_driver,
)
from hostdev_kit import AUDIO, FULL, function


def verdict(
    subject: PciFunction,
    caps: HostCapabilities = FULL,
    others: tuple[GroupMember, ...] = (),
    group_node: bool = True,
) -> Assessment:
    groups: tuple[IommuGroup, ...] = ()
    if subject.iommu_group is not None:
        members = (GroupMember(str(subject.bdf), subject.bdf, subject.driver), *others)
        groups = (IommuGroup(subject.iommu_group, members, group_node),)
    return assess_function(subject, HostInventory((subject,), groups, caps))


def test_gpu_with_cdev_and_iommufd_goes_over_iommufd() -> None:
    assert verdict(function()) == Assessment(Backend.IOMMUFD, ())


@pytest.mark.parametrize(
    ("subject", "caps", "reasons"),
    [
        (
            function(),
            replace(FULL, iommu=False),
            [
                "no IOMMU: enable VT-d/AMD-Vi in the firmware and boot with intel_iommu=on"
                " (or amd_iommu=on)"
            ],
        ),
        (
            function(class_code=0x060400, driver="pcieport"),
            FULL,
            ["a bridge (class 0604): bridges cannot be assigned, only the devices behind them"],
        ),
        (
            function(class_code=0x060000, driver=None),
            FULL,
            ["a bridge (class 0600): bridges cannot be assigned, only the devices behind them"],
        ),
        (
            function(driver=None),
            FULL,
            ["bound to no driver: bind it to vfio-pci to assign it"],
        ),
        (
            function(driver="nvidia"),
            FULL,
            ["bound to nvidia, not to a VFIO driver"],
        ),
        (
            function(iommu_group=None),
            FULL,
            ["in no IOMMU group: the IOMMU does not cover it"],
        ),
    ],
    ids=["no-iommu", "pci-bridge", "host-bridge", "no-driver", "nvidia", "no-group"],
)
def test_not_assignable(subject: PciFunction, caps: HostCapabilities, reasons: list[str]) -> None:
    assert verdict(subject, caps) == Assessment(None, tuple(reasons))


def test_group_with_a_member_on_a_host_driver_is_not_viable() -> None:
    others = (GroupMember(str(AUDIO), AUDIO, "snd_hda_intel"),)
    assert verdict(function(), others=others) == Assessment(
        None, ("group 14 not viable: 0000:3b:00.1 is bound to snd_hda_intel",)
    )


def test_a_member_that_is_not_pci_can_block_the_group() -> None:
    others = (GroupMember("INT3450:00", None, "intel_pmc"),)
    assert verdict(function(), others=others).reasons == (
        "group 14 not viable: INT3450:00 is bound to intel_pmc",
    )


@pytest.mark.parametrize("driver", [None, "pci-stub", "pcieport", "vfio-pci", "mlx5_vfio_pci"])
def test_group_members_that_leave_the_group_viable(driver: str | None) -> None:
    others = (GroupMember(str(AUDIO), AUDIO, driver),)
    assert verdict(function(), others=others).backend is Backend.IOMMUFD


@pytest.mark.parametrize(
    ("subject", "caps", "reasons"),
    [
        (
            function(vfio_cdev=None, vfio_cdev_present=False, vfio_sysfs_without_cdev=True),
            replace(FULL, iommufd=False, iommufd_node_present=False, vfio_cdev=False),
            [
                "no VFIO cdev: the kernel lacks CONFIG_VFIO_DEVICE_CDEV",
                "no iommufd: the kernel lacks CONFIG_IOMMUFD",
            ],
        ),
        (
            function(vfio_cdev=None, vfio_cdev_present=False),
            replace(FULL, vfio_cdev=None),
            ["no VFIO cdev: the kernel gave the device none (needs Linux >= 6.6)"],
        ),
        (
            function(vfio_cdev_present=False),
            FULL,
            ["no VFIO cdev node: /dev/vfio/devices/vfio0 is missing"],
        ),
        (
            function(),
            replace(FULL, iommufd_node_present=False),
            ["no iommufd node: /dev/iommu is missing"],
        ),
    ],
    ids=["kernel-without-cdev-and-iommufd", "old-kernel", "cdev-node-missing", "no-dev-iommu"],
)
def test_legacy_only(subject: PciFunction, caps: HostCapabilities, reasons: list[str]) -> None:
    assert verdict(subject, caps) == Assessment(Backend.LEGACY, tuple(reasons))


def test_neither_path_usable_lists_every_gap() -> None:
    subject = function(vfio_cdev_present=False)
    caps = replace(FULL, legacy_vfio_node_present=False)
    assert verdict(subject, caps, group_node=False) == Assessment(
        None,
        (
            "no VFIO cdev node: /dev/vfio/devices/vfio0 is missing",
            "no legacy VFIO group node: /dev/vfio/14 is missing",
            "no legacy VFIO container: /dev/vfio/vfio is missing",
        ),
    )


def test_cdev_path_does_not_need_legacy_nodes() -> None:
    caps = replace(FULL, legacy_vfio_node_present=False)
    assert verdict(function(), caps, group_node=False).backend is Backend.IOMMUFD


@pytest.mark.parametrize(
    ("driver", "vfio"),
    [
        ("vfio-pci", True),
        ("vfio_pci", True),
        ("nvgrace_gpu_vfio_pci", True),
        ("nvgrace-gpu-vfio-pci", True),
        ("mlx5_vfio_pci", True),
        ("vfio", False),
        ("vfio-pci-core", False),
        ("nvidia", False),
        (None, False),
    ],
)
def test_vfio_driver_names(driver: str | None, vfio: bool) -> None:
    assert is_vfio_driver(driver) is vfio


@pytest.mark.parametrize(
    ("driver", "safe"),
    [(None, True), ("pci-stub", True), ("pcieport", True), ("vfio-pci", True), ("nvme", False)],
)
def test_group_safe_drivers(driver: str | None, safe: bool) -> None:
    assert is_group_safe_driver(driver) is safe
