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
READ_SIZE = 4096
"""A sysfs attribute's most (a page): one read, and one more that finds the end."""


@dataclass(frozen=True, slots=True)
class AerCounts:
    """The totals of one function's uncorrectable errors since it was enumerated."""

    fatal: int
    nonfatal: int


def parse_aer_total(text: str, total: str) -> int | None:
    """The `total` line's count; None when the file has none (not a file of this format)."""
    for line in text.splitlines():
        name, _, count = line.rpartition(" ")
        # isdigit alone takes digits int() refuses (superscripts).
        if name == total and count.isascii() and count.isdigit():
            return int(count)
    return None


def read_aer_counts(root: Path, bdf: Bdf) -> AerCounts | None:
    """The function's counters; None when the kernel exposes none for it (no AER capability,
    a kernel without CONFIG_PCIEAER, or the function gone)."""
    device = f"{str(root).rstrip('/')}/sys/bus/pci/devices/{bdf}/"
    try:
        fatal = parse_aer_total(_read_text(device + FATAL_FILE), FATAL_TOTAL)
        nonfatal = parse_aer_total(_read_text(device + NONFATAL_FILE), NONFATAL_TOTAL)
    except (OSError, UnicodeDecodeError):
        return None
    if fatal is None or nonfatal is None:
        return None
    return AerCounts(fatal, nonfatal)


def _read_text(path: str) -> str:
    """The whole file through `os` calls: with `Path.read_text`, which sets up text IO for each
    file, reading 4,096 functions' counters (8,192 files) before the first slices took 4 times
    as long (0.33 s)."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        chunks = []
        while chunk := os.read(fd, READ_SIZE):
            chunks.append(chunk)
    finally:
        os.close(fd)
    return b"".join(chunks).decode()
