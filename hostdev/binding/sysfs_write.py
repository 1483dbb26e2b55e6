"""The one place where this project writes to sysfs (and /proc): a seam that tests replace with a
simulator reacting like the kernel."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Protocol


class SysfsWriter(Protocol):
    def write(self, path: Path, text: str) -> None:
        """Write `text` to the attribute at `path`; an OSError is the kernel's refusal."""
        ...


class KernelSysfs:
    """Writes for real. One `write(2)` per attribute: sysfs takes a value in a single write,
    and its errno (EBUSY, ENODEV, ENOTTY, ...) is the kernel's answer."""

    def write(self, path: Path, text: str) -> None:
        fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC)
        try:
            os.write(fd, text.encode())
        finally:
            os.close(fd)
