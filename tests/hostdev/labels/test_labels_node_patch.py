"""`--label-node`: the labels on the Node through the real `kubernetes` client, against the API
server stand-in over HTTPS; only keys under kubevirt-iommufd.io/ are ever sent."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import pytest

from hostdev.labels.node_labels import build_label_patch
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
