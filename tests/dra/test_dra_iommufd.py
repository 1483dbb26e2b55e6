"""The iommufd fd through DRA: the driver publishes the node's iommufd slots, and a claim on one,
shaped as kube-scheduler makes it for a launcher pod asking for `devices.kubevirt.io/iommufd: 1`,
gets what the device plugin's iommufd Allocate gives: a prepared /dev/iommu fd served once over a
socket owned by the launcher's user, expiring, mounted by the claim's CDI spec at
/var/run/kubevirt/iommufd.sock. Through the whole driver: the kubelet stand-in over real gRPC,
the real `kubernetes` client against the API server stand-in; a real SIGKILL for the crashes.

The simulated node's /dev/iommu is a regular file: the fd the socket hands is checked to be that
file opened afresh, and the IOMMU_OPTION ioctl (tested on its own in
tests/deviceplugin/test_dp_handoff.py) is seen refused by it, which the hand-off logs and serves
through as the device plugin's does."""

from __future__ import annotations

import json
import logging
import os
import signal
import stat
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import grpc
import kubernetes.client
import pytest

from dra.driver import DriverSettings
from dra.iommufd_slots import SLOT_ATTRIBUTE
from dra_cdi_schema_kit import validate_cdi_spec
from dra_kit import DRIVER, NODE, driver_settings, running_driver, short_directory
from handoff_kit import fds_open_on, receive_iommufd, wait_until
from hostdev.config import IOMMUFD_RESOURCE, PluginConfig, default_config
from hostdev.iommufd_handoff import CONTAINER_SOCKET_PATH
from k8s_schema_kit import assert_valid
from sim.apiserver import AllocatedDevice, ApiServerStandIn
from sim.dra_kubelet import Claim, DRAKubeletStandIn
from test_dra_extended_resources import POD, runtime_env, scheduler_claim

REPO = Path(__file__).resolve().parents[2]
IOMMUFD_CLASS = "devices.kubevirt.io.iommufd"
# The launcher's compute container (container 2) asks, sorted: cpu, devices.kubevirt.io/iommufd,
# …/kvm, …/tun, …/vhost-net, ephemeral-storage, memory, nvidia.com/2330.
IOMMUFD_REQUEST = "container-2-request-1"
GPU_REQUEST = "container-2-request-7"
GPU = "pci-0000-18-00-0"
SLOTS = 4


def config_with(**iommufd: Any) -> PluginConfig:
    config = default_config()
    return replace(config, iommufd=replace(config.iommufd, slots=SLOTS, **iommufd))


@pytest.fixture
def node(
    scenario_root: Callable[[str], Path], apiserver: ApiServerStandIn
) -> Iterator[tuple[Path, Path]]:
    """The simulated node's root, and a short base directory for the driver's sockets."""
    apiserver.put_node(NODE)
    with short_directory() as base:
        yield scenario_root("hgx-h100"), base


def launcher_claim(
    apiserver: ApiServerStandIn, name: str, allocated: list[tuple[str, str]]
) -> Claim:
    """The claim the scheduler makes for the launcher pod's extended resources, allocated."""
    requests: dict[str, int] = {}
    for request, _ in allocated:
        requests[request] = requests.get(request, 0) + 1
    classes = {r: IOMMUFD_CLASS for r in requests if r != GPU_REQUEST}
    claim = scheduler_claim(name, requests, classes)
    assert_valid(claim, "1.36")
    assert_valid(claim, "1.37")
    apiserver.put_claim(claim)
    stored = apiserver.set_allocation(
        "vms", name, [AllocatedDevice(r, DRIVER, NODE, d) for r, d in allocated], NODE
    )
    return Claim("vms", stored["metadata"]["uid"], name)


def cdi_spec(settings: DriverSettings, claim: Claim) -> dict[str, Any]:
    spec: dict[str, Any] = json.loads(
        (settings.cdi_dir / f"{DRIVER}-claim_{claim.uid}.json").read_text()
    )
    validate_cdi_spec(spec)
    return spec


def handoff_mount(spec: dict[str, Any], cdi_ids: list[str]) -> dict[str, Any]:
    """The one mount at virt-launcher's socket path among the entries `cdi_ids` name."""
    names = {i.partition("=")[2] for i in cdi_ids}
    mounts: list[dict[str, Any]] = [
        m
        for d in spec["devices"]
        if d["name"] in names
        for m in d["containerEdits"].get("mounts", [])
        if m["containerPath"] == CONTAINER_SOCKET_PATH
    ]
    (mount,) = mounts
    return mount


def ids_of(answer: Any, request: str) -> list[str]:
    return [i for d in answer.devices if request in d.request_names for i in d.cdi_device_ids]


def socket_of(settings: DriverSettings, claim: Claim, answer: Any) -> Path:
    """The host path of the socket the claim's CDI spec mounts for the iommufd request."""
    return Path(
        handoff_mount(cdi_spec(settings, claim), ids_of(answer, IOMMUFD_REQUEST))["hostPath"]
    )


def test_the_slots_are_published_as_what_they_are(
    node: tuple[Path, Path], apiserver: ApiServerStandIn, api_client: kubernetes.client.ApiClient
) -> None:
    root, base = node
    with running_driver(root, base, api_client, config_with()):

        def slots() -> list[dict[str, Any]]:
            return [
                d
                for s in apiserver.slices(NODE, DRIVER)
                for d in s["spec"]["devices"]
                if d["name"].startswith("iommufd-")
            ]

        assert apiserver.wait_until(lambda: len(slots()) == SLOTS)
        assert [d["name"] for d in slots()] == [f"iommufd-{i}" for i in range(SLOTS)]
        assert all(
            d["attributes"]
            == {"resourceName": {"string": IOMMUFD_RESOURCE}, SLOT_ATTRIBUTE: {"bool": True}}
            for d in slots()
        )
        for item in apiserver.slices(NODE, DRIVER):
            assert_valid(item, "1.36")
            assert_valid(item, "1.37")


def test_a_launcher_pods_claim_gets_the_fd_once_as_from_the_device_plugin(
    node: tuple[Path, Path],
    apiserver: ApiServerStandIn,
    api_client: kubernetes.client.ApiClient,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="hostdev.iommufd_handoff")
    root, base = node
    with running_driver(root, base, api_client, config_with()) as (settings, kubelet):
        claim = launcher_claim(
            apiserver,
            f"{POD}-extended-resources-4x7kq",
            [(GPU_REQUEST, GPU), (IOMMUFD_REQUEST, "iommufd-2")],
        )
        answer = kubelet.node_prepare_resources([claim])[claim.uid]
        assert answer.error == ""
        spec = cdi_spec(settings, claim)
        # The compute container's GPU keeps the device plugin's variable; the socket comes with
        # the iommufd request only, with /dev/iommu as the plugin's Allocate gives it.
        assert runtime_env(settings.cdi_dir, ids_of(answer, GPU_REQUEST)) == {
            "PCI_RESOURCE_NVIDIA_COM_2330": "0000:18:00.0"
        }
        with pytest.raises(ValueError):
            handoff_mount(spec, ids_of(answer, GPU_REQUEST))
        mount = handoff_mount(spec, ids_of(answer, IOMMUFD_REQUEST))
        (entry,) = [d for d in spec["devices"] if mount in d["containerEdits"].get("mounts", [])]
        assert entry["containerEdits"]["deviceNodes"] == [{"path": "/dev/iommu"}]
        socket_path = Path(mount["hostPath"])
        assert socket_path.parent == settings.state_dir / "iommufd"
        info = socket_path.stat()
        assert stat.S_ISSOCK(info.st_mode) and stat.S_IMODE(info.st_mode) == 0o660
        assert (info.st_uid, info.st_gid) == (107, 107)
        # As virt-launcher takes it: one fd, /dev/iommu opened for this claim.
        iommu = (root / "dev/iommu").resolve()
        fd = receive_iommufd(socket_path)
        try:
            assert os.path.samestat(os.fstat(fd), iommu.stat())
            assert fd in fds_open_on(iommu)
        finally:
            os.close(fd)
        assert "IOMMU_OPTION RLIMIT_MODE=per-process refused" in caplog.text
        # Served once: the socket is gone, and the driver holds no fd on /dev/iommu.
        wait_until(lambda: not socket_path.exists() and not fds_open_on(iommu))
        # A kubelet retry gets the same answer and no second hand-off.
        again = kubelet.node_prepare_resources([claim])[claim.uid]
        assert again.error == "" and not socket_path.exists()
        assert kubelet.node_unprepare_resources([claim]) == {claim.uid: ""}
        assert not (settings.cdi_dir / f"{DRIVER}-claim_{claim.uid}.json").exists()


def test_a_handoff_nobody_takes_expires_and_unprepare_takes_one_back(
    node: tuple[Path, Path], apiserver: ApiServerStandIn, api_client: kubernetes.client.ApiClient
) -> None:
    root, base = node
    iommu = (root / "dev/iommu").resolve()
    config = config_with(handoff_timeout_seconds=0.5)
    with running_driver(root, base, api_client, config) as (settings, kubelet):
        expiring = launcher_claim(apiserver, "expiring", [(IOMMUFD_REQUEST, "iommufd-0")])
        answer = kubelet.node_prepare_resources([expiring])[expiring.uid]
        socket_path = Path(
            handoff_mount(cdi_spec(settings, expiring), ids_of(answer, IOMMUFD_REQUEST))["hostPath"]
        )
        assert socket_path.exists() and fds_open_on(iommu)
        wait_until(lambda: not socket_path.exists() and not fds_open_on(iommu))
        assert kubelet.node_unprepare_resources([expiring]) == {expiring.uid: ""}
    with running_driver(root, base, api_client, config_with()) as (settings, kubelet):
        withdrawn = launcher_claim(apiserver, "withdrawn", [(IOMMUFD_REQUEST, "iommufd-1")])
        answer = kubelet.node_prepare_resources([withdrawn])[withdrawn.uid]
        socket_path = Path(
            handoff_mount(cdi_spec(settings, withdrawn), ids_of(answer, IOMMUFD_REQUEST))[
                "hostPath"
            ]
        )
        assert socket_path.exists()
        assert kubelet.node_unprepare_resources([withdrawn]) == {withdrawn.uid: ""}
        assert not socket_path.exists()
        wait_until(lambda: not fds_open_on(iommu))
        assert list((settings.state_dir / "iommufd").iterdir()) == []


def test_two_slots_of_one_request_share_the_handoff_and_two_requests_are_refused(
    node: tuple[Path, Path], apiserver: ApiServerStandIn, api_client: kubernetes.client.ApiClient
) -> None:
    root, base = node
    with running_driver(root, base, api_client, config_with()) as (settings, kubelet):
        shared = launcher_claim(
            apiserver, "shared", [(IOMMUFD_REQUEST, "iommufd-0"), (IOMMUFD_REQUEST, "iommufd-1")]
        )
        answer = kubelet.node_prepare_resources([shared])[shared.uid]
        assert answer.error == ""
        (cdi_id,) = set(ids_of(answer, IOMMUFD_REQUEST))
        assert len(answer.devices) == 2
        mount = handoff_mount(cdi_spec(settings, shared), [cdi_id])
        assert Path(mount["hostPath"]).exists()
        assert kubelet.node_unprepare_resources([shared]) == {shared.uid: ""}
        sidecar = "container-3-request-0"
        two = launcher_claim(
            apiserver, "two", [(IOMMUFD_REQUEST, "iommufd-0"), (sidecar, "iommufd-1")]
        )
        refused = kubelet.node_prepare_resources([two])[two.uid].error
        assert f"iommufd slots for requests {IOMMUFD_REQUEST}, {sidecar}" in refused
        assert "only one container of a pod can receive the prepared iommufd fd" in refused
        assert not (settings.cdi_dir / f"{DRIVER}-claim_{two.uid}.json").exists()
        assert list((settings.state_dir / "iommufd").iterdir()) == []
        beyond = launcher_claim(apiserver, "beyond", [(IOMMUFD_REQUEST, f"iommufd-{SLOTS}")])
        refused = kubelet.node_prepare_resources([beyond])[beyond.uid].error
        assert f"is not one of the {SLOTS} iommufd slots this driver publishes" in refused


CHILD = """
import os, signal, sys, threading
from dataclasses import replace
from pathlib import Path

sys.path[:0] = ["tests", "tests/dra"]
import dra.state
from dra.api import ResourceApi
from dra.driver import DraDriver
from dra_kit import driver_settings
from hostdev.config import default_config
from hostdev.labels.kube_client import load_api_client
from hostdev.pciids import PciIds

root, base, kubeconfig, slots, killed_at = sys.argv[1:6]
if killed_at == "record":
    # Killed once the socket is bound and the CDI spec written, before the claim is recorded.
    dra.state.ClaimStore.save = lambda self, claim: os.kill(os.getpid(), signal.SIGKILL)
config = default_config()
config = replace(config, iommufd=replace(config.iommufd, slots=int(slots)))
settings = driver_settings(Path(root), Path(base), 0.2)
api = ResourceApi(load_api_client(Path(kubeconfig)))
DraDriver(settings, config, PciIds(None), api).start()
print("serving", flush=True)
threading.Event().wait()
"""


@pytest.mark.parametrize("killed_at", ["record", "prepared"])
def test_a_driver_killed_between_steps_strands_nothing(
    node: tuple[Path, Path],
    apiserver: ApiServerStandIn,
    api_client: kubernetes.client.ApiClient,
    killed_at: str,
) -> None:
    """A driver process dies by SIGKILL before it records the claim (its socket is bound, its CDI
    spec written), or after it prepared it, before the launcher took the fd. The next one serves
    a recorded claim's waiting socket again, with a fresh fd, and removes an unrecorded one; the
    kubelet's retry or unprepare leaves nothing behind."""
    root, base = node
    iommu = (root / "dev/iommu").resolve()
    kubeconfig = apiserver.write_kubeconfig(base / "kubeconfig")
    argv = [
        sys.executable,
        "-c",
        CHILD,
        str(root),
        str(base),
        str(kubeconfig),
        str(SLOTS),
        killed_at,
    ]
    child = subprocess.Popen(
        argv, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    settings = driver_settings(root, base, 0.2)
    socket_dir = settings.state_dir / "iommufd"
    try:
        assert child.stdout is not None and child.stdout.readline() == "serving\n", child.stderr
        with DRAKubeletStandIn(base / "kubelet", info_poll_interval=None) as kubelet:
            kubelet.wait_registered(DRIVER, timeout=20)
            claim = launcher_claim(apiserver, "vm-a", [(IOMMUFD_REQUEST, "iommufd-0")])
            if killed_at == "record":
                with pytest.raises(grpc.RpcError):
                    kubelet.node_prepare_resources([claim])
            else:
                assert kubelet.node_prepare_resources([claim])[claim.uid].error == ""
                child.send_signal(signal.SIGKILL)
            assert child.wait(timeout=30) == -signal.SIGKILL
    finally:
        child.kill()
        child.communicate()
    (left,) = socket_dir.iterdir()
    assert stat.S_ISSOCK(left.lstat().st_mode)
    records = sorted(p.stem for p in (settings.state_dir / "claims").glob("*.json"))
    assert records == ([claim.uid] if killed_at == "prepared" else [])
    with running_driver(root, base, api_client, config_with()) as (settings, kubelet):
        if killed_at == "prepared":
            # Its pod may not have started yet: the socket is served again, with a new fd.
            fd = receive_iommufd(left)
            os.close(fd)
        else:
            assert list(socket_dir.iterdir()) == []
            answer = kubelet.node_prepare_resources([claim])[claim.uid]
            assert answer.error == ""
            assert (
                Path(
                    handoff_mount(cdi_spec(settings, claim), ids_of(answer, IOMMUFD_REQUEST))[
                        "hostPath"
                    ]
                )
                == left
            )
            assert left.exists()
        assert kubelet.node_unprepare_resources([claim]) == {claim.uid: ""}
        assert list(socket_dir.iterdir()) == []
        assert not (settings.cdi_dir / f"{DRIVER}-claim_{claim.uid}.json").exists()
        wait_until(lambda: not fds_open_on(iommu))


def test_a_node_without_dev_iommu_refuses_the_claim_naming_the_fix(
    node: tuple[Path, Path], apiserver: ApiServerStandIn, api_client: kubernetes.client.ApiClient
) -> None:
    root, base = node
    (root / "dev/iommu").unlink()
    with running_driver(root, base, api_client, config_with()) as (settings, kubelet):
        claim = launcher_claim(apiserver, "vm-a", [(IOMMUFD_REQUEST, "iommufd-0")])
        refused = kubelet.node_prepare_resources([claim])[claim.uid].error
        assert f"claim vms/vm-a (uid {claim.uid}): cannot prepare its iommufd fd:" in refused
        assert "dev/iommu does not exist: the kernel needs CONFIG_IOMMUFD" in refused
        assert not (settings.cdi_dir / f"{DRIVER}-claim_{claim.uid}.json").exists()
        assert list((settings.state_dir / "iommufd").iterdir()) == []
        assert kubelet.node_unprepare_resources([claim]) == {claim.uid: ""}
