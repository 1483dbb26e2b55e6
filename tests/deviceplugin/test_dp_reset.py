"""Reset after use, the pure part: configuration, the transitions and the health overlay."""

from __future__ import annotations

from pathlib import Path

import pytest

from deviceplugin.command import apply_flags
from deviceplugin.inventory import build_device_tree
from deviceplugin.reset_policy import (
    RESETTING_REASON,
    Key,
    Phase,
    ResetState,
    ResetTiming,
    observe_allocation,
    observe_assignments,
    observe_reset,
    overlay_resets,
    tracked_devices,
    unhealthy_reasons,
)
from hostdev.config import ConfigError, default_config, parse_config
from hostdev.pciids import PciIds
from hostdev.scan import scan_host
from kubevirt_iommufd.cli import build_parser
from sim.host import BuildHost, hgx_h100

H100 = "nvidia.com/H100"
A: Key = (H100, "0000:18:00.0")
B: Key = (H100, "0000:2a:00.0")
TRACKED = frozenset({A, B})
TIMING = ResetTiming(grace_seconds=10, retry_seconds=30)


def listed(*keys: Key) -> dict[str, frozenset[str]]:
    return {H100: frozenset(k[1] for k in keys)}


def phases(state: ResetState) -> dict[Key, Phase]:
    return {k: u.phase for k, u in state.devices.items()}


def test_config_opts_in_per_resource() -> None:
    config = parse_config(
        {
            "resources": [
                {"resourceName": H100, "selectors": {"vendors": ["10de"]}, "resetAfterUse": True},
                {"autoName": "nvidia", "selectors": {"vendors": ["15b3"]}},
            ],
            "podResources": {"socket": "/run/pr/kubelet.sock", "pollIntervalSeconds": 0.5},
        }
    )
    assert [r.reset_after_use for r in config.resources] == [True, False]
    assert config.resets_after_use
    assert config.pod_resources.socket == Path("/run/pr/kubelet.sock")
    assert config.pod_resources.poll_interval_seconds == 0.5
    assert parse_config({}).pod_resources.socket == Path(
        "/var/lib/kubelet/pod-resources/kubelet.sock"
    )
    assert not parse_config({}).resets_after_use


@pytest.mark.parametrize(
    ("document", "message"),
    [
        (
            {
                "resources": [
                    {
                        "resourceName": H100,
                        "selectors": {"vendors": ["10de"]},
                        "resetAfterUse": "yes",
                    }
                ]
            },
            "resources[0].resetAfterUse: expected true or false, got str 'yes'",
        ),
        (
            {"podResources": {"pollIntervalSeconds": 0}},
            "podResources.pollIntervalSeconds: expected",
        ),
        ({"podResources": {"sock": "x"}}, "podResources.sock: unknown key"),
        ({"podResources": {"socket": ""}}, "podResources.socket: expected a non-empty string"),
    ],
)
def test_config_errors_name_the_key(document: object, message: str) -> None:
    with pytest.raises(ConfigError) as caught:
        parse_config(document)
    assert str(caught.value).startswith(message)


def test_only_resources_that_opted_in_are_tracked(build_host: BuildHost) -> None:
    inventory = scan_host(build_host(hgx_h100()))
    config = parse_config(
        {
            "resources": [
                {
                    "resourceName": H100,
                    "selectors": {"pciAddresses": ["0000:18:00.0"]},
                    "resetAfterUse": True,
                },
                {"resourceName": "nvidia.com/other", "selectors": {"vendors": ["10de"]}},
            ]
        }
    )
    tree = build_device_tree(inventory, config, PciIds(None))
    assert tree.resources[H100].reset_after_use
    assert not tree.resources["nvidia.com/other"].reset_after_use
    assert tracked_devices(tree) == {A}


def test_first_list_resets_every_device_no_pod_holds() -> None:
    state, start = observe_assignments(ResetState(), TRACKED, listed(A), 0.0, TIMING)
    assert phases(state) == {A: Phase.ASSIGNED, B: Phase.RESETTING}
    assert start == (B,)
    assert state.devices[B].message == "not known to be clean when the plugin started"


def test_a_released_device_is_reset_then_offered() -> None:
    state, _ = observe_assignments(ResetState(), TRACKED, listed(A, B), 0.0, TIMING)
    state, start = observe_assignments(state, TRACKED, listed(B), 2.0, TIMING)
    assert start == (A,)
    assert unhealthy_reasons(state) == {A: RESETTING_REASON}
    # A List while the reset runs starts nothing more.
    state, start = observe_assignments(state, TRACKED, listed(B), 4.0, TIMING)
    assert start == ()
    state = observe_reset(state, A, "reset", "", 4.5)
    assert phases(state)[A] is Phase.FREE
    assert unhealthy_reasons(state) == {}


def test_an_allocation_the_kubelet_has_not_listed_yet_is_left_alone() -> None:
    state, _ = observe_assignments(ResetState(), TRACKED, listed(A, B), 0.0, TIMING)
    state, _ = observe_assignments(state, TRACKED, listed(B), 1.0, TIMING)
    state = observe_reset(state, A, "reset", "", 1.0)
    state = observe_allocation(state, H100, ["0000:18:00.0"], 2.0)
    state, start = observe_assignments(state, TRACKED, listed(B), 2.1, TIMING)
    assert (start, phases(state)[A]) == ((), Phase.ALLOCATED)
    state, start = observe_assignments(state, TRACKED, listed(A, B), 3.0, TIMING)
    assert phases(state)[A] is Phase.ASSIGNED


def test_an_allocation_no_pod_ever_showed_is_reset_after_the_grace_period() -> None:
    state, _ = observe_assignments(ResetState(), TRACKED, listed(A, B), 0.0, TIMING)
    state = observe_reset(
        observe_assignments(state, TRACKED, listed(B), 1.0, TIMING)[0], A, "reset", "", 1.0
    )
    state = observe_allocation(state, H100, ["0000:18:00.0"], 5.0)
    state, start = observe_assignments(state, TRACKED, listed(B), 14.9, TIMING)
    assert start == ()
    state, start = observe_assignments(state, TRACKED, listed(B), 15.0, TIMING)
    assert start == (A,)
    assert state.devices[A].message == "allocated, but no pod holds it any more"


@pytest.mark.parametrize(
    ("status", "phase", "reason"),
    [
        ("reset", Phase.FREE, None),
        ("no-method", Phase.FREE, None),
        ("busy", Phase.DIRTY, RESETTING_REASON),
        ("failed", Phase.FAILED, "reset failed: it broke; retrying"),
    ],
)
def test_reset_outcomes(status: str, phase: Phase, reason: str | None) -> None:
    state, _ = observe_assignments(ResetState(), frozenset({A}), {}, 0.0, TIMING)
    state = observe_reset(state, A, status, "it broke", 1.0)
    assert phases(state)[A] is phase
    assert unhealthy_reasons(state).get(A) == reason


def test_busy_and_failed_resets_are_tried_again() -> None:
    state, _ = observe_assignments(ResetState(), frozenset({A}), {}, 0.0, TIMING)
    busy = observe_reset(state, A, "busy", "held", 1.0)
    assert observe_assignments(busy, frozenset({A}), {}, 2.0, TIMING)[1] == (A,)
    failed = observe_reset(state, A, "failed", "EIO", 1.0)
    assert observe_assignments(failed, frozenset({A}), {}, 30.9, TIMING)[1] == ()
    again, start = observe_assignments(failed, frozenset({A}), {}, 31.0, TIMING)
    assert start == (A,)
    assert again.devices[A].message == "retrying after: EIO"


def test_devices_that_left_the_tree_are_forgotten() -> None:
    state, _ = observe_assignments(ResetState(), TRACKED, listed(A, B), 0.0, TIMING)
    state, _ = observe_assignments(state, frozenset({B}), listed(B), 1.0, TIMING)
    assert set(state.devices) == {B}
    assert observe_reset(state, A, "reset", "", 2.0) == state


def test_overlay_turns_only_healthy_devices_unhealthy(build_host: BuildHost) -> None:
    inventory = scan_host(build_host(hgx_h100()))
    config = parse_config(
        {
            "resources": [
                {"resourceName": H100, "selectors": {"vendors": ["10de"]}, "resetAfterUse": True}
            ]
        }
    )
    tree = build_device_tree(inventory, config, PciIds(None))
    overlaid = overlay_resets(tree, {A: RESETTING_REASON})
    device = overlaid.resources[H100].devices[A[1]]
    assert (device.healthy, device.reason) == (False, RESETTING_REASON)
    assert overlaid.resources[H100].healthy_count == 7
    assert overlaid.members() == tree.members()
    assert overlay_resets(tree, {}) is tree


def test_the_socket_flag_wins_over_the_config() -> None:
    args = build_parser().parse_args(["plugin", "--pod-resources-socket", "/run/pr.sock"])
    assert apply_flags(default_config(), args).pod_resources.socket == Path("/run/pr.sock")
    args = build_parser().parse_args(["plugin"])
    assert apply_flags(default_config(), args) == default_config()
