"""The scheduler stand-in for extended resources backed by DRA: request names and counts as
kube-scheduler makes them, a claim the 1.36 and 1.37 schemas accept and the driver reads as an
extended-resource claim, and the pod status that maps requests back to containers."""

from __future__ import annotations

from typing import Any

import pytest

from dra.claims import ClaimRef, parse_allocation
from k8s_schema_kit import assert_valid
from sim.scheduler import (
    ExtendedRequest,
    build_extended_resource_claim,
    build_extended_resource_claim_status,
    plan_extended_requests,
)

GPU = "nvidia.com/GH100H100_SXM5_80GB"
IOMMUFD = "devices.kubevirt.io/iommufd"
CLASSES = {GPU: "nvidia.com.gh100h100-sxm5-80gb", IOMMUFD: "devices.kubevirt.io.iommufd"}


def container(name: str, **requests: str) -> dict[str, Any]:
    return {"name": name, "resources": {"requests": requests, "limits": dict(requests)}}


def launcher_pod() -> dict[str, Any]:
    """Two init containers asking for nothing extended, then compute and a hook sidecar."""
    compute = container("compute", cpu="8", memory="17Gi")
    compute["resources"]["requests"] |= {
        "devices.kubevirt.io/kvm": "1",
        "devices.kubevirt.io/tun": "1",
        "devices.kubevirt.io/vhost-net": "1",
        "ephemeral-storage": "50M",
        GPU: "2",
        IOMMUFD: "1",
    }
    return {
        "metadata": {"name": "virt-launcher-vm-x2v7q", "namespace": "vms", "uid": "u-1"},
        "spec": {
            "initContainers": [container("container-disk-binary"), container("volume-init")],
            "containers": [compute, container("hook-sidecar-0", cpu="200m", **{GPU: "1"})],
        },
    }


def test_requests_are_named_by_container_and_sorted_request_index() -> None:
    requests = plan_extended_requests(launcher_pod(), CLASSES, {})
    # compute is container 2 (after two init containers); its requests sorted: cpu,
    # devices.kubevirt.io/iommufd, …/kvm, …/tun, …/vhost-net, ephemeral-storage, memory, GPU.
    assert requests == (
        ExtendedRequest("compute", IOMMUFD, "container-2-request-1", CLASSES[IOMMUFD], 1),
        ExtendedRequest("compute", GPU, "container-2-request-7", CLASSES[GPU], 2),
        ExtendedRequest("hook-sidecar-0", GPU, "container-3-request-1", CLASSES[GPU], 1),
    )


def test_a_resource_the_node_has_from_a_device_plugin_stays_with_it() -> None:
    requests = plan_extended_requests(launcher_pod(), CLASSES, {GPU: 8, IOMMUFD: 0})
    assert [r.resource for r in requests] == [IOMMUFD]


def test_a_resource_no_class_names_is_left_alone() -> None:
    requests = plan_extended_requests(launcher_pod(), {IOMMUFD: CLASSES[IOMMUFD]}, {})
    assert [r.request for r in requests] == ["container-2-request-1"]


@pytest.mark.parametrize("version", ["1.36", "1.37"])
def test_the_claim_is_the_apis_shape(version: str) -> None:
    pod = launcher_pod()
    requests = plan_extended_requests(pod, CLASSES, {})
    claim = build_extended_resource_claim(
        pod, requests, "virt-launcher-vm-x2v7q-extended-resources-a1b2c"
    )
    assert_valid(claim, version)
    assert claim["metadata"]["generateName"] == "virt-launcher-vm-x2v7q-extended-resources-"
    assert claim["metadata"]["ownerReferences"][0]["controller"] is True


def test_the_driver_reads_it_as_an_extended_resource_claim() -> None:
    pod = launcher_pod()
    requests = plan_extended_requests(pod, CLASSES, {})
    claim = build_extended_resource_claim(pod, requests, "c")
    claim["metadata"]["uid"] = "claim-uid"
    claim["status"]["allocation"] = {
        "devices": {
            "results": [
                {"request": r.request, "driver": "d", "pool": "node", "device": f"dev-{i}"}
                for i, r in enumerate(requests)
            ]
        }
    }
    allocation = parse_allocation(claim, ClaimRef("vms", "c", "claim-uid"), "d", "node")
    assert allocation.extended_resources
    assert allocation.pod_claim_name is None


def test_the_pod_status_maps_each_request_to_its_container() -> None:
    requests = plan_extended_requests(launcher_pod(), CLASSES, {})
    status = build_extended_resource_claim_status("c", requests)
    assert status == {
        "resourceClaimName": "c",
        "requestMappings": [
            {
                "containerName": "compute",
                "resourceName": IOMMUFD,
                "requestName": "container-2-request-1",
            },
            {
                "containerName": "compute",
                "resourceName": GPU,
                "requestName": "container-2-request-7",
            },
            {
                "containerName": "hook-sidecar-0",
                "resourceName": GPU,
                "requestName": "container-3-request-1",
            },
        ],
    }
