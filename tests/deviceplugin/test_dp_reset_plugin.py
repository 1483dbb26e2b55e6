"""Reset after use end to end: the plugin against the kubelet stand-in and the pod resources
stand-in, over real gRPC, resetting devices of a simulated node through a recording writer."""

from __future__ import annotations

import errno
import logging
import os
import shutil
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from deviceplugin import resetter
from deviceplugin.manager import PluginManager
from deviceplugin.metrics import PluginMetrics
from hostdev.binding.lock import LockHolder, hold_binding_lock, read_lock_holder
from hostdev.config import PluginConfig, parse_config
from hostdev.pciids import PciIds
from sim.host import BuildHost, hgx_h100
from sim.kubelet import KubeletStandIn
from sim.podresources import PodResourcesStandIn

H100 = "nvidia.com/H100"
GPU = "0000:18:00.0"
OTHER = "0000:2a:00.0"


class RecordingSysfs:
    """Resets as the kernel does them (the `reset` attribute must exist), recorded with the
    time they happened; a failure can be injected per device."""

    def __init__(self) -> None:
        self.resets: list[tuple[float, str]] = []
        self.lock_holders: list[LockHolder | None] = []
        """The binding lock's holder during each reset."""
        self.failing: set[str] = set()
        self.gate = threading.Event()
        """Cleared: resets wait (as a slow FLR would) until it is set again."""
        self.gate.set()
        self._lock = threading.Lock()

    def write(self, path: Path, text: str) -> None:
        assert (path.name, text) == ("reset", "1")
        bdf = path.parent.name
        if not path.exists():
            raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT))
        self.gate.wait(5)
        if bdf in self.failing:
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        # <root>/sys/bus/pci/devices/<BDF>/reset
        holder = read_lock_holder(path.parents[5])
        with self._lock:
            self.resets.append((time.monotonic(), bdf))
            self.lock_holders.append(holder)

    def count(self, bdf: str) -> int:
        with self._lock:
            return sum(1 for _, b in self.resets if b == bdf)

    def last(self, bdf: str) -> float:
        with self._lock:
            return max(t for t, b in self.resets if b == bdf)


@dataclass
class Node:
    root: Path
    kubelet: KubeletStandIn
    pods: PodResourcesStandIn
    sysfs: RecordingSysfs
    manager: PluginManager
    thread: threading.Thread

    def health(self) -> dict[str, str]:
        return self.kubelet.health(H100)

    def wait_health(self, bdf: str, health: str, timeout: float = 5.0) -> None:
        self.kubelet.wait_for(lambda: self.health().get(bdf) == health, timeout)

    def ever(self, bdf: str, health: str, after: float = 0.0) -> bool:
        registration = self.kubelet.latest(H100)
        assert registration is not None
        return any(t >= after and s.get(bdf) == health for t, s in registration.snapshots)


@pytest.fixture
def start_node(build_host: BuildHost, short_dir: Path) -> Iterator[Callable[..., Node]]:
    started: list[Node] = []

    def start(
        *,
        pods_serving: bool = True,
        poll: float = 0.2,
        prepare: Callable[[Path], None] | None = None,
    ) -> Node:
        root = build_host(hgx_h100())
        if prepare is not None:
            prepare(root)
        config: PluginConfig = parse_config(
            {
                "resources": [
                    {
                        "resourceName": H100,
                        "selectors": {"vendors": ["10de"], "classes": ["0302"]},
                        "resetAfterUse": True,
                    }
                ],
                "iommufd": {"enabled": False},
                "podResources": {
                    "socket": str(short_dir / "pod-resources/kubelet.sock"),
                    "pollIntervalSeconds": poll,
                },
            }
        )
        kubelet = KubeletStandIn(short_dir / "kubelet")
        kubelet.start()
        pods = PodResourcesStandIn(short_dir / "pod-resources/kubelet.sock")
        if pods_serving:
            pods.start()
        sysfs = RecordingSysfs()
        manager = PluginManager(
            config, root, short_dir / "kubelet", PciIds(None), PluginMetrics(), sysfs_writer=sysfs
        )
        manager.start()
        thread = threading.Thread(target=manager.run, daemon=True)
        thread.start()
        node = Node(root, kubelet, pods, sysfs, manager, thread)
        started.append(node)
        kubelet.wait_registered(H100)
        return node

    yield start
    for node in started:
        node.manager.stop()
        node.thread.join(5)
        node.pods.stop()
        node.kubelet.stop()


def eventually(condition: Callable[[], bool], timeout: float = 10.0) -> None:
    """Poll `condition` (for state the kubelet stand-in is not told about)."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"condition not met within {timeout} s"
        time.sleep(0.02)


def reset_at_start_and_offered(node: Node) -> None:
    """GPU reset at start and offered again: by the plugin, and as the kubelet last heard."""
    eventually(
        lambda: (
            node.sysfs.count(GPU) == 1
            and node.manager.tree.resources[H100].devices[GPU].healthy
            and node.health().get(GPU) == "Healthy"
        )
    )


def test_devices_are_reset_once_at_start_then_offered(start_node: Callable[..., Node]) -> None:
    node = start_node()
    node.kubelet.wait_for(
        lambda: set(node.health().values()) == {"Healthy"} and len(node.sysfs.resets) == 8
    )
    assert {b for _, b in node.sysfs.resets} == set(node.health())


def test_a_released_device_is_unhealthy_until_reset(start_node: Callable[..., Node]) -> None:
    node = start_node()
    reset_at_start_and_offered(node)
    node.kubelet.allocate(H100, [GPU])
    node.pods.assign("virt-launcher-vm-a", H100, [GPU])
    node.pods.wait_listed(node.pods.list_calls)
    node.pods.wait_listed(node.pods.list_calls)
    assert node.sysfs.count(GPU) == 1  # held by a pod: left alone
    released = time.monotonic()
    node.sysfs.gate.clear()
    node.pods.remove("virt-launcher-vm-a")
    node.wait_health(GPU, "Unhealthy")
    assert node.manager.tree.resources[H100].devices[GPU].reason == "resetting after use"
    node.sysfs.gate.set()
    node.kubelet.wait_for(lambda: node.sysfs.count(GPU) == 2)
    node.wait_health(GPU, "Healthy")
    assert node.ever(GPU, "Unhealthy", after=released)
    # Offered again only after the reset: no Healthy snapshot between release and reset.
    registration = node.kubelet.latest(H100)
    assert registration is not None
    reset_at = node.sysfs.last(GPU)
    unhealthy_at = min(
        t for t, s in registration.snapshots if t >= released and s.get(GPU) == "Unhealthy"
    )
    assert not any(
        unhealthy_at <= t < reset_at and s.get(GPU) == "Healthy" for t, s in registration.snapshots
    )
    assert node.sysfs.count(OTHER) == 1


def test_allocate_triggers_an_early_list(start_node: Callable[..., Node]) -> None:
    node = start_node(poll=30.0)
    node.kubelet.wait_for(
        lambda: len(node.sysfs.resets) == 8 and set(node.health().values()) == {"Healthy"}
    )
    calls = node.pods.list_calls
    node.pods.assign("virt-launcher-vm-a", H100, [GPU])
    node.kubelet.allocate(H100, [GPU])
    node.pods.wait_listed(calls, timeout=2)


def test_a_device_still_open_waits_for_its_holder(start_node: Callable[..., Node]) -> None:
    node = start_node()
    reset_at_start_and_offered(node)
    node.kubelet.allocate(H100, [GPU])
    node.pods.assign("vm-a", H100, [GPU])
    node.pods.wait_listed(node.pods.list_calls)
    qemu = node.root / "proc/4242"
    (qemu / "fd").mkdir(parents=True)
    (qemu / "comm").write_text("qemu-kvm\n")
    (qemu / "fd/7").symlink_to("/dev/vfio/devices/vfio0")
    node.pods.remove("vm-a")
    node.wait_health(GPU, "Unhealthy")
    for _ in range(3):
        node.pods.wait_listed(node.pods.list_calls)
    assert node.sysfs.count(GPU) == 1
    assert node.health()[GPU] == "Unhealthy"
    shutil.rmtree(qemu)
    node.kubelet.wait_for(lambda: node.sysfs.count(GPU) == 2)
    node.wait_health(GPU, "Healthy")


def test_a_device_without_reset_method_stays_usable_with_a_warning(
    start_node: Callable[..., Node], caplog: pytest.LogCaptureFixture
) -> None:
    def no_reset(root: Path) -> None:
        device = root / "sys/bus/pci/devices" / GPU
        (device / "reset").unlink()
        (device / "reset_method").unlink()

    caplog.set_level(logging.INFO, logger="deviceplugin")
    node = start_node(prepare=no_reset)
    node.kubelet.wait_for(
        lambda: len(node.sysfs.resets) == 7 and set(node.health().values()) == {"Healthy"}
    )
    assert node.sysfs.count(GPU) == 0
    assert any(
        "device has no reset method; offering it again without a reset" in r.getMessage()
        and GPU in r.getMessage()
        for r in caplog.records
    )


def test_a_failed_reset_keeps_the_device_unhealthy(start_node: Callable[..., Node]) -> None:
    node = start_node()
    reset_at_start_and_offered(node)
    node.kubelet.allocate(H100, [GPU])
    node.pods.assign("vm-a", H100, [GPU])
    node.pods.wait_listed(node.pods.list_calls)
    node.sysfs.failing.add(GPU)
    node.pods.remove("vm-a")
    node.kubelet.wait_for(
        lambda: node.manager.tree.resources[H100].devices[GPU].reason.startswith("reset failed")
    )
    assert node.health()[GPU] == "Unhealthy"
    assert "Input/output error" in node.manager.tree.resources[H100].devices[GPU].reason


def test_without_pod_resources_devices_are_offered_and_the_log_says_why(
    start_node: Callable[..., Node], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="deviceplugin")
    node = start_node(pods_serving=False)
    node.kubelet.wait_for(
        lambda: any("cannot learn device assignments" in r.getMessage() for r in caplog.records)
    )
    assert set(node.health().values()) == {"Healthy"}
    assert node.sysfs.resets == []
    warnings = [r for r in caplog.records if "cannot learn device assignments" in r.getMessage()]
    time.sleep(0.5)
    assert len(
        [r for r in caplog.records if "cannot learn device assignments" in r.getMessage()]
    ) == len(warnings)


def test_each_reset_holds_the_binding_lock(start_node: Callable[..., Node]) -> None:
    node = start_node()
    node.kubelet.wait_for(lambda: len(node.sysfs.resets) == 8)
    assert [(h.pid, h.doing) if h else None for h in node.sysfs.lock_holders] == [
        (os.getpid(), f"reset {bdf} after use") for _, bdf in node.sysfs.resets
    ]


def test_a_reset_waits_for_a_binding_in_progress(start_node: Callable[..., Node]) -> None:
    node = start_node()
    reset_at_start_and_offered(node)
    node.kubelet.allocate(H100, [GPU])
    node.pods.assign("vm-a", H100, [GPU])
    node.pods.wait_listed(node.pods.list_calls)
    with hold_binding_lock(node.root, 10, who="bind 0000:18:00.0"):
        node.pods.remove("vm-a")
        node.wait_health(GPU, "Unhealthy")
        time.sleep(0.5)
        assert node.sysfs.count(GPU) == 1
    node.kubelet.wait_for(lambda: node.sysfs.count(GPU) == 2)
    node.wait_health(GPU, "Healthy")


def test_a_reset_that_cannot_get_the_lock_is_retried_naming_the_holder(
    start_node: Callable[..., Node],
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(resetter, "LOCK_WAIT_SECONDS", 0.1)
    caplog.set_level(logging.INFO, logger="deviceplugin")
    node = start_node()
    reset_at_start_and_offered(node)
    node.kubelet.allocate(H100, [GPU])
    node.pods.assign("vm-a", H100, [GPU])
    node.pods.wait_listed(node.pods.list_calls)
    with hold_binding_lock(node.root, 10, who="unbind 0000:18:00.0"):
        node.pods.remove("vm-a")
        eventually(
            lambda: any(
                "device still in use; reset retried" in r.getMessage()
                and "another binding run holds" in r.getMessage()
                and f"pid {os.getpid()}" in r.getMessage()
                and "unbind 0000:18:00.0" in r.getMessage()
                for r in caplog.records
            )
        )
        node.wait_health(GPU, "Unhealthy")
        assert node.sysfs.count(GPU) == 1
    node.kubelet.wait_for(lambda: node.sysfs.count(GPU) == 2)
    node.wait_health(GPU, "Healthy")
