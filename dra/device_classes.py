"""The DeviceClasses that let pods asking for the device plugin's resource names be served by this
driver (KEP-5004, DRA-backed extended resources: `DeviceClass.spec.extendedResourceName`). Pure:
the configuration's resource names in, DeviceClass objects out.

On a node with no device plugin for such a name, kube-scheduler allocates the pod's request
(`nvidia.com/GH100H100_SXM5_80GB: 1`, as KubeVirt renders a `deviceName` VMI's launcher pod)
from the class whose `extendedResourceName` it is, and writes the claim the driver then prepares
(dra/claims.py). Each class selects this driver's devices of one resource by their `resourceName`
attribute (dra/devices.py), so the class and the device plugin agree on which device is which.
The iommufd slots carry it too (dra/iommufd_slots.py): the class of `devices.kubevirt.io/iommufd`
serves the request our webhook, or KubeVirt's own `IOMMUFD` gate, adds to a launcher pod.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from typing import Any

from hostdev.config import PluginConfig, ResourceConfig
from hostdev.model import PciFunction
from hostdev.naming import nvidia_resource_name
from hostdev.pciids import PciIds
from hostdev.selection import matches_identity, resource_name

MAX_ATTRIBUTE = 64
"""The API's cap on a string attribute: a longer resource name is not published as
`resourceName` (dra/devices.py), so no class could select its devices."""
_DNS_SUBDOMAIN = re.compile(
    r"(?=.{1,253}$)[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*"
)


class DeviceClassError(ValueError):
    """A resource no DeviceClass can be made for; the message names it and the fix."""


def device_class_name(resource: str) -> str:
    """The class's name: the resource name in lower case with `/` made `.` and `_` made `-`
    (`nvidia.com/GH100H100_SXM5_80GB` → `nvidia.com.gh100h100-sxm5-80gb`)."""
    name = resource.lower().replace("/", ".").replace("_", "-")
    if not _DNS_SUBDOMAIN.fullmatch(name):
        raise DeviceClassError(
            f"resource {resource}: {name!r} is not a DeviceClass name (a DNS subdomain); rename"
            " the resource in the configuration (letters, digits and single '-' or '_' between"
            " them after the '/')"
        )
    return name


def device_selector(driver: str, resource: str) -> str:
    """CEL selecting `driver`'s devices of `resource`. The driver is checked first and the
    attribute's presence before its value: a CEL error aborts the pod's whole allocation, and
    `false && <error>` is false."""
    attribute = f"device.attributes[{json.dumps(driver)}]"
    return (
        f"device.driver == {json.dumps(driver)} && has({attribute}.resourceName)"
        f" && {attribute}.resourceName == {json.dumps(resource)}"
    )


def build_device_class(driver: str, resource: str) -> dict[str, Any]:
    if len(resource) > MAX_ATTRIBUTE:
        raise DeviceClassError(
            f"resource {resource}: longer than {MAX_ATTRIBUTE} characters, so its devices carry no"
            " resourceName attribute for a DeviceClass to select; give it a shorter resourceName"
        )
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "DeviceClass",
        "metadata": {"name": device_class_name(resource)},
        "spec": {
            "extendedResourceName": resource,
            "selectors": [{"cel": {"expression": device_selector(driver, resource)}}],
        },
    }


def build_device_classes(driver: str, resources: Iterable[str]) -> list[dict[str, Any]]:
    """One class per resource, by name; two resources whose class names would be one are
    refused."""
    classes: dict[str, tuple[str, dict[str, Any]]] = {}
    for resource in sorted(set(resources)):
        device_class = build_device_class(driver, resource)
        name = device_class["metadata"]["name"]
        if name in classes:
            raise DeviceClassError(
                f"resources {classes[name][0]} and {resource} would both be DeviceClass {name};"
                " rename one of them in the configuration"
            )
        classes[name] = resource, device_class
    return [device_class for _, device_class in classes.values()]


def plan_resource_names(
    config: PluginConfig,
    names: PciIds,
    functions: Iterable[PciFunction] = (),
    device_ids: Iterable[tuple[int, int]] = (),
) -> tuple[str, ...]:
    """The resource names the configuration gives: every named resource, and for resources named
    per device id (NVIDIA's naming) the names of `functions` (a node's) and of `device_ids`
    (vendor, device) any of them selects. Drivers are left out: a device's driver changes (an
    admin's bind, binding on demand), its name does not; a class no device matches is harmless."""
    found: dict[str, None] = {}
    for resource in config.resources:
        if resource.resource_name is not None:
            found[resource.resource_name] = None
    for function in functions:
        for resource in config.resources:
            if resource.auto_name and matches_identity(function, resource.selectors):
                found[resource_name(function, resource, names)] = None
    for vendor, device in device_ids:
        for resource in config.resources:
            if resource.auto_name and _selects_ids(resource, vendor, device):
                found[nvidia_resource_name(names.device_name(vendor, device), device)] = None
                break
    return tuple(sorted(found))


def plan_iommufd_resource_names(config: PluginConfig) -> tuple[str, ...]:
    """The iommufd slots' resource name (`devices.kubevirt.io/iommufd` by default) when the
    driver publishes slots (`iommufd.enabled`)."""
    return (config.iommufd.resource_name,) if config.iommufd.enabled else ()


def _selects_ids(resource: ResourceConfig, vendor: int, device: int) -> bool:
    selectors = resource.selectors
    return (not selectors.vendors or vendor in selectors.vendors) and (
        not selectors.devices or device in selectors.devices
    )
