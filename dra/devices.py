"""Which PCI functions the DRA driver publishes, and what each looks like to the scheduler.

A pure function of the host inventory and the node configuration the device plugin also reads:
the same selectors pick the same functions. A function is first published once a VM could be
given it (on a VFIO driver, its IOMMU group viable, its device nodes present; or on its host
driver, to be bound on demand). Once published it stays while the function is on the bus and
its ids still match, marked `unusable` with the reason when it turns unusable: the health stream
and the slice's taint say so, instead of the device vanishing under a running VM.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Mapping
from dataclasses import dataclass, replace
from types import MappingProxyType
from typing import Any

from hostdev.assess import (
    blockers,
    iommufd_gaps,
    iommufd_once_bound,
    legacy_gaps,
    on_demand_gaps,
)
from hostdev.bdf import Bdf
from hostdev.config import Binding, PluginConfig, ResourceConfig
from hostdev.device_nodes import IOMMU_NODE, build_device_nodes
from hostdev.model import HostCapabilities, HostInventory, IommuGroup, PciFunction, is_vfio_driver
from hostdev.naming import nvidia_device_name
from hostdev.pciids import PciIds
from hostdev.selection import resource_for

PCI_BUS_ID = "resource.kubernetes.io/pciBusID"
PCIE_ROOT = "resource.kubernetes.io/pcieRoot"
# The API server caps string attribute values at 64 characters.
MAX_STRING_ATTRIBUTE = 64

_DEVICE_NAME = re.compile(r"pci-([0-9a-f]{4,8})-([0-9a-f]{2})-([01][0-9a-f])-([0-7])")

AttributeValue = str | int | bool


@dataclass(frozen=True, slots=True)
class DraDevice:
    """One published device: a PCI function, named as a DNS label, with its attributes and the
    device nodes a claim on it hands to the container."""

    name: str
    bdf: Bdf
    resource: str
    """The resource the configuration puts it in (the device plugin's name for it)."""
    attributes: Mapping[str, AttributeValue]
    device_nodes: tuple[str, ...]
    """Host paths the container gets: the cdev and /dev/iommu when iommufd can be used, and
    always (when present) /dev/vfio/vfio and the group node, which KubeVirt's DRA path uses."""
    group: int
    bind_on_demand: bool = False
    """On its host driver now: preparing a claim binds it (and its group) to VFIO first."""
    nodes_pending: bool = False
    """On VFIO, but some of its device nodes are not there yet (udev is still making them)."""
    reset_after_use: bool = False
    unusable: str = ""
    """Why a VM could not be given it now (published before, kept while it is on the bus);
    empty when it could. NodePrepare refuses it with this reason."""


def device_name(bdf: Bdf) -> str:
    """A DNS label for a PCI address: `0000:65:00.0` → `pci-0000-65-00-0`."""
    return "pci-" + str(bdf).replace(":", "-").replace(".", "-")


def bdf_of_device(name: str) -> Bdf | None:
    """The PCI address a device name stands for; None for a name this driver never gives."""
    match = _DEVICE_NAME.fullmatch(name)
    if match is None:
        return None
    domain, bus, slot, function = match.groups()
    return Bdf.parse(f"{domain}:{bus}:{slot}.{function}")


def build_devices(
    inventory: HostInventory,
    config: PluginConfig,
    names: PciIds,
    previous: Mapping[Bdf, DraDevice] | None = None,
) -> tuple[DraDevice, ...]:
    """Every function the configuration selects that a VM could be given now, and every one of
    the `previous` devices still on the bus and still selected that no longer could (marked
    `unusable`), in address order."""
    before = previous or {}
    devices: list[DraDevice] = []
    for function in inventory.functions:
        known = before.get(function.bdf)
        judged = judge_function(
            function, inventory, config, names, known.resource if known else None
        )
        if isinstance(judged, DraDevice):
            devices.append(judged)
        elif known is not None and _still_selected(function, config, names, known.resource):
            devices.append(_unusable(known, function, judged))
    return tuple(sorted(devices, key=lambda d: d.bdf))


def _still_selected(
    function: PciFunction, config: PluginConfig, names: PciIds, resource: str
) -> bool:
    chosen = resource_for(function, config.resources, names, resource)
    return chosen is not None and chosen[0] == resource


def _unusable(known: DraDevice, function: PciFunction, reason: str) -> DraDevice:
    """The device as published before, with no device nodes to hand out, its driver as it is
    now, and why a VM cannot be given it."""
    attributes = dict(known.attributes) | {"currentDriver": function.driver or ""}
    return replace(
        known,
        attributes=MappingProxyType(attributes),
        device_nodes=(),
        bind_on_demand=False,
        nodes_pending=False,
        unusable=reason,
    )


def judge_function(
    function: PciFunction,
    inventory: HostInventory,
    config: PluginConfig,
    names: PciIds,
    previous_resource: str | None = None,
) -> DraDevice | str:
    """The function as a published device, or why it is not one; `previous_resource` is the
    resource it was published in, which it stays in while its ids match (see `resource_for`)."""
    chosen = resource_for(function, config.resources, names, previous_resource)
    group = inventory.group_of(function)
    caps = inventory.capabilities
    if (
        chosen is not None
        and chosen[1].binding is Binding.ON_DEMAND
        and not is_vfio_driver(function.driver)
    ):
        return _judge_on_demand(function, group, caps, chosen, names)
    problems = blockers(function, group, caps)
    # A function the drivers selector left out for its driver is best explained by that driver.
    if problems:
        return "; ".join(problems)
    if chosen is None:
        return "no resource of the configuration selects it"
    if group is None:
        return "in no IOMMU group"
    nodes = build_device_nodes(function, group, caps)
    if not nodes:
        return "; ".join(iommufd_gaps(function, caps) + legacy_gaps(group, caps))
    return DraDevice(
        name=device_name(function.bdf),
        bdf=function.bdf,
        resource=chosen[0],
        attributes=build_attributes(function, group, chosen[0], names, IOMMU_NODE in nodes),
        device_nodes=nodes,
        group=group.number,
        nodes_pending=(caps.legacy_vfio_node_present and not group.legacy_node_present)
        or (function.vfio_cdev is not None and not function.vfio_cdev_present),
        reset_after_use=chosen[1].reset_after_use,
    )


def _judge_on_demand(
    function: PciFunction,
    group: IommuGroup | None,
    caps: HostCapabilities,
    chosen: tuple[str, ResourceConfig],
    names: PciIds,
) -> DraDevice | str:
    resource, config = chosen
    problems = on_demand_gaps(function, group, caps)
    if problems or group is None:
        return "; ".join(problems)
    # Its nodes exist only once it is bound, when a claim on it is prepared.
    return DraDevice(
        name=device_name(function.bdf),
        bdf=function.bdf,
        resource=resource,
        attributes=build_attributes(function, group, resource, names, iommufd_once_bound(caps)),
        device_nodes=(),
        group=group.number,
        bind_on_demand=True,
        reset_after_use=config.reset_after_use,
    )


def build_attributes(
    function: PciFunction, group: IommuGroup, resource: str, names: PciIds, iommufd: bool
) -> Mapping[str, AttributeValue]:
    """The device's attributes: the two standard PCI ones, then ours (unqualified names are in
    the driver's own domain), each as CEL in a DeviceClass or claim would select on it."""
    attributes: dict[str, AttributeValue] = {PCI_BUS_ID: str(function.bdf)}
    if function.pcie_root is not None:
        attributes[PCIE_ROOT] = function.pcie_root
    attributes |= _identity_attributes(
        names, function.vendor_id, function.device_id, function.class_code
    )
    attributes |= {
        "iommuGroup": group.number,
        "iommufd": iommufd,
        "currentDriver": function.driver or "",
    }
    if len(resource) <= MAX_STRING_ATTRIBUTE:
        attributes["resourceName"] = resource
    if function.numa_node is not None:
        attributes["numaNode"] = function.numa_node
    return MappingProxyType(attributes)


@functools.lru_cache(maxsize=256)
def _identity_attributes(
    names: PciIds, vendor_id: int, device_id: int, class_code: int
) -> Mapping[str, AttributeValue]:
    """The attributes that say what kind of device it is: a node's functions come in a few
    kinds, and naming one (its pci.ids name, as NVIDIA's plugin spells it) cost as much as the
    rest of its attributes."""
    product = nvidia_device_name(names.device_name(vendor_id, device_id), device_id)
    return MappingProxyType(
        {
            "vendorID": f"{vendor_id:04x}",
            "deviceID": f"{device_id:04x}",
            "pciClass": f"{class_code:06x}",
            "productName": product[:MAX_STRING_ATTRIBUTE],
        }
    )


def typed_attributes(attributes: Mapping[str, AttributeValue]) -> dict[str, Any]:
    """Attributes as the API writes them (`{"string": …}`, `{"int": …}`, `{"bool": …}`), in
    slices and in the metadata files alike."""
    typed: dict[str, Any] = {}
    for key, value in attributes.items():
        # bool before int: Python's bool is an int.
        if isinstance(value, bool):
            typed[key] = {"bool": value}
        elif isinstance(value, int):
            typed[key] = {"int": value}
        else:
            typed[key] = {"string": value}
    return typed
