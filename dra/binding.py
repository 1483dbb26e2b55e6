"""On-demand binding: a device on its host driver moves to VFIO when a VM's claim on it is
prepared, and goes back when the claim is released — with the same machinery, checks and lock
as `kubevirt-iommufd bind`/`unbind` (hostdev.binding.bind), never around them.

Every move is written down before the first sysfs write: a journal entry per claim under the
state directory names the functions the claim asked for and each function moved, with the driver
and override it had. The entry says `binding` until the bind is done and checked, `bound` while
the claim holds the devices, `releasing` from just before the first write of giving them back,
and is removed once they are back. A driver killed anywhere in a bind or a give-back, or a node
that rebooted, finds the entries at start-up and puts every function exactly where its entry
says (hostdev.binding.give_back), saying what it did. Each entry names the instance of the driver
(pod UID, pid) that wrote it, for the log: during a rolling update two instances share the
journal, and recovery runs only under their serialize lock (dra.serialize_lock), so it never
meets a bind the other, living instance is in the middle of.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Literal, NoReturn, cast, get_args

from hostdev.atomic_file import sync_directory, write_file_atomically
from hostdev.bdf import Bdf
from hostdev.binding.bind import HostAccess, Outcome, Status, bind_devices
from hostdev.binding.give_back import GiveBackRefused, Returned, check_free, give_back
from hostdev.binding.lock import BindingLock, BindingLockBusy, hold_binding_lock
from hostdev.binding.plan import AUTO, BindRequest, Move
from hostdev.binding.reset import ResetStatus, reset_function
from hostdev.binding.usage import FunctionState
from hostdev.errors import HostdevError
from hostdev.model import is_vfio_driver
from hostdev.scan import scan_host

log = logging.getLogger(__name__)
LOCK_WAIT_SECONDS = 20.0
"""How long a prepare waits for another binding run (an admin's `bind`, the init container):
with the bind itself it stays well inside the kubelet's 45 s."""
NODES_WAIT_SECONDS = 10.0
"""How long the device nodes of a freshly bound device may take to appear (udev makes them)."""
Phase = Literal["binding", "bound", "releasing"]
_WHY = {
    "binding": "a bind was interrupted",
    "bound": "its claim is no longer prepared",
    "releasing": "giving them back was interrupted",
}
_SETTLED_NS = 1_000_000_000
"""How long ago the journal directory must have last changed for its listing to be kept on its
stamp: file systems stamp a change with a clock that moves in ticks (milliseconds apart), so a
change in the same tick as the listing could leave the stamp as it was."""


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
class Writer:
    """The instance of the driver that wrote a journal entry."""

    pid: int
    instance: str
    """Its pod's UID; empty for a driver run as the node's only instance."""

    def __str__(self) -> str:
        return f"pid {self.pid} of instance {self.instance}" if self.instance else f"pid {self.pid}"


@dataclass(frozen=True, slots=True)
class JournalEntry:
    claim_uid: str
    phase: Phase
    moved: tuple[Moved, ...]
    reset_after_use: bool
    requested: tuple[Bdf, ...] | None = None
    """The functions the claim asked for; None in entries written before it was recorded."""
    writer: Writer | None = None
    """None in entries written before it was recorded."""

    def to_json(self) -> dict[str, Any]:
        data: dict[str, Any] = {
            "claimUID": self.claim_uid,
            "phase": self.phase,
            "resetAfterUse": self.reset_after_use,
            "moved": [
                {"bdf": str(m.bdf), "driver": m.driver, "override": m.override} for m in self.moved
            ],
        }
        if self.requested is not None:
            data["requested"] = [str(b) for b in self.requested]
        if self.writer is not None:
            data["writtenBy"] = {"pid": self.writer.pid, "instance": self.writer.instance}
        return data

    @classmethod
    def from_json(cls, data: object) -> JournalEntry:
        """The entry `to_json` wrote; any other JSON value raises ValueError naming the field,
        so an entry someone mangled is reported, never a traceback at start."""
        if not isinstance(data, dict):
            raise ValueError(f"the entry: expected an object, found {type(data).__name__}")
        phase = data.get("phase")
        if phase not in get_args(Phase):
            raise ValueError(f"phase: expected one of {', '.join(get_args(Phase))}")
        claim_uid = data.get("claimUID")
        if not isinstance(claim_uid, str):
            raise ValueError("claimUID: expected a string")
        moved = data.get("moved")
        if not isinstance(moved, list):
            raise ValueError("moved: expected an array")
        reset_after_use = data.get("resetAfterUse", False)
        if not isinstance(reset_after_use, bool):
            raise ValueError("resetAfterUse: expected true or false")
        requested = data.get("requested")
        if requested is not None and not (
            isinstance(requested, list) and all(isinstance(b, str) for b in requested)
        ):
            raise ValueError("requested: expected an array of PCI addresses")
        return cls(
            claim_uid=claim_uid,
            phase=cast(Phase, phase),
            moved=tuple(_moved_from_json(item, index) for index, item in enumerate(moved)),
            reset_after_use=reset_after_use,
            requested=None if requested is None else tuple(Bdf.parse(b) for b in requested),
            writer=_writer_from_json(data.get("writtenBy")),
        )

    def asks_for(self, bdfs: Iterable[Bdf]) -> bool:
        """Whether this entry is for the same functions (a retry, or a bind after a reboot)."""
        wanted = set(bdfs)
        if self.requested is None:
            return wanted <= {m.bdf for m in self.moved}
        return wanted == set(self.requested)


class OnDemandBinder:
    def __init__(
        self,
        access: HostAccess,
        journal_dir: Path,
        *,
        lock_wait: float = LOCK_WAIT_SECONDS,
        nodes_wait: float = NODES_WAIT_SECONDS,
        instance: str = "",
    ) -> None:
        self._access = access
        self._writer = Writer(os.getpid(), instance)
        self._dir = journal_dir
        self._lock_wait = lock_wait
        self._nodes_wait = nodes_wait
        self._listed: tuple[tuple[int, int, int], tuple[Path, ...]] | None = None
        """The journal directory's stamp (inode, mtime, ctime) and its entries' files as listed
        then, kept while the directory is unchanged (`_journal_files`)."""

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
        if earlier is not None:
            _check_earlier(earlier, claim_uid, bdfs)
        requests = [BindRequest(b, AUTO) for b in bdfs]
        with self._lock(f"DRA bind {named} for claim {claim_uid}") as lock:
            planned = bind_devices(self._access, requests, dry_run=True)
            if planned.status is Status.REFUSED:
                raise BindingError(_refused(planned))
            entry = JournalEntry(
                claim_uid,
                "binding",
                _merged(earlier, planned.plan.moves),
                reset_after_use,
                tuple(bdfs),
                self._writer,
            )
            # Durable before the first write: a crash from here on is undone at start-up.
            self._record(entry)
            try:
                outcome = bind_devices(self._access, requests, lock=lock)
                failure = _failure(outcome)
                if failure is None and not self._wait_for(nodes_ready):
                    failure = (
                        f"{named} bound to VFIO but its device nodes did not appear within"
                        f" {self._nodes_wait:.0f} s (is udev running on the node?)"
                    )
            except (HostdevError, OSError) as error:
                failure = f"binding failed: {error}"
            if failure is not None:
                self._undo(entry, failure)
            # The plan under the lock is the truth: it may have found less to move.
            entry = replace(entry, phase="bound", moved=_merged(earlier, outcome.plan.moves))
            self._record(entry)
        log.info(
            "bound %s to VFIO for claim %s (%d functions moved)", named, claim_uid, len(entry.moved)
        )
        return entry.moved

    # Unprepare -------------------------------------------------------------------------------
    def release(self, claim_uid: str) -> None:
        """Give a claim's functions back to the drivers and overrides they had; nothing when it
        moved none."""
        entry = self._read(claim_uid)
        if entry is None:
            return
        with self._lock(f"DRA release for claim {claim_uid}"):
            returned = self._give_back(entry, reset=entry.reset_after_use)
        if not all(r.ok for r in returned):
            raise BindingError(
                f"giving back failed: {_said(returned)}; the kubelet retries"
                " (kubevirt-iommufd inspect shows where they are)"
            )
        self._forget(claim_uid)
        log.info("gave back claim %s's functions: %s", claim_uid, _said(returned))

    def holds(self, claim_uid: str) -> bool:
        return self._read(claim_uid) is not None

    def journaled(self, phase: Phase | None = None) -> dict[Bdf, str]:
        """Every function a journal entry names (moved or asked for), with the UID of the claim
        it is on VFIO, or on its way there or back, for. A claim whose give-back failed is no
        longer prepared but still has its entry: its functions sit on VFIO, and no other claim
        may be handed them, or the next start would take them back from under it. Unreadable
        entries are left to `recover`, which names them. `phase` keeps only entries in it."""
        found: dict[Bdf, str] = {}
        for _, entry in self._entries():
            if isinstance(entry, JournalEntry) and phase in (None, entry.phase):
                for bdf in (*(m.bdf for m in entry.moved), *(entry.requested or ())):
                    found.setdefault(bdf, entry.claim_uid)
        return found

    # Start-up --------------------------------------------------------------------------------
    def recover(self, prepared: Iterable[str], *, others_only: bool = False) -> list[str]:
        """Put back what a bind or give-back interrupted, or what a claim no longer prepared
        still holds; keep what prepared claims hold. Returns what was done, one line each.

        With `others_only`, only entries another instance of the driver wrote (one killed
        during a rolling update): the caller holds the serialize lock, under which alone a
        living instance binds and gives back, so an entry of another's found unfinished is a
        dead run's. Entries that name no writer (written by a driver from before this was
        recorded, which took no serialize lock) and our own are left to the next start."""
        keep = set(prepared)
        done: list[str] = []
        for path, entry in self._entries():
            if not isinstance(entry, JournalEntry):
                if not others_only:
                    done.append(f"unreadable binding journal {path}: {entry}; left for a person")
                continue
            if entry.phase == "bound" and entry.claim_uid in keep:
                continue
            if others_only and (entry.writer is None or entry.writer == self._writer):
                continue
            why = _WHY[entry.phase]
            if entry.writer is not None:
                why += f", by {entry.writer}"
            try:
                with self._lock(f"DRA recovery for claim {entry.claim_uid}"):
                    # A VM used them, unless the bind never finished.
                    returned = self._give_back(
                        entry, reset=entry.reset_after_use and entry.phase != "binding"
                    )
            except (BindingError, HostdevError, OSError) as error:
                done.append(
                    f"could not put back claim {entry.claim_uid}'s functions ({why}): {error};"
                    f" {path} is kept and the next start tries again"
                )
                continue
            if all(r.ok for r in returned):
                self._forget(entry.claim_uid)
                done.append(
                    f"put back claim {entry.claim_uid}'s functions ({why}): {_said(returned)}"
                )
            else:
                done.append(
                    f"could not put back all of claim {entry.claim_uid}'s functions ({why}):"
                    f" {_said(returned)}; {path} is kept and the next start tries again"
                    " (kubevirt-iommufd inspect shows where they are)"
                )
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

    def _undo(self, entry: JournalEntry, failure: str) -> NoReturn:
        """Put back what a failed bind moved, to where the journal says, and raise."""
        try:
            returned = self._give_back(entry, reset=False)
        except (BindingError, HostdevError, OSError) as error:
            raise BindingError(
                f"{failure}; putting {_names(entry.moved)} back failed too: {error}; the driver"
                " tries again at its next start (kubevirt-iommufd inspect shows where they are)"
            ) from error
        if not all(r.ok for r in returned):
            # The journal keeps saying `binding`: the next start tries again to put it back.
            raise BindingError(
                f"{failure}; putting it back failed too: {_said(returned)}; the host needs a"
                " person (kubevirt-iommufd inspect); the driver tries again at its next start"
            )
        self._forget(entry.claim_uid)
        raise BindingError(f"{failure}; undone: {_names(entry.moved)} put back")

    def _give_back(self, entry: JournalEntry, *, reset: bool) -> tuple[Returned, ...]:
        """Every function of the entry back where it was. Nothing is written while one is still
        open; then `releasing` is journalled before the first write, so a give-back killed
        midway is finished at the next start even if its claim is still prepared."""
        wanted = {m.bdf: FunctionState(m.driver, m.override) for m in reversed(entry.moved)}
        try:
            check_free(self._access, wanted)
            if entry.phase == "bound":
                self._record(replace(entry, phase="releasing", writer=self._writer))
            if reset:
                self._reset(entry.moved)
            return give_back(self._access, wanted)
        except GiveBackRefused as error:
            raise BindingError(str(error)) from error

    def _reset(self, moved: Sequence[Moved]) -> None:
        """Reset what is still on VFIO: a function already back on its host driver is in use."""
        inventory = scan_host(self._access.root)
        for item in moved:
            function = inventory.function(item.bdf)
            if function is None or not is_vfio_driver(function.driver):
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

    def _entries(self) -> Iterator[tuple[Path, JournalEntry | Exception]]:
        """Every entry of the journal, or why it cannot be read."""
        for path in self._journal_files():
            try:
                entry: JournalEntry | Exception = _read_entry(path)
            except (OSError, ValueError, RecursionError) as error:
                entry = error
            yield path, entry

    def _journal_files(self) -> tuple[Path, ...]:
        """The entries' files, in order, without the temporary files of writes under way
        (dotted); none when the directory cannot be listed. Looked at by every prepare (up to
        three times) and unprepare, and mostly empty: listed again only when its stamp changed
        or it changed too recently for the stamp to tell (_SETTLED_NS)."""
        now = time.time_ns()
        try:
            info = self._dir.stat()
            stamp = (info.st_ino, info.st_mtime_ns, info.st_ctime_ns)
            if self._listed is not None and self._listed[0] == stamp:
                return self._listed[1]
            names = os.listdir(self._dir)  # noqa: PTH208 - names only; iterdir makes a Path each
        except OSError:
            self._listed = None
            return ()
        files = tuple(self._dir / n for n in sorted(names) if n.endswith(".json") and n[0] != ".")
        settled = now - info.st_mtime_ns >= _SETTLED_NS
        self._listed = (stamp, files) if settled else None
        return files

    def _path(self, claim_uid: str) -> Path:
        return self._dir / f"{claim_uid}.json"

    def _record(self, entry: JournalEntry) -> None:
        data = json.dumps(entry.to_json(), indent=1).encode()
        write_file_atomically(self._path(entry.claim_uid), data, 0o600, directory_mode=0o700)

    def _read(self, claim_uid: str) -> JournalEntry | None:
        try:
            return _read_entry(self._path(claim_uid))
        except FileNotFoundError:
            return None
        except (OSError, ValueError, RecursionError) as error:
            raise BindingError(
                f"binding journal {self._path(claim_uid)} is unreadable: {error}; check the"
                " device's driver with kubevirt-iommufd inspect, then remove the file"
            ) from error

    def _forget(self, claim_uid: str) -> None:
        self._path(claim_uid).unlink(missing_ok=True)
        if self._dir.is_dir():
            sync_directory(self._dir)


def _read_entry(path: Path) -> JournalEntry:
    return JournalEntry.from_json(json.loads(path.read_text()))


def _writer_from_json(value: object) -> Writer | None:
    if value is None:
        return None
    if not isinstance(value, dict):
        raise ValueError("writtenBy: expected an object")
    pid, instance = value.get("pid"), value.get("instance")
    if not isinstance(pid, int) or isinstance(pid, bool) or not isinstance(instance, str):
        raise ValueError("writtenBy: expected a pid and an instance")
    return Writer(pid, instance)


def _moved_from_json(item: object, index: int) -> Moved:
    if not isinstance(item, dict) or not isinstance(item.get("bdf"), str):
        raise ValueError(f"moved[{index}]: expected an object with a PCI address as bdf")
    driver, override = item.get("driver"), item.get("override")
    for name, value in (("driver", driver), ("override", override)):
        if value is not None and not isinstance(value, str):
            raise ValueError(f"moved[{index}].{name}: expected a string or null")
    return Moved(Bdf.parse(item["bdf"]), driver, override)


def _check_earlier(earlier: JournalEntry, claim_uid: str, bdfs: Sequence[Bdf]) -> None:
    """Refuse a bind that would overwrite the only record of where functions were."""
    if earlier.phase == "binding":
        by = f" by {earlier.writer}" if earlier.writer is not None else ""
        raise BindingError(
            f"an earlier bind for this claim{by} failed and could not be undone"
            f" ({_names(earlier.moved)}); the host needs a person (kubevirt-iommufd"
            " inspect); the driver puts them back at its next start"
        )
    if not earlier.asks_for(bdfs):
        held = ", ".join(str(b) for b in earlier.requested or (m.bdf for m in earlier.moved))
        raise BindingError(
            f"claim {claim_uid} already has {held} bound to VFIO and now asks for"
            f" {', '.join(map(str, bdfs))}; a claim's allocation never changes, so this is"
            " refused and the first binding kept (delete and recreate the claim)"
        )


def _merged(earlier: JournalEntry | None, moves: Iterable[Move]) -> tuple[Moved, ...]:
    """The functions moved for a claim with where they were before it: an earlier bind's
    record of a function (a bind again after a reboot, or over an interrupted give-back) is
    the one from before the claim."""
    kept = earlier.moved if earlier is not None else ()
    known = {m.bdf for m in kept}
    return (
        *kept,
        *(Moved(m.bdf, m.from_driver, m.from_override) for m in moves if m.bdf not in known),
    )


def _failure(outcome: Outcome) -> str | None:
    if outcome.status in (Status.DONE, Status.NOTHING_TO_DO):
        return None
    if outcome.status is Status.REFUSED:
        return _refused(outcome)
    return f"binding failed: {outcome.error}"


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


def _said(returned: Iterable[Returned]) -> str:
    return "; ".join(map(str, returned))
