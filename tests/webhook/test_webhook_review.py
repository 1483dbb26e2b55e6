"""The pure core: AdmissionReview in, answer out, checked by applying the patch with jsonpatch."""

from __future__ import annotations

import copy
import json
import re
from types import MappingProxyType
from typing import Any

import jsonpointer
import pytest

from webhook.config import Config, HookSidecar
from webhook.plan import pointer
from webhook.review import MAX_PATCH_BYTES, BadReview, review_pod, review_vmi
from webhook.vmi import HOOK_SIDECARS
from webhook_kit import (
    IOMMUFD,
    Json,
    admission_review,
    apply_patch,
    as_v1_pod,
    container,
    decode_patch,
    load,
    model_container_names,
    model_resources,
)

DEFAULT = Config()


def with_iommufd(pod: Json, name: str, *, limits: bool = True, requests: bool = True) -> Json:
    """The pod we expect: `pod` with the iommufd resource written into container `name`."""
    expected = copy.deepcopy(pod)
    resources = container(expected, name)["resources"]
    if limits:
        resources.setdefault("limits", {})[IOMMUFD] = "1"
    if requests:
        resources["requests"][IOMMUFD] = "1"
    return expected


@pytest.mark.parametrize(
    ("manifest", "compute_index"),
    [
        pytest.param("pod-gpu.yaml", 0, id="gpu-vmi"),
        pytest.param("pod-hostdevice.yaml", 0, id="hostdevice-vmi"),
        pytest.param("pod-hook-sidecars.yaml", 0, id="hook-sidecars-gpu-in-limits-only"),
        pytest.param("pod-compute-not-first.yaml", 1, id="compute-not-first"),
    ],
)
def test_launcher_pod_with_a_managed_device_gets_iommufd_in_compute_only(
    manifest: str, compute_index: int
) -> None:
    pod = load(manifest)
    answer = review_pod(admission_review(pod), DEFAULT)

    assert answer.outcome == "patched"
    assert answer.review["response"]["allowed"] is True
    patched = apply_patch(pod, answer.review)
    assert patched == with_iommufd(pod, "compute")
    assert patched["spec"]["containers"][compute_index]["name"] == "compute"
    model = as_v1_pod(patched)
    assert model_container_names(model)[compute_index] == "compute"
    limits, requests = model_resources(model, "compute")
    assert limits[IOMMUFD] == requests[IOMMUFD] == "1"
    for name in model_container_names(model):
        if name != "compute":
            assert IOMMUFD not in model_resources(model, name)[0]


@pytest.mark.parametrize(
    "manifest",
    ["pod-gpu.yaml", "pod-hostdevice.yaml", "pod-hook-sidecars.yaml", "pod-compute-not-first.yaml"],
)
def test_reinvocation_on_the_patched_pod_changes_nothing(manifest: str) -> None:
    pod = load(manifest)
    patched = apply_patch(pod, review_pod(admission_review(pod), DEFAULT).review)

    again = review_pod(admission_review(patched), DEFAULT)

    assert again.outcome == "unchanged"
    assert decode_patch(again.review) == []
    assert again.review["response"]["allowed"] is True


@pytest.mark.parametrize(
    ("manifest", "reason"),
    [
        pytest.param("pod-no-devices.yaml", "no managed VFIO resource", id="vmi-without-devices"),
        pytest.param("pod-already-iommufd.yaml", "already has", id="already-has-iommufd"),
    ],
)
def test_launcher_pods_that_need_nothing_get_no_patch(manifest: str, reason: str) -> None:
    answer = review_pod(admission_review(load(manifest)), DEFAULT)

    assert answer.outcome == "unchanged"
    assert reason in answer.reason
    assert answer.review["response"] == {
        "uid": answer.review["response"]["uid"],
        "allowed": True,
    }


def test_a_pod_that_is_not_a_launcher_is_left_alone() -> None:
    pod = load("pod-gpu.yaml")
    del pod["metadata"]["labels"]["kubevirt.io"]

    answer = review_pod(admission_review(pod), DEFAULT)

    assert answer.outcome == "unchanged"
    assert decode_patch(answer.review) == []


@pytest.mark.parametrize("operation", ["UPDATE", "DELETE", "CONNECT"])
def test_only_create_is_mutated(operation: str) -> None:
    answer = review_pod(admission_review(load("pod-gpu.yaml"), operation=operation), DEFAULT)

    assert answer.outcome == "unchanged"
    assert decode_patch(answer.review) == []


def test_compute_without_requests_gets_the_limit_only() -> None:
    pod = load("pod-gpu.yaml")
    del container(pod, "compute")["resources"]["requests"]

    patched = apply_patch(pod, review_pod(admission_review(pod), DEFAULT).review)

    assert patched == with_iommufd(pod, "compute", requests=False)
    as_v1_pod(patched)


def test_a_device_only_in_requests_creates_the_missing_limits() -> None:
    pod = load("pod-gpu.yaml")
    resources = container(pod, "compute")["resources"]
    del resources["limits"]

    patched = apply_patch(pod, review_pod(admission_review(pod), DEFAULT).review)

    assert container(patched, "compute")["resources"]["limits"] == {IOMMUFD: "1"}
    assert container(patched, "compute")["resources"]["requests"][IOMMUFD] == "1"


def test_a_request_without_a_limit_gets_a_limit_of_the_same_quantity() -> None:
    pod = load("pod-gpu.yaml")
    container(pod, "compute")["resources"]["requests"][IOMMUFD] = "2"

    patched = apply_patch(pod, review_pod(admission_review(pod), DEFAULT).review)

    resources = container(patched, "compute")["resources"]
    assert resources["limits"][IOMMUFD] == "2"
    assert resources["requests"][IOMMUFD] == "2"


def test_exact_names_select_resources_outside_the_prefixes() -> None:
    pod = load("pod-hostdevice.yaml")
    for section in container(pod, "compute")["resources"].values():
        del section["nvidia.com/GA102GL_A10"]
    only_qat = Config(resource_names=frozenset({"intel.com/qat_4xxx"}), resource_prefixes=())

    assert review_pod(admission_review(pod), DEFAULT).outcome == "unchanged"
    answer = review_pod(admission_review(pod), only_qat)

    assert answer.outcome == "patched"
    assert "intel.com/qat_4xxx" in answer.reason
    assert apply_patch(pod, answer.review) == with_iommufd(pod, "compute")


def test_a_prefix_never_matches_the_iommufd_resource_itself() -> None:
    pod = load("pod-no-devices.yaml")
    container(pod, "compute")["resources"]["requests"][IOMMUFD] = "1"
    everything_kubevirt = Config(resource_prefixes=("devices.kubevirt.io/",))

    answer = review_pod(admission_review(pod), everything_kubevirt)

    # kvm, tun and vhost-net match the prefix; the iommufd request must not count as "present".
    assert answer.outcome == "patched"
    assert container(apply_patch(pod, answer.review), "compute")["resources"]["limits"][IOMMUFD]


@pytest.mark.parametrize(
    "config",
    [
        pytest.param(Config(skip_namespaces=frozenset({"vms"})), id="namespace"),
        pytest.param(
            Config(skip_labels=MappingProxyType({"app.kubernetes.io/part-of": "inference"})),
            id="vmi-label",
        ),
    ],
)
def test_opted_out_pods_get_no_patch(config: Config) -> None:
    answer = review_pod(admission_review(load("pod-gpu.yaml")), config)

    assert answer.outcome == "unchanged"
    assert "opt" in answer.reason


def test_a_label_opt_out_needs_the_value_too() -> None:
    config = Config(skip_labels=MappingProxyType({"app.kubernetes.io/part-of": "batch"}))

    assert review_pod(admission_review(load("pod-gpu.yaml")), config).outcome == "patched"


def test_response_echoes_uid_api_version_and_kind() -> None:
    review = admission_review(load("pod-gpu.yaml"), uid="705ab4f5-6393-11e8-b7cc-42010a800002")
    review["apiVersion"] = "admission.k8s.io/v1beta1"

    answer = review_pod(review, DEFAULT).review

    assert answer["apiVersion"] == "admission.k8s.io/v1beta1"
    assert answer["kind"] == "AdmissionReview"
    assert answer["response"]["uid"] == "705ab4f5-6393-11e8-b7cc-42010a800002"


@pytest.mark.parametrize(
    "body",
    [
        pytest.param([], id="a-list"),
        pytest.param({"apiVersion": "admission.k8s.io/v1"}, id="no-request"),
        pytest.param({"request": {"operation": "CREATE"}}, id="no-uid"),
        pytest.param({"request": {"uid": ""}}, id="empty-uid"),
        pytest.param({"request": {"uid": 17}}, id="uid-not-a-string"),
    ],
)
def test_a_body_without_request_uid_is_a_bad_review(body: object) -> None:
    with pytest.raises(BadReview):
        review_pod(body, DEFAULT)


def break_containers(pod: Json) -> None:
    pod["spec"]["containers"] = {"compute": {}}


def drop_compute(pod: Json) -> None:
    container(pod, "compute")["name"] = "kompute"


def limits_as_text(pod: Json) -> None:
    container(pod, "compute")["resources"]["limits"] = "nvidia.com/GH100_H100=1"


@pytest.mark.parametrize(
    ("damage", "field"),
    [
        pytest.param(break_containers, "spec.containers", id="containers-not-a-list"),
        pytest.param(drop_compute, "container named compute", id="no-compute-container"),
        pytest.param(limits_as_text, "compute.resources.limits", id="limits-not-an-object"),
    ],
)
def test_a_launcher_pod_we_cannot_read_is_allowed_with_a_warning(damage: Any, field: str) -> None:
    pod = load("pod-gpu.yaml")
    damage(pod)

    answer = review_pod(admission_review(pod), DEFAULT)

    assert answer.outcome == "warned"
    response = answer.review["response"]
    assert response["allowed"] is True
    assert "patch" not in response
    (warning,) = response["warnings"]
    assert field in warning
    assert "\n" not in warning


def test_strict_denies_a_launcher_pod_it_cannot_read() -> None:
    pod = load("pod-gpu.yaml")
    drop_compute(pod)

    answer = review_pod(admission_review(pod), Config(strict=True))

    assert answer.outcome == "denied"
    response = answer.review["response"]
    assert response["allowed"] is False
    assert "compute" in response["status"]["message"]
    assert response["status"]["code"] == 400
    assert "warnings" not in response


def test_a_vmi_sent_to_the_pod_endpoint_warns_about_the_configuration() -> None:
    review = admission_review(load("vmi-gpu.yaml"), kind="VirtualMachineInstance")

    answer = review_pod(review, DEFAULT)

    assert answer.outcome == "warned"
    assert "webhook configuration" in answer.review["response"]["warnings"][0]


def test_a_warning_never_carries_a_line_break_from_the_request() -> None:
    review = admission_review(load("pod-gpu.yaml"))
    review["request"]["kind"]["kind"] = "Pod\nInjected: header"

    (warning,) = review_pod(review, DEFAULT).review["response"]["warnings"]

    assert "\n" not in warning
    assert "Injected" in warning


@pytest.mark.parametrize(
    "keys",
    [["a/b"], ["m~n"], ["~1"], ["/~"], ["spec", "containers", 0, "devices.kubevirt.io/iommufd"]],
)
def test_pointer_escapes_tilde_before_slash(keys: list[str | int]) -> None:
    document: Any = "leaf"
    for key in reversed(keys):
        document = [document] if isinstance(key, int) else {key: document}

    assert jsonpointer.resolve_pointer(document, pointer(*keys)) == "leaf"


def test_the_iommufd_path_is_escaped_as_rfc_6901_says() -> None:
    operations = decode_patch(review_pod(admission_review(load("pod-gpu.yaml")), DEFAULT).review)

    paths = {operation["path"] for operation in operations}
    assert paths == {
        "/spec/containers/0/resources/limits/devices.kubevirt.io~1iommufd",
        "/spec/containers/0/resources/requests/devices.kubevirt.io~1iommufd",
    }


# --- /mutate-vmi -----------------------------------------------------------------------------

SIDECAR = HookSidecar(image="ghcr.io/kubevirt-iommufd/kubevirt-iommufd:v0.2.0")
WITH_SIDECAR = Config(hook_sidecar=SIDECAR)
HOOKS = "hooks.kubevirt.io/hookSidecars"
OURS = {
    "image": "ghcr.io/kubevirt-iommufd/kubevirt-iommufd:v0.2.0",
    "imagePullPolicy": "IfNotPresent",
    "args": ["hook", "--cdev-check", "sysfs"],
}


def vmi_review(vmi: Json, **kwargs: Any) -> Json:
    return admission_review(vmi, kind="VirtualMachineInstance", **kwargs)


def sidecars(vmi: Json) -> list[Any]:
    entries = json.loads(vmi["metadata"]["annotations"][HOOKS])
    assert isinstance(entries, list)
    return entries


def test_the_sidecar_is_off_by_default() -> None:
    answer = review_vmi(vmi_review(load("vmi-gpu.yaml")), DEFAULT)

    assert answer.outcome == "unchanged"
    assert decode_patch(answer.review) == []


def test_a_gpu_vmi_gets_the_sidecar_annotation() -> None:
    vmi = load("vmi-gpu.yaml")

    answer = review_vmi(vmi_review(vmi), WITH_SIDECAR)

    patched = apply_patch(vmi, answer.review)
    assert sidecars(patched) == [OURS]
    expected = copy.deepcopy(vmi)
    expected["metadata"]["annotations"][HOOKS] = patched["metadata"]["annotations"][HOOKS]
    assert patched == expected


def test_existing_sidecars_are_kept_and_ours_appended() -> None:
    vmi = load("vmi-hostdevice-with-sidecar.yaml")
    before = json.loads(vmi["metadata"]["annotations"][HOOKS])

    patched = apply_patch(vmi, review_vmi(vmi_review(vmi), WITH_SIDECAR).review)

    assert sidecars(patched) == [*before, OURS]


def test_a_vmi_without_annotations_gets_the_annotations_map() -> None:
    vmi = load("vmi-gpu.yaml")
    del vmi["metadata"]["annotations"]

    patched = apply_patch(vmi, review_vmi(vmi_review(vmi), WITH_SIDECAR).review)

    assert list(patched["metadata"]["annotations"]) == [HOOKS]
    assert sidecars(patched) == [OURS]


def test_command_is_written_only_when_configured() -> None:
    sidecar = HookSidecar(image="registry:5000/hook:dev", command=("/bin/kubevirt-iommufd",))
    vmi = load("vmi-gpu.yaml")

    patched = apply_patch(vmi, review_vmi(vmi_review(vmi), Config(hook_sidecar=sidecar)).review)

    assert sidecars(patched)[0]["command"] == ["/bin/kubevirt-iommufd"]
    assert sidecars(patched)[0]["image"] == "registry:5000/hook:dev"


@pytest.mark.parametrize("manifest", ["vmi-gpu.yaml", "vmi-hostdevice-with-sidecar.yaml"])
def test_the_sidecar_is_never_added_twice(manifest: str) -> None:
    vmi = load(manifest)
    patched = apply_patch(vmi, review_vmi(vmi_review(vmi), WITH_SIDECAR).review)

    again = review_vmi(vmi_review(patched), WITH_SIDECAR)

    assert again.outcome == "unchanged"
    assert decode_patch(again.review) == []


@pytest.mark.parametrize(
    "image",
    [
        "ghcr.io/kubevirt-iommufd/kubevirt-iommufd:v0.1.0",
        "ghcr.io/kubevirt-iommufd/kubevirt-iommufd@sha256:" + "ab" * 32,
        "ghcr.io/kubevirt-iommufd/kubevirt-iommufd",
    ],
)
def test_another_release_of_our_hook_counts_as_present(image: str) -> None:
    vmi = load("vmi-gpu.yaml")
    vmi["metadata"]["annotations"][HOOKS] = json.dumps([{"image": image}])

    assert review_vmi(vmi_review(vmi), WITH_SIDECAR).outcome == "unchanged"


def test_a_registry_port_is_not_mistaken_for_a_tag() -> None:
    vmi = load("vmi-gpu.yaml")
    vmi["metadata"]["annotations"][HOOKS] = json.dumps([{"image": "registry:5000/other:v1"}])
    config = Config(hook_sidecar=HookSidecar(image="registry:5000/hook:v1"))

    assert review_vmi(vmi_review(vmi), config).outcome == "patched"


def test_a_vmi_without_managed_devices_gets_no_sidecar() -> None:
    assert review_vmi(vmi_review(load("vmi-no-devices.yaml")), WITH_SIDECAR).outcome == "unchanged"


def test_an_unreadable_sidecar_annotation_warns_and_keeps_it() -> None:
    vmi = load("vmi-gpu.yaml")
    vmi["metadata"]["annotations"][HOOKS] = "[{'image': 'single-quoted'}]"

    answer = review_vmi(vmi_review(vmi), WITH_SIDECAR)

    assert answer.outcome == "warned"
    assert HOOKS in answer.review["response"]["warnings"][0]
    assert "patch" not in answer.review["response"]


def test_opted_out_vmi_namespace_gets_no_sidecar() -> None:
    config = Config(hook_sidecar=SIDECAR, skip_namespaces=frozenset({"ml"}))

    answer = review_vmi(vmi_review(load("vmi-hostdevice-with-sidecar.yaml")), config)

    assert answer.outcome == "unchanged"


HOSTILE = "nvidia.com/GA102\n2026-01-01 00:00:00 INFO webhook.routes: pod admitted\x1b[2J"


def hostile_pod(*names: str) -> Json:
    pod = load("pod-gpu.yaml")
    resources = container(pod, "compute")["resources"]
    for name in names:
        resources["limits"][name] = "1"
        resources["requests"][name] = "1"
    return pod


def test_resource_names_in_a_reason_are_quoted_and_cannot_forge_a_line() -> None:
    answer = review_pod(admission_review(hostile_pod(HOSTILE)), DEFAULT)

    assert answer.outcome == "patched"
    assert answer.reason.isprintable()
    assert "'nvidia.com/GA102\\n2026-01-01 00:00:00 INFO webhook.routes: pod admitted\\x1b[2J'" in (
        answer.reason
    )


def test_a_huge_or_numerous_resource_names_make_a_short_reason() -> None:
    names = [f"nvidia.com/{'x' * 100_000}{n}" for n in range(50)]

    answer = review_pod(admission_review(hostile_pod(*names)), DEFAULT)

    assert answer.outcome == "patched"
    assert len(answer.reason) < 1_000
    assert answer.reason.endswith(" more")
    assert "chars]" in answer.reason  # each name cut, saying how much was dropped


def test_device_names_in_a_vmi_reason_are_quoted() -> None:
    vmi = load("vmi-gpu.yaml")
    vmi["spec"]["domain"]["devices"]["gpus"][0]["deviceName"] = HOSTILE
    config = Config(hook_sidecar=HookSidecar(image="ghcr.io/kubevirt-iommufd/kubevirt-iommufd:v1"))

    answer = review_vmi(admission_review(vmi, kind="VirtualMachineInstance"), config)

    assert answer.outcome == "patched"
    assert answer.reason.isprintable()
    assert "\\n2026-01-01" in answer.reason


@pytest.mark.parametrize(
    "operation",
    ["UPDATE\nINFO forged", ["nested"] * 3, {"op": "x"}],
    ids=["string", "list", "object"],
)
def test_an_operation_other_than_create_is_shown_quoted(operation: object) -> None:
    review = admission_review(load("pod-gpu.yaml"))
    review["request"]["operation"] = operation

    answer = review_pod(review, DEFAULT)

    assert answer.outcome == "unchanged"
    assert answer.reason.isprintable()
    assert "is not CREATE" in answer.reason


def test_a_patch_over_the_limit_is_refused_not_sent() -> None:
    # Each emoji of an existing sidecar entry is re-encoded as two escaped surrogates: 4 bytes
    # in, 14 out, so a 320 KB annotation would come back as a patch of over 1 MiB.
    entry = {"image": "registry.example/other-hook:v1", "args": ["\U0001f600" * 80_000]}
    vmi = load("vmi-gpu.yaml")
    vmi["metadata"]["annotations"][HOOK_SIDECARS] = json.dumps([entry], ensure_ascii=False)

    answer = review_vmi(
        admission_review(vmi, kind="VirtualMachineInstance"), Config(hook_sidecar=SIDECAR)
    )

    response = answer.review["response"]
    assert (answer.outcome, response["allowed"]) == ("denied", False)
    assert "patch" not in response
    message = response["status"]["message"]
    assert re.fullmatch(
        r"kubevirt-iommufd: the patch for this VMI would be \d{7} bytes, over the webhook's limit"
        rf" of {MAX_PATCH_BYTES}; added hook sidecar for 'nvidia.com/GH100_H100'",
        message,
    )
