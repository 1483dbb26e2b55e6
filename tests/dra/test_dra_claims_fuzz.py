"""parse_allocation is total: for any JSON value, and for any part of a valid claim replaced by
any JSON value, it returns a ClaimAllocation or raises ClaimError, never anything else."""

from __future__ import annotations

import copy
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from dra.claims import ClaimAllocation, ClaimError, ClaimRef, parse_allocation

DRIVER = "vfio.kubevirt-iommufd.io"
POOL = "node-a"
REF = ClaimRef("vms", "gpu-claim", "4f1c7d2e-0000-4000-8000-000000000001")
VALID: dict[str, Any] = {
    "metadata": {
        "name": REF.name,
        "namespace": REF.namespace,
        "uid": REF.uid,
        "generation": 3,
        "annotations": {"resource.kubernetes.io/pod-claim-name": "gpus"},
    },
    "status": {
        "allocation": {
            "devices": {
                "results": [
                    {"request": "gpu", "driver": DRIVER, "pool": POOL, "device": "pci-0"},
                    {"request": "nic", "driver": "other.example.com", "pool": "p", "device": "n"},
                ]
            }
        }
    },
}

json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats()
    | st.text(max_size=20)
    | st.sampled_from([REF.uid, DRIVER, POOL, "pci-0", "gpu", "\x00", ""]),
    lambda inner: (
        st.lists(inner, max_size=4)
        | st.dictionaries(
            st.sampled_from(
                ["metadata", "status", "allocation", "devices", "results", "uid", "driver", "pool"]
            )
            | st.text(max_size=8),
            inner,
            max_size=4,
        )
    ),
    max_leaves=30,
)


def paths(value: object, prefix: tuple[str | int, ...] = ()) -> list[tuple[str | int, ...]]:
    """Every place in `value` a value sits, the root included."""
    found = [prefix]
    if isinstance(value, dict):
        for key, item in value.items():
            found += paths(item, (*prefix, key))
    elif isinstance(value, list):
        for index, item in enumerate(value):
            found += paths(item, (*prefix, index))
    return found


def replaced(document: object, path: tuple[str | int, ...], value: object) -> object:
    if not path:
        return value
    changed = copy.deepcopy(document)
    parent: Any = changed
    for step in path[:-1]:
        parent = parent[step]
    parent[path[-1]] = value
    return changed


def assert_total(document: object) -> None:
    try:
        outcome = parse_allocation(document, REF, DRIVER, POOL)
    except ClaimError as error:
        assert str(error).startswith(str(REF))
        return
    assert isinstance(outcome, ClaimAllocation)
    assert all(isinstance(d.request, str) and d.request for d in outcome.devices)


def test_the_valid_claim_is_read() -> None:
    outcome = parse_allocation(VALID, REF, DRIVER, POOL)
    assert [d.device for d in outcome.devices] == ["pci-0"]


@settings(max_examples=400, deadline=None)
@given(json_values)
def test_any_json_value_is_a_claim_or_a_claim_error(document: object) -> None:
    assert_total(document)


@settings(max_examples=600, deadline=None)
@given(st.sampled_from(paths(VALID)), json_values)
def test_any_part_of_a_valid_claim_replaced_is_a_claim_or_a_claim_error(
    path: tuple[str | int, ...], value: object
) -> None:
    assert_total(replaced(VALID, path, value))
