"""The CDI spec check the DRA tests run on every spec the driver writes: a spec of the driver's
shape passes; each thing a runtime would refuse is named."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from dra_cdi_schema_kit import CdiSpecError, minimum_cdi_version, validate_cdi_spec

UID = "0b6f6a5e-3c1d-4b8e-9f11-2a7c5d9e8f01"


def claim_spec() -> dict[str, Any]:
    """One VFIO device with its nodes and one request's metadata mount, as the driver writes."""
    return {
        "cdiVersion": "0.6.0",
        "kind": "vfio.kubevirt-iommufd.io/claim",
        "devices": [
            {
                "name": f"{UID}-pci-0000-65-00-0",
                "containerEdits": {
                    "deviceNodes": [
                        {"path": "/dev/vfio/devices/vfio0"},
                        {"path": "/dev/iommu"},
                        {"path": "/dev/vfio/vfio"},
                        {"path": "/dev/vfio/42", "hostPath": "/dev/vfio/42", "type": "c"},
                    ]
                },
            },
            {
                "name": f"{UID}-metadata-gpu",
                "containerEdits": {
                    "mounts": [
                        {
                            "hostPath": "/var/lib/kubevirt-iommufd/dra/gpu.json",
                            "containerPath": "/var/run/kubernetes.io/dra-device-attributes/"
                            "resourceclaims/gpus/gpu/vfio.kubevirt-iommufd.io-metadata.json",
                            "options": ["ro", "nosuid", "nodev", "bind"],
                        }
                    ]
                },
            },
        ],
    }


def test_a_spec_of_the_drivers_shape_is_valid() -> None:
    validate_cdi_spec(claim_spec())
    assert minimum_cdi_version(claim_spec()) == "0.5.0"  # hostPath, and names led by a digit


def changed(change: Any) -> dict[str, Any]:
    spec = claim_spec()
    change(spec)
    return spec


def edits(spec: dict[str, Any]) -> dict[str, Any]:
    edits: dict[str, Any] = spec["devices"][0]["containerEdits"]
    return edits


# Spec → what the error must say.
INVALID = {
    "no devices": (changed(lambda s: s.update(devices=[])), "devices: [] should be non-empty"),
    "no kind": (changed(lambda s: s.pop("kind")), "<the spec>: 'kind' is a required property"),
    "a misspelt field": (
        changed(lambda s: edits(s).update(deviceNode=[])),
        "devices[0].containerEdits: Additional properties are not allowed ('deviceNode'",
    ),
    "a device node without a path": (
        changed(lambda s: edits(s)["deviceNodes"].append({"hostPath": "/dev/iommu"})),
        "devices[0].containerEdits.deviceNodes[4]: 'path' is a required property",
    ),
    "an env entry without =": (
        changed(lambda s: edits(s).update(env=["VFIO"])),
        "devices[0].containerEdits.env[0]: 'VFIO' does not match",
    ),
    "a negative uid": (
        changed(lambda s: edits(s)["deviceNodes"][0].update(uid=-1)),
        "deviceNodes[0].uid: -1 is less than the minimum of 0",
    ),
    "a device without edits": (
        changed(lambda s: s["devices"][0].pop("containerEdits")),
        "devices[0]: 'containerEdits' is a required property",
    ),
    "an unreleased version": (
        changed(lambda s: s.update(cdiVersion="2.0.0")),
        "cdiVersion '2.0.0' is not a released CDI version",
    ),
    "a version older than a field used": (
        changed(lambda s: s.update(cdiVersion="0.4.0")),
        "the fields used need cdiVersion 0.5.0 or later, not 0.4.0",
    ),
    "a kind without a class": (
        changed(lambda s: s.update(kind="vfio.kubevirt-iommufd.io")),
        "kind 'vfio.kubevirt-iommufd.io' needs the form vendor/class",
    ),
    "a device name with a slash": (
        changed(lambda s: s["devices"][0].update(name="pci/0000:65:00.0")),
        "device name 'pci/0000:65:00.0' must start and end with a letter or digit",
    ),
    "the same device twice": (
        changed(lambda s: s["devices"].append(copy.deepcopy(s["devices"][0]))),
        f"device '{UID}-pci-0000-65-00-0' is defined twice",
    ),
    "empty edits": (
        changed(lambda s: s["devices"][0].update(containerEdits={"deviceNodes": []})),
        f"device '{UID}-pci-0000-65-00-0' has no container edits",
    ),
    "a bad device node type": (
        changed(lambda s: edits(s)["deviceNodes"][0].update(type="char")),
        "device node '/dev/vfio/devices/vfio0' has type 'char': use b, c, u or p",
    ),
    "bad permissions": (
        changed(lambda s: edits(s)["deviceNodes"][0].update(permissions="rx")),
        "device node '/dev/vfio/devices/vfio0' has permissions 'rx'",
    ),
    "an unknown hook": (
        changed(lambda s: edits(s).update(hooks=[{"hookName": "prepare", "path": "/bin/true"}])),
        "hook name 'prepare' is not one of",
    ),
}


@pytest.mark.parametrize(("spec", "message"), INVALID.values(), ids=list(INVALID))
def test_an_invalid_spec_is_refused_naming_the_problem(spec: dict[str, Any], message: str) -> None:
    with pytest.raises(CdiSpecError) as caught:
        validate_cdi_spec(spec)
    assert message in str(caught.value)
    assert str(caught.value).startswith("CDI spec")


@pytest.mark.parametrize(
    ("change", "version"),
    [
        (lambda s: s.update(annotations={"a": "b"}), "0.6.0"),
        (lambda s: s.update(kind="example.com/vfio.gpu"), "0.6.0"),
        (lambda s: edits(s).update(additionalGids=[1000]), "0.7.0"),
        (lambda s: edits(s).update(netDevices=[{"hostInterfaceName": "a", "name": "b"}]), "1.1.0"),
    ],
    ids=["annotations", "a dotted class", "additional gids", "net devices"],
)
def test_newer_fields_raise_the_minimum_version(change: Any, version: str) -> None:
    spec = changed(change)
    assert minimum_cdi_version(spec) == version
    spec["cdiVersion"] = version
    validate_cdi_spec(spec)
