"""Reset after use (RFD 114's dirty -> cleaned), as pure transitions over what the plugin saw.

For each device of a resource with `resetAfterUse`, the plugin tracks where it is in its life:

    unknown --(not in List)--------------------------> dirty (never vouched for by this run)
    free --(Allocate)--> allocated --(in List)--> assigned --(not in List)--> dirty
    allocated --(not in List after the grace period: the pod never started or ended at once)-> dirty
    dirty --(a reset is started)--> resetting --(done, or no method)--> free
    resetting --(still held by a process)--> dirty (tried again at the next List)
    resetting --(the write failed)--> failed --(after the retry delay)--> dirty

Dirty, resetting and failed devices are advertised Unhealthy, so the kubelet hands out only
clean ones. The grace period exists because the kubelet records an allocation a moment after
Allocate returns; a List in between must not make a device just handed out look released.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from enum import Enum
from types import MappingProxyType

from deviceplugin.inventory import DeviceTree, VfioResource

Key = tuple[str, str]
"""(resource name, device id)."""

RESETTING_REASON = "resetting after use"


class Phase(Enum):
    UNKNOWN = "unknown"
    FREE = "free"
    ALLOCATED = "allocated"
    ASSIGNED = "assigned"
    DIRTY = "dirty"
    RESETTING = "resetting"
    FAILED = "failed"


@dataclass(frozen=True, slots=True)
class DeviceUse:
    phase: Phase
    since: float
    message: str = ""


@dataclass(frozen=True, slots=True)
class ResetTiming:
    grace_seconds: float = 10.0
    retry_seconds: float = 30.0


@dataclass(frozen=True, slots=True)
class ResetState:
    devices: Mapping[Key, DeviceUse] = field(default_factory=lambda: MappingProxyType({}))

    def phase(self, key: Key) -> Phase:
        use = self.devices.get(key)
        return Phase.UNKNOWN if use is None else use.phase


def tracked_devices(tree: DeviceTree) -> frozenset[Key]:
    """The devices of every resource that resets after use."""
    return frozenset(
        (resource.name, device_id)
        for resource in tree.resources.values()
        if resource.reset_after_use
        for device_id in resource.devices
    )


def observe_allocation(
    state: ResetState, resource: str, device_ids: Iterable[str], now: float
) -> ResetState:
    devices = dict(state.devices)
    for device_id in device_ids:
        key = (resource, device_id)
        if state.phase(key) in (Phase.UNKNOWN, Phase.FREE):
            devices[key] = DeviceUse(Phase.ALLOCATED, now)
    return ResetState(MappingProxyType(devices))


def observe_assignments(
    state: ResetState,
    tracked: frozenset[Key],
    assigned: Mapping[str, frozenset[str]],
    now: float,
    timing: ResetTiming,
) -> tuple[ResetState, tuple[Key, ...]]:
    """Fold in one pod resources List: the new state and the devices to reset now (which
    are `resetting` in it)."""
    devices: dict[Key, DeviceUse] = {}
    start: list[Key] = []
    for key in sorted(tracked):
        use = state.devices.get(key, DeviceUse(Phase.UNKNOWN, now))
        held = key[1] in assigned.get(key[0], frozenset())
        if use.phase is Phase.RESETTING:
            pass  # its reset is under way; the next List after it settles the rest
        elif held:
            use = use if use.phase is Phase.ASSIGNED else DeviceUse(Phase.ASSIGNED, now)
        elif use.phase is Phase.UNKNOWN:
            use = DeviceUse(Phase.DIRTY, now, "not known to be clean when the plugin started")
        elif use.phase is Phase.ASSIGNED:
            use = DeviceUse(Phase.DIRTY, now, "released by its pod")
        elif use.phase is Phase.ALLOCATED and now - use.since >= timing.grace_seconds:
            use = DeviceUse(Phase.DIRTY, now, "allocated, but no pod holds it any more")
        elif use.phase is Phase.FAILED and now - use.since >= timing.retry_seconds:
            use = DeviceUse(Phase.DIRTY, now, f"retrying after: {use.message}")
        if use.phase is Phase.DIRTY:
            use = DeviceUse(Phase.RESETTING, now, use.message)
            start.append(key)
        devices[key] = use
    return ResetState(MappingProxyType(devices)), tuple(start)


def observe_reset(state: ResetState, key: Key, status: str, message: str, now: float) -> ResetState:
    """Fold in a finished reset; `status` is a hostdev.binding.reset.ResetStatus value."""
    if state.phase(key) is not Phase.RESETTING:
        return state  # the device left the tree meanwhile
    if status in ("reset", "no-method"):
        use = DeviceUse(Phase.FREE, now)
    elif status == "busy":
        use = DeviceUse(Phase.DIRTY, now, message)
    else:
        use = DeviceUse(Phase.FAILED, now, message)
    return ResetState(MappingProxyType({**state.devices, key: use}))


def unhealthy_reasons(state: ResetState) -> dict[Key, str]:
    """Why each device that must not be handed out is Unhealthy."""
    reasons: dict[Key, str] = {}
    for key, use in state.devices.items():
        if use.phase in (Phase.DIRTY, Phase.RESETTING):
            reasons[key] = RESETTING_REASON
        elif use.phase is Phase.FAILED:
            reasons[key] = f"reset failed: {use.message}; retrying"
    return reasons


def overlay_resets(tree: DeviceTree, reasons: Mapping[Key, str]) -> DeviceTree:
    """The tree with devices awaiting a reset turned Unhealthy (a device already unhealthy
    for another reason keeps that reason)."""
    if not reasons:
        return tree
    resources: dict[str, VfioResource] = {}
    for name, resource in tree.resources.items():
        changed = {
            device_id: replace(device, healthy=False, reason=reasons[(name, device_id)])
            for device_id, device in resource.devices.items()
            if device.healthy and (name, device_id) in reasons
        }
        devices = MappingProxyType({i: changed.get(i, d) for i, d in resource.devices.items()})
        resources[name] = replace(resource, devices=devices) if changed else resource
    return replace(tree, resources=MappingProxyType(resources))
