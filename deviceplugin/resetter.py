"""The shell around deviceplugin.reset_policy: holds the reset state for the manager's thread,
runs resets in a worker thread and reports them back as events, and logs every step. Each reset
holds the node's binding lock (hostdev.binding.lock), so it never races a bind or unbind.

The manager hands this module every event of reset after use without knowing their kinds: it is
loaded only when a resource resets after use (the plugin registers without it)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from deviceplugin.inventory import DeviceTree
from deviceplugin.podresources_client import AssignmentsSeen, AssignmentsUnavailable
from deviceplugin.reset_policy import (
    Key,
    ResetState,
    ResetTiming,
    observe_allocation,
    observe_assignments,
    observe_reset,
    overlay_resets,
    tracked_devices,
    unhealthy_reasons,
)
from hostdev.bdf import Bdf
from hostdev.binding.lock import BindingLockBusy, hold_binding_lock
from hostdev.binding.reset import ResetOutcome, ResetStatus, reset_function
from hostdev.binding.sysfs_write import SysfsWriter
from hostdev.errors import HostdevError
from hostdev.model import HostInventory
from hostdev.scan import read_function

log = logging.getLogger(__name__)

LOCK_WAIT_SECONDS = 5.0
"""How long a reset waits for a bind or unbind to finish before it is retried at the next List
(the wait blocks the one reset worker, and the plugin's shutdown)."""


@dataclass(frozen=True, slots=True)
class DevicesAllocated:
    resource: str
    device_ids: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class ResetFinished:
    key: Key
    outcome: ResetOutcome
    at: float


UseEvent = AssignmentsSeen | AssignmentsUnavailable | DevicesAllocated | ResetFinished
"""What the manager passes back to `ResetCoordinator.fold`."""


class ResetCoordinator:
    def __init__(
        self,
        root: Path,
        writer: SysfsWriter,
        emit: Callable[[DevicesAllocated | ResetFinished], None],
        clock: Callable[[], float],
        timing: ResetTiming | None = None,
    ) -> None:
        self._root = root
        self._writer = writer
        self._emit = emit
        self._clock = clock
        self._timing = timing or ResetTiming()
        self._state = ResetState()
        self._unavailable: str | None = None
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="reset")

    def overlay(self, tree: DeviceTree) -> DeviceTree:
        return overlay_resets(tree, unhealthy_reasons(self._state))

    def note_allocated(self, resource: str, device_ids: tuple[str, ...]) -> None:
        """From a gRPC thread: post the Allocate, for `fold` on the manager's thread."""
        self._emit(DevicesAllocated(resource, device_ids))

    def fold(self, events: list[UseEvent], tree: DeviceTree, inventory: HostInventory) -> bool:
        """Fold in a batch of events: Allocates, finished resets, then the newest List (or,
        with none, the newest failure to get one); True when some device's health changed."""
        changed = False
        for event in events:
            if isinstance(event, DevicesAllocated):
                self.allocated(event)
        for event in events:
            if isinstance(event, ResetFinished):
                changed |= self.finished(event)
        lists = [e for e in events if isinstance(e, AssignmentsSeen)]
        failures = [e for e in events if isinstance(e, AssignmentsUnavailable)]
        seen = lists[-1] if lists else None  # the newest List says it all
        if failures and seen is None:
            self.unavailable(failures[-1].error)
        if seen is not None:
            changed |= self.assignments(seen, tree, inventory)
        return changed

    def allocated(self, event: DevicesAllocated) -> None:
        self._state = observe_allocation(
            self._state, event.resource, event.device_ids, self._clock()
        )

    def unavailable(self, error: str) -> None:
        if self._unavailable != error:
            log.warning(
                "cannot learn device assignments; devices are not reset until it works error=%r",
                error,
            )
        self._unavailable = error

    def assignments(
        self, seen: AssignmentsSeen, tree: DeviceTree, inventory: HostInventory
    ) -> bool:
        """Fold in a List; True when some device's health changed."""
        if self._unavailable is not None:
            log.info("pod resources API answers again")
            self._unavailable = None
        before = unhealthy_reasons(self._state)
        self._state, start = observe_assignments(
            self._state, tracked_devices(tree), seen.assigned, seen.at, self._timing
        )
        for key in start:
            log.info(
                "resetting device resource=%s device=%s why=%r",
                key[0],
                key[1],
                self._state.devices[key].message,
            )
            self._submit(key, inventory)
        return unhealthy_reasons(self._state) != before

    def finished(self, event: ResetFinished) -> bool:
        outcome = event.outcome
        resource, device = event.key
        if outcome.status is ResetStatus.RESET:
            log.info(
                "device reset resource=%s device=%s methods=%s",
                resource,
                device,
                " ".join(outcome.methods),
            )
        elif outcome.status is ResetStatus.NO_METHOD:
            log.warning(
                "device has no reset method; offering it again without a reset resource=%s"
                " device=%s",
                resource,
                device,
            )
        elif outcome.status is ResetStatus.BUSY:
            log.info(
                "device still in use; reset retried resource=%s device=%s why=%r",
                resource,
                device,
                outcome.message,
            )
        else:
            log.error(
                "device reset failed resource=%s device=%s error=%r",
                resource,
                device,
                outcome.message,
            )
        before = unhealthy_reasons(self._state)
        self._state = observe_reset(
            self._state, event.key, outcome.status.value, outcome.message, event.at
        )
        return unhealthy_reasons(self._state) != before

    def close(self) -> None:
        self._executor.shutdown(wait=True, cancel_futures=True)

    def _submit(self, key: Key, inventory: HostInventory) -> None:
        bdf = Bdf.parse(key[1])
        function = inventory.function(bdf)
        if function is None:
            gone = ResetOutcome(bdf, ResetStatus.FAILED, (), f"{bdf} is no longer on this host")
            self._emit(ResetFinished(key, gone, self._clock()))
            return

        def run() -> ResetOutcome:
            try:
                with hold_binding_lock(self._root, LOCK_WAIT_SECONDS, who=f"reset {bdf} after use"):
                    # Read again under the lock: a bind or unbind may have moved it since.
                    current = read_function(self._root, bdf)
                    if current is None:
                        return ResetOutcome(
                            bdf, ResetStatus.FAILED, (), f"{bdf} is no longer on this host"
                        )
                    group = inventory.group_of(current)
                    return reset_function(self._root, current, group, self._writer)
            except BindingLockBusy as busy:
                return ResetOutcome(bdf, ResetStatus.BUSY, (), f"{bdf} waits its turn: {busy}")
            except (HostdevError, OSError) as error:
                return ResetOutcome(bdf, ResetStatus.FAILED, (), f"resetting {bdf} failed: {error}")
            except Exception as error:
                # Anything else would be dropped by the executor with no ResetFinished, leaving
                # the device "resetting" for good; a failure is retried like any other.
                log.exception("resetting %s failed unexpectedly", bdf)
                return ResetOutcome(
                    bdf, ResetStatus.FAILED, (), f"resetting {bdf} failed: {error!r}"
                )

        def done(future: Future[ResetOutcome]) -> None:
            if not future.cancelled():
                self._emit(ResetFinished(key, future.result(), self._clock()))

        self._executor.submit(run).add_done_callback(done)
