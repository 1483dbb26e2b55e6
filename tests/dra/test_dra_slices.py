"""The pool's slices and the plan that brings the API server's copy to them."""

from __future__ import annotations

from dataclasses import replace
from types import MappingProxyType

import pytest

from dra.slices import (
    MAX_DEVICES_PER_SLICE,
    Owner,
    TypedCache,
    build_slices,
    plan_slices,
    slice_name,
)
from dra_kit import DRIVER
from dra_slices_kit import devices, stored

OWNER = Owner("node-a", "0f0f0f0f-0000-4000-8000-000000000001")


@pytest.mark.parametrize(("count", "slices"), [(0, 1), (1, 1), (128, 1), (129, 2), (4096, 32)])
def test_slices_split_at_128_devices_and_count_themselves(count: int, slices: int) -> None:
    built = build_slices(OWNER, DRIVER, devices(count), 3)
    assert len(built) == slices
    assert sum(len(s["spec"]["devices"]) for s in built) == count
    for index, item in enumerate(built):
        assert len(item["spec"]["devices"]) <= MAX_DEVICES_PER_SLICE
        assert item["spec"]["pool"] == {
            "name": "node-a",
            "generation": 3,
            "resourceSliceCount": slices,
        }
        assert item["spec"]["nodeName"] == "node-a"
        assert item["metadata"]["name"] == f"node-a-{DRIVER}-{index}"
        assert item["metadata"]["ownerReferences"][0]["uid"] == OWNER.uid


def test_first_publication_creates_at_generation_one() -> None:
    plan = plan_slices([], OWNER, DRIVER, devices(130))
    assert plan.generation == 1
    assert len(plan.create) == 2 and not plan.update and not plan.delete


def test_unchanged_pool_needs_nothing() -> None:
    held = stored(build_slices(OWNER, DRIVER, devices(130), 4))
    plan = plan_slices(held, OWNER, DRIVER, devices(130))
    assert plan.empty and plan.generation == 4


def test_a_change_bumps_the_generation_on_every_slice_and_drops_extra_ones() -> None:
    held = stored(build_slices(OWNER, DRIVER, devices(130), 4))
    plan = plan_slices(held, OWNER, DRIVER, devices(5))
    assert plan.generation == 5
    assert [u["metadata"]["resourceVersion"] for u in plan.update] == ["1"]
    assert plan.update[0]["spec"]["pool"]["generation"] == 5
    assert plan.update[0]["spec"]["pool"]["resourceSliceCount"] == 1
    assert plan.delete == ((slice_name("node-a", DRIVER, 1), "2"),)


def test_mixed_generations_left_by_a_crash_are_rewritten_above_the_highest() -> None:
    held = stored(build_slices(OWNER, DRIVER, devices(130), 4))
    held[1]["spec"]["pool"]["generation"] = 7
    plan = plan_slices(held, OWNER, DRIVER, devices(130))
    assert plan.generation == 8 and len(plan.update) == 2


def test_a_slice_edited_by_someone_else_is_written_back() -> None:
    held = stored(build_slices(OWNER, DRIVER, devices(3), 2))
    held[0]["spec"]["devices"].pop()
    plan = plan_slices(held, OWNER, DRIVER, devices(3))
    assert plan.generation == 3 and len(plan.update) == 1


def test_overlong_names_stay_valid_and_distinct() -> None:
    node = "n" * 250
    first, second = slice_name(node, DRIVER, 0), slice_name(node, DRIVER, 1)
    assert len(first) <= 253 and len(second) <= 253 and first != second


def test_a_typed_cache_plans_as_typing_anew_and_shares_only_what_is_unchanged() -> None:
    cache = TypedCache()
    pool = devices(130)
    assert plan_slices([], OWNER, DRIVER, pool, typed=cache) == plan_slices([], OWNER, DRIVER, pool)
    cache.settle()
    first = build_slices(OWNER, DRIVER, pool, 1, typed=cache)
    cache.settle()
    # The first device rebuilt (its function read differently), the rest as they were.
    rebuilt = replace(
        pool[0], attributes=MappingProxyType({**pool[0].attributes, "currentDriver": "nvidia"})
    )
    second = build_slices(OWNER, DRIVER, [rebuilt, *pool[1:]], 2, typed=cache)
    assert second == build_slices(OWNER, DRIVER, [rebuilt, *pool[1:]], 2)
    before, after = first[0]["spec"]["devices"], second[0]["spec"]["devices"]
    assert after[0]["attributes"]["currentDriver"] == {"string": "nvidia"}
    assert after[0]["attributes"] is not before[0]["attributes"]
    kept = zip(after[1:], before[1:], strict=True)
    assert all(a["attributes"] is b["attributes"] for a, b in kept)
