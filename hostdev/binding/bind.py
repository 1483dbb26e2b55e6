"""Carrying out a bind or unbind plan: under the node's binding lock (hostdev.binding.lock), read
the host, plan (hostdev.binding.plan), load modules, write sysfs through a `SysfsWriter`, check each
step took, and on any failure put every function touched back on its previous driver and
override.

Everything that touches the host goes through `HostAccess`, so tests run the same code against a
fixture tree whose writer moves symlinks the way the kernel would.
"""

from __future__ import annotations

import errno
import os
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path

from hostdev.bdf import Bdf
from hostdev.binding.driver_match import find_driver_dir, read_vfio_aliases, same_driver
from hostdev.binding.holders import Holder
from hostdev.binding.lock import BindingLock, BindingLockBusy, LockHolder, hold_binding_lock
from hostdev.binding.plan import (
    BindPlan,
    BindRequest,
    Move,
    Refusal,
    Write,
    WriteKind,
    group_closure,
    plan_bind,
    plan_return,
    plan_unbind,
    plan_writes,
    with_registered_names,
)
from hostdev.binding.sysfs_write import KernelSysfs, SysfsWriter
from hostdev.binding.usage import FunctionState, read_override, read_usage
from hostdev.model import HostInventory
from hostdev.scan import scan_host

Runner = Callable[[Sequence[str]], subprocess.CompletedProcess[str]]
_POLL_SECONDS = 1.0


def run_command(argv: Sequence[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(list(argv), capture_output=True, text=True, check=False, timeout=120)


@dataclass(frozen=True, slots=True)
class HostAccess:
    """Where the host is and how to change it."""

    root: Path = Path("/")
    """Holds sys/, dev/ and proc/."""
    host_root: Path = Path("/")
    """Holds the host's /lib/modules and modprobe (the host's / mounted into a container)."""
    writer: SysfsWriter = field(default_factory=KernelSysfs)
    runner: Runner = run_command
    sleep: Callable[[float], None] = time.sleep
    clock: Callable[[], float] = time.monotonic


class Status(Enum):
    DONE = "done"
    NOTHING_TO_DO = "nothing-to-do"
    DRY_RUN = "dry-run"
    REFUSED = "refused"
    """Nothing was changed."""
    FAILED_RESTORED = "failed-restored"
    """A step failed; every function touched is back as it was."""
    FAILED_NOT_RESTORED = "failed-not-restored"
    """A step failed and putting something back failed too: the host needs a person."""


@dataclass(frozen=True, slots=True)
class Restored:
    bdf: Bdf
    driver: str | None
    override: str | None
    ok: bool
    problems: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class Outcome:
    action: str
    status: Status
    plan: BindPlan
    writes: tuple[Write, ...] = ()
    """Performed, or for a dry run the ones that would be."""
    drivers: Mapping[Bdf, str | None] = field(default_factory=dict)
    """Driver of each moved function at the end."""
    modules: tuple[str, ...] = ()
    """Loaded, or for a dry run the ones that would be."""
    error: str | None = None
    restored: tuple[Restored, ...] = ()
    waited_seconds: float = 0.0


Requests = Sequence[BindRequest] | Callable[[HostInventory], Sequence[BindRequest]]
"""The functions to bind, or how to pick them from the host as read under the binding lock (a
selector, a reservations file)."""
LockWaitReport = Callable[[LockHolder | None], None]


def bind_devices(
    access: HostAccess,
    requests: Requests,
    *,
    wait_seconds: float = 0.0,
    dry_run: bool = False,
    lock: BindingLock | None = None,
    on_lock_wait: LockWaitReport | None = None,
) -> Outcome:
    """Move the requested functions, their groups and companions to VFIO drivers.

    Holds the node's binding lock (hostdev.binding.lock) from reading the host to checking the
    last write; `lock` is one the caller already holds (and keeps holding while busy devices
    are waited for), otherwise it is taken here, within the same `wait_seconds` as busy devices,
    and released between polls. A dry run changes nothing and takes no lock.
    """

    def plan(current: HostInventory) -> BindPlan:
        wanted = requests(current) if callable(requests) else requests
        release = current.capabilities.kernel_release or os.uname().release
        aliases = read_vfio_aliases(access.host_root, release)
        closure = group_closure(current, (r.bdf for r in wanted))
        usage = read_usage(access.root, current, closure)
        return plan_bind(current, wanted, aliases, usage, _registered(access.root))

    named = "" if callable(requests) else " ".join(str(r.bdf) for r in requests)
    return _run(access, "bind", named, plan, wait_seconds, dry_run, lock, on_lock_wait)


def unbind_devices(
    access: HostAccess,
    bdfs: Sequence[Bdf],
    *,
    to_driver: str | None = None,
    reprobe: bool = False,
    wait_seconds: float = 0.0,
    dry_run: bool = False,
    lock: BindingLock | None = None,
    on_lock_wait: LockWaitReport | None = None,
) -> Outcome:
    """Take functions and their consumers off VFIO drivers; locking as `bind_devices`."""

    def plan(current: HostInventory) -> BindPlan:
        scope = list(bdfs)
        for bdf in bdfs:
            function = current.function(bdf)
            scope += function.consumers if function else ()
        usage = read_usage(access.root, current, scope)
        return plan_unbind(
            current, bdfs, usage, _registered(access.root), to_driver=to_driver, reprobe=reprobe
        )

    named = " ".join(str(b) for b in bdfs)
    return _run(access, "unbind", named, plan, wait_seconds, dry_run, lock, on_lock_wait)


def _run(
    access: HostAccess,
    action: str,
    named: str,
    make_plan: Callable[[HostInventory], BindPlan],
    wait_seconds: float,
    dry_run: bool,
    lock: BindingLock | None,
    on_lock_wait: LockWaitReport | None,
) -> Outcome:
    start = access.clock()
    while True:
        held: AbstractContextManager[BindingLock | None]
        if dry_run or lock is not None:
            held = nullcontext(lock)
        else:
            held = hold_binding_lock(
                access.root,
                max(0.0, wait_seconds - (access.clock() - start)),
                who=f"{action} {named}".strip(),
                on_wait=on_lock_wait,
                clock=access.clock,
                sleep=access.sleep,
            )
        try:
            with held as taken:
                # The plan comes from the host as read now, under the lock: what another run
                # changed while this one waited is seen.
                waited = min(access.clock() - start, wait_seconds)
                outcome = _attempt(access, action, make_plan, taken, dry_run, waited)
        except BindingLockBusy as busy:
            return _lock_refusal(action, busy, min(access.clock() - start, wait_seconds))
        waited = access.clock() - start
        clears_by_itself = outcome.status is Status.REFUSED and outcome.plan.only_busy
        if not clears_by_itself or dry_run or waited >= wait_seconds:
            return outcome
        access.sleep(min(_POLL_SECONDS, wait_seconds - waited))


def _attempt(
    access: HostAccess,
    action: str,
    make_plan: Callable[[HostInventory], BindPlan],
    lock: BindingLock | None,
    dry_run: bool,
    waited: float,
) -> Outcome:
    plan = make_plan(scan_host(access.root))
    if plan.refused:
        return Outcome(action, Status.REFUSED, plan, waited_seconds=waited)
    if not plan.moves:
        return Outcome(action, Status.NOTHING_TO_DO, plan, waited_seconds=waited)
    if dry_run:
        writes = tuple(w for m in plan.moves for w in plan_writes(m))
        return Outcome(action, Status.DRY_RUN, plan, writes, modules=plan.modules)
    if lock is not None:
        lock.note(f"{action} {' '.join(str(m.bdf) for m in plan.moves)}")
    try:
        _load_modules(access, plan.modules)
    except _ModuleError as error:
        refusal = Refusal(None, str(error), error.fix)
        return Outcome(action, Status.REFUSED, _with_refusal(plan, refusal), waited_seconds=waited)
    plan = with_registered_names(plan, _registered(access.root))
    return _Transaction(access, action, plan, waited).run()


def _lock_refusal(action: str, busy: BindingLockBusy, waited: float) -> Outcome:
    holder = busy.holder
    refusal = Refusal(
        None,
        str(busy),
        "wait for it to finish, or pass --wait SECONDS",
        busy=True,
        holders=() if holder is None else (Holder(holder.pid, holder.command, str(busy.path)),),
    )
    return Outcome(action, Status.REFUSED, BindPlan((), (), (), (refusal,)), waited_seconds=waited)


class _ModuleError(Exception):
    def __init__(self, message: str, fix: str) -> None:
        super().__init__(message)
        self.fix = fix


def _load_modules(access: HostAccess, modules: Sequence[str]) -> None:
    for module in modules:
        argv = ["modprobe", module]
        if access.host_root != Path("/"):
            # In a container: the host's modprobe, modules and configuration.
            argv = ["chroot", str(access.host_root), *argv]
        fix = (
            "install the module for this kernel, or pass --driver vfio-pci;"
            " --host-root must hold the host's / when running in a container"
        )
        try:
            done = access.runner(argv)
        except (OSError, subprocess.SubprocessError) as error:
            raise _ModuleError(f"cannot run `{' '.join(argv)}`: {error}", fix) from error
        if done.returncode != 0:
            detail = (done.stderr or done.stdout or "").strip().splitlines()
            last = f": {detail[-1]}" if detail else ""
            raise _ModuleError(
                f"`{' '.join(argv)}` failed with exit status {done.returncode}{last}", fix
            )
        if find_driver_dir(access.root, module) is None:
            raise _ModuleError(
                f"module {module} loaded, but no PCI driver of that name appeared under"
                f" {access.root / 'sys/bus/pci/drivers'}",
                "check that it is a PCI driver (see modinfo) and the kernel log",
            )


class _LockBusy(Exception):
    pass


class _StepFailed(Exception):
    pass


class _Transaction:
    """Apply a plan's writes; on the first failure, restore every function touched."""

    def __init__(self, access: HostAccess, action: str, plan: BindPlan, waited: float) -> None:
        self.access = access
        self.action = action
        self.plan = plan
        self.waited = waited
        self.writes: list[Write] = []
        self.touched: list[Move] = []
        self.locked: list[Move] = []

    def run(self) -> Outcome:
        try:
            # Every lock first: a GPU the NVIDIA driver will not let go leaves nothing changed.
            for move in self.plan.moves:
                if move.take_unbind_lock:
                    self._take_lock(move)
            for move in self.plan.moves:
                self.touched.append(move)
                for write in plan_writes(move):
                    if write.kind is not WriteKind.UNBIND_LOCK:
                        self._write(write)
                self._check(move)
        except _LockBusy as busy:
            self._restore()
            refusal = Refusal(
                busy.args[0],
                "the NVIDIA driver refused the unbind lock: the GPU is in use",
                "stop what uses it (nvidia-smi shows the processes), or pass --wait SECONDS",
                busy=True,
            )
            return Outcome(
                self.action,
                Status.REFUSED,
                _with_refusal(self.plan, refusal),
                tuple(self.writes),
                waited_seconds=self.waited,
            )
        except _StepFailed as failure:
            restored = self._restore()
            status = (
                Status.FAILED_RESTORED
                if all(r.ok for r in restored)
                else Status.FAILED_NOT_RESTORED
            )
            return Outcome(
                self.action,
                status,
                self.plan,
                tuple(self.writes),
                self._drivers(),
                self.plan.modules,
                str(failure),
                restored,
                self.waited,
            )
        return Outcome(
            self.action,
            Status.DONE,
            self.plan,
            tuple(self.writes),
            self._drivers(),
            self.plan.modules,
            waited_seconds=self.waited,
        )

    def _take_lock(self, move: Move) -> None:
        write = plan_writes(move)[0]
        self._write(write)
        self.locked.append(move)
        try:
            held = (self.access.root / write.path).read_text().strip() == "1"
        except OSError:
            held = False
        if not held:
            raise _LockBusy(move.bdf)

    def _write(self, write: Write) -> None:
        try:
            self.access.writer.write(self.access.root / write.path, write.text)
        except OSError as error:
            raise _StepFailed(_explain(write, error)) from error
        self.writes.append(write)

    def _check(self, move: Move) -> None:
        now = _driver_of(self.access.root, move.bdf)
        if move.reprobe:
            return  # whatever the kernel picked (or nothing) is the answer
        if move.to_driver is None and now is None:
            return
        if not same_driver(now, move.to_driver):
            wanted = move.to_driver or "no driver"
            raise _StepFailed(
                f"{move.bdf} is on {now or 'no driver'} instead of {wanted} after the writes;"
                " the kernel log (dmesg) says why"
            )

    def _restore(self) -> tuple[Restored, ...]:
        restored: list[Restored] = []
        touched = {m.bdf for m in self.touched}
        # Locks taken for moves never started are released too.
        undo = list(self.touched) + [m for m in self.locked if m.bdf not in touched]
        for move in reversed(undo):
            now = FunctionState(
                _driver_of(self.access.root, move.bdf),
                read_override(self.access.root, move.bdf),
                unbind_locked=move in self.locked,
            )
            wanted = FunctionState(move.from_driver, move.from_override)
            writes = plan_return(move.bdf, now, wanted)
            problems: list[str] = []
            for write in writes:
                try:
                    self.access.writer.write(self.access.root / write.path, write.text)
                    self.writes.append(write)
                except OSError as error:
                    problems.append(_explain(write, error))
            driver = _driver_of(self.access.root, move.bdf)
            override = read_override(self.access.root, move.bdf)
            ok = (
                not problems
                and same_driver(driver, move.from_driver)
                and override == move.from_override
            )
            if not ok and not problems:
                problems.append(
                    f"{move.bdf} is on {driver or 'no driver'} (override {override or 'none'}),"
                    f" not back on {move.from_driver or 'no driver'}"
                    f" (override {move.from_override or 'none'})"
                )
            restored.append(Restored(move.bdf, driver, override, ok, tuple(problems)))
        return tuple(reversed(restored))

    def _drivers(self) -> dict[Bdf, str | None]:
        return {m.bdf: _driver_of(self.access.root, m.bdf) for m in self.plan.moves}


def _explain(write: Write, error: OSError) -> str:
    problem = error.strerror or str(error)
    hint = {
        (WriteKind.BIND, errno.ENODEV): ": the driver does not take this device",
        (WriteKind.BIND, errno.EBUSY): ": another driver holds it",
        (WriteKind.UNBIND, errno.ENODEV): ": it was not on that driver",
    }.get((write.kind, error.errno or 0), "")
    return f"{write.bdf}: `{write}` failed: {problem}{hint}"


def _with_refusal(plan: BindPlan, refusal: Refusal) -> BindPlan:
    return BindPlan(plan.moves, plan.unchanged, plan.modules, (*plan.refusals, refusal))


def _registered(root: Path) -> tuple[str, ...]:
    try:
        return tuple(sorted(p.name for p in (root / "sys/bus/pci/drivers").iterdir()))
    except FileNotFoundError:
        return ()


def _driver_of(root: Path, bdf: Bdf) -> str | None:
    try:
        return (root / "sys/bus/pci/devices" / str(bdf) / "driver").readlink().name
    except FileNotFoundError:
        return None
