"""Device selectors for `bind --match` and reservations: which PCI functions, by ids or class.

Two spellings: KubeVirt's `pciVendorSelector` form `VVVV:DDDD` (device may be `*`), or
comma-separated terms `vendor=10de,device=2330,class=0302,driver=nvidia`; all terms must hold.
Chipset bridges never match: they cannot be assigned.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from hostdev.errors import HostdevError
from hostdev.model import HostInventory, PciFunction

_VENDOR_DEVICE = re.compile(r"([0-9a-f]{4}):([0-9a-f]{4}|\*)")
_HEX4 = re.compile(r"[0-9a-f]{4}")
_CLASS = re.compile(r"[0-9a-f]{2}|[0-9a-f]{4}|[0-9a-f]{6}")
_DRIVER = re.compile(r"[A-Za-z0-9_.-]{1,64}")
_KEYS = ("vendor", "device", "class", "driver")


class InvalidSelector(HostdevError, ValueError):
    def __init__(self, text: str, problem: str) -> None:
        self.text = text
        super().__init__(
            f"invalid device selector {text!r}: {problem}; write VVVV:DDDD (e.g. 10de:2330)"
            " or terms like vendor=10de,device=2330,class=0302,driver=nvidia"
        )


@dataclass(frozen=True, slots=True)
class DeviceSelector:
    vendor: int | None = None
    device: int | None = None
    class_prefix: str | None = None
    """Hex prefix of the 24-bit class code: "03", "0302" or "030200"."""
    driver: str | None = None
    text: str = ""

    @classmethod
    def parse(cls, text: str) -> DeviceSelector:
        lowered = text.strip().lower()
        if match := _VENDOR_DEVICE.fullmatch(lowered):
            device = None if match[2] == "*" else int(match[2], 16)
            return cls(vendor=int(match[1], 16), device=device, text=text)
        terms: dict[str, str] = {}
        for term in (t.strip() for t in text.split(",")):
            key, sep, value = term.partition("=")
            key = key.strip().lower()
            value = value.strip()
            if not sep or key not in _KEYS:
                raise InvalidSelector(text, f"{term!r} is not one of {', '.join(_KEYS)}=VALUE")
            if key in terms:
                raise InvalidSelector(text, f"{key} is given twice")
            terms[key] = value
        for key in ("vendor", "device"):
            if key in terms:
                terms[key] = terms[key].lower().removeprefix("0x")
                if not _HEX4.fullmatch(terms[key]):
                    raise InvalidSelector(text, f"{key} must be 4 hex digits such as 10de")
        if "class" in terms:
            terms["class"] = terms["class"].lower().removeprefix("0x")
            if not _CLASS.fullmatch(terms["class"]):
                raise InvalidSelector(text, "class must be 2, 4 or 6 hex digits such as 0302")
        if "driver" in terms and not _DRIVER.fullmatch(terms["driver"]):
            raise InvalidSelector(text, "driver must be a driver name such as nvidia")
        return cls(
            vendor=int(terms["vendor"], 16) if "vendor" in terms else None,
            device=int(terms["device"], 16) if "device" in terms else None,
            class_prefix=terms.get("class"),
            driver=terms.get("driver"),
            text=text,
        )

    def matches(self, function: PciFunction) -> bool:
        if function.is_bridge:
            return False
        if self.vendor is not None and function.vendor_id != self.vendor:
            return False
        if self.device is not None and function.device_id != self.device:
            return False
        if self.class_prefix is not None and not f"{function.class_code:06x}".startswith(
            self.class_prefix
        ):
            return False
        return self.driver is None or function.driver == self.driver


def select_functions(inventory: HostInventory, selector: DeviceSelector) -> tuple[PciFunction, ...]:
    return tuple(f for f in inventory.functions if selector.matches(f))
