"""kube-scheduler's part in extended resources backed by DRA (KEP-5004): the claim it writes for
a pod's extended resources on a node that serves them through DRA, and the pod status that maps
the claim's requests back to the containers. Pure: a pod in, API objects out.

As kubernetes pkg/scheduler/framework/plugins/dynamicresources/extendeddynamicresources.go does
(filterExtendedResources, createResourceRequestAndMappings, and preFilterExtendedResources for
the claim's metadata): a resource of the pod goes to DRA on a node whose allocatable has none of
it (no device plugin serves it there) when a DeviceClass names it in `extendedResourceName`; it
becomes one request per container (init containers first) asking for it, named
`container-<container index>-request-<index of the resource among the container's requests,
sorted by name>`, `exactly{deviceClassName, allocationMode: ExactCount, count}`. The claim has
`generateName: <pod>-extended-resources-`, the pod as its controller, and the annotation
`resource.kubernetes.io/extended-resource-claim: "true"`. Not modelled: an init container's
devices reused by a later container (launcher pods' init containers ask for none).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

EXTENDED_RESOURCE_CLAIM_ANNOTATION = "resource.kubernetes.io/extended-resource-claim"
Object = dict[str, Any]


@dataclass(frozen=True, slots=True)
class ExtendedRequest:
    """One request of the pod's extended-resource claim: a container's ask for one resource."""

    container: str
    resource: str
    request: str
    device_class: str
    count: int


def plan_extended_requests(
    pod: Object, classes: Mapping[str, str], allocatable: Mapping[str, int]
) -> tuple[ExtendedRequest, ...]:
    """The claim's requests for `pod` on a node with `allocatable` (its device-plugin
    resources), `classes` naming the DeviceClass of each extended resource backed by DRA; by
    request name, as the scheduler sorts them."""
    spec = pod.get("spec", {})
    containers = [*spec.get("initContainers", []), *spec.get("containers", [])]
    planned: list[ExtendedRequest] = []
    for index, container in enumerate(containers):
        requests = container.get("resources", {}).get("requests", {})
        names = sorted(requests)
        for resource in names:
            if resource not in classes or allocatable.get(resource, 0) > 0:
                continue
            count = int(str(requests[resource]))
            if count == 0:
                continue
            planned.append(
                ExtendedRequest(
                    container=container["name"],
                    resource=resource,
                    request=f"container-{index}-request-{names.index(resource)}",
                    device_class=classes[resource],
                    count=count,
                )
            )
    return tuple(sorted(planned, key=lambda r: r.request))


def build_extended_resource_claim(
    pod: Object, requests: tuple[ExtendedRequest, ...], name: str
) -> Object:
    """The claim as the scheduler writes it at PreBind (`name` is what the API server makes of
    its generateName), reserved for the pod; its allocation is written with it."""
    metadata = pod["metadata"]
    owner = {"apiVersion": "v1", "kind": "Pod", "name": metadata["name"], "uid": metadata["uid"]}
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {
            "name": name,
            "generateName": f"{metadata['name']}-extended-resources-",
            "namespace": metadata["namespace"],
            "annotations": {EXTENDED_RESOURCE_CLAIM_ANNOTATION: "true"},
            "ownerReferences": [{**owner, "controller": True}],
            "finalizers": ["resource.kubernetes.io/delete-protection"],
        },
        "spec": {
            "devices": {
                "requests": [
                    {
                        "name": r.request,
                        "exactly": {
                            "deviceClassName": r.device_class,
                            "allocationMode": "ExactCount",
                            "count": r.count,
                        },
                    }
                    for r in requests
                ]
            }
        },
        "status": {
            "reservedFor": [{"resource": "pods", "name": metadata["name"], "uid": metadata["uid"]}]
        },
    }


def build_extended_resource_claim_status(
    claim_name: str, requests: tuple[ExtendedRequest, ...]
) -> Object:
    """`pod.status.extendedResourceClaimStatus`: which container gets which request's devices
    (the kubelet hands each container the CDI devices of its own requests only)."""
    return {
        "resourceClaimName": claim_name,
        "requestMappings": [
            {"containerName": r.container, "resourceName": r.resource, "requestName": r.request}
            for r in requests
        ],
    }
