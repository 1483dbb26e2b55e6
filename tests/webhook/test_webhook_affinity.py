"""/mutate-vmi: a VMI requiring iommufd gets a required node affinity on the iommufd node label,
ANDed into what its owner wrote; patches applied with jsonpatch, as the API server would."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from launcher_hook.model import ANNOTATION_MODE
from webhook.affinity import MODE_ANNOTATION
from webhook.config import Config, HookSidecar
from webhook.review import review_vmi
from webhook_kit import admission_review, apply_patch, decode_patch, load

Json = dict[str, Any]
LABEL = "kubevirt-iommufd.io/iommufd"
OURS = {"key": LABEL, "operator": "In", "values": ["true"]}
ZONE = {"key": "topology.kubernetes.io/zone", "operator": "In", "values": ["a", "b"]}
GPU_NODES = {"key": "nvidia.com/gpu.present", "operator": "Exists"}
DEFAULT = Config()


def requiring(**spec: Any) -> Json:
    vmi = load("vmi-gpu.yaml")
    vmi["metadata"]["annotations"][MODE_ANNOTATION] = "require"
    vmi["spec"].update(spec)
    return vmi


def review(vmi: Json, config: Config = DEFAULT) -> Json:
    verdict = review_vmi(admission_review(vmi, kind="VirtualMachineInstance"), config)
    return verdict.review


def required_terms(vmi: Json) -> list[Json]:
    node_affinity = vmi["spec"]["affinity"]["nodeAffinity"]
    terms = node_affinity["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    assert isinstance(terms, list)
    return terms


def test_the_annotation_is_the_one_the_hook_reads() -> None:
    assert MODE_ANNOTATION == ANNOTATION_MODE


def test_no_affinity_gets_a_single_required_term() -> None:
    vmi = requiring()

    answer = review(vmi)

    patched = apply_patch(vmi, answer)
    assert required_terms(patched) == [{"matchExpressions": [OURS]}]
    expected = copy.deepcopy(vmi)
    expected["spec"]["affinity"] = patched["spec"]["affinity"]
    assert patched == expected
    assert "warnings" not in answer["response"]


def test_requirement_is_anded_into_every_existing_term() -> None:
    fields = {"key": "metadata.name", "operator": "In", "values": ["node-7"]}
    terms = [{"matchExpressions": [ZONE]}, {"matchFields": [fields]}, {"matchExpressions": []}]
    preferred = [{"weight": 10, "preference": {"matchExpressions": [GPU_NODES]}}]
    affinity = {
        "nodeAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": terms},
            "preferredDuringSchedulingIgnoredDuringExecution": preferred,
        },
        "podAntiAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": []},
    }
    vmi = requiring(affinity=copy.deepcopy(affinity), nodeSelector={"pool": "gpu"})

    patched = apply_patch(vmi, review(vmi))

    assert required_terms(patched) == [
        {"matchExpressions": [ZONE, OURS]},
        {"matchFields": [fields], "matchExpressions": [OURS]},
        {"matchExpressions": [OURS]},
    ]
    node_affinity = patched["spec"]["affinity"]["nodeAffinity"]
    assert node_affinity["preferredDuringSchedulingIgnoredDuringExecution"] == preferred
    assert patched["spec"]["affinity"]["podAntiAffinity"] == affinity["podAntiAffinity"]
    assert patched["spec"]["nodeSelector"] == {"pool": "gpu"}


def test_preferred_only_keeps_the_preference_and_adds_a_required_term() -> None:
    preferred = [{"weight": 50, "preference": {"matchExpressions": [ZONE]}}]
    affinity = {"nodeAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": preferred}}
    vmi = requiring(affinity=affinity)

    patched = apply_patch(vmi, review(vmi))

    node_affinity = patched["spec"]["affinity"]["nodeAffinity"]
    assert node_affinity["preferredDuringSchedulingIgnoredDuringExecution"] == preferred
    assert required_terms(patched) == [{"matchExpressions": [OURS]}]


def test_an_empty_or_null_required_section_gets_the_term() -> None:
    sections: list[Json] = [{}, {"nodeSelectorTerms": None}, {"nodeSelectorTerms": []}]
    for required in sections:
        affinity = {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": required}}
        vmi = requiring(affinity=affinity)
        assert required_terms(apply_patch(vmi, review(vmi))) == [{"matchExpressions": [OURS]}]
    vmi = requiring(affinity=None)
    assert required_terms(apply_patch(vmi, review(vmi))) == [{"matchExpressions": [OURS]}]


@pytest.mark.parametrize(
    "vmi",
    [
        pytest.param(requiring(), id="no-affinity"),
        pytest.param(
            requiring(
                affinity={
                    "nodeAffinity": {
                        "requiredDuringSchedulingIgnoredDuringExecution": {
                            "nodeSelectorTerms": [
                                {"matchExpressions": [ZONE]},
                                {"matchExpressions": [GPU_NODES]},
                            ]
                        }
                    }
                }
            ),
            id="existing-terms",
        ),
    ],
)
def test_a_second_review_changes_nothing(vmi: Json) -> None:
    once = apply_patch(vmi, review(vmi))

    again = review_vmi(admission_review(once, kind="VirtualMachineInstance"), DEFAULT)

    assert decode_patch(again.review) == []
    assert again.outcome == "unchanged"
    assert "already" in again.reason


def test_only_the_terms_without_the_requirement_get_it() -> None:
    terms = [{"matchExpressions": [ZONE, OURS]}, {"matchExpressions": [GPU_NODES]}]
    required = {"nodeSelectorTerms": copy.deepcopy(terms)}
    vmi = requiring(
        affinity={"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": required}}
    )

    answer = review(vmi)

    assert len(decode_patch(answer)) == 1
    assert required_terms(apply_patch(vmi, answer)) == [
        {"matchExpressions": [ZONE, OURS]},
        {"matchExpressions": [GPU_NODES, OURS]},
    ]


def test_a_node_selector_asking_for_true_is_already_enough() -> None:
    vmi = requiring(nodeSelector={LABEL: "true"})

    answer = review_vmi(admission_review(vmi, kind="VirtualMachineInstance"), DEFAULT)

    assert (answer.outcome, decode_patch(answer.review)) == ("unchanged", [])


@pytest.mark.parametrize(
    ("spec", "why"),
    [
        pytest.param({"nodeSelector": {LABEL: "false"}}, "nodeSelector asks for", id="selector"),
        *[
            pytest.param(
                {
                    "affinity": {
                        "nodeAffinity": {
                            "requiredDuringSchedulingIgnoredDuringExecution": {
                                "nodeSelectorTerms": [
                                    {"matchExpressions": [ZONE]},
                                    {"matchExpressions": [expression]},
                                ]
                            }
                        }
                    }
                },
                "nodeSelectorTerms[1] excludes",
                id=name,
            )
            for name, expression in [
                ("not-in", {"key": LABEL, "operator": "NotIn", "values": ["true"]}),
                ("does-not-exist", {"key": LABEL, "operator": "DoesNotExist"}),
                ("in-false", {"key": LABEL, "operator": "In", "values": ["false"]}),
            ]
        ],
    ],
)
def test_an_incompatible_pin_is_left_alone_with_a_warning(spec: Json, why: str) -> None:
    vmi = requiring(**spec)

    answer = review_vmi(admission_review(vmi, kind="VirtualMachineInstance"), DEFAULT)

    assert decode_patch(answer.review) == []
    assert answer.outcome == "warned"
    assert answer.review["response"]["allowed"] is True
    (warning,) = answer.review["response"]["warnings"]
    assert warning.startswith("kubevirt-iommufd: iommufd.kubevirt.io/mode=require wants a node")
    assert why in warning
    assert "left unchanged" in warning


def test_compatible_expressions_on_the_label_are_kept_and_anded() -> None:
    either = {"key": LABEL, "operator": "In", "values": ["true", "false"]}
    exists = {"key": LABEL, "operator": "Exists"}
    terms = [{"matchExpressions": [either]}, {"matchExpressions": [exists]}]
    required = {"nodeSelectorTerms": terms}
    vmi = requiring(
        affinity={"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": required}}
    )

    assert required_terms(apply_patch(vmi, review(vmi))) == [
        {"matchExpressions": [either, OURS]},
        {"matchExpressions": [exists, OURS]},
    ]


@pytest.mark.parametrize("mode", [None, "auto", "disable", "REQUIRE"])
def test_other_modes_get_no_affinity(mode: str | None) -> None:
    vmi = load("vmi-gpu.yaml")
    if mode is not None:
        vmi["metadata"]["annotations"][MODE_ANNOTATION] = mode

    answer = review_vmi(admission_review(vmi, kind="VirtualMachineInstance"), DEFAULT)

    assert decode_patch(answer.review) == []


def test_sidecar_and_affinity_come_in_one_patch() -> None:
    config = Config(hook_sidecar=HookSidecar(image="ghcr.io/kubevirt-iommufd/kubevirt-iommufd:v1"))
    vmi = requiring()

    answer = review_vmi(admission_review(vmi, kind="VirtualMachineInstance"), config)

    patched = apply_patch(vmi, answer.review)
    assert "hooks.kubevirt.io/hookSidecars" in patched["metadata"]["annotations"]
    assert required_terms(patched) == [{"matchExpressions": [OURS]}]
    assert answer.reason.startswith("added hook sidecar for")


def test_an_opted_out_vmi_gets_no_affinity() -> None:
    vmi = requiring()

    answer = review_vmi(
        admission_review(vmi, kind="VirtualMachineInstance"),
        Config(skip_namespaces=frozenset({"vms"})),
    )

    assert (answer.outcome, decode_patch(answer.review)) == ("unchanged", [])


def test_a_dra_host_device_is_not_mistaken_for_an_unreadable_one() -> None:
    vmi = requiring()
    devices = vmi["spec"]["domain"]["devices"]
    devices["hostDevices"] = [{"name": "nic", "claimName": "nic-claim", "requestName": "nic"}]
    vmi["spec"]["resourceClaims"] = [{"name": "nic-claim", "resourceClaimName": "nic"}]

    answer = review_vmi(admission_review(vmi, kind="VirtualMachineInstance"), DEFAULT)

    assert answer.outcome == "patched"
    assert required_terms(apply_patch(vmi, answer.review)) == [{"matchExpressions": [OURS]}]


def test_an_unreadable_term_warns_and_changes_nothing() -> None:
    required = {"nodeSelectorTerms": ["not an object"]}
    vmi = requiring(
        affinity={"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": required}}
    )

    answer = review_vmi(admission_review(vmi, kind="VirtualMachineInstance"), DEFAULT)

    assert answer.outcome == "warned"
    assert "nodeSelectorTerms[0] is not an object" in answer.review["response"]["warnings"][0]
    assert decode_patch(answer.review) == []
