"""Persistent reservations: the devices a node keeps on VFIO drivers (RFD 114's ppt database).

`bind --from-config FILE` applies the file from a DaemonSet init container before the device
plugin starts, so a reboot never leaves a reserved device on a host driver. YAML or JSON (by
suffix); every error names the key:

    driver: auto                 # default for every entry: auto or a driver name
    devices:
      - pciAddress: "0000:3b:00.0"
      - match: "10de:2330"       # a selector, as `bind --match`
        driver: vfio-pci
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hostdev.bdf import Bdf
from hostdev.binding.plan import AUTO, BindRequest
from hostdev.documents import DocumentError, read_document
from hostdev.errors import HostdevError, InvalidBdf
from hostdev.model import HostInventory
from hostdev.selector import DeviceSelector, InvalidSelector, select_functions
from hostdev.untrusted import quote_untrusted

_DRIVER = re.compile(r"[A-Za-z0-9_.-]{1,64}")


class ReservationError(HostdevError, ValueError):
    """A reservations file that cannot be used; the message names the file, the key and the fix."""


@dataclass(frozen=True, slots=True)
class Reservation:
    bdf: Bdf | None
    selector: DeviceSelector | None
    driver: str
    key: str
    """Where it came from, `devices[1]`, for messages."""


def load_reservations(path: Path) -> tuple[Reservation, ...]:
    try:
        data = read_document(path, "reservations")
    except DocumentError as error:
        raise ReservationError(str(error)) from error
    try:
        return parse_reservations(data)
    except ReservationError as error:
        raise ReservationError(f"reservations {path}: {error}") from error


def parse_reservations(data: object) -> tuple[Reservation, ...]:
    top = _mapping(data, "the document")
    _known(top, "", {"driver", "devices"})
    default = _driver(top.get("driver", AUTO), "driver")
    devices = top.get("devices")
    # An empty list is a node that reserves nothing: the DaemonSet's init container still runs.
    if not isinstance(devices, list):
        raise ReservationError(f"devices: expected a list, got {_kind(devices)}")
    return tuple(_entry(item, f"devices[{i}]", default) for i, item in enumerate(devices))


def resolve_reservations(
    reservations: tuple[Reservation, ...], inventory: HostInventory
) -> tuple[BindRequest, ...]:
    """The bind requests a file makes on this host: every address it names (which must exist)
    and every function its selectors match (possibly none: one file serves many nodes)."""
    requests: dict[Bdf, BindRequest] = {}
    for reservation in reservations:
        if reservation.bdf is not None:
            if inventory.function(reservation.bdf) is None:
                raise ReservationError(
                    f"{reservation.key}.pciAddress: no PCI function {reservation.bdf} on this"
                    " host; fix the address (see `kubevirt-iommufd inspect`) or use a selector"
                )
            requests.setdefault(reservation.bdf, BindRequest(reservation.bdf, reservation.driver))
        elif reservation.selector is not None:
            for function in select_functions(inventory, reservation.selector):
                requests.setdefault(function.bdf, BindRequest(function.bdf, reservation.driver))
    return tuple(requests[b] for b in sorted(requests))


def _entry(data: object, key: str, default: str) -> Reservation:
    item = _mapping(data, key)
    _known(item, key, {"pciAddress", "match", "driver"})
    if ("pciAddress" in item) == ("match" in item):
        raise ReservationError(f"{key}: give exactly one of pciAddress and match")
    driver = _driver(item.get("driver", default), f"{key}.driver")
    if "pciAddress" in item:
        text = _string(item["pciAddress"], f"{key}.pciAddress")
        try:
            return Reservation(Bdf.parse(text), None, driver, key)
        except InvalidBdf as error:
            raise ReservationError(f"{key}.pciAddress: {error}") from None
    try:
        selector = DeviceSelector.parse(_string(item["match"], f"{key}.match"))
    except InvalidSelector as error:
        raise ReservationError(f"{key}.match: {error}") from None
    return Reservation(None, selector, driver, key)


def _driver(value: object, key: str) -> str:
    text = _string(value, key)
    if not _DRIVER.fullmatch(text):
        raise ReservationError(
            f"{key}: expected auto or a driver name such as vfio-pci, got {text!r}"
        )
    return text


def _string(value: object, key: str) -> str:
    if isinstance(value, str) and value:
        return value
    hint = ""
    if isinstance(value, int | float) and not isinstance(value, bool):
        # YAML 1.1 reads 0000:18:00.0 as a base-60 number.
        hint = "; quote PCI addresses and ids in YAML"
    raise ReservationError(f"{key}: expected a non-empty string, got {_kind(value)}{hint}")


def _mapping(value: object, key: str) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise ReservationError(f"{key}: expected a mapping, got {_kind(value)}")
    return value


def _known(item: Mapping[str, Any], key: str, allowed: set[str]) -> None:
    for name in item:
        if name not in allowed:
            text = str(name)
            # Quoted when it could break the one-line message (a newline, a megabyte).
            shown = text if text.isprintable() and len(text) <= 60 else quote_untrusted(text, 60)
            where = f"{key}.{shown}" if key else shown
            raise ReservationError(
                f"{where}: unknown key; expected one of {', '.join(sorted(allowed))}"
            )


def _kind(value: object) -> str:
    if value is None:
        return "nothing"
    return f"{type(value).__name__} {value!r}"[:80]
