"""Vendor, device and class names from the pci.ids database, read only when asked, and then only
as much as is asked: a daemon names a handful of vendors' devices, and parsing all of a 1.3 MB
database cost a DRA driver's start 170 ms and its RSS 13 MB (issue 22). The whole file is still
checked at the first look-up, so a malformed database is refused whichever names are asked."""

from __future__ import annotations

import bisect
import functools
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


class _Grammar:
    """The database's line forms, compiled at the first look-up: compiling them cost each
    daemon's start 3 ms before it could serve (issue 22), and most never look a name up."""

    def __init__(self) -> None:
        self.vendor = re.compile(r"([0-9a-f]{4})  (.+)")
        self.device = re.compile(r"\t([0-9a-f]{4})  (.+)")
        self.subsystem = re.compile(r"\t\t([0-9a-f]{4}) ([0-9a-f]{4})  (.+)")
        self.klass = re.compile(r"C ([0-9a-f]{2})  (.+)")
        self.subclass = re.compile(r"\t([0-9a-f]{2})  (.+)")
        self.prog_if = re.compile(r"\t\t([0-9a-f]{2})  (.+)")
        # The whole text at once, in C: section headers, and what makes a file suspect, which
        # then is read line by line as before to say which line is wrong.
        self.header = re.compile(r"^(?:([0-9a-f]{4})|C ([0-9a-f]{2}))  (.+)$", re.M)
        self.odd_line = re.compile(
            r"^(?![0-9a-f]{4}  .|\t[0-9a-f]{4}  .|\t\t[0-9a-f]{4} [0-9a-f]{4}  .|C [0-9a-f]{2}  ."
            r"|\t\t?[0-9a-f]{2}  .|#|[ \t]*$)",
            re.M,
        )
        self.class_form = re.compile(r"^\t\t?[0-9a-f]{2}  ", re.M)
        self.subsystem_first = re.compile(r"^[0-9a-f]{4}  .*\n(?:(?:#.*|[ \t]*)\n)*\t\t", re.M)
        self.vendor_lines = re.compile(
            r"^\t([0-9a-f]{4})  (.+)$|^\t\t([0-9a-f]{4}) ([0-9a-f]{4})  (.+)$", re.M
        )


@functools.cache
def _grammar() -> _Grammar:
    return _Grammar()


_OTHER_BREAKS = "\r\x0b\x0c\x1c\x1d\x1e\x85\u2028\u2029"
"""Where str.splitlines breaks a line besides "\n"."""


@dataclass(slots=True)
class _Devices:
    """One vendor's devices and subsystems."""

    devices: dict[int, str] = field(default_factory=dict)
    subsystems: dict[tuple[int, int, int], str] = field(default_factory=dict)


@dataclass(slots=True)
class _Index:
    """The checked text, its vendors and classes, and each vendor's devices once asked for."""

    text: str = ""
    vendors: dict[int, str] = field(default_factory=dict)
    classes: dict[tuple[int, ...], str] = field(default_factory=dict)
    spans: dict[int, list[tuple[int, int]]] = field(default_factory=dict)
    parsed: dict[int, _Devices] = field(default_factory=dict)

    def devices_of(self, vendor: int) -> _Devices:
        known = self.parsed.get(vendor)
        if known is None:
            known = _Devices()
            grammar = _grammar()
            for start, end in self.spans.get(vendor, ()):
                device: int | None = None
                for match in grammar.vendor_lines.finditer(self.text, start, end):
                    if match[1] is not None:
                        device = int(match[1], 16)
                        known.devices[device] = match[2]
                    elif device is not None:
                        key = (device, int(match[3], 16), int(match[4], 16))
                        known.subsystems[key] = match[5]
            self.parsed[vendor] = known
        return known


class PciIds:
    """Names for PCI ids. With no database every look-up answers None, and nothing else changes."""

    def __init__(self, path: Path | None) -> None:
        self.path = path
        self._index: _Index | None = None

    @classmethod
    def find(cls) -> PciIds:
        """The first database found in the usual places, or an empty one."""
        return cls(next((p for p in DEFAULT_PATHS if p.is_file()), None))

    def vendor_name(self, vendor: int) -> str | None:
        return self._load().vendors.get(vendor)

    def device_name(self, vendor: int, device: int) -> str | None:
        return self._load().devices_of(vendor).devices.get(device)

    def subsystem_name(
        self, vendor: int, device: int, sub_vendor: int, sub_device: int
    ) -> str | None:
        return self._load().devices_of(vendor).subsystems.get((device, sub_vendor, sub_device))

    def class_name(self, class_code: int) -> str | None:
        """The most specific name for a 24-bit class code (class, subclass, programming if)."""
        base, sub, prog_if = class_code >> 16, (class_code >> 8) & 0xFF, class_code & 0xFF
        classes = self._load().classes
        return classes.get((base, sub, prog_if)) or classes.get((base, sub)) or classes.get((base,))

    def _load(self) -> _Index:
        if self._index is None:
            self._index = _read_index(self.path) if self.path is not None else _Index()
        return self._index


def _read_index(path: Path) -> _Index:
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except FileNotFoundError:
        return _Index()
    except OSError as error:
        raise PciIdsError(str(path), 0, error.strerror or str(error)) from error
    if any(mark in text for mark in _OTHER_BREAKS):
        text = "\n".join(text.splitlines())
    index, suspect = _build_index(text)
    if suspect:
        # Read line by line, which names the wrong line, or finds none.
        _check_lines(path, text)
    return index


def _build_index(text: str) -> tuple[_Index, bool]:
    """Vendors, classes and where each vendor's devices are, and whether any line may be
    malformed or out of place."""
    grammar = _grammar()
    headers = list(grammar.header.finditer(text))
    starts = [h.start() for h in headers] + [len(text)]
    index = _Index(text)
    suspect = False
    for number, header in enumerate(headers):
        span = (header.end(), starts[number + 1])
        if header[1] is not None:
            vendor = int(header[1], 16)
            index.vendors[vendor] = header[3]
            index.spans.setdefault(vendor, []).append(span)
        elif not _read_classes(int(header[2], 16), header[3], text[span[0] : span[1]], index):
            suspect = True
    suspect = suspect or bool(
        grammar.odd_line.search(text)
        or re.search(r"^\t+[0-9a-f]", text[: starts[0]], re.M)
        or grammar.subsystem_first.search(text)
    )
    # Class-shaped lines belong below a class header.
    for line in grammar.class_form.finditer(text):
        owner = bisect.bisect_right(starts, line.start()) - 1
        suspect = suspect or owner < 0 or headers[owner][2] is None
    return index, suspect


def _read_classes(klass: int, name: str, block: str, index: _Index) -> bool:
    """A class's subclasses and programming interfaces into `index`; False on a line that does
    not belong there."""
    grammar = _grammar()
    index.classes[(klass,)] = name
    subclass: int | None = None
    for line in block.split("\n"):
        if not line.strip() or line.startswith("#"):
            continue
        if match := grammar.subclass.fullmatch(line):
            subclass = int(match[1], 16)
            index.classes[(klass, subclass)] = match[2]
        elif subclass is not None and (match := grammar.prog_if.fullmatch(line)):
            index.classes[(klass, subclass, int(match[1], 16))] = match[2]
        else:
            return False
    return True


def _check_lines(path: Path, text: str) -> None:
    """Read every line in order, as a database is read; PciIdsError names the first line that
    does not belong where it is."""
    grammar = _grammar()
    vendor = device = klass = subclass = False
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip() or line.startswith("#"):
            continue
        if grammar.vendor.fullmatch(line):
            vendor, device, klass = True, False, False
        elif grammar.klass.fullmatch(line):
            klass, subclass, vendor = True, False, False
        elif klass and grammar.subclass.fullmatch(line):
            subclass = True
        elif klass and subclass and grammar.prog_if.fullmatch(line):
            pass
        elif vendor and grammar.device.fullmatch(line):
            device = True
        elif not (vendor and device and grammar.subsystem.fullmatch(line)):
            raise PciIdsError(str(path), number, f"unexpected line {line[:60]!r}")
