"""Plan the change to a virt-launcher pod: the iommufd slot for a `compute` that has a VFIO device.

The VM runs in the container named `compute`; virt-controller puts other containers (container
disks, hook sidecars) before or after it, so it is found by name. The new resource mirrors how
virt-controller renders device resources: in limits always, in requests when there are requests.
"""

from __future__ import annotations

from collections.abc import Mapping

from webhook.config import IOMMUFD_RESOURCE, Config
from webhook.plan import (
    Operation,
    Plan,
    Unintelligible,
    listing,
    mapping,
    pointer,
    quoted_names,
)

LAUNCHER_LABEL = "kubevirt.io"
LAUNCHER_VALUE = "virt-launcher"
COMPUTE = "compute"


def plan_pod(pod: object, namespace: str, config: Config) -> Plan:
    """The patch giving a launcher pod's `compute` the iommufd resource, if it needs it."""
    if not isinstance(pod, dict):
        raise Unintelligible("request.object is not an object")
    metadata = mapping(pod.get("metadata"), "metadata")
    labels = mapping(metadata.get("labels"), "metadata.labels")
    if labels.get(LAUNCHER_LABEL) != LAUNCHER_VALUE:
        return Plan((), "not a virt-launcher pod")
    skipped = config.skips(namespace, labels)
    if skipped:
        return Plan((), skipped)
    spec = mapping(pod.get("spec"), "spec")
    containers = listing(spec.get("containers"), "spec.containers")
    index = _find_compute(containers)
    resources = mapping(containers[index].get("resources"), f"{COMPUTE}.resources")
    limits = mapping(resources.get("limits"), f"{COMPUTE}.resources.limits")
    requests = mapping(resources.get("requests"), f"{COMPUTE}.resources.requests")
    managed = sorted({name for name in (*limits, *requests) if config.is_managed(name)})
    if not managed:
        return Plan((), "no managed VFIO resource in container compute")
    if IOMMUFD_RESOURCE in limits:
        return Plan((), f"container compute already has {IOMMUFD_RESOURCE}")
    return Plan(
        _operations(index, resources, limits, requests),
        f"added {IOMMUFD_RESOURCE} to container compute for {quoted_names(managed)}",
    )


def _find_compute(containers: list[object]) -> int:
    for index, container in enumerate(containers):
        if not isinstance(container, dict):
            raise Unintelligible(f"spec.containers[{index}] is not an object")
        if container.get("name") == COMPUTE:
            return index
    raise Unintelligible("a virt-launcher pod without a container named compute")


def _operations(
    index: int,
    resources: Mapping[str, object],
    limits: Mapping[str, object],
    requests: Mapping[str, object],
) -> tuple[Operation, ...]:
    base = ("spec", "containers", index, "resources")
    # An extended resource's limit and request must be equal: keep one the pod already requests.
    requested = requests.get(IOMMUFD_RESOURCE)
    value = requested if isinstance(requested, str) else "1"
    operations: list[Operation] = []
    if isinstance(resources.get("limits"), dict):
        operations.append(
            {"op": "add", "path": pointer(*base, "limits", IOMMUFD_RESOURCE), "value": value}
        )
    else:
        limit = {IOMMUFD_RESOURCE: value}
        operations.append({"op": "add", "path": pointer(*base, "limits"), "value": limit})
    if isinstance(resources.get("requests"), dict) and IOMMUFD_RESOURCE not in requests:
        operations.append(
            {"op": "add", "path": pointer(*base, "requests", IOMMUFD_RESOURCE), "value": value}
        )
    return tuple(operations)
