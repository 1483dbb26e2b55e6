"""The one place where this project writes to sysfs (and /proc): a seam that tests replace with a
simulator reacting like the kernel."""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Protocol

SIGKILL_AFTER_ENV = "KUBEVIRT_IOMMUFD_TEST_SIGKILL_AFTER"
"""Test only (the system test's crash checks, tests/system/guest_dra.py): set to an attribute's
name (`driver_override`, `unbind`, `bind`, `unbindLock`, ...), it makes the process SIGKILL
itself right after its first write to an attribute of that name has taken effect, so a real
kernel is left exactly where a driver killed at that point leaves it. Unset, as everywhere else,
it does nothing."""


class SysfsWriter(Protocol):
    def write(self, path: Path, text: str) -> None:
        """Write `text` to the attribute at `path`; an OSError is the kernel's refusal."""
        ...


class KernelSysfs:
    """Writes for real. One `write(2)` per attribute: sysfs takes a value in a single write,
    and its errno (EBUSY, ENODEV, ENOTTY, ...) is the kernel's answer."""

    def __init__(self) -> None:
        self._die_after = os.environ.get(SIGKILL_AFTER_ENV) or None

    def write(self, path: Path, text: str) -> None:
        fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC)
        try:
            os.write(fd, text.encode())
        finally:
            os.close(fd)
        if path.name == self._die_after:
            os.kill(os.getpid(), signal.SIGKILL)
