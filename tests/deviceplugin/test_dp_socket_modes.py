"""The plugin's gRPC sockets get mode 0600 whatever the umask, and the kubelet (root) still
reaches them: registration, Allocate and re-registration over real gRPC under umask 000. And what
the kubelet answers to a Register is quoted before it reaches a log line."""

from __future__ import annotations

import stat
from collections.abc import Callable, Iterator
from concurrent import futures
from pathlib import Path

import grpc
import pytest

from deviceplugin.registration import RegistrationError, register_with_kubelet
from deviceplugin.v1beta1 import api_pb2, api_pb2_grpc
from plugin_harness import H100, IOMMUFD, Plugin, plugin_starter, short_directory
from sim.host import BuildHost


@pytest.fixture
def short_dir() -> Iterator[Path]:
    with short_directory("km-") as path:
        yield path


@pytest.fixture
def start_plugin(
    build_host: BuildHost, short_dir: Path, tmp_path: Path
) -> Iterator[Callable[..., Plugin]]:
    with plugin_starter(build_host, short_dir, tmp_path) as start:
        yield start


def _plugin_socket_modes(directory: Path) -> dict[str, int]:
    return {
        p.name: stat.S_IMODE(p.lstat().st_mode) for p in directory.glob("kubevirt-iommufd-*.sock")
    }


EXPECTED = {
    "kubevirt-iommufd-nvidia.com_GH100H100_SXM5_80GB.sock": 0o600,
    "kubevirt-iommufd-devices.kubevirt.io_iommufd.sock": 0o600,
}


def test_plugin_sockets_are_0600_under_umask_000_and_the_kubelet_reaches_them(
    start_plugin: Callable[..., Plugin], open_umask: None
) -> None:
    plugin = start_plugin()
    kubelet = plugin.kubelet
    kubelet.wait_registered(H100)
    kubelet.wait_registered(IOMMUFD)
    assert _plugin_socket_modes(kubelet.directory) == EXPECTED
    assert kubelet.allocate(H100, ["0000:18:00.0"]).container_responses
    # Served anew after a kubelet restart: the same mode again, and nothing else left behind.
    kubelet.restart()
    kubelet.wait_registered(H100, count=2)
    kubelet.wait_registered(IOMMUFD, count=2)
    assert _plugin_socket_modes(kubelet.directory) == EXPECTED
    assert sorted(p.name for p in kubelet.directory.iterdir()) == sorted(
        [*EXPECTED, "kubelet.sock"]
    )
    assert kubelet.allocate(H100, ["0000:18:00.0"]).container_responses


def test_a_removed_plugin_socket_comes_back_0600(
    start_plugin: Callable[..., Plugin], open_umask: None
) -> None:
    plugin = start_plugin()
    kubelet = plugin.kubelet
    kubelet.wait_registered(H100)
    kubelet.wait_registered(IOMMUFD)
    (kubelet.directory / "kubevirt-iommufd-nvidia.com_GH100H100_SXM5_80GB.sock").unlink()
    kubelet.wait_registered(H100, count=2)
    assert _plugin_socket_modes(kubelet.directory) == EXPECTED


class _RefusingKubelet:
    def Register(
        self, request: api_pb2.RegisterRequest, context: grpc.ServicerContext
    ) -> api_pb2.Empty:
        context.abort(grpc.StatusCode.INVALID_ARGUMENT, "bad\nERROR forged " + "x" * 5_000)


def test_a_kubelets_refusal_is_quoted_and_short(short_dir: Path) -> None:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=1))
    api_pb2_grpc.add_RegistrationServicer_to_server(_RefusingKubelet(), server)
    server.add_insecure_port(f"unix://{short_dir / 'kubelet.sock'}")
    server.start()
    try:
        with pytest.raises(RegistrationError) as caught:
            register_with_kubelet(short_dir, H100, "x.sock", api_pb2.DevicePluginOptions())
    finally:
        server.stop(0).wait()
    message = str(caught.value)
    assert "refused nvidia.com/GH100H100_SXM5_80GB: 'bad\\nERROR forged xxx" in message
    assert len(message) < 400 and "\n" not in message
