"""`--label-node`: the labels on the Node through the real `kubernetes` client, against the API
server stand-in over HTTPS; only keys under kubevirt-iommufd.io/ are ever sent."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hostdev.labels.node_labels import NodeShapeError, build_label_patch, build_node_label_patch
from hostdev.labels.node_patch import NodeLabeler
from sim.apiserver import ApiServerStandIn, running_apiserver

NODE = "gpu-node-1"
THEIRS = {
    "kubernetes.io/hostname": NODE,
    "nvidia.com/gpu.present": "true",
    # Under our prefix, but the operator's: it places the plugin DaemonSet.
    "kubevirt-iommufd.io/passthrough": "true",
}
WANTED = {
    "kubevirt-iommufd.io/iommufd": "true",
    "kubevirt-iommufd.io/kernel": "6.12",
    "kubevirt-iommufd.io/iommufd-devices.nvidia.com_2330": "8",
}


@pytest.fixture
def api() -> Iterator[ApiServerStandIn]:
    with running_apiserver() as server:
        yield server


@pytest.fixture
def labeler(api: ApiServerStandIn) -> Iterator[NodeLabeler]:
    with api.api_client() as client:
        labeler = NodeLabeler(client, NODE, retry_first=0.05, retry_max=0.2)
        labeler.start()
        yield labeler
        labeler.close()


def node_labels(api: ApiServerStandIn) -> dict[str, str]:
    node = api.read("Node", NODE)
    assert node is not None
    labels: dict[str, str] = node["metadata"]["labels"]
    return labels


def patches(api: ApiServerStandIn) -> list[Any]:
    return [r.body for r in api.requests if r.method == "PATCH"]


def test_the_patch_names_only_our_keys() -> None:
    gone = "kubevirt-iommufd.io/iommufd-devices.nvidia.com_1db6"
    current = {**THEIRS, "kubevirt-iommufd.io/kernel": "6.12", gone: "2"}
    assert build_label_patch(current, WANTED) == {
        "kubevirt-iommufd.io/iommufd": "true",
        "kubevirt-iommufd.io/iommufd-devices.nvidia.com_2330": "8",
        gone: None,
    }
    assert build_label_patch({**THEIRS, **WANTED}, WANTED) == {}
    assert build_label_patch({**THEIRS, **WANTED}, {}) == dict.fromkeys(WANTED)


NODE_SHAPES = {
    "labels-null": ({"metadata": {"name": NODE, "labels": None}}, WANTED),
    "no-labels": ({"metadata": {"name": NODE}}, WANTED),
    "odd-values": (
        {"metadata": {"labels": {"kubevirt-iommufd.io/kernel": 6.12, "a": [1], "b": None}}},
        WANTED,
    ),
    "labels-a-list": ({"metadata": {"labels": []}}, "metadata.labels is an array, not an object"),
    "labels-a-number": ({"metadata": {"labels": 0}}, "metadata.labels is a number, not an object"),
    "metadata-a-string": ({"metadata": "x"}, "the Node's metadata is a string, not an object"),
    "no-metadata": ({"kind": "Node"}, "the Node's metadata is null or missing, not an object"),
    "a-list": ([{"metadata": {}}], "the answer is an array, not a Node"),
    "null": (None, "the answer is null or missing, not a Node"),
    "a-bool": (False, "the answer is a boolean, not a Node"),
}


@pytest.mark.parametrize("node, expected", NODE_SHAPES.values(), ids=NODE_SHAPES.keys())
def test_the_patch_from_any_answer_is_a_patch_or_says_what_is_wrong(
    node: object, expected: dict[str, str] | str
) -> None:
    if isinstance(expected, dict):
        assert build_node_label_patch(node, WANTED) == expected
    else:
        with pytest.raises(NodeShapeError, match=expected):
            build_node_label_patch(node, WANTED)


KEYS = st.sampled_from(["metadata", "labels", "name", *WANTED, "kubevirt-iommufd.io/vfio-cdev"])
JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=6) | KEYS,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(KEYS, inner, max_size=3),
    max_leaves=10,
)
# Mostly Node-shaped, so the labels themselves are reached, with anything anywhere.
NODES = st.one_of(
    JSON,
    st.fixed_dictionaries({"metadata": JSON}),
    st.fixed_dictionaries({"metadata": st.fixed_dictionaries({"labels": JSON})}),
    st.fixed_dictionaries(
        {"metadata": st.fixed_dictionaries({"labels": st.dictionaries(KEYS, JSON)})}
    ),
)


@settings(max_examples=200, derandomize=True, deadline=None)
@given(node=NODES)
def test_the_patch_is_total_over_any_json(node: object) -> None:
    try:
        patch = build_node_label_patch(node, WANTED)
    except NodeShapeError as error:
        assert "\n" not in str(error)
        return
    assert set(patch) <= {*WANTED, "kubevirt-iommufd.io/vfio-cdev"}
    assert all(value is None or value == WANTED[key] for key, value in patch.items())


def test_labels_are_set_changed_and_taken_off_leaving_others_alone(
    api: ApiServerStandIn, labeler: NodeLabeler
) -> None:
    api.put_node(NODE, {**THEIRS, "kubevirt-iommufd.io/vfio-cdev": "true"})

    labeler.publish(WANTED)

    assert api.wait_until(lambda: node_labels(api) == {**THEIRS, **WANTED})
    (first,) = patches(api)
    assert first == {"metadata": {"labels": {**WANTED, "kubevirt-iommufd.io/vfio-cdev": None}}}
    changed = {**WANTED, "kubevirt-iommufd.io/iommufd": "false"}
    labeler.publish(changed)
    assert api.wait_until(lambda: node_labels(api) == {**THEIRS, **changed})
    assert patches(api)[-1] == {"metadata": {"labels": {"kubevirt-iommufd.io/iommufd": "false"}}}
    assert {r.path for r in api.requests if r.method == "PATCH"} == {f"/api/v1/nodes/{NODE}"}

    labeler.close()

    assert node_labels(api) == THEIRS


def test_an_unchanged_set_sends_no_patch(api: ApiServerStandIn, labeler: NodeLabeler) -> None:
    api.put_node(NODE, {**THEIRS, **WANTED})
    labeler.publish(WANTED)
    assert api.wait_until(lambda: any(r.method == "GET" for r in api.requests))
    labeler.publish(dict(WANTED))
    labeler.close()
    assert [r.method for r in api.requests].count("PATCH") == 1  # only close() removing ours


def test_a_missing_node_is_retried_until_it_is_there(
    api: ApiServerStandIn, labeler: NodeLabeler, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING)
    labeler.publish(WANTED)
    assert api.wait_until(lambda: "no such Node; check --node-name" in caplog.text)
    api.put_node(NODE, THEIRS)
    assert api.wait_until(lambda: node_labels(api) == {**THEIRS, **WANTED})


def test_forbidden_says_which_rbac_is_missing(
    api: ApiServerStandIn, labeler: NodeLabeler, caplog: pytest.LogCaptureFixture
) -> None:
    api.put_node(NODE, THEIRS)
    api.fail_next(2, 403, method="PATCH")
    labeler.publish(WANTED)
    assert api.wait_until(lambda: node_labels(api) == {**THEIRS, **WANTED})
    assert "--label-node needs RBAC to get and patch nodes" in caplog.text


def test_close_with_the_api_away_does_not_hang(api: ApiServerStandIn) -> None:
    api.put_node(NODE, THEIRS)
    with api.api_client() as client:
        labeler = NodeLabeler(client, NODE, retry_first=0.05)
        labeler.start()
        labeler.publish(WANTED)
        assert api.wait_until(lambda: node_labels(api) == {**THEIRS, **WANTED})
        api.stop()
        labeler.close()


def node_answer(metadata: object) -> bytes:
    return json.dumps({"kind": "Node", "apiVersion": "v1", "metadata": metadata}).encode()


HOSTILE_ANSWERS = {
    "labels-a-list": (200, node_answer({"name": NODE, "labels": ["a", "b"]})),
    "labels-a-string": (200, node_answer({"name": NODE, "labels": "a=b"})),
    "labels-a-number": (200, node_answer({"name": NODE, "labels": 7})),
    "labels-a-bool": (200, node_answer({"name": NODE, "labels": True})),
    "metadata-a-list": (200, node_answer([{"name": NODE}])),
    "metadata-null": (200, node_answer(None)),
    "no-metadata": (200, b'{"kind": "Node", "apiVersion": "v1"}'),
    "a-list": (200, b"[]"),
    "a-string": (200, b'"Node"'),
    "null": (200, b"null"),
    "not-json": (200, b"<html>gateway says hello</html>"),
    "not-utf8": (200, b'{"metadata": "\xff\xfe"}'),
    "empty": (200, b""),
    "deeply-nested": (200, b"[" * 100_000 + b"]" * 100_000),
    "500": (500, b'{"kind": "Status", "code": 500}'),
    "409": (409, b'{"kind": "Status", "code": 409, "reason": "Conflict"}'),
    "500-not-json": (500, b"internal error"),
}


@pytest.mark.parametrize("answer", HOSTILE_ANSWERS.values(), ids=HOSTILE_ANSWERS.keys())
def test_a_hostile_node_answer_is_retried_and_later_changes_are_applied(
    api: ApiServerStandIn,
    labeler: NodeLabeler,
    caplog: pytest.LogCaptureFixture,
    answer: tuple[int, bytes],
) -> None:
    caplog.set_level(logging.DEBUG, logger="hostdev.labels.node_patch")
    api.put_node(NODE, THEIRS)
    status, body = answer
    api.answer_next(body, 4, status, method="GET")

    labeler.publish(WANTED)

    assert api.wait_until(lambda: node_labels(api) == {**THEIRS, **WANTED})
    changed = {**WANTED, "kubevirt-iommufd.io/iommufd": "false"}
    labeler.publish(changed)
    assert api.wait_until(lambda: node_labels(api) == {**THEIRS, **changed})
    # Four failures in a row, the same each time: said once, the repeats only at DEBUG.
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1, [r.getMessage() for r in warnings]
    assert f"node labels not applied node={NODE}: get node {NODE}:" in warnings[0].getMessage()
    assert "Traceback" not in caplog.text


@pytest.mark.parametrize("status", [409, 500, 200], ids=["409", "500", "200-not-json"])
def test_a_failed_patch_is_retried(
    api: ApiServerStandIn, labeler: NodeLabeler, status: int
) -> None:
    api.put_node(NODE, THEIRS)
    api.answer_next(b"<html>no</html>", 2, status, method="PATCH")
    labeler.publish(WANTED)
    assert api.wait_until(lambda: node_labels(api) == {**THEIRS, **WANTED})
