"""Kernel events about PCI devices, shared by the components that follow the host's devices.

Real sysfs sends no inotify events, so on a node (root `/`) a udev netlink monitor reports binds,
unbinds and hot-plug; callers re-read the named functions and keep a periodic re-scan for
anything missed.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from hostdev.bdf import Bdf, is_bdf

log = logging.getLogger(__name__)
POLL_MS = 250
_PROBES = frozenset({"add", "remove", "bind", "unbind"})


@dataclass(frozen=True, slots=True)
class DevicesChanged:
    """Something about devices changed: the named functions need reading again (none named:
    only which /dev nodes exist), or everything when `rescan`."""

    bdfs: frozenset[Bdf]
    reason: str
    rescan: bool = False
    reprobed: bool = False
    """The named functions were bound, unbound, added or removed: whatever a reading shows, they
    went through their drivers' probe or remove since the last one."""


EmitDevices = Callable[[DevicesChanged], None]


class UdevWatch:
    """Kernel uevents for PCI devices (bind, unbind, add, remove) from netlink, on a real node."""

    def __init__(self, emit: EmitDevices) -> None:
        self._emit = emit
        self._monitor: Any = None
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="udev-watch", daemon=True)

    def start(self) -> bool:
        """False when this process cannot listen to uevents (no netlink in its network
        namespace): inotify and re-scans carry on without it."""
        try:
            import pyudev

            self._monitor = pyudev.Monitor.from_netlink(pyudev.Context(), source="kernel")
            self._monitor.start()
        except (ImportError, OSError, ValueError) as error:
            log.info(
                "udev monitor unavailable error=%r; relying on inotify and re-scans", str(error)
            )
            return False
        self._thread.start()
        return True

    def stop(self) -> None:
        self._stopping.set()
        if self._thread.is_alive():
            self._thread.join()

    def _run(self) -> None:
        while not self._stopping.is_set():
            device = self._monitor.poll(timeout=POLL_MS / 1000)
            if device is None or device.subsystem != "pci" or not is_bdf(device.sys_name):
                continue
            action = device.action or "change"
            self._emit(
                DevicesChanged(
                    frozenset({Bdf.parse(device.sys_name)}),
                    f"{device.sys_name} {action}",
                    reprobed=action in _PROBES,
                )
            )
