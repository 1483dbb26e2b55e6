from __future__ import annotations

import json
from pathlib import Path

import pytest

from hostdev.bdf import Bdf
from hostdev.config import (
    ConfigError,
    DeviceMode,
    IommufdConfig,
    ResourceConfig,
    Selectors,
    default_config,
    load_config,
    parse_config,
)

FULL_YAML = """\
resources:
  - resourceName: example.com/h100
    selectors:
      vendors: ["10de"]
      devices: ["0x2330"]
      classes: ["0302"]
      drivers: [vfio-pci]
      pciAddresses: ["0000:18:00.0"]
  - autoName: nvidia
    selectors: {vendors: ["10DE"]}
deviceMode: iommufd
rescanIntervalSeconds: 5
pciIds: /usr/share/misc/pci.ids
iommufd:
  enabled: true
  resourceName: devices.kubevirt.io/iommufd
  slots: 16
  socketDir: /run/kubevirt-iommufd
  socketOwner: {uid: 107, gid: 1000}
  socketMode: "0600"
  handoffTimeoutSeconds: 60
"""


def test_full_yaml(tmp_path: Path) -> None:
    path = tmp_path / "config.yaml"
    path.write_text(FULL_YAML)
    config = load_config(path)
    assert config.resources == (
        ResourceConfig(
            Selectors(
                vendors=(0x10DE,),
                devices=(0x2330,),
                classes=("0302",),
                drivers=("vfio-pci",),
                pci_addresses=(Bdf.parse("0000:18:00.0"),),
            ),
            resource_name="example.com/h100",
        ),
        ResourceConfig(Selectors(vendors=(0x10DE,))),
    )
    assert config.device_mode is DeviceMode.IOMMUFD
    assert config.rescan_interval_seconds == 5
    assert config.pci_ids == Path("/usr/share/misc/pci.ids")
    assert config.iommufd == IommufdConfig(
        enabled=True,
        resource_name="devices.kubevirt.io/iommufd",
        slots=16,
        socket_dir=Path("/run/kubevirt-iommufd"),
        socket_uid=107,
        socket_gid=1000,
        socket_mode=0o600,
        handoff_timeout_seconds=60,
    )


def test_json_file(tmp_path: Path) -> None:
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"deviceMode": "legacy", "iommufd": {"enabled": False}}))
    config = load_config(path)
    assert config.device_mode is DeviceMode.LEGACY
    assert not config.iommufd.enabled
    assert not config.iommufd.without_iommu_legacy
    legacy = parse_config({"iommufd": {"withoutIommu": "legacy"}})
    assert legacy.iommufd.without_iommu_legacy
    assert config.resources == default_config().resources


def test_empty_file_is_the_default(tmp_path: Path) -> None:
    path = tmp_path / "config.yaml"
    path.write_text("")
    assert load_config(path) == default_config()


def test_default_is_nvidia_gpus_and_nvswitches_on_vfio() -> None:
    (resource,) = default_config().resources
    assert resource.auto_name
    assert resource.selectors == Selectors(
        vendors=(0x10DE,), classes=("0300", "0302", "0680"), drivers=("vfio",)
    )
    assert default_config().iommufd.slots == 110
    assert default_config().iommufd.socket_mode == 0o660


@pytest.mark.parametrize(
    ("document", "features_dir"),
    [
        ({}, Path("/etc/kubernetes/node-feature-discovery/features.d")),
        ({"nodeLabels": {"featuresDir": "/run/nfd/features.d"}}, Path("/run/nfd/features.d")),
        ({"nodeLabels": {"featuresDir": "none"}}, None),
    ],
)
def test_node_labels_features_dir(document: object, features_dir: Path | None) -> None:
    assert parse_config(document).node_labels.features_dir == features_dir


@pytest.mark.parametrize(
    ("document", "message"),
    [
        ([], "the document: expected a mapping, got list []"),
        (
            {"resource": []},
            "resource: unknown key; expected one of deviceMode, iommufd, nodeLabels, pciIds,",
        ),
        ({"resources": {}}, "resources: expected a list, got dict {}"),
        (
            {"resources": [{"selectors": {"vendors": ["10de"]}}]},
            "resources[0]: missing resourceName",
        ),
        (
            {"resources": [{"resourceName": "gpu", "selectors": {"vendors": ["10de"]}}]},
            "resources[0].resourceName: 'gpu' is not an extended resource name",
        ),
        (
            {"resources": [{"resourceName": "a.com/b", "selectors": {}}]},
            "resources[0].selectors: give at least one selector",
        ),
        (
            {"resources": [{"resourceName": "a.com/b", "selectors": {"vendors": ["nvidia"]}}]},
            'resources[0].selectors.vendors[0]: expected 4 hex digits such as "10de",'
            " got 'nvidia'",
        ),
        (
            {"resources": [{"resourceName": "a.com/b", "selectors": {"classes": ["3"]}}]},
            "resources[0].selectors.classes[0]: expected a class prefix of 2, 4 or 6 hex digits",
        ),
        (
            {
                "resources": [
                    {"resourceName": "a.com/b", "selectors": {"pciAddresses": ["3b:00.0"]}}
                ]
            },
            "resources[0].selectors.pciAddresses[0]: invalid PCI address '3b:00.0'",
        ),
        (
            {"resources": [{"resourceName": "a.com/b", "selectors": {"drivers": ["../x"]}}]},
            "resources[0].selectors.drivers[0]: expected a driver name",
        ),
        (
            {"resources": [{"autoName": "amd"}]},
            "resources[0].autoName: expected \"nvidia\", got 'amd'",
        ),
        (
            {"resources": [{"autoName": "nvidia", "resourceName": "a.com/b"}]},
            "resources[0]: give resourceName or autoName, not both",
        ),
        (
            {"deviceMode": "fast"},
            'deviceMode: expected "both", "iommufd" or "legacy", got \'fast\'',
        ),
        (
            {"rescanIntervalSeconds": 0},
            "rescanIntervalSeconds: expected a number of at least 1, got 0",
        ),
        ({"rescanIntervalSeconds": True}, "rescanIntervalSeconds: expected a number of at least 1"),
        ({"iommufd": {"slots": 1.5}}, "iommufd.slots: expected an integer of at least 1, got 1.5"),
        ({"iommufd": {"socketMode": "0666"}}, "iommufd.socketMode: 0666 lets any user take the"),
        ({"iommufd": {"socketMode": "rw"}}, "iommufd.socketMode: expected an octal mode"),
        ({"iommufd": {"socketOwner": {"user": 1}}}, "iommufd.socketOwner.user: unknown key"),
        ({"iommufd": {"enabled": "yes"}}, "iommufd.enabled: expected true or false, got 'yes'"),
        (
            {
                "resources": [
                    {
                        "resourceName": "devices.kubevirt.io/iommufd",
                        "selectors": {"vendors": ["10de"]},
                    }
                ]
            },
            "resources[0].resourceName: 'devices.kubevirt.io/iommufd' is the iommufd resource's",
        ),
        (
            {"iommufd": {"withoutIommu": "ignore"}},
            'iommufd.withoutIommu: expected "unhealthy" or "legacy", got \'ignore\'',
        ),
        (
            {"iommufd": {"resourceName": "kubernetes.io/iommu"}},
            "iommufd.resourceName: 'kubernetes.io/iommu' is in a namespace Kubernetes reserves",
        ),
        (
            {"nodeLabels": {"featuresDir": "features.d"}},
            "nodeLabels.featuresDir: expected an absolute directory",
        ),
        ({"nodeLabels": {"featuresDir": False}}, "nodeLabels.featuresDir: expected a non-empty"),
        ({"nodeLabels": {"featureFile": "/x"}}, "nodeLabels.featureFile: unknown key"),
    ],
)
def test_bad_config_names_the_key(document: object, message: str) -> None:
    with pytest.raises(ConfigError) as caught:
        parse_config(document)
    assert str(caught.value).startswith(message)


def test_unreadable_and_malformed_files(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"cannot read config .*missing.yaml: No such file"):
        load_config(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("resources: [\n")
    with pytest.raises(ConfigError, match=r"config .*bad.yaml is not valid YAML"):
        load_config(bad)
    wrong = tmp_path / "wrong.json"
    wrong.write_text('{"deviceMode": 3}')
    with pytest.raises(ConfigError, match=r"config .*wrong.json: deviceMode: expected a non-empty"):
        load_config(wrong)
