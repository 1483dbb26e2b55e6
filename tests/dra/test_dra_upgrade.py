"""Upgrades with no gap: the old and the new instance of the driver on one node, as a DaemonSet's
rolling update with `maxSurge: 1` runs them — one state directory, one kubelet directory, the
kubelet stand-in over real gRPC (which keeps both registrations, as the kubelet does), the API
server stand-in, and a kernel simulator under on-demand binding. A claim prepared by one is
unprepared by the other, the two never bind one device twice, and an old instance killed in
the middle of a bind (a real SIGKILL of a process running the driver) strands nothing."""

from __future__ import annotations

import base64
import hashlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path

import grpc
import kubernetes.client
import pytest

import dra.driver
import dra.state
from dra.api import ResourceApi
from dra.driver import DraDriver
from dra.health import Health
from dra.iommufd_slots import slot_index
from dra.kubelet_sockets import dra_socket_path, registration_socket_path, serialize_lock_path
from dra.serialize_lock import SerializeLock, SerializeLockBusy
from dra.state import ClaimStore, PreparedClaim, PreparedDevice
from dra.v1 import api_pb2 as v1_pb2
from dra.v1 import api_pb2_grpc as v1_grpc
from dra_kit import DRIVER, NODE, driver_settings, short_directory
from hostdev.bdf import Bdf
from hostdev.binding.bind import HostAccess
from hostdev.grpc_socket import GrpcSocketServer
from hostdev.pciids import PciIds
from sim.apiserver import AllocatedDevice, ApiServerStandIn, build_resource_claim
from sim.dra_kubelet import Claim, DRAKubeletStandIn
from sim.host import BuildHost, FunctionSpec, HostSpec, report_aer_error
from sim.kernel import KernelSimulator
from test_dra_on_demand import AUDIO, BEFORE, GPU, GPU_DEVICE, ON_DEMAND, desktop_gpu

OLD = "11111111-1111-4111-8111-111111111111"
NEW = "22222222-2222-4222-8222-222222222222"
ON_VFIO = {GPU: ("vfio-pci", "vfio-pci"), AUDIO: ("vfio-pci", "vfio-pci")}
REPO = Path(__file__).resolve().parents[2]


@dataclass
class Node:
    """One node: its host, kernel, kubelet and the driver instances started on it."""

    root: Path
    base: Path
    kernel: KernelSimulator
    apiserver: ApiServerStandIn
    api_client: kubernetes.client.ApiClient
    kubelet: DRAKubeletStandIn
    wiped: list[str]
    running: list[DraDriver] = field(default_factory=list)

    def driver(self, uid: str, *, start: bool = True) -> DraDriver:
        settings = replace(driver_settings(self.root, self.base, 0.2), instance_uid=uid)
        driver = DraDriver(settings, ON_DEMAND, PciIds(None), ResourceApi(self.api_client))
        if start:
            driver.start()
        self.running.append(driver)
        return driver

    def claim(self, name: str) -> Claim:
        self.apiserver.put_claim(build_resource_claim("vms", name, ["gpu"], DRIVER))
        stored = self.apiserver.set_allocation(
            "vms", name, [AllocatedDevice("gpu", DRIVER, NODE, GPU_DEVICE)], NODE
        )
        return Claim("vms", stored["metadata"]["uid"], name)

    def drivers(self) -> dict[str, tuple[str | None, str | None]]:
        return {b: (self.kernel.driver(b), self.kernel.override(b)) for b in (GPU, AUDIO)}

    def journal(self) -> list[dict[str, object]]:
        directory = self.base / "state" / "bindings"
        return [json.loads(p.read_text()) for p in sorted(directory.glob("*.json"))]

    def records(self) -> list[str]:
        return sorted(p.stem for p in (self.base / "state" / "claims").glob("*.json"))

    def dra_path(self, uid: str) -> Path:
        return dra_socket_path(self.base / "kubelet", DRIVER, uid)

    def registration_path(self, uid: str) -> Path:
        return registration_socket_path(self.base / "kubelet", DRIVER, uid)


SECOND_GPU = "0000:3b:00.2"


def two_gpus_in_one_group() -> HostSpec:
    """The desktop GPU with a second one in its IOMMU group: preparing either hides the other."""
    spec = desktop_gpu()
    second = FunctionSpec(
        SECOND_GPU,
        0x10DE,
        0x2204,
        0x030000,
        driver="nvidia",
        group=14,
        parent=spec.functions[0].bdf,
    )
    return HostSpec((*spec.functions, second))


@pytest.fixture
def node(
    request: pytest.FixtureRequest,
    build_host: BuildHost,
    apiserver: ApiServerStandIn,
    api_client: kubernetes.client.ApiClient,
    monkeypatch: pytest.MonkeyPatch,
) -> Iterator[Node]:
    spec: HostSpec = getattr(request, "param", None) or desktop_gpu()
    root = build_host(spec)
    native = {f.bdf: f.driver for f in spec.functions if f.driver is not None}
    kernel = KernelSimulator(root, native)
    # The drivers write sysfs through the simulator, which moves the tree's links as Linux would.
    monkeypatch.setattr(
        dra.driver,
        "HostAccess",
        lambda root, host_root: HostAccess(root=root, writer=kernel, runner=kernel.run),
    )
    apiserver.put_node(NODE)
    wiped: list[str] = []
    with short_directory() as base:
        kubelet = DRAKubeletStandIn(
            base / "kubelet", info_poll_interval=None, wipe=wiped.append, wipe_delay=0.5
        )
        with kubelet:
            world = Node(root, base, kernel, apiserver, api_client, kubelet, wiped)
            try:
                yield world
            finally:
                for driver in world.running:
                    driver.stop()


def prepare_on(path: Path, claim: Claim) -> str:
    """NodePrepareResources over gRPC at one instance's DRA socket (the kubelet would call the
    newest): the claim's error, "" when prepared."""
    with grpc.insecure_channel(f"unix:{path}") as channel:
        request = v1_pb2.NodePrepareResourcesRequest(
            claims=[v1_pb2.Claim(namespace=claim.namespace, uid=claim.uid, name=claim.name)]
        )
        response = v1_grpc.DRAPluginStub(channel).NodePrepareResources(request, timeout=30)
    error: str = response.claims[claim.uid].error
    return error


# Socket names --------------------------------------------------------------------------------


def _hash(text: str, size: int) -> str:
    return base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()[:size]).decode()


def test_one_instance_keeps_the_names_it_always_had() -> None:
    kubelet = Path("/var/lib/kubelet")
    assert dra_socket_path(kubelet, DRIVER) == kubelet / "plugins" / DRIVER / "dra.sock"
    assert registration_socket_path(kubelet, DRIVER) == (
        kubelet / "plugins_registry" / f"{DRIVER}-reg.sock"
    )
    assert serialize_lock_path(kubelet, DRIVER) == kubelet / "plugins" / DRIVER / "serialize.lock"


def test_an_instance_names_its_sockets_after_its_pod_uid() -> None:
    kubelet = Path("/var/lib/kubelet")
    assert registration_socket_path(kubelet, DRIVER, OLD).name == f"{DRIVER}-{OLD}-reg.sock"
    assert dra_socket_path(kubelet, DRIVER, OLD) == kubelet / "plugins" / DRIVER / f"dra-{OLD}.sock"
    assert registration_socket_path(kubelet, DRIVER, OLD) != registration_socket_path(
        kubelet, DRIVER, NEW
    )


@pytest.mark.parametrize(
    ("directory_length", "expected"),
    [
        pytest.param(30, lambda: f"{DRIVER}-{OLD}-reg.sock", id="the-uid-fits"),
        pytest.param(50, lambda: f"{DRIVER}-{_hash(OLD, 8).rstrip('=')}-reg.sock", id="uid-hash"),
        pytest.param(
            66,
            lambda: f"dra-{_hash(DRIVER + chr(0) + OLD, 16).rstrip('=')}-reg.sock",
            id="driver-and-uid-hash",
        ),
    ],
)
def test_a_registration_socket_too_long_for_a_unix_address_falls_back_to_hashes(
    directory_length: int, expected: Callable[[], str]
) -> None:
    """The kubeletplugin helper's order (RollingUpdateRegistrarSocketFile): the UID, a hash of
    it, a hash of driver and UID; each unpadded base64url."""
    kubelet = Path("/" + "k" * (directory_length - len("/plugins_registry") - 1))
    path = registration_socket_path(kubelet, DRIVER, OLD)
    assert path.name == expected()
    assert len(os.fsencode(path)) <= 107
    assert "=" not in path.name and "/" not in path.name


def test_a_dra_socket_too_long_falls_back_to_a_hash_of_the_uid() -> None:
    kubelet = Path("/" + "k" * 30)
    path = dra_socket_path(kubelet, DRIVER, OLD)
    assert path.name == f"dra-{_hash(OLD, 8).rstrip('=')}.sock"
    assert len(os.fsencode(path)) <= 107


def test_the_command_takes_its_instance_from_the_pods_uid(
    scenario_root: Callable[[str], Path], apiserver: ApiServerStandIn
) -> None:
    """`kubevirt-iommufd dra` in a pod with POD_UID (the DaemonSet's downward API) serves under
    that pod's names, registers once ready and says so, and removes its sockets when stopped."""
    apiserver.put_node(NODE)
    with short_directory() as base:
        kubelet_dir = base / "kubelet"
        argv = [
            sys.executable, "-m", "kubevirt_iommufd", "dra", "--node-name", NODE,
            "--root", str(scenario_root("hgx-h100")), "--kubelet-dir", str(kubelet_dir),
            "--cdi-dir", str(base / "cdi"), "--state-dir", str(base / "state"),
            "--run-dir", str(base / "run"),
            "--kubeconfig", str(apiserver.write_kubeconfig(base / "kubeconfig")),
        ]  # fmt: skip
        env = {**os.environ, "POD_UID": OLD}
        process = subprocess.Popen(argv, env=env, stderr=subprocess.PIPE, text=True, cwd=REPO)
        try:
            with DRAKubeletStandIn(kubelet_dir, info_poll_interval=None) as kubelet:
                registration = kubelet.wait_registered(DRIVER, timeout=20)
                assert registration.socket_path == registration_socket_path(
                    kubelet_dir, DRIVER, OLD
                )
                assert registration.endpoint == str(dra_socket_path(kubelet_dir, DRIVER, OLD))
            process.send_signal(signal.SIGTERM)
            _, stderr = process.communicate(timeout=20)
        finally:
            process.kill()
        assert process.returncode == 0, stderr
        assert not list((kubelet_dir / "plugins_registry").iterdir())
        assert not dra_socket_path(kubelet_dir, DRIVER, OLD).exists()
    lines = stderr.splitlines()
    (ready,) = [n for n, line in enumerate(lines) if "ready: serving the registration" in line]
    assert f"at {registration.socket_path};" in lines[ready]
    assert f"the kubelet calls instance {OLD} from now on" in lines[ready]
    # What its first prepare needs came before: the API client, and recovery.
    (loaded,) = [n for n, line in enumerate(lines) if "API client loaded" in line]
    assert loaded < ready


def test_an_instance_uid_that_is_no_pod_uid_is_refused(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "kubevirt_iommufd", "dra", "--node-name", "a",
         "--state-dir", str(tmp_path / "state"), "--run-dir", str(tmp_path / "run")],
        env={**os.environ, "POD_UID": "../../etc"},
        capture_output=True, text=True, timeout=60, check=False, cwd=REPO,
    )  # fmt: skip
    assert done.returncode == 2
    assert "--instance-uid '../../etc': expected a pod UID" in done.stderr


# Two instances through the kubelet ------------------------------------------------------------


def test_both_register_and_the_kubelet_calls_the_newest(node: Node) -> None:
    node.driver(OLD)
    first = node.kubelet.wait_registered(DRIVER)
    assert first.endpoint == str(node.dra_path(OLD))
    assert first.socket_path == node.registration_path(OLD)
    node.driver(NEW)
    newest = node.kubelet.wait_registered(DRIVER, count=2)
    assert newest.endpoint == str(node.dra_path(NEW))
    assert node.kubelet.deregistrations == [] and node.kubelet.refusals == []
    claim = node.claim("vm-a")
    assert node.kubelet.node_prepare_resources([claim])[claim.uid].error == ""
    # The bind was the new instance's: its journal entry says so.
    (entry,) = node.journal()
    assert entry["writtenBy"] == {"pid": os.getpid(), "instance": NEW}


def test_a_claim_prepared_by_the_old_is_unprepared_by_the_new(node: Node) -> None:
    old = node.driver(OLD)
    node.kubelet.wait_registered(DRIVER)
    claim = node.claim("vm-a")
    assert node.kubelet.node_prepare_resources([claim])[claim.uid].error == ""
    assert node.drivers() == ON_VFIO and node.records() == [claim.uid]
    assert list((node.base / "cdi").glob(f"*{claim.uid}*"))
    new = node.driver(NEW)
    node.kubelet.wait_registered(DRIVER, count=2)
    # The new one publishes what the old prepared: the GPU's group companions stay hidden.
    assert new.store.get(claim.uid) is not None
    assert node.kubelet.node_unprepare_resources([claim]) == {claim.uid: ""}
    assert node.drivers() == BEFORE
    assert node.records() == [] and node.journal() == []
    assert not list((node.base / "cdi").glob(f"*{claim.uid}*"))
    # And the old one knows it too, at its next call or within its follow interval.
    assert node.apiserver.wait_until(lambda: old.store.get(claim.uid) is None, timeout=5)


def test_the_old_stopping_removes_only_its_own_sockets_and_no_slices(node: Node) -> None:
    old = node.driver(OLD)
    node.kubelet.wait_registered(DRIVER)
    new = node.driver(NEW)
    node.kubelet.wait_registered(DRIVER, count=2)
    old.stop()
    node.running.remove(old)
    assert not node.dra_path(OLD).exists() and not node.registration_path(OLD).exists()
    assert node.dra_path(NEW).is_socket() and node.registration_path(NEW).is_socket()
    node.kubelet.wait_for(
        lambda: len(node.kubelet.deregistrations) == 1, 5, "the old instance deregistered"
    )
    current = node.kubelet.current(DRIVER)
    assert current is not None and current.endpoint == str(node.dra_path(NEW))
    claim = node.claim("vm-a")
    assert node.kubelet.node_prepare_resources([claim])[claim.uid].error == ""
    time.sleep(3 * node.kubelet.wipe_delay)
    assert node.wiped == [] and node.apiserver.slices(NODE, DRIVER)
    # The last instance going is what wipes them, after the delay.
    new.stop()
    node.running.remove(new)
    node.kubelet.wait_for(lambda: node.wiped == [DRIVER], 5, "slices wiped after the last")


def test_a_server_at_the_same_path_stops_without_removing_the_others_socket() -> None:
    """Two single-instance drivers (no pod UID) share the names: the one stopping leaves the
    socket the other made in its place."""
    with short_directory() as base:
        path = base / "dra.sock"
        first = GrpcSocketServer(path, lambda server: None)
        second = GrpcSocketServer(path, lambda server: None)
        first.start()
        second.start()
        try:
            first.stop()
            assert path.is_socket() and second.present
            with grpc.insecure_channel(f"unix:{path}") as channel:
                grpc.channel_ready_future(channel).result(timeout=5)
        finally:
            second.stop()
        assert not path.exists()


def test_concurrent_prepares_on_both_never_bind_one_device_twice(node: Node) -> None:
    old = node.driver(OLD)
    node.kubelet.wait_registered(DRIVER)
    new = node.driver(NEW)
    node.kubelet.wait_registered(DRIVER, count=2)
    first, second = node.claim("vm-a"), node.claim("vm-b")
    barrier = threading.Barrier(2)

    def prepare(path: Path, claim: Claim) -> str:
        barrier.wait(timeout=10)
        return prepare_on(path, claim)

    with ThreadPoolExecutor(2) as pool:
        calls = [
            pool.submit(prepare, node.dra_path(OLD), first),
            pool.submit(prepare, node.dra_path(NEW), second),
        ]
        answers = [call.result(timeout=60) for call in calls]
    # One got it; the other is refused naming the device and the claim that has it.
    (won,) = [c for c, error in zip((first, second), answers, strict=True) if error == ""]
    (refused,) = [error for error in answers if error]
    assert f"{GPU_DEVICE} ({GPU})" in refused and won.uid in refused
    binds = [w for w in node.kernel.writes if w == ("sys/bus/pci/drivers/vfio-pci/bind", GPU)]
    assert len(binds) == 1
    assert node.drivers() == ON_VFIO and len(node.records()) == 1
    assert {old.store.get(first.uid), new.store.get(second.uid)} != {None}


@pytest.mark.parametrize("node", [two_gpus_in_one_group()], indirect=True, ids=["two-gpus"])
def test_both_publish_the_same_pool_and_settle(node: Node) -> None:
    node.driver(OLD)
    node.kubelet.wait_registered(DRIVER)
    node.driver(NEW)
    node.kubelet.wait_registered(DRIVER, count=2)

    def published() -> list[str]:
        return sorted(
            d["name"]
            for s in node.apiserver.slices(NODE, DRIVER)
            for d in s["spec"]["devices"]
            if slot_index(d["name"]) is None
        )

    both = sorted([GPU_DEVICE, "pci-0000-3b-00-2"])
    assert node.apiserver.wait_until(lambda: published() == both, timeout=10), published()
    claim = node.claim("vm-a")
    assert prepare_on(node.dra_path(OLD), claim) == ""

    def slice_writes() -> int:
        return sum(
            1
            for r in node.apiserver.requests
            if r.method in ("POST", "PUT", "DELETE") and "resourceslices" in r.path
        )

    # Both follow the claim records within their interval; then neither rewrites the other
    # (two that fought would wake each other's watch with every write, for good).
    deadline = time.monotonic() + 15
    while True:
        before = slice_writes()
        time.sleep(1.5)
        if slice_writes() == before:
            break
        assert time.monotonic() < deadline, "the two instances keep rewriting the slices"
    # The prepared GPU's group companion stays hidden: the new instance follows the old's claim.
    assert published() == [GPU_DEVICE]


def test_a_fatal_error_before_the_new_instance_started_keeps_its_taint_and_no_fight(
    node: Node,
) -> None:
    old = node.driver(OLD)
    node.kubelet.wait_registered(DRIVER)
    report_aer_error(node.root, GPU, fatal=True)

    def tainted() -> bool:
        return any(
            d.get("taints")
            for s in node.apiserver.slices(NODE, DRIVER)
            for d in s["spec"]["devices"]
            if d["name"] == GPU_DEVICE
        )

    assert node.apiserver.wait_until(tainted, timeout=10)
    new = node.driver(NEW)
    node.kubelet.wait_registered(DRIVER, count=2)
    # The error came before the new instance looked, and no reset since: it is as unhealthy to
    # the new one as to the old. Two that disagreed would rewrite the taint in and out for good.
    assert _settled(node), "the two instances keep rewriting the slices"
    assert tainted()
    (judged,) = [h for h in new.device_health if h.device == GPU_DEVICE]
    assert judged.health is Health.UNHEALTHY, judged
    assert [h.health for h in old.device_health if h.device == GPU_DEVICE] == [Health.UNHEALTHY]


def test_a_device_unusable_before_the_new_instance_started_and_no_fight(node: Node) -> None:
    old = node.driver(OLD)
    node.kubelet.wait_registered(DRIVER)
    # Out of its IOMMU group: the old instance keeps publishing it, unusable and tainted.
    (node.root / "sys/bus/pci/devices" / GPU / "iommu_group").unlink()
    (node.root / "sys/kernel/iommu_groups/14/devices" / GPU).unlink()

    def gpu_entries() -> list[dict[str, object]]:
        return [
            d
            for s in node.apiserver.slices(NODE, DRIVER)
            for d in s["spec"]["devices"]
            if d["name"] == GPU_DEVICE
        ]

    assert node.apiserver.wait_until(
        lambda: [bool(d.get("taints")) for d in gpu_entries()] == [True], timeout=10
    ), (old.device_health, gpu_entries())
    node.driver(NEW)
    node.kubelet.wait_registered(DRIVER, count=2)
    assert _settled(node), "the two instances keep rewriting the slices"
    assert [bool(d.get("taints")) for d in gpu_entries()] == [True]
    assert [h.health for h in old.device_health if h.device == GPU_DEVICE] == [Health.UNHEALTHY]


def _settled(node: Node) -> bool:
    """Whether the slice writes stop (two writers waking each other never do)."""

    def slice_writes() -> int:
        return sum(
            1
            for r in node.apiserver.requests
            if r.method in ("POST", "PUT", "DELETE") and "resourceslices" in r.path
        )

    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        before = slice_writes()
        time.sleep(1.5)
        if slice_writes() == before:
            return True
    return False


def test_an_unprepare_on_one_stops_a_prepare_whose_read_is_under_way_on_the_other(
    node: Node, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The kubelet gave up on a slow NodePrepare at the new instance and, the pod gone,
    unprepares at the old one (the new one's registration went away meanwhile, say) while the
    claim GET is still under way: the prepare must not then bind and record the claim."""
    node.driver(OLD)
    node.kubelet.wait_registered(DRIVER)
    node.driver(NEW)
    node.kubelet.wait_registered(DRIVER, count=2)
    claim = node.claim("vm-a")
    inside, go = threading.Event(), threading.Event()
    serve = node.apiserver.take_failure

    def held(method: str, path: str) -> object:
        if method == "GET" and path.endswith("/resourceclaims/vm-a"):
            inside.set()
            go.wait(30)
        return serve(method, path)

    monkeypatch.setattr(node.apiserver, "take_failure", held)
    with ThreadPoolExecutor(1) as pool:
        preparing = pool.submit(prepare_on, node.dra_path(NEW), claim)
        assert inside.wait(10), "the new instance never asked for the claim"
        with grpc.insecure_channel(f"unix:{node.dra_path(OLD)}") as channel:
            request = v1_pb2.NodeUnprepareResourcesRequest(
                claims=[v1_pb2.Claim(namespace=claim.namespace, uid=claim.uid, name=claim.name)]
            )
            unprepared = v1_grpc.DRAPluginStub(channel).NodeUnprepareResources(request, timeout=30)
        assert unprepared.claims[claim.uid].error == ""
        go.set()
        answer = preparing.result(timeout=30)
    assert "unprepared while its claim was being read" in answer
    assert node.drivers() == BEFORE and node.records() == [] and node.journal() == []
    # A later prepare (the kubelet's, for a pod that still needs it) goes through.
    monkeypatch.undo()
    assert node.kubelet.node_prepare_resources([claim])[claim.uid].error == ""


# Start-up recovery beside a living instance -------------------------------------------------


def test_the_new_instance_waits_for_a_bind_the_old_is_doing_and_never_undoes_it(
    node: Node,
) -> None:
    """The old instance is alive in the middle of a bind (holding the serialize lock); the new
    one's start-up recovery waits for it and finds the bind finished, not a dead run's."""
    node.driver(OLD)
    node.kubelet.wait_registered(DRIVER)
    claim = node.claim("vm-a")
    reached, go = threading.Event(), threading.Event()

    def hold_the_unbind(path: str, _text: str) -> bool:
        if path == f"sys/bus/pci/devices/{GPU}/driver/unbind" and not reached.is_set():
            reached.set()
            go.wait(30)
        return False

    node.kernel.fail(hold_the_unbind)
    with ThreadPoolExecutor(2) as pool:
        preparing = pool.submit(prepare_on, node.dra_path(OLD), claim)
        assert reached.wait(10), "the old instance never reached the unbind"
        assert [e["phase"] for e in node.journal()] == ["binding"]
        new = node.driver(NEW, start=False)
        started = pool.submit(new.start)
        time.sleep(1.0)
        waited = not started.done()
        writes = len(node.kernel.writes)
        go.set()
        assert preparing.result(timeout=30) == ""
        started.result(timeout=30)
    assert waited, "the new instance's recovery did not wait for the old one's bind"
    # Nothing was written while the old one was held at its unbind.
    assert node.kernel.writes[writes - 1][0] == f"sys/bus/pci/devices/{GPU}/driver/unbind"
    (entry,) = node.journal()
    assert entry["phase"] == "bound" and entry["writtenBy"]["instance"] == OLD  # type: ignore[index]
    assert node.drivers() == ON_VFIO and node.records() == [claim.uid]
    assert new.store.get(claim.uid) is not None
    # Later calls go to the new one, which gives the old one's bind back.
    node.kubelet.wait_registered(DRIVER, count=2)
    assert node.kubelet.node_unprepare_resources([claim]) == {claim.uid: ""}
    assert node.drivers() == BEFORE and node.journal() == []


CHILD = """
import os, signal, sys, threading
from dataclasses import replace
from pathlib import Path

sys.path[:0] = ["tests", "tests/dra"]
import dra.driver
import dra.state
from dra.api import ResourceApi
from dra.driver import DraDriver
from dra.health import Health
from dra_kit import driver_settings
from hostdev.binding.bind import HostAccess
from hostdev.labels.kube_client import load_api_client
from hostdev.pciids import PciIds
from sim.kernel import KernelSimulator
from test_dra_on_demand import ON_DEMAND

root, base, kubeconfig, uid, count = sys.argv[1:6]
native = dict(item.split("=") for item in sys.argv[6:])
kernel = KernelSimulator(Path(root), native, die=lambda: os.kill(os.getpid(), signal.SIGKILL))
dra.driver.HostAccess = lambda root, host_root: HostAccess(
    root=root, writer=kernel, runner=kernel.run
)
settings = replace(driver_settings(Path(root), Path(base), 0.2), instance_uid=uid)
api = ResourceApi(load_api_client(Path(kubeconfig)))
DraDriver(settings, ON_DEMAND, PciIds(None), api).start()
kernel.kill_after(int(count))
print("serving", flush=True)
threading.Event().wait()
"""


@pytest.mark.parametrize("killed_after", [1, 2, 3, 5], ids=lambda n: f"after-{n}-writes")
@pytest.mark.parametrize("then", ["retried", "unprepared"])
def test_the_old_killed_mid_bind_strands_nothing_while_the_new_runs(
    node: Node, killed_after: int, then: str
) -> None:
    """The old instance, a process of its own, dies by SIGKILL after `killed_after` writes of a
    bind; the new one, running all along, puts the functions back at the kubelet's next call
    for the claim: bound for it when the kubelet retries, where they began when it unprepares."""
    kubeconfig = node.apiserver.write_kubeconfig(node.base / "kubeconfig")
    lock = node.root / "proc/driver/nvidia/gpus" / GPU / "unbindLock"
    unlocked = lock.read_text()
    native = [f"{bdf}={driver}" for bdf, driver in node.kernel.native.items()]
    argv = [
        sys.executable, "-c", CHILD, str(node.root), str(node.base), str(kubeconfig), OLD,
        str(killed_after), *native,
    ]  # fmt: skip
    old = subprocess.Popen(
        argv, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        assert old.stdout is not None and old.stdout.readline() == "serving\n", old.stderr
        node.kubelet.wait_registered(DRIVER, timeout=20)
        node.driver(NEW)
        node.kubelet.wait_registered(DRIVER, count=2)
        claim = node.claim("vm-a")
        with pytest.raises(grpc.RpcError):
            prepare_on(node.dra_path(OLD), claim)
        assert old.wait(timeout=30) == -signal.SIGKILL
    finally:
        old.kill()
        old.communicate()
    (entry,) = node.journal()
    assert entry["phase"] == "binding"
    assert entry["writtenBy"] == {"pid": old.pid, "instance": OLD}
    if then == "retried":
        assert node.kubelet.node_prepare_resources([claim])[claim.uid].error == ""
        assert node.drivers() == ON_VFIO and node.records() == [claim.uid]
        (entry,) = node.journal()
        assert entry["phase"] == "bound" and entry["writtenBy"]["instance"] == NEW  # type: ignore[index]
        assert node.kubelet.node_unprepare_resources([claim]) == {claim.uid: ""}
    else:
        assert node.kubelet.node_unprepare_resources([claim]) == {claim.uid: ""}
    assert node.drivers() == BEFORE and node.journal() == [] and node.records() == []
    # The NVIDIA driver's unbind lock is let go too.
    assert lock.read_text() == unlocked


# The lock and the records ----------------------------------------------------------------


def test_a_lock_held_too_long_names_its_holder(tmp_path: Path) -> None:
    path = tmp_path / "plugins" / DRIVER / "serialize.lock"
    holder = SerializeLock(path, OLD)
    waiter = SerializeLock(path, NEW, wait_seconds=0.2)
    with holder.hold():
        start = time.monotonic()
        with pytest.raises(SerializeLockBusy) as busy, waiter.hold():
            pass
        assert time.monotonic() - start >= 0.2
    assert f'"instance": "{OLD}"' in str(busy.value) and str(os.getpid()) in str(busy.value)
    assert "the kubelet retries" in str(busy.value)
    with waiter.hold():
        pass


def test_a_waiter_names_the_holder_of_now_not_the_one_before(tmp_path: Path) -> None:
    """The file keeps the last holder's name after it lets go; whoever takes the lock next
    writes its own, longer or shorter."""
    path = tmp_path / "serialize.lock"
    old, new = SerializeLock(path, OLD), SerializeLock(path, "")
    waiter = SerializeLock(path, NEW, wait_seconds=0.05)
    for holder, name in ((old, OLD), (new, "(single)"), (old, OLD), (old, OLD)):
        with holder.hold(), pytest.raises(SerializeLockBusy) as busy, waiter.hold():
            pass
        said = str(busy.value)
        assert f'"instance": "{name}"}}) has held' in said, said


def test_a_lock_file_removed_under_a_waiter_is_not_two_locks(tmp_path: Path) -> None:
    """The kubelet wiping its plugin directory while one instance holds the lock: a waiter
    that got the old file's lock takes the new file's instead of believing it alone."""
    path = tmp_path / "serialize.lock"
    first, second = SerializeLock(path, OLD), SerializeLock(path, NEW)
    inside: list[str] = []
    with first.hold():
        waiter = threading.Thread(target=lambda: _enter(second, inside, NEW))
        waiter.start()
        time.sleep(0.1)
        path.unlink()
        inside.append(OLD)
        time.sleep(0.1)
        assert inside == [OLD], "the waiter got in while the holder was inside"
    waiter.join(5)
    assert inside == [OLD, NEW]


def _enter(lock: SerializeLock, inside: list[str], name: str) -> None:
    with lock.hold():
        inside.append(name)


def _record(uid: str) -> PreparedClaim:
    device = PreparedDevice("gpu", NODE, "pci-0000-3b-00-0", Bdf.parse(GPU), ("x",), 14)
    return PreparedClaim(uid, "vms", f"claim-{uid}", (device,), ())


def test_a_refresh_reads_only_the_records_another_instance_changed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    mine, theirs = (ClaimStore(tmp_path, tmp_path / "run") for _ in "ab")
    mine.load()
    theirs.load()
    uids = [f"a1b2c3d4-0000-4000-8000-{n:012d}" for n in range(100)]
    for uid in uids:
        theirs.save(_record(uid))
    read: list[str] = []
    real = dra.state._read_record

    def counting(path: Path) -> PreparedClaim:
        read.append(path.stem)
        return real(path)

    monkeypatch.setattr(dra.state, "_read_record", counting)
    assert mine.refresh() and len(read) == 100
    read.clear()
    assert not mine.refresh() and read == []
    theirs.forget(uids[0])
    theirs.save(replace(_record(uids[1]), name="renamed"))
    assert mine.refresh() and read == [uids[1]]
    assert mine.get(uids[0]) is None and mine.get(uids[1]) == theirs.get(uids[1])
    # Our own saves are not read back.
    read.clear()
    mine.save(_record(uids[2]))
    assert not mine.refresh() and read == []
