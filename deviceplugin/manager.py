"""The plugin's life: keep the inventory current, one server per resource, registered with
whichever kubelet is running.

One thread owns all state and handles events in batches from a queue: watch events (device
changes, a restarted kubelet, a removed socket), the periodic re-scan and registration retries,
and for resources that reset devices after use: pod resources Lists, Allocates and finished
resets. gRPC threads only read what the servicers hold.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from deviceplugin.identities import read_identities
from deviceplugin.inventory import (
    DeviceTree,
    VfioResource,
    build_device_tree,
    plan_resources,
)
from deviceplugin.metrics import PluginMetrics
from deviceplugin.registration import (
    KUBELET_SOCKET,
    PluginServer,
    RegistrationError,
    register_with_kubelet,
    remove_stale_sockets,
    socket_name,
)
from deviceplugin.servicer import Handoff, IommufdServicer, VfioServicer
from deviceplugin.watch import (
    FilesystemWatch,
    KubeletStarted,
    SocketRemoved,
    WatchEvent,
)
from hostdev.bdf import Bdf
from hostdev.config import PluginConfig
from hostdev.device_events import DevicesChanged, UdevWatch
from hostdev.device_nodes import IOMMU_NODE
from hostdev.directories import make_directories
from hostdev.grpc_socket import SOCKET_DIRECTORY_MODE
from hostdev.labels.publisher import LabelPublisher
from hostdev.model import HostInventory
from hostdev.pciids import PciIds
from hostdev.scan import refresh_host, scan_host

if TYPE_CHECKING:
    from deviceplugin.podresources_client import AssignmentPoller
    from deviceplugin.resetter import ResetCoordinator, UseEvent
    from hostdev.binding.sysfs_write import SysfsWriter

log = logging.getLogger(__name__)
_SIGNAL_SLICE = 0.5
_RETRY_FIRST = 0.5
_RETRY_MAX = 30.0
_SETTLE = 0.5


@dataclass
class _Batch:
    bdfs: set[Bdf] = field(default_factory=set)
    reasons: list[str] = field(default_factory=list)
    refresh: bool = False
    rescan: bool = False
    kubelet_started: bool = False
    removed_sockets: set[str] = field(default_factory=set)
    stop: bool = False
    use: list[UseEvent] = field(default_factory=list)
    """Reset after use: for the resetter to fold in."""


class _Stop:
    """Queued by `stop()` to end `run()`."""


if TYPE_CHECKING:
    _Event = WatchEvent | _Stop | UseEvent


class PluginManager:
    def __init__(
        self,
        config: PluginConfig,
        root: Path,
        kubelet_dir: Path,
        names: PciIds,
        metrics: PluginMetrics,
        handoff: Handoff | None = None,
        *,
        watch_udev: bool = False,
        sysfs_writer: SysfsWriter | None = None,
        labels: LabelPublisher | None = None,
    ) -> None:
        self._config = config
        self._labels = labels
        self._root = root
        self._kubelet_dir = kubelet_dir
        self._names = names
        self._metrics = metrics
        self._handoff = handoff
        self._events: queue.Queue[_Event] = queue.Queue()
        self._watches: list[FilesystemWatch | UdevWatch] = [
            FilesystemWatch(root, kubelet_dir, self._events.put)
        ]
        if watch_udev:
            self._watches.append(UdevWatch(self._events.put))
        self._inventory: HostInventory | None = None
        self._tree = DeviceTree()
        """What the kubelet is told: the scanned tree with devices awaiting a reset Unhealthy."""
        self._scanned = DeviceTree()
        """The tree as discovery alone makes it."""
        self._resets: ResetCoordinator | None = None
        self._poller: AssignmentPoller | None = None
        if config.resets_after_use:
            # Loaded here: a plugin whose resources never reset registers without them.
            from deviceplugin.podresources_client import AssignmentPoller
            from deviceplugin.resetter import ResetCoordinator
            from hostdev.binding.sysfs_write import KernelSysfs

            self._resets = ResetCoordinator(
                root, sysfs_writer or KernelSysfs(), self._events.put, time.monotonic
            )
            pod_resources = config.pod_resources
            self._poller = AssignmentPoller(
                pod_resources.socket, pod_resources.poll_interval_seconds, self._events.put
            )
        self._vfio: dict[str, VfioServicer] = {}
        self._iommufd: IommufdServicer | None = None
        self._servers: dict[str, PluginServer] = {}
        self._registrar = ThreadPoolExecutor(max_workers=4, thread_name_prefix="register")
        self._unregistered: set[str] = set()
        self._retry_delay = _RETRY_FIRST
        self._retry_at: float | None = None
        self._lost: set[str] = set()
        self._lost_check_at: float | None = None
        self._running = threading.Event()
        self._finished = threading.Event()
        self.ready = threading.Event()
        """Set once every server is up and the first registration attempt is over."""

    @property
    def tree(self) -> DeviceTree:
        return self._tree

    def start(self) -> None:
        """Serve every resource and register it, watch, then label the node and poll.

        The iommufd slots need no scan: they are served first. The VFIO resources follow from a
        first look at each function's ids and driver (`read_identities`, two reads a function);
        each is registered at once, and the kubelet's round trips (it dials back at once) overlap
        the full scan and the judging of the devices' health. A resource's first ListAndWatch
        answer waits for those, so it tells the devices as the scan found them (8 GPUs and 200
        other functions: the scan took 13-25 ms before Register; 4,096 functions: the scan
        190-250 ms, judging 80 ms and building the list 25 ms)."""
        make_directories(self._kubelet_dir, SOCKET_DIRECTORY_MODE)
        remove_stale_sockets(self._kubelet_dir)
        under_way: dict[str, Future[None]] = {}
        if self._config.iommufd.enabled and self._handoff is not None:
            iommufd = self._config.iommufd
            self._iommufd = IommufdServicer(
                iommufd.resource_name,
                iommufd.slots,
                (self._root / IOMMU_NODE.lstrip("/")).exists(),
                self._handoff,
                self._metrics.allocation,
                legacy_without_iommu=iommufd.without_iommu_legacy,
            )
            self._serve(iommufd.resource_name, self._iommufd)
            self._count_iommufd()
            if (self._kubelet_dir / KUBELET_SOCKET).exists():
                under_way[iommufd.resource_name] = self._register_async(iommufd.resource_name)
        first_look = plan_resources(read_identities(self._root), self._config, self._names)
        for name, reset_after_use in first_look.items():
            servicer = VfioServicer.awaiting(
                name,
                self._metrics.allocation,
                reset_after_use=reset_after_use,
                allocated=self._on_allocated if reset_after_use else None,
            )
            self._vfio[name] = servicer
            self._serve(name, servicer)
            if (self._kubelet_dir / KUBELET_SOCKET).exists():
                under_way[name] = self._register_async(name)
        self._start_watches()
        self._inventory = scan_host(self._root)
        self._scanned = build_device_tree(self._inventory, self._config, self._names)
        self._apply(self._published(), "start")
        for name in sorted(self._vfio.keys() - self._tree.resources.keys()):
            # Seen by the first look only: the device went, or was read mid-change.
            under_way.pop(name, None)
            self._remove_resource(name, "not found by the scan")
        self._register_pending(under_way)
        self._publish_labels()
        if self._poller is not None:
            self._poller.start()
        self.ready.set()

    def _start_watches(self) -> None:
        """Watch once every resource is served and its registration under way (inotify and
        ctypes load on the start: 4-9 ms), before the scan: a device that changes after the scan
        read it is an event. A socket removed before the watch began is told as the watch would
        have told it; a kubelet that started meanwhile is met by `_register_pending`."""
        for watch in self._watches:
            watch.start()
        for server in self._servers.values():
            if not server.present:
                self._events.put(SocketRemoved(server.path.name))

    def run(self) -> None:
        """Handle events until `stop()`, then tear down."""
        self._running.set()
        try:
            self._loop()
        finally:
            self._teardown()
            self._finished.set()

    def request_stop(self) -> None:
        """Ask `run()` to end; returns at once (for signal handlers)."""
        self._events.put(_Stop())

    def stop(self, timeout: float = 10.0) -> None:
        """Stop serving and watching and remove our sockets (SIGTERM); safe from any thread."""
        if self._running.is_set():
            self._events.put(_Stop())
            self._finished.wait(timeout)
        else:
            self._teardown()

    def _teardown(self) -> None:
        if self._poller is not None:
            self._poller.stop()
        if self._resets is not None:
            self._resets.close()
        for watch in self._watches:
            watch.stop()
        for resource, server in list(self._servers.items()):
            server.stop(grace=0.1)
            self._close_servicer(resource)
        self._servers.clear()
        self._registrar.shutdown(wait=False, cancel_futures=True)
        if self._labels is not None:
            self._labels.close()

    def _loop(self) -> None:
        next_rescan = time.monotonic() + self._config.rescan_interval_seconds
        while True:
            now = time.monotonic()
            deadlines = (next_rescan, self._retry_at, self._lost_check_at)
            deadline = min(t for t in deadlines if t is not None)
            batch = self._collect(max(0.0, deadline - now))
            if batch.stop:
                return
            if time.monotonic() >= next_rescan:
                batch.rescan = True
                batch.reasons.append("periodic re-scan")
                next_rescan = time.monotonic() + self._config.rescan_interval_seconds
            try:
                self._handle(batch)
            except Exception:
                # A bug or a host in a state we did not foresee must not take the node's
                # devices away: log it, re-scan soon (not at once: the cause may persist) and
                # re-register.
                log.exception("handling events failed; re-scanning and re-registering")
                self._inventory = None
                self._unregistered |= set(self._servers)
                self._retry_at = time.monotonic() + _RETRY_FIRST
                next_rescan = time.monotonic() + _RETRY_FIRST

    def _handle(self, batch: _Batch) -> None:
        if batch.refresh or batch.rescan:
            self._refresh(batch)
        self._track_use(batch)
        if batch.kubelet_started:
            log.info("kubelet restarted; serving anew and re-registering")
            self._lost.clear()
            self._lost_check_at = None
            self._restart_servers(set(self._servers))
            return
        removed = {r for r, s in self._servers.items() if s.path.name in batch.removed_sockets}
        if removed:
            # A starting kubelet deletes every socket before it recreates its own: wait for that
            # rather than serve anew into the middle of its clean-up.
            self._lost |= removed
            self._lost_check_at = time.monotonic() + _SETTLE
        if self._lost_check_at is not None and time.monotonic() >= self._lost_check_at:
            # A resource may have gone from the node since its socket did.
            lost, self._lost = self._lost & self._servers.keys(), set()
            self._lost_check_at = None
            if (self._kubelet_dir / KUBELET_SOCKET).exists():
                log.info("sockets removed resources=%s; serving anew", ",".join(sorted(lost)))
                self._restart_servers(lost)
        if self._unregistered and self._retry_at is not None and time.monotonic() >= self._retry_at:
            self._register_pending()

    def _first_event(self, timeout: float) -> _Event | None:
        """The next event, or None after `timeout`. Waited for in slices: a SIGTERM the kernel
        delivers to one of gRPC's threads only marks the handler as due, and the main thread runs
        it when it next runs Python code; one wait of up to a re-scan interval could outlast the
        pod's grace period."""
        end = time.monotonic() + timeout
        while True:
            try:
                return self._events.get(
                    timeout=min(_SIGNAL_SLICE, max(0.0, end - time.monotonic()))
                )
            except queue.Empty:
                if time.monotonic() >= end:
                    return None

    def _collect(self, timeout: float) -> _Batch:
        batch = _Batch()
        first = self._first_event(timeout)
        if first is None:
            return batch
        pending: list[_Event] = [first]
        while True:
            try:
                pending.append(self._events.get_nowait())
            except queue.Empty:
                break
        for event in pending:
            if isinstance(event, _Stop):
                batch.stop = True
            elif isinstance(event, KubeletStarted):
                batch.kubelet_started = True
            elif isinstance(event, SocketRemoved):
                batch.removed_sockets.add(event.name)
            elif isinstance(event, DevicesChanged):
                batch.refresh = True
                batch.rescan |= event.rescan
                batch.bdfs |= event.bdfs
                batch.reasons.append(event.reason)
            else:
                batch.use.append(event)
        return batch

    def _refresh(self, batch: _Batch) -> None:
        cause = "; ".join(dict.fromkeys(batch.reasons)) or "change"
        if batch.rescan or self._inventory is None:
            self._inventory = scan_host(self._root)
        else:
            self._inventory = refresh_host(self._root, self._inventory, batch.bdfs)
        self._scanned = build_device_tree(self._inventory, self._config, self._names, self._scanned)
        self._apply(self._published(), cause)
        self._publish_labels()

    def _published(self) -> DeviceTree:
        return self._scanned if self._resets is None else self._resets.overlay(self._scanned)

    def _track_use(self, batch: _Batch) -> None:
        """Reset after use: fold in Allocates, finished resets and the newest List."""
        if self._resets is None or self._inventory is None:
            return
        if self._resets.fold(batch.use, self._scanned, self._inventory):
            self._apply(self._published(), "reset after use")

    def _on_allocated(self, resource: str, device_ids: tuple[str, ...]) -> None:
        """From a gRPC thread: note the allocation and ask the kubelet soon who holds what."""
        if self._resets is not None:
            self._resets.note_allocated(resource, device_ids)
        if self._poller is not None:
            self._poller.poke()

    def _apply(self, tree: DeviceTree, cause: str) -> None:
        """Publish what changed: new resources get a server, changed ones a new snapshot,
        vanished ones are stopped."""
        previous = self._tree
        for name, resource in tree.resources.items():
            old = previous.resources.get(name)
            if old == resource and name in self._servers:
                continue
            if old != resource:
                _log_health_changes(old, resource, cause)
            servicer = self._vfio.get(name)
            if servicer is None:
                servicer = VfioServicer(
                    resource,
                    self._metrics.allocation,
                    allocated=self._on_allocated if resource.reset_after_use else None,
                )
                self._vfio[name] = servicer
            else:
                servicer.update(resource)
            if name not in self._servers:
                # Served here rather than with the servicer: a server that failed to start is
                # tried again by the next tree.
                self._serve(name, servicer)
            self._metrics.set_devices(
                name, resource.healthy_count, len(resource.devices) - resource.healthy_count
            )
        for name in set(previous.resources) - set(tree.resources):
            self._remove_resource(name, cause)
        self._tree = tree
        if self._iommufd is not None and self._iommufd.node_present != tree.iommu_node_present:
            self._iommufd.update(tree.iommu_node_present)
            state = "healthy" if self._iommufd.healthy else "unhealthy"
            log.info(
                "resource %s resource=%s iommu_node=%s cause=%r",
                state,
                self._iommufd.resource_name,
                "present" if tree.iommu_node_present else "missing",
                cause,
            )
            self._count_iommufd()

    def _remove_resource(self, name: str, cause: str) -> None:
        log.info("resource gone resource=%s cause=%r", name, cause)
        server = self._servers.pop(name, None)
        if server is not None:
            server.stop()
        self._close_servicer(name)
        self._unregistered.discard(name)
        self._metrics.forget_resource(name)

    def _publish_labels(self) -> None:
        """The node labels follow the scanned tree (a device awaiting its reset still counts:
        the labels say what the node offers, the kubelet's capacity what is free)."""
        if self._labels is not None and self._inventory is not None:
            # Loaded at the first labels, after the first registrations.
            from hostdev.labels.node_labels import build_node_labels

            counts = self._scanned.iommufd_counts()
            self._labels.publish(build_node_labels(self._inventory.capabilities, counts))

    def _count_iommufd(self) -> None:
        if self._iommufd is not None:
            slots = self._config.iommufd.slots
            healthy = slots if self._iommufd.healthy else 0
            self._metrics.set_devices(self._iommufd.resource_name, healthy, slots - healthy)

    def _serve(self, resource: str, servicer: VfioServicer | IommufdServicer) -> None:
        server = PluginServer(self._kubelet_dir / socket_name(resource), servicer)
        server.start()
        self._servers[resource] = server
        self._unregistered.add(resource)
        if self.ready.is_set():
            self._register_pending()

    def _restart_servers(self, resources: set[str]) -> None:
        for resource in sorted(resources):
            self._servers[resource].restart(grace=0)
            self._unregistered.add(resource)
        self._retry_delay = _RETRY_FIRST
        self._register_pending()

    def _register_async(self, resource: str) -> Future[None]:
        """Register `resource` in a thread: the kubelet dials back before it answers."""
        server = self._servers[resource]
        if not server.present:
            server.restart(grace=0)
        return self._registrar.submit(
            register_with_kubelet,
            self._kubelet_dir,
            resource,
            server.path.name,
            server.servicer.options,
        )

    def _register_pending(self, under_way: dict[str, Future[None]] | None = None) -> None:
        """Register every resource not registered yet, all at once; `under_way`: registrations
        already started."""
        kubelet_socket = self._kubelet_dir / KUBELET_SOCKET
        if not kubelet_socket.exists():
            log.info("waiting for the kubelet socket=%s", kubelet_socket)
            # Its creation is an inotify event; the slow retry covers a watch that was lost.
            self._retry_at = time.monotonic() + _RETRY_MAX
            return
        attempts = dict(under_way or {})
        for resource in sorted(self._unregistered - attempts.keys()):
            attempts[resource] = self._register_async(resource)
        for resource, attempt in sorted(attempts.items()):
            server = self._servers[resource]
            try:
                attempt.result()
            except RegistrationError as error:
                log.warning("registration failed resource=%s error=%r", resource, str(error))
                self._metrics.registration(resource, "failed")
                continue
            log.info("registered resource=%s endpoint=%s", resource, server.path.name)
            self._metrics.registration(resource, "ok")
            self._unregistered.discard(resource)
        if self._unregistered:
            self._retry_at = time.monotonic() + self._retry_delay
            self._retry_delay = min(self._retry_delay * 2, _RETRY_MAX)
        else:
            self._retry_at = None
            self._retry_delay = _RETRY_FIRST

    def _close_servicer(self, resource: str) -> None:
        servicer = self._vfio.pop(resource, None)
        if servicer is not None:
            servicer.close()
        if self._iommufd is not None and resource == self._iommufd.resource_name:
            self._iommufd.close()


def _log_health_changes(old: VfioResource | None, new: VfioResource, cause: str) -> None:
    before = {} if old is None else dict(old.devices)
    for device_id, device in new.devices.items():
        previous = before.pop(device_id, None)
        if previous is None:
            state = "healthy" if device.healthy else f"unhealthy reason={device.reason!r}"
            log.info(
                "device added resource=%s device=%s %s cause=%r", new.name, device_id, state, cause
            )
        elif previous.healthy and not device.healthy:
            log.warning(
                "device unhealthy resource=%s device=%s reason=%r cause=%r",
                new.name,
                device_id,
                device.reason,
                cause,
            )
        elif device.healthy and not previous.healthy:
            log.info("device healthy resource=%s device=%s cause=%r", new.name, device_id, cause)
    for device_id in before:
        log.info("device removed resource=%s device=%s cause=%r", new.name, device_id, cause)
