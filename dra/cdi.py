"""The CDI spec and KEP-5304 device metadata a prepared claim hands to its pod. Pure.

One spec file per claim. It names, per device, the VFIO nodes the container needs: the cdev and
/dev/iommu where the device can use iommufd, and always the legacy container and group node,
which KubeVirt's DRA path opens (and chowns for QEMU only when /dev/vfio/vfio is in the pod).
Beside the devices, one entry per request mounts that request's metadata file where KubeVirt
reads the device's PCI address. Entry names cannot clash: a device's is its name in the slice
(`pci-…`, once per device), a metadata entry's the request's (`metadata-…`, once per request).

A claim the scheduler made for a pod's extended resources (a launcher pod of a `deviceName` VMI)
also sets, in its request entries, the variable virt-launcher reads such devices from:
`PCI_RESOURCE_<NAME>` (KubeVirt pkg/virt-launcher/virtwrap/device/hostdevice/addresspool.go,
`util.ResourceNameToEnvVar`), the request's addresses of that resource comma-separated, as the
device plugin's Allocate sets it. The variable sits in the request's entry, not in a device's nor
in the spec's own edits, because of how the runtime merges them (tags.cncf.io/container-device-
interface pkg/cdi/cache.go InjectDevices and container-edits.go Apply): the spec's edits are
applied before its first device's, each entry's after, and a variable set twice keeps the value
set last. One variable per device would leave the last device alone in it; one in the spec's
edits would be undone by any device entry setting it and would reach every container of the pod.
The request entry comes with every device of its request and only to the containers that asked
for that request, and the scheduler makes one request per container and extended resource: each
container sees exactly its own devices. Claims written by users set no variable: KubeVirt's DRA
path reads the metadata, and a variable could override the device plugin's for a resource both
serve on one node; the scheduler makes an extended-resource claim only where no device plugin
offers the resource.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import PurePosixPath
from typing import Any

from dra.claims import Allocated, ClaimAllocation
from dra.devices import DraDevice, typed_attributes
from hostdev.naming import pci_resource_env

CDI_VERSION = "0.6.0"
METADATA_API_VERSION = "metadata.resource.k8s.io/v1alpha1"
METADATA_ROOT = PurePosixPath("/var/run/kubernetes.io/dra-device-attributes")
Object = dict[str, Any]


def cdi_kind(driver: str) -> str:
    return f"{driver}/claim"


def spec_file_name(driver: str, claim_uid: str) -> str:
    return f"{driver}-claim_{claim_uid}.json"


def metadata_file_name(driver: str) -> str:
    """The name of a request's metadata file, on the host and in the container alike."""
    return f"{driver}-metadata.json"


def device_cdi_name(claim_uid: str, device: str) -> str:
    return f"{claim_uid}-{device}"


def main_request(request: str) -> str:
    """The request whose directory holds a result's metadata: for a subrequest of a
    prioritized-list request (`<request>/<subrequest>`) the main request, as KEP-5304 lays it out
    and KubeVirt reads it; the document inside names the subrequest."""
    return request.partition("/")[0]


def metadata_cdi_name(claim_uid: str, request: str) -> str:
    """The CDI name of the mount of `request`'s metadata (a main request: a DNS label)."""
    return f"{claim_uid}-metadata-{request}"


def cdi_id(driver: str, name: str) -> str:
    """The fully qualified name the kubelet passes to the runtime: `<vendor>/<class>=<name>`."""
    return f"{cdi_kind(driver)}={name}"


def metadata_container_base(allocation: ClaimAllocation) -> PurePosixPath:
    """The directory of the pod's claims whose metadata the container sees."""
    kind = "resourceclaimtemplates" if allocation.pod_claim_name else "resourceclaims"
    return METADATA_ROOT / kind


def metadata_container_path(allocation: ClaimAllocation, request: str, driver: str) -> str:
    """Where KubeVirt looks for a main request's metadata: under the pod's own name for a claim
    made from a template, under the claim's name otherwise. A claim the scheduler made for
    extended resources has no pod-claim-name, so its metadata lies under its generated name
    (`<pod>-extended-resources-<suffix>`, which the pod's
    `status.extendedResourceClaimStatus.resourceClaimName` gives); KubeVirt never looks there: a
    `deviceName` device takes its address from `PCI_RESOURCE_<NAME>` (`build_request_env`)."""
    name = allocation.pod_claim_name or allocation.ref.name
    return str(metadata_container_base(allocation) / name / request / metadata_file_name(driver))


def build_metadata(
    allocation: ClaimAllocation, request: str, driver: str, devices: Mapping[str, DraDevice]
) -> Object:
    """The KEP-5304 DeviceMetadata document for one main request of the claim; `devices` are
    the host's devices by the allocation's names for them."""
    ref = allocation.ref
    document: Object = {
        "apiVersion": METADATA_API_VERSION,
        "kind": "DeviceMetadata",
        "metadata": {
            "name": ref.name,
            "namespace": ref.namespace,
            "uid": ref.uid,
            "generation": allocation.generation,
        },
    }
    if allocation.pod_claim_name:
        document["podClaimName"] = allocation.pod_claim_name
    items = [d for d in allocation.devices if main_request(d.request) == request]
    document["requests"] = [
        {
            "name": name,
            "devices": [
                {
                    "driver": driver,
                    "pool": item.pool,
                    "name": item.device,
                    "attributes": typed_attributes(devices[item.device].attributes),
                }
                for item in items
                if item.request == name
            ],
        }
        for name in sorted({item.request for item in items})
    ]
    return document


def build_spec(
    allocation: ClaimAllocation,
    driver: str,
    devices: Mapping[str, DraDevice],
    metadata_host_paths: Mapping[str, str],
) -> Object:
    """The claim's CDI spec: one entry per device with its nodes (`devices` by the allocation's
    names for them), one per main request with the read-only mount of that request's metadata
    file (host path by main request name)."""
    uid = allocation.ref.uid
    entries: list[Object] = [
        {
            "name": device_cdi_name(uid, name),
            "containerEdits": {
                "deviceNodes": [{"path": node} for node in devices[name].device_nodes]
            },
        }
        for name in dict.fromkeys(item.device for item in allocation.devices)
    ]
    entries += [
        {
            "name": metadata_cdi_name(uid, request),
            "containerEdits": {
                **_request_env(allocation, request, devices),
                "mounts": [
                    {
                        "hostPath": host_path,
                        "containerPath": metadata_container_path(allocation, request, driver),
                        "options": ["ro", "nosuid", "nodev", "bind"],
                    }
                ],
            },
        }
        for request, host_path in sorted(metadata_host_paths.items())
    ]
    return {"cdiVersion": CDI_VERSION, "kind": cdi_kind(driver), "devices": entries}


def build_request_env(
    allocation: ClaimAllocation, request: str, devices: Mapping[str, DraDevice]
) -> dict[str, str]:
    """What a main request of an extended-resource claim sets in its containers: per resource
    among its devices, `PCI_RESOURCE_<NAME>` = their addresses in allocation order (virt-launcher
    hands them to the VMI's devices by position). Nothing for other claims."""
    if not allocation.extended_resources:
        return {}
    by_resource: dict[str, list[str]] = {}
    for item in allocation.devices:
        if main_request(item.request) == request:
            device = devices[item.device]
            by_resource.setdefault(device.resource, []).append(str(device.bdf))
    return {pci_resource_env(name): ",".join(bdfs) for name, bdfs in sorted(by_resource.items())}


def _request_env(
    allocation: ClaimAllocation, request: str, devices: Mapping[str, DraDevice]
) -> Object:
    env = build_request_env(allocation, request, devices)
    return {"env": [f"{name}={value}" for name, value in env.items()]} if env else {}


def build_cdi_ids(driver: str, claim_uid: str, device: Allocated) -> tuple[str, ...]:
    """What the kubelet hands the runtime for one device: its nodes and its request's metadata."""
    return (
        cdi_id(driver, device_cdi_name(claim_uid, device.device)),
        cdi_id(driver, metadata_cdi_name(claim_uid, main_request(device.request))),
    )
