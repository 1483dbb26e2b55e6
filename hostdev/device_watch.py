"""inotify over the places a PCI function's state shows, for the components that follow the host's
devices: the device nodes under /dev (group nodes, cdevs, /dev/iommu) and, on simulated trees,
the functions and driver links in sysfs. Real sysfs sends no inotify events: on a node the udev
watch (hostdev.device_events) reports binds, unbinds and hot-plug instead.

A caller may watch more directories on the same inotify instance and thread, each with its own
translation of a name appearing or disappearing into an event of its own.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Generic, TypeVar

from hostdev.bdf import Bdf, is_bdf
from hostdev.device_events import POLL_MS, DevicesChanged

if TYPE_CHECKING:
    from inotify_simple import INotify

log = logging.getLogger(__name__)

T = TypeVar("T")
Translate = Callable[[str, bool], T | None]
"""A name in a directory appeared (True) or disappeared (False): the event it means, if any."""


class DeviceWatch(Generic[T]):
    """One thread reading one inotify instance over the device directories and the `extra` ones."""

    def __init__(
        self,
        root: Path,
        emit: Callable[[DevicesChanged | T], None],
        extra: Mapping[Path, Translate[T]] | None = None,
        name: str = "device-watch",
    ) -> None:
        self._emit = emit
        self._extra = dict(extra or {})
        self._dev = root / "dev"
        self._dev_vfio = root / "dev/vfio"
        self._dev_cdevs = root / "dev/vfio/devices"
        self._pci_devices = root / "sys/bus/pci/devices"
        self._drivers = root / "sys/bus/pci/drivers"
        self._inotify: INotify | None = None
        self._paths: dict[int, Path] = {}
        self._stopping = threading.Event()
        self._name = name
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        # Loaded here, with ctypes: 4 ms that a daemon's start spends only once it serves.
        from inotify_simple import INotify

        inotify = self._inotify = INotify()
        self._sync_watches(inotify, initial=True)
        self._thread = threading.Thread(
            target=self._run, args=(inotify,), name=self._name, daemon=True
        )
        self._thread.start()

    def stop(self) -> None:
        self._stopping.set()
        if self._thread is not None and self._thread.is_alive():
            self._thread.join()
        if self._inotify is not None:
            self._inotify.close()

    def _wanted(self) -> list[Path]:
        fixed = [
            *self._extra,
            self._dev,
            self._dev_vfio,
            self._dev_cdevs,
            self._pci_devices,
            self._drivers,
        ]
        try:
            drivers = sorted(p for p in self._drivers.iterdir() if p.is_dir())
        except FileNotFoundError:
            drivers = []
        return [p for p in fixed + drivers if p.is_dir()]

    def _sync_watches(self, inotify: INotify, *, initial: bool = False) -> None:
        from inotify_simple import flags

        changes = flags.CREATE | flags.DELETE | flags.MOVED_TO | flags.MOVED_FROM | flags.ONLYDIR
        watched = set(self._paths.values())
        for path in self._wanted():
            if path in watched:
                continue
            try:
                wd = inotify.add_watch(path, changes)
            except OSError as error:
                log.warning("cannot watch path=%s error=%r", path, error.strerror or str(error))
                continue
            self._paths[wd] = path
            if not initial and path.parent == self._drivers:
                self._bound_before_watched(path)

    def _bound_before_watched(self, driver: Path) -> None:
        """A driver directory that appeared after the start: the functions bound to it before
        its watch was added sent their events to no one."""
        try:
            bound = frozenset(Bdf.parse(p.name) for p in driver.iterdir() if is_bdf(p.name))
        except OSError:
            return
        if bound:
            self._emit(DevicesChanged(bound, f"bound to {driver.name}", reprobed=True))

    def _run(self, inotify: INotify) -> None:
        from inotify_simple import flags

        appears = flags.CREATE | flags.MOVED_TO
        while not self._stopping.is_set():
            try:
                events = inotify.read(timeout=POLL_MS)
            except OSError as error:
                log.error("inotify read failed error=%r; relying on periodic re-scans", str(error))
                return
            resync = False
            for event in events:
                if event.mask & flags.Q_OVERFLOW:
                    self._emit(DevicesChanged(frozenset(), "inotify queue overflowed", rescan=True))
                    continue
                if event.mask & flags.IGNORED:
                    self._paths.pop(event.wd, None)
                    resync = True
                    continue
                directory = self._paths.get(event.wd)
                if directory is None:
                    continue
                appeared = bool(event.mask & appears)
                resync |= appeared and bool(event.mask & flags.ISDIR)
                translate = self._extra.get(directory)
                translated = (
                    translate(event.name, appeared)
                    if translate is not None
                    else self._device_event(directory, event.name, appeared)
                )
                if translated is not None:
                    self._emit(translated)
            if resync:
                self._sync_watches(inotify)

    def _device_event(self, directory: Path, name: str, appeared: bool) -> DevicesChanged | None:
        verb = "appeared" if appeared else "disappeared"
        if directory == self._dev:
            if name in ("iommu", "vfio"):
                return DevicesChanged(frozenset(), f"{directory / name} {verb}")
            return None
        if directory in (self._dev_vfio, self._dev_cdevs):
            return DevicesChanged(frozenset(), f"{directory / name} {verb}")
        if directory == self._pci_devices and is_bdf(name):
            return DevicesChanged(frozenset({Bdf.parse(name)}), f"{name} {verb}", reprobed=True)
        if directory.parent == self._drivers and is_bdf(name):
            action = "bound to" if appeared else "unbound from"
            return DevicesChanged(
                frozenset({Bdf.parse(name)}), f"{name} {action} {directory.name}", reprobed=True
            )
        return None
