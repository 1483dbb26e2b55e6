"""The DRA kubelet stand-in's health watching against a scripted plugin over real gRPC: which
version it watches, what its cache says and when a device turns Unknown, when it opens the
stream again and when it stops."""

from __future__ import annotations

import queue
import shutil
import tempfile
import time
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
import pytest

from dra.healthapi.v1 import api_pb2 as h1_pb2
from dra.healthapi.v1 import api_pb2_grpc as h1_grpc
from dra.pluginregistration.v1 import api_pb2 as reg_pb2
from dra.pluginregistration.v1 import api_pb2_grpc as reg_grpc
from sim.dra_kubelet import DRAKubeletStandIn, SeenHealth
from sim.dra_kubelet_records import (
    pick_health_service,
    read_health_response,
    reconcile_health,
)

DRIVER = "gpu.example.com"
ALL_HEALTH = ("v1.DRAResourceHealth", "v1beta1.DRAResourceHealth", "v1alpha1.DRAResourceHealth")
FAST: dict[str, Any] = {"retry_initial": 0.05, "info_poll_interval": None, "health_retry": 0.05}
END = None  # queued: the plugin ends the stream


def response(*devices: tuple[str, int, str, int]) -> h1_pb2.NodeWatchResourcesResponse:
    return h1_pb2.NodeWatchResourcesResponse(
        devices=[
            h1_pb2.DeviceHealth(
                device=h1_pb2.DeviceIdentifier(pool_name="node-a", device_name=name),
                health=health,  # type: ignore[arg-type]
                last_updated_time=1_780_000_000,
                health_check_timeout_seconds=timeout,
                message=message,
            )
            for name, health, message, timeout in devices
        ]
    )


# --- decisions (pure) -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("offered", "spoken", "watched"),
    [
        (("v1.DRAPlugin", *ALL_HEALTH), ALL_HEALTH, "v1.DRAResourceHealth"),
        (
            ("v1.DRAPlugin", "v1alpha1.DRAResourceHealth", "v1.DRAResourceHealth"),
            ALL_HEALTH,
            "v1.DRAResourceHealth",
        ),
        (
            ("v1.DRAPlugin", *ALL_HEALTH),
            ("v1alpha1.DRAResourceHealth",),
            "v1alpha1.DRAResourceHealth",
        ),
        (("v1.DRAPlugin", "v1.DRAResourceHealth"), ("v1alpha1.DRAResourceHealth",), None),
        (("v1.DRAPlugin",), ALL_HEALTH, None),
    ],
    ids=["newest", "order-of-the-kubelet", "kubelet-1.34", "no-common", "none-offered"],
)
def test_the_newest_health_service_both_sides_know_is_watched(
    offered: tuple[str, ...], spoken: tuple[str, ...], watched: str | None
) -> None:
    assert pick_health_service(offered, spoken) == watched


def test_a_response_is_read_as_the_kubelet_reads_it() -> None:
    read = read_health_response(
        response(("a", 1, "", 0), ("b", 2, "y" * 1100, -5), ("c", 7, "", 9)), now=100.0
    )
    assert {k: (s.health, len(s.message), s.timeout) for k, s in read.items()} == {
        "node-a/a": ("Healthy", 0, 30.0),
        "node-a/b": ("Unhealthy", 1024, 30.0),
        "node-a/c": ("Unknown", 0, 9.0),
    }
    assert read["node-a/b"].message.endswith("y...")


def test_a_device_left_out_turns_unknown_only_after_its_timeout() -> None:
    known = read_health_response(response(("a", 1, "", 10), ("b", 2, "gone", 10)), now=100.0)
    later = read_health_response(response(("a", 1, "", 10)), now=105.0)
    kept = reconcile_health(known, later, now=105.0)
    assert kept["node-a/b"].health == "Unhealthy"
    dropped = reconcile_health(kept, later, now=110.5)
    assert dropped["node-a/b"].health == "Unknown"
    assert dropped["node-a/b"].message == "gone"
    assert dropped["node-a/a"].at(115.0).health == "Healthy"
    assert dropped["node-a/a"].at(115.5).health == "Unknown"


# --- against a plugin over gRPC ------------------------------------------------------------------


class _Registration:
    def __init__(self, versions: list[str], endpoint: str) -> None:
        self.versions, self.endpoint = versions, endpoint

    def GetInfo(self, request: Any, context: grpc.ServicerContext) -> reg_pb2.PluginInfo:
        return reg_pb2.PluginInfo(
            type="DRAPlugin",
            name=DRIVER,
            endpoint=self.endpoint,
            supported_versions=self.versions,
        )

    def NotifyRegistrationStatus(self, request: Any, context: grpc.ServicerContext) -> Any:
        return reg_pb2.RegistrationStatusResponse()


class _Health:
    """Sends what the test queues; END ends the stream. Counts the streams and cancellations."""

    def __init__(self) -> None:
        self.script: queue.SimpleQueue[h1_pb2.NodeWatchResourcesResponse | None] = (
            queue.SimpleQueue()
        )
        self.opened = 0
        self.cancelled = 0

    def NodeWatchResources(self, request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
        self.opened += 1
        while context.is_active():
            try:
                item = self.script.get(timeout=0.02)
            except queue.Empty:
                continue
            if item is END:
                return
            yield item
        self.cancelled += 1


class HealthPlugin:
    """A DRA plugin with only registration and, when `serve_health`, DRAResourceHealth v1."""

    def __init__(self, directory: Path, versions: tuple[str, ...], serve_health: bool) -> None:
        self.reg_socket = directory / "plugins_registry" / f"{DRIVER}-reg.sock"
        self.dra_socket = directory / "plugins" / DRIVER / "dra.sock"
        self.health = _Health()
        self._servers: list[grpc.Server] = []
        self.reg_socket.parent.mkdir(parents=True, exist_ok=True)
        self.dra_socket.parent.mkdir(parents=True)
        dra = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        if serve_health:
            h1_grpc.add_DRAResourceHealthServicer_to_server(self.health, dra)
        dra.add_insecure_port(f"unix:{self.dra_socket}")
        registration = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        reg_grpc.add_RegistrationServicer_to_server(
            _Registration(["v1.DRAPlugin", *versions], str(self.dra_socket)), registration
        )
        registration.add_insecure_port(f"unix:{self.reg_socket}")
        for server in (dra, registration):
            server.start()
            self._servers.append(server)

    def stop_registration(self) -> None:
        self._servers[1].stop(0).wait()

    def stop(self) -> None:
        for server in self._servers:
            server.stop(0).wait()


@pytest.fixture
def directory() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="dkh-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def kubelet(directory: Path) -> Iterator[DRAKubeletStandIn]:
    with DRAKubeletStandIn(directory, **FAST) as started:
        yield started


@pytest.fixture
def plugins() -> Iterator[list[HealthPlugin]]:
    started: list[HealthPlugin] = []
    yield started
    for plugin in started:
        plugin.stop()


def registered(
    kubelet: DRAKubeletStandIn,
    plugins: list[HealthPlugin],
    versions: tuple[str, ...] = ALL_HEALTH,
    *,
    serve: bool = True,
) -> HealthPlugin:
    """A plugin serving in the kubelet's directory, once the kubelet has registered it."""
    plugin = HealthPlugin(kubelet.registry_dir.parent, versions, serve)
    plugins.append(plugin)
    kubelet.wait_registered(DRIVER)
    return plugin


def events(kubelet: DRAKubeletStandIn) -> list[str]:
    return [event for _, event, _ in kubelet.health_events]


def test_a_plugin_without_a_health_service_is_not_watched(
    kubelet: DRAKubeletStandIn, plugins: list[HealthPlugin]
) -> None:
    plugin = registered(kubelet, plugins, ())
    registration = kubelet.current(DRIVER)
    assert registration is not None and registration.health_service is None
    time.sleep(0.2)
    assert events(kubelet) == []
    assert plugin.health.opened == 0


def test_unimplemented_is_not_asked_again(
    kubelet: DRAKubeletStandIn, plugins: list[HealthPlugin]
) -> None:
    registered(kubelet, plugins, serve=False)
    kubelet.wait_for(lambda: len(kubelet.health_events) >= 2, 5, "no health failure")
    time.sleep(0.3)  # six retry periods
    assert events(kubelet) == ["opened", "failed: UNIMPLEMENTED"]


def test_a_stream_the_plugin_ends_is_opened_again(
    kubelet: DRAKubeletStandIn, plugins: list[HealthPlugin]
) -> None:
    plugin = registered(kubelet, plugins)
    plugin.health.script.put(response(("a", 1, "", 30)))
    kubelet.wait_health(DRIVER, lambda h: "node-a/a" in h)
    plugin.health.script.put(END)
    kubelet.wait_for(lambda: events(kubelet).count("opened") >= 2, 5, "not reopened")
    assert events(kubelet)[:3] == ["opened", "ended", "opened"]
    plugin.health.script.put(response(("a", 2, "lost", 30)))
    seen = kubelet.wait_health(DRIVER, lambda h: h["node-a/a"].health == "Unhealthy")
    assert seen["node-a/a"] == SeenHealth(
        "node-a", "a", "Unhealthy", "lost", 1_780_000_000, 30.0, seen["node-a/a"].received
    )


def test_no_news_within_the_timeout_reads_unknown(
    kubelet: DRAKubeletStandIn, plugins: list[HealthPlugin]
) -> None:
    plugin = registered(kubelet, plugins)
    plugin.health.script.put(response(("a", 1, "", 1)))
    kubelet.wait_health(DRIVER, lambda h: "node-a/a" in h)
    assert kubelet.health(DRIVER)["node-a/a"].health == "Healthy"
    waited = kubelet.wait_for(
        lambda: kubelet.health(DRIVER)["node-a/a"].health == "Unknown", 5, "not Unknown"
    )
    assert 0.5 < waited < 2.0
    plugin.health.script.put(response(("a", 1, "", 1)))
    kubelet.wait_health(DRIVER, lambda h: h["node-a/a"].health == "Healthy")


def test_deregistration_cancels_the_stream(
    kubelet: DRAKubeletStandIn, plugins: list[HealthPlugin]
) -> None:
    plugin = registered(kubelet, plugins)
    kubelet.wait_for(lambda: plugin.health.opened == 1, 5, "no stream")
    plugin.stop_registration()
    kubelet.wait_deregistered(DRIVER)
    kubelet.wait_for(lambda: plugin.health.cancelled == 1, 5, "the stream was not cancelled")
    time.sleep(0.2)
    assert plugin.health.opened == 1
