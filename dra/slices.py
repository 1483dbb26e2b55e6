"""ResourceSlices (`resource.k8s.io/v1`) for one node's pool, and the plan that brings what the
API server holds to them. Pure: objects in, objects and a plan out.

The pool is named after the node, split into slices of at most 128 devices (64 once any device
carries a taint, the API server's limit then) that all carry the pool's generation and its slice
count; the scheduler only trusts a pool once it sees that many slices of the newest generation, so
every change of content bumps the generation on all of them.

An unhealthy device carries the taint `<driver>/unhealthy` (KEP-5055): the scheduler allocates it
to no claim that does not tolerate the taint, and with `NoExecute` evicts the pods using it. The
API server stamps each taint's `timeAdded` when a write leaves it out; a plan carries the stamp of
the same taint over, so a stamped pool compares equal to the wanted one and is not rewritten, and
two writers of one pool agree on it.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from dra.devices import AttributeValue, DraDevice, typed_attributes
from dra.health import DeviceHealth, Health

# Re-exported: the publisher and its tests take it from here.
from dra.health import TaintEffect as TaintEffect  # noqa: PLC0414

API_VERSION = "resource.k8s.io/v1"
MAX_DEVICES_PER_SLICE = 128
MAX_DEVICES_PER_TAINTED_SLICE = 64
MAX_NAME = 253
UNHEALTHY_TAINT_NAME = "unhealthy"
Object = dict[str, Any]


@dataclass(frozen=True, slots=True)
class DeviceTaint:
    """One `spec.devices[].taints[]` entry as the driver wants it (the server adds `timeAdded`)."""

    key: str
    effect: TaintEffect
    value: str = ""


NO_TAINTS: Mapping[str, DeviceTaint] = MappingProxyType({})


@dataclass(frozen=True, slots=True)
class Owner:
    """The Node the slices belong to: deleting the Node deletes them."""

    name: str
    uid: str


@dataclass(frozen=True, slots=True)
class SlicePlan:
    generation: int
    create: tuple[Object, ...]
    update: tuple[Object, ...]
    """Full objects carrying the resourceVersion of the slice they replace."""
    delete: tuple[tuple[str, str], ...]
    """(name, resourceVersion) of slices no longer wanted."""

    @property
    def empty(self) -> bool:
        return not (self.create or self.update or self.delete)


def unhealthy_taint_key(driver: str) -> str:
    """`<driver>/unhealthy`: a label-style name in the driver's own domain (a driver name is a
    DNS subdomain of at most 63 characters, so the key is always a valid qualified name)."""
    return f"{driver}/{UNHEALTHY_TAINT_NAME}"


def build_taints(
    driver: str, health: Iterable[DeviceHealth], effect: TaintEffect
) -> dict[str, DeviceTaint]:
    """Device name → the taint it carries: UNHEALTHY devices only.

    UNKNOWN is left untainted: it means the driver could not judge (not yet checked), and
    tainting on it would take every device away from the scheduler whenever checking falters.
    The taint has no value: the reason is in the health stream's message and the driver's log,
    and a value that followed the reason would change the taint when the reason changes, which
    restarts `timeAdded` and so a NoExecute toleration's countdown (node taints such as
    `node.kubernetes.io/unreachable` carry no value either).
    """
    taint = DeviceTaint(unhealthy_taint_key(driver), effect)
    return {h.device: taint for h in health if h.health is Health.UNHEALTHY}


Typed = Callable[[Mapping[str, AttributeValue]], Object]
"""`typed_attributes`, or a `TypedCache` of it."""


class TypedCache:
    """`typed_attributes` of each device's attributes, kept from one pool to the next while they
    are the same object (the host cache rebuilds a device only when its function changed): every
    change of the pool rewrites all of it, a prepare's group companions leaving it too, and
    typing 4,096 devices' attributes anew each time took 30 ms of the driver's time, which a
    prepare beside it waited for. The entries it gives are shared: never change them."""

    def __init__(self) -> None:
        self._held: dict[int, tuple[Mapping[str, AttributeValue], Object]] = {}
        self._used: dict[int, tuple[Mapping[str, AttributeValue], Object]] = {}

    def __call__(self, attributes: Mapping[str, AttributeValue]) -> Object:
        key = id(attributes)
        held = self._held.get(key)
        # The mapping is held with its typing, so its id is not another's while cached.
        if held is None or held[0] is not attributes:
            held = (attributes, typed_attributes(attributes))
        self._used[key] = held
        return held[1]

    def settle(self) -> None:
        """Forget what was not asked for since the last settle (devices gone or rebuilt)."""
        self._held, self._used = self._used, {}


def build_device_entry(
    device: DraDevice, taint: DeviceTaint | None = None, typed: Typed = typed_attributes
) -> Object:
    entry: Object = {"name": device.name, "attributes": typed(device.attributes)}
    if taint is not None:
        fields = {"key": taint.key, "value": taint.value, "effect": taint.effect.value}
        entry["taints"] = [{k: v for k, v in fields.items() if v}]
    return entry


def slice_name(node: str, driver: str, index: int) -> str:
    """`<node>-<driver>-<index>`, or a hashed stand-in for the pair when that would be longer
    than an object name may be."""
    name = f"{node}-{driver}-{index}"
    if len(name) <= MAX_NAME:
        return name
    digest = hashlib.sha256(f"{node}\0{driver}".encode()).hexdigest()[:16]
    return f"{node[: MAX_NAME - 40].rstrip('-.')}-{digest}-{index}"


def build_slices(
    owner: Owner,
    driver: str,
    devices: Sequence[DraDevice],
    generation: int,
    taints: Mapping[str, DeviceTaint] = NO_TAINTS,
    slots: Sequence[Object] = (),
    typed: Typed = typed_attributes,
) -> list[Object]:
    """The pool's slices: at least one, so an empty pool is published as empty, not unknown.
    `slots` are the iommufd slots' entries (dra.iommufd_slots), after the devices.

    `taints` maps device names to the taint each carries. While any device is tainted every
    slice holds at most 64: the split stays one rule of the pool, and the pool is rewritten at
    a new generation on any taint change anyway.
    """
    entries = [build_device_entry(d, taints.get(d.name), typed) for d in devices] + list(slots)
    size = (
        MAX_DEVICES_PER_TAINTED_SLICE
        if any(d.name in taints for d in devices)
        else MAX_DEVICES_PER_SLICE
    )
    chunks = [entries[start : start + size] for start in range(0, len(entries), size)] or [[]]
    return [
        {
            "apiVersion": API_VERSION,
            "kind": "ResourceSlice",
            "metadata": {
                "name": slice_name(owner.name, driver, index),
                "ownerReferences": [
                    {
                        "apiVersion": "v1",
                        "kind": "Node",
                        "name": owner.name,
                        "uid": owner.uid,
                        "controller": True,
                    }
                ],
            },
            "spec": {
                "driver": driver,
                "nodeName": owner.name,
                "pool": {
                    "name": owner.name,
                    "generation": generation,
                    "resourceSliceCount": len(chunks),
                },
                "devices": chunk,
            },
        }
        for index, chunk in enumerate(chunks)
    ]


def plan_slices(
    existing: Iterable[Object],
    owner: Owner,
    driver: str,
    devices: Sequence[DraDevice],
    taints: Mapping[str, DeviceTaint] = NO_TAINTS,
    slots: Sequence[Object] = (),
    typed: Typed = typed_attributes,
) -> SlicePlan:
    """What to write so the API server holds exactly the pool for `devices` and `taints`.

    Nothing when it already does. Otherwise every slice is written at a generation above any
    seen (also above slices some other writer left), and slices beyond the new count go. A
    taint already held (same device, key, value and effect) keeps its `timeAdded`.
    """
    current = {s["metadata"]["name"]: s for s in existing}
    generations = [_pool(s).get("generation", 0) for s in current.values()]
    generation = max(generations, default=0)
    wanted = build_slices(owner, driver, devices, generation + 1, taints, slots, typed)
    _carry_time_added(current.values(), wanted)
    if current and _same_pool(current, wanted):
        return SlicePlan(generation, (), (), ())
    generation += 1
    create: list[Object] = []
    update: list[Object] = []
    for item in wanted:
        name = item["metadata"]["name"]
        if name in current:
            item["metadata"]["resourceVersion"] = current[name]["metadata"]["resourceVersion"]
            update.append(item)
        else:
            create.append(item)
    names = {item["metadata"]["name"] for item in wanted}
    delete = tuple(
        (name, s["metadata"].get("resourceVersion", ""))
        for name, s in sorted(current.items())
        if name not in names
    )
    return SlicePlan(generation, tuple(create), tuple(update), delete)


def tainted_devices(item: Object) -> set[str]:
    """The names of a slice's devices that carry a taint (of a written slice, as answered)."""
    return {str(d.get("name")) for d in _entries(item) if d.get("taints")}


def _carry_time_added(current: Iterable[Object], wanted: Sequence[Object]) -> None:
    """Give each wanted taint the `timeAdded` the server stamped on the same taint of the same
    device, wherever in the pool that device is held now (a split can move it)."""
    stamped: dict[tuple[str, tuple[str, str, str]], str] = {}
    for item in current:
        for device in _entries(item):
            taints = device.get("taints")
            for taint in taints if isinstance(taints, list) else []:
                if isinstance(taint, dict) and isinstance(taint.get("timeAdded"), str):
                    stamped[str(device.get("name")), _taint_identity(taint)] = taint["timeAdded"]
    for item in wanted:
        for device in item["spec"]["devices"]:
            for taint in device.get("taints", ()):
                held = stamped.get((device["name"], _taint_identity(taint)))
                if held is not None:
                    taint["timeAdded"] = held


def _taint_identity(taint: Object) -> tuple[str, str, str]:
    return str(taint.get("key")), str(taint.get("value") or ""), str(taint.get("effect"))


def _entries(item: Object) -> list[Object]:
    """A held slice's device entries (what is not an object is no device of ours)."""
    devices = (item.get("spec") or {}).get("devices")
    return [d for d in devices if isinstance(d, dict)] if isinstance(devices, list) else []


def _pool(item: Object) -> Object:
    pool: Object = (item.get("spec") or {}).get("pool") or {}
    return pool


def _same_pool(current: Mapping[str, Object], wanted: Sequence[Object]) -> bool:
    """Whether the slices held are the wanted ones at one generation (whichever it is)."""
    generations = {_pool(item).get("generation") for item in current.values()}
    return len(generations) == 1 and {name: _content(item) for name, item in current.items()} == {
        item["metadata"]["name"]: _content(item) for item in wanted
    }


def _content(item: Object) -> tuple[object, ...]:
    spec = item.get("spec") or {}
    return (
        spec.get("driver"),
        spec.get("nodeName"),
        _pool(item).get("resourceSliceCount"),
        spec.get("devices") or [],
        _owner_uids(item),
    )


def _owner_uids(item: Object) -> list[str]:
    return [ref.get("uid", "") for ref in item["metadata"].get("ownerReferences") or []]
