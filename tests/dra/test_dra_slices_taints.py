"""Unhealthy devices published with a taint (KEP-5055): which devices, with what, and a plan
that keeps the `timeAdded` the API server stamped instead of rewriting the pool for it."""

from __future__ import annotations

import copy
from collections.abc import Mapping

import pytest

from dra.health import DeviceHealth, Health
from dra.slices import (
    MAX_DEVICES_PER_TAINTED_SLICE,
    DeviceTaint,
    Object,
    Owner,
    TaintEffect,
    build_slices,
    build_taints,
    plan_slices,
)
from dra_kit import DRIVER
from dra_slices_kit import devices, stored
from k8s_schema_kit import assert_valid
from sim.apiserver_rules import validate_resource_slice

OWNER = Owner("node-a", "0f0f0f0f-0000-4000-8000-000000000001")
KEY = f"{DRIVER}/unhealthy"
EARLIER = "2026-12-01T08:00:00Z"
LATER = "2026-12-03T09:30:00Z"
POOL = devices(4)
NAMES = [d.name for d in POOL]


def taints(*indexes: int, effect: TaintEffect = TaintEffect.NO_SCHEDULE) -> dict[str, DeviceTaint]:
    return {NAMES[i]: DeviceTaint(KEY, effect) for i in indexes}


def held(tainted: Mapping[str, DeviceTaint], stamp: str | None = EARLIER) -> list[Object]:
    """The pool as the server holds it after a write of `tainted`, stamped at `stamp`."""
    return stored(build_slices(OWNER, DRIVER, POOL, 4, tainted), stamp=stamp)


def device_taints(items: tuple[Object, ...] | list[Object]) -> dict[str, list[Object]]:
    return {d["name"]: d.get("taints", []) for s in items for d in s["spec"]["devices"]}


def health(device: str, state: Health, message: str = "") -> DeviceHealth:
    return DeviceHealth(device, state, message, 1000.0)


@pytest.mark.parametrize(
    ("state", "tainted"),
    [
        pytest.param(Health.UNHEALTHY, True, id="unhealthy-tainted"),
        pytest.param(Health.HEALTHY, False, id="healthy-not"),
        pytest.param(Health.UNKNOWN, False, id="unknown-not"),
    ],
)
@pytest.mark.parametrize("effect", list(TaintEffect), ids=str)
def test_only_unhealthy_devices_are_tainted_with_the_configured_effect(
    state: Health, tainted: bool, effect: TaintEffect
) -> None:
    found = build_taints(
        DRIVER, [health(NAMES[0], state, "driver lost"), health(NAMES[1], Health.HEALTHY)], effect
    )
    assert found == ({NAMES[0]: DeviceTaint(KEY, effect)} if tainted else {})


def test_a_taint_is_a_key_in_the_drivers_domain_and_an_effect() -> None:
    (item,) = build_slices(OWNER, DRIVER, POOL, 1, taints(2, effect=TaintEffect.NO_EXECUTE))
    assert device_taints([item])[NAMES[2]] == [
        {"key": "vfio.kubevirt-iommufd.io/unhealthy", "effect": "NoExecute"}
    ]
    assert "taints" not in item["spec"]["devices"][0]


@pytest.mark.parametrize(
    ("before", "after", "rewritten", "expected"),
    [
        pytest.param(
            taints(), taints(1), True, {NAMES[1]: [{"key": KEY, "effect": "NoSchedule"}]},
            id="turns-unhealthy-tainted-for-the-server-to-stamp",
        ),
        pytest.param(taints(1), taints(), True, {}, id="healthy-again-untainted"),
        pytest.param(
            taints(1), taints(1), False,
            {NAMES[1]: [{"key": KEY, "effect": "NoSchedule", "timeAdded": EARLIER}]},
            id="stamped-by-the-server-no-rewrite",
        ),
        pytest.param(
            taints(1), taints(1, 3), True,
            {
                NAMES[1]: [{"key": KEY, "effect": "NoSchedule", "timeAdded": EARLIER}],
                NAMES[3]: [{"key": KEY, "effect": "NoSchedule"}],
            },
            id="another-one-unhealthy-the-first-keeps-its-time",
        ),
        pytest.param(
            taints(1), taints(1, effect=TaintEffect.NO_EXECUTE), True,
            {NAMES[1]: [{"key": KEY, "effect": "NoExecute"}]},
            id="effect-changed-by-config-a-new-taint-with-a-new-time",
        ),
    ],
)  # fmt: skip
def test_the_plan_follows_the_taints_and_keeps_their_stamped_time(
    before: dict[str, DeviceTaint],
    after: dict[str, DeviceTaint],
    rewritten: bool,
    expected: dict[str, list[Object]],
) -> None:
    plan = plan_slices(held(before), OWNER, DRIVER, POOL, after)
    assert plan.empty is not rewritten
    if rewritten:
        assert plan.generation == 5
        assert {k: v for k, v in device_taints(plan.update).items() if v} == expected


def test_a_taint_the_server_did_not_stamp_is_still_the_same_taint() -> None:
    plan = plan_slices(held(taints(1), stamp=None), OWNER, DRIVER, POOL, taints(1))
    assert plan.empty


def test_a_taint_edited_by_someone_else_is_written_back() -> None:
    items = held(taints(1))
    items[0]["spec"]["devices"][1]["taints"][0]["effect"] = "None"
    plan = plan_slices(items, OWNER, DRIVER, POOL, taints(1))
    assert device_taints(plan.update)[NAMES[1]] == [{"key": KEY, "effect": "NoSchedule"}]


def test_a_second_writer_planning_from_the_first_ones_slices_writes_nothing() -> None:
    """Two instances of the driver (a rolling upgrade) with the same view of the host: what one
    wrote and the server stamped is what the other wants."""
    first = plan_slices([], OWNER, DRIVER, POOL, taints(0, 2))
    written = stored(list(first.create), stamp=LATER)
    second = plan_slices(copy.deepcopy(written), OWNER, DRIVER, POOL, taints(0, 2))
    assert second.empty and second.generation == 1


@pytest.mark.parametrize(
    ("count", "tainted", "sizes"),
    [
        pytest.param(100, (), [100], id="untainted-up-to-128"),
        pytest.param(100, (99,), [64, 36], id="one-tainted-all-slices-up-to-64"),
        pytest.param(64, (0,), [64], id="64-with-a-taint-still-one"),
    ],
)
def test_a_pool_with_a_taint_splits_at_64(
    count: int, tainted: tuple[int, ...], sizes: list[int]
) -> None:
    pool = devices(count)
    marks = {pool[i].name: DeviceTaint(KEY, TaintEffect.NO_SCHEDULE) for i in tainted}
    built = build_slices(OWNER, DRIVER, pool, 1, marks)
    assert [len(s["spec"]["devices"]) for s in built] == sizes
    assert (
        all(len(s["spec"]["devices"]) <= MAX_DEVICES_PER_TAINTED_SLICE for s in built)
        or not tainted
    )
    for item in built:
        assert validate_resource_slice(item, None) == []


def test_a_stamped_taint_keeps_its_time_when_its_device_moves_to_another_slice() -> None:
    pool = devices(100)
    mark = {pool[64].name: DeviceTaint(KEY, TaintEffect.NO_SCHEDULE)}
    items = stored(build_slices(OWNER, DRIVER, pool, 3, mark), stamp=EARLIER)
    assert pool[64].name in device_taints(items[1:])
    # A device before it goes: it moves from the second slice to the first.
    plan = plan_slices(items, OWNER, DRIVER, pool[1:], mark)
    assert device_taints(plan.update[:1])[pool[64].name][0]["timeAdded"] == EARLIER


@pytest.mark.parametrize("version", ["1.35", "1.36", "1.37"])
@pytest.mark.parametrize("stamp", [None, LATER], ids=["as-sent", "as-stamped"])
def test_tainted_slices_are_valid_against_the_official_schema(
    version: str, stamp: str | None
) -> None:
    for effect in TaintEffect:
        for item in stored(
            build_slices(OWNER, DRIVER, devices(70), 2, taints(0, 3, effect=effect)), stamp=stamp
        ):
            del item["metadata"]["resourceVersion"]
            assert_valid(item, version)
            assert validate_resource_slice(item, None) == []


@pytest.mark.parametrize("version", ["1.34", "1.36", "1.37"])
def test_untainted_slices_stay_valid_on_older_servers(version: str) -> None:
    for item in build_slices(OWNER, DRIVER, devices(130), 2):
        assert "taints" not in str(item)
        assert_valid(item, version)


def one_device_slice(device_taints: list[Object]) -> Object:
    (item,) = build_slices(OWNER, DRIVER, POOL[:1], 1)
    item["spec"]["devices"][0]["taints"] = device_taints
    return item


@pytest.mark.parametrize(
    ("device_taints", "field", "kind"),
    [
        pytest.param(
            [{"key": "a/b/c", "effect": "NoSchedule"}], "taints[0].key", "FieldValueInvalid",
            id="key-two-slashes",
        ),
        pytest.param(
            [{"key": "Bad_Domain/x", "effect": "NoSchedule"}], "taints[0].key",
            "FieldValueInvalid", id="key-prefix-not-a-subdomain",
        ),
        pytest.param(
            [{"key": "x" * 64, "effect": "NoSchedule"}], "taints[0].key", "FieldValueInvalid",
            id="key-name-too-long",
        ),
        pytest.param(
            [{"key": KEY, "value": "driver lost", "effect": "NoSchedule"}], "taints[0].value",
            "FieldValueInvalid", id="value-not-a-label-value",
        ),
        pytest.param(
            [{"key": KEY, "effect": "PreferNoSchedule"}], "taints[0].effect",
            "FieldValueNotSupported", id="effect-of-nodes-only",
        ),
        pytest.param([{"key": KEY}], "taints[0].effect", "FieldValueRequired", id="no-effect"),
        pytest.param(
            [{"key": f"{KEY}{i}", "effect": "None"} for i in range(17)], "taints",
            "FieldValueTooMany", id="17-taints",
        ),
    ],
)  # fmt: skip
def test_the_stand_in_refuses_taints_the_real_server_refuses(
    device_taints: list[Object], field: str, kind: str
) -> None:
    errors = validate_resource_slice(one_device_slice(device_taints), None)
    assert [(e.field, e.type) for e in errors] == [(f"spec.devices[0].{field}", kind)]


def test_the_stand_in_takes_16_taints_with_values() -> None:
    device_taints = [{"key": f"{KEY}{i}", "value": "v.1_x", "effect": "None"} for i in range(16)]
    assert validate_resource_slice(one_device_slice(device_taints), None) == []


@pytest.mark.parametrize(
    "junk",
    [
        pytest.param({"taints": "x"}, id="taints-not-a-list"),
        pytest.param({"taints": ["x", {"key": [1], "timeAdded": {}}]}, id="taints-not-objects"),
        pytest.param({"name": ["unhashable"]}, id="name-not-a-string"),
    ],
)
def test_a_held_slice_of_the_wrong_shape_is_written_over(junk: Object) -> None:
    items = held(taints(1))
    items[0]["spec"]["devices"][1].update(junk)
    items[0]["spec"]["devices"].append("not a device")
    plan = plan_slices(items, OWNER, DRIVER, POOL, taints(1))
    assert device_taints(plan.update)[NAMES[1]] == [{"key": KEY, "effect": "NoSchedule"}]
