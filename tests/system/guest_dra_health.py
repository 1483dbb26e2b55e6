"""How the DRA driver follows a device's health on the real kernel, for guest_dra.py's checks: how
long the kubelet's health stream and the slice's taint take to follow an unbind or a bind, and
which kernel watches the driver's process really holds (its udev netlink socket, its inotify
watches on /dev/vfio).

Latencies are measured from just before the sysfs write to the moment each watcher, already
waiting before the write, sees the new state: the kubelet stand-in wakes its waiters on every
health message, the API server stand-in's store on every write.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from guestkit import CheckFailed

from dra.slices import unhealthy_taint_key
from sim.apiserver import ApiServerStandIn
from sim.dra_kubelet import DRAKubeletStandIn, SeenHealth

HEALTHY = "Healthy"
UNHEALTHY = "Unhealthy"
NETLINK_KOBJECT_UEVENT = 15
KERNEL_UEVENTS = 1
"""The multicast group kernel uevents go to (udevd re-sends them to group 2)."""


@dataclass(frozen=True, slots=True)
class Followed:
    """Seconds from an event to each signal saying the device's new health."""

    stream: float
    """The kubelet's health stream."""
    taint: float
    """The ResourceSlice's `<driver>/unhealthy` taint, gained or lost."""


@dataclass(frozen=True, slots=True)
class HealthWatch:
    """One device as the kubelet and the API server see its health."""

    api: ApiServerStandIn
    kubelet: DRAKubeletStandIn
    driver: str
    node: str
    device: str

    def streamed(self) -> str | None:
        """The kubelet's health for the device ("Healthy", "Unhealthy", "Unknown"), if any."""
        seen = self._seen()
        return None if seen is None else seen.health

    def message(self) -> str:
        seen = self._seen()
        return "" if seen is None else seen.message

    def _seen(self) -> SeenHealth | None:
        for key, seen in self.kubelet.health(self.driver).items():
            if key.endswith(f"/{self.device}"):
                return seen
        return None

    def tainted(self) -> bool | None:
        """Whether its slice entry carries `<driver>/unhealthy`; None while it is unpublished."""
        key = unhealthy_taint_key(self.driver)
        for item in self.api.slices(self.node, self.driver):
            for device in item["spec"].get("devices", []):
                if device["name"] == self.device:
                    return any(t.get("key") == key for t in device.get("taints", []))
        return None

    def settled(self, health: str) -> bool:
        return self.streamed() == health and self.tainted() is (health == UNHEALTHY)

    def follow(self, event: Callable[[], object], health: str, timeout: float) -> Followed:
        """Run `event`, which must turn the device `health`; how long each signal took. The
        device must be settled in the other health before."""
        before = UNHEALTHY if health == HEALTHY else HEALTHY
        if not self.settled(before):
            raise CheckFailed(
                f"{self.device} is not settled {before} before the event: stream"
                f" {self.streamed()}, tainted {self.tainted()}"
            )
        tainted = health == UNHEALTHY

        def stream_seen() -> float | None:
            try:
                self.kubelet.wait_for(lambda: self.streamed() == health, timeout, "stream")
            except TimeoutError:
                return None
            return time.monotonic()

        def taint_seen() -> float | None:
            # The revision read before the slices: a write in between wakes the wait at once.
            deadline = time.monotonic() + timeout
            while True:
                revision = self.api.store.revision
                if self.tainted() is tainted:
                    return time.monotonic()
                if time.monotonic() >= deadline:
                    return None
                self.api.store.wait(revision, deadline, lambda: False)

        with ThreadPoolExecutor(2) as pool:
            stream = pool.submit(stream_seen)
            taint = pool.submit(taint_seen)
            started = time.monotonic()
            event()
            stream_at, taint_at = stream.result(), taint.result()
        missing = [
            what
            for what, at in (("the stream saying it", stream_at), ("the taint", taint_at))
            if at is None
        ]
        if stream_at is None or taint_at is None:
            raise CheckFailed(
                f"{self.device} {health}: no {' nor '.join(missing)} within {timeout:g} s"
                f" (stream {self.streamed()}, tainted {self.tainted()})"
            )
        return Followed(stream_at - started, taint_at - started)


def listens_to_uevents(pid: int) -> bool:
    """Whether the process holds a netlink socket bound to the kernel's uevent group (the udev
    monitor with source "kernel")."""
    inodes = _socket_inodes(pid)
    for line in Path("/proc/net/netlink").read_text().splitlines()[1:]:
        fields = line.split()
        protocol, groups, inode = int(fields[1]), int(fields[3], 16), int(fields[9])
        if protocol == NETLINK_KOBJECT_UEVENT and groups & KERNEL_UEVENTS and inode in inodes:
            return True
    return False


def inotify_watches(pid: int, path: Path) -> bool:
    """Whether one of the process's inotify instances watches `path` (its inode, on its
    file system)."""
    info = path.stat()
    # fdinfo prints the kernel's dev_t (major << 20 | minor), not the one stat gives.
    wanted = ((os.major(info.st_dev) << 20) | os.minor(info.st_dev), info.st_ino)
    return wanted in _inotify_watched(pid)


def _socket_inodes(pid: int) -> set[int]:
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        target = _readlink(fd)
        if target.startswith("socket:["):
            inodes.add(int(target[len("socket:[") : -1]))
    return inodes


def _inotify_watched(pid: int) -> set[tuple[int, int]]:
    """(device, inode) of everything the process's inotify instances watch."""
    watched = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        if _readlink(fd) != "anon_inode:inotify":
            continue
        for line in Path(f"/proc/{pid}/fdinfo/{fd.name}").read_text().splitlines():
            if not line.startswith("inotify "):
                continue
            fields = dict(part.split(":", 1) for part in line.split()[1:] if ":" in part)
            watched.add((int(fields["sdev"], 16), int(fields["ino"], 16)))
    return watched


def _readlink(path: Path) -> str:
    try:
        return str(path.readlink())
    except OSError:
        return ""
