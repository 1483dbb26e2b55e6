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
error counters, which send no event, it reads every `aer_poll_interval` seconds in between (less
often on a host so large that reading them would take more than COUNTER_SHARE of the time).
"""

from __future__ import annotations

import json
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
from dra.health_judge import (
    Baseline,
    HealthState,
    HostSignals,
    baselines_json,
    build_baselines,
    diff_health,
    judge_health,
    parse_baselines,
    same_health,
)
from dra.host_cache import HostCache, parse_published, published_json
from dra.iommufd_slots import build_slot_entries
from dra.kubelet_sockets import KubeletFront, build_kubelet_front, serialize_lock_path
from dra.prepare import ClaimPreparer, ClaimsChanged
from dra.prepare_plan import Paths
from dra.publisher import SlicePublisher
from dra.serialize_lock import SerializeLock
from dra.state import RECORDS_MODE, ClaimStore
from hostdev.aer import AerCounts, read_aer_counts
from hostdev.atomic_file import write_file_atomically
from hostdev.bdf import Bdf
from hostdev.binding.bind import HostAccess
from hostdev.config import PluginConfig
from hostdev.device_events import DevicesChanged, UdevWatch
from hostdev.device_watch import DeviceWatch
from hostdev.directories import make_private_directory
from hostdev.errors import HostdevError
from hostdev.iommufd_handoff import HandoffConfig
from hostdev.labels.node_labels import build_node_labels
from hostdev.labels.publisher import LabelPublisher
from hostdev.pciids import PciIds

log = logging.getLogger(__name__)
BASELINES_FILE = "aer-baselines.json"
"""Under the state directory: the judge's fatal-error baselines for whichever judge starts next,
the other instance of a rolling update or this driver after a restart. Without them a judge that
starts after a fatal error takes its count for the baseline and calls the device healthy while
the instance that saw it taints it: two publishers of one pool rewriting the taint for good."""
PUBLISHED_FILE = "published-devices.json"
"""Under the state directory: the devices last published, for whichever instance reads the host
next (HostCache.remember)."""
CLAIMS_FOLLOW_SECONDS = 0.2
"""How often the claim records are looked at for another instance's prepares and unprepares."""
PERIODIC = "periodic re-scan"
CLAIMS_QUIET_SECONDS = 0.1
"""Claims prepared or forgotten are handled (their group companions hidden or shown, every
device's health judged and handed on) once none has come for this long, or CLAIMS_MAX_SECONDS
after the first at the latest."""
CLAIMS_MAX_SECONDS = 0.5
RESCAN_SHARE = 0.1
"""The most of its time the event thread spends reading the whole host on its own (not for an
event): on 4,096 functions a reading takes half a second, and more beside a busy driver."""
COUNTER_SHARE = 0.05
"""The most of its time the event thread spends reading error counters between events: a
reading is two sysfs files per device, tens of milliseconds on 4,096 functions, which every
`aer_poll_interval` would keep a core busy and slow every prepare beside it."""
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
    run_dir: Path
    """What need not survive a reboot (a tmpfs): the metadata files, the unprepared marks."""
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
        self._baselines: dict[str, Baseline] = {}
        """As last written for the next judge to start (BASELINES_FILE)."""
        self._remembered: tuple[DraDevice, ...] = ()
        """The devices as last written for the next instance (HostCache.remember)."""
        self._next_whole_read = 0.0
        """When the periodic re-scan may next read the whole host (see RESCAN_SHARE)."""
        self._next_poll = 0.0
        """When the error counters may next be read between events (see COUNTER_SHARE)."""
        self.host = HostCache(settings.root, config, names)
        self.store = ClaimStore(settings.state_dir, settings.run_dir)
        handoff = build_handoff_config(settings, config)
        self._paths = Paths(
            settings.cdi_dir,
            settings.run_dir / "metadata",
            settings.state_dir / "metadata",
            handoff.socket_dir if handoff else None,
            config.iommufd.slots if handoff else 0,
        )
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
            handoff=handoff,
        )
        self.publisher = SlicePublisher(
            api,
            settings.node,
            settings.driver,
            (),
            taint_effect=settings.unhealthy_taint_effect,
            slots=build_slot_entries(config.iommufd.resource_name, self._paths.slots),
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
        """Serve the kubelet (the only instance registers at once, an instance of a rolling
        update once recovered), recover and read the host, then let the kubelet's prepares
        through and publish in the background. A start that fails stops
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
        self._baselines = read_baselines(self.settings.state_dir / BASELINES_FILE)
        # Nothing is prepared before recovery put back what a dead run left half-done.
        self.front.ready(self.preparer)
        # Judged before the first publication: a device found unusable is tainted from the start.
        # Of the error counters, only those of devices with a recorded baseline are read first:
        # a device's first reading is its baseline otherwise, which no verdict depends on (see
        # health_judge._track), and reading 4,096 devices' took 0.1 s before the first slice.
        devices = self.devices
        self._read_counters([d for d in devices if d.name in self._baselines])
        self._judge(devices, frozenset(), report=True, counters=False, keep_hints=False)
        self.publisher.start()
        # Beside the first publication (its API client loading): the first reading of the
        # other counters, before start returns, so an error after it is one since the baseline;
        # then the hints for the next instance.
        if len(self._aer) < len(devices):
            self._poll_counters()
        self._record_baselines()
        self._record_published()
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
        self._remembered = parse_published(_read_json(self.settings.state_dir / PUBLISHED_FILE))
        self.host.remember(self._remembered)
        self.host.scan()

    def _make_directories(self) -> None:
        """Each directory the driver writes into as root, made with its mode whatever the umask,
        and refused (UnsafeDirectory) when another user could write into it: there they could
        plant a symbolic link the driver then writes through. The claim store makes claims/ and
        the unprepared marks' directory."""
        make_private_directory(self._paths.cdi_dir, READABLE_MODE, "CDI directory")
        make_private_directory(self.settings.state_dir, READABLE_MODE, "state directory")
        make_private_directory(self.settings.run_dir, READABLE_MODE, "run directory")
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
        self.preparer.close()
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
        # Claims prepared or forgotten, not yet handled: a burst of them is judged once.
        held: list[Event] = []
        held_first = held_last = 0.0
        while True:
            now = time.monotonic()
            wait = min(next_rescan, self._next_poll) if poll > 0 else next_rescan
            if held:
                wait = min(wait, held_last + CLAIMS_QUIET_SECONDS, held_first + CLAIMS_MAX_SECONDS)
            batch = _take(self._events, max(0.0, wait - now))
            if batch and batch[-1] is None:
                return
            if batch and not any(isinstance(e, DevicesChanged) for e in batch):
                # Each judgement hands every device's health to the kubelet and the
                # publisher: on 4,096 functions tens of milliseconds of the driver's time,
                # which a prepare beside it would wait for.
                held_first = held_first if held else time.monotonic()
                held_last = time.monotonic()
                held += batch
                batch = []
            if held and (
                batch
                or time.monotonic()
                >= min(held_last + CLAIMS_QUIET_SECONDS, held_first + CLAIMS_MAX_SECONDS)
            ):
                batch, held = held + batch, []
            if time.monotonic() >= next_rescan:
                # Every interval the devices' health is judged and handed on; the whole host
                # is read again only as often as RESCAN_SHARE allows (a second on 4,096
                # functions under load), otherwise the device nodes alone are.
                whole = time.monotonic() >= self._next_whole_read
                batch.append(DevicesChanged(frozenset(), PERIODIC, rescan=whole))
                next_rescan = time.monotonic() + interval
            if batch:
                self._handle(batch)
            elif poll > 0 and time.monotonic() >= self._next_poll:
                self._poll_counters()

    def _handle(self, batch: list[Event]) -> None:
        host = [e for e in batch if isinstance(e, DevicesChanged)]
        try:
            if any(e.rescan for e in host):
                started = time.monotonic()
                self.host.scan(None)
                took = time.monotonic() - started
                self._next_whole_read = started + max(
                    self.settings.rescan_interval, took / RESCAN_SHARE
                )
            elif host:
                # No functions named: only the device nodes are looked at again.
                self.host.scan(frozenset().union(*(e.bdfs for e in host)))
            # After a prepare only which group companions are hidden can change: a filter
            # over the devices already built. They are published with their health (below).
            devices = self._published()
            if host:
                self._publish_labels(devices)
        except HostdevError as error:
            log.error("re-reading the host failed: %s", error)
            return
        reprobed = frozenset().union(*(e.bdfs for e in host if e.reprobed))
        # A claim prepared or forgotten, or the interval passing, changes no counter: the
        # polls read them.
        periodic = all(e.reason == PERIODIC for e in host)
        self._judge(devices, reprobed, report=True, counters=not periodic, checked=bool(host))

    def _poll_counters(self) -> None:
        """Between events: read the counters again, and judge when they moved or a device's
        nodes are still being made (its judgement changes with time alone)."""
        devices = self._published()
        before = self._aer
        if self._read_counters(devices) != before or self._health.pending():
            self._judge(devices, frozenset(), report=False)

    def _read_counters(self, devices: Iterable[DraDevice]) -> dict[Bdf, AerCounts | None]:
        """Read every device's counters; the next poll waits as COUNTER_SHARE says, from any
        reading (the one before the first publication too, which took 0.3-0.5 s of a start on
        4,096 functions, and was read again at once beside the first slices)."""
        before = self._aer
        started = time.monotonic()
        self._aer = {d.bdf: read_aer_counts(self.settings.root, d.bdf) for d in devices}
        took = time.monotonic() - started
        self._next_poll = started + max(self.settings.aer_poll_interval, took / COUNTER_SHARE)
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
        self,
        devices: tuple[DraDevice, ...],
        reprobed: frozenset[Bdf],
        *,
        report: bool,
        counters: bool | None = None,
        checked: bool = True,
        keep_hints: bool = True,
    ) -> None:
        """Judge every published device's health, log each change once and hand the list on:
        always after a reading of the host, after a counter reading only when it changed. The
        counters are read first when `counters` (by default when `report`); not `checked`: a
        claim alone, no reading (see judge_health). With `keep_hints`, the baselines and the
        devices are written for the next instance when they changed."""
        if report if counters is None else counters:
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
            recorded=self._baselines,
        )
        before = self._health.health
        self._health = judge_health(self._health, devices, signals, time.time(), checked=checked)
        if keep_hints:
            self._record_baselines()
            self._record_published()
        logged = [
            (old, new)
            for old, new in diff_health(before, self._health.health)
            if old is not None or new.health is not Health.HEALTHY
        ]
        if logged:
            bdfs = {d.name: d.bdf for d in devices} | {n: b for b, n in prepared.items()}
            for old, new in logged:
                _log_change(old, new, bdfs.get(new.device), claims)
        if (not report or not checked) and same_health(before, self._health.health):
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

    def _record_published(self) -> None:
        devices = self.host.devices
        if devices == self._remembered:
            return
        self._remembered = devices
        self._keep_hint(
            PUBLISHED_FILE,
            published_json(devices),
            "the published devices for the next start",
            "an instance started next leaves out those unusable by then",
        )

    def _record_baselines(self) -> None:
        baselines = build_baselines(self._health)
        # The companions of a claim's device leave the pool while it holds their group, and
        # come back with the baselines they had: an error meanwhile came after they were bound.
        kept = {d.name for d in self.host.devices}
        baselines |= {
            name: baseline
            for name, baseline in self._baselines.items()
            if name in kept and name not in self._health.tracked
        }
        if baselines == self._baselines:
            return
        self._baselines = baselines
        self._keep_hint(
            BASELINES_FILE,
            baselines_json(baselines),
            "the devices' fatal PCIe error counts for the next start",
            "an instance started next takes errors from before it for none",
        )

    def _keep_hint(self, name: str, value: object, what: str, without: str) -> None:
        """Write a hint for whichever instance starts next (read back by `_read_json`); a
        failure is logged with what the next instance does without it."""
        # Unindented: json's C encoder, a third of the time on 4,096 devices.
        data = json.dumps(value, separators=(",", ":")).encode()
        try:
            write_file_atomically(
                self.settings.state_dir / name, data, 0o600, directory_mode=RECORDS_MODE
            )
        except OSError as error:
            log.error("cannot keep %s: %s; %s", what, error, without)


def read_baselines(path: Path) -> dict[str, Baseline]:
    """The baselines another judge left; none when there are none or the file is unreadable."""
    return parse_baselines(_read_json(path))


def _read_json(path: Path) -> object:
    """A hint another instance left; None when there is none or it is unreadable."""
    try:
        return json.loads(path.read_bytes())
    except FileNotFoundError:
        return None
    except (OSError, ValueError, RecursionError) as error:
        log.warning("ignoring %s: %s", path, error)
        return None


def build_handoff_config(settings: DriverSettings, config: PluginConfig) -> HandoffConfig | None:
    """The iommufd hand-off of claims on the driver's iommufd slots, as the device plugin's
    (owner, mode, expiry from the shared configuration's `iommufd`), its sockets under the state
    directory, a host path the runtime bind-mounts from; None when `iommufd.enabled` is false."""
    iommufd = config.iommufd
    if not iommufd.enabled:
        return None
    return HandoffConfig(
        socket_dir=settings.state_dir / "iommufd",
        root=settings.root,
        owner_uid=iommufd.socket_uid,
        owner_gid=iommufd.socket_gid,
        mode=iommufd.socket_mode,
        expiry_seconds=iommufd.handoff_timeout_seconds,
    )


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
