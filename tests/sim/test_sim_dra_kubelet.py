"""The DRA kubelet stand-in against a minimal plugin: real gRPC servers on unix sockets."""

from __future__ import annotations

import shutil
import socket
import tempfile
import threading
import time
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
import pytest

from dra.pluginregistration.v1 import api_pb2 as reg_pb2
from dra.pluginregistration.v1 import api_pb2_grpc as reg_grpc
from dra.v1 import api_pb2 as v1_pb2
from dra.v1 import api_pb2_grpc as v1_grpc
from dra.v1beta1 import api_pb2 as v1beta1_pb2
from dra.v1beta1 import api_pb2_grpc as v1beta1_grpc
from sim.dra_kubelet import (
    Claim,
    DRAKubeletStandIn,
    PreparedDevice,
    PrepareResult,
    choose_service,
)

DRIVER = "gpu.example.com"
BOTH = ("v1.DRAPlugin", "v1beta1.DRAPlugin")
CLAIM = Claim("default", "uid-1", "claim-1")
# Fast timings; the behaviour under test is the same as with the kubelet's defaults.
FAST: dict[str, Any] = {"retry_initial": 0.05, "dial_timeout": 1.0, "info_poll_interval": None}


class _Registration:
    def __init__(self, plugin: FakePlugin) -> None:
        self._plugin = plugin

    def GetInfo(self, request: reg_pb2.InfoRequest, context: grpc.ServicerContext) -> Any:
        plugin = self._plugin
        with plugin.changed:
            plugin.info_calls += 1
        if not plugin.answering.is_set():
            context.abort(grpc.StatusCode.UNAVAILABLE, "plugin is wedged")
        return reg_pb2.PluginInfo(
            type=plugin.plugin_type,
            name=plugin.name,
            endpoint=plugin.endpoint,
            supported_versions=plugin.versions,
        )

    def NotifyRegistrationStatus(
        self, request: reg_pb2.RegistrationStatus, context: grpc.ServicerContext
    ) -> reg_pb2.RegistrationStatusResponse:
        with self._plugin.changed:
            self._plugin.statuses.append((request.plugin_registered, request.error))
            self._plugin.changed.notify_all()
        return reg_pb2.RegistrationStatusResponse()


class _DRA:
    """NodePrepare/NodeUnprepare for one version: one device per claim, an error for "bad"."""

    def __init__(self, plugin: FakePlugin, version: str, messages: Any) -> None:
        self._plugin, self._version, self._m = plugin, version, messages

    def NodePrepareResources(self, request: Any, context: grpc.ServicerContext) -> Any:
        self._plugin.calls.append((self._version, "NodePrepareResources"))
        response = self._m.NodePrepareResourcesResponse()
        for claim in request.claims:
            if claim.name == "bad":
                response.claims[claim.uid].error = f"claim {claim.name} is bad"
                continue
            device = self._m.Device(
                request_names=["gpu"],
                pool_name="node-a",
                device_name=f"dev-{claim.uid}",
                cdi_device_ids=[f"example.com/gpu={claim.uid}"],
            )
            if self._version == "v1":
                device.share_id = "share-1"
            response.claims[claim.uid].devices.append(device)
        return response

    def NodeUnprepareResources(self, request: Any, context: grpc.ServicerContext) -> Any:
        self._plugin.calls.append((self._version, "NodeUnprepareResources"))
        response = self._m.NodeUnprepareResourcesResponse()
        for claim in request.claims:
            response.claims[claim.uid].error = "busy" if claim.name == "bad" else ""
        return response


class FakePlugin:
    """Registration on plugins_registry/<name>-reg.sock, DRAPlugin v1 and v1beta1 on
    plugins/<name>/dra.sock: the layout a real DRA driver uses."""

    def __init__(
        self,
        kubelet_dir: Path,
        name: str = DRIVER,
        *,
        versions: tuple[str, ...] = BOTH,
        plugin_type: str = "DRAPlugin",
        endpoint: str | None = None,
        registration_name: str | None = None,
    ) -> None:
        self.name, self.versions, self.plugin_type = name, list(versions), plugin_type
        self.dra_socket = kubelet_dir / "plugins" / name / "dra.sock"
        self.endpoint = str(self.dra_socket) if endpoint is None else endpoint
        self.reg_socket = (
            kubelet_dir / "plugins_registry" / (registration_name or f"{name}-reg.sock")
        )
        self.statuses: list[tuple[bool, str]] = []
        self.calls: list[tuple[str, str]] = []
        self.info_calls = 0
        self.changed = threading.Condition()
        self.answering = threading.Event()
        self.answering.set()
        self._reg_server: grpc.Server | None = None
        self._dra_server: grpc.Server | None = None

    def serve_dra(self) -> None:
        self.dra_socket.parent.mkdir(parents=True, exist_ok=True)
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        v1_grpc.add_DRAPluginServicer_to_server(_DRA(self, "v1", v1_pb2), server)
        v1beta1_grpc.add_DRAPluginServicer_to_server(_DRA(self, "v1beta1", v1beta1_pb2), server)
        server.add_insecure_port(f"unix:{self.dra_socket}")
        server.start()
        self._dra_server = server

    def serve_registration(self) -> None:
        self.reg_socket.parent.mkdir(parents=True, exist_ok=True)
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        reg_grpc.add_RegistrationServicer_to_server(_Registration(self), server)
        server.add_insecure_port(f"unix:{self.reg_socket}")
        server.start()
        self._reg_server = server

    def start(self) -> FakePlugin:
        self.serve_dra()
        self.serve_registration()
        return self

    def stop_registration(self) -> None:
        """Stop serving; gRPC removes the socket file, as a plugin's clean shutdown does."""
        if self._reg_server is not None:
            self._reg_server.stop(0).wait()
            self._reg_server = None

    def stop(self) -> None:
        self.stop_registration()
        if self._dra_server is not None:
            self._dra_server.stop(0).wait()
            self._dra_server = None

    def wait_statuses(self, count: int, timeout: float = 5.0) -> list[tuple[bool, str]]:
        deadline = time.monotonic() + timeout
        with self.changed:
            while len(self.statuses) < count:
                remaining = deadline - time.monotonic()
                assert remaining > 0, f"{count} statuses expected, got {self.statuses}"
                self.changed.wait(remaining)
            return list(self.statuses)


@pytest.fixture
def kubelet_dir() -> Iterator[Path]:
    # Unix socket paths hold at most 107 bytes; pytest's tmp_path can be longer.
    path = Path(tempfile.mkdtemp(prefix="dk-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def plugins() -> Iterator[list[FakePlugin]]:
    started: list[FakePlugin] = []
    yield started
    for plugin in started:
        plugin.stop()


def run(plugins: list[FakePlugin], plugin: FakePlugin) -> FakePlugin:
    plugins.append(plugin.start())
    return plugin


# --- version choice (pure) ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("offered", "spoken", "chosen"),
    [
        (BOTH, BOTH, "v1.DRAPlugin"),
        (("v1beta1.DRAPlugin", "v1.DRAPlugin"), BOTH, "v1beta1.DRAPlugin"),
        (BOTH, ("v1beta1.DRAPlugin",), "v1beta1.DRAPlugin"),
        (("v2.DRAPlugin", "v1.DRAPlugin"), BOTH, "v1.DRAPlugin"),
    ],
)
def test_the_plugins_first_service_the_kubelet_speaks_wins(
    offered: tuple[str, ...], spoken: tuple[str, ...], chosen: str
) -> None:
    assert choose_service(offered, spoken) == chosen


@pytest.mark.parametrize(
    ("offered", "message"),
    [((), "empty list"), (("v1.DRAPlugin",), "none of services supported by the plugin")],
)
def test_no_common_service_is_an_error(offered: tuple[str, ...], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        choose_service(offered, ("v1beta1.DRAPlugin",))


# --- registration -----------------------------------------------------------------------------


def test_registers_with_v1_and_calls_it(kubelet_dir: Path, plugins: list[FakePlugin]) -> None:
    plugin = run(plugins, FakePlugin(kubelet_dir))
    with DRAKubeletStandIn(kubelet_dir, **FAST) as kubelet:
        registration = kubelet.wait_registered(DRIVER)
        assert registration.service == "v1.DRAPlugin"
        assert registration.version == "v1"
        assert registration.endpoint == str(plugin.dra_socket)
        assert registration.socket_path == plugin.reg_socket
        assert registration.supported_versions == BOTH
        assert plugin.wait_statuses(1) == [(True, "")]

        prepared = kubelet.node_prepare_resources([CLAIM, Claim("default", "uid-2", "bad")])
        unprepared = kubelet.node_unprepare_resources([CLAIM, Claim("default", "uid-2", "bad")])
    device = PreparedDevice(("gpu",), "node-a", "dev-uid-1", ("example.com/gpu=uid-1",), "share-1")
    assert prepared == {
        "uid-1": PrepareResult((device,)),
        "uid-2": PrepareResult((), "claim bad is bad"),
    }
    assert unprepared == {"uid-1": "", "uid-2": "busy"}
    assert plugin.calls == [("v1", "NodePrepareResources"), ("v1", "NodeUnprepareResources")]


def test_a_v1beta1_only_kubelet_uses_v1beta1(kubelet_dir: Path, plugins: list[FakePlugin]) -> None:
    plugin = run(plugins, FakePlugin(kubelet_dir))
    with DRAKubeletStandIn(kubelet_dir, services=("v1beta1.DRAPlugin",), **FAST) as kubelet:
        assert kubelet.wait_registered(DRIVER).service == "v1beta1.DRAPlugin"
        prepared = kubelet.node_prepare_resources([CLAIM])
    assert prepared["uid-1"].devices[0].share_id is None
    assert prepared["uid-1"].devices[0].cdi_device_ids == ("example.com/gpu=uid-1",)
    assert plugin.calls == [("v1beta1", "NodePrepareResources")]


def test_a_forced_version_answers_alike_but_for_share_id(
    kubelet_dir: Path, plugins: list[FakePlugin]
) -> None:
    plugin = run(plugins, FakePlugin(kubelet_dir))
    with DRAKubeletStandIn(kubelet_dir, **FAST) as kubelet:
        kubelet.wait_registered(DRIVER)
        new = kubelet.node_prepare_resources([CLAIM])
        old = kubelet.node_prepare_resources([CLAIM], "v1beta1")
        with pytest.raises(ValueError, match="unknown DRA version 'v2'"):
            kubelet.node_prepare_resources([CLAIM], "v2")
    assert plugin.calls == [("v1", "NodePrepareResources"), ("v1beta1", "NodePrepareResources")]
    assert new["uid-1"].devices[0].share_id == "share-1"
    assert old["uid-1"].devices[0].share_id is None
    assert new["uid-1"].devices[0].device_name == old["uid-1"].devices[0].device_name


def test_dot_files_and_plain_files_are_ignored(
    kubelet_dir: Path, plugins: list[FakePlugin]
) -> None:
    hidden = run(plugins, FakePlugin(kubelet_dir, registration_name=".hidden-reg.sock"))
    (kubelet_dir / "plugins_registry" / "plain.sock").write_text("not a socket")
    with DRAKubeletStandIn(kubelet_dir, **FAST) as kubelet:
        visible = run(plugins, FakePlugin(kubelet_dir, "other.example.com"))
        kubelet.wait_registered("other.example.com")
        time.sleep(0.2)  # ten scans more
        assert kubelet.current(DRIVER) is None
    assert hidden.info_calls == 0
    assert visible.info_calls == 1


def test_a_socket_in_a_subdirectory_registers(kubelet_dir: Path, plugins: list[FakePlugin]) -> None:
    run(plugins, FakePlugin(kubelet_dir, registration_name="sub/gpu-reg"))
    with DRAKubeletStandIn(kubelet_dir, **FAST) as kubelet:
        assert kubelet.wait_registered(DRIVER).socket_path.parent.name == "sub"


# --- refusals ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "services", "message"),
    [
        ({"plugin_type": "CSIPlugin"}, BOTH, "no handler registered for plugin type: CSIPlugin"),
        ({"versions": ()}, BOTH, "empty list of supported gRPC services"),
        ({"versions": ("v1.DRAPlugin",)}, ("v1beta1.DRAPlugin",), "none of services supported"),
        ({"endpoint": "/nonexistent/dra.sock"}, BOTH, "endpoint /nonexistent/dra.sock of DRA"),
    ],
    ids=["wrong-type", "no-versions", "no-common-version", "endpoint-missing"],
)
def test_refusal_is_notified_and_retried(
    kubelet_dir: Path,
    plugins: list[FakePlugin],
    kwargs: dict[str, Any],
    services: tuple[str, ...],
    message: str,
) -> None:
    plugin = run(plugins, FakePlugin(kubelet_dir, **kwargs))
    with DRAKubeletStandIn(kubelet_dir, services=services, **FAST) as kubelet:
        refusal = kubelet.wait_refused()
        statuses = plugin.wait_statuses(2)  # the kubelet tries again after a back-off
        assert kubelet.current(DRIVER) is None
        assert kubelet.registrations == []
    assert message in refusal.error
    assert refusal.socket_path == plugin.reg_socket
    assert all(not registered and message in error for registered, error in statuses)


def test_a_missing_endpoint_registers_like_the_kubelet_when_unchecked(
    kubelet_dir: Path, plugins: list[FakePlugin]
) -> None:
    missing = str(kubelet_dir / "nowhere.sock")
    plugin = run(plugins, FakePlugin(kubelet_dir, endpoint=missing))
    with DRAKubeletStandIn(kubelet_dir, check_endpoint=False, **FAST) as kubelet:
        assert kubelet.wait_registered(DRIVER).endpoint == missing
        with pytest.raises(grpc.RpcError) as failed:
            kubelet.node_prepare_resources([CLAIM])
    assert failed.value.code() == grpc.StatusCode.UNAVAILABLE
    assert plugin.wait_statuses(1) == [(True, "")]


def test_an_empty_endpoint_means_the_registration_socket(
    kubelet_dir: Path, plugins: list[FakePlugin]
) -> None:
    plugin = run(plugins, FakePlugin(kubelet_dir, endpoint=""))
    with DRAKubeletStandIn(kubelet_dir, **FAST) as kubelet:
        assert kubelet.wait_registered(DRIVER).endpoint == str(plugin.reg_socket)


def test_a_second_registration_of_the_same_endpoint_is_refused(
    kubelet_dir: Path, plugins: list[FakePlugin]
) -> None:
    first = run(plugins, FakePlugin(kubelet_dir))
    with DRAKubeletStandIn(kubelet_dir, **FAST) as kubelet:
        kubelet.wait_registered(DRIVER)
        second = FakePlugin(kubelet_dir, endpoint=first.endpoint, registration_name="again.sock")
        second.serve_registration()
        plugins.append(second)
        refusal = kubelet.wait_refused()
        assert kubelet.current(DRIVER) == kubelet.registrations[0]
    assert f"endpoint {first.endpoint} already registered" in refusal.error
    assert second.wait_statuses(1)[0][0] is False


def test_calls_name_the_driver_when_several_are_registered(
    kubelet_dir: Path, plugins: list[FakePlugin]
) -> None:
    run(plugins, FakePlugin(kubelet_dir))
    other = run(plugins, FakePlugin(kubelet_dir, "other.example.com"))
    with DRAKubeletStandIn(kubelet_dir, **FAST) as kubelet:
        kubelet.wait_registered(DRIVER)
        kubelet.wait_registered("other.example.com")
        with pytest.raises(LookupError, match="name the driver"):
            kubelet.node_prepare_resources([CLAIM])
        with pytest.raises(LookupError, match=r"'absent\.example\.com' is not registered"):
            kubelet.node_prepare_resources([CLAIM], driver="absent.example.com")
        kubelet.node_unprepare_resources([CLAIM], driver="other.example.com")
    assert other.calls == [("v1", "NodeUnprepareResources")]


def test_wait_timeout_says_what_was_seen(kubelet_dir: Path, plugins: list[FakePlugin]) -> None:
    run(plugins, FakePlugin(kubelet_dir, plugin_type="CSIPlugin"))
    with DRAKubeletStandIn(kubelet_dir, **FAST) as kubelet:
        kubelet.wait_refused()
        with pytest.raises(TimeoutError) as timed_out:
            kubelet.wait_registered(DRIVER, timeout=0.2)
    text = str(timed_out.value)
    assert f"DRA driver '{DRIVER}' not registered 1x within 0.2 s" in text
    assert "no handler registered for plugin type: CSIPlugin" in text
    assert str(kubelet_dir / "plugins_registry") in text


# --- the plugin going away and coming back ------------------------------------------------------


def test_removed_socket_deregisters_and_a_new_one_registers_again(
    kubelet_dir: Path, plugins: list[FakePlugin]
) -> None:
    plugin = run(plugins, FakePlugin(kubelet_dir))
    with DRAKubeletStandIn(kubelet_dir, **FAST) as kubelet:
        first = kubelet.wait_registered(DRIVER)
        plugin.stop_registration()
        gone = kubelet.wait_deregistered(DRIVER)
        assert gone.reason == "registration socket removed"
        assert gone.registration == first
        with pytest.raises(LookupError):
            kubelet.node_prepare_resources([CLAIM])
        plugin.serve_registration()
        second = kubelet.wait_registered(DRIVER, count=2)
        assert second.at > first.at
        assert kubelet.node_prepare_resources([CLAIM])["uid-1"].error == ""
    assert plugin.wait_statuses(2) == [(True, ""), (True, "")]


@pytest.mark.parametrize("remove_directory", [False, True], ids=["sockets-deleted", "dir-removed"])
def test_restart_wipes_the_registry_and_expects_a_fresh_registration(
    kubelet_dir: Path, plugins: list[FakePlugin], remove_directory: bool
) -> None:
    plugin = run(plugins, FakePlugin(kubelet_dir))
    stray = kubelet_dir / "plugins_registry" / "stray.sock"
    with socket.socket(socket.AF_UNIX) as leftover:
        leftover.bind(str(stray))
        with DRAKubeletStandIn(kubelet_dir, **FAST) as kubelet:
            kubelet.wait_registered(DRIVER)
            kubelet.restart(remove_directory=remove_directory)
            assert not plugin.reg_socket.exists()
            assert not stray.exists()
            assert kubelet.current(DRIVER) is None
            assert kubelet.restarts == 1
            plugin.stop_registration()
            plugin.serve_registration()  # what a driver that watches its socket does
            kubelet.wait_registered(DRIVER, count=2)
            assert kubelet.node_prepare_resources([CLAIM])["uid-1"].devices
    assert plugin.wait_statuses(2) == [(True, ""), (True, "")]
    assert kubelet.deregistrations == []  # a killed kubelet tells nobody


def test_a_socket_recreated_while_the_kubelet_is_down_is_found_at_start(
    kubelet_dir: Path, plugins: list[FakePlugin]
) -> None:
    plugin = run(plugins, FakePlugin(kubelet_dir))
    registry = kubelet_dir / "plugins_registry"

    def recreate_once_wiped() -> None:
        while registry.exists():
            time.sleep(0.005)
        plugin.stop_registration()
        plugin.serve_registration()

    with DRAKubeletStandIn(kubelet_dir, **FAST) as kubelet:
        kubelet.wait_registered(DRIVER)
        driver_side = threading.Thread(target=recreate_once_wiped)
        driver_side.start()
        kubelet.restart(remove_directory=True, downtime=0.3)
        driver_side.join()
        kubelet.wait_registered(DRIVER, count=2)
    assert plugin.wait_statuses(2) == [(True, ""), (True, "")]


def test_a_silent_plugin_is_dropped_and_taken_back_when_it_answers(
    kubelet_dir: Path, plugins: list[FakePlugin]
) -> None:
    plugin = run(plugins, FakePlugin(kubelet_dir))
    polling = {**FAST, "info_poll_interval": 0.1, "poll_timeout": 0.5}
    with DRAKubeletStandIn(kubelet_dir, **polling) as kubelet:
        kubelet.wait_registered(DRIVER)
        plugin.answering.clear()
        gone = kubelet.wait_deregistered(DRIVER)
        assert gone.reason == "GetInfo failed 2 times in a row: StatusCode.UNAVAILABLE"
        assert plugin.reg_socket.exists()
        time.sleep(0.3)  # probed meanwhile, still silent: not registered
        assert kubelet.current(DRIVER) is None
        plugin.answering.set()
        kubelet.wait_registered(DRIVER, count=2)
    assert plugin.wait_statuses(2) == [(True, ""), (True, "")]


def test_an_old_kubelet_does_not_poll(kubelet_dir: Path, plugins: list[FakePlugin]) -> None:
    plugin = run(plugins, FakePlugin(kubelet_dir))
    with DRAKubeletStandIn(kubelet_dir, **FAST) as kubelet:
        kubelet.wait_registered(DRIVER)
        plugin.answering.clear()
        time.sleep(0.3)
        assert kubelet.current(DRIVER) is not None
    assert plugin.info_calls == 1
