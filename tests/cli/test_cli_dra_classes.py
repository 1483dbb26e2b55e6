"""`kubevirt-iommufd dra-classes`: the DeviceClasses it prints name exactly the resources the
DRA driver publishes its devices under, are valid Kubernetes 1.36 and 1.37 objects, and every
refusal says what to change; through the real entry point."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from dra.device_classes import device_selector
from dra.devices import build_devices
from hostdev.config import IOMMUFD_RESOURCE, parse_config
from hostdev.pciids import PciIds
from hostdev.scan import scan_host
from k8s_schema_kit import assert_valid
from kubevirt_iommufd.cli import main

DRIVER = "vfio.kubevirt-iommufd.io"
PCI_IDS = """\
10de  NVIDIA Corporation
\t2330  GH100[H100 SXM5 80GB]
\t22a3  GH100 [H100 NVSwitch]
"""


@pytest.fixture
def pci_ids(tmp_path: Path) -> str:
    path = tmp_path / "pci.ids"
    path.write_text(PCI_IDS)
    return str(path)


def classes(capsys: pytest.CaptureFixture[str], *argv: str) -> list[dict[str, Any]]:
    assert main(["dra-classes", *argv]) == 0
    return [c for c in yaml.safe_load_all(capsys.readouterr().out) if c]


def refusal(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    assert main(["dra-classes", *argv]) == 1
    out, err = capsys.readouterr()
    assert out == ""
    return err


@pytest.mark.parametrize("pci_ids_option", ["file", "none"])
def test_the_classes_select_what_the_driver_publishes_on_the_node(
    capsys: pytest.CaptureFixture[str],
    scenario_root: Callable[[str], Path],
    pci_ids: str,
    pci_ids_option: str,
) -> None:
    names = PciIds(Path(pci_ids)) if pci_ids_option == "file" else PciIds(None)
    option = pci_ids if pci_ids_option == "file" else "none"
    root = scenario_root("hgx-h100")
    printed = classes(capsys, "--root", str(root), "--pci-ids", option)
    published = build_devices(scan_host(root), parse_config({}), names)
    assert published
    by_resource = {c["spec"]["extendedResourceName"]: c for c in printed}
    # The iommufd slots' class too: the driver publishes its slots with that resource name.
    assert by_resource.pop(IOMMUFD_RESOURCE)["spec"]["selectors"] == [
        {"cel": {"expression": device_selector(DRIVER, IOMMUFD_RESOURCE)}}
    ]
    assert set(by_resource) == {d.attributes["resourceName"] for d in published}
    for device in published:
        device_class = by_resource[str(device.attributes["resourceName"])]
        assert device_class["spec"]["selectors"] == [
            {"cel": {"expression": device_selector(DRIVER, device.resource)}}
        ]
    if pci_ids_option == "file":
        assert set(by_resource) == {"nvidia.com/GH100H100_SXM5_80GB"}
        assert [c["metadata"]["name"] for c in printed] == [
            "devices.kubevirt.io.iommufd",
            "nvidia.com.gh100h100-sxm5-80gb",
        ]
    for device_class in printed:
        for version in ("1.36", "1.37"):
            assert_valid(device_class, version)


def test_device_ids_are_named_as_the_plugin_names_them(
    capsys: pytest.CaptureFixture[str], pci_ids: str
) -> None:
    printed = classes(
        capsys, "--device", "10de:2330", "--device", "10de:22A3", "--pci-ids", pci_ids
    )
    assert [c["spec"]["extendedResourceName"] for c in printed] == [
        IOMMUFD_RESOURCE,
        "nvidia.com/GH100H100_SXM5_80GB",
        "nvidia.com/GH100_H100_NVSWITCH",
    ]
    # The default configuration takes only NVIDIA devices.
    assert classes(capsys, "--device", "8086:0b25", "--device", "10de:2330", "--pci-ids", "none")


def test_named_resources_of_a_configuration_need_no_node(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    config = tmp_path / "dra.yaml"
    config.write_text(
        "resources:\n"
        "- resourceName: example.com/fpga_vf\n"
        "  selectors: {vendors: ['1172']}\n"
        "- autoName: nvidia\n  selectors: {vendors: ['10de']}\n"
        "iommufd: {enabled: false}\n"
    )
    printed = classes(capsys, "--config", str(config), "--driver-name", "vfio.example.com")
    (device_class,) = printed
    assert device_class["metadata"]["name"] == "example.com.fpga-vf"
    assert device_class["spec"] == {
        "extendedResourceName": "example.com/fpga_vf",
        "selectors": [
            {"cel": {"expression": device_selector("vfio.example.com", "example.com/fpga_vf")}}
        ],
    }
    assert device_selector("vfio.example.com", "example.com/fpga_vf") == (
        'device.driver == "vfio.example.com"'
        ' && has(device.attributes["vfio.example.com"].resourceName)'
        ' && device.attributes["vfio.example.com"].resourceName == "example.com/fpga_vf"'
    )


@pytest.mark.parametrize(
    ("resources", "expected"),
    [
        ([], "no resource to make a DeviceClass for"),
        (["example.com/" + "a" * 60], "longer than 64 characters"),
        (["example.com/GPU", "example.com/gpu"], "would both be DeviceClass example.com.gpu"),
        (["example.com/a_.b"], "is not a DeviceClass name"),
    ],
    ids=["auto-named-only", "too-long", "same-class", "not-a-subdomain"],
)
def test_refusals_name_the_fix(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, resources: list[str], expected: str
) -> None:
    config = tmp_path / "dra.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "resources": [
                    {"resourceName": name, "selectors": {"pciAddresses": [f"0000:0{i}:00.0"]}}
                    for i, name in enumerate(resources)
                ]
                or [{"autoName": "nvidia", "selectors": {"vendors": ["10de"]}}]
            }
        )
    )
    assert expected in refusal(capsys, "--config", str(config))


def test_help_describes_the_command(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as done:
        main(["dra-classes", "--help"])
    assert done.value.code == 0
    assert "extendedResourceName" in capsys.readouterr().out
