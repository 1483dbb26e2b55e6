"""The device tree: which devices each resource advertises, their health and what Allocate hands
out for them. A pure function of the host inventory, the configuration and the previous tree.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from hostdev.assess import blockers, iommufd_gaps, legacy_gaps
from hostdev.bdf import Bdf
from hostdev.config import DeviceMode, PluginConfig
from hostdev.device_nodes import IOMMU_NODE, build_device_nodes
from hostdev.model import (
    HostCapabilities,
    HostInventory,
    IommuGroup,
    PciFunction,
)
from hostdev.naming import pci_resource_env
from hostdev.pciids import PciIds
from hostdev.selection import resource_for


@dataclass(frozen=True, slots=True)
class VfioDevice:
    """One advertised device: a PCI function, with everything Allocate needs precomputed."""

    bdf: Bdf
    healthy: bool
    reason: str
    """Why it is unhealthy; empty when healthy."""
    driver: str | None
    numa_node: int | None
    switch: tuple[Bdf, ...]
    """Bridges above the device's own parent: equal for devices under one PCIe switch."""
    device_nodes: tuple[str, ...]
    """Nodes Allocate hands out: the cdevs and group node(s) of the whole IOMMU group and the
    shared /dev/iommu or /dev/vfio/vfio, as the device mode asks and as they exist."""

    @property
    def id(self) -> str:
        return str(self.bdf)


@dataclass(frozen=True, slots=True)
class VfioResource:
    name: str
    devices: Mapping[str, VfioDevice]
    """By device id (the BDF), in address order."""
    reset_after_use: bool = False

    @property
    def env_name(self) -> str:
        return pci_resource_env(self.name)

    @property
    def healthy_count(self) -> int:
        return sum(1 for d in self.devices.values() if d.healthy)


@dataclass(frozen=True, slots=True)
class _Source:
    """What one function's entry was built from, to reuse it while none of that changes."""

    function: PciFunction
    group: IommuGroup | None
    siblings: tuple[PciFunction | None, ...]
    resource: str | None
    device: VfioDevice | None
    reset_after_use: bool = False


@dataclass(frozen=True, slots=True)
class DeviceTree:
    resources: Mapping[str, VfioResource] = field(default_factory=dict)
    iommu_node_present: bool = False
    """`/dev/iommu` exists; the iommufd slots' health follows it (see `IommufdServicer`)."""
    _sources: Mapping[Bdf, _Source] = field(default_factory=dict, compare=False, repr=False)
    _basis: tuple[HostCapabilities, PluginConfig] | None = field(
        default=None, compare=False, repr=False
    )

    def members(self) -> dict[Bdf, str]:
        """Resource name of every advertised function."""
        return {d.bdf: r.name for r in self.resources.values() for d in r.devices.values()}

    def iommufd_counts(self) -> dict[str, int]:
        """Per resource, how many devices Allocate hands out over iommufd (with /dev/iommu)."""
        return {
            r.name: sum(IOMMU_NODE in d.device_nodes for d in r.devices.values())
            for r in self.resources.values()
        }


def plan_resources(
    functions: Iterable[PciFunction], config: PluginConfig, names: PciIds
) -> dict[str, bool]:
    """The resources `functions` make on a fresh start, in name order, and whether each resets
    its devices after use: what serving and registering them needs, before any device's health
    is judged."""
    found: dict[str, bool] = {}
    for function in functions:
        chosen = resource_for(function, config.resources, names)
        if chosen is not None:
            found[chosen[0]] = found.get(chosen[0], False) or chosen[1].reset_after_use
    return dict(sorted(found.items()))


def build_device_tree(
    inventory: HostInventory,
    config: PluginConfig,
    names: PciIds,
    previous: DeviceTree | None = None,
) -> DeviceTree:
    """Assign functions to resources and judge their health.

    A function joins the first resource whose selectors it matches. Once in, it stays while it
    is present and its ids still match, even when the `drivers` selector no longer does: a
    device unbound from vfio-pci turns Unhealthy instead of vanishing from the kubelet's
    capacity under a running VM.
    """
    before = previous.members() if previous else {}
    caps = inventory.capabilities
    # A refresh keeps the objects of functions it did not read again, so an entry whose function,
    # group and group siblings are the same objects as last time is still right: reuse it rather
    # than judge 4,096 devices again for one event.
    reusable = previous._sources if previous and previous._basis == (caps, config) else {}
    sources: dict[Bdf, _Source] = {}
    grouped: dict[str, list[VfioDevice]] = {}
    # Members of a group share one siblings tuple and, mostly, one tuple of nodes: on a
    # 4,096-function node that is the difference of a few megabytes.
    siblings_of: dict[int, tuple[PciFunction | None, ...]] = {}
    shared_nodes: dict[tuple[str, ...], tuple[str, ...]] = {}
    for function in inventory.functions:
        group = inventory.group_of(function)
        siblings: tuple[PciFunction | None, ...] = ()
        if group is not None:
            if group.number not in siblings_of:
                siblings_of[group.number] = tuple(
                    inventory.function(m.bdf) for m in group.members if m.bdf is not None
                )
            siblings = siblings_of[group.number]
        source = reusable.get(function.bdf)
        if not (
            source is not None
            and source.function is function
            and source.group == group
            and _same_objects(source.siblings, siblings)
        ):
            chosen = resource_for(function, config.resources, names, before.get(function.bdf))
            resource, reset = (chosen[0], chosen[1].reset_after_use) if chosen else (None, False)
            device = (
                _device(function, group, siblings, caps, config.device_mode, shared_nodes)
                if resource
                else None
            )
            source = _Source(function, group, siblings, resource, device, reset)
        sources[function.bdf] = source
        if source.resource is not None and source.device is not None:
            grouped.setdefault(source.resource, []).append(source.device)
    resets = {s.resource for s in sources.values() if s.reset_after_use}
    resources = {
        name: VfioResource(name, MappingProxyType({d.id: d for d in devices}), name in resets)
        for name, devices in sorted(grouped.items())
    }
    return DeviceTree(
        resources=MappingProxyType(resources),
        iommu_node_present=caps.iommufd_node_present,
        _sources=sources,
        _basis=(caps, config),
    )


def _same_objects(a: tuple[object, ...], b: tuple[object, ...]) -> bool:
    return len(a) == len(b) and all(x is y for x, y in zip(a, b, strict=True))


def _device(
    function: PciFunction,
    group: IommuGroup | None,
    siblings: tuple[PciFunction | None, ...],
    caps: HostCapabilities,
    mode: DeviceMode,
    shared_nodes: dict[tuple[str, ...], tuple[str, ...]],
) -> VfioDevice:
    problems = list(blockers(function, group, caps))
    no_iommufd = iommufd_gaps(function, caps)
    no_legacy = legacy_gaps(group, caps) if group is not None else ()
    if not problems and group is not None:
        if mode is DeviceMode.IOMMUFD:
            problems.extend(no_iommufd)
        elif mode is DeviceMode.LEGACY:
            problems.extend(no_legacy)
        elif no_iommufd and no_legacy:
            problems.extend(no_iommufd + no_legacy)
    nodes = (
        build_device_nodes(function, group, caps, mode, siblings)
        if group is not None and not problems
        else ()
    )
    return VfioDevice(
        bdf=function.bdf,
        healthy=not problems,
        reason="; ".join(problems),
        driver=function.driver,
        numa_node=function.numa_node,
        switch=function.upstream[:-1],
        device_nodes=shared_nodes.setdefault(nodes, nodes),
    )
