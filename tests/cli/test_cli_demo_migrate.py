"""`kubevirt-iommufd demo --scenario migrate`: a `deviceName` VMI served by the DRA driver, every
step printed and checked; exit 1 when the driver leaves out what the device plugin gives (the
environment), when the webhook does not attach the hook, or when the node cannot hand out an
iommufd fd. The DeviceClasses it shows are the ones the DRA overlay ships."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

import dra.cdi
from kubevirt_iommufd import demo_migrate, demo_scenarios
from kubevirt_iommufd.cli import main
from sim.host import legacy_only

OVERLAY_CLASSES = (
    Path(__file__).resolve().parents[2]
    / "manifests/overlays/dra/deviceclasses-extended-resources.yaml"
)


def run_demo(capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    code = main(["demo", "--scenario", "migrate"])
    return code, capsys.readouterr().out


def test_migrate_scenario(capsys: pytest.CaptureFixture[str]) -> None:
    code, out = run_demo(capsys)
    assert code == 0, out
    assert "FAIL" not in out
    for expected in (
        "[1/8] a node switched to the DRA driver",
        "DeviceClass nvidia.com.gh100h100-sxm5-80gb: extendedResourceName"
        " nvidia.com/GH100H100_SXM5_80GB, selects 8 device(s)",
        "DeviceClass devices.kubevirt.io.iommufd: extendedResourceName"
        " devices.kubevirt.io/iommufd, selects 110 device(s)",
        "ok   the hook sidecar is attached, as on a device-plugin node",
        "annotations {'resource.kubernetes.io/extended-resource-claim': 'true'}",
        # compute's requests sorted: cpu, devices.kubevirt.io/iommufd, …/kvm, …/tun,
        # …/vhost-net, memory, nvidia.com/GH100H100_SXM5_80GB.
        "container-0-request-1: 1 x devices.kubevirt.io.iommufd",
        "container-0-request-6: 2 x nvidia.com.gh100h100-sxm5-80gb",
        "requestMappings: compute nvidia.com/GH100H100_SXM5_80GB -> container-0-request-6",
        "ok   the claim is prepared, with no error",
        "env: PCI_RESOURCE_NVIDIA_COM_GH100H100_SXM5_80GB=0000:18:00.0,0000:2a:00.0",
        "/var/run/kubevirt <- (emptyDir public)",
        "ok   the claim's hand-off socket at /var/run/kubevirt/iommufd.sock, mounted after",
        "ok   the fd is the node's /dev/iommu, opened and set up by the driver",
        "ok   the one-shot socket is gone afterwards",
        "ok   both GPUs on iommufd, on the handed-over fd (fdgroup='iommu' kept)",
        "ok   the same PCI_RESOURCE_<NAME>, the same addresses in the same order",
        "ok   the same device nodes in the container",
        "ok   the fd at the same /var/run/kubevirt/iommufd.sock, taken the same way",
        "demo passed: every step did what it should",
    ):
        assert expected in out
    assert out.count("\n  ok   ") == 16


def test_without_the_environment_the_vmi_would_not_find_its_devices(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(dra.cdi, "build_request_env", lambda *_: {})
    code, out = run_demo(capsys)
    assert code == 1
    assert "FAIL PCI_RESOURCE_NVIDIA_COM_GH100H100_SXM5_80GB lists the claim's 2 GPUs" in out
    assert "demo FAILED" in out


def test_without_the_hook_the_demo_fails(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(demo_migrate, "WEBHOOK_CONFIG", {})
    code, out = run_demo(capsys)
    assert code == 1
    assert "FAIL the hook sidecar is attached" in out


def test_a_node_without_iommufd_cannot_serve_the_fd(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    wrong = demo_scenarios.Scenario("no iommufd", legacy_only, "12.9.0", "iommufd", flow="migrate")
    monkeypatch.setitem(demo_scenarios.SCENARIOS, "migrate", wrong)
    code, out = run_demo(capsys)
    assert code == 1
    # Unlike the device plugin's `withoutIommu: legacy`, the driver refuses the claim's slot.
    assert "FAIL the claim is prepared, with no error" in out
    assert "cannot prepare its iommufd fd" in out
    assert "demo FAILED: 1 check(s) did not hold" in out


def overlay_classes() -> dict[str, Any]:
    with OVERLAY_CLASSES.open() as stream:
        return {c["metadata"]["name"]: c for c in yaml.safe_load_all(stream)}


def test_the_classes_shown_are_the_ones_the_overlay_ships(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["dra-classes", "--example", "hgx-h100"]) == 0
    printed = {c["metadata"]["name"]: c for c in yaml.safe_load_all(capsys.readouterr().out)}
    shipped = overlay_classes()
    assert sorted(printed) == ["devices.kubevirt.io.iommufd", "nvidia.com.gh100h100-sxm5-80gb"]
    for name, device_class in printed.items():
        assert device_class == shipped[name], name
