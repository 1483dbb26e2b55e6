"""Watches that turn filesystem and kernel events into a few plain events for the manager.

inotify covers the kubelet's directory (its restart deletes every socket and recreates
`kubelet.sock`) beside the device watch's directories (hostdev.device_watch: the device nodes
under /dev and, on simulated trees, the driver links). Real sysfs sends no inotify events, so on
a node (root `/`) a udev netlink monitor reports binds, unbinds and hot-plug; a periodic re-scan
in the manager catches anything both miss.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from deviceplugin.registration import KUBELET_SOCKET
from hostdev.device_events import DevicesChanged
from hostdev.device_watch import DeviceWatch


@dataclass(frozen=True, slots=True)
class KubeletStarted:
    """`kubelet.sock` was (re)created: every plugin socket is gone and must be re-registered."""


@dataclass(frozen=True, slots=True)
class SocketRemoved:
    name: str


WatchEvent = KubeletStarted | SocketRemoved | DevicesChanged
Emit = Callable[[WatchEvent], None]


class FilesystemWatch(DeviceWatch[KubeletStarted | SocketRemoved]):
    """The device watch (hostdev.device_watch), with the kubelet's directory on its thread."""

    def __init__(self, root: Path, kubelet_dir: Path, emit: Emit) -> None:
        super().__init__(root, emit, {kubelet_dir: _kubelet_event}, name="fs-watch")


def _kubelet_event(name: str, appeared: bool) -> KubeletStarted | SocketRemoved | None:
    if name == KUBELET_SOCKET and appeared:
        return KubeletStarted()
    if name.startswith("kubevirt-iommufd-") and not appeared:
        return SocketRemoved(name)
    return None
