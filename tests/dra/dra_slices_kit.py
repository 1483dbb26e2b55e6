"""Devices to publish, and the API server's copy of written slices, for the slice and publisher
tests."""

from __future__ import annotations

import copy
from types import MappingProxyType

from dra.devices import DraDevice, device_name
from dra.slices import Object
from hostdev.bdf import Bdf


def devices(count: int) -> list[DraDevice]:
    made = []
    for index in range(count):
        bdf = Bdf(0, index // 32 + 1, index % 32, 0)
        made.append(
            DraDevice(
                name=device_name(bdf),
                bdf=bdf,
                resource="example.com/dev",
                attributes=MappingProxyType({"resource.kubernetes.io/pciBusID": str(bdf)}),
                device_nodes=(),
                group=index,
            )
        )
    return made


def stored(objects: list[Object], start: int = 1, stamp: str | None = None) -> list[Object]:
    """What the API server would hold after creating `objects`: each with a resourceVersion,
    and each taint sent without `timeAdded` stamped with `stamp` (the server's clock)."""
    held = copy.deepcopy(objects)
    for offset, item in enumerate(held):
        item["metadata"]["resourceVersion"] = str(start + offset)
        for device in item["spec"]["devices"]:
            for taint in device.get("taints", ()):
                if stamp is not None:
                    taint.setdefault("timeAdded", stamp)
    return held
