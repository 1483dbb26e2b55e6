"""What Allocate and GetPreferredAllocation answer for a VFIO resource, and which requests the
iommufd resource accepts: pure functions of the device tree (or the slots) and the kubelet's
request. Ids from a request are quoted and shortened in every message (`quote_untrusted`): a
megabyte id would otherwise make a megabyte log line and a gRPC error trailer over its limit."""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence, Set
from dataclasses import dataclass

from deviceplugin.inventory import VfioDevice, VfioResource
from hostdev.bdf import Bdf
from hostdev.untrusted import quote_untrusted


class AllocationError(ValueError):
    """A request the plugin must refuse; the message names the device and why."""


@dataclass(frozen=True, slots=True)
class ContainerAllocation:
    device_nodes: tuple[str, ...]
    """Host paths, each given to the container at the same path with `mrw`."""
    envs: Mapping[str, str]


def plan_allocation(resource: VfioResource, device_ids: Sequence[str]) -> ContainerAllocation:
    """The nodes and environment for one container's devices, in request order.

    The environment lists only the requested BDFs: virt-launcher hands them to the VMI's devices
    by position, so a group sibling listed there would take a requested device's place.
    """
    if not device_ids:
        raise AllocationError(f"{resource.name}: the request names no device")
    repeated = [i for i, n in Counter(device_ids).items() if n > 1]
    if repeated:
        raise AllocationError(
            f"{resource.name}: device {quote_untrusted(repeated[0])} is requested twice"
        )
    nodes: dict[str, None] = {}
    for device_id in device_ids:
        device = resource.devices.get(device_id)
        if device is None:
            raise AllocationError(
                f"{resource.name}: unknown device {quote_untrusted(device_id)}: this node does"
                " not advertise it (see `kubevirt-iommufd inspect`)"
            )
        if not device.healthy:
            raise AllocationError(
                f"{resource.name}: device {device_id} is unhealthy: {device.reason}"
            )
        nodes.update(dict.fromkeys(device.device_nodes))
    return ContainerAllocation(tuple(nodes), {resource.env_name: ",".join(device_ids)})


def iommufd_slot_ids(slots: int) -> tuple[str, ...]:
    """The ids the iommufd resource advertises: `iommufd-000` and up."""
    return tuple(f"iommufd-{i:03d}" for i in range(slots))


def check_slot_request(
    resource_name: str, slot_ids: Set[str], containers: Sequence[Sequence[str]]
) -> None:
    """Refuse an iommufd Allocate unless each container names advertised slots and no slot
    is named twice in the request: each container gets a hand-off of its own, so the kubelet
    can never have more containers waiting for one than there are slots."""
    if not containers:
        raise AllocationError(f"{resource_name}: the request names no container")
    seen: set[str] = set()
    for slots in containers:
        if not slots:
            raise AllocationError(f"{resource_name}: a container request names no slot")
        for slot in slots:
            if slot not in slot_ids:
                raise AllocationError(
                    f"{resource_name}: unknown slot {quote_untrusted(slot)}: this node"
                    f" advertises {_slot_range(slot_ids)}"
                )
            if slot in seen:
                raise AllocationError(f"{resource_name}: slot {slot} is requested twice")
            seen.add(slot)


def _slot_range(slot_ids: Set[str]) -> str:
    if not slot_ids:
        return "no slots"
    ordered = sorted(slot_ids)
    return ordered[0] if len(ordered) == 1 else f"{ordered[0]} to {ordered[-1]}"


def plan_preferred(
    resource: VfioResource,
    available: Sequence[str],
    must_include: Sequence[str],
    size: int,
) -> list[str]:
    """The devices to prefer: `must_include` first, then from one NUMA node, under as few PCIe
    switches as possible, then the rest. Always a subset of `available`; when too few are
    available the answer is short and the kubelet fills the gap itself.
    """
    if len(must_include) > size:
        raise AllocationError(
            f"{resource.name}: {len(must_include)} devices must be included but only"
            f" {size} are to be allocated"
        )
    offered = list(dict.fromkeys(available))
    chosen = [d for d in dict.fromkeys(must_include) if d in offered]
    candidates = sorted(d for d in offered if d not in chosen)
    wanted = size - len(chosen)
    if wanted <= 0:
        return chosen[:size]
    info = {d: resource.devices.get(d) for d in offered}
    node = _target_numa_node(chosen, candidates, wanted, info)
    local = [d for d in candidates if _numa(info[d]) == node]
    chosen += _fill_by_switch(chosen, local, wanted, info)
    rest = [d for d in candidates if d not in chosen]
    # What is left comes from the fullest other nodes first, to stay on few NUMA nodes.
    counts = _numa_counts(rest, info)
    rest.sort(key=lambda d: (-counts[_numa(info[d])], _numa(info[d]) is None, d))
    chosen += rest[: size - len(chosen)]
    return chosen


def _target_numa_node(
    chosen: list[str], candidates: list[str], wanted: int, info: Mapping[str, VfioDevice | None]
) -> int | None:
    if chosen:
        # Stay with the NUMA node most of the required devices are on.
        return Counter(_numa(info[d]) for d in chosen).most_common(1)[0][0]
    counts = _numa_counts(candidates, info)
    if not counts:
        return None
    fitting = [n for n, count in counts.items() if count >= wanted]
    if fitting:
        # Best fit: the node with the fewest free devices that still holds the whole request
        # keeps the larger nodes whole for larger requests.
        return min(fitting, key=lambda n: (counts[n], n is None, _sort_key(n)))
    return max(counts, key=lambda n: (counts[n], n is not None, -_sort_key(n)))


def _fill_by_switch(
    chosen: list[str], local: list[str], wanted: int, info: Mapping[str, VfioDevice | None]
) -> list[str]:
    by_switch: dict[tuple[Bdf, ...], list[str]] = {}
    for device in local:
        by_switch.setdefault(_switch(info[device]), []).append(device)
    taken_switches = {_switch(info[d]) for d in chosen}
    picked: list[str] = []
    while len(picked) < wanted and by_switch:
        need = wanted - len(picked)
        key = _pick_switch(by_switch, taken_switches, need)
        picked += by_switch.pop(key)[:need]
    return picked


def _pick_switch(
    by_switch: dict[tuple[Bdf, ...], list[str]], taken: set[tuple[Bdf, ...]], need: int
) -> tuple[Bdf, ...]:
    shared = [k for k in by_switch if k in taken and k]
    if shared:
        return max(shared, key=lambda k: len(by_switch[k]))
    fitting = [k for k, devices in by_switch.items() if len(devices) >= need and k]
    if fitting:
        return min(fitting, key=lambda k: len(by_switch[k]))
    return max(by_switch, key=lambda k: (bool(k), len(by_switch[k])))


def _numa_counts(devices: list[str], info: Mapping[str, VfioDevice | None]) -> Counter[int | None]:
    return Counter(_numa(info[d]) for d in devices)


def _numa(device: VfioDevice | None) -> int | None:
    return None if device is None else device.numa_node


def _switch(device: VfioDevice | None) -> tuple[Bdf, ...]:
    return () if device is None else device.switch


def _sort_key(node: int | None) -> int:
    return -1 if node is None else node
