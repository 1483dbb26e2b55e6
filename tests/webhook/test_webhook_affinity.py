"""/mutate-vmi: a VMI requiring iommufd gets a required node affinity on the iommufd node label,
ANDed into what its owner wrote; patches applied with jsonpatch, as the API server would."""

from __future__ import annotations

import copy
import json
from typing import Any

import pytest

from launcher_hook.model import ANNOTATION_MODE
from webhook.affinity import MAX_EXPRESSIONS, MAX_TERMS, MODE_ANNOTATION
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
        {"matchExpressions": []},
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


@pytest.mark.parametrize(
    "empty", [{}, {"matchExpressions": []}, {"matchFields": [], "matchExpressions": None}]
)
def test_an_empty_term_selects_no_node_and_stays_empty(empty: Json) -> None:
    # Kubernetes skips an empty term; with the requirement in it, it would admit any iommufd node
    # in any zone, where the owner's other term keeps the VMI to one.
    terms = [{"matchExpressions": [ZONE]}, copy.deepcopy(empty)]
    required = {"nodeSelectorTerms": terms}
    vmi = requiring(
        affinity={"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": required}}
    )

    assert required_terms(apply_patch(vmi, review(vmi))) == [
        {"matchExpressions": [ZONE, OURS]},
        empty,
    ]


REQUIRED_AT = "spec.affinity.nodeAffinity.requiredDuringSchedulingIgnoredDuringExecution"
TERMS_AT = f"{REQUIRED_AT}.nodeSelectorTerms"


def with_terms(*terms: object) -> Json:
    required = {"nodeSelectorTerms": list(terms)}
    return requiring(
        affinity={"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": required}}
    )


def with_labels(labels: object) -> Json:
    vmi = requiring()
    vmi["metadata"]["labels"] = labels
    return vmi


@pytest.mark.parametrize(
    ("vmi", "field"),
    [
        pytest.param(with_terms(None), f"{TERMS_AT}[0] is null", id="null-term"),
        pytest.param(
            with_terms({"matchExpressions": [ZONE]}, "a term"),
            f"{TERMS_AT}[1] is not an object",
            id="string-term",
        ),
        pytest.param(
            with_terms({"matchExpressions": {"key": LABEL}}),
            f"{TERMS_AT}[0].matchExpressions is not a list",
            id="expressions-object",
        ),
        pytest.param(
            with_terms({"matchExpressions": [ZONE], "matchFields": "metadata.name"}),
            f"{TERMS_AT}[0].matchFields is not a list",
            id="fields-string",
        ),
        pytest.param(
            with_terms({"matchExpressions": [ZONE, 7]}),
            f"{TERMS_AT}[0].matchExpressions[1] is not an object",
            id="expression-number",
        ),
        pytest.param(
            with_terms({"matchExpressions": [{"key": LABEL, "operator": "In", "values": "true"}]}),
            f"{TERMS_AT}[0].matchExpressions[0].values is not a list",
            id="values-string",
        ),
        pytest.param(
            with_terms({"matchExpressions": [{"key": LABEL, "operator": "In", "values": [True]}]}),
            f"{TERMS_AT}[0].matchExpressions[0].values is not a list of strings",
            id="values-bool",
        ),
        pytest.param(
            requiring(
                affinity={
                    "nodeAffinity": {
                        "requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": {}}
                    }
                }
            ),
            f"{TERMS_AT} is not a list",
            id="terms-object",
        ),
        pytest.param(
            requiring(
                affinity={"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": []}}
            ),
            f"{REQUIRED_AT} is not an object",
            id="required-list",
        ),
        pytest.param(requiring(affinity=[]), "spec.affinity is not an object", id="affinity-list"),
        pytest.param(
            requiring(nodeSelector={LABEL: True}),
            f"spec.nodeSelector[{LABEL}] is not a string",
            id="selector-bool",
        ),
        pytest.param(requiring(nodeSelector="gpu"), "spec.nodeSelector is not", id="selector"),
        pytest.param(with_labels(["a"]), "metadata.labels is not an object", id="labels-list"),
    ],
)
@pytest.mark.parametrize("config", [DEFAULT, Config(strict=True)], ids=["default", "strict"])
def test_an_unreadable_field_of_a_requiring_vmi_is_refused(
    vmi: Json, field: str, config: Config
) -> None:
    # Let through with a warning, the VMI would run without the affinity it requires.
    answer = review_vmi(admission_review(vmi, kind="VirtualMachineInstance"), config)

    response = answer.review["response"]
    assert (answer.outcome, response["allowed"]) == ("denied", False)
    message = response["status"]["message"]
    assert message.startswith("kubevirt-iommufd: iommufd.kubevirt.io/mode=require, but ")
    assert field in message
    assert "correct that field" in message
    assert "patch" not in response


def test_a_vmi_not_requiring_iommufd_is_not_refused_for_its_affinity() -> None:
    vmi = with_terms(None)
    del vmi["metadata"]["annotations"][MODE_ANNOTATION]

    answer = review_vmi(admission_review(vmi, kind="VirtualMachineInstance"), DEFAULT)

    assert answer.outcome == "unchanged"


@pytest.mark.parametrize(
    ("terms", "count"),
    [
        pytest.param([{}] * 250_000, 250_000, id="250k-empty"),
        pytest.param(
            [{"matchExpressions": [ZONE]}] * (MAX_TERMS + 1), MAX_TERMS + 1, id="one-over"
        ),
    ],
)
def test_more_terms_than_the_limit_are_refused_not_amplified(terms: list[Json], count: int) -> None:
    answer = review_vmi(
        admission_review(with_terms(*terms), kind="VirtualMachineInstance"), DEFAULT
    )

    response = answer.review["response"]
    assert (answer.outcome, response["allowed"]) == ("denied", False)
    message = response["status"]["message"]
    assert f"{TERMS_AT} has {count} terms, over the webhook's limit of {MAX_TERMS}" in message
    assert len(json.dumps(answer.review)) < 2_000


def test_as_many_terms_as_the_limit_are_patched() -> None:
    vmi = with_terms(*[{"matchExpressions": [ZONE]} for _ in range(MAX_TERMS)])

    answer = review(vmi)

    assert (
        required_terms(apply_patch(vmi, answer)) == [{"matchExpressions": [ZONE, OURS]}] * MAX_TERMS
    )


def test_more_expressions_than_the_limit_are_refused() -> None:
    per_term = MAX_EXPRESSIONS // 10 + 1
    vmi = with_terms(*[{"matchExpressions": [ZONE] * per_term}] * 10)

    answer = review_vmi(admission_review(vmi, kind="VirtualMachineInstance"), DEFAULT)

    response = answer.review["response"]
    assert (answer.outcome, response["allowed"]) == ("denied", False)
    assert (
        f"hold {per_term * 10} matchExpressions in all, over the webhook's limit of"
        f" {MAX_EXPRESSIONS}" in response["status"]["message"]
    )
