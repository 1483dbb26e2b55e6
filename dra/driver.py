"""The running DRA driver: the host's devices, the slices that publish them, the kubelet's sockets
and the preparer behind them, started and stopped together.

The host is read once at start. On a node, kernel uevents (bind, unbind, hot-plug) make the
named functions be read again at once, and inotify does the same for the device nodes under
/dev (and, on simulated trees, for the driver links); the whole host is re-read every
`rescan_interval` seconds for anything else, and the claimed functions are read again whenever a
claim is prepared, so a claim never gets a device on the strength of an old reading.

After each reading the one event thread judges every published device's health
(dra.health_judge) and hands the complete list to the kubelet's health stream (dra.health_stream),
to the publisher, which taints the unhealthy devices' slice entries, and to `on_health`; the PCIe
error counters, which send no event, it reads every `aer_poll_interval` seconds in between.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from dra.api import ResourceApi
from dra.binding import OnDemandBinder
from dra.claims import ClaimRef
from dra.devices import DraDevice
from dra.health import DeviceHealth, Health, TaintEffect
from dra.health_judge import HealthState, HostSignals, diff_health, judge_health, same_health
from dra.host_cache import HostCache
from dra.kubelet_sockets import KubeletFront, build_kubelet_front, serialize_lock_path
from dra.prepare import ClaimPreparer, ClaimsChanged
from dra.prepare_plan import Paths
from dra.publisher import SlicePublisher
from dra.serialize_lock import SerializeLock
from dra.state import RECORDS_MODE, ClaimStore
from hostdev.aer import AerCounts, read_aer_counts
from hostdev.bdf import Bdf
from hostdev.binding.bind import HostAccess
from hostdev.config import PluginConfig
from hostdev.device_events import DevicesChanged, UdevWatch
from hostdev.device_watch import DeviceWatch
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

OnHealth = Callable[[tuple[DeviceHealth, ...]], None]
Event = DevicesChanged | ClaimsChanged | None


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
    unhealthy_taint_effect: TaintEffect = TaintEffect.NO_SCHEDULE
    """What the taint on an unhealthy device's slice entry does to claims and their pods."""
    aer_poll_interval: float = 0.05
    """Seconds between readings of the published devices' PCIe error counters (two small sysfs
    files each), which send no event; 0 reads them only with the host."""
    instance_uid: str = ""
    """The pod's UID when instances run side by side during a rolling update (socket names,
    journal entries); empty for the node's only instance."""


class DraDriver:
    """Built without touching the host or the API server; `start` serves the kubelet, then
    recovers, reads the host and publishes. The kubelet's side (`front`) may be served already:
    the `dra` command serves it before it loads this module.

    `on_health` is called from the event thread with every device's health (the published
    devices, then prepared ones gone from the bus): at start, after every reading of the host
    (events and each re-scan, so at least every `rescan_interval`), and whenever a counter
    reading changes a verdict. It must return quickly; `device_health` holds the last list.
    """

    def __init__(
        self,
        settings: DriverSettings,
        config: PluginConfig,
        names: PciIds,
        api: ResourceApi,
        *,
        labels: LabelPublisher | None = None,
        on_health: OnHealth | None = None,
        front: KubeletFront | None = None,
    ) -> None:
        self.settings = settings
        self._labels = labels
        self._on_health = on_health
        self._health = HealthState()
        self._aer: dict[Bdf, AerCounts | None] = {}
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
        self._events: queue.SimpleQueue[Event] = queue.SimpleQueue()
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
        self.publisher = SlicePublisher(
            api,
            settings.node,
            settings.driver,
            (),
            taint_effect=settings.unhealthy_taint_effect,
        )
        self.front = front or build_kubelet_front(
            settings.kubelet_dir,
            settings.driver,
            settings.node,
            settings.rescan_interval,
            settings.instance_uid,
        )
        self.health = self.front.health
        self.sockets = self.front.sockets
        self._udev = UdevWatch(self._events.put) if settings.watch_udev else None
        self._watch = DeviceWatch[DevicesChanged](settings.root, self._events.put)
        self._events_thread = threading.Thread(
            target=self._event_loop, name="dra-events", daemon=True
        )
        # Another instance's prepares reach the slices this one publishes too, so both publish
        # the same and neither undoes the other's writes. Only an instance of a rolling update
        # (one with a pod UID) can have another beside it.
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

    @property
    def device_health(self) -> tuple[DeviceHealth, ...]:
        """The last judgement: every published device, then prepared ones gone from the bus."""
        return self._health.health

    def start(self) -> None:
        """Serve the kubelet (GetInfo answers at once), recover and read the host, then let the
        kubelet's prepares through and publish in the background. A start that fails stops
        serving, so the kubelet forgets the driver, and answers the calls waiting with its error."""
        if not self.sockets.serving:
            self.sockets.start()
        try:
            self._start_served()
        except BaseException as error:
            self.front.gate.failed(str(error) or type(error).__name__)
            self.sockets.stop()
            raise

    def _start_served(self) -> None:
        self.recover()
        # Nothing is prepared before recovery put back what a dead run left half-done.
        self.front.gate.ready(self.preparer)
        # Judged before the first publication: a device found unusable is tainted from the start.
        self._judge(self.devices, frozenset(), report=True)
        self.publisher.start()
        self._publish_labels(self.devices)
        self._watch.start()
        self._events_thread.start()
        if self.settings.instance_uid:
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
        self._watch.stop()
        self._events.put(None)
        # Before the sockets: each stream then ends with OK instead of being cut off.
        self.health.close()
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
            if device.unusable:
                continue
            counts[device.resource] = counts.get(device.resource, 0) + int(
                device.attributes.get("iommufd") is True
            )
        self._labels.publish(build_node_labels(capabilities, counts))

    def _published(self) -> tuple[DraDevice, ...]:
        """What to publish: every device the host cache keeps, less the group companions of
        prepared ones (a group goes to one VM; the prepared device itself stays, allocated to
        its claim)."""
        groups, functions = self.store.held()
        return tuple(d for d in self.host.devices if d.group not in groups or d.bdf in functions)

    def _event_loop(self) -> None:
        interval = self.settings.rescan_interval
        poll = self.settings.aer_poll_interval
        next_rescan = time.monotonic() + interval
        while True:
            wait = next_rescan - time.monotonic()
            batch = _take(self._events, max(0.0, min(wait, poll) if poll > 0 else wait))
            if batch and batch[-1] is None:
                return
            if time.monotonic() >= next_rescan:
                batch.append(DevicesChanged(frozenset(), "periodic re-scan", rescan=True))
                next_rescan = time.monotonic() + interval
            if batch:
                self._handle(batch)
            else:
                self._poll_counters()

    def _handle(self, batch: list[Event]) -> None:
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
            # over the devices already built. They are published with their health (below).
            devices = self._published()
            if host:
                self._publish_labels(devices)
        except HostdevError as error:
            log.error("re-reading the host failed: %s", error)
            return
        reprobed = frozenset().union(*(e.bdfs for e in host if e.reprobed))
        self._judge(devices, reprobed, report=True)

    def _poll_counters(self) -> None:
        """Between events: read the counters again, and judge when they moved or a device's
        nodes are still being made (its judgement changes with time alone)."""
        devices = self._published()
        before = self._aer
        if self._read_counters(devices) != before or self._health.pending():
            self._judge(devices, frozenset(), report=False)

    def _read_counters(self, devices: Iterable[DraDevice]) -> dict[Bdf, AerCounts | None]:
        before = self._aer
        self._aer = {d.bdf: read_aer_counts(self.settings.root, d.bdf) for d in devices}
        for bdf, counts in self._aer.items():
            old = before.get(bdf)
            if counts is not None and old is not None and counts.nonfatal > old.nonfatal:
                log.warning(
                    "%s: %d new non-fatal PCIe errors (AER, %d in all); the device stays usable",
                    bdf,
                    counts.nonfatal - old.nonfatal,
                    counts.nonfatal,
                )
        return self._aer

    def _judge(
        self, devices: tuple[DraDevice, ...], reprobed: frozenset[Bdf], *, report: bool
    ) -> None:
        """Judge every published device's health, log each change once and hand the list on:
        always after a reading of the host, after a counter reading only when it changed."""
        if report:
            self._read_counters(devices)
        claims = {
            d.bdf: str(ClaimRef(c.namespace, c.name, c.uid)) for c in self.store for d in c.devices
        }
        prepared = {d.bdf: d.device for c in self.store for d in c.devices}
        on_bus = self.host.on_bus(prepared)
        gone = {name: claims[bdf] for bdf, name in prepared.items() if bdf not in on_bus}
        needs_journal = any(d.bind_on_demand and d.bdf in claims for d in devices)
        signals = HostSignals(
            aer=self._aer,
            claims=claims,
            gone=gone,
            bound_for_claims=frozenset(self.binder.journaled("bound"))
            if needs_journal
            else frozenset(),
            reprobed=reprobed,
        )
        before = self._health.health
        self._health = judge_health(self._health, devices, signals, time.time())
        bdfs = {d.name: d.bdf for d in devices} | {n: b for b, n in prepared.items()}
        for old, new in diff_health(before, self._health.health):
            if old is not None or new.health is not Health.HEALTHY:
                _log_change(old, new, bdfs.get(new.device), claims)
        if not report and same_health(before, self._health.health):
            return
        # After every reading even when nothing changed: the kubelet takes a device whose health
        # no list repeated within the timeout for Unknown. The publisher writes in the background.
        self.health.update(self._health.health)
        self.publisher.update(devices, self._health.health)
        if self._on_health is None:
            return
        try:
            self._on_health(self._health.health)
        except Exception:
            log.exception("handing on the devices' health failed")


def _take(events: queue.SimpleQueue[Event], timeout: float) -> list[Event]:
    """What is queued, waiting up to `timeout` for the first: a bind is a burst of events. Empty
    when nothing came; ends with None when the driver stops."""
    try:
        batch = [events.get(timeout=timeout)]
    except queue.Empty:
        return []
    while batch[-1] is not None:
        try:
            batch.append(events.get_nowait())
        except queue.Empty:
            break
    return batch


def _log_change(
    old: Health | None, new: DeviceHealth, bdf: Bdf | None, claims: dict[Bdf, str]
) -> None:
    claim = claims.get(bdf) if bdf is not None else None
    held = ""
    if claim is not None and new.health is Health.UNHEALTHY:
        held = f"; {claim} stays prepared on it (its VM decides what to do)"
    log.log(
        logging.WARNING if new.health is Health.UNHEALTHY else logging.INFO,
        "device %s (%s) health %s -> %s: %s%s",
        new.device,
        bdf,
        old.name if old is not None else "new",
        new.health.name,
        new.message or "usable",
        held,
    )
