"""`kubevirt-iommufd demo` in each scenario: every step printed and checked, exit 0 only when
all held (and 1 when one does not)."""

from __future__ import annotations

import functools
import subprocess
import sys

import pytest

from kubevirt_iommufd import demo_dra, demo_scenarios
from kubevirt_iommufd.cli import main
from sim.apiserver import running_apiserver
from sim.dra_kubelet import DRAKubeletStandIn
from sim.host import legacy_only


def run_demo(capsys: pytest.CaptureFixture[str], scenario: str) -> tuple[int, str]:
    code = main(["demo", "--scenario", scenario])
    return code, capsys.readouterr().out


def test_iommufd_scenario(capsys: pytest.CaptureFixture[str]) -> None:
    code, out = run_demo(capsys, "iommufd")
    assert code == 0, out
    assert "FAIL" not in out
    for expected in (
        "[1/5] a simulated node",
        "[5/5] the launcher hook rewrites the domain",
        "ok   8 GPUs assignable over iommufd",
        "ok   devices.kubevirt.io/iommufd: 110 slots, Healthy",
        "ok   adds devices.kubevirt.io/iommufd: 1 to container compute's limits and requests",
        "ok   hands out each GPU's cdev and /dev/iommu",
        "ok   a launcher-like client received the /dev/iommu fd (SCM_RIGHTS), ACKed",
        "ok   the one-shot socket is gone afterwards",
        '+  <iommufd enabled="yes"/>',
        "ok   both GPUs on iommufd, the decision recorded in <metadata>",
        "demo passed: every step did what it should",
    ):
        assert expected in out
    assert out.count("\n  ok   ") >= 11


@pytest.mark.parametrize(
    ("scenario", "lines"),
    [
        (
            "legacy-node",
            [
                "ok   8 GPUs assignable over legacy",
                "110 slots, Healthy (no /dev/iommu here: allocatable, for launchers on legacy",
                "ok   the pod still schedules here and its launcher stays on legacy VFIO",
                "ok   hands out legacy VFIO nodes only (the node has no cdevs)",
                "legacy (no iommufd: the kernel lacks CONFIG_IOMMUFD",
                "ok   both GPUs on legacy",
            ],
        ),
        (
            "old-libvirt",
            [
                "ok   8 GPUs assignable over iommufd",
                "legacy (libvirt 11.10.0 (--libvirt-version) predates iommufd (needs 12.1.0))",
                "ok   both GPUs on legacy",
            ],
        ),
    ],
)
def test_fall_back_scenarios(
    capsys: pytest.CaptureFixture[str], scenario: str, lines: list[str]
) -> None:
    code, out = run_demo(capsys, scenario)
    assert code == 0, out
    for line in lines:
        assert line in out
    assert "<iommufd" not in out


def test_dra_scenario(capsys: pytest.CaptureFixture[str]) -> None:
    code, out = run_demo(capsys, "dra")
    assert code == 0, out
    assert "FAIL" not in out
    for expected in (
        "[1/7] the DRA driver starts on a simulated node and registers with the kubelet",
        "GetInfo -> DRAPlugin vfio.kubevirt-iommufd.io, versions v1.DRAPlugin, v1beta1.DRAPlugin",
        "ok   registered: the kubelet speaks v1.DRAPlugin to dra.sock",
        "pool gpu-node-1, generation 1: 1 slice(s) (gpu-node-1-vfio.kubevirt-iommufd.io-0), 8",
        "pci-0000-18-00-0  0000:18:00.0",
        "ok   8 GPUs in pool gpu-node-1, nodeName gpu-node-1, resourceSliceCount 1",
        "ok   the slices are owned by Node gpu-node-1",
        "gpu -> vfio.kubevirt-iommufd.io gpu-node-1/pci-0000-18-00-0",
        "ok   the claim is prepared, with no error",
        "ok   asked again (as the kubelet retries), the same answer",
        '"kind": "vfio.kubevirt-iommufd.io/claim"',
        '{"path": "/dev/vfio/devices/vfio0"},',
        "ok   device nodes for iommufd: /dev/vfio/devices/vfio0 /dev/iommu /dev/vfio/vfio",
        "metadata file, mounted in the pod at /var/run/kubernetes.io/dra-device-attributes/"
        "resourceclaims/vm-gpu/gpu/vfio.kubevirt-iommufd.io-metadata.json:",
        '"kind": "DeviceMetadata"',
        '"resource.kubernetes.io/pciBusID": {"string": "0000:18:00.0"},',
        "ok   one request, one device, its PCI address 0000:18:00.0: what KubeVirt expects",
        "[6/7] the VM's GPU loses vfio-pci and gets it back: the health stream and the slice",
        "NodeWatchResources (gRPC): 8 devices Healthy; unbind 0000:18:00.0 from vfio-pci",
        "health stream: gpu-node-1/pci-0000-18-00-0 Unhealthy after ",
        "cannot be given to a VM: bound to no driver",
        'slice: pci-0000-18-00-0 taints [{"key": "vfio.kubevirt-iommufd.io/unhealthy",'
        ' "effect": "NoSchedule", "timeAdded": ',
        "ok   the kubelet reads it Unhealthy, and why, within 1000 ms",
        "ok   its slice entry is tainted NoSchedule within 1000 ms: the scheduler allocates the 7"
        " others (7 allocatable)",
        "ok   the claim stays prepared, its CDI spec and metadata in place: the VM decides",
        "health stream: gpu-node-1/pci-0000-18-00-0 Healthy after ",
        "slice: pci-0000-18-00-0 untainted after ",
        "ok   the kubelet reads it Healthy again within 1000 ms",
        "ok   the taint is gone within 1000 ms: all 8 allocatable again",
        "[7/7] the VM's pod is gone: NodeUnprepareResources (gRPC)",
        "ok   its CDI spec, metadata file and state record are gone",
        "demo passed: every step did what it should",
    ):
        assert expected in out
    assert out.count("\n  ok   ") == 21


def test_a_failed_check_fails_the_demo(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # The hook is told to expect iommufd where the node can only do legacy VFIO.
    wrong = demo_scenarios.Scenario("mislabelled", legacy_only, "12.9.0", "iommufd")
    monkeypatch.setitem(demo_scenarios.SCENARIOS, "legacy-node", wrong)
    code, out = run_demo(capsys, "legacy-node")
    assert code == 1
    assert "FAIL both GPUs on iommufd" in out
    assert "demo FAILED: 1 check(s) did not hold" in out


def test_a_failed_dra_check_fails_the_demo(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # A claim on a node without iommufd gets legacy VFIO nodes only, not the cdev the
    # mislabelled scenario expects.
    wrong = demo_scenarios.Scenario("mislabelled", legacy_only, "12.9.0", "iommufd", flow="dra")
    monkeypatch.setitem(demo_scenarios.SCENARIOS, "dra", wrong)
    code, out = run_demo(capsys, "dra")
    assert code == 1
    assert "FAIL device nodes for iommufd: (no cdev) /dev/iommu /dev/vfio/vfio" in out
    assert "ok   its CDI spec, metadata file and state record are gone" in out
    assert "demo FAILED: 1 check(s) did not hold" in out


@pytest.mark.parametrize(
    ("stand_in", "replacement", "lines"),
    [
        (
            # A kubelet from before DRAResourceHealth: the driver registers, but no stream opens.
            "DRAKubeletStandIn",
            functools.partial(DRAKubeletStandIn, health_services=()),
            [
                "FAIL the kubelet's health stream says 8 devices Healthy (1.0 s)",
                "[7/7] the VM's pod is gone",
            ],
        ),
        (
            # The DRADeviceTaints feature gate off: the server drops the taint the driver writes.
            "running_apiserver",
            functools.partial(running_apiserver, device_taints=False),
            [
                "ok   the kubelet reads it Unhealthy, and why, within 1000 ms",
                "slice: pci-0000-18-00-0 taints [] after (not seen)",
                "FAIL its slice entry is tainted NoSchedule within 1000 ms: the scheduler"
                " allocates the 7 others (8 allocatable)",
                "ok   the taint is gone within 1000 ms: all 8 allocatable again",
            ],
        ),
    ],
    ids=["kubelet-without-health-stream", "apiserver-dropping-taints"],
)
def test_health_not_seen_fails_the_dra_demo(
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    stand_in: str,
    replacement: object,
    lines: list[str],
) -> None:
    monkeypatch.setattr(demo_dra, "HEALTH_WAIT", 1.0)
    monkeypatch.setattr(demo_dra, stand_in, replacement)
    code, out = run_demo(capsys, "dra")
    assert code == 1
    for line in lines:
        assert line in out
    assert "demo FAILED: 1 check(s) did not hold" in out


def test_runs_as_the_installed_command() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "kubevirt_iommufd", "demo"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.rstrip().endswith("demo passed: every step did what it should")
