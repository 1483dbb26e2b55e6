"""The device plugin against the kubelet stand-in, over real gRPC on unix sockets."""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import grpc
import pytest

import deviceplugin.manager as manager_module
from deviceplugin.identities import read_identities
from deviceplugin.registration import socket_name
from dp_kit import GPUS, H100, IOMMUFD, Plugin
from hostdev.bdf import Bdf
from hostdev.config import (
    DeviceMode,
    PluginConfig,
    ResourceConfig,
    Selectors,
    default_config,
)
from hostdev.model import PciFunction
from sim.host import bind_driver, unbind_driver


def test_registers_both_resources_with_topology(start_plugin: Callable[..., Plugin]) -> None:
    plugin = start_plugin()
    h100 = plugin.kubelet.wait_registered(H100)
    assert h100.request.endpoint == "kubevirt-iommufd-nvidia.com_GH100H100_SXM5_80GB.sock"
    assert h100.request.version == "v1beta1"
    assert h100.options.get_preferred_allocation_available
    assert not h100.options.pre_start_required
    assert h100.request.options == h100.options
    assert plugin.kubelet.health(H100) == dict.fromkeys(GPUS, "Healthy")
    # Registered before the devices were judged, yet the first list already tells them all.
    assert h100.snapshots[0][1] == dict.fromkeys(GPUS, "Healthy")
    assert h100.topology == {gpu: [0] if i < 4 else [1] for i, gpu in enumerate(GPUS)}
    iommufd = plugin.kubelet.wait_registered(IOMMUFD)
    assert len(iommufd.snapshots[-1][1]) == 110
    assert set(plugin.kubelet.health(IOMMUFD).values()) == {"Healthy"}


def test_allocate_hands_out_cdevs_group_nodes_and_env(start_plugin: Callable[..., Plugin]) -> None:
    plugin = start_plugin()
    plugin.kubelet.wait_registered(H100)
    response = plugin.kubelet.allocate(H100, ["0000:9a:00.0", "0000:18:00.0"], ["0000:2a:00.0"])
    first, second = response.container_responses
    assert [(d.host_path, d.container_path, d.permissions) for d in first.devices] == [
        ("/dev/vfio/devices/vfio4", "/dev/vfio/devices/vfio4", "mrw"),
        ("/dev/iommu", "/dev/iommu", "mrw"),
        ("/dev/vfio/vfio", "/dev/vfio/vfio", "mrw"),
        ("/dev/vfio/25", "/dev/vfio/25", "mrw"),
        ("/dev/vfio/devices/vfio0", "/dev/vfio/devices/vfio0", "mrw"),
        ("/dev/vfio/13", "/dev/vfio/13", "mrw"),
    ]
    assert dict(first.envs) == {
        "PCI_RESOURCE_NVIDIA_COM_GH100H100_SXM5_80GB": "0000:9a:00.0,0000:18:00.0"
    }
    assert dict(second.envs) == {"PCI_RESOURCE_NVIDIA_COM_GH100H100_SXM5_80GB": "0000:2a:00.0"}


@pytest.mark.parametrize(
    ("ids", "message"),
    [
        (["0000:01:00.0"], "unknown device '0000:01:00.0'"),
        ([], "the request names no device"),
    ],
)
def test_allocate_refusals_are_grpc_errors(
    start_plugin: Callable[..., Plugin], ids: list[str], message: str
) -> None:
    plugin = start_plugin()
    plugin.kubelet.wait_registered(H100)
    with pytest.raises(grpc.RpcError) as caught:
        plugin.kubelet.allocate(H100, ids)
    assert caught.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert message in str(caught.value.details())


def test_preferred_allocation_over_grpc(start_plugin: Callable[..., Plugin]) -> None:
    plugin = start_plugin()
    plugin.kubelet.wait_registered(H100)
    assert plugin.kubelet.preferred(H100, GPUS, ["0000:ab:00.0"], 2) == [
        "0000:ab:00.0",
        "0000:9a:00.0",
    ]
    with pytest.raises(grpc.RpcError):
        plugin.kubelet.preferred(H100, GPUS, GPUS[:3], 2)


def test_unbind_turns_unhealthy_and_rebind_healthy(start_plugin: Callable[..., Plugin]) -> None:
    plugin = start_plugin()
    kubelet = plugin.kubelet
    kubelet.wait_registered(H100)
    unbind_driver(plugin.root, "0000:3a:00.0")
    kubelet.wait_for(lambda: kubelet.health(H100).get("0000:3a:00.0") == "Unhealthy", 2)
    assert sum(h == "Healthy" for h in kubelet.health(H100).values()) == 7
    with pytest.raises(grpc.RpcError) as caught:
        kubelet.allocate(H100, ["0000:3a:00.0"])
    assert "is unhealthy: bound to no driver" in str(caught.value.details())
    bind_driver(plugin.root, "0000:3a:00.0", "vfio-pci")
    kubelet.wait_for(lambda: kubelet.health(H100).get("0000:3a:00.0") == "Healthy", 2)
    response = kubelet.allocate(H100, ["0000:3a:00.0"])
    assert "/dev/vfio/devices/vfio2" in [
        d.host_path for d in response.container_responses[0].devices
    ]


def test_cdev_node_removed_and_restored_in_iommufd_mode(
    start_plugin: Callable[..., Plugin],
) -> None:
    plugin = start_plugin(config=replace(default_config(), device_mode=DeviceMode.IOMMUFD))
    kubelet = plugin.kubelet
    kubelet.wait_registered(H100)
    node = plugin.root / "dev/vfio/devices/vfio5"
    node.unlink()
    kubelet.wait_for(lambda: kubelet.health(H100).get("0000:ab:00.0") == "Unhealthy", 2)
    node.touch()
    kubelet.wait_for(lambda: kubelet.health(H100).get("0000:ab:00.0") == "Healthy", 2)


def test_dev_iommu_removed_and_restored(start_plugin: Callable[..., Plugin]) -> None:
    plugin = start_plugin()
    kubelet = plugin.kubelet
    kubelet.wait_registered(IOMMUFD)
    kubelet.wait_registered(H100)
    node = plugin.root / "dev/iommu"
    node.unlink()
    kubelet.wait_for(lambda: set(kubelet.health(IOMMUFD).values()) == {"Unhealthy"}, 2)
    # Legacy VFIO still works, so the GPUs stay usable in the default mode.
    assert set(kubelet.health(H100).values()) == {"Healthy"}
    node.touch()
    kubelet.wait_for(lambda: set(kubelet.health(IOMMUFD).values()) == {"Healthy"}, 2)


def test_kubelet_restart_means_reregistration(start_plugin: Callable[..., Plugin]) -> None:
    plugin = start_plugin()
    kubelet = plugin.kubelet
    kubelet.wait_registered(H100)
    kubelet.wait_registered(IOMMUFD)
    kubelet.restart()
    again = kubelet.wait_registered(H100, count=2, timeout=2)
    kubelet.wait_registered(IOMMUFD, count=2, timeout=2)
    assert kubelet.health(H100) == dict.fromkeys(GPUS, "Healthy")
    assert again.request.endpoint == "kubevirt-iommufd-nvidia.com_GH100H100_SXM5_80GB.sock"
    assert kubelet.allocate(H100, ["0000:18:00.0"]).container_responses


def test_resource_only_the_first_look_saw_is_withdrawn(
    start_plugin: Callable[..., Plugin], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A function bound or removed between the first look and the scan: the scan decides."""

    def with_ghost(root: Path) -> tuple[PciFunction, ...]:
        found = read_identities(root)
        gpu = next(f for f in found if str(f.bdf) == GPUS[0])
        return (*found, replace(gpu, bdf=Bdf.parse("0000:fe:00.0"), device_id=0x2331))

    monkeypatch.setattr(manager_module, "read_identities", with_ghost)
    plugin = start_plugin()
    kubelet = plugin.kubelet
    kubelet.wait_registered(H100)
    kubelet.wait_registered(IOMMUFD)
    assert list(plugin.manager.tree.resources) == [H100]
    assert not (kubelet.directory / "kubevirt-iommufd-nvidia.com_2331.sock").exists()
    ghosts = [r for r in kubelet.registrations if r.request.resource_name == "nvidia.com/2331"]
    kubelet.wait_for(lambda: all(r.stream_ended for r in ghosts), 2)
    assert all(r.snapshots == [] for r in ghosts)


def test_resource_the_first_look_missed_registers_after_the_scan(
    start_plugin: Callable[..., Plugin], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(manager_module, "read_identities", lambda root: ())
    plugin = start_plugin()
    assert plugin.kubelet.wait_registered(H100).snapshots[0][1] == dict.fromkeys(GPUS, "Healthy")
    plugin.kubelet.wait_registered(IOMMUFD)


def test_a_socket_removed_before_the_watch_began_is_served_again(
    start_plugin: Callable[..., Plugin], short_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The watch starts once the resources are served and registering: a socket the kubelet
    removed in between is noticed all the same."""
    path = short_dir / "kubelet" / socket_name(IOMMUFD)
    removed_at: list[float] = []

    def removing_first(root: Path) -> tuple[PciFunction, ...]:
        # Runs after the iommufd resource is served and its registration sent, before the
        # watch starts; the stand-in has it registered within milliseconds.
        time.sleep(1)
        path.unlink()
        removed_at.append(time.monotonic())
        return read_identities(root)

    monkeypatch.setattr(manager_module, "read_identities", removing_first)
    kubelet = start_plugin().kubelet
    kubelet.wait_registered(H100)

    def served_again() -> bool:
        return path.exists() and any(
            r.request.resource_name == IOMMUFD and r.at > removed_at[0] and r.snapshots
            for r in kubelet.registrations
        )

    kubelet.wait_for(served_again, 5)


def test_plugin_started_before_its_kubelet(start_plugin: Callable[..., Plugin]) -> None:
    plugin = start_plugin(kubelet_first=False)
    assert plugin.manager.ready.wait(2)
    plugin.kubelet.start()
    plugin.kubelet.wait_registered(H100, timeout=2)
    plugin.kubelet.wait_registered(IOMMUFD, timeout=2)


def test_legacy_only_host(start_plugin: Callable[..., Plugin]) -> None:
    plugin = start_plugin("legacy-only")
    kubelet = plugin.kubelet
    kubelet.wait_registered(H100)
    kubelet.wait_registered(IOMMUFD)
    assert set(kubelet.health(IOMMUFD).values()) == {"Unhealthy"}
    response = kubelet.allocate(H100, ["0000:18:00.0"])
    assert [d.host_path for d in response.container_responses[0].devices] == [
        "/dev/vfio/vfio",
        "/dev/vfio/13",
    ]
    with pytest.raises(grpc.RpcError) as caught:
        kubelet.allocate(IOMMUFD, ["iommufd-000"])
    assert caught.value.code() is grpc.StatusCode.FAILED_PRECONDITION


def test_iommufd_allocation_hands_over_an_fd(start_plugin: Callable[..., Plugin]) -> None:
    plugin = start_plugin()
    kubelet = plugin.kubelet
    kubelet.wait_registered(IOMMUFD)
    response = kubelet.allocate(IOMMUFD, ["iommufd-007"])
    (container,) = response.container_responses
    assert [(d.host_path, d.container_path, d.permissions) for d in container.devices] == [
        ("/dev/iommu", "/dev/iommu", "mrw")
    ]
    (mount,) = container.mounts
    assert mount.container_path == "/var/run/kubevirt/iommufd.sock"
    assert not mount.read_only
    host_socket = Path(mount.host_path)
    assert host_socket.is_socket()
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as client:
        client.connect(str(host_socket))
        payload, fds, _, _ = socket.recv_fds(client, 1, 1)
        assert len(payload) == 1 and len(fds) == 1
        try:
            received = Path(f"/proc/self/fd/{fds[0]}").stat()
            assert received.st_ino == (plugin.root / "dev/iommu").stat().st_ino
        finally:
            for fd in fds:
                os.close(fd)
        client.sendall(b"\x00")
    deadline = time.monotonic() + 2
    while plugin.handoff.stats().served != 1:
        assert time.monotonic() < deadline, "the hand-off never counted as served"
        time.sleep(0.01)
    assert not host_socket.exists()


def test_metrics_count_devices_and_allocations(start_plugin: Callable[..., Plugin]) -> None:
    from prometheus_client import generate_latest

    plugin = start_plugin("vga-audio")
    plugin.kubelet.wait_registered(IOMMUFD)
    plugin.kubelet.allocate(IOMMUFD, ["iommufd-000"])
    text = generate_latest(plugin.metrics.registry).decode()
    assert 'kubevirt_iommufd_devices{health="Unhealthy",resource="nvidia.com/2204"} 1.0' in text
    assert (
        'kubevirt_iommufd_allocations_total{resource="devices.kubevirt.io/iommufd",result="ok"} 1.0'
        in text
    )
    assert (
        'kubevirt_iommufd_registrations_total{resource="nvidia.com/2204",result="ok"} 1.0' in text
    )
    assert "kubevirt_iommufd_handoffs_pending 1.0" in text


def test_stop_removes_every_socket(start_plugin: Callable[..., Plugin]) -> None:
    plugin = start_plugin()
    plugin.kubelet.wait_registered(H100)
    directory = plugin.kubelet.directory
    assert len(list(directory.glob("kubevirt-iommufd-*.sock"))) == 2
    plugin.stop()
    assert list(directory.glob("kubevirt-iommufd-*.sock")) == []
    assert (directory / "kubelet.sock").exists()


def test_legacy_node_keeps_iommufd_slots_allocatable_when_configured(
    start_plugin: Callable[..., Plugin],
) -> None:
    config = replace(
        default_config(),
        iommufd=replace(default_config().iommufd, without_iommu_legacy=True),
    )
    plugin = start_plugin("legacy-only", config)
    kubelet = plugin.kubelet
    kubelet.wait_registered(IOMMUFD)
    assert set(kubelet.health(IOMMUFD).values()) == {"Healthy"}
    (container,) = kubelet.allocate(IOMMUFD, ["iommufd-000"]).container_responses
    # Nothing handed out: no /dev/iommu in the pod, so the launcher stays on legacy VFIO.
    assert list(container.devices) == [] and list(container.mounts) == []
    assert plugin.handoff.stats().pending == 0
    # Once the node has /dev/iommu, the same slots hand over a prepared fd.
    (plugin.root / "dev/iommu").touch()
    deadline = time.monotonic() + 2
    while True:
        (container,) = kubelet.allocate(IOMMUFD, ["iommufd-001"]).container_responses
        if container.mounts or time.monotonic() > deadline:
            break
        time.sleep(0.02)
    assert [d.host_path for d in container.devices] == ["/dev/iommu"]
    assert container.mounts[0].container_path == "/var/run/kubevirt/iommufd.sock"


def test_kubelet_restarts_leave_no_threads_behind(start_plugin: Callable[..., Plugin]) -> None:
    plugin = start_plugin()
    kubelet = plugin.kubelet
    kubelet.wait_registered(H100)
    kubelet.wait_registered(IOMMUFD)
    kubelet.allocate(H100, ["0000:18:00.0"])
    before = threading.active_count()
    for run in range(2, 7):
        kubelet.restart()
        kubelet.wait_registered(H100, count=run, timeout=5)
        kubelet.wait_registered(IOMMUFD, count=run, timeout=5)
        kubelet.allocate(H100, ["0000:18:00.0"])
    # Each restart replaces both servers; their worker pools must go with them (the stand-in's
    # own stream threads for dead streams end too).
    deadline = time.monotonic() + 3
    while threading.active_count() > before + 4 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert threading.active_count() <= before + 4


def test_allocate_on_a_non_viable_group_is_refused_with_the_reason(
    start_plugin: Callable[..., Plugin],
) -> None:
    plugin = start_plugin("vga-audio")
    resource = "nvidia.com/2204"
    registration = plugin.kubelet.wait_registered(resource)
    assert plugin.kubelet.health(resource) == {"0000:3b:00.0": "Unhealthy"}
    assert registration.topology == {"0000:3b:00.0": [0]}
    with pytest.raises(grpc.RpcError) as caught:
        plugin.kubelet.allocate(resource, ["0000:3b:00.0"])
    assert caught.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert (
        "device 0000:3b:00.0 is unhealthy: group 14 not viable: 0000:3b:00.1 is bound to"
        " snd_hda_intel" in str(caught.value.details())
    )


def test_allocate_sriov_vfs_by_explicit_resource(start_plugin: Callable[..., Plugin]) -> None:
    config = PluginConfig(
        resources=(
            ResourceConfig(
                Selectors(vendors=(0x15B3,), devices=(0x101E,)), resource_name="mellanox.com/vf"
            ),
        )
    )
    plugin = start_plugin("sriov", config)
    plugin.kubelet.wait_registered("mellanox.com/vf")
    assert len(plugin.kubelet.health("mellanox.com/vf")) == 4
    (container,) = plugin.kubelet.allocate(
        "mellanox.com/vf", ["0000:5e:00.3", "0000:5e:00.2"]
    ).container_responses
    assert [d.host_path for d in container.devices] == [
        "/dev/vfio/devices/vfio1",
        "/dev/iommu",
        "/dev/vfio/vfio",
        "/dev/vfio/41",
        "/dev/vfio/devices/vfio0",
        "/dev/vfio/40",
    ]
    assert dict(container.envs) == {"PCI_RESOURCE_MELLANOX_COM_VF": "0000:5e:00.3,0000:5e:00.2"}


def test_iommufd_only_mode_on_a_legacy_host_advertises_unhealthy_devices(
    start_plugin: Callable[..., Plugin],
) -> None:
    plugin = start_plugin("legacy-only", replace(default_config(), device_mode=DeviceMode.IOMMUFD))
    plugin.kubelet.wait_registered(H100)
    assert set(plugin.kubelet.health(H100).values()) == {"Unhealthy"}
    with pytest.raises(grpc.RpcError) as caught:
        plugin.kubelet.allocate(H100, ["0000:18:00.0"])
    assert "no VFIO cdev: the kernel lacks CONFIG_VFIO_DEVICE_CDEV" in str(caught.value.details())
