"""Planning driver changes: which functions move, to which driver, with which sysfs writes, or
why not. Pure functions of the inventory and of the usage read just before; no IO.

Rules (docs/lifecycle.md explains them):
- VFIO hands out whole IOMMU groups, so every PCI function in a requested function's group moves
  with it, and so do its consumers (a GPU's HD-audio function), with their groups in turn.
- Chipset bridges never move: one in the group on `pcieport` (or no driver) stays where it is,
  one on any other driver refuses the group; a requested bridge is refused.
- A function must be free to move: no process holding its nodes, no SR-IOV VFs enabled, and a
  storage or network controller must not be in use by the host (mounted, swap, stacked under
  LVM/md, an interface up). These refusals are "busy": `--wait` polls until they clear.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from enum import Enum

from hostdev.bdf import Bdf
from hostdev.binding.driver_match import (
    VfioAlias,
    choose_vfio_driver,
    driver_names,
    module_name,
    same_driver,
)
from hostdev.binding.holders import Holder
from hostdev.binding.usage import FunctionState, FunctionUsage
from hostdev.model import HostInventory, PciFunction, is_group_safe_driver, is_vfio_driver

AUTO = "auto"


@dataclass(frozen=True, slots=True)
class BindRequest:
    bdf: Bdf
    driver: str = AUTO
    """`auto` (the best VFIO variant for the device, else vfio-pci) or a driver name."""


@dataclass(frozen=True, slots=True)
class Move:
    """One function changing driver."""

    bdf: Bdf
    why: str
    """`requested`, or how it came along: "in IOMMU group 14 with 0000:3b:00.0"."""
    from_driver: str | None
    from_override: str | None
    to_driver: str | None
    """None: left on no driver (unbind), or whatever the kernel picks when `reprobe`."""
    to_override: str | None
    reprobe: bool = False
    take_unbind_lock: bool = False

    @property
    def requested(self) -> bool:
        return self.why == "requested"


@dataclass(frozen=True, slots=True)
class Unchanged:
    bdf: Bdf
    why: str
    driver: str | None
    note: str
    """"already on vfio-pci", "bridge, stays on pcieport"."""


@dataclass(frozen=True, slots=True)
class Refusal:
    bdf: Bdf | None
    """None for a refusal about a non-PCI group member."""
    reason: str
    fix: str
    busy: bool = False
    """It can clear by itself (a process exits, a disk is unmounted): worth `--wait`ing for."""
    holders: tuple[Holder, ...] = ()

    def __str__(self) -> str:
        subject = f"{self.bdf}: " if self.bdf is not None else ""
        return f"{subject}{self.reason}; {self.fix}"


@dataclass(frozen=True, slots=True)
class BindPlan:
    moves: tuple[Move, ...]
    unchanged: tuple[Unchanged, ...]
    modules: tuple[str, ...]
    """Modules to load before writing: drivers the plan needs that are not registered."""
    refusals: tuple[Refusal, ...]

    @property
    def refused(self) -> bool:
        return bool(self.refusals)

    @property
    def only_busy(self) -> bool:
        return self.refused and all(r.busy for r in self.refusals)


class WriteKind(Enum):
    UNBIND_LOCK = "unbind-lock"
    OVERRIDE = "override"
    UNBIND = "unbind"
    BIND = "bind"
    PROBE = "probe"
    UNLOCK = "unlock"


@dataclass(frozen=True, slots=True)
class Write:
    kind: WriteKind
    bdf: Bdf
    path: str
    """Relative to the root: `sys/bus/pci/devices/<BDF>/driver_override`."""
    text: str

    def __str__(self) -> str:
        return f"echo {self.text.strip() or repr(self.text)} > /{self.path}"


def group_closure(inventory: HostInventory, bdfs: Iterable[Bdf]) -> dict[Bdf, str]:
    """Every PCI function that has to move with `bdfs`, with why; requested ones first."""
    why: dict[Bdf, str] = dict.fromkeys(bdfs, "requested")
    pending = list(why)
    while pending:
        bdf = pending.pop(0)
        function = inventory.function(bdf)
        if function is None:
            continue
        group = inventory.group_of(function)
        companions: list[tuple[Bdf, str]] = [
            (c, f"consumer of {bdf} (device link)") for c in function.consumers
        ]
        if group is not None:
            companions += [
                (m.bdf, f"in IOMMU group {group.number} with {bdf}")
                for m in group.members
                if m.bdf is not None
            ]
        for companion, reason in companions:
            if companion not in why:
                why[companion] = reason
                pending.append(companion)
    return why


def plan_bind(
    inventory: HostInventory,
    requests: Sequence[BindRequest],
    aliases: Sequence[VfioAlias],
    usage: Mapping[Bdf, FunctionUsage],
    registered: Iterable[str],
) -> BindPlan:
    """Move the requested functions and everything that must come along to VFIO drivers.

    `requests` name the driver of each requested function; companions get the best VFIO driver
    for their own modalias (a GPU's variant driver would not take its HD-audio function).
    `registered` are the driver directories under /sys/bus/pci/drivers.
    """
    wanted = {r.bdf: r.driver for r in reversed(requests)}
    refusals: list[Refusal] = [
        _missing(r.bdf) for r in requests if inventory.function(r.bdf) is None
    ]
    closure = group_closure(inventory, (r.bdf for r in requests))
    refusals += _foreign_group_members(inventory, closure)
    moves: list[Move] = []
    unchanged: list[Unchanged] = []
    for bdf, why in closure.items():
        function = inventory.function(bdf)
        if function is None:
            continue
        if function.is_bridge:
            refusal, kept = _bridge(function, why)
            refusals += [refusal] if refusal else []
            unchanged += [kept] if kept else []
            continue
        if function.iommu_group is None:
            refusals.append(
                Refusal(
                    bdf,
                    "in no IOMMU group, so VFIO cannot take it",
                    "enable the IOMMU (VT-d/AMD-Vi in the firmware, intel_iommu=on or"
                    " amd_iommu=on on the kernel command line)",
                )
            )
            continue
        choice = wanted.get(bdf, AUTO)
        target = choose_vfio_driver(function.modalias, aliases) if choice == AUTO else choice
        if same_driver(function.driver, target):
            unchanged.append(Unchanged(bdf, why, function.driver, f"already on {function.driver}"))
            continue
        state = usage.get(bdf, FunctionUsage(bdf, None))
        refusals += _busy(function, state, target)
        moves.append(
            Move(
                bdf=bdf,
                why=why,
                from_driver=function.driver,
                from_override=state.override,
                to_driver=target,
                to_override=target,
                take_unbind_lock=state.unbind_lock,
            )
        )
    return BindPlan(tuple(moves), tuple(unchanged), _modules(moves, registered), tuple(refusals))


def _missing(bdf: Bdf) -> Refusal:
    return Refusal(
        bdf,
        "no such PCI function on this host",
        "check the address with `kubevirt-iommufd inspect`",
    )


def plan_unbind(
    inventory: HostInventory,
    bdfs: Sequence[Bdf],
    usage: Mapping[Bdf, FunctionUsage],
    registered: Iterable[str],
    *,
    to_driver: str | None = None,
    reprobe: bool = False,
) -> BindPlan:
    """Take functions (and their consumers) off VFIO: onto `to_driver`, back to whatever the
    kernel picks (`reprobe`), or onto no driver. Only functions on a VFIO driver, or with a
    VFIO `driver_override`, change; the override is cleared unless `to_driver` is set."""
    refusals: list[Refusal] = []
    why: dict[Bdf, str] = {}
    for bdf in bdfs:
        if inventory.function(bdf) is None:
            refusals.append(_missing(bdf))
        why.setdefault(bdf, "requested")
    pending = list(why)
    while pending:
        bdf = pending.pop(0)
        function = inventory.function(bdf)
        for consumer in function.consumers if function is not None else ():
            if consumer not in why:
                why[consumer] = f"consumer of {bdf} (device link)"
                pending.append(consumer)
    moves: list[Move] = []
    unchanged: list[Unchanged] = []
    for bdf, reason in why.items():
        function = inventory.function(bdf)
        if function is None:
            continue
        state = usage.get(bdf, FunctionUsage(bdf, None))
        if not is_vfio_driver(function.driver) and not is_vfio_driver(state.override):
            note = f"not on a VFIO driver (on {function.driver or 'no driver'})"
            unchanged.append(Unchanged(bdf, reason, function.driver, note))
            continue
        target = to_driver if reason == "requested" else None
        refusals += _busy(function, state, target or "another driver")
        moves.append(
            Move(
                bdf=bdf,
                why=reason,
                from_driver=function.driver,
                from_override=state.override,
                to_driver=target,
                to_override=target,
                # The driver given with --to-driver is for the requested device; its companions
                # go back to their own drivers.
                reprobe=reprobe or (to_driver is not None and target is None),
            )
        )
    return BindPlan(tuple(moves), tuple(unchanged), _modules(moves, registered), tuple(refusals))


def with_registered_names(plan: BindPlan, registered: Iterable[str]) -> BindPlan:
    """The plan with each driver spelled as the kernel registered it: `driver_override` is
    compared with the driver's name exactly, and `drivers/<name>/bind` must exist."""
    names = set(registered)

    def spelled(driver: str | None) -> str | None:
        if driver is None:
            return None
        return next((n for n in driver_names(driver) if n in names), driver)

    moves = tuple(
        replace(m, to_driver=spelled(m.to_driver), to_override=spelled(m.to_override))
        for m in plan.moves
    )
    return replace(plan, moves=moves)


def plan_writes(move: Move) -> tuple[Write, ...]:
    """The writes that make a move, in the kernel's order (FACTS §4): take the NVIDIA unbind
    lock, set the override (so no other driver grabs the device between unbind and bind),
    unbind, then bind to the new driver or let the kernel probe."""
    bdf = str(move.bdf)
    device = f"sys/bus/pci/devices/{bdf}"
    writes: list[Write] = []
    if move.take_unbind_lock:
        writes.append(_unbind_lock(move.bdf, "1"))
    writes.append(
        Write(WriteKind.OVERRIDE, move.bdf, f"{device}/driver_override", move.to_override or "\n")
    )
    if move.from_driver is not None:
        writes.append(Write(WriteKind.UNBIND, move.bdf, f"{device}/driver/unbind", bdf))
    if move.reprobe:
        writes.append(Write(WriteKind.PROBE, move.bdf, "sys/bus/pci/drivers_probe", bdf))
    elif move.to_driver is not None:
        path = f"sys/bus/pci/drivers/{move.to_driver}/bind"
        writes.append(Write(WriteKind.BIND, move.bdf, path, bdf))
    return tuple(writes)


def plan_return(bdf: Bdf, now: FunctionState, wanted: FunctionState) -> tuple[Write, ...]:
    """The writes that take a function from `now` to `wanted`'s driver and override with the
    NVIDIA unbind lock released; none when it is there. Each write is one the kernel takes
    from any state a killed run can leave, so a run killed anywhere in them can start over."""
    device = f"sys/bus/pci/devices/{bdf}"
    moving = not same_driver(now.driver, wanted.driver)
    writes: list[Write] = []
    if moving and now.driver is not None:
        writes.append(Write(WriteKind.UNBIND, bdf, f"{device}/driver/unbind", str(bdf)))
    # The kernel binds a device only to the driver its override names, so an override naming
    # another driver (set after the bind, say) goes on last.
    early = wanted.override
    if (
        moving
        and wanted.driver is not None
        and wanted.override is not None
        and not same_driver(wanted.override, wanted.driver)
    ):
        early = None
    if early != now.override:
        writes.append(_override(bdf, early))
    if moving and wanted.driver is not None:
        path = f"sys/bus/pci/drivers/{wanted.driver}/bind"
        writes.append(Write(WriteKind.BIND, bdf, path, str(bdf)))
    if early != wanted.override:
        writes.append(_override(bdf, wanted.override))
    if now.unbind_locked and not moving:
        # Still on the NVIDIA driver with the lock taken; a rebind makes a fresh one.
        writes.append(_unbind_lock(bdf, "0"))
    return tuple(writes)


def _override(bdf: Bdf, override: str | None) -> Write:
    path = f"sys/bus/pci/devices/{bdf}/driver_override"
    return Write(WriteKind.OVERRIDE, bdf, path, override or "\n")


def _unbind_lock(bdf: Bdf, value: str) -> Write:
    kind = WriteKind.UNBIND_LOCK if value == "1" else WriteKind.UNLOCK
    return Write(kind, bdf, f"proc/driver/nvidia/gpus/{bdf}/unbindLock", value)


def _bridge(function: PciFunction, why: str) -> tuple[Refusal | None, Unchanged | None]:
    kind = f"a bridge (class {function.class_code >> 8:04x})"
    if why == "requested":
        return (
            Refusal(
                function.bdf,
                f"{kind}: bridges cannot be given to a VM",
                "bind the devices behind it instead",
            ),
            None,
        )
    if is_group_safe_driver(function.driver):
        on = function.driver or "no driver"
        return None, Unchanged(function.bdf, why, function.driver, f"bridge, stays on {on}")
    return (
        Refusal(
            function.bdf,
            f"{kind} {why} is on {function.driver}, and bridges must not move",
            "this group cannot be given to a VM on this host (an ACS-capable slot may split it)",
        ),
        None,
    )


def _foreign_group_members(inventory: HostInventory, closure: Mapping[Bdf, str]) -> list[Refusal]:
    """Non-PCI members of the groups (platform devices) on a driver that keeps VFIO out."""
    groups = {f.iommu_group for f in map(inventory.function, closure) if f is not None}
    refusals = []
    for number in sorted(g for g in groups if g is not None):
        group = inventory.group(number)
        for member in group.members if group else ():
            if member.bdf is None and not is_group_safe_driver(member.driver):
                refusals.append(
                    Refusal(
                        None,
                        f"IOMMU group {number} also holds {member.name} on {member.driver},"
                        " which is not a PCI function and cannot move",
                        "this group cannot be given to a VM on this host",
                    )
                )
    return refusals


def _busy(function: PciFunction, state: FunctionUsage, target: str) -> list[Refusal]:
    bdf = function.bdf
    refusals: list[Refusal] = []
    if function.sriov is not None and function.sriov.num_vfs > 0:
        refusals.append(
            Refusal(
                bdf,
                f"has {function.sriov.num_vfs} SR-IOV virtual functions enabled",
                f"disable them first: echo 0 > /sys/bus/pci/devices/{bdf}/sriov_numvfs",
                busy=True,
            )
        )
    if state.holders:
        named = "; ".join(str(h) for h in state.holders)
        refusals.append(
            Refusal(
                bdf,
                f"in use: {named}",
                "stop those processes (or the VM), or pass --wait SECONDS",
                busy=True,
                holders=state.holders,
            )
        )
    if state.unreadable_pids:
        count = len(state.unreadable_pids)
        refusals.append(
            Refusal(
                bdf,
                f"cannot tell whether it is in use: the open files of {count} processes are"
                " unreadable",
                "run as root (in a container: privileged, with the host's PID namespace)",
            )
        )
    if state.in_use:
        kind = "storage" if function.class_code >> 16 == 0x01 else "network"
        refusals.append(
            Refusal(
                bdf,
                f"a {kind} controller the host uses through {function.driver}:"
                f" {'; '.join(state.in_use)}",
                f"stop using it on the host before moving it to {target}",
                busy=True,
            )
        )
    return refusals


def _modules(moves: Sequence[Move], registered: Iterable[str]) -> tuple[str, ...]:
    loaded = set(registered)
    needed = {m.to_driver for m in moves if m.to_driver is not None and not m.reprobe}
    return tuple(
        sorted(
            module_name(driver)
            for driver in needed
            if not any(name in loaded for name in driver_names(driver))
        )
    )
