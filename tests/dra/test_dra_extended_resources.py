"""Claims the scheduler makes for a pod's extended resources backed by DRA (KEP-5004), prepared
through the whole driver: the kubelet stand-in over real gRPC, the real `kubernetes` client
against the API server stand-in. The claim is written exactly as kube-scheduler writes it, and
checked against the 1.36 and 1.37 schemas; its CDI spec, applied the way the runtime's CDI
library applies it, gives each container `PCI_RESOURCE_<NAME>` with that container's devices,
as the device plugin's Allocate does."""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import kubernetes.client
import pytest

from dra.cdi import build_request_env
from dra.claims import EXTENDED_RESOURCE_CLAIM_ANNOTATION, ClaimRef, parse_allocation
from dra.devices import DraDevice
from dra.driver import DriverSettings
from dra_cdi_schema_kit import validate_cdi_spec
from dra_kit import DRIVER, NODE, running_driver, short_directory
from hostdev.bdf import Bdf
from hostdev.config import default_config
from hostdev.naming import pci_resource_env
from k8s_schema_kit import assert_valid
from sim.apiserver import AllocatedDevice, ApiServerStandIn
from sim.dra_kubelet import Claim, DRAKubeletStandIn

POD = "virt-launcher-vmi-gpu-x2v7q"
POD_UID = "6b1f3c52-9d7e-4b8a-a0e4-3f1c2d5e7a90"
RESOURCE = "nvidia.com/2330"
"""The default configuration's name for an H100 SXM5 without pci.ids, as the plugin names it."""
CLASS = "nvidia.com-2330"
# A launcher pod has two init containers (container-disk-binary, volumecontainerdisk-init), so
# `compute` is container 2; its requests sorted are cpu, devices.kubevirt.io/kvm, …/tun,
# …/vhost-net, ephemeral-storage, memory, nvidia.com/2330: the GPUs are request 6.
COMPUTE_REQUEST = "container-2-request-6"
SIDECAR_REQUEST = "container-3-request-2"


def scheduler_claim(
    name: str, requests: dict[str, int], classes: dict[str, str] | None = None
) -> dict[str, Any]:
    """The claim as kube-scheduler creates it at PreBind (extendeddynamicresources.go:
    preFilterExtendedResources, createRequestsAndMappings, createExtendedResourceClaimInAPI)
    and reserves it for the pod; `name` is what the API server made of the generateName, and
    each request asks for the class `classes` names for it (the GPUs' by default)."""
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {
            "name": name,
            "generateName": f"{POD}-extended-resources-",
            "namespace": "vms",
            "annotations": {EXTENDED_RESOURCE_CLAIM_ANNOTATION: "true"},
            "ownerReferences": [
                {"apiVersion": "v1", "kind": "Pod", "name": POD, "uid": POD_UID, "controller": True}
            ],
            "finalizers": ["resource.kubernetes.io/delete-protection"],
        },
        "spec": {
            "devices": {
                "requests": [
                    {
                        "name": request,
                        "exactly": {
                            "deviceClassName": (classes or {}).get(request, CLASS),
                            "allocationMode": "ExactCount",
                            "count": count,
                        },
                    }
                    for request, count in sorted(requests.items())
                ]
            }
        },
        "status": {"reservedFor": [{"resource": "pods", "name": POD, "uid": POD_UID}]},
    }


def runtime_env(cdi_dir: Path, cdi_ids: Sequence[str]) -> dict[str, str]:
    """The environment a container gets from `cdi_ids`, merged as the CDI library merges it
    (tags.cncf.io/container-device-interface pkg/cdi/cache.go InjectDevices: a spec's own edits
    before its first device's, then each device's; container-edits.go Apply: a variable set again
    replaces the earlier value)."""
    specs = [json.loads(p.read_text()) for p in sorted(cdi_dir.glob("*.json"))]
    env: dict[str, str] = {}
    applied: set[int] = set()
    for cdi_id in cdi_ids:
        kind, _, name = cdi_id.partition("=")
        (index, entry), *_ = [
            (i, d)
            for i, s in enumerate(specs)
            if s["kind"] == kind
            for d in s["devices"]
            if d["name"] == name
        ]
        edits = []
        if index not in applied:
            applied.add(index)
            edits += specs[index].get("containerEdits", {}).get("env", [])
        edits += entry["containerEdits"].get("env", [])
        env |= dict(e.split("=", 1) for e in edits)
    return env


@pytest.fixture
def driver(
    scenario_root: Any, apiserver: ApiServerStandIn, api_client: kubernetes.client.ApiClient
) -> Iterator[tuple[DriverSettings, DRAKubeletStandIn]]:
    apiserver.put_node(NODE)
    root = scenario_root("hgx-h100")
    with short_directory() as base, running_driver(root, base, api_client, default_config()) as up:
        yield up


@pytest.mark.parametrize("version", ["1.36", "1.37"])
def test_the_claim_is_the_apis_shape(version: str) -> None:
    assert_valid(scheduler_claim(f"{POD}-extended-resources-9pk2d", {COMPUTE_REQUEST: 2}), version)


def test_a_scheduler_claim_is_prepared_with_the_device_plugins_environment(
    driver: tuple[DriverSettings, DRAKubeletStandIn], apiserver: ApiServerStandIn
) -> None:
    settings, kubelet = driver
    name = f"{POD}-extended-resources-9pk2d"
    apiserver.put_claim(scheduler_claim(name, {COMPUTE_REQUEST: 2, SIDECAR_REQUEST: 1}))
    # Allocation order, not address order: virt-launcher hands the addresses out by position.
    allocated = [
        (COMPUTE_REQUEST, "pci-0000-9a-00-0"),
        (COMPUTE_REQUEST, "pci-0000-18-00-0"),
        (SIDECAR_REQUEST, "pci-0000-2a-00-0"),
    ]
    stored = apiserver.set_allocation(
        "vms", name, [AllocatedDevice(r, DRIVER, NODE, d) for r, d in allocated], NODE
    )
    claim = Claim("vms", stored["metadata"]["uid"], name)
    answer = kubelet.node_prepare_resources([claim])[claim.uid]
    assert answer.error == ""
    spec = json.loads((settings.cdi_dir / f"{DRIVER}-claim_{claim.uid}.json").read_text())
    validate_cdi_spec(spec)
    # The kubelet gives each container the CDI ids of its own requests (requestMappings).
    ids = {
        request: [i for d in answer.devices if request in d.request_names for i in d.cdi_device_ids]
        for request in (COMPUTE_REQUEST, SIDECAR_REQUEST)
    }
    variable = pci_resource_env(RESOURCE)
    assert variable == "PCI_RESOURCE_NVIDIA_COM_2330"
    assert runtime_env(settings.cdi_dir, ids[COMPUTE_REQUEST]) == {
        variable: "0000:9a:00.0,0000:18:00.0"
    }
    assert runtime_env(settings.cdi_dir, ids[SIDECAR_REQUEST]) == {variable: "0000:2a:00.0"}
    # The metadata goes where a claim not made from a template has it, under the claim's name.
    mounts = [m for d in spec["devices"] for m in d["containerEdits"].get("mounts", [])]
    assert sorted(m["containerPath"] for m in mounts) == [
        f"/var/run/kubernetes.io/dra-device-attributes/resourceclaims/{name}/{request}/"
        f"{DRIVER}-metadata.json"
        for request in (COMPUTE_REQUEST, SIDECAR_REQUEST)
    ]
    assert kubelet.node_unprepare_resources([claim]) == {claim.uid: ""}


def test_a_claim_written_by_a_user_sets_no_environment(
    driver: tuple[DriverSettings, DRAKubeletStandIn], apiserver: ApiServerStandIn
) -> None:
    settings, kubelet = driver
    claim_object = scheduler_claim("vm-gpus", {"gpu": 1})
    del claim_object["metadata"]["annotations"]
    apiserver.put_claim(claim_object)
    stored = apiserver.set_allocation(
        "vms", "vm-gpus", [AllocatedDevice("gpu", DRIVER, NODE, "pci-0000-18-00-0")], NODE
    )
    claim = Claim("vms", stored["metadata"]["uid"], "vm-gpus")
    answer = kubelet.node_prepare_resources([claim])[claim.uid]
    assert answer.error == ""
    ids = [i for d in answer.devices for i in d.cdi_device_ids]
    assert runtime_env(settings.cdi_dir, ids) == {}


def test_the_environment_is_per_request_and_resource_in_allocation_order() -> None:
    ref = ClaimRef("vms", "pod-extended-resources-abcde", "uid-1")
    claim = scheduler_claim(ref.name, {"container-0-request-0": 2, "container-0-request-1": 1})
    claim["metadata"]["uid"] = ref.uid
    claim["status"]["allocation"] = {
        "devices": {
            "results": [
                {"request": r, "driver": DRIVER, "pool": NODE, "device": d}
                for r, d in [
                    ("container-0-request-0", "pci-0000-9a-00-0"),
                    ("container-0-request-1", "pci-0000-5e-00-3"),
                    ("container-0-request-0", "pci-0000-18-00-0"),
                ]
            ]
        }
    }
    allocation = parse_allocation(claim, ref, DRIVER, NODE)
    assert allocation.extended_resources
    assert allocation.pod_claim_name is None
    devices = {
        "pci-0000-9a-00-0": _device("0000:9a:00.0", RESOURCE),
        "pci-0000-18-00-0": _device("0000:18:00.0", RESOURCE),
        "pci-0000-5e-00-3": _device("0000:5e:00.3", "mellanox.com/cx7_vf"),
    }
    assert build_request_env(allocation, "container-0-request-0", devices) == {
        "PCI_RESOURCE_NVIDIA_COM_2330": "0000:9a:00.0,0000:18:00.0"
    }
    assert build_request_env(allocation, "container-0-request-1", devices) == {
        "PCI_RESOURCE_MELLANOX_COM_CX7_VF": "0000:5e:00.3"
    }


@pytest.mark.parametrize("value", ["false", "", "True", None])
def test_only_the_schedulers_true_marks_an_extended_resource_claim(value: str | None) -> None:
    ref = ClaimRef("vms", "c", "uid-1")
    claim = scheduler_claim(ref.name, {"gpu": 1})
    claim["metadata"]["uid"] = ref.uid
    claim["metadata"]["annotations"] = {EXTENDED_RESOURCE_CLAIM_ANNOTATION: value}
    result = {"request": "gpu", "driver": DRIVER, "pool": NODE, "device": "pci-0000-18-00-0"}
    claim["status"]["allocation"] = {"devices": {"results": [result]}}
    assert not parse_allocation(claim, ref, DRIVER, NODE).extended_resources


def _device(bdf: str, resource: str) -> DraDevice:
    address = Bdf.parse(bdf)
    return DraDevice(
        name="pci-" + bdf.replace(":", "-").replace(".", "-"),
        bdf=address,
        resource=resource,
        attributes={},
        device_nodes=(),
        group=1,
    )
