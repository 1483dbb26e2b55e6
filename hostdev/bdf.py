"""PCI addresses (domain:bus:slot.function), validated before any path is built from them."""

from __future__ import annotations

import re
from dataclasses import dataclass

from hostdev.errors import InvalidBdf

# The kernel prints the domain with "%04x", so VMD domains (0x10000 and up) have more digits.
_BDF = re.compile(r"([0-9a-f]{4,8}):([0-9a-f]{2}):([01][0-9a-f])\.([0-7])")


@dataclass(frozen=True, order=True, slots=True)
class Bdf:
    """A PCI function address; `str()` gives the kernel's sysfs name."""

    domain: int
    bus: int
    slot: int
    function: int

    @classmethod
    def parse(cls, text: str) -> Bdf:
        """Parse the kernel's form exactly; anything else (upper case, `../`, spaces) is refused."""
        match = _BDF.fullmatch(text)
        if match is None:
            raise InvalidBdf(text)
        domain, bus, slot, function = match.groups()
        return cls(int(domain, 16), int(bus, 16), int(slot, 16), int(function, 16))

    def __str__(self) -> str:
        return f"{self.domain:04x}:{self.bus:02x}:{self.slot:02x}.{self.function:x}"

    @property
    def device_address(self) -> str:
        """The address without the function: functions sharing it are one physical device."""
        return f"{self.domain:04x}:{self.bus:02x}:{self.slot:02x}"


def is_bdf(text: str) -> bool:
    """True when `text` is a PCI address in the kernel's form."""
    return _BDF.fullmatch(text) is not None
