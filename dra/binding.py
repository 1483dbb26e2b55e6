"""On-demand binding: a device on its host driver moves to VFIO when a VM's claim on it is
prepared, and goes back when the claim is released — with the same machinery, checks and lock
as `kubevirt-iommufd bind`/`unbind` (hostdev.binding.bind), never around them.

Every move is written down before the first sysfs write: a journal entry per claim under the
state directory names each function of the move and the driver and override it had. The entry
says `binding` until the bind is done and checked, `bound` while the claim holds the devices, and
is removed once they are back. A driver killed mid-bind, or a node that rebooted, finds the
entries at start-up and puts the host back in a known state (`recover`), saying what it did.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hostdev.atomic_file import sync_directory, write_file_atomically
from hostdev.bdf import Bdf
from hostdev.binding.bind import HostAccess, Outcome, Status, bind_devices, unbind_devices
from hostdev.binding.lock import BindingLock, BindingLockBusy, hold_binding_lock
from hostdev.binding.plan import AUTO, BindRequest
from hostdev.binding.reset import ResetStatus, reset_function
from hostdev.errors import HostdevError
from hostdev.model import is_vfio_driver
from hostdev.scan import scan_host

log = logging.getLogger(__name__)
LOCK_WAIT_SECONDS = 20.0
"""How long a prepare waits for another binding run (an admin's `bind`, the init container):
with the bind itself it stays well inside the kubelet's 45 s."""
NODES_WAIT_SECONDS = 10.0
"""How long the device nodes of a freshly bound device may take to appear (udev makes them)."""


class BindingError(Exception):
    """Binding or unbinding for a claim failed; the message names the device, why and the fix.
    Whatever was moved has been put back unless the message says otherwise."""


@dataclass(frozen=True, slots=True)
class Moved:
    """A function a claim's bind moved, and where it was before."""

    bdf: Bdf
    driver: str | None
    override: str | None


@dataclass(frozen=True, slots=True)
class JournalEntry:
    claim_uid: str
    phase: str
    """`binding` (writes may be under way) or `bound`."""
    moved: tuple[Moved, ...]
    reset_after_use: bool

    def to_json(self) -> dict[str, Any]:
        return {
            "claimUID": self.claim_uid,
            "phase": self.phase,
            "resetAfterUse": self.reset_after_use,
            "moved": [
                {"bdf": str(m.bdf), "driver": m.driver, "override": m.override} for m in self.moved
            ],
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> JournalEntry:
        return cls(
            claim_uid=str(data["claimUID"]),
            phase=str(data["phase"]),
            moved=tuple(
                Moved(Bdf.parse(str(m["bdf"])), m.get("driver"), m.get("override"))
                for m in data["moved"]
            ),
            reset_after_use=bool(data.get("resetAfterUse", False)),
        )


class OnDemandBinder:
    def __init__(
        self,
        access: HostAccess,
        journal_dir: Path,
        *,
        lock_wait: float = LOCK_WAIT_SECONDS,
        nodes_wait: float = NODES_WAIT_SECONDS,
    ) -> None:
        self._access = access
        self._dir = journal_dir
        self._lock_wait = lock_wait
        self._nodes_wait = nodes_wait

    # Prepare ---------------------------------------------------------------------------------
    def bind(
        self,
        claim_uid: str,
        bdfs: Sequence[Bdf],
        reset_after_use: bool,
        nodes_ready: Callable[[], bool],
    ) -> tuple[Moved, ...]:
        """Bind `bdfs` (with their groups and companions) to their VFIO drivers for a claim and
        wait until `nodes_ready()`; on any failure put everything back and raise."""
        named = ", ".join(str(b) for b in bdfs)
        earlier = self._read(claim_uid)
        if earlier is not None and earlier.phase == "binding":
            # Its record of the drivers the functions had is the only one: never overwrite it.
            raise BindingError(
                f"an earlier bind for this claim failed and could not be undone"
                f" ({_names(earlier.moved)}); the host needs a person (kubevirt-iommufd"
                " inspect); the driver puts them back at its next start"
            )
        with self._lock(f"DRA bind {named} for claim {claim_uid}") as lock:
            planned = bind_devices(self._access, [BindRequest(b, AUTO) for b in bdfs], dry_run=True)
            if planned.status is Status.REFUSED:
                raise BindingError(_refused(planned))
            moved = tuple(Moved(m.bdf, m.from_driver, m.from_override) for m in planned.plan.moves)
            # Durable before the first write: a crash from here on is undone at start-up.
            self._record(JournalEntry(claim_uid, "binding", moved, reset_after_use))
            outcome = bind_devices(self._access, [BindRequest(b, AUTO) for b in bdfs], lock=lock)
            if outcome.status not in (Status.DONE, Status.NOTHING_TO_DO):
                self._after_failed_bind(claim_uid, outcome, moved, lock)
            # The plan under the lock is the truth: it may have found less to move.
            moved = tuple(Moved(m.bdf, m.from_driver, m.from_override) for m in outcome.plan.moves)
            if not self._wait_for(nodes_ready):
                self._give_back(moved, lock, reset=False)
                self._forget(claim_uid)
                raise BindingError(
                    f"{named} bound to VFIO but its device nodes did not appear within"
                    f" {self._nodes_wait:.0f} s (is udev running on the node?); put back"
                )
            self._record(JournalEntry(claim_uid, "bound", moved, reset_after_use))
        log.info("bound %s to VFIO for claim %s (%d functions moved)", named, claim_uid, len(moved))
        return moved

    # Unprepare -------------------------------------------------------------------------------
    def release(self, claim_uid: str) -> None:
        """Give a claim's functions back to the drivers they had; nothing when it moved none."""
        entry = self._read(claim_uid)
        if entry is None:
            return
        with self._lock(f"DRA release for claim {claim_uid}") as lock:
            self._give_back(entry.moved, lock, reset=entry.reset_after_use)
        self._forget(claim_uid)
        log.info("gave back %s after claim %s", _names(entry.moved), claim_uid)

    def holds(self, claim_uid: str) -> bool:
        return self._read(claim_uid) is not None

    # Start-up --------------------------------------------------------------------------------
    def recover(self, prepared: Iterable[str]) -> list[str]:
        """Put back what a bind interrupted, or what a claim no longer prepared still holds;
        keep what prepared claims hold. Returns what was done, one line each."""
        keep = set(prepared)
        done: list[str] = []
        for path in sorted(self._dir.glob("*.json")) if self._dir.is_dir() else ():
            try:
                entry = JournalEntry.from_json(json.loads(path.read_text()))
            except (OSError, ValueError, KeyError, TypeError) as error:
                done.append(f"unreadable binding journal {path}: {error}; left for a person")
                continue
            if entry.phase == "bound" and entry.claim_uid in keep:
                continue
            why = (
                "a bind was interrupted"
                if entry.phase == "binding"
                else "its claim is no longer prepared"
            )
            try:
                with self._lock(f"DRA recovery for claim {entry.claim_uid}") as lock:
                    self._give_back(entry.moved, lock, reset=False)
                self._forget(entry.claim_uid)
                done.append(f"put {_names(entry.moved)} back for claim {entry.claim_uid}: {why}")
            except (BindingError, HostdevError) as error:
                done.append(f"could not put back claim {entry.claim_uid}'s devices: {error}")
        return done

    # Parts -----------------------------------------------------------------------------------
    @contextmanager
    def _lock(self, who: str) -> Iterator[BindingLock]:
        with ExitStack() as stack:
            try:
                lock = stack.enter_context(
                    hold_binding_lock(self._access.root, self._lock_wait, who=who)
                )
            except BindingLockBusy as error:
                raise BindingError(f"{error}; the kubelet retries") from error
            yield lock

    def _after_failed_bind(
        self, claim_uid: str, outcome: Outcome, moved: tuple[Moved, ...], lock: BindingLock
    ) -> None:
        if outcome.status is Status.REFUSED:
            self._forget(claim_uid)
            raise BindingError(_refused(outcome))
        if outcome.status is Status.FAILED_RESTORED:
            self._forget(claim_uid)
            raise BindingError(f"binding failed and was undone: {outcome.error}")
        # The journal keeps saying `binding`: the next start tries again to put it back.
        raise BindingError(
            f"binding failed and putting {_names(moved)} back failed too: {outcome.error};"
            " the host needs a person (kubevirt-iommufd inspect)"
        )

    def _give_back(self, moved: Sequence[Moved], lock: BindingLock, *, reset: bool) -> None:
        if reset:
            self._reset(moved)
        inventory = scan_host(self._access.root)
        to_none = [m.bdf for m in moved if m.driver is None or is_vfio_driver(m.driver)]
        to_native = [m.bdf for m in moved if m.bdf not in to_none]
        for bdfs, reprobe in ((to_none, False), (to_native, True)):
            wanted = [
                b
                for b in bdfs
                if (f := inventory.function(b)) is not None and is_vfio_driver(f.driver)
            ]
            if not wanted:
                continue
            outcome = unbind_devices(self._access, wanted, reprobe=reprobe, lock=lock)
            if outcome.status not in (Status.DONE, Status.NOTHING_TO_DO):
                raise BindingError(
                    f"giving back {', '.join(map(str, wanted))} failed:"
                    f" {_refused(outcome) if outcome.status is Status.REFUSED else outcome.error}"
                )
        after = scan_host(self._access.root)
        for item in moved:
            function = after.function(item.bdf)
            now = function.driver if function else None
            if item.driver is not None and not is_vfio_driver(item.driver) and now != item.driver:
                log.warning(
                    "%s went back to %s, not to %s, which it had before the claim",
                    item.bdf,
                    now or "no driver",
                    item.driver,
                )

    def _reset(self, moved: Sequence[Moved]) -> None:
        inventory = scan_host(self._access.root)
        for item in moved:
            function = inventory.function(item.bdf)
            if function is None:
                continue
            result = reset_function(
                self._access.root, function, inventory.group_of(function), self._access.writer
            )
            level = logging.INFO if result.status is ResetStatus.RESET else logging.WARNING
            log.log(level, "reset after use: %s", result.message)

    def _wait_for(self, ready: Callable[[], bool]) -> bool:
        deadline = self._access.clock() + self._nodes_wait
        while not ready():
            if self._access.clock() >= deadline:
                return False
            self._access.sleep(0.05)
        return True

    def _path(self, claim_uid: str) -> Path:
        return self._dir / f"{claim_uid}.json"

    def _record(self, entry: JournalEntry) -> None:
        data = json.dumps(entry.to_json(), indent=1).encode()
        write_file_atomically(self._path(entry.claim_uid), data, 0o600)

    def _read(self, claim_uid: str) -> JournalEntry | None:
        try:
            return JournalEntry.from_json(json.loads(self._path(claim_uid).read_text()))
        except FileNotFoundError:
            return None
        except (OSError, ValueError, KeyError, TypeError) as error:
            raise BindingError(
                f"binding journal {self._path(claim_uid)} is unreadable: {error}; check the"
                " device's driver with kubevirt-iommufd inspect, then remove the file"
            ) from error

    def _forget(self, claim_uid: str) -> None:
        self._path(claim_uid).unlink(missing_ok=True)
        if self._dir.is_dir():
            sync_directory(self._dir)


def _refused(outcome: Outcome) -> str:
    """The planner's refusals, with its advice for a person at a shell (`--wait`) turned into
    what holds for a claim: the kubelet asks again."""
    parts = []
    for refusal in outcome.plan.refusals:
        subject = f"{refusal.bdf}: " if refusal.bdf is not None else ""
        fix = (
            "stop those processes (or the VM); the kubelet retries"
            if refusal.holders
            else refusal.fix
        )
        parts.append(f"{subject}{refusal.reason}; {fix}")
    return "; ".join(parts) or "refused"


def _names(moved: Iterable[Moved]) -> str:
    return ", ".join(f"{m.bdf} (to {m.driver or 'no driver'})" for m in moved)
