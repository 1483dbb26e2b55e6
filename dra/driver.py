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
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from dra.api import ResourceApi
from dra.binding import OnDemandBinder
from dra.devices import IOMMU_NODE, DraDevice, build_devices, judge_function
from dra.kubelet_sockets import KubeletSockets
from dra.prepare import ClaimPreparer, Paths
from dra.publisher import SlicePublisher
from dra.servicer import DraServicerV1, DraServicerV1beta1
from dra.state import ClaimStore
from hostdev.bdf import Bdf
from hostdev.binding.bind import HostAccess
from hostdev.config import PluginConfig
from hostdev.device_events import DevicesChanged, UdevWatch
from hostdev.errors import HostdevError
from hostdev.labels.node_labels import build_node_labels
from hostdev.labels.publisher import LabelPublisher
from hostdev.model import HostInventory
from hostdev.pciids import PciIds
from hostdev.scan import refresh_host, scan_host

log = logging.getLogger(__name__)


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


class DraDriver:
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
        self._config = config
        self._names = names
        self._host_lock = threading.Lock()
        # Reading what is held and handing it to the publisher are one step: a re-scan must not
        # publish, after a prepare, a list computed before it.
        self._publish_lock = threading.Lock()
        self._inventory = scan_host(settings.root)
        self.store = ClaimStore(settings.state_dir)
        self.store.load()
        self.binder = OnDemandBinder(
            HostAccess(root=settings.root, host_root=settings.host_root),
            settings.state_dir / "bindings",
        )
        for line in self.binder.recover(c.uid for c in self.store):
            log.warning("start-up recovery: %s", line)
        self.preparer = ClaimPreparer(
            settings.driver,
            settings.node,
            api,
            self._judge,
            self.store,
            Paths(settings.cdi_dir, settings.state_dir / "metadata"),
            on_change=self._claims_changed,
            binder=self.binder,
        )
        self._usable = build_devices(self._inventory, config, names)
        """Every device a VM could be given, as of the last reading of the host."""
        self.publisher = SlicePublisher(api, settings.node, settings.driver, self._published())
        self.sockets = KubeletSockets(
            settings.kubelet_dir,
            settings.driver,
            DraServicerV1(self.preparer),
            DraServicerV1beta1(self.preparer),
        )
        self._events: queue.SimpleQueue[DevicesChanged | None] = queue.SimpleQueue()
        self._udev = UdevWatch(self._events.put) if settings.watch_udev else None
        self._rescanner = threading.Thread(target=self._rescan_loop, name="dra-rescan", daemon=True)

    @property
    def devices(self) -> tuple[DraDevice, ...]:
        return self._published()

    def start(self) -> None:
        """Serve the kubelet first (GetInfo must answer at once), then publish in the background."""
        self.sockets.start()
        self.publisher.start()
        self._publish_labels(self.devices)
        self._rescanner.start()
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

    def stop(self) -> None:
        if self._udev is not None:
            self._udev.stop()
        self._events.put(None)
        self.sockets.stop()
        self.publisher.stop()
        if self._rescanner.is_alive():
            self._rescanner.join()
        if self._labels is not None:
            self._labels.close()

    def rescan(self, changed: frozenset[Bdf] | None = None) -> None:
        """Read the `changed` functions (with their groups), or the whole host, again and
        publish what changed."""
        with self._host_lock:
            if changed is None:
                self._inventory = scan_host(self.settings.root)
            else:
                self._inventory = refresh_host(
                    self.settings.root, self._inventory, _with_groups(self._inventory, changed)
                )
            self._usable = build_devices(self._inventory, self._config, self._names)
        with self._publish_lock:
            devices = self._published()
            self.publisher.update(devices)
        self._publish_labels(devices)

    def _publish_labels(self, devices: tuple[DraDevice, ...]) -> None:
        """The node labels (hostdev.labels.node_labels) from the published devices: per
        resource, how many hand out their cdev and /dev/iommu."""
        if self._labels is None:
            return
        counts: dict[str, int] = {}
        for device in devices:
            counts[device.resource] = counts.get(device.resource, 0) + int(
                IOMMU_NODE in device.device_nodes
            )
        with self._host_lock:
            capabilities = self._inventory.capabilities
        self._labels.publish(build_node_labels(capabilities, counts))

    def _published(self) -> tuple[DraDevice, ...]:
        """What to publish: every usable device, less the group companions of prepared ones (a
        group goes to one VM; the prepared device itself stays, allocated to its claim)."""
        groups, functions = self.store.held()
        with self._host_lock:
            usable = self._usable
        return tuple(d for d in usable if d.group not in groups or d.bdf in functions)

    def _claims_changed(self) -> None:
        # Only which group companions are hidden can change: a filter over the devices already
        # built, cheap enough for the kubelet's call; the publisher writes in the background.
        with self._publish_lock:
            self.publisher.update(self._published())

    def _judge(self, bdfs: Iterable[Bdf]) -> Mapping[Bdf, DraDevice | str]:
        wanted = set(bdfs)
        with self._host_lock:
            inventory = refresh_host(
                self.settings.root, self._inventory, _with_groups(self._inventory, wanted)
            )
            self._inventory = inventory
        judged: dict[Bdf, DraDevice | str] = {}
        for bdf in wanted:
            function = inventory.function(bdf)
            judged[bdf] = (
                "gone from the host"
                if function is None
                else judge_function(function, inventory, self._config, self._names)
            )
        return judged

    def _rescan_loop(self) -> None:
        while True:
            try:
                event = self._events.get(timeout=self.settings.rescan_interval)
            except queue.Empty:
                event = DevicesChanged(frozenset(), "periodic re-scan", rescan=True)
            if event is None:
                return
            # No functions named: only the device nodes are looked at again (hostdev.scan).
            changed: set[Bdf] | None = None if event.rescan else set(event.bdfs)
            # Take what else is queued: a bind is a burst of uevents.
            while changed is not None:
                try:
                    more = self._events.get_nowait()
                except queue.Empty:
                    break
                if more is None:
                    return
                changed = None if more.rescan else changed | more.bdfs
            try:
                self.rescan(None if changed is None else frozenset(changed))
            except HostdevError as error:
                log.error("re-reading the host failed: %s", error)


def _with_groups(inventory: HostInventory, bdfs: Iterable[Bdf]) -> set[Bdf]:
    """The functions and every member of their IOMMU groups: one member bound elsewhere makes
    the whole group not viable."""
    wanted = set(bdfs)
    for bdf in list(wanted):
        function = inventory.function(bdf)
        group = inventory.group_of(function) if function else None
        if group is not None:
            wanted |= {m.bdf for m in group.members if m.bdf is not None}
    return wanted
