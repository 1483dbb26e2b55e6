"""Keeps the API server's ResourceSlices for this node equal to the devices the host offers,
each unhealthy one tainted (`slices.build_taints`) with the configured effect.

One thread reconciles: list this node's slices of this driver, plan (`slices.plan_slices`),
write. It runs when the devices change, when a watch sees a slice changed by anyone but us (the
kubelet deletes a node's slices when it starts, and a driver's 30 s after the driver's socket
went away), and once a minute regardless. An API server that cannot be reached is retried with
backoff; nothing else of the driver waits for it.

Every change of a pool is a new generation on all its slices (32 on 4,096 functions), and a
prepare changes the pool (its device's group companions leave it), so the publisher spares the
work it can: changes that follow each other within COALESCE_SECONDS are published as one, the
slices are listed only when someone else may have changed them (what our own writes answered is
what the server holds otherwise), and the slices of a generation are written side by side. A
change of the devices alone waits until writing the pool has taken no more than WRITE_SHARE of
the time; a change of taints, a first publication and slices someone else changed do not wait.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor

from dra.api import ApiError, ResourceApi
from dra.devices import DraDevice
from dra.health import DeviceHealth
from dra.slices import (
    NO_TAINTS,
    DeviceTaint,
    Object,
    Owner,
    SlicePlan,
    TaintEffect,
    TypedCache,
    build_taints,
    plan_slices,
    tainted_devices,
)

log = logging.getLogger(__name__)
RESYNC_SECONDS = 60.0
WATCH_SECONDS = 300
BACKOFF_FIRST = 0.5
BACKOFF_MAX = 30.0
COALESCE_SECONDS = 0.2
"""A change is published once the devices have been still this long (a prepare and an
unprepare, a bind's burst of events), or COALESCE_MAX_SECONDS after it at the latest (a change of
the devices alone may wait longer: WRITE_SHARE). The first publication does not wait."""
COALESCE_MAX_SECONDS = 1.0
WRITE_SHARE = 0.1
"""The most of its time the publisher spends rewriting the pool for changes of the devices alone
(a claim's group companions leaving the pool or coming back, a device plugged in). A rewrite of
4,096 devices is 32 writes of 40 kB and 32 events to every watcher of slices; against an API
server that takes 1.5 s for them, prepares and unprepares in a row rewrote it every 2.5 s, and the
claim GETs of the prepares beside the writes waited for that server (a prepare's p99 was 330 ms
against a p50 of 13). Against one that takes 0.1 s it changes nothing: COALESCE_MAX_SECONDS
comes first."""
WRITE_WAIT_MAX_SECONDS = 10.0
"""WRITE_SHARE's wait is never longer: one write slowed by a hiccup of the API server (30 s)
must not keep a device gone or back from the scheduler for ten times as long."""
WRITERS = 4
"""Slices written at once: the API client's pool keeps more connections than this (the claim
GETs of prepares use the others)."""


class SlicePublisher:
    def __init__(
        self,
        api: ResourceApi,
        node: str,
        driver: str,
        devices: Sequence[DraDevice],
        *,
        taint_effect: TaintEffect = TaintEffect.NO_SCHEDULE,
        backoff_first: float = BACKOFF_FIRST,
        backoff_max: float = BACKOFF_MAX,
        slots: Sequence[Object] = (),
        coalesce_seconds: float = COALESCE_SECONDS,
    ) -> None:
        self._api = api
        self._node = node
        self._driver = driver
        self._devices = tuple(devices)
        self._slots = tuple(slots)
        """The iommufd slots' entries (dra.iommufd_slots), published after the devices."""
        self._taint_effect = taint_effect
        self._taints: Mapping[str, DeviceTaint] = NO_TAINTS
        self._dropped: Mapping[str, DeviceTaint] | None = None
        """Taints the API server threw away (its DRADeviceTaints gate is off): not sent again."""
        self._owner: Owner | None = None
        self._dirty = threading.Event()
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._ours: set[str] = set()
        """resourceVersions of our own writes, so the watch does not wake us for them."""
        self._backoff = (backoff_first, backoff_max)
        self._threads: list[threading.Thread] = []
        self._coalesce = coalesce_seconds
        self._changed_at = 0.0
        self._held: list[Object] | None = None
        """The slices as our last writes left them, or None: list them."""
        self._relist = threading.Event()
        """Someone else may have written the slices since: list them before planning."""
        self._seen: list[tuple[str, str, str]] = []
        """Watch events (kind, name, resourceVersion) not known to be ours when they came."""
        self._version = 0
        """Counts the changes `update` was given; `_written` is the one last published."""
        self._written = -1
        self._written_taints: Mapping[str, DeviceTaint] | None = None
        """The taints as last published: a change of them is published without WRITE_SHARE's
        wait."""
        self._write_after = 0.0
        """When a change of the devices alone may be written (see WRITE_SHARE)."""
        self._typed = TypedCache()
        """The devices' attributes as the last plan typed them (only the reconciling thread
        uses it)."""
        self._woken = threading.Condition(self._lock)
        """Notified when a change comes or the publisher stops, for a wait in `_settle`."""

    def start(self) -> None:
        self._dirty.set()
        for target, name in ((self._reconcile_loop, "dra-slices"), (self._watch_loop, "dra-watch")):
            thread = threading.Thread(target=target, name=name, daemon=True)
            thread.start()
            self._threads.append(thread)

    def stop(self) -> None:
        self._stop.set()
        self._dirty.set()
        with self._woken:
            self._woken.notify_all()
        for thread in self._threads:
            # The watch thread may sit in a long read; it is a daemon and ends with the process.
            thread.join(timeout=1.0)

    def update(
        self, devices: Sequence[DraDevice], health: Sequence[DeviceHealth] | None = None
    ) -> None:
        """The host's devices or their health changed: publish these, the unhealthy ones
        tainted. Without `health`, the devices keep the health last given."""
        taints = (
            self._taints
            if health is None
            else build_taints(self._driver, health, self._taint_effect)
        )
        with self._lock:
            if tuple(devices) == self._devices and taints == self._taints:
                return
            self._devices = tuple(devices)
            self._taints = taints
            self._changed_at = time.monotonic()
            self._version += 1
            self._woken.notify_all()
        self._dirty.set()

    def _reconcile_loop(self) -> None:
        delay = self._backoff[0]
        while not self._stop.is_set():
            if not self._dirty.wait(RESYNC_SECONDS):
                self._relist.set()
            if self._held is not None:
                self._settle()
            if self._stop.is_set():
                return
            self._dirty.clear()
            try:
                self._reconcile()
            # Any failure, not only the API's: this thread must outlive it.
            except Exception as error:
                self._relist.set()
                if not (isinstance(error, ApiError) and error.conflict):
                    if not isinstance(error, ApiError):
                        log.exception("publishing slices failed unexpectedly")
                    log.warning("publishing slices failed: %s; retrying in %.1f s", error, delay)
                    self._stop.wait(delay)
                    delay = min(delay * 2, self._backoff[1])
                self._dirty.set()
                continue
            delay = self._backoff[0]

    def _settle(self) -> None:
        """Wait until the devices have been still for the coalescing time (at most
        COALESCE_MAX_SECONDS from now), and for a change of the devices alone also until
        WRITE_SHARE allows the next write."""
        deadline = time.monotonic() + COALESCE_MAX_SECONDS
        with self._woken:
            while not self._stop.is_set():
                due = min(self._changed_at + self._coalesce, deadline)
                if self._taints == self._written_taints and not self._others_wrote():
                    due = max(due, self._write_after)
                now = time.monotonic()
                if now >= due:
                    return
                self._woken.wait(due - now)

    def _others_wrote(self) -> bool:
        """Whether a watch event not (yet) known as one of our writes came (hold the lock):
        our own come back too, often before their answers."""
        return any(kind == "DELETED" or rv not in self._ours for kind, _, rv in self._seen)

    def _reconcile(self) -> None:
        if self._owner is None:
            self._owner = Owner(self._node, self._api.read_node_uid(self._node))
        with self._lock:
            # One reading: a change coming in between must not count as published.
            devices, taints, version = self._devices, self._taints, self._version
            seen, self._seen = self._seen, []
        requested = taints
        if taints == self._dropped:
            # Sent, they would be dropped again and the pool rewritten on every reconcile; with
            # two instances publishing it, each would wake the other without end.
            taints = NO_TAINTS
        for kind, name, written in seen:
            if kind == "DELETED" or written not in self._ours:
                log.info("slice %s %s by someone else: publishing again", name, kind.lower())
                self._relist.set()
        if not self._relist.is_set() and self._held is not None and version == self._written:
            return  # woken by our own writes coming back
        if self._relist.is_set() or self._held is None:
            self._relist.clear()
            self._held = None
            self._held, _ = self._api.list_slices(self._node, self._driver)
        plan = plan_slices(
            self._held, self._owner, self._driver, devices, taints, self._slots, self._typed
        )
        self._typed.settle()
        if not plan.empty:
            started = time.monotonic()
            dropped = self._apply(plan)
            took = time.monotonic() - started
            self._write_after = started + min(took / WRITE_SHARE, WRITE_WAIT_MAX_SECONDS)
            if dropped:
                self._dropped = taints
                log.warning(
                    "the API server dropped the taints of %d unhealthy devices (its"
                    " DRADeviceTaints feature gate is off): the scheduler can still allocate"
                    " them, and only the kubelet's health stream reports them; enable the gate"
                    " to keep VMs off unhealthy devices",
                    len(taints),
                )
            log.info(
                "published %d devices (%d tainted %s) in %d slices, generation %d",
                len(devices),
                sum(d.name in taints for d in devices),
                self._taint_effect.value,
                len(plan.create) + len(plan.update) or 1,
                plan.generation,
            )
        self._written = version
        self._written_taints = requested

    def _apply(self, plan: SlicePlan) -> bool:
        """Write the plan, keeping what the server answered as the slices it holds; whether
        the server dropped taints it was sent."""
        self._held = None
        writes = [(self._api.create_slice, item) for item in plan.create]
        writes += [(self._api.replace_slice, item) for item in plan.update]

        def write(call: Callable[[Object], Object], item: Object) -> Object:
            # Noted at once: the watch may bring the write back before the others are done.
            answer = call(item)
            self._note(answer)
            return answer

        with ThreadPoolExecutor(min(WRITERS, len(writes) or 1), "dra-slice-write") as pool:
            written = list(pool.map(write, *zip(*writes, strict=True))) if writes else []
        for name, version in plan.delete:
            self._api.delete_slice(name, version)
        self._held = written
        return any(
            tainted_devices(item) - tainted_devices(answer)
            for (_, item), answer in zip(writes, written, strict=True)
        )

    def _note(self, written: dict[str, object]) -> None:
        metadata = written.get("metadata")
        if isinstance(metadata, dict):
            # Forgetting old versions costs at most one reconcile that finds nothing to do.
            if len(self._ours) > 1024:
                self._ours.clear()
            self._ours.add(str(metadata.get("resourceVersion")))

    def _watch_loop(self) -> None:
        delay = self._backoff[0]
        while not self._stop.is_set():
            try:
                _, version = self._api.list_slices(self._node, self._driver)
                for kind, item in self._api.watch_slices(
                    self._node, self._driver, version, WATCH_SECONDS
                ):
                    if self._stop.is_set():
                        return
                    delay = self._backoff[0]
                    if kind == "BOOKMARK":
                        continue
                    written = str((item.get("metadata") or {}).get("resourceVersion"))
                    if kind == "DELETED" or written not in self._ours:
                        # Maybe ours still: a write's event can come before its answer.
                        name = str((item.get("metadata") or {}).get("name"))
                        with self._lock:
                            self._seen.append((kind, name, written))
                            self._woken.notify_all()
                        self._dirty.set()
            # Any failure: the watch must come back whatever ended it.
            except Exception as error:
                if not isinstance(error, ApiError):
                    log.exception("slice watch failed unexpectedly")
                log.debug("slice watch ended: %s", error)
                self._stop.wait(delay)
                delay = min(delay * 2, self._backoff[1])
