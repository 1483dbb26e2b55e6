"""The driver's kubelet sockets over real gRPC, against the DRA kubelet stand-in: registration,
both DRA versions (and the three health versions after them), a kubelet restart survived, nothing
left behind on stop."""

from __future__ import annotations

import shutil
import stat
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest

from dra.health_stream import HealthStreams
from dra.kubelet_sockets import KubeletSockets, dra_socket_path, registration_socket_path
from dra.pluginregistration.v1 import api_pb2 as reg_pb2
from dra.pluginregistration.v1 import api_pb2_grpc as reg_grpc
from dra.servicer import DraServicerV1, DraServicerV1beta1
from dra_kit import DRIVER, REF, Node, short_directory
from sim.dra_kubelet import Claim, DRAKubeletStandIn

ScenarioRoot = Callable[[str], Path]


@pytest.fixture
def node(scenario_root: ScenarioRoot, tmp_path: Path) -> Node:
    return Node(scenario_root("hgx-h100"), tmp_path)


@pytest.fixture
def kubelet_dir() -> Iterator[Path]:
    with short_directory() as path:
        yield path / "kubelet"


def kubelet_sockets(node: Node, kubelet_dir: Path, check_interval: float = 0.2) -> KubeletSockets:
    return KubeletSockets(
        kubelet_dir,
        DRIVER,
        DraServicerV1(node.preparer),
        DraServicerV1beta1(node.preparer),
        HealthStreams("node-a", timeout_seconds=30),
        check_interval=check_interval,
    )


@pytest.fixture
def sockets(node: Node, kubelet_dir: Path) -> Iterator[KubeletSockets]:
    served = kubelet_sockets(node, kubelet_dir)
    served.start()
    yield served
    served.stop()


def test_getinfo_names_the_driver_its_versions_and_the_dra_socket(
    sockets: KubeletSockets, kubelet_dir: Path
) -> None:
    path = registration_socket_path(kubelet_dir, DRIVER)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    with grpc.insecure_channel(f"unix:{path}") as channel:
        start = time.monotonic()
        info = reg_grpc.RegistrationStub(channel).GetInfo(reg_pb2.InfoRequest(), timeout=1)
        elapsed = time.monotonic() - start
    assert info.type == "DRAPlugin" and info.name == DRIVER
    assert info.endpoint == str(dra_socket_path(kubelet_dir, DRIVER))
    # The DRAPlugin versions first (the kubelet takes the first it knows), the health after.
    assert list(info.supported_versions) == [
        "v1.DRAPlugin",
        "v1beta1.DRAPlugin",
        "v1.DRAResourceHealth",
        "v1beta1.DRAResourceHealth",
        "v1alpha1.DRAResourceHealth",
    ]
    assert elapsed < 1.0


@pytest.mark.parametrize(
    "services", [("v1.DRAPlugin", "v1beta1.DRAPlugin"), ("v1beta1.DRAPlugin",)]
)
def test_the_kubelet_registers_and_prepares_in_the_version_it_speaks(
    node: Node, sockets: KubeletSockets, kubelet_dir: Path, services: tuple[str, ...]
) -> None:
    node.claims.add(REF, [("gpu", "pci-0000-18-00-0")])
    with DRAKubeletStandIn(kubelet_dir, services=services) as kubelet:
        registration = kubelet.wait_registered(DRIVER)
        assert registration.service == services[0]
        sockets_registered = time.monotonic()
        while sockets.registration.registered is not True:
            assert time.monotonic() - sockets_registered < 5
            time.sleep(0.01)
        claim = Claim(REF.namespace, REF.uid, REF.name)
        answer = kubelet.node_prepare_resources([claim])[REF.uid]
        assert answer.error == ""
        (device,) = answer.devices
        assert device.request_names == ("gpu",)
        assert device.pool_name == "node-a" and device.device_name == "pci-0000-18-00-0"
        assert device.cdi_device_ids == (
            f"{DRIVER}/claim={REF.uid}-pci-0000-18-00-0",
            f"{DRIVER}/claim={REF.uid}-metadata-gpu",
        )
        assert kubelet.node_prepare_resources([claim])[REF.uid] == answer
        assert kubelet.node_unprepare_resources([claim]) == {REF.uid: ""}
        assert kubelet.node_unprepare_resources([claim]) == {REF.uid: ""}


def test_every_claim_of_a_call_is_answered_with_its_own_error(
    node: Node, sockets: KubeletSockets, kubelet_dir: Path
) -> None:
    node.claims.add(REF, [("gpu", "pci-0000-18-00-0")])
    with DRAKubeletStandIn(kubelet_dir) as kubelet:
        kubelet.wait_registered(DRIVER)
        missing = Claim("vms", "b1b2c3d4-0000-4000-8000-000000000009", "missing")
        answers = kubelet.node_prepare_resources([Claim(REF.namespace, REF.uid, REF.name), missing])
        assert answers[REF.uid].error == ""
        assert (
            "vms/missing" in answers[missing.uid].error
            and "not found" in answers[missing.uid].error
        )


@pytest.mark.parametrize("remove_directory", [False, True], ids=["sockets-wiped", "dir-removed"])
def test_a_kubelet_restart_is_survived(
    node: Node, sockets: KubeletSockets, kubelet_dir: Path, remove_directory: bool
) -> None:
    node.claims.add(REF, [("gpu", "pci-0000-18-00-0")])
    with DRAKubeletStandIn(kubelet_dir) as kubelet:
        kubelet.wait_registered(DRIVER)
        kubelet.restart(remove_directory=remove_directory)
        kubelet.wait_registered(DRIVER, count=2, timeout=5)
        answer = kubelet.node_prepare_resources([Claim(REF.namespace, REF.uid, REF.name)])
        assert answer[REF.uid].error == ""
    assert sockets.restarts >= 1


def test_stop_removes_both_sockets(node: Node, kubelet_dir: Path) -> None:
    served = kubelet_sockets(node, kubelet_dir)
    served.start()
    paths = [dra_socket_path(kubelet_dir, DRIVER), registration_socket_path(kubelet_dir, DRIVER)]
    assert all(p.is_socket() for p in paths)
    served.stop()
    assert not any(p.exists() for p in paths)
    # No private staging directories left either.
    assert [p.name for p in (kubelet_dir / "plugins_registry").iterdir()] == []


@pytest.mark.usefixtures("open_umask")
def test_socket_directories_are_made_0750_whatever_the_umask(node: Node, kubelet_dir: Path) -> None:
    served = kubelet_sockets(node, kubelet_dir, check_interval=0.05)
    served.start()
    try:
        dra_dir = dra_socket_path(kubelet_dir, DRIVER).parent
        made = [kubelet_dir, kubelet_dir / "plugins", dra_dir, kubelet_dir / "plugins_registry"]
        assert [oct(stat.S_IMODE(p.stat().st_mode)) for p in made] == ["0o750"] * 4
        # Wiped by a restarting kubelet: made again, with the same mode.
        shutil.rmtree(dra_dir)
        deadline = time.monotonic() + 5
        while not dra_socket_path(kubelet_dir, DRIVER).is_socket():
            assert time.monotonic() < deadline, "the DRA socket was not served again"
            time.sleep(0.02)
        assert oct(stat.S_IMODE(dra_dir.stat().st_mode)) == "0o750"
    finally:
        served.stop()
