"""The running DRA driver: the host's devices, the slices that publish them, the kubelet's sockets
and the preparer behind them, started and stopped together.

The host is read once at start. On a node, kernel uevents (bind, unbind, hot-plug) make the
named functions be read again at once; the whole host is re-read every `rescan_interval`
seconds for anything else, and the claimed functions are read again whenever a claim is
prepared, so a claim never gets a device on the strength of an old reading.
"""

from __future__ import annotations

import logging
import queue
import threading
from dataclasses import dataclass
from pathlib import Path

from dra.api import ResourceApi
from dra.binding import OnDemandBinder
from dra.devices import DraDevice
from dra.host_cache import HostCache
from dra.kubelet_sockets import KubeletSockets, serialize_lock_path
from dra.prepare import ClaimPreparer, ClaimsChanged
from dra.prepare_plan import Paths
from dra.publisher import SlicePublisher
from dra.serialize_lock import SerializeLock
from dra.servicer import DraServicerV1, DraServicerV1beta1
from dra.state import RECORDS_MODE, ClaimStore
from hostdev.binding.bind import HostAccess
from hostdev.config import PluginConfig
from hostdev.device_events import DevicesChanged, UdevWatch
from hostdev.directories import make_private_directory
from hostdev.errors import HostdevError
from hostdev.labels.node_labels import build_node_labels
from hostdev.labels.publisher import LabelPublisher
from hostdev.pciids import PciIds

log = logging.getLogger(__name__)
CLAIMS_FOLLOW_SECONDS = 0.2
"""How often the claim records are looked at for another instance's prepares and unprepares."""
# The container runtime (root) reads the CDI specs and bind-mounts the metadata files into the
# virt-launcher pod, where KubeVirt reads them as uid 107: those directories may be read and
# passed through by all, and written by root alone.
READABLE_MODE = 0o755


@dataclass(frozen=True, slots=True)
class DriverSettings:
    node: str
    driver: str
    root: Path
    kubelet_dir: Path
    cdi_dir: Path
    state_dir: Path
    rescan_interval: float = 5.0
    watch_udev: bool = False
    host_root: Path = Path("/")
    """Holds the host's /lib/modules and modprobe, for binding devices on demand."""
    instance_uid: str = ""
    """The pod's UID when instances run side by side during a rolling update (socket names,
    journal entries); empty for the node's only instance."""


class DraDriver:
    """Built without touching the host or the API server; `start` recovers, reads and serves."""

    def __init__(
        self,
        settings: DriverSettings,
        config: PluginConfig,
        names: PciIds,
        api: ResourceApi,
        *,
        labels: LabelPublisher | None = None,
    ) -> None:
        self.settings = settings
        self._labels = labels
        self.host = HostCache(settings.root, config, names)
        self.store = ClaimStore(settings.state_dir)
        self._paths = Paths(settings.cdi_dir, settings.state_dir / "metadata")
        self._journal_dir = settings.state_dir / "bindings"
        self.binder = OnDemandBinder(
            HostAccess(root=settings.root, host_root=settings.host_root),
            self._journal_dir,
            instance=settings.instance_uid,
        )
        # Host events, claims prepared or forgotten, and the stop mark, all read by one thread:
        # it alone publishes, so what it publishes follows what is held in order.
        self._events: queue.SimpleQueue[DevicesChanged | ClaimsChanged | None] = queue.SimpleQueue()
        self.preparer = ClaimPreparer(
            settings.driver,
            settings.node,
            api,
            self.host,
            self.store,
            self._paths,
            changes=self._events,
            binder=self.binder,
            serialize=SerializeLock(
                serialize_lock_path(settings.kubelet_dir, settings.driver), settings.instance_uid
            ),
        )
        self.publisher = SlicePublisher(api, settings.node, settings.driver, ())
        self.sockets = KubeletSockets(
            settings.kubelet_dir,
            settings.driver,
            DraServicerV1(self.preparer),
            DraServicerV1beta1(self.preparer),
            instance_uid=settings.instance_uid,
        )
        self._udev = UdevWatch(self._events.put) if settings.watch_udev else None
        self._events_thread = threading.Thread(
            target=self._event_loop, name="dra-events", daemon=True
        )
        # Another instance's prepares reach the slices this one publishes too, so both publish
        # the same and neither undoes the other's writes.
        self._stopping = threading.Event()
        self._follower = threading.Thread(
            target=self.store.follow,
            args=(
                lambda: self._events.put(ClaimsChanged("")),
                self._stopping,
                CLAIMS_FOLLOW_SECONDS,
            ),
            name="dra-claims",
            daemon=True,
        )

    @property
    def devices(self) -> tuple[DraDevice, ...]:
        return self._published()

    def start(self) -> None:
        """Recover and read the host, then serve the kubelet (GetInfo must answer at once), then
        publish in the background."""
        self.recover()
        self.publisher.update(self.devices)
        self.sockets.start()
        self.publisher.start()
        self._publish_labels(self.devices)
        self._events_thread.start()
        self._follower.start()
        if self._udev is not None:
            self._udev.start()
        log.info(
            "driver %s serving on %s for node %s (%d devices, %d prepared claims)",
            self.settings.driver,
            self.settings.kubelet_dir,
            self.settings.node,
            len(self.devices),
            sum(1 for _ in self.store),
        )

    def recover(self) -> None:
        """Read the prepared claims, put back what an interrupted bind or a claim no longer
        prepared left on VFIO (sysfs writes), then read the host as it is after that."""
        self._make_directories()
        self.store.load()
        for line in self.preparer.recover():
            log.warning("start-up recovery: %s", line)
        self.host.scan()

    def _make_directories(self) -> None:
        """Each directory the driver writes into as root, made with its mode whatever the umask,
        and refused (UnsafeDirectory) when another user could write into it: there they could
        plant a symbolic link the driver then writes through. The claim store makes claims/."""
        make_private_directory(self._paths.cdi_dir, READABLE_MODE, "CDI directory")
        make_private_directory(self.settings.state_dir, READABLE_MODE, "state directory")
        make_private_directory(self._paths.metadata_dir, READABLE_MODE, "metadata directory")
        make_private_directory(self._journal_dir, RECORDS_MODE, "binding journal directory")

    def stop(self) -> None:
        self._stopping.set()
        if self._udev is not None:
            self._udev.stop()
        self._events.put(None)
        self.sockets.stop()
        self.publisher.stop()
        if self._events_thread.is_alive():
            self._events_thread.join()
        if self._follower.is_alive():
            self._follower.join()
        if self._labels is not None:
            self._labels.close()

    def _publish_labels(self, devices: tuple[DraDevice, ...]) -> None:
        """The node labels (hostdev.labels.node_labels) from the published devices: per
        resource, how many a VM gets over iommufd — by the `iommufd` attribute the slice
        publishes, so a device on its host driver waiting for an on-demand claim counts by what
        it will offer once bound, as the scheduler sees it."""
        capabilities = self.host.capabilities
        if self._labels is None or capabilities is None:
            return
        counts: dict[str, int] = {}
        for device in devices:
            counts[device.resource] = counts.get(device.resource, 0) + int(
                device.attributes.get("iommufd") is True
            )
        self._labels.publish(build_node_labels(capabilities, counts))

    def _published(self) -> tuple[DraDevice, ...]:
        """What to publish: every usable device, less the group companions of prepared ones (a
        group goes to one VM; the prepared device itself stays, allocated to its claim)."""
        groups, functions = self.store.held()
        return tuple(d for d in self.host.usable if d.group not in groups or d.bdf in functions)

    def _event_loop(self) -> None:
        while True:
            try:
                first = self._events.get(timeout=self.settings.rescan_interval)
            except queue.Empty:
                first = DevicesChanged(frozenset(), "periodic re-scan", rescan=True)
            # Take what else is queued: a bind is a burst of uevents.
            batch = [first]
            while batch[-1] is not None:
                try:
                    batch.append(self._events.get_nowait())
                except queue.Empty:
                    break
            if batch[-1] is None:
                return
            host = [e for e in batch if isinstance(e, DevicesChanged)]
            try:
                if host:
                    # No functions named: only the device nodes are looked at again.
                    self.host.scan(
                        None
                        if any(e.rescan for e in host)
                        else frozenset().union(*(e.bdfs for e in host))
                    )
                # After a prepare only which group companions are hidden can change: a filter
                # over the devices already built; the publisher writes in the background.
                devices = self._published()
                self.publisher.update(devices)
                if host:
                    self._publish_labels(devices)
            except HostdevError as error:
                log.error("re-reading the host failed: %s", error)
