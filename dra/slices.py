"""ResourceSlices (`resource.k8s.io/v1`) for one node's pool, and the plan that brings what the
API server holds to them. Pure: objects in, objects and a plan out.

The pool is named after the node, split into slices of at most 128 devices that all carry the
pool's generation and its slice count; the scheduler only trusts a pool once it sees that many
slices of the newest generation, so every change of content bumps the generation on all of them.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from dra.devices import DraDevice, typed_attributes

API_VERSION = "resource.k8s.io/v1"
MAX_DEVICES_PER_SLICE = 128
MAX_NAME = 253
Object = dict[str, Any]


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


def build_device_entry(device: DraDevice) -> Object:
    return {"name": device.name, "attributes": typed_attributes(device.attributes)}


def slice_name(node: str, driver: str, index: int) -> str:
    """`<node>-<driver>-<index>`, or a hashed stand-in for the pair when that would be longer
    than an object name may be."""
    name = f"{node}-{driver}-{index}"
    if len(name) <= MAX_NAME:
        return name
    digest = hashlib.sha256(f"{node}\0{driver}".encode()).hexdigest()[:16]
    return f"{node[: MAX_NAME - 40].rstrip('-.')}-{digest}-{index}"


def build_slices(
    owner: Owner, driver: str, devices: Sequence[DraDevice], generation: int
) -> list[Object]:
    """The pool's slices: at least one, so an empty pool is published as empty, not unknown."""
    entries = [build_device_entry(d) for d in devices]
    chunks = [
        entries[start : start + MAX_DEVICES_PER_SLICE]
        for start in range(0, len(entries), MAX_DEVICES_PER_SLICE)
    ] or [[]]
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
    existing: Iterable[Object], owner: Owner, driver: str, devices: Sequence[DraDevice]
) -> SlicePlan:
    """What to write so the API server holds exactly the pool for `devices`.

    Nothing when it already does. Otherwise every slice is written at a generation above any
    seen (also above slices some other writer left), and slices beyond the new count go.
    """
    current = {s["metadata"]["name"]: s for s in existing}
    generations = [_pool(s).get("generation", 0) for s in current.values()]
    generation = max(generations, default=0)
    wanted = build_slices(owner, driver, devices, generation + 1)
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
