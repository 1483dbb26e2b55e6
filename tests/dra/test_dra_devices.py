"""Which functions the DRA driver publishes and with which attributes, on simulated nodes."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from dra.devices import bdf_of_device, build_devices, device_name, typed_attributes
from hostdev.bdf import Bdf
from hostdev.config import PluginConfig, ResourceConfig, Selectors, default_config
from hostdev.pciids import PciIds
from hostdev.scan import scan_host
from sim.host import remove_function, unbind_driver

ScenarioRoot = Callable[[str], Path]
H100 = "nvidia.com/GH100H100_SXM5_80GB"


@pytest.fixture
def names(tmp_path: Path) -> PciIds:
    path = tmp_path / "pci.ids"
    path.write_text("10de  NVIDIA Corporation\n\t2330  GH100[H100 SXM5 80GB]\n")
    return PciIds(path)


def test_hgx_h100_publishes_every_gpu_with_its_attributes(
    scenario_root: ScenarioRoot, names: PciIds
) -> None:
    devices = build_devices(scan_host(scenario_root("hgx-h100")), default_config(), names)
    assert [d.name for d in devices] == [
        "pci-0000-18-00-0",
        "pci-0000-2a-00-0",
        "pci-0000-3a-00-0",
        "pci-0000-5d-00-0",
        "pci-0000-9a-00-0",
        "pci-0000-ab-00-0",
        "pci-0000-ba-00-0",
        "pci-0000-db-00-0",
    ]
    first = devices[0]
    assert first.resource == H100
    assert dict(first.attributes) == {
        "resource.kubernetes.io/pciBusID": "0000:18:00.0",
        "resource.kubernetes.io/pcieRoot": "pci0000:15",
        "vendorID": "10de",
        "deviceID": "2330",
        "pciClass": "030200",
        "productName": "GH100H100_SXM5_80GB",
        "iommuGroup": first.group,
        "iommufd": True,
        "currentDriver": "vfio-pci",
        "resourceName": H100,
        "numaNode": 0,
    }
    assert first.device_nodes == (
        "/dev/vfio/devices/vfio0",
        "/dev/iommu",
        "/dev/vfio/vfio",
        f"/dev/vfio/{first.group}",
    )
    assert devices[-1].attributes["numaNode"] == 1


def test_legacy_only_node_gives_group_nodes_and_says_no_iommufd(
    scenario_root: ScenarioRoot, names: PciIds
) -> None:
    devices = build_devices(scan_host(scenario_root("legacy-only")), default_config(), names)
    assert devices
    for device in devices:
        assert device.attributes["iommufd"] is False
        assert device.device_nodes == ("/dev/vfio/vfio", f"/dev/vfio/{device.group}")


def test_unusable_functions_are_not_published(scenario_root: ScenarioRoot, names: PciIds) -> None:
    # The GPU's group holds an audio function on snd_hda_intel: not viable, so not offered.
    assert build_devices(scan_host(scenario_root("vga-audio")), default_config(), names) == ()
    # A GPU on the nvidia driver is not on VFIO.
    assert build_devices(scan_host(scenario_root("nvidia-driver")), default_config(), names) == ()
    assert build_devices(scan_host(scenario_root("no-iommu")), default_config(), names) == ()


def test_a_device_unbound_from_vfio_leaves_the_published_set(
    scenario_root: ScenarioRoot, names: PciIds
) -> None:
    root = scenario_root("hgx-h100")
    # Any driver may join, so the unbound GPU is still selected and must be refused as unusable.
    config = PluginConfig(resources=(ResourceConfig(Selectors(vendors=(0x10DE,))),))
    before = build_devices(scan_host(root), config, names)
    unbind_driver(root, "0000:2a:00.0")
    after = build_devices(scan_host(root), config, names)
    assert [d.bdf for d in before if d not in after] == [Bdf.parse("0000:2a:00.0")]


def test_selectors_are_the_device_plugins(scenario_root: ScenarioRoot, names: PciIds) -> None:
    config = PluginConfig(
        resources=(
            ResourceConfig(
                Selectors(pci_addresses=(Bdf.parse("0000:18:00.0"),)),
                resource_name="example.com/one",
            ),
        )
    )
    devices = build_devices(scan_host(scenario_root("hgx-h100")), config, names)
    assert [(d.name, d.resource) for d in devices] == [("pci-0000-18-00-0", "example.com/one")]


@pytest.mark.parametrize(
    "bdf", ["0000:00:00.0", "0000:65:1f.7", "10000:e1:00.3", "ffffffff:ff:1f.7"]
)
def test_device_names_are_dns_labels_that_map_back(bdf: str) -> None:
    name = device_name(Bdf.parse(bdf))
    assert len(name) <= 63
    assert name.replace("-", "").isalnum() and name == name.lower()
    assert bdf_of_device(name) == Bdf.parse(bdf)


@pytest.mark.parametrize(
    "name", ["gpu-0", "pci-0000-65-00-8", "pci-0000-65-20-0", "pci-000-65-00-0", "PCI-0000-65-00-0"]
)
def test_foreign_device_names_map_to_nothing(name: str) -> None:
    assert bdf_of_device(name) is None


def test_attribute_types_follow_python_types() -> None:
    assert typed_attributes({"a": True, "b": 3, "c": "x"}) == {
        "a": {"bool": True},
        "b": {"int": 3},
        "c": {"string": "x"},
    }


def test_a_published_device_stays_while_on_the_bus_marked_unusable(
    scenario_root: ScenarioRoot, names: PciIds
) -> None:
    root = scenario_root("hgx-h100")
    config = default_config()
    before = build_devices(scan_host(root), config, names)
    unbind_driver(root, "0000:2a:00.0")
    remove_function(root, "0000:3a:00.0")
    after = build_devices(scan_host(root), config, names, {d.bdf: d for d in before})
    by_name = {d.name: d for d in after}
    assert "pci-0000-3a-00-0" not in by_name and len(after) == 7
    unbound = by_name["pci-0000-2a-00-0"]
    assert unbound.unusable == "bound to no driver: bind it to vfio-pci to assign it"
    assert unbound.device_nodes == () and unbound.attributes["currentDriver"] == ""
    assert unbound.resource == H100 and unbound.group == before[1].group
    assert all(not d.unusable for n, d in by_name.items() if n != "pci-0000-2a-00-0")
    # Never published before: an unusable function is not published at all.
    assert "pci-0000-2a-00-0" not in {d.name for d in build_devices(scan_host(root), config, names)}
    # No longer selected by its ids: it leaves the slice.
    others = PluginConfig(resources=(ResourceConfig(Selectors(vendors=(0x8086,))),))
    assert build_devices(scan_host(root), others, names, {d.bdf: d for d in after}) == ()
