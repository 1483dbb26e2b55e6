"""Watches that turn filesystem and kernel events into a few plain events for the manager.

inotify covers the kubelet's directory (its restart deletes every socket and recreates
`kubelet.sock`), the device nodes under /dev (group nodes, cdevs, /dev/iommu) and, on simulated
trees, the driver links. Real sysfs sends no inotify events, so on a node (root `/`) a udev
netlink monitor reports binds, unbinds and hot-plug; a periodic re-scan in the manager catches
anything both miss.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from inotify_simple import INotify, flags

from deviceplugin.registration import KUBELET_SOCKET
from hostdev.bdf import Bdf, is_bdf
from hostdev.device_events import POLL_MS, DevicesChanged

log = logging.getLogger(__name__)

_CHANGES = flags.CREATE | flags.DELETE | flags.MOVED_TO | flags.MOVED_FROM
_APPEARS = flags.CREATE | flags.MOVED_TO


@dataclass(frozen=True, slots=True)
class KubeletStarted:
    """`kubelet.sock` was (re)created: every plugin socket is gone and must be re-registered."""


@dataclass(frozen=True, slots=True)
class SocketRemoved:
    name: str


WatchEvent = KubeletStarted | SocketRemoved | DevicesChanged
Emit = Callable[[WatchEvent], None]


class FilesystemWatch:
    """One thread reading one inotify instance over every directory of interest."""

    def __init__(self, root: Path, kubelet_dir: Path, emit: Emit) -> None:
        self._emit = emit
        self._kubelet_dir = kubelet_dir
        self._dev = root / "dev"
        self._dev_vfio = root / "dev/vfio"
        self._dev_cdevs = root / "dev/vfio/devices"
        self._pci_devices = root / "sys/bus/pci/devices"
        self._drivers = root / "sys/bus/pci/drivers"
        self._inotify = INotify()
        self._paths: dict[int, Path] = {}
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="fs-watch", daemon=True)

    def start(self) -> None:
        self._sync_watches()
        self._thread.start()

    def stop(self) -> None:
        self._stopping.set()
        self._thread.join()
        self._inotify.close()

    def _wanted(self) -> list[Path]:
        fixed = [
            self._kubelet_dir,
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

    def _sync_watches(self) -> None:
        watched = set(self._paths.values())
        for path in self._wanted():
            if path in watched:
                continue
            try:
                wd = self._inotify.add_watch(path, _CHANGES | flags.ONLYDIR)
            except OSError as error:
                log.warning("cannot watch path=%s error=%r", path, error.strerror or str(error))
                continue
            self._paths[wd] = path

    def _run(self) -> None:
        while not self._stopping.is_set():
            try:
                events = self._inotify.read(timeout=POLL_MS)
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
                appeared = bool(event.mask & _APPEARS)
                resync |= appeared and bool(event.mask & flags.ISDIR)
                translated = self._translate(directory, event.name, appeared)
                if translated is not None:
                    self._emit(translated)
            if resync:
                self._sync_watches()

    def _translate(self, directory: Path, name: str, appeared: bool) -> WatchEvent | None:
        if directory != self._kubelet_dir:
            return self._device_event(directory, name, appeared)
        if name == KUBELET_SOCKET and appeared:
            return KubeletStarted()
        if name.startswith("kubevirt-iommufd-") and not appeared:
            return SocketRemoved(name)
        return None

    def _device_event(self, directory: Path, name: str, appeared: bool) -> DevicesChanged | None:
        verb = "appeared" if appeared else "disappeared"
        if directory == self._dev:
            if name in ("iommu", "vfio"):
                return DevicesChanged(frozenset(), f"{directory / name} {verb}")
            return None
        if directory in (self._dev_vfio, self._dev_cdevs):
            return DevicesChanged(frozenset(), f"{directory / name} {verb}")
        if directory == self._pci_devices and is_bdf(name):
            return DevicesChanged(frozenset({Bdf.parse(name)}), f"{name} {verb}")
        if directory.parent == self._drivers and is_bdf(name):
            action = "bound to" if appeared else "unbound from"
            return DevicesChanged(frozenset({Bdf.parse(name)}), f"{name} {action} {directory.name}")
        return None
