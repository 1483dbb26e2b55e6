"""The host as the DRA driver last read it: the inventory, the devices published from it, and a
fresh judgement of named functions for a claim.

The driver's event thread reads the host again on uevents and every re-scan interval; the
preparer reads the functions a claim names (with their groups) again before deciding, so a
claim never gets a device on the strength of an old reading. Both hold the same cache.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Mapping
from dataclasses import replace
from pathlib import Path
from types import MappingProxyType
from typing import Any

from dra.devices import DraDevice, build_devices, device_name, judge_function
from dra.prepare_plan import GONE
from hostdev.bdf import Bdf, is_bdf
from hostdev.config import PluginConfig
from hostdev.model import HostCapabilities, HostInventory, IommuGroup, PciFunction
from hostdev.pciids import PciIds
from hostdev.scan import refresh_host, scan_host


class HostCache:
    def __init__(self, root: Path, config: PluginConfig, names: PciIds) -> None:
        self._root = root
        self._config = config
        self._names = names
        self._lock = threading.Lock()
        self._inventory: HostInventory | None = None
        """None until the host is first read: nothing is published before that."""
        self._devices: tuple[DraDevice, ...] = ()
        self._built_from: HostInventory | None = None
        """The inventory `_devices` were judged from (only `scan`, one thread, uses it)."""

    @property
    def devices(self) -> tuple[DraDevice, ...]:
        """Every device to publish as of the last reading of the host: those a VM could be
        given, and those published before that no longer could (`unusable`)."""
        with self._lock:
            return self._devices

    @property
    def capabilities(self) -> HostCapabilities | None:
        with self._lock:
            return None if self._inventory is None else self._inventory.capabilities

    def on_bus(self, bdfs: Iterable[Bdf]) -> frozenset[Bdf]:
        """Which of `bdfs` the host had at its last reading."""
        with self._lock:
            inventory = self._inventory
        if inventory is None:
            return frozenset()
        return frozenset(b for b in bdfs if inventory.function(b) is not None)

    def remember(self, devices: Iterable[DraDevice]) -> None:
        """Devices published before this cache first read the host (by the other instance of a
        rolling update, or this driver before a restart): the first reading keeps those that
        turned unusable meanwhile, as if it had published them itself. Without them two
        instances publishing one pool disagree on the device and rewrite it in and out."""
        with self._lock:
            if self._inventory is None:
                self._devices = tuple(devices)

    def scan(self, changed: frozenset[Bdf] | None = None) -> None:
        """Read the `changed` functions (with their groups), or the whole host, again and work
        out the devices to publish anew.

        A whole reading (about half a second on 4,096 functions) is done outside the lock, so
        a claim's `judge_now` does not wait for it; what `judge_now` read meanwhile is lost
        to it, which costs nothing: a claim reads its functions again whatever the cache holds.
        Functions and groups read the same as before keep their objects, so only the devices
        of what changed are judged again."""
        with self._lock:
            before = self._inventory
        if changed is None or before is None:
            fresh = scan_host(self._root)
            with self._lock:
                self._inventory = fresh if before is None else _sharing(before, fresh)
                inventory = self._inventory
        else:
            with self._lock:
                # judge_now may have read the host again since `before`.
                current = self._inventory or before
                self._inventory = refresh_host(self._root, current, _with_groups(current, changed))
                inventory = self._inventory
        devices = _rebuild(self._built_from, inventory, self._devices, self._config, self._names)
        with self._lock:
            self._devices = devices
        self._built_from = inventory

    def judge_now(self, bdfs: Iterable[Bdf]) -> Mapping[Bdf, DraDevice | str]:
        """Read the named functions (and their groups) again and judge each as a published
        device, or say why it is not one. The published devices are left as they were: the
        next scan publishes what changed."""
        wanted = set(bdfs)
        with self._lock:
            if self._inventory is None:
                inventory = scan_host(self._root)
            else:
                inventory = _read_again(self._root, self._inventory, wanted)
            self._inventory = inventory
        return {
            bdf: GONE
            if (function := inventory.function(bdf)) is None
            else judge_function(function, inventory, self._config, self._names)
            for bdf in wanted
        }


def _read_again(root: Path, inventory: HostInventory, bdfs: Iterable[Bdf]) -> HostInventory:
    """`inventory` with the functions `bdfs` names and their groups read again, and the host's
    capabilities. The re-read looks at those functions alone (refresh_host over an inventory of
    them), not at every function's device nodes: a prepare costs the same beside 200 functions
    as beside 4,096, and what else changed comes with the next event or re-scan."""
    named = _with_groups(inventory, bdfs)
    functions = [f for b in sorted(named) if (f := inventory.function(b)) is not None]
    groups = {g.number: g for f in functions if (g := inventory.group_of(f)) is not None}
    part = HostInventory(tuple(functions), tuple(groups.values()), inventory.capabilities)
    fresh = refresh_host(root, part, named)
    merged = inventory.with_changes(
        {b: fresh.function(b) for b in named | {f.bdf for f in fresh.functions}},
        {n: fresh.group(n) for n in groups.keys() | {g.number for g in fresh.groups}},
    )
    return merged.with_changes(capabilities=_whole_host(fresh.capabilities, merged))


def _whole_host(read: HostCapabilities, inventory: HostInventory) -> HostCapabilities:
    """The capabilities `read` from the host beside a part of its functions, as a reading beside
    all of `inventory`'s would say: an IOMMU is active when any group is there, and VFIO cdevs
    are seen when any function shows one (hostdev.scan reads them so)."""
    vfio_cdev = read.vfio_cdev
    if vfio_cdev is not True:
        if any(f.vfio_cdev for f in inventory.functions):
            vfio_cdev = True
        elif vfio_cdev is None and any(f.vfio_sysfs_without_cdev for f in inventory.functions):
            vfio_cdev = False
    return replace(read, iommu=read.iommu or bool(inventory.groups), vfio_cdev=vfio_cdev)


def _with_groups(inventory: HostInventory, bdfs: Iterable[Bdf]) -> set[Bdf]:
    """The functions and every member of their IOMMU groups: one member bound elsewhere makes
    the whole group not viable."""
    wanted = set(bdfs)
    for bdf in list(wanted):
        function = inventory.function(bdf)
        group = inventory.group_of(function) if function else None
        if group is not None:
            wanted |= {m.bdf for m in group.members if m.bdf is not None}
    return wanted


def published_json(devices: Iterable[DraDevice]) -> list[dict[str, Any]]:
    """What `parse_published` reads back: what an unusable device keeps of its publication."""
    return [
        {
            "bdf": str(d.bdf),
            "resource": d.resource,
            "attributes": dict(d.attributes),
            "group": d.group,
            "resetAfterUse": d.reset_after_use,
        }
        for d in devices
    ]


def parse_published(data: object) -> tuple[DraDevice, ...]:
    """The devices `published_json` gave; entries of any other shape are left out (it is only a
    hint: a device left out is judged as on a first start)."""
    devices: list[DraDevice] = []
    for entry in data if isinstance(data, list) else ():
        if not isinstance(entry, dict):
            continue
        bdf, resource, attributes = entry.get("bdf"), entry.get("resource"), entry.get("attributes")
        group, reset = entry.get("group"), entry.get("resetAfterUse")
        if not (
            isinstance(bdf, str)
            and is_bdf(bdf)
            and isinstance(resource, str)
            and isinstance(attributes, dict)
            and all(isinstance(v, str | int | bool) for v in attributes.values())
            and type(group) is int
            and isinstance(reset, bool)
        ):
            continue
        devices.append(
            DraDevice(
                name=device_name(Bdf.parse(bdf)),
                bdf=Bdf.parse(bdf),
                resource=resource,
                attributes=MappingProxyType(attributes),
                device_nodes=(),
                group=group,
                reset_after_use=reset,
            )
        )
    return tuple(devices)


def _sharing(before: HostInventory, fresh: HostInventory) -> HostInventory:
    """`fresh`, holding `before`'s objects for the functions and groups read the same."""
    functions: dict[Bdf, PciFunction | None] = {
        f.bdf: f for f in fresh.functions if before.function(f.bdf) != f
    }
    functions.update({f.bdf: None for f in before.functions if fresh.function(f.bdf) is None})
    groups: dict[int, IommuGroup | None] = {
        g.number: g for g in fresh.groups if before.group(g.number) != g
    }
    groups.update({g.number: None for g in before.groups if fresh.group(g.number) is None})
    return before.with_changes(functions, groups, fresh.capabilities)


def _rebuild(
    before: HostInventory | None,
    inventory: HostInventory,
    devices: tuple[DraDevice, ...],
    config: PluginConfig,
    names: PciIds,
) -> tuple[DraDevice, ...]:
    """`build_devices` of `inventory`, judging again only the functions whose reading (or
    group) differs from `before`'s, which `devices` were built from: a device is a pure
    function of its function, its group and the host's capabilities."""
    if (
        before is None
        or before.capabilities != inventory.capabilities
        or len(before.functions) != len(inventory.functions)
        or len(before.groups) != len(inventory.groups)
    ):
        return build_devices(inventory, config, names, {d.bdf: d for d in devices})
    groups = {b.number for a, b in zip(before.groups, inventory.groups, strict=True) if a is not b}
    changed = []
    for old, new in zip(before.functions, inventory.functions, strict=True):
        if old is not new or new.iommu_group in groups:
            if old.bdf != new.bdf:
                return build_devices(inventory, config, names, {d.bdf: d for d in devices})
            changed.append(new)
    if not changed:
        return devices
    bdfs = {f.bdf for f in changed}
    numbers = {f.iommu_group for f in changed}
    part = HostInventory(
        tuple(changed),
        tuple(g for g in inventory.groups if g.number in numbers),
        inventory.capabilities,
    )
    judged = build_devices(part, config, names, {d.bdf: d for d in devices if d.bdf in bdfs})
    return tuple(
        sorted([d for d in devices if d.bdf not in bdfs] + list(judged), key=lambda d: d.bdf)
    )
