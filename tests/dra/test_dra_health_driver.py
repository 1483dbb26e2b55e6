"""The driver's health judgement on a simulated node: the event (an unbind, a removed node, an AER
error) to the list handed to `on_health`, timed. The re-scan interval is long, so what is
measured is the event path (inotify, the counter poll), not the periodic re-scan."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path

import kubernetes.client
import pytest

from dra.api import ResourceApi
from dra.driver import BASELINES_FILE, DraDriver
from dra.health import DeviceHealth, Health
from dra_kit import DRIVER, NODE, driver_settings, short_directory
from hostdev.config import Binding, PluginConfig, ResourceConfig, Selectors, default_config
from hostdev.pciids import PciIds
from sim.apiserver import AllocatedDevice, ApiServerStandIn, build_resource_claim
from sim.dra_kubelet import Claim, DRAKubeletStandIn
from sim.host import (
    BuildHost,
    HostSpec,
    bind_driver,
    hgx_h100,
    nvidia_driver,
    remove_function,
    report_aer_error,
    scale,
    unbind_driver,
)

GPU = "0000:2a:00.0"
GPU_DEVICE = "pci-0000-2a-00-0"
RESCAN = 30.0


@dataclass
class Node:
    driver: DraDriver
    root: Path
    base: Path
    reports: list[tuple[DeviceHealth, ...]]

    def health(self, device: str) -> DeviceHealth | None:
        """The device as the last list handed to `on_health` has it."""
        last = self.reports[-1] if self.reports else ()
        return next((h for h in last if h.device == device), None)

    def wait(
        self, device: str, health: Health, what: str, says: str = "", timeout: float = 1.0
    ) -> DeviceHealth:
        """Wait until `on_health` hands on the device with `health` (and a message starting
        with `says`), print how long it took from the call and return it."""
        start = time.monotonic()
        while time.monotonic() - start < timeout:
            now = self.health(device)
            if now is not None and now.health is health and now.message.startswith(says):
                print(
                    f"\n{what}: {device} {health.name} in {(time.monotonic() - start) * 1e3:.1f} ms"
                )
                return now
            time.sleep(0.001)
        pytest.fail(f"{device} not {health.name} within {timeout} s: {self.health(device)}")


@pytest.fixture
def start(
    build_host: BuildHost, apiserver: ApiServerStandIn, api_client: kubernetes.client.ApiClient
) -> Iterator[Callable[..., Node]]:
    apiserver.put_node(NODE)
    started: list[DraDriver] = []
    with short_directory() as base:

        def run(
            spec: HostSpec | None = None,
            config: PluginConfig | None = None,
            root: Path | None = None,
        ) -> Node:
            root = root or build_host(spec or hgx_h100())
            reports: list[tuple[DeviceHealth, ...]] = []
            driver = DraDriver(
                driver_settings(root, base, RESCAN),
                config or default_config(),
                PciIds(None),
                ResourceApi(api_client),
                on_health=reports.append,
            )
            driver.start()
            started.append(driver)
            return Node(driver, root, base, reports)

        try:
            yield run
        finally:
            for driver in started:
                driver.stop()


def test_unbound_is_unhealthy_and_bound_again_healthy_both_at_once(
    start: Callable[..., Node],
) -> None:
    node = start()
    assert [h.health for h in node.driver.device_health] == [Health.HEALTHY] * 8
    assert node.reports and len(node.reports[-1]) == 8
    unbind_driver(node.root, GPU)
    unhealthy = node.wait(GPU_DEVICE, Health.UNHEALTHY, "unbind")
    assert unhealthy.message == (
        "cannot be given to a VM: bound to no driver: bind it to vfio-pci to assign it"
    )
    # Still published (its taint says why), and every report is the complete list.
    assert GPU_DEVICE in {d.name for d in node.driver.devices}
    assert all(len(r) == 8 for r in node.reports)
    bind_driver(node.root, GPU, "vfio-pci")
    node.wait(GPU_DEVICE, Health.HEALTHY, "bind")


def test_a_removed_cdev_is_unhealthy(start: Callable[..., Node]) -> None:
    node = start()
    (entry,) = (node.root / "sys/bus/pci/devices" / GPU / "vfio-dev").iterdir()
    (node.root / "dev/vfio/devices" / entry.name).unlink()
    unhealthy = node.wait(GPU_DEVICE, Health.UNHEALTHY, "cdev removed")
    assert "is missing, after it was there" in unhealthy.message


def test_a_group_made_not_viable_is_unhealthy(start: Callable[..., Node]) -> None:
    spec = hgx_h100()
    shared = tuple(
        replace(f, group=99) if f.bdf in ("0000:18:00.0", GPU) else f for f in spec.functions
    )
    node = start(replace(spec, functions=shared))
    unbind_driver(node.root, GPU)
    bind_driver(node.root, GPU, "nvidia")
    unhealthy = node.wait("pci-0000-18-00-0", Health.UNHEALTHY, "group not viable")
    assert "group 99 not viable: 0000:2a:00.0 is bound to nvidia" in unhealthy.message


def test_a_fatal_pcie_error_is_unhealthy_until_the_device_is_reprobed(
    start: Callable[..., Node],
) -> None:
    node = start()
    report_aer_error(node.root, GPU, fatal=True)
    unhealthy = node.wait(GPU_DEVICE, Health.UNHEALTHY, "AER fatal")
    assert unhealthy.message.startswith("1 fatal PCIe error (AER) since it was bound to vfio-pci")
    time.sleep(0.3)
    still = node.health(GPU_DEVICE)
    assert still is not None and (still.health, still.message) == (
        unhealthy.health,
        unhealthy.message,
    )
    unbind_driver(node.root, GPU)
    bind_driver(node.root, GPU, "vfio-pci")
    node.wait(GPU_DEVICE, Health.HEALTHY, "re-probed after the fatal error")


def test_non_fatal_pcie_errors_leave_it_healthy_and_are_said(
    start: Callable[..., Node], caplog: pytest.LogCaptureFixture
) -> None:
    node = start()
    with caplog.at_level(logging.WARNING, logger="dra.driver"):
        report_aer_error(node.root, GPU, fatal=False)
        health = node.wait(GPU_DEVICE, Health.HEALTHY, "AER non-fatal", "1 non-fatal")
    assert health.message == "1 non-fatal PCIe errors (AER) so far"
    assert f"{GPU}: 1 new non-fatal PCIe errors (AER, 1 in all)" in caplog.text


def test_a_gpu_on_its_host_driver_for_on_demand_claims_is_healthy(
    start: Callable[..., Node],
) -> None:
    config = PluginConfig(
        resources=(
            ResourceConfig(
                Selectors(vendors=(0x10DE,)),
                resource_name="nvidia.com/gpu",
                binding=Binding.ON_DEMAND,
            ),
        )
    )
    node = start(nvidia_driver(), config)
    devices = node.driver.devices
    assert devices and all(d.bind_on_demand for d in devices)
    assert {h.health for h in node.driver.device_health} == {Health.HEALTHY}


def test_a_prepared_device_gone_from_the_bus_is_unhealthy_naming_its_claim(
    start: Callable[..., Node], apiserver: ApiServerStandIn, caplog: pytest.LogCaptureFixture
) -> None:
    node = start()
    apiserver.put_claim(build_resource_claim("vms", "vm-gpu", ["gpu"], DRIVER))
    stored = apiserver.set_allocation(
        "vms", "vm-gpu", [AllocatedDevice("gpu", DRIVER, NODE, GPU_DEVICE)], NODE
    )
    uid = stored["metadata"]["uid"]
    with DRAKubeletStandIn(node.base / "kubelet", info_poll_interval=None) as kubelet:
        kubelet.wait_registered(DRIVER)
        answer = kubelet.node_prepare_resources([Claim("vms", uid, "vm-gpu")])[uid]
        assert answer.error == ""
        with caplog.at_level(logging.WARNING, logger="dra.driver"):
            remove_function(node.root, GPU)
            gone = node.wait(
                GPU_DEVICE,
                Health.UNHEALTHY,
                "prepared device removed",
                f"gone from the PCI bus while claim vms/vm-gpu (uid {uid}) is prepared on it",
            )
        assert node.driver.device_health == node.reports[-1]
        assert GPU_DEVICE not in {d.name for d in node.driver.devices}
        changes = [r.getMessage() for r in caplog.records if GPU_DEVICE in r.getMessage()]
        # The removal unbinds first: the device may be judged unusable on the way, once.
        assert 1 <= len(changes) <= 2
        assert changes[-1].startswith(f"device {GPU_DEVICE} ({GPU}) health ")
        assert changes[-1].endswith(
            f" -> UNHEALTHY: {gone.message}; claim vms/vm-gpu (uid {uid}) stays prepared on it"
            " (its VM decides what to do)"
        )
        # The claim is kept: the VM decides.
        assert node.driver.store.get(uid) is not None


def test_a_group_companion_keeps_its_fatal_baseline_while_a_claim_holds_its_group(
    start: Callable[..., Node], apiserver: ApiServerStandIn
) -> None:
    """A claim takes its device's group companions out of the pool; one that had a fatal error
    meanwhile comes back unhealthy, as the error came after it was bound. Holding the group
    leaves the baselines kept for the next start as they were (on 4,096 functions a rewrite of
    them was most of the event thread's work after each claim)."""
    node = start(scale(16))
    claimed, companion = "pci-0000-01-00-0", "0000:01:00.1"
    baselines = node.base / "state" / BASELINES_FILE
    written = baselines.stat().st_ino
    apiserver.put_claim(build_resource_claim("vms", "vm-gpu", ["gpu"], DRIVER))
    stored = apiserver.set_allocation(
        "vms", "vm-gpu", [AllocatedDevice("gpu", DRIVER, NODE, claimed)], NODE
    )
    claim = Claim("vms", stored["metadata"]["uid"], "vm-gpu")
    with DRAKubeletStandIn(node.base / "kubelet", info_poll_interval=None) as kubelet:
        kubelet.wait_registered(DRIVER)
        # Counted before the prepare: the event thread may report the hidden companion before
        # the prepare's answer is back.
        hidden = len(node.reports)
        assert kubelet.node_prepare_resources([claim])[claim.uid].error == ""
        deadline = time.monotonic() + 10
        while node.health("pci-0000-01-00-1") is not None and time.monotonic() < deadline:
            time.sleep(0.01)
        assert node.health("pci-0000-01-00-1") is None
        assert len(node.reports) > hidden
        report_aer_error(node.root, companion, fatal=True)
        assert kubelet.node_unprepare_resources([claim]) == {claim.uid: ""}
    back = node.wait("pci-0000-01-00-1", Health.UNHEALTHY, "shown again", timeout=10.0)
    assert back.message.startswith("1 fatal PCIe error (AER) since it was bound to vfio-pci")
    assert baselines.stat().st_ino == written


def test_the_health_list_is_handed_on_at_every_rescan(
    build_host: BuildHost, apiserver: ApiServerStandIn, api_client: kubernetes.client.ApiClient
) -> None:
    apiserver.put_node(NODE)
    reports: list[float] = []
    ready = threading.Event()

    def report(health: tuple[DeviceHealth, ...]) -> None:
        reports.append(health[0].checked_at)
        if len(reports) >= 3:
            ready.set()

    with short_directory() as base:
        driver = DraDriver(
            driver_settings(build_host(hgx_h100()), base, 0.1),
            default_config(),
            PciIds(None),
            ResourceApi(api_client),
            on_health=report,
        )
        driver.start()
        try:
            assert ready.wait(2)
        finally:
            driver.stop()
    assert reports == sorted(reports) and len(set(reports)) == len(reports)


def test_errors_counted_before_a_first_start_are_its_baseline_and_one_after_it_counts(
    start: Callable[..., Node], build_host: BuildHost
) -> None:
    """A device without a recorded baseline has its counters read after the first publication
    is handed on, and still before the start returns: what they hold then is its baseline."""
    spec = hgx_h100()
    root = build_host(spec)
    for _ in range(2):
        report_aer_error(root, GPU, fatal=True)
    node = start(spec, root=root)
    (first,) = [h for h in node.reports[0] if h.device == GPU_DEVICE]
    assert first.health is Health.HEALTHY
    assert node.health(GPU_DEVICE) == DeviceHealth(GPU_DEVICE, Health.HEALTHY, "", first.checked_at)
    report_aer_error(root, GPU, fatal=True)
    unhealthy = node.wait(GPU_DEVICE, Health.UNHEALTHY, "AER fatal after the start")
    assert unhealthy.message.startswith("1 fatal PCIe error (AER) since it was bound to vfio-pci")


def test_an_error_while_the_driver_was_down_taints_its_first_publication(
    build_host: BuildHost, apiserver: ApiServerStandIn, api_client: kubernetes.client.ApiClient
) -> None:
    """A device with a recorded baseline has its counters read before the first publication:
    an error since the last run makes the first list, and the first slices written, unhealthy."""
    apiserver.put_node(NODE)
    root = build_host(hgx_h100())
    with short_directory() as base:
        runs: list[list[tuple[DeviceHealth, ...]]] = []

        def run() -> DraDriver:
            runs.append([])
            driver = DraDriver(
                driver_settings(root, base, RESCAN),
                default_config(),
                PciIds(None),
                ResourceApi(api_client),
                on_health=runs[-1].append,
            )
            driver.start()
            return driver

        first = run()
        assert apiserver.wait_until(lambda: bool(apiserver.slices(NODE, DRIVER)), timeout=10)
        first.stop()
        report_aer_error(root, GPU, fatal=True)
        written = len(apiserver.requests)
        second = run()
        try:
            (judged,) = [h for h in runs[1][0] if h.device == GPU_DEVICE]
            assert judged.health is Health.UNHEALTHY, judged

            def gpu_entries() -> list[dict[str, object]]:
                """The GPU's entry in each slice written since the restart, in order."""
                return [
                    d
                    for r in apiserver.requests[written:]
                    if r.method in ("POST", "PUT") and "resourceslices" in r.path and r.body
                    for d in r.body["spec"]["devices"]
                    if d["name"] == GPU_DEVICE
                ]

            assert apiserver.wait_until(lambda: bool(gpu_entries()), timeout=10)
            assert gpu_entries()[0].get("taints"), gpu_entries()[0]
        finally:
            second.stop()
