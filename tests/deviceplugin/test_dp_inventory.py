"""The device tree on every foundation scenario: membership, naming, health and the nodes
Allocate will hand out."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import pytest

from deviceplugin.inventory import DeviceTree, build_device_tree
from hostdev.bdf import Bdf
from hostdev.config import (
    DeviceMode,
    PluginConfig,
    ResourceConfig,
    Selectors,
    default_config,
)
from hostdev.pciids import PciIds
from hostdev.scan import refresh_host, scan_host
from sim.host import bind_driver, unbind_driver

ScenarioRoot = Callable[[str], Path]
H100 = "nvidia.com/GH100H100_SXM5_80GB"


@pytest.fixture
def names(tmp_path: Path) -> PciIds:
    path = tmp_path / "pci.ids"
    path.write_text(
        "10de  NVIDIA Corporation\n\t2330  GH100[H100 SXM5 80GB]\n"
        "\t2204  GA102 [GeForce RTX 3090]\n\t1aef  GA102 High Definition Audio Controller\n"
    )
    return PciIds(path)


def tree(root: Path, names: PciIds, config: PluginConfig | None = None) -> DeviceTree:
    return build_device_tree(scan_host(root), config or default_config(), names)


def test_hgx_h100_default_config(scenario_root: ScenarioRoot, names: PciIds) -> None:
    result = tree(scenario_root("hgx-h100"), names)
    assert list(result.resources) == [H100]
    resource = result.resources[H100]
    assert resource.env_name == "PCI_RESOURCE_NVIDIA_COM_GH100H100_SXM5_80GB"
    assert list(resource.devices) == [
        "0000:18:00.0",
        "0000:2a:00.0",
        "0000:3a:00.0",
        "0000:5d:00.0",
        "0000:9a:00.0",
        "0000:ab:00.0",
        "0000:ba:00.0",
        "0000:db:00.0",
    ]
    gpu = resource.devices["0000:18:00.0"]
    assert gpu.healthy and gpu.reason == ""
    assert gpu.numa_node == 0
    assert [str(b) for b in gpu.switch] == ["0000:15:01.0", "0000:16:00.0"]
    assert gpu.device_nodes == (
        "/dev/vfio/devices/vfio0",
        "/dev/iommu",
        "/dev/vfio/vfio",
        "/dev/vfio/13",
    )
    assert result.iommu_node_present


@pytest.mark.parametrize(
    ("mode", "nodes"),
    [
        (DeviceMode.IOMMUFD, ("/dev/vfio/devices/vfio0", "/dev/iommu")),
        (DeviceMode.LEGACY, ("/dev/vfio/vfio", "/dev/vfio/13")),
    ],
)
def test_device_mode_picks_the_nodes(
    scenario_root: ScenarioRoot, names: PciIds, mode: DeviceMode, nodes: tuple[str, ...]
) -> None:
    config = replace(default_config(), device_mode=mode)
    result = tree(scenario_root("hgx-h100"), names, config)
    assert result.resources[H100].devices["0000:18:00.0"].device_nodes == nodes


def test_legacy_only_host(scenario_root: ScenarioRoot, names: PciIds) -> None:
    root = scenario_root("legacy-only")
    both = tree(root, names).resources[H100].devices["0000:18:00.0"]
    assert both.healthy and both.device_nodes == ("/dev/vfio/vfio", "/dev/vfio/13")
    iommufd_only = replace(default_config(), device_mode=DeviceMode.IOMMUFD)
    device = tree(root, names, iommufd_only).resources[H100].devices["0000:18:00.0"]
    assert not device.healthy
    assert device.reason == (
        "no VFIO cdev: the kernel lacks CONFIG_VFIO_DEVICE_CDEV;"
        " no iommufd: the kernel lacks CONFIG_IOMMUFD"
    )
    assert device.device_nodes == ()
    assert not tree(root, names).iommu_node_present


def test_multi_function_group_hands_out_every_member(
    scenario_root: ScenarioRoot, names: PciIds
) -> None:
    root = scenario_root("vga-audio")
    unbind_driver(root, "0000:3b:00.1")
    bind_driver(root, "0000:3b:00.1", "vfio-pci")
    config = PluginConfig(
        resources=(
            ResourceConfig(
                Selectors(pci_addresses=(Bdf.parse("0000:3b:00.0"),)), "example.com/gpu"
            ),
        )
    )
    device = tree(root, names, config).resources["example.com/gpu"].devices["0000:3b:00.0"]
    assert device.healthy
    assert device.device_nodes == (
        "/dev/vfio/devices/vfio0",
        "/dev/vfio/devices/vfio1",
        "/dev/iommu",
        "/dev/vfio/vfio",
        "/dev/vfio/14",
    )


def test_non_viable_group_is_unhealthy(scenario_root: ScenarioRoot, names: PciIds) -> None:
    result = tree(scenario_root("vga-audio"), names)
    (resource,) = result.resources.values()
    assert resource.name == "nvidia.com/GA102_GEFORCE_RTX_3090"
    # The audio function is not a GPU class, so only the VGA function is advertised.
    assert list(resource.devices) == ["0000:3b:00.0"]
    device = resource.devices["0000:3b:00.0"]
    assert not device.healthy
    assert device.reason == "group 14 not viable: 0000:3b:00.1 is bound to snd_hda_intel"


def test_gpu_on_nvidia_driver_is_not_advertised(scenario_root: ScenarioRoot, names: PciIds) -> None:
    assert tree(scenario_root("nvidia-driver"), names).resources == {}


def test_no_iommu_host_advertises_nothing(scenario_root: ScenarioRoot, names: PciIds) -> None:
    result = tree(scenario_root("no-iommu"), names)
    assert result.resources == {} and not result.iommu_node_present


def test_sriov_vfs_by_explicit_selector(scenario_root: ScenarioRoot, names: PciIds) -> None:
    config = PluginConfig(
        resources=(
            ResourceConfig(
                Selectors(vendors=(0x15B3,), devices=(0x101E,)), "mellanox.com/cx6dx_vf"
            ),
        )
    )
    resource = tree(scenario_root("sriov"), names, config).resources["mellanox.com/cx6dx_vf"]
    assert list(resource.devices) == [f"0000:5e:00.{i}" for i in range(2, 6)]
    assert resource.healthy_count == 4


def test_unbound_device_stays_unhealthy_and_comes_back(
    scenario_root: ScenarioRoot, names: PciIds
) -> None:
    root = scenario_root("hgx-h100")
    config = default_config()
    first = build_device_tree(scan_host(root), config, names)
    unbind_driver(root, "0000:2a:00.0")
    second = build_device_tree(scan_host(root), config, names, first)
    device = second.resources[H100].devices["0000:2a:00.0"]
    assert not device.healthy
    assert device.reason == "bound to no driver: bind it to vfio-pci to assign it"
    # Without the previous tree, the driver selector keeps it out altogether.
    assert (
        "0000:2a:00.0"
        not in build_device_tree(scan_host(root), config, names).resources[H100].devices
    )
    bind_driver(root, "0000:2a:00.0", "vfio-pci")
    third = build_device_tree(scan_host(root), config, names, second)
    assert third.resources[H100].devices["0000:2a:00.0"].healthy


def test_missing_nodes_make_a_device_unhealthy(scenario_root: ScenarioRoot, names: PciIds) -> None:
    root = scenario_root("hgx-h100")
    (root / "dev/vfio/devices/vfio1").unlink()
    both = tree(root, names).resources[H100].devices["0000:2a:00.0"]
    assert both.healthy and both.device_nodes == ("/dev/vfio/vfio", "/dev/vfio/15")
    iommufd = replace(default_config(), device_mode=DeviceMode.IOMMUFD)
    device = tree(root, names, iommufd).resources[H100].devices["0000:2a:00.0"]
    assert not device.healthy
    assert device.reason == "no VFIO cdev node: /dev/vfio/devices/vfio1 is missing"
    (root / "dev/vfio/15").unlink()
    gone = tree(root, names).resources[H100].devices["0000:2a:00.0"]
    assert not gone.healthy
    assert gone.reason == (
        "no VFIO cdev node: /dev/vfio/devices/vfio1 is missing;"
        " no legacy VFIO group node: /dev/vfio/15 is missing"
    )


def test_first_matching_resource_wins(scenario_root: ScenarioRoot, names: PciIds) -> None:
    config = PluginConfig(
        resources=(
            ResourceConfig(
                Selectors(pci_addresses=(Bdf.parse("0000:18:00.0"),)), "example.com/reserved"
            ),
            *default_config().resources,
        )
    )
    result = tree(scenario_root("hgx-h100"), names, config)
    assert list(result.resources["example.com/reserved"].devices) == ["0000:18:00.0"]
    assert "0000:18:00.0" not in result.resources[H100].devices
    assert len(result.resources[H100].devices) == 7


def test_unknown_device_id_is_named_by_its_hex_id(scenario_root: ScenarioRoot) -> None:
    result = tree(scenario_root("hgx-h100"), PciIds(None))
    assert list(result.resources) == ["nvidia.com/2330"]


@pytest.mark.parametrize(
    "change", ["unbind-gpu", "sibling-cdev-node", "group-node", "dev-iommu", "nothing"]
)
def test_tree_built_from_the_previous_one_equals_a_fresh_one(
    scenario_root: ScenarioRoot, names: PciIds, change: str
) -> None:
    root = scenario_root("vga-audio")
    unbind_driver(root, "0000:3b:00.1")
    bind_driver(root, "0000:3b:00.1", "vfio-pci")
    config = PluginConfig(
        resources=(ResourceConfig(Selectors(vendors=(0x10DE,)), "example.com/gpu"),)
    )
    inventory = scan_host(root)
    first = build_device_tree(inventory, config, names)
    changed: list[Bdf] = []
    if change == "unbind-gpu":
        unbind_driver(root, "0000:3b:00.0")
        changed = [Bdf.parse("0000:3b:00.0")]
    elif change == "sibling-cdev-node":
        (root / "dev/vfio/devices/vfio1").unlink()
    elif change == "group-node":
        (root / "dev/vfio/14").unlink()
    elif change == "dev-iommu":
        (root / "dev/iommu").unlink()
    refreshed = refresh_host(root, inventory, changed)
    incremental = build_device_tree(refreshed, config, names, first)
    fresh = build_device_tree(refreshed, config, names, first if change == "unbind-gpu" else None)
    assert incremental == fresh
    if change == "sibling-cdev-node":
        gpu = incremental.resources["example.com/gpu"].devices["0000:3b:00.0"]
        assert "/dev/vfio/devices/vfio1" not in gpu.device_nodes
    if change == "nothing":
        assert incremental == first
