"""The node's iommufd slots as DRA devices, and what a claim on them hands its pod. Pure.

The device plugin advertises `devices.kubevirt.io/iommufd` as `iommufd.slots` interchangeable
slots; each Allocate hands the container a prepared `/dev/iommu` fd over a one-shot socket
(hostdev.iommufd_handoff). The driver publishes the same number of slots (`iommufd-0` …) with
the attribute `resourceName: devices.kubevirt.io/iommufd`, so the DeviceClass whose
`extendedResourceName` is that name (dra.device_classes) selects them, and a launcher pod asking
for the resource (our webhook's or KubeVirt's `IOMMUFD` gate's request) is served on a DRA node.

A claim holding slots gets one hand-off: its CDI spec mounts the claim's socket at
`/var/run/kubevirt/iommufd.sock`, where virt-launcher receives the fd whenever the file exists.
That path lies inside KubeVirt's "public" emptyDir (`/var/run/kubevirt`), so the socket's bind
mount must come after the directory's own, or the emptyDir would hide it. The CDI library sorts
every mount of the container's OCI spec by the depth of its destination when it applies a
device's mounts (tags.cncf.io/container-device-interface pkg/cdi/container-edits.go at
github.com/cncf-tags/container-device-interface 05ae4b5: `ContainerEdits.Apply` calls
`sortMounts` after adding them, a `sort.Stable` of `orderedMounts` whose `Less` compares
`strings.Count(filepath.Clean(Destination), "/")`), and the runtime injects CDI devices into a
spec that already holds the pod's volume mounts (containerd internal/cri/server:
container_create.go builds the spec with the CRI mounts, then applies the platform's spec
options to it through `containerd.WithSpec(spec, specOpts...)`, container_create_linux.go
appending `customopts.WithCDI` last among them): the socket (4 levels deep) is mounted after
`/var/run/kubevirt` (3), whatever order the mounts came in.

One hand-off per pod: a pod asks for the resource once, in its compute container, so a claim's
slots all come from one request. Slots of one request share the hand-off (as the device plugin
gives a container asking for two slots one fd); slots spread over two requests are refused:
two containers cannot both receive the one fd.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

from dra.devices import typed_attributes
from hostdev.device_nodes import IOMMU_NODE
from hostdev.iommufd_handoff import CONTAINER_SOCKET_PATH

SLOT_ATTRIBUTE = "iommufdSlot"
"""True on every slot: what the device is, for a CEL selector or `kubectl get resourceslices`."""
_SLOT_NAME = re.compile(r"iommufd-(0|[1-9][0-9]{0,5})")
Object = dict[str, Any]


def slot_name(index: int) -> str:
    return f"iommufd-{index}"


def slot_index(name: str) -> int | None:
    """The slot a device name stands for; None for a name that is no slot's."""
    match = _SLOT_NAME.fullmatch(name)
    return int(match.group(1)) if match else None


def build_slot_entries(resource: str, slots: int) -> list[Object]:
    """The slots' entries in the node's ResourceSlices."""
    attributes = typed_attributes({"resourceName": resource, SLOT_ATTRIBUTE: True})
    return [{"name": slot_name(i), "attributes": attributes} for i in range(slots)]


def handoff_cdi_name(claim_uid: str) -> str:
    return f"{claim_uid}-iommufd"


def build_handoff_entry(claim_uid: str, socket_host_path: str) -> Object:
    """The CDI entry of a claim's hand-off: /dev/iommu (as the device plugin's Allocate gives
    it) and the socket at the path virt-launcher looks at."""
    return {
        "name": handoff_cdi_name(claim_uid),
        "containerEdits": {
            "deviceNodes": [{"path": IOMMU_NODE}],
            "mounts": [
                {
                    "hostPath": socket_host_path,
                    "containerPath": CONTAINER_SOCKET_PATH,
                    "options": ["nosuid", "nodev", "bind"],
                }
            ],
        },
    }


def check_slots(devices: Iterable[tuple[str, str]], slots: int) -> str | None:
    """Why the claim's slots (request, device name) cannot be prepared; None when they can."""
    requests: dict[str, None] = {}
    for request, device in devices:
        index = slot_index(device)
        if slots == 0:
            return (
                f"device {device}: this driver publishes no iommufd slots (its configuration"
                " has iommufd.enabled: false); the allocation is from an older slice: recreate"
                " the pod"
            )
        if index is None or index >= slots:
            return (
                f"device {device} is not one of the {slots} iommufd slots this driver publishes;"
                " the allocation is from an older slice (iommufd.slots was lowered): recreate"
                " the pod"
            )
        requests[request] = None
    if len(requests) > 1:
        return (
            f"iommufd slots for requests {', '.join(requests)}: only one container of a pod can"
            " receive the prepared iommufd fd; ask for devices.kubevirt.io/iommufd in the"
            " compute container only"
        )
    return None
