"""Reset methods: read by discovery on request, shown by inspect, and resetting through sysfs."""

from __future__ import annotations

import errno
from dataclasses import replace

import pytest

from hostdev.bdf import Bdf
from hostdev.binding.reset import ResetStatus, reset_function
from hostdev.pciids import PciIds
from hostdev.scan import read_reset_methods, refresh_host, scan_host
from kubevirt_iommufd.inspect_report import NO_RESET_WARNING, build_report, render_table
from sim.host import CLASS_3D, NVIDIA, BuildHost, FunctionSpec, HostSpec
from sim.kernel import KernelSimulator, hold

GPU = "0000:18:00.0"
OLD = "0000:19:00.0"
NONE = "0000:1a:00.0"


def three_gpus() -> HostSpec:
    def gpu(bdf: str, group: int, methods: tuple[str, ...]) -> FunctionSpec:
        return FunctionSpec(
            bdf, NVIDIA, 0x2330, CLASS_3D, driver="vfio-pci", group=group, reset_methods=methods
        )

    return HostSpec((gpu(GPU, 1, ("flr", "bus")), gpu(OLD, 2, ()), gpu(NONE, 3, ())))


@pytest.fixture
def host(build_host: BuildHost) -> KernelSimulator:
    root = build_host(three_gpus())
    # A kernel before 5.15: `reset` without `reset_method`.
    (root / "sys/bus/pci/devices" / OLD / "reset").write_text("")
    return KernelSimulator(root)


def test_discovery_reads_reset_methods_only_when_asked(host: KernelSimulator) -> None:
    assert {f.reset_methods for f in scan_host(host.root).functions} == {None}
    inventory = scan_host(host.root, reset_methods=True)
    assert [f.reset_methods for f in inventory.functions] == [("flr", "bus"), ("default",), ()]
    refreshed = refresh_host(host.root, inventory, [Bdf.parse(GPU)], reset_methods=True)
    assert refreshed.functions == inventory.functions
    assert read_reset_methods(host.root, Bdf.parse(NONE)) == ()


def test_inspect_warns_about_a_device_without_reset(host: KernelSimulator) -> None:
    inventory = scan_host(host.root, reset_methods=True)
    report = build_report(inventory, PciIds(None))
    devices = {d["bdf"]: d for g in report["groups"] for d in g["functions"]}
    assert devices[GPU]["reset_methods"] == ["flr", "bus"]
    assert devices[GPU]["warnings"] == []
    assert devices[NONE]["reset_methods"] == []
    assert devices[NONE]["warnings"] == [NO_RESET_WARNING]
    row = next(line for line in render_table(report).splitlines() if NONE in line)
    assert row.endswith("yes (iommufd); warning: no reset method")
    plain = build_report(scan_host(host.root), PciIds(None))
    assert "warnings" not in plain["groups"][0]["functions"][0]


def test_reset_writes_reset_and_honours_the_methods(host: KernelSimulator) -> None:
    inventory = scan_host(host.root)
    for bdf, methods in ((GPU, ("flr", "bus")), (OLD, ("default",))):
        function = inventory.function(Bdf.parse(bdf))
        assert function is not None
        outcome = reset_function(host.root, function, inventory.group_of(function), host)
        assert (outcome.status, outcome.methods) == (ResetStatus.RESET, methods)
    assert host.resets == [GPU, OLD]
    assert host.writes[0] == (f"sys/bus/pci/devices/{GPU}/reset", "1")


def test_no_method_means_no_write(host: KernelSimulator) -> None:
    inventory = scan_host(host.root)
    function = inventory.function(Bdf.parse(NONE))
    assert function is not None
    outcome = reset_function(host.root, function, inventory.group_of(function), host)
    assert outcome.status is ResetStatus.NO_METHOD
    assert "has no reset method" in outcome.message
    assert host.writes == []


def test_a_held_device_is_not_reset(host: KernelSimulator) -> None:
    hold(host.root, 99, "qemu-kvm", "/dev/vfio/1")
    inventory = scan_host(host.root)
    function = inventory.function(Bdf.parse(GPU))
    assert function is not None
    outcome = reset_function(host.root, function, inventory.group_of(function), host)
    assert outcome.status is ResetStatus.BUSY
    assert outcome.message == f"{GPU} is still open: pid 99 (qemu-kvm) holds /dev/vfio/1"
    assert host.resets == []


@pytest.mark.parametrize(
    ("code", "status", "text"),
    [
        (errno.ENOTTY, ResetStatus.FAILED, "none of its reset methods worked"),
        (errno.EAGAIN, ResetStatus.BUSY, "it was busy, trying again later"),
        (errno.EIO, ResetStatus.FAILED, "Input/output error"),
    ],
)
def test_a_failed_reset_says_why(
    host: KernelSimulator, code: int, status: ResetStatus, text: str
) -> None:
    host.fail(lambda path, _: path.endswith("/reset"), code)
    inventory = scan_host(host.root)
    function = inventory.function(Bdf.parse(GPU))
    assert function is not None
    outcome = reset_function(host.root, function, inventory.group_of(function), host)
    assert outcome.status is status
    assert outcome.message.startswith(f"resetting {GPU} (flr bus) failed: ")
    assert text in outcome.message


def test_bridges_get_no_warning(host: KernelSimulator) -> None:
    inventory = scan_host(host.root, reset_methods=True)
    bridge = replace(inventory.functions[2], class_code=0x060400)
    assert bridge.is_bridge
    report = build_report(replace(inventory, functions=(bridge,)), PciIds(None), [bridge.bdf])
    assert report["groups"][0]["functions"][0]["warnings"] == []
