"""The health judgement (dra.health_judge) as tables: a device's state before and after, and the
verdict."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from types import MappingProxyType

import pytest

from dra.devices import DraDevice, device_name
from dra.health import Health
from dra.health_judge import (
    NODES_GRACE,
    Baseline,
    HealthState,
    HostSignals,
    build_baselines,
    diff_health,
    judge_health,
    same_health,
)
from hostdev.aer import AerCounts
from hostdev.bdf import Bdf

BDF = Bdf.parse("0000:18:00.0")
NAME = device_name(BDF)
CLAIM = "claim vms/vm-gpu (uid a1b2c3d4-0000-4000-8000-000000000001)"


def gpu(driver: str = "vfio-pci", **changes: object) -> DraDevice:
    device = DraDevice(
        name=NAME,
        bdf=BDF,
        resource="nvidia.com/GH100_H100",
        attributes=MappingProxyType({"currentDriver": driver}),
        device_nodes=("/dev/vfio/devices/vfio0", "/dev/iommu"),
        group=17,
    )
    return replace(device, **changes)  # type: ignore[arg-type]


ON_HOST_DRIVER = gpu("nvidia", bind_on_demand=True, device_nodes=())
PENDING = gpu(nodes_pending=True)
UNBOUND = gpu("", unusable="bound to no driver: bind it to vfio-pci to assign it")


@dataclass(frozen=True)
class Step:
    device: DraDevice
    aer: AerCounts | None = None
    at: float = 0.0
    reprobed: bool = False
    claims: dict[Bdf, str] = field(default_factory=dict)
    bound_for_claims: frozenset[Bdf] = frozenset()
    recorded: Baseline | None = None


def run(steps: list[Step], *, again: bool = False) -> tuple[Health, str]:
    """The verdict after the steps; `again`: each step judged a second time from the same
    inputs (a device copied, as a new reading of it is), and once more as after a claim alone,
    with the host not read."""
    state = HealthState()
    for step in steps:
        signals = HostSignals(
            aer={BDF: step.aer},
            claims=step.claims,
            bound_for_claims=step.bound_for_claims,
            reprobed=frozenset({BDF}) if step.reprobed else frozenset(),
            recorded={NAME: step.recorded} if step.recorded else {},
        )
        state = judge_health(state, (step.device,), signals, step.at)
        if again:
            # A re-probe is one event: the judgements after it do not see it again.
            signals = replace(signals, reprobed=frozenset())
            state = judge_health(state, (replace(step.device),), signals, step.at)
            verdict = state.health
            state = judge_health(state, (step.device,), signals, step.at, checked=False)
            assert state.health == verdict
    (last,) = state.health
    assert last.device == NAME and last.checked_at == steps[-1].at
    return last.health, last.message


CASES = {
    "on VFIO with its nodes": ([Step(gpu())], Health.HEALTHY, ""),
    "on its host driver waiting for an on-demand claim": (
        [Step(ON_HOST_DRIVER)],
        Health.HEALTHY,
        "",
    ),
    "unbound from vfio-pci": (
        [Step(gpu()), Step(UNBOUND)],
        Health.UNHEALTHY,
        "cannot be given to a VM: bound to no driver",
    ),
    "bound again": ([Step(gpu()), Step(UNBOUND), Step(gpu())], Health.HEALTHY, ""),
    "nodes being made just after the bind": (
        [Step(PENDING, at=1.0)],
        Health.HEALTHY,
        "udev is making its VFIO nodes",
    ),
    "nodes still missing after the grace": (
        [Step(PENDING, at=1.0), Step(PENDING, at=1.0 + NODES_GRACE + 0.1)],
        Health.UNHEALTHY,
        "check that udev runs",
    ),
    "nodes made within the grace": (
        [Step(PENDING, at=1.0), Step(gpu(), at=1.5)],
        Health.HEALTHY,
        "",
    ),
    "cdev removed after it was there": (
        [Step(gpu()), Step(PENDING, at=0.01)],
        Health.UNHEALTHY,
        "after it was there",
    ),
    "cdev removed, then unbound and bound again: being made anew": (
        [Step(gpu()), Step(PENDING), Step(PENDING, reprobed=True)],
        Health.HEALTHY,
        "udev is making",
    ),
    "fatal errors from before the driver started are its baseline": (
        [Step(gpu(), AerCounts(3, 0))],
        Health.HEALTHY,
        "",
    ),
    "a fatal error another judge counted from its baseline (a rolling update's old instance)": (
        [Step(gpu(), AerCounts(1, 0), recorded=Baseline("vfio-pci", 0))],
        Health.UNHEALTHY,
        "1 fatal PCIe error (AER) since it was bound to vfio-pci",
    ),
    "a baseline recorded on another driver: re-probed since": (
        [Step(gpu(), AerCounts(1, 0), recorded=Baseline("nvidia", 0))],
        Health.HEALTHY,
        "",
    ),
    "a baseline recorded above the counters: a new device at the address": (
        [Step(gpu(), AerCounts(1, 0), recorded=Baseline("vfio-pci", 2))],
        Health.HEALTHY,
        "",
    ),
    "a baseline recorded, and a re-probe event": (
        [Step(gpu(), AerCounts(1, 0), reprobed=True, recorded=Baseline("vfio-pci", 0))],
        Health.HEALTHY,
        "",
    ),
    "a new fatal error": (
        [Step(gpu(), AerCounts(3, 0)), Step(gpu(), AerCounts(4, 0))],
        Health.UNHEALTHY,
        "1 fatal PCIe error (AER) since it was bound to vfio-pci",
    ),
    "a new fatal error stays": (
        [Step(gpu(), AerCounts(0, 0)), Step(gpu(), AerCounts(2, 0)), Step(gpu(), AerCounts(2, 0))],
        Health.UNHEALTHY,
        "2 fatal PCIe errors",
    ),
    "a fatal error, then the device unbound and bound again": (
        [
            Step(gpu(), AerCounts(0, 0)),
            Step(gpu(), AerCounts(1, 0)),
            Step(UNBOUND, AerCounts(1, 0)),
            Step(gpu(), AerCounts(1, 0)),
        ],
        Health.HEALTHY,
        "",
    ),
    "a fatal error, then a re-probe faster than a judgement": (
        [
            Step(gpu(), AerCounts(0, 0)),
            Step(gpu(), AerCounts(1, 0)),
            Step(gpu(), AerCounts(1, 0), reprobed=True),
        ],
        Health.HEALTHY,
        "",
    ),
    "a fatal error, then removed and rescanned (counters start anew)": (
        [Step(gpu(), AerCounts(5, 0)), Step(gpu(), AerCounts(6, 0)), Step(gpu(), AerCounts(0, 0))],
        Health.HEALTHY,
        "",
    ),
    "non-fatal errors are named but leave it healthy": (
        [Step(gpu(), AerCounts(0, 0)), Step(gpu(), AerCounts(0, 7))],
        Health.HEALTHY,
        "7 non-fatal PCIe errors (AER) so far",
    ),
    "no AER counters": ([Step(gpu(), None), Step(gpu(), None)], Health.HEALTHY, ""),
    "bound for a claim and back on its host driver": (
        [
            Step(gpu(), claims={BDF: CLAIM}, bound_for_claims=frozenset({BDF})),
            Step(ON_HOST_DRIVER, claims={BDF: CLAIM}, bound_for_claims=frozenset({BDF})),
        ],
        Health.UNHEALTHY,
        f"bound to VFIO for {CLAIM}, now on nvidia",
    ),
    "on its host driver while its claim gives it back": (
        [
            Step(gpu(), claims={BDF: CLAIM}, bound_for_claims=frozenset({BDF})),
            Step(ON_HOST_DRIVER, claims={BDF: CLAIM}),
        ],
        Health.HEALTHY,
        "",
    ),
}


@pytest.mark.parametrize(("steps", "health", "message"), CASES.values(), ids=CASES.keys())
def test_judgement(steps: list[Step], health: Health, message: str) -> None:
    judged, said = run(steps)
    assert judged is health
    assert message in said if message else said == ""


@pytest.mark.parametrize(("steps", "health", "message"), CASES.values(), ids=CASES.keys())
def test_a_device_judged_again_from_the_same_inputs_has_the_same_verdict(
    steps: list[Step], health: Health, message: str
) -> None:
    assert run(steps, again=True) == run(steps)


def test_after_a_claim_alone_only_the_devices_it_concerns_are_judged_again() -> None:
    other = replace(gpu(), name="pci-0000-2a-00-0", bdf=Bdf.parse("0000:2a:00.0"))
    first = judge_health(HealthState(), (gpu(), other), HostSignals(), 1.0)
    claimed = HostSignals(claims={BDF: CLAIM}, bound_for_claims=frozenset({BDF}))
    after = judge_health(first, (gpu(), other), claimed, 2.0, checked=False)
    assert after.health[1] is first.health[1]
    assert after.health[0].checked_at == 2.0 and after.health[0].health is Health.HEALTHY
    lost = judge_health(after, (ON_HOST_DRIVER, other), claimed, 3.0)
    assert lost.health[0].health is Health.UNHEALTHY
    assert lost.health[0].message.startswith(f"bound to VFIO for {CLAIM}, now on nvidia")
    assert [h.checked_at for h in lost.health] == [3.0, 3.0]


def test_a_prepared_device_gone_from_the_bus_stays_in_the_list_naming_its_claim() -> None:
    other = replace(gpu(), name="pci-0000-2a-00-0", bdf=Bdf.parse("0000:2a:00.0"))
    state = judge_health(HealthState(), (gpu(), other), HostSignals(), 1.0)
    state = judge_health(state, (other,), HostSignals(gone={NAME: CLAIM}), 2.0)
    assert [(h.device, h.health) for h in state.health] == [
        ("pci-0000-2a-00-0", Health.HEALTHY),
        (NAME, Health.UNHEALTHY),
    ]
    assert f"gone from the PCI bus while {CLAIM} is prepared on it" in state.health[1].message
    assert NAME not in state.tracked


def test_changes_are_the_devices_whose_health_moved() -> None:
    first = judge_health(HealthState(), (gpu(),), HostSignals(), 1.0)
    again = judge_health(first, (gpu(),), HostSignals(), 2.0)
    worse = judge_health(again, (UNBOUND,), HostSignals(), 3.0)
    assert diff_health((), first.health) == [(None, first.health[0])]
    assert diff_health(first.health, again.health) == []
    assert same_health(first.health, again.health)
    assert diff_health(again.health, worse.health) == [(Health.HEALTHY, worse.health[0])]
    assert not same_health(again.health, worse.health)


def test_pending_says_whether_time_alone_changes_the_judgement() -> None:
    assert judge_health(HealthState(), (PENDING,), HostSignals(), 1.0).pending()
    assert not judge_health(HealthState(), (gpu(),), HostSignals(), 1.0).pending()


def test_a_judge_started_later_from_the_recorded_baselines_agrees() -> None:
    first = judge_health(HealthState(), (gpu(),), HostSignals(aer={BDF: AerCounts(0, 0)}), 1.0)
    after = HostSignals(aer={BDF: AerCounts(1, 0)})
    first = judge_health(first, (gpu(),), after, 2.0)
    assert build_baselines(first) == {NAME: Baseline("vfio-pci", 0)}
    later = judge_health(
        HealthState(), (gpu(),), replace(after, recorded=build_baselines(first)), 2.0
    )
    assert same_health(later.health, first.health)
    assert later.health[0].health is Health.UNHEALTHY
