"""The container runtime stand-in applies CDI devices as the CDI library does: a spec's own edits
before its first device's, the last value of a variable kept, mounts sorted by depth (stably), and
an id no spec provides refused."""

from __future__ import annotations

from typing import Any

import pytest

from sim.container_runtime import Mount, UnresolvedDevice, apply_cdi_devices


def spec(kind: str, devices: dict[str, dict[str, Any]], **edits: Any) -> dict[str, Any]:
    return {
        "cdiVersion": "0.6.0",
        "kind": kind,
        "containerEdits": edits,
        "devices": [{"name": n, "containerEdits": e} for n, e in devices.items()],
    }


def test_spec_edits_come_first_and_the_last_value_wins() -> None:
    specs = [
        spec(
            "v.io/c",
            {"a": {"env": ["X=a", "A=1"]}, "b": {"env": ["X=b"]}},
            env=["X=spec", "S=1"],
        )
    ]
    edits = apply_cdi_devices(specs, ["v.io/c=a", "v.io/c=b"])
    assert edits.env == {"X": "b", "S": "1", "A": "1"}
    # The spec's edits apply once, before its first device: a later device's value stays.
    assert apply_cdi_devices(specs, ["v.io/c=b", "v.io/c=a"]).env["X"] == "a"


def test_mounts_are_sorted_by_depth_after_the_pods_own() -> None:
    socket = {"hostPath": "/h/s.sock", "containerPath": "/var/run/kubevirt/iommufd.sock"}
    specs = [spec("v.io/c", {"a": {"mounts": [socket], "deviceNodes": [{"path": "/dev/iommu"}]}})]
    pod = [Mount("/var/run/kubevirt-private", "p"), Mount("/var/run/kubevirt", "public")]
    edits = apply_cdi_devices(specs, ["v.io/c=a"], pod)
    assert [m.container_path for m in edits.mounts] == [
        "/var/run/kubevirt-private",
        "/var/run/kubevirt",
        "/var/run/kubevirt/iommufd.sock",
    ]
    assert edits.device_nodes == ("/dev/iommu",)


def test_a_shallow_cdi_mount_goes_before_a_deeper_one_of_the_pod() -> None:
    specs = [spec("v.io/c", {"a": {"mounts": [{"hostPath": "/h", "containerPath": "/data"}]}})]
    edits = apply_cdi_devices(specs, ["v.io/c=a"], [Mount("/data/cache/x", "pod")])
    assert [m.container_path for m in edits.mounts] == ["/data", "/data/cache/x"]


def test_an_unknown_device_is_refused() -> None:
    with pytest.raises(UnresolvedDevice, match=r"v\.io/c=missing"):
        apply_cdi_devices([spec("v.io/c", {"a": {}})], ["v.io/c=missing"])
