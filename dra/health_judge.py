"""Each published device's health, judged from the devices as last built from the host, their
PCIe error counters and the prepared claims. Pure: the judge's memory of the last judgement goes
in and comes out as a value (`HealthState`); the driver's event thread holds it.

What makes a device UNHEALTHY, the same signals the device plugin follows:
- it cannot be given to a VM any more (`DraDevice.unusable`: unbound from VFIO, its IOMMU group
  no longer viable, its VFIO nodes all gone);
- some of its VFIO nodes went away after they had all been there, or udev has not made them
  `NODES_GRACE` seconds after the device came on VFIO (until then it is only being made);
- it was bound to VFIO for a prepared claim and is off VFIO again;
- a new fatal PCIe error (AER) since the device was last (re)bound to a driver;
- it is gone from the PCI bus while a claim on it is still prepared.
A device on its host driver waiting for an on-demand claim is healthy; so is one with non-fatal
PCIe errors (they are named in its message).

A fatal error stays until the device is reset. What shows a reset: the device is re-probed,
which is what recovering from a fatal error takes (the kernel's own AER recovery resets the link
but does not clear our doubt). We see a re-probe as its driver changing between two judgements,
as an unbind or bind event for it (an unbind and bind again faster than we judge), or as its
counters going down (removed and rescanned: the kernel counts anew for a new device). A bare
`echo 1 > reset` (hostdev/binding/reset.py's reset after use) sends no event and leaves the
counters as they were, so it is not taken as one: our reset-after-use runs on the give-back,
which moves the device to its host driver — a driver change — anyway.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace

from dra.devices import DraDevice
from dra.health import DeviceHealth, Health
from hostdev.aer import AerCounts
from hostdev.bdf import Bdf

NODES_GRACE = 2.0
"""Seconds udev may take to make a device's nodes once it is on VFIO before that is a fault."""


@dataclass(frozen=True, slots=True)
class Tracked:
    """What the judge remembers of one device between judgements."""

    driver: str
    fatal_baseline: int | None
    """TOTAL_ERR_FATAL when the device was last (re)bound; None without AER counters."""
    nodes_seen: bool
    """All its VFIO nodes were there since it came on its current driver."""
    pending_since: float | None
    """When its nodes were first seen missing while none had been seen yet."""


Inputs = tuple[DraDevice, AerCounts | None, str | None, bool]
"""What a device's verdict is a function of, with what the judge remembers of it (`Tracked`):
the device, its counters, the claim holding it and whether it was bound for that claim."""


@dataclass(frozen=True, slots=True)
class HealthState:
    health: tuple[DeviceHealth, ...] = ()
    tracked: Mapping[str, Tracked] = field(default_factory=dict)
    inputs: Mapping[str, Inputs] = field(default_factory=dict)
    """What each device was last judged from."""

    def pending(self) -> bool:
        """Whether a device waits for its nodes: the judgement changes with time alone."""
        return any(t.pending_since is not None for t in self.tracked.values())


@dataclass(frozen=True, slots=True)
class Baseline:
    """A device's driver and TOTAL_ERR_FATAL when it was last (re)bound, as a judge recorded it."""

    driver: str
    fatal: int


@dataclass(frozen=True, slots=True)
class HostSignals:
    """What the judge reads besides the devices, as the driver's event thread last saw it."""

    aer: Mapping[Bdf, AerCounts | None] = field(default_factory=dict)
    claims: Mapping[Bdf, str] = field(default_factory=dict)
    """The prepared claim holding each function, as log and message name it."""
    gone: Mapping[str, str] = field(default_factory=dict)
    """Devices of prepared claims no longer on the bus, by name, with their claim."""
    bound_for_claims: frozenset[Bdf] = frozenset()
    """Functions the driver bound to VFIO for a prepared claim (and has not begun giving back)."""
    reprobed: frozenset[Bdf] = frozenset()
    """Functions an unbind or bind event named since the last judgement."""
    recorded: Mapping[str, Baseline] = field(default_factory=dict)
    """Baselines by device name that another judge recorded (the other instance of a rolling
    update, or this driver before a restart): a device new to this judge on the same driver
    keeps the fatal errors counted since, instead of taking them as its baseline."""


def judge_health(
    state: HealthState,
    devices: Sequence[DraDevice],
    signals: HostSignals,
    now: float,
    *,
    checked: bool = True,
) -> HealthState:
    """Every published device's health, then every prepared device gone from the bus.

    A device judged from the same inputs as the last time, not re-probed and not waiting for
    its nodes, keeps its verdict: checked `now` when the host was (`checked`), else as it was
    (after a claim alone, where judging all 4,096 functions again took tens of milliseconds
    that the prepare beside it waited for)."""
    health: list[DeviceHealth] = []
    tracked: dict[str, Tracked] = {}
    inputs: dict[str, Inputs] = {}
    last = {h.device: h for h in state.health}
    # Each signal looked up once per device, and the sets and claims only when they hold any:
    # a PCI address hashes slowly, and 4,096 devices are judged at every reading of the host.
    aer, claims, bound, reprobed = (
        signals.aer,
        signals.claims,
        signals.bound_for_claims,
        signals.reprobed,
    )
    for device in devices:
        name, bdf = device.name, device.bdf
        judged = inputs[name] = (
            device,
            aer.get(bdf),
            claims.get(bdf) if claims else None,
            bool(bound) and bdf in bound,
        )
        again = bool(reprobed) and bdf in reprobed
        before = state.tracked.get(name)
        previous = last.get(name)
        if (
            before is not None
            and previous is not None
            and before.pending_since is None
            and not again
            and state.inputs.get(name) == judged
        ):
            tracked[name] = before
            health.append(
                DeviceHealth(name, previous.health, previous.message, now) if checked else previous
            )
            continue
        seen = tracked[name] = _track(before, judged, again, signals.recorded, now)
        verdict, message = _judge(judged, seen, now)
        health.append(DeviceHealth(name, verdict, message, now))
    for name, claim in sorted(signals.gone.items()):
        if name not in tracked:
            health.append(
                DeviceHealth(
                    name,
                    Health.UNHEALTHY,
                    f"gone from the PCI bus while {claim} is prepared on it: its VM has lost"
                    " the device; delete the VM's pod so that the claim is unprepared",
                    now,
                )
            )
    return HealthState(tuple(health), tracked, inputs)


def build_baselines(state: HealthState) -> dict[str, Baseline]:
    """What `HostSignals.recorded` takes: each device's driver and fatal baseline."""
    return {
        name: Baseline(t.driver, t.fatal_baseline)
        for name, t in state.tracked.items()
        if t.fatal_baseline is not None
    }


def parse_baselines(data: object) -> dict[str, Baseline]:
    """The baselines `baselines_json` gave; entries of any other shape are left out (they are
    only a hint: a device without one takes its counters as they are, as on a first start)."""
    if not isinstance(data, dict):
        return {}
    baselines: dict[str, Baseline] = {}
    for name, entry in data.items():
        if not isinstance(entry, dict):
            continue
        driver, fatal = entry.get("driver"), entry.get("fatal")
        if isinstance(driver, str) and type(fatal) is int and fatal >= 0:
            baselines[name] = Baseline(driver, fatal)
    return baselines


def baselines_json(baselines: Mapping[str, Baseline]) -> dict[str, dict[str, str | int]]:
    return {name: {"driver": b.driver, "fatal": b.fatal} for name, b in sorted(baselines.items())}


def diff_health(
    before: Sequence[DeviceHealth], after: Sequence[DeviceHealth]
) -> list[tuple[Health | None, DeviceHealth]]:
    """The devices whose health changed (or that are new), or that are still unhealthy for
    another reason, with their health before."""
    old = {h.device: h for h in before}
    changes: list[tuple[Health | None, DeviceHealth]] = []
    for now in after:
        was = old.get(now.device)
        if was is None:
            changes.append((None, now))
        elif was.health != now.health or (
            now.health is Health.UNHEALTHY and was.message != now.message
        ):
            changes.append((was.health, now))
    return changes


def same_health(a: Sequence[DeviceHealth], b: Sequence[DeviceHealth]) -> bool:
    """Equal but for when each was checked."""
    return [(h.device, h.health, h.message) for h in a] == [
        (h.device, h.health, h.message) for h in b
    ]


def _track(
    before: Tracked | None,
    judged: Inputs,
    reprobed: bool,
    recorded: Mapping[str, Baseline],
    now: float,
) -> Tracked:
    device, counts, _, _ = judged
    driver = str(device.attributes.get("currentDriver", ""))
    fatal = counts.fatal if counts is not None else None
    if before is None or before.driver != driver or reprobed:
        first = _first_seen(device, driver, fatal, now)
        kept = recorded.get(device.name) if before is None and not reprobed else None
        # Counters going down since the record mean a new device at that address.
        if kept is None or kept.driver != driver or fatal is None or kept.fatal > fatal:
            return first
        return replace(first, fatal_baseline=kept.fatal)
    baseline = before.fatal_baseline
    if baseline is None or (fatal is not None and fatal < baseline):
        baseline = fatal
    if device.unusable or device.bind_on_demand:
        return Tracked(driver, baseline, nodes_seen=False, pending_since=None)
    if not device.nodes_pending:
        return Tracked(driver, baseline, nodes_seen=True, pending_since=None)
    if before.nodes_seen:
        return Tracked(driver, baseline, nodes_seen=True, pending_since=None)
    return Tracked(driver, baseline, nodes_seen=False, pending_since=before.pending_since or now)


def _first_seen(device: DraDevice, driver: str, fatal: int | None, now: float) -> Tracked:
    """A device new to the judge, or (re)bound since it last looked: its counters as they are
    now are its baseline, and nodes it lacks may still be being made."""
    on_vfio = not device.unusable and not device.bind_on_demand
    pending = on_vfio and device.nodes_pending
    return Tracked(
        driver, fatal, nodes_seen=on_vfio and not pending, pending_since=now if pending else None
    )


def _judge(judged: Inputs, seen: Tracked, now: float) -> tuple[Health, str]:
    device, counts, claim, bound_for_claim = judged
    if device.unusable:
        return Health.UNHEALTHY, f"cannot be given to a VM: {device.unusable}"
    if device.bind_on_demand and claim is not None and bound_for_claim:
        return Health.UNHEALTHY, (
            f"bound to VFIO for {claim}, now on {seen.driver or 'no driver'}: its VM has lost"
            " the device; delete the VM's pod so that the claim is unprepared"
        )
    if device.nodes_pending and seen.nodes_seen:
        return Health.UNHEALTHY, (
            f"{_missing_nodes(device)}, after it was there: something removed it; unbind the"
            " device and bind it to vfio-pci again to have it made anew"
        )
    if seen.pending_since is not None and now - seen.pending_since > NODES_GRACE:
        return Health.UNHEALTHY, (
            f"{_missing_nodes(device)} {now - seen.pending_since:.0f} s after it was bound to"
            f" {seen.driver}: check that udev runs and makes /dev/vfio nodes"
        )
    if counts is not None and seen.fatal_baseline is not None:
        new = counts.fatal - seen.fatal_baseline
        if new > 0:
            return Health.UNHEALTHY, (
                f"{new} fatal PCIe error{'s' if new > 1 else ''} (AER) since it was bound"
                f" to {seen.driver or 'no driver'}: reset it once no VM uses it (unbind it and"
                " bind it again, or remove it and rescan the PCI bus)"
            )
    notes = []
    if seen.pending_since is not None:
        notes.append("udev is making its VFIO nodes")
    if counts is not None and counts.nonfatal:
        notes.append(f"{counts.nonfatal} non-fatal PCIe errors (AER) so far")
    return Health.HEALTHY, "; ".join(notes)


def _missing_nodes(device: DraDevice) -> str:
    return f"its VFIO cdev or group node /dev/vfio/{device.group} is missing"
