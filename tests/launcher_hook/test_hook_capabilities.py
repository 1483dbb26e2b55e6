"""Detection on simulated nodes, and the libvirt version from libvirt, flag or annotation."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import pytest

from hook_kit import GPU1, GPU2, build_cdevs, build_missing_cdev_node, gpu_node
from hostdev.bdf import Bdf
from launcher_hook.capabilities import (
    LibvirtVersionSource,
    read_capabilities,
    read_device_support,
    read_kernel_iommufd,
    read_libvirt_version,
)
from launcher_hook.decide import resolve_libvirt
from launcher_hook.model import (
    ANNOTATION_LIBVIRT_VERSION,
    Capabilities,
    DeviceSupport,
    LibvirtVersion,
    Sourced,
    Vmi,
)
from sim.host import SCENARIOS, build_tree

NVIDIA_DRIVER_GPU = Bdf.parse("0000:17:00.0")


@pytest.mark.parametrize(
    ("scenario", "iommufd"),
    [("hgx-h100", True), ("legacy-only", False), ("no-iommu", False), ("sriov", True)],
)
def test_kernel_iommufd(scenario: str, iommufd: bool, tmp_path: Path) -> None:
    assert read_kernel_iommufd(build_tree(SCENARIOS[scenario](), tmp_path)) is iommufd


def test_kernel_iommufd_from_sysfs_alone(tmp_path: Path) -> None:
    """Inside a pod /dev/iommu may not have been handed over; the misc class still tells."""
    root = build_cdevs(tmp_path)
    (root / "dev/iommu").unlink()
    assert read_kernel_iommufd(root)


def test_device_with_cdev(tmp_path: Path) -> None:
    assert read_device_support(build_cdevs(tmp_path), Bdf.parse(GPU1)) == DeviceSupport(
        "vfio0", None
    )


@pytest.mark.parametrize(
    ("build", "bdf", "gap"),
    [
        (build_missing_cdev_node, GPU2, "no VFIO cdev node: /dev/vfio/devices/vfio1 is missing"),
        (build_cdevs, "0000:ee:00.0", "no PCI function 0000:ee:00.0 on this node"),
        (
            lambda root: build_tree(replace(gpu_node(), vfio_cdev=False), root),
            GPU1,
            "no VFIO cdev: the kernel lacks CONFIG_VFIO_DEVICE_CDEV",
        ),
        (
            lambda root: build_tree(replace(gpu_node(), vfio_sysfs=False), root),
            GPU1,
            "no VFIO cdev: the kernel gave the device none (needs Linux >= 6.6)",
        ),
        (
            lambda root: build_tree(SCENARIOS["nvidia-driver"](), root),
            str(NVIDIA_DRIVER_GPU),
            "no VFIO cdev: bound to nvidia, not to a VFIO driver",
        ),
        (
            lambda root: build_tree(SCENARIOS["sriov"](), root),
            "0000:5e:00.0",
            "no VFIO cdev: bound to mlx5_core, not to a VFIO driver",
        ),
    ],
    ids=["node-missing", "no-such-device", "no-cdev-config", "pre-6.6", "nvidia", "sriov-pf"],
)
def test_device_gaps(build: Callable[[Path], Path], bdf: str, gap: str, tmp_path: Path) -> None:
    root = build(tmp_path)
    assert read_device_support(root, Bdf.parse(bdf)) == DeviceSupport(None, gap)


def test_sidecar_mode_judges_the_cdev_from_sysfs_alone(tmp_path: Path) -> None:
    """A sidecar's /dev has no VFIO nodes at all; sysfs still names the cdev."""
    root = build_cdevs(tmp_path)
    shutil.rmtree(root / "dev/vfio")
    (root / "dev/iommu").unlink()
    caps = read_capabilities(root, [Bdf.parse(GPU1)], None, require_node=False)
    assert caps.kernel_iommufd
    assert caps.devices == {Bdf.parse(GPU1): DeviceSupport("vfio0", None)}
    strict = read_capabilities(root, [Bdf.parse(GPU1)], None)
    assert strict.devices[Bdf.parse(GPU1)] == DeviceSupport(
        None, "no VFIO cdev node: /dev/vfio/devices/vfio0 is missing"
    )
    # sysfs alone never invents a cdev the kernel did not make.
    pre_cdev = build_tree(replace(gpu_node(), vfio_cdev=False), tmp_path / "old")
    assert read_device_support(pre_cdev, Bdf.parse(GPU1), require_node=False) == DeviceSupport(
        None, "no VFIO cdev: the kernel lacks CONFIG_VFIO_DEVICE_CDEV"
    )


def test_read_capabilities_looks_only_at_the_requested_devices(tmp_path: Path) -> None:
    libvirt = Sourced(LibvirtVersion(12, 9), "--libvirt-version")
    caps = read_capabilities(build_cdevs(tmp_path), [Bdf.parse(GPU2)], libvirt)
    assert caps == Capabilities(True, {Bdf.parse(GPU2): DeviceSupport("vfio1", None)}, libvirt)


def test_libvirt_version_from_libvirt() -> None:
    """libvirt-python against the installed libvirt's test driver (9.0 on bookworm)."""
    version = read_libvirt_version("test:///default")
    assert version is not None
    assert version >= LibvirtVersion(9, 0)


def test_libvirt_answer_wins_over_the_flag() -> None:
    source = LibvirtVersionSource("test:///default", LibvirtVersion(12, 9))
    answer = source.read()
    assert answer is not None
    assert answer.source == "libvirt at test:///default"
    assert answer.value == read_libvirt_version("test:///default")


def test_flag_when_libvirt_does_not_answer(tmp_path: Path) -> None:
    uri = f"qemu:///system?socket={tmp_path}/no-such.sock"
    assert read_libvirt_version(uri) is None
    source = LibvirtVersionSource(uri, LibvirtVersion(12, 2))
    assert source.read() == Sourced(LibvirtVersion(12, 2), "--libvirt-version")
    assert LibvirtVersionSource(uri, None).read() is None


def test_annotation_when_neither_libvirt_nor_flag_says() -> None:
    vmi = Vmi("v", "ns", {ANNOTATION_LIBVIRT_VERSION: "12.1"})
    caps = Capabilities(True, {}, None)
    assert resolve_libvirt(caps, vmi) == Sourced(
        LibvirtVersion(12, 1, 0), f"annotation {ANNOTATION_LIBVIRT_VERSION}"
    )
    flagged = Capabilities(True, {}, Sourced(LibvirtVersion(11, 10), "--libvirt-version"))
    assert resolve_libvirt(flagged, vmi) == flagged.libvirt
    assert resolve_libvirt(caps, Vmi("v", "ns")) is None


@pytest.mark.parametrize(
    ("number", "version"),
    [(9000000, "9.0.0"), (12001000, "12.1.0"), (12009002, "12.9.2"), (11010000, "11.10.0")],
)
def test_libvirt_version_numbers(number: int, version: str) -> None:
    assert str(LibvirtVersion.from_number(number)) == version
