"""A PCI function's PCIe Advanced Error Reporting counters, as the kernel (>= 4.19) exposes them
in `/sys/bus/pci/devices/<BDF>/aer_dev_fatal` and `aer_dev_nonfatal` on AER-capable devices.

Each file lists one "<error name> <count>" line per error kind and ends with the total
(`TOTAL_ERR_FATAL <n>`, `TOTAL_ERR_NONFATAL <n>`). The kernel keeps the counts for as long as
the function exists: they start at 0 when it is enumerated and never go down.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from hostdev.bdf import Bdf

FATAL_FILE = "aer_dev_fatal"
NONFATAL_FILE = "aer_dev_nonfatal"
FATAL_TOTAL = "TOTAL_ERR_FATAL"
NONFATAL_TOTAL = "TOTAL_ERR_NONFATAL"
_PAGE = 65536
"""More than a sysfs attribute holds (one page)."""


@dataclass(frozen=True, slots=True)
class AerCounts:
    """The totals of one function's uncorrectable errors since it was enumerated."""

    fatal: int
    nonfatal: int


def parse_aer_total(text: str, total: str) -> int | None:
    """The `total` line's count; None when the file has none (not a file of this format)."""
    # The kernel's line, found at once: the DRA driver reads two files per device, and going
    # through every line of them was a third of reading 4,096 devices' counters.
    start = text.find(total)
    if start < 0:
        return None
    if start == 0 or text[start - 1] == "\n":
        end = text.find("\n", start)
        count = text[start + len(total) + 1 : end if end >= 0 else len(text)]
        if text.startswith(" ", start + len(total)) and count.isascii() and count.isdigit():
            return int(count)
    for line in text.splitlines():
        name, _, count = line.rpartition(" ")
        # isdigit alone takes digits int() refuses (superscripts).
        if name == total and count.isascii() and count.isdigit():
            return int(count)
    return None


def read_aer_counts(root: Path, bdf: Bdf) -> AerCounts | None:
    """The function's counters; None when the kernel exposes none for it (no AER capability,
    a kernel without CONFIG_PCIEAER, or the function gone)."""
    device = f"{root}/sys/bus/pci/devices/{bdf}/"
    try:
        fatal = parse_aer_total(_read_attribute(device + FATAL_FILE), FATAL_TOTAL)
        nonfatal = parse_aer_total(_read_attribute(device + NONFATAL_FILE), NONFATAL_TOTAL)
    except (OSError, UnicodeDecodeError):
        return None
    if fatal is None or nonfatal is None:
        return None
    return AerCounts(fatal, nonfatal)


def _read_attribute(path: str) -> str:
    """A sysfs attribute (at most a page) in one read: the DRA driver reads two per device every
    50 ms, and a path object and a text file for each cost three times as much."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        return os.read(fd, _PAGE).decode()
    finally:
        os.close(fd)
