"""Node labels: what each says on each kind of node, and keys and values Kubernetes accepts."""

from __future__ import annotations

import re
from dataclasses import replace

import pytest
from hypothesis import given
from hypothesis import strategies as st

from hostdev.config import Binding, DeviceMode, PluginConfig, default_config
from hostdev.labels.node_labels import (
    build_node_labels,
    count_iommufd_devices,
    kernel_version,
    resource_count_label,
)
from hostdev.model import HostCapabilities
from hostdev.pciids import PciIds
from hostdev.scan import scan_host
from sim.host import SCENARIOS, BuildHost, unbind_driver

# Kubernetes' own rules (apimachinery IsQualifiedName, IsValidLabelValue), written out here
# rather than taken from the module under test.
NAME = r"[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?"
DNS_SUBDOMAIN = r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*"
KEY = re.compile(rf"({DNS_SUBDOMAIN}/)?{NAME}")
VALUE = re.compile(rf"({NAME})?")

CAPS = HostCapabilities(
    iommu=True,
    iommufd=True,
    iommufd_node_present=True,
    iommufd_devnum="10:257",
    vfio_cdev=True,
    legacy_vfio_node_present=True,
    kernel_release="6.12.0-kubevirt-iommufd",
)
GPU = "nvidia.com/GH100H100_SXM5_80GB"
GPU_COUNT = "kubevirt-iommufd.io/iommufd-devices.nvidia.com_GH100H100_SXM5_80GB"


def assert_valid(labels: dict[str, str]) -> None:
    for key, value in labels.items():
        assert KEY.fullmatch(key), key
        assert key.startswith("kubevirt-iommufd.io/"), key
        assert VALUE.fullmatch(value), (key, value)


@pytest.mark.parametrize(
    ("caps", "counts", "expected"),
    [
        pytest.param(
            CAPS,
            {GPU: 8},
            {
                "kubevirt-iommufd.io/iommufd": "true",
                "kubevirt-iommufd.io/vfio-cdev": "true",
                "kubevirt-iommufd.io/kernel": "6.12",
                GPU_COUNT: "8",
            },
            id="iommufd-node",
        ),
        pytest.param(
            CAPS,
            {GPU: 0, "example.com/nic": 0},
            {
                "kubevirt-iommufd.io/iommufd": "false",
                "kubevirt-iommufd.io/vfio-cdev": "true",
                "kubevirt-iommufd.io/kernel": "6.12",
                "kubevirt-iommufd.io/iommufd-devices.example.com_nic": "0",
                GPU_COUNT: "0",
            },
            id="no-device-over-iommufd",
        ),
        pytest.param(
            replace(CAPS, iommufd_node_present=False),
            {GPU: 8},
            {
                "kubevirt-iommufd.io/iommufd": "false",
                "kubevirt-iommufd.io/vfio-cdev": "true",
                "kubevirt-iommufd.io/kernel": "6.12",
                GPU_COUNT: "8",
            },
            id="dev-iommu-gone",
        ),
        pytest.param(
            replace(CAPS, vfio_cdev=None, kernel_release=None),
            {},
            {"kubevirt-iommufd.io/iommufd": "false"},
            id="nothing-known",
        ),
        pytest.param(
            replace(CAPS, vfio_cdev=False, kernel_release="5.14.0-427.el9.x86_64"),
            {GPU: 0},
            {
                "kubevirt-iommufd.io/iommufd": "false",
                "kubevirt-iommufd.io/vfio-cdev": "false",
                "kubevirt-iommufd.io/kernel": "5.14",
                GPU_COUNT: "0",
            },
            id="old-kernel",
        ),
    ],
)
def test_labels(caps: HostCapabilities, counts: dict[str, int], expected: dict[str, str]) -> None:
    labels = build_node_labels(caps, counts)
    assert labels == expected
    assert_valid(labels)


@pytest.mark.parametrize(
    ("release", "version"),
    [
        ("6.12.0-kubevirt-iommufd", "6.12"),
        ("6.1.0-18-amd64", "6.1"),
        ("5.14.0-427.el9.x86_64", "5.14"),
        ("06.08", "6.8"),
        ("6", None),
        ("", None),
        (None, None),
        ("linux-6.12", None),
    ],
)
def test_kernel_version(release: str | None, version: str | None) -> None:
    assert kernel_version(release) == version


def test_a_resource_count_key_maps_back_to_its_resource() -> None:
    key = resource_count_label(GPU)
    assert key == GPU_COUNT
    name = key.removeprefix("kubevirt-iommufd.io/iommufd-devices.")
    assert name.replace("_", "/", 1) == GPU


def test_a_long_resource_name_gets_a_hashed_key_that_keeps_what_fits() -> None:
    long_a = "devices.example.com/" + "A" * 50 + "_a"
    long_b = "devices.example.com/" + "A" * 50 + "_b"
    key_a, key_b = resource_count_label(long_a), resource_count_label(long_b)
    assert key_a != key_b
    for key in (key_a, key_b):
        assert KEY.fullmatch(key)
        name = key.partition("/")[2]
        assert len(name) == 63
        assert re.fullmatch(r"iommufd-devices-[0-9a-f]{10}\.devices\.example\.com_A+", name)


@given(
    st.from_regex(rf"{DNS_SUBDOMAIN}/{NAME}", fullmatch=True).filter(lambda n: len(n) < 300),
    st.from_regex(rf"{DNS_SUBDOMAIN}/{NAME}", fullmatch=True).filter(lambda n: len(n) < 300),
)
def test_every_resource_name_gets_a_valid_key_of_its_own(first: str, second: str) -> None:
    key = resource_count_label(first)
    assert KEY.fullmatch(key), key
    assert key.startswith("kubevirt-iommufd.io/iommufd-devices")
    if first != second:
        assert resource_count_label(second) != key


def test_counts_on_an_iommufd_node_follow_the_devices(build_host: BuildHost) -> None:
    root = build_host(SCENARIOS["hgx-h100"]())
    config, names = default_config(), PciIds(None)
    assert count_iommufd_devices(scan_host(root), config, names) == {"nvidia.com/2330": 8}
    unbind_driver(root, "0000:18:00.0")
    assert count_iommufd_devices(scan_host(root), config, names) == {"nvidia.com/2330": 7}
    legacy = replace(config, device_mode=DeviceMode.LEGACY)
    assert count_iommufd_devices(scan_host(root), legacy, names) == {"nvidia.com/2330": 0}


def test_a_legacy_only_node_says_false(build_host: BuildHost) -> None:
    inventory = scan_host(build_host(SCENARIOS["legacy-only"]()))
    counts = count_iommufd_devices(inventory, default_config(), PciIds(None))
    assert counts == {"nvidia.com/2330": 0}
    labels = build_node_labels(inventory.capabilities, counts)
    assert labels == {
        "kubevirt-iommufd.io/iommufd": "false",
        "kubevirt-iommufd.io/vfio-cdev": "false",
        "kubevirt-iommufd.io/kernel": "6.1",
        "kubevirt-iommufd.io/iommufd-devices.nvidia.com_2330": "0",
    }


def on_demand(config: PluginConfig) -> PluginConfig:
    return replace(
        config,
        resources=tuple(
            replace(r, binding=Binding.ON_DEMAND, selectors=replace(r.selectors, drivers=()))
            for r in config.resources
        ),
    )


def test_an_on_demand_device_off_vfio_counts_by_what_it_offers_once_bound(
    build_host: BuildHost,
) -> None:
    """A GPU a claim will bind to vfio-pci is served over iommufd then: a `require` VMI must
    be let onto its node (issue: on-demand nodes said iommufd=false)."""
    root = build_host(SCENARIOS["hgx-h100"]())
    unbind_driver(root, "0000:18:00.0")
    inventory, names = scan_host(root), PciIds(None)
    counts = count_iommufd_devices(inventory, on_demand(default_config()), names)
    assert counts == {"nvidia.com/2330": 8}
    assert build_node_labels(inventory.capabilities, counts)["kubevirt-iommufd.io/iommufd"] == (
        "true"
    )
    legacy = replace(on_demand(default_config()), device_mode=DeviceMode.LEGACY)
    assert count_iommufd_devices(inventory, legacy, names) == {"nvidia.com/2330": 0}


def test_an_on_demand_device_on_a_kernel_without_iommufd_does_not_count(
    build_host: BuildHost,
) -> None:
    root = build_host(SCENARIOS["legacy-only"]())
    unbind_driver(root, "0000:18:00.0")
    counts = count_iommufd_devices(scan_host(root), on_demand(default_config()), PciIds(None))
    assert counts == {"nvidia.com/2330": 0}
