"""Which resource a PCI function belongs to, by the configuration's selectors: the one rule the
device plugin and the DRA driver both publish devices by."""

from __future__ import annotations

from hostdev.config import ANY_VFIO_DRIVER, ResourceConfig, Selectors
from hostdev.model import PciFunction, is_vfio_driver
from hostdev.naming import nvidia_resource_name
from hostdev.pciids import PciIds


def resource_for(
    function: PciFunction,
    resources: tuple[ResourceConfig, ...],
    names: PciIds,
    previous_resource: str | None = None,
) -> tuple[str, ResourceConfig] | None:
    """The name of the resource a function joins, and that resource's configuration.

    The first resource whose identity selectors match wins. Its `drivers` selector decides only
    whether the function joins: one that already belonged (`previous_resource`) stays while its
    ids still match, so a device unbound under a running VM is reported, not dropped.
    """
    for resource in resources:
        if not matches_identity(function, resource.selectors):
            continue
        name = resource_name(function, resource, names)
        if name == previous_resource or matches_driver(function, resource.selectors):
            return name, resource
    return None


def resource_name(function: PciFunction, resource: ResourceConfig, names: PciIds) -> str:
    if resource.resource_name is not None:
        return resource.resource_name
    pci_name = names.device_name(function.vendor_id, function.device_id)
    return nvidia_resource_name(pci_name, function.device_id)


def matches_identity(function: PciFunction, selectors: Selectors) -> bool:
    if function.is_bridge:
        return False
    if selectors.vendors and function.vendor_id not in selectors.vendors:
        return False
    if selectors.devices and function.device_id not in selectors.devices:
        return False
    if selectors.pci_addresses and function.bdf not in selectors.pci_addresses:
        return False
    class_hex = f"{function.class_code:06x}"
    return not selectors.classes or any(class_hex.startswith(c) for c in selectors.classes)


def matches_driver(function: PciFunction, selectors: Selectors) -> bool:
    if not selectors.drivers:
        return True
    return any(
        (wanted == ANY_VFIO_DRIVER and is_vfio_driver(function.driver)) or wanted == function.driver
        for wanted in selectors.drivers
    )
