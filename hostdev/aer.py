"""A PCI function's PCIe Advanced Error Reporting counters, as the kernel (>= 4.19) exposes them
in `/sys/bus/pci/devices/<BDF>/aer_dev_fatal` and `aer_dev_nonfatal` on AER-capable devices.

Each file lists one "<error name> <count>" line per error kind and ends with the total
(`TOTAL_ERR_FATAL <n>`, `TOTAL_ERR_NONFATAL <n>`). The kernel keeps the counts for as long as
the function exists: they start at 0 when it is enumerated and never go down.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from hostdev.bdf import Bdf

FATAL_FILE = "aer_dev_fatal"
NONFATAL_FILE = "aer_dev_nonfatal"
FATAL_TOTAL = "TOTAL_ERR_FATAL"
NONFATAL_TOTAL = "TOTAL_ERR_NONFATAL"


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
    device = root / "sys/bus/pci/devices" / str(bdf)
    try:
        fatal = parse_aer_total((device / FATAL_FILE).read_text(), FATAL_TOTAL)
        nonfatal = parse_aer_total((device / NONFATAL_FILE).read_text(), NONFATAL_TOTAL)
    except (OSError, UnicodeDecodeError):
        return None
    if fatal is None or nonfatal is None:
        return None
    return AerCounts(fatal, nonfatal)
