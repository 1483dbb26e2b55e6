"""The health streams (KEP-4680) over real gRPC on the driver's DRA socket: every version, the
list at once and every later one, many watchers, a stalled or gone watcher costing update()
nothing, the stream cap that keeps NodePrepare answering, messages cut the kubelet's way; and
against the kubelet stand-in: it watches the newest version and survives its own restart."""

from __future__ import annotations

import time
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
import kubernetes.client
import pytest

from dra.api import ResourceApi
from dra.driver import DraDriver
from dra.health import DeviceHealth, Health
from dra.health_stream import MAX_WATCHERS, HealthStreams, build_message
from dra.healthapi.v1 import api_pb2 as h1_pb2
from dra.healthapi.v1 import api_pb2_grpc as h1_grpc
from dra.healthapi.v1alpha1 import api_pb2 as h1a_pb2
from dra.healthapi.v1alpha1 import api_pb2_grpc as h1a_grpc
from dra.healthapi.v1beta1 import api_pb2 as h1b_pb2
from dra.healthapi.v1beta1 import api_pb2_grpc as h1b_grpc
from dra.kubelet_sockets import KubeletSockets, dra_socket_path
from dra.servicer import DraServicerV1, DraServicerV1beta1
from dra.v1 import api_pb2 as v1_pb2
from dra.v1 import api_pb2_grpc as v1_grpc
from dra_kit import DRIVER, NODE, REF, Node, driver_settings, short_directory
from hostdev.config import default_config
from hostdev.pciids import PciIds
from sim.apiserver import ApiServerStandIn
from sim.dra_kubelet import Claim, DRAKubeletStandIn

VERSIONS = {
    "v1": (h1_pb2, h1_grpc),
    "v1beta1": (h1b_pb2, h1b_grpc),
    "v1alpha1": (h1a_pb2, h1a_grpc),
}
GPU = "pci-0000-18-00-0"
OTHER_GPU = "pci-0000-2a-00-0"
NOW = 1_780_000_000.0


def healthy(device: str = GPU) -> DeviceHealth:
    return DeviceHealth(device, Health.HEALTHY, "", NOW)


def unhealthy(device: str = GPU, message: str = "VFIO device node gone") -> DeviceHealth:
    return DeviceHealth(device, Health.UNHEALTHY, message, NOW + 1.7)


@pytest.fixture
def node(scenario_root: Any, tmp_path: Path) -> Node:
    return Node(scenario_root("hgx-h100"), tmp_path)


@pytest.fixture
def kubelet_dir() -> Iterator[Path]:
    with short_directory() as path:
        yield path / "kubelet"


@pytest.fixture
def health() -> HealthStreams:
    return HealthStreams(NODE, timeout_seconds=30)


@pytest.fixture
def sockets(node: Node, kubelet_dir: Path, health: HealthStreams) -> Iterator[KubeletSockets]:
    served = KubeletSockets(
        kubelet_dir, DRIVER, DraServicerV1(node.preparer), DraServicerV1beta1(node.preparer), health
    )
    served.start()
    yield served
    health.close()
    served.stop()


@pytest.fixture
def channel(sockets: KubeletSockets, kubelet_dir: Path) -> Iterator[grpc.Channel]:
    with grpc.insecure_channel(f"unix:{dra_socket_path(kubelet_dir, DRIVER)}") as opened:
        yield opened


def watch(channel: grpc.Channel, version: str = "v1") -> Any:
    messages, stubs = VERSIONS[version]
    return stubs.DRAResourceHealthStub(channel).NodeWatchResources(
        messages.NodeWatchResourcesRequest(), timeout=10
    )


def names(response: Any) -> dict[str, tuple[int, str]]:
    return {d.device.device_name: (d.health, d.message) for d in response.devices}


def wait_watchers(health: HealthStreams, count: int) -> None:
    deadline = time.monotonic() + 5
    while health.watchers != count:
        assert time.monotonic() < deadline, f"{health.watchers} watchers, expected {count}"
        time.sleep(0.005)


# --- the pure parts ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("message", "expected"),
    [
        ("", ""),
        ("x" * 1024, "x" * 1024),
        ("x" * 1025, "x" * 1021 + "..."),
        ("é" * 600, "é" * 510 + "..."),  # 1200 bytes: cut to 1021 bytes, never inside a character
        ("bad \udcff name", "bad \\udcff name"),
    ],
    ids=["empty", "at-limit", "one-over", "multibyte", "surrogate"],
)
def test_messages_are_cut_the_kubelets_way(message: str, expected: str) -> None:
    assert build_message(message) == expected
    assert len(expected.encode()) <= 1024


def test_update_before_any_watcher_is_kept_and_a_closed_pool_ends_new_watches() -> None:
    streams = HealthStreams(NODE, timeout_seconds=30)
    assert streams.latest is None
    streams.update([healthy()])
    watch_ = streams.open()
    assert watch_.next() == (healthy(),)
    streams.update([unhealthy()])
    streams.update([healthy(), healthy(OTHER_GPU)])
    # Only the newest list waits in the slot.
    assert watch_.next() == (healthy(), healthy(OTHER_GPU))
    streams.close()
    assert watch_.next() is None
    assert streams.open().next() is None
    assert streams.watchers == 0


# --- over gRPC --------------------------------------------------------------------------------


@pytest.mark.parametrize("version", list(VERSIONS))
def test_every_version_sends_the_full_list_at_once_then_each_change(
    channel: grpc.Channel, health: HealthStreams, version: str
) -> None:
    health.update([healthy(), healthy(OTHER_GPU)])
    stream = watch(channel, version)
    first = next(stream)
    messages = VERSIONS[version][0]
    assert [
        (d.device.pool_name, d.device.device_name, d.health, d.last_updated_time)
        for d in first.devices
    ] == [(NODE, GPU, messages.HEALTHY, int(NOW)), (NODE, OTHER_GPU, messages.HEALTHY, int(NOW))]
    assert {d.health_check_timeout_seconds for d in first.devices} == {30}
    health.update([unhealthy(), healthy(OTHER_GPU)])
    second = next(stream)
    assert names(second) == {
        GPU: (messages.UNHEALTHY, "VFIO device node gone"),
        OTHER_GPU: (messages.HEALTHY, ""),
    }
    assert second.devices[0].last_updated_time == int(NOW + 1.7)
    stream.cancel()


def test_a_long_message_arrives_cut(channel: grpc.Channel, health: HealthStreams) -> None:
    health.update([unhealthy(message="lost its driver; " * 100)])
    (device,) = next(watch(channel)).devices
    assert len(device.message) == 1024 and device.message.endswith("...")


def test_a_watcher_that_opens_before_any_judgement_waits_for_the_first_list(
    channel: grpc.Channel, health: HealthStreams
) -> None:
    stream = watch(channel)
    wait_watchers(health, 1)
    health.update([healthy()])
    assert names(next(stream)) == {GPU: (h1_pb2.HEALTHY, "")}
    stream.cancel()


def test_every_watcher_gets_every_list_in_the_end(
    channel: grpc.Channel, health: HealthStreams
) -> None:
    health.update([healthy()])
    streams = [watch(channel, version) for version in ("v1", "v1beta1", "v1alpha1", "v1")]
    assert all(names(next(s)) == {GPU: (1, "")} for s in streams)
    for step in range(20):
        health.update([DeviceHealth(GPU, Health(1 + step % 2), f"step {step}", NOW + step)])
    # Intermediate lists may be skipped; the last one always arrives, and never out of order.
    for stream in streams:
        steps: list[int] = []
        while not steps or steps[-1] != 19:
            steps.append(int(next(stream).devices[0].message.split()[1]))
        assert steps == sorted(steps)
        stream.cancel()


def test_a_cancelled_stream_frees_its_slot(channel: grpc.Channel, health: HealthStreams) -> None:
    health.update([healthy()])
    streams = [watch(channel) for _ in range(MAX_WATCHERS)]
    for stream in streams:
        next(stream)
    assert health.watchers == MAX_WATCHERS
    streams[0].cancel()
    wait_watchers(health, MAX_WATCHERS - 1)
    replacement = watch(channel)
    assert names(next(replacement)) == {GPU: (1, "")}
    for stream in [*streams[1:], replacement]:
        stream.cancel()
    wait_watchers(health, 0)


def test_a_gone_client_frees_its_slot(
    sockets: KubeletSockets, kubelet_dir: Path, health: HealthStreams
) -> None:
    health.update([healthy()])
    client = grpc.insecure_channel(f"unix:{dra_socket_path(kubelet_dir, DRIVER)}")
    next(watch(client))
    assert health.watchers == 1
    client.close()  # the connection goes, as when the kubelet dies
    wait_watchers(health, 0)


def test_one_too_many_streams_is_refused_and_prepare_still_answers(
    node: Node, channel: grpc.Channel, health: HealthStreams
) -> None:
    node.claims.add(REF, [("gpu", GPU)])
    health.update([healthy()])
    streams = [watch(channel) for _ in range(MAX_WATCHERS)]
    for stream in streams:
        next(stream)
    with pytest.raises(grpc.RpcError) as refused:
        next(watch(channel))
    assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "health streams are open already" in str(refused.value.details())
    # Every open stream holds a worker: the rest still serve prepare, several at once.
    stub = v1_grpc.DRAPluginStub(channel)
    request = v1_pb2.NodePrepareResourcesRequest(
        claims=[v1_pb2.Claim(namespace=REF.namespace, name=REF.name, uid=REF.uid)]
    )
    with futures.ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(lambda _: stub.NodePrepareResources(request, timeout=5), range(4)))
    assert all(a.claims[REF.uid].error == "" for a in answers)
    health.update([unhealthy()])
    assert all(names(next(s))[GPU][0] == h1_pb2.UNHEALTHY for s in streams)
    for stream in streams:
        stream.cancel()


def test_a_stalled_watcher_never_slows_update(
    sockets: KubeletSockets, kubelet_dir: Path, health: HealthStreams
) -> None:
    # Big lists, never read: the stalled client's flow-control window fills within a few.
    many = [
        DeviceHealth(f"pci-0000-{i:02x}-00-0", Health.UNHEALTHY, "x" * 1000, NOW) for i in range(64)
    ]
    health.update(many)
    stalled = grpc.insecure_channel(f"unix:{dra_socket_path(kubelet_dir, DRIVER)}")
    call = watch(stalled)  # opened, never read
    wait_watchers(health, 1)
    took = []
    for _ in range(500):
        start = time.perf_counter()
        health.update(many)
        took.append(time.perf_counter() - start)
    took.sort()
    # An update that waited for the stalled client would never return; the slowest one here is
    # whatever the scheduler of a busy machine adds (the GIL changes hands every 5 ms).
    assert took[len(took) // 2] < 0.0005, f"median update() {took[len(took) // 2] * 1e6:.0f} µs"
    assert took[-1] < 0.25, f"slowest update() {took[-1] * 1e3:.0f} ms"
    call.cancel()
    stalled.close()
    wait_watchers(health, 0)


def test_close_ends_every_stream_cleanly(channel: grpc.Channel, health: HealthStreams) -> None:
    health.update([healthy()])
    streams = [watch(channel) for _ in range(2)]
    for stream in streams:
        next(stream)
    health.close()
    for stream in streams:
        assert list(stream) == []  # the stream ended, with no error
        assert stream.code() == grpc.StatusCode.OK
    assert health.watchers == 0


# --- against the kubelet stand-in ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("spoken", "watched"),
    [
        (None, "v1.DRAResourceHealth"),
        (("v1alpha1.DRAResourceHealth",), "v1alpha1.DRAResourceHealth"),
        (("v1beta1.DRAResourceHealth", "v1alpha1.DRAResourceHealth"), "v1beta1.DRAResourceHealth"),
    ],
    ids=["newest", "kubelet-1.34", "no-v1"],
)
def test_the_kubelet_watches_the_newest_version_it_speaks(
    sockets: KubeletSockets,
    kubelet_dir: Path,
    health: HealthStreams,
    spoken: tuple[str, ...] | None,
    watched: str,
) -> None:
    options: dict[str, Any] = {} if spoken is None else {"health_services": spoken}
    health.update([healthy(), unhealthy(OTHER_GPU)])
    with DRAKubeletStandIn(kubelet_dir, **options) as kubelet:
        registration = kubelet.wait_registered(DRIVER)
        assert registration.service == "v1.DRAPlugin"
        assert registration.health_service == watched
        seen = kubelet.wait_health(DRIVER, lambda h: len(h) == 2)
        assert {k: (s.health, s.message, s.timeout) for k, s in seen.items()} == {
            f"{NODE}/{GPU}": ("Healthy", "", 30.0),
            f"{NODE}/{OTHER_GPU}": ("Unhealthy", "VFIO device node gone", 30.0),
        }
        health.update([unhealthy(), healthy(OTHER_GPU)])
        kubelet.wait_health(
            DRIVER,
            lambda h: (
                h[f"{NODE}/{GPU}"].health == "Unhealthy"
                and h[f"{NODE}/{OTHER_GPU}"].health == "Healthy"
            ),
        )


def test_a_kubelet_restart_mid_stream_reconnects_and_gets_the_full_list(
    sockets: KubeletSockets, kubelet_dir: Path, health: HealthStreams, node: Node
) -> None:
    health.update([healthy(), healthy(OTHER_GPU)])
    with DRAKubeletStandIn(kubelet_dir, health_retry=0.05) as kubelet:
        kubelet.wait_registered(DRIVER)
        kubelet.wait_health(DRIVER, lambda h: len(h) == 2)
        assert health.watchers == 1
        kubelet.restart()
        # Changed while the kubelet was away: the new stream's first list says so.
        health.update([unhealthy(), healthy(OTHER_GPU)])
        kubelet.wait_registered(DRIVER, count=2)
        seen = kubelet.wait_health(DRIVER, lambda h: h[f"{NODE}/{GPU}"].health == "Unhealthy")
        assert seen[f"{NODE}/{OTHER_GPU}"].health == "Healthy"
        # The old stream's slot is free again: one stream, not two.
        wait_watchers(health, 1)
        node.claims.add(REF, [("gpu", GPU)])
        answer = kubelet.node_prepare_resources([Claim(REF.namespace, REF.uid, REF.name)])
        assert answer[REF.uid].error == ""
    wait_watchers(health, 0)


def test_a_stream_cut_off_is_opened_again_while_registered(
    sockets: KubeletSockets, kubelet_dir: Path, health: HealthStreams
) -> None:
    health.update([healthy()])
    with DRAKubeletStandIn(kubelet_dir, health_retry=0.05) as kubelet:
        kubelet.wait_registered(DRIVER)
        kubelet.wait_health(DRIVER, lambda h: len(h) == 1)
        # The DRA socket wiped: the driver serves it anew, which cuts the open stream off; the
        # registration socket stays, so the kubelet keeps the registration and dials again.
        dra_socket_path(kubelet_dir, DRIVER).unlink()
        kubelet.wait_for(
            lambda: [e for _, e, _ in kubelet.health_events].count("opened") >= 2,
            5,
            "health stream not opened again",
        )
        wait_watchers(health, 1)
        health.update([unhealthy()])
        kubelet.wait_health(DRIVER, lambda h: h[f"{NODE}/{GPU}"].health == "Unhealthy")


# --- the driver ---------------------------------------------------------------------------------


@pytest.mark.parametrize(("rescan", "timeout"), [(0.2, 30), (5.0, 30), (10.0, 30), (10.5, 32)])
def test_the_timeout_follows_the_rescan_interval(
    scenario_root: Any,
    api_client: kubernetes.client.ApiClient,
    rescan: float,
    timeout: int,
    tmp_path: Path,
) -> None:
    settings = driver_settings(scenario_root("hgx-h100"), tmp_path, rescan)
    driver = DraDriver(settings, default_config(), PciIds(None), ResourceApi(api_client))
    assert driver.health.timeout_seconds == timeout
    assert driver.health.pool == NODE


def test_the_driver_serves_health_and_ends_the_streams_at_stop(
    scenario_root: Any, apiserver: ApiServerStandIn, api_client: kubernetes.client.ApiClient
) -> None:
    apiserver.put_node(NODE)
    with short_directory() as base:
        settings = driver_settings(scenario_root("hgx-h100"), base, 0.2)
        driver = DraDriver(settings, default_config(), PciIds(None), ResourceApi(api_client))
        driver.start()
        with DRAKubeletStandIn(base / "kubelet", info_poll_interval=None) as kubelet:
            try:
                assert kubelet.wait_registered(DRIVER).health_service == "v1.DRAResourceHealth"
                # The driver's own judgement of the host, not a list the test hands in.
                names = {f"{NODE}/{d.name}" for d in driver.devices}
                seen = kubelet.wait_health(DRIVER, lambda h: names <= set(h))
                assert names and {seen[n].health for n in names} == {"Healthy"}
            finally:
                driver.stop()
            kubelet.wait_for(
                lambda: [e for _, e, _ in kubelet.health_events][:2] == ["opened", "ended"],
                5,
                "the stream did not end cleanly at driver stop",
            )
