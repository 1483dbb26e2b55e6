"""A fixture tree that behaves like the kernel when written: a `SysfsWriter` (and a modprobe
runner) reacting to `driver_override`, `unbind`, `bind`, `drivers_probe`, `reset` and the NVIDIA
`unbindLock` by moving the tree's symlinks as Linux would (sim.host.bind_driver /
unbind_driver), with the kernel's errnos for what it would refuse, and faults to inject: a write
that fails, or the writing process dying (SIGKILL) at a given write."""

from __future__ import annotations

import errno
import os
import subprocess
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from hostdev.model import is_vfio_driver
from sim.host import bind_driver, unbind_driver

Condition = Callable[[str, str], bool]
"""(path relative to the root, text) -> whether this write fails."""


class ProcessKilled(BaseException):
    """The writing process died (SIGKILL) at a sysfs write. A BaseException, so no `except
    Exception` of the code under test catches it, as nothing in a process catches SIGKILL."""


def die_by_exception() -> None:
    raise ProcessKilled("killed (simulated SIGKILL) at a sysfs write")


def oserror(code: int) -> OSError:
    return OSError(code, os.strerror(code))


@dataclass
class KernelSimulator:
    root: Path
    native: dict[str, str] = field(default_factory=dict)
    """BDF -> the driver the kernel's own matching picks on `drivers_probe` (no override)."""
    writes: list[tuple[str, str]] = field(default_factory=list)
    resets: list[str] = field(default_factory=list)
    busy_locks: set[str] = field(default_factory=set)
    """GPUs whose NVIDIA unbindLock cannot be taken (in use)."""
    rejects: dict[str, set[str]] = field(default_factory=dict)
    """driver -> BDFs its probe refuses (ENODEV)."""
    missing_modules: set[str] = field(default_factory=set)
    legacy_container: bool = True
    """Loading a VFIO driver brings up the legacy container `/dev/vfio/vfio`
    (CONFIG_VFIO_CONTAINER), as the vfio module does."""
    commands: list[list[str]] = field(default_factory=list)
    die: Callable[[], None] = die_by_exception
    """How the writing process dies at a `kill_after` point: raising ProcessKilled, or (in a
    child process) a real SIGKILL."""
    _failures: list[tuple[Condition, int]] = field(default_factory=list)
    _taken: int = 0
    """Writes that took effect."""
    _die_when_taken: int | None = None

    def fail(self, when: Condition, code: int = errno.EIO) -> None:
        """Every later write for which `when` holds fails with `code`."""
        self._failures.append((when, code))

    def fail_at(self, number: int, code: int = errno.EIO, *, and_after: bool = False) -> None:
        """The `number`-th write from now (1 is the next) fails with `code`; with `and_after`,
        so does every write after it."""
        first = len(self.writes) + number

        def failing(_path: str, _text: str) -> bool:
            count = len(self.writes)  # with the write being judged
            return count == first or (and_after and count > first)

        self.fail(failing, code)

    def clear_failures(self) -> None:
        self._failures.clear()

    def kill_after(self, count: int) -> None:
        """The writing process dies (`die`) right after `count` more writes have taken effect;
        with 0, at the next write, before it does."""
        self._die_when_taken = self._taken + count

    # SysfsWriter ----------------------------------------------------------------------------
    def write(self, path: Path, text: str) -> None:
        self._maybe_die()
        rel = str(path.relative_to(self.root))
        self.writes.append((rel, text))
        for when, code in self._failures:
            if when(rel, text):
                raise oserror(code)
        self._apply(rel, text)
        self._taken += 1
        self._maybe_die()

    def _maybe_die(self) -> None:
        if self._die_when_taken == self._taken:
            self._die_when_taken = None
            self.die()

    def _apply(self, rel: str, text: str) -> None:
        parts = rel.split("/")
        value = text.strip()
        if rel == "sys/bus/pci/drivers_probe":
            self._probe(value)
        elif parts[:4] == ["sys", "bus", "pci", "devices"] and len(parts) >= 6:
            self._device_write(parts[4], "/".join(parts[5:]), text)
        elif parts[:4] == ["sys", "bus", "pci", "drivers"] and len(parts) == 6:
            self._driver_write(parts[4], parts[5], value)
        elif parts[:4] == ["proc", "driver", "nvidia", "gpus"] and parts[5:] == ["unbindLock"]:
            self._unbind_lock(parts[4], value)
        else:
            raise oserror(errno.EACCES)

    def _device_write(self, bdf: str, attribute: str, text: str) -> None:
        device = self.root / "sys/bus/pci/devices" / bdf
        if attribute == "driver_override":
            (device / "driver_override").write_text((text.strip() or "(null)") + "\n")
        elif attribute == "driver/unbind":
            driver = self.driver(bdf)
            if driver is None:
                raise oserror(errno.ENOENT)  # no driver link, so no driver/unbind
            if text.strip() != bdf:
                raise oserror(errno.ENODEV)
            self._unbind(bdf, driver)
        elif attribute == "reset":
            if not (device / "reset").exists():
                raise oserror(errno.ENOENT)
            self.resets.append(bdf)
        else:
            raise oserror(errno.EACCES)

    def _driver_write(self, driver: str, attribute: str, bdf: str) -> None:
        if not (self.root / "sys/bus/pci/drivers" / driver).is_dir():
            raise oserror(errno.ENOENT)
        if attribute == "unbind":
            if self.driver(bdf) != driver:
                raise oserror(errno.ENODEV)
            self._unbind(bdf, driver)
        elif attribute == "bind":
            if self.driver(bdf) is not None:
                raise oserror(errno.EBUSY)
            override = self.override(bdf)
            if (override is not None and override != driver) or bdf in self.rejects.get(
                driver, set()
            ):
                raise oserror(errno.ENODEV)
            self._bind(bdf, driver)
        else:
            raise oserror(errno.EACCES)

    def _probe(self, bdf: str) -> None:
        if self.driver(bdf) is not None:
            return
        driver = self.override(bdf) or self.native.get(bdf)
        if driver is None or not (self.root / "sys/bus/pci/drivers" / driver).is_dir():
            return  # nothing claims it: probe succeeds, the device stays driverless
        if bdf not in self.rejects.get(driver, set()):
            self._bind(bdf, driver)

    def _unbind_lock(self, bdf: str, value: str) -> None:
        lock = self.root / "proc/driver/nvidia/gpus" / bdf / "unbindLock"
        if not lock.exists():
            raise oserror(errno.ENOENT)
        taken = value == "1" and bdf not in self.busy_locks
        lock.write_text("1\n" if taken else "0\n")

    def _bind(self, bdf: str, driver: str) -> None:
        bind_driver(self.root, bdf, driver)
        if driver == "nvidia":
            gpu = self.root / "proc/driver/nvidia/gpus" / bdf
            gpu.mkdir(parents=True, exist_ok=True)
            (gpu / "information").write_text("Device Minor:\t 0\n")
            (gpu / "unbindLock").write_text("0\n")

    def _unbind(self, bdf: str, driver: str) -> None:
        unbind_driver(self.root, bdf)
        if driver == "nvidia":
            # The NVIDIA driver's per-GPU /proc entries go with the GPU.
            gpu = self.root / "proc/driver/nvidia/gpus" / bdf
            for entry in gpu.iterdir():
                entry.unlink()
            gpu.rmdir()

    # Runner (modprobe) --------------------------------------------------------------------
    def run(self, argv: Sequence[str]) -> subprocess.CompletedProcess[str]:
        self.commands.append(list(argv))
        module = argv[-1]
        if module in self.missing_modules:
            return subprocess.CompletedProcess(
                list(argv), 1, "", f"modprobe: FATAL: Module {module} not found in directory\n"
            )
        # vfio_pci registers its driver as vfio-pci; variant drivers use the module name.
        name = "vfio-pci" if module == "vfio_pci" else module
        (self.root / "sys/bus/pci/drivers" / name).mkdir(parents=True, exist_ok=True)
        if is_vfio_driver(name) and self.legacy_container:
            (self.root / "dev/vfio").mkdir(parents=True, exist_ok=True)
            (self.root / "dev/vfio/vfio").touch()
        return subprocess.CompletedProcess(list(argv), 0, "", "")

    # Reading the tree back ------------------------------------------------------------------
    def driver(self, bdf: str) -> str | None:
        link = self.root / "sys/bus/pci/devices" / bdf / "driver"
        return link.readlink().name if link.is_symlink() else None

    def override(self, bdf: str) -> str | None:
        path = self.root / "sys/bus/pci/devices" / bdf / "driver_override"
        text = path.read_text().strip() if path.exists() else "(null)"
        return None if text == "(null)" else text


def hold(root: Path, pid: int, command: str, *paths: str) -> None:
    """A process `pid` named `command` holding `paths` open, as /proc shows it."""
    proc = root / "proc" / str(pid)
    (proc / "fd").mkdir(parents=True, exist_ok=True)
    (proc / "comm").write_text(command + "\n")
    for number, path in enumerate(paths, start=3):
        (proc / "fd" / str(number)).symlink_to(path)
    # Every process also holds ordinary files, which must not count.
    if not (proc / "fd/0").is_symlink():
        (proc / "fd/0").symlink_to("/dev/null")


def release(root: Path, pid: int) -> None:
    proc = root / "proc" / str(pid)
    for entry in (proc / "fd").iterdir():
        entry.unlink()
    (proc / "fd").rmdir()
    (proc / "comm").unlink()
    proc.rmdir()


def on_vfio(simulator: KernelSimulator, bdf: str) -> bool:
    return is_vfio_driver(simulator.driver(bdf))
