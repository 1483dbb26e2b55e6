"""What every part of the system test's guest side shares: check bookkeeping and the edu devices.

Imported by guest.py (the checks, in order) and launcher.py (the launcher's side: the hook on a
mixed domain and a nested QEMU started the way libvirt starts it). Runs inside the VM only.
"""

from __future__ import annotations

import contextlib
import os
import socket
import sys
import time
import traceback
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

VENV_BIN = Path(sys.executable).parent
CLI = str(VENV_BIN / "kubevirt-iommufd")
PCI = Path("/sys/bus/pci")
EDU_VENDOR, EDU_DEVICE = "0x1234", "0x11e8"


# --------------------------------------------------------------------------- check bookkeeping


@dataclass
class Check:
    name: str
    ok: bool = False
    seconds: float = 0.0
    detail: str = ""


@dataclass
class Report:
    kernel: str
    qemu: str
    uptime_at_start: float
    loop_ms: float = 0.0
    host_loop_ms: float = 0.0
    devices: list[dict[str, str]] = field(default_factory=list)
    checks: list[Check] = field(default_factory=list)


class CheckFailed(Exception):
    """A check's condition did not hold; the message says what was seen."""


def require(condition: bool, message: str) -> None:
    if not condition:
        raise CheckFailed(message)


class Runner:
    def __init__(self, report: Report) -> None:
        self.report = report

    @contextlib.contextmanager
    def check(self, name: str) -> Iterator[Check]:
        """Time the block; an exception fails the check (and is reported), never the run."""
        check = Check(name)
        say(f"--- {name}")
        started = time.monotonic()
        try:
            yield check
            check.ok = True
        except CheckFailed as error:
            check.detail = f"{error}; {check.detail}" if check.detail else str(error)
        except Exception as error:
            traceback.print_exc()
            check.detail = f"{type(error).__name__}: {error}"
        check.seconds = time.monotonic() - started
        self.report.checks.append(check)
        say(f"{'PASS' if check.ok else 'FAIL'} {name} ({check.seconds:.2f} s) {check.detail}")

    def skip(self, name: str, why: str) -> None:
        self.report.checks.append(Check(name, False, 0.0, f"not run: {why}"))
        say(f"FAIL {name}: not run: {why}")


def cpu_loop_ms() -> float:
    """A fixed bit of pure-Python work (run.py times the same on the host: the TCG slowdown)."""
    started = time.perf_counter()
    sum(i * i for i in range(200_000))
    return (time.perf_counter() - started) * 1000


def say(message: str) -> None:
    print(message, flush=True)


# --------------------------------------------------------------------------- the real host


@dataclass
class Edu:
    bdf: str
    group: str = ""
    cdev: str = ""

    @property
    def sysfs(self) -> Path:
        return PCI / "devices" / self.bdf

    @property
    def cdev_path(self) -> str:
        return f"/dev/vfio/devices/{self.cdev}"

    def driver(self) -> str | None:
        try:
            return (self.sysfs / "driver").readlink().name
        except FileNotFoundError:
            return None

    def read_cdev(self) -> str:
        names = sorted(p.name for p in (self.sysfs / "vfio-dev").glob("vfio*"))
        return names[0] if names else ""


def find_edu() -> list[Edu]:
    found = []
    for device in sorted((PCI / "devices").iterdir()):
        vendor = (device / "vendor").read_text().strip()
        product = (device / "device").read_text().strip()
        if (vendor, product) == (EDU_VENDOR, EDU_DEVICE):
            found.append(Edu(device.name))
    return found


def bind_vfio(edu: Edu) -> None:
    """The recipe's sysfs writes (also what the health-flip cycles use: precise timing)."""
    (edu.sysfs / "driver_override").write_text("vfio-pci")
    if edu.driver() not in (None, "vfio-pci"):
        (edu.sysfs / "driver" / "unbind").write_text(edu.bdf)
    if edu.driver() is None:
        (PCI / "drivers_probe").write_text(edu.bdf)


def unbind(edu: Edu) -> None:
    (edu.sysfs / "driver" / "unbind").write_text(edu.bdf)


def receive_fd(path: str, timeout: float = 10.0) -> int:
    """KubeVirt's launcher side (`ReceiveIOMMUFD`): one fd with a 1-byte payload, then ACK."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
        conn.settimeout(timeout)
        conn.connect(path)
        message, fds, _flags, _address = socket.recv_fds(conn, 1, 1)
        if len(fds) != 1 or len(message) != 1:
            for fd in fds:
                os.close(fd)
            raise CheckFailed(f"expected 1 byte and 1 fd, got {message!r} and {len(fds)} fds")
        conn.sendall(b"\x00")
    return fds[0]
