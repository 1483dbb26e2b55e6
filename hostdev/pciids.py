"""Vendor, device and class names from the pci.ids database, parsed once and only when asked."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

from hostdev.errors import PciIdsError

# Where Debian (pci.ids), Fedora/RHEL (hwdata) and Alpine put the database.
DEFAULT_PATHS = (
    Path("/usr/share/misc/pci.ids"),
    Path("/usr/share/hwdata/pci.ids"),
    Path("/usr/share/pci.ids"),
)

_VENDOR = re.compile(r"([0-9a-f]{4})  (.+)")
_DEVICE = re.compile(r"\t([0-9a-f]{4})  (.+)")
_SUBSYSTEM = re.compile(r"\t\t([0-9a-f]{4}) ([0-9a-f]{4})  (.+)")
_CLASS = re.compile(r"C ([0-9a-f]{2})  (.+)")
_SUBCLASS = re.compile(r"\t([0-9a-f]{2})  (.+)")
_PROG_IF = re.compile(r"\t\t([0-9a-f]{2})  (.+)")


@dataclass(slots=True)
class _Tables:
    vendors: dict[int, str] = field(default_factory=dict)
    devices: dict[tuple[int, int], str] = field(default_factory=dict)
    subsystems: dict[tuple[int, int, int, int], str] = field(default_factory=dict)
    classes: dict[tuple[int, ...], str] = field(default_factory=dict)


class PciIds:
    """Names for PCI ids. With no database every look-up answers None, and nothing else changes."""

    def __init__(self, path: Path | None) -> None:
        self.path = path
        self._tables: _Tables | None = None

    @classmethod
    def find(cls) -> PciIds:
        """The first database found in the usual places, or an empty one."""
        return cls(next((p for p in DEFAULT_PATHS if p.is_file()), None))

    def vendor_name(self, vendor: int) -> str | None:
        return self._load().vendors.get(vendor)

    def device_name(self, vendor: int, device: int) -> str | None:
        return self._load().devices.get((vendor, device))

    def subsystem_name(
        self, vendor: int, device: int, sub_vendor: int, sub_device: int
    ) -> str | None:
        return self._load().subsystems.get((vendor, device, sub_vendor, sub_device))

    def class_name(self, class_code: int) -> str | None:
        """The most specific name for a 24-bit class code (class, subclass, programming if)."""
        base, sub, prog_if = class_code >> 16, (class_code >> 8) & 0xFF, class_code & 0xFF
        classes = self._load().classes
        return classes.get((base, sub, prog_if)) or classes.get((base, sub)) or classes.get((base,))

    def _load(self) -> _Tables:
        if self._tables is None:
            self._tables = _parse(self.path) if self.path is not None else _Tables()
        return self._tables


def _parse(path: Path) -> _Tables:
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except FileNotFoundError:
        return _Tables()
    except OSError as error:
        raise PciIdsError(str(path), 0, error.strerror or str(error)) from error
    tables = _Tables()
    vendor: int | None = None
    device: int | None = None
    klass: int | None = None
    subclass: int | None = None
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip() or line.startswith("#"):
            continue
        if match := _VENDOR.fullmatch(line):
            vendor, device, klass = int(match[1], 16), None, None
            tables.vendors[vendor] = match[2]
        elif match := _CLASS.fullmatch(line):
            klass, subclass, vendor = int(match[1], 16), None, None
            tables.classes[(klass,)] = match[2]
        elif klass is not None and (match := _SUBCLASS.fullmatch(line)):
            subclass = int(match[1], 16)
            tables.classes[(klass, subclass)] = match[2]
        elif klass is not None and subclass is not None and (match := _PROG_IF.fullmatch(line)):
            tables.classes[(klass, subclass, int(match[1], 16))] = match[2]
        elif vendor is not None and (match := _DEVICE.fullmatch(line)):
            device = int(match[1], 16)
            tables.devices[(vendor, device)] = match[2]
        elif vendor is not None and device is not None and (match := _SUBSYSTEM.fullmatch(line)):
            key = (vendor, device, int(match[1], 16), int(match[2], 16))
            tables.subsystems[key] = match[3]
        else:
            raise PciIdsError(str(path), number, f"unexpected line {line[:60]!r}")
    return tables
