"""Resetting a PCI function between users through sysfs: `echo 1 > <dev>/reset`.

The kernel tries the methods listed in `<dev>/reset_method` in order (the operator may have
narrowed that list, e.g. to `bus`); writing `reset` rather than choosing a method here honours
that choice. A device with no method cannot be reset by the kernel at all.
"""

from __future__ import annotations

import errno
from dataclasses import dataclass
from enum import Enum
from pathlib import Path

from hostdev.bdf import Bdf
from hostdev.binding.holders import find_holders, read_device_nodes
from hostdev.binding.sysfs_write import SysfsWriter
from hostdev.model import IommuGroup, PciFunction
from hostdev.scan import read_reset_methods


class ResetStatus(Enum):
    RESET = "reset"
    NO_METHOD = "no-method"
    """The kernel has no way to reset it; usable, but the next user may see the last one's state."""
    BUSY = "busy"
    """A process still holds it (a VM shutting down): try again later."""
    FAILED = "failed"


@dataclass(frozen=True, slots=True)
class ResetOutcome:
    bdf: Bdf
    status: ResetStatus
    methods: tuple[str, ...]
    message: str


def reset_function(
    root: Path, function: PciFunction, group: IommuGroup | None, writer: SysfsWriter
) -> ResetOutcome:
    """Reset one function, unless nothing can reset it or a process still holds it."""
    bdf = function.bdf
    methods = read_reset_methods(root, bdf)
    if not methods:
        return ResetOutcome(
            bdf,
            ResetStatus.NO_METHOD,
            methods,
            f"{bdf} has no reset method (no {root / 'sys/bus/pci/devices' / str(bdf)}/reset):"
            " the next user may see the previous user's device state",
        )
    scan = find_holders(root, read_device_nodes(root, function, group))
    if scan.holders:
        named = "; ".join(str(h) for h in scan.holders)
        return ResetOutcome(bdf, ResetStatus.BUSY, methods, f"{bdf} is still open: {named}")
    if scan.unreadable:
        return ResetOutcome(
            bdf,
            ResetStatus.BUSY,
            methods,
            f"cannot tell whether {bdf} is still open: the open files of"
            f" {len(scan.unreadable)} processes are unreadable (run as root)",
        )
    try:
        writer.write(root / "sys/bus/pci/devices" / str(bdf) / "reset", "1")
    except OSError as error:
        problem = error.strerror or str(error)
        hint = ""
        if error.errno == errno.ENOTTY:
            hint = "; none of its reset methods worked"
        elif error.errno == errno.EAGAIN:
            hint = "; it was busy, trying again later"
        return ResetOutcome(
            bdf,
            ResetStatus.BUSY if error.errno == errno.EAGAIN else ResetStatus.FAILED,
            methods,
            f"resetting {bdf} ({' '.join(methods)}) failed: {problem}{hint}",
        )
    return ResetOutcome(bdf, ResetStatus.RESET, methods, f"{bdf} reset ({' '.join(methods)})")
