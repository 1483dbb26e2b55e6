"""Reading a claim's allocation for this driver and node, and refusing what is not ours."""

from __future__ import annotations

from typing import Any

import pytest

from dra.claims import ClaimError, ClaimRef, parse_allocation

DRIVER = "vfio.kubevirt-iommufd.io"
REF = ClaimRef("vms", "gpu-claim", "4f1c7d2e-0000-4000-8000-000000000001")


def claim(results: list[dict[str, str]], uid: str = REF.uid, **metadata: Any) -> dict[str, Any]:
    return {
        "metadata": {"name": REF.name, "namespace": REF.namespace, "uid": uid, **metadata},
        "status": {"allocation": {"devices": {"results": results}}},
    }


def result(
    device: str, pool: str = "node-a", driver: str = DRIVER, request: str = "gpu"
) -> dict[str, str]:
    return {"request": request, "driver": driver, "pool": pool, "device": device}


def test_our_results_are_read_and_others_ignored() -> None:
    allocation = parse_allocation(
        claim(
            [result("pci-0000-65-00-0"), result("gpu-0", driver="gpu.nvidia.com")],
            generation=2,
            annotations={"resource.kubernetes.io/pod-claim-name": "gpus"},
        ),
        REF,
        DRIVER,
        "node-a",
    )
    assert [(d.request, d.device) for d in allocation.devices] == [("gpu", "pci-0000-65-00-0")]
    assert allocation.generation == 2 and allocation.pod_claim_name == "gpus"


@pytest.mark.parametrize(
    ("document", "words"),
    [
        (claim([result("pci-0000-65-00-0")], uid="other"), "uid 'other'"),
        ({"metadata": {"uid": REF.uid}, "status": {}}, "not allocated yet"),
        (claim([result("gpu-0", driver="gpu.nvidia.com")]), "no device of driver"),
        (claim([result("pci-0000-65-00-0", pool="node-b")]), "pool 'node-b'"),
        (claim([{"driver": DRIVER, "pool": "node-a"}]), "lacks its request or device"),
    ],
    ids=["uid-mismatch", "unallocated", "other-driver", "other-node", "incomplete"],
)
def test_claims_we_cannot_prepare_name_the_claim_and_the_fix(
    document: dict[str, Any], words: str
) -> None:
    with pytest.raises(ClaimError) as caught:
        parse_allocation(document, REF, DRIVER, "node-a")
    assert words in str(caught.value)
    assert "vms/gpu-claim" in str(caught.value)


def allocated(results: object) -> dict[str, Any]:
    return {
        "metadata": {"uid": REF.uid},
        "status": {"allocation": {"devices": {"results": results}}},
    }


def with_metadata(**fields: object) -> dict[str, Any]:
    document = claim([result("pci-0000-65-00-0")])
    document["metadata"].update(fields)
    return document


@pytest.mark.parametrize(
    ("document", "words"),
    [
        ([], "the claim is a list, not an object"),
        ("claim", "the claim is a string, not an object"),
        ({"status": {}}, "metadata is missing, not an object"),
        ({"metadata": []}, "metadata is a list, not an object"),
        ({"metadata": {"uid": 7}}, "metadata.uid is a number, not a non-empty string"),
        (with_metadata(generation="abc"), "metadata.generation is a string, not a non-negative"),
        (with_metadata(generation=True), "metadata.generation is a boolean"),
        (with_metadata(generation=-1), "metadata.generation is a number, not a non-negative"),
        (with_metadata(annotations=["a"]), "metadata.annotations is a list, not an object"),
        (
            with_metadata(annotations={"resource.kubernetes.io/pod-claim-name": 3}),
            "pod-claim-name] is a number, not a non-empty string",
        ),
        (
            with_metadata(annotations={"resource.kubernetes.io/pod-claim-name": "gpu\x00s"}),
            "'gpu\\x00s': longer than 1024 characters or with characters",
        ),
        ({"metadata": {"uid": REF.uid}, "status": "x"}, "status is a string, not an object"),
        (
            {"metadata": {"uid": REF.uid}, "status": {"allocation": [1]}},
            "status.allocation is a list, not an object",
        ),
        (
            {"metadata": {"uid": REF.uid}, "status": {"allocation": {"devices": 1}}},
            "status.allocation.devices is a number, not an object",
        ),
        (allocated("pci-0000-65-00-0"), "results is a string, not a list"),
        (allocated({"0": result("x")}), "results is an object, not a list"),
        (allocated([["x"]]), "results[0] is a list, not an object"),
        (allocated([None]), "results[0] is missing, not an object"),
        (allocated([{**result("x"), "device": 65}]), "results[0].device is a number"),
        (allocated([{**result("x"), "driver": ["d"]}]), "results[0].driver is a list"),
        (allocated([result("pci\x00-65")]), "'pci\\x00-65': longer than 1024"),
        (allocated([result("p" * 2000)]), "longer than 1024 characters"),
        (allocated([result(f"pci-{i}") for i in range(129)]), "lists 129 devices; the API allows"),
    ],
    ids=[
        "list",
        "string",
        "no-metadata",
        "metadata-list",
        "uid-number",
        "generation-abc",
        "generation-bool",
        "generation-negative",
        "annotations-list",
        "pod-claim-name-number",
        "pod-claim-name-nul",
        "status-string",
        "allocation-list",
        "devices-number",
        "results-string",
        "results-object",
        "result-list",
        "result-null",
        "device-number",
        "driver-list",
        "device-nul",
        "device-long",
        "too-many-results",
    ],
)
def test_a_claim_of_the_wrong_shape_is_its_own_error_naming_the_field(
    document: object, words: str
) -> None:
    with pytest.raises(ClaimError) as caught:
        parse_allocation(document, REF, DRIVER, "node-a")
    assert words in str(caught.value)
    assert str(caught.value).startswith(str(REF))


def test_as_many_results_as_the_api_allows_are_read() -> None:
    results = [result(f"pci-{i}", request=f"r{i}") for i in range(128)]
    allocation = parse_allocation(claim(results), REF, DRIVER, "node-a")
    assert len(allocation.devices) == 128


@pytest.mark.parametrize(
    "request_name",
    ["gpu", "gpu-2", "0", "a" * 63, "gpu/high-memory", "gpu/0"],
)
def test_request_names_the_api_allows_are_read(request_name: str) -> None:
    allocation = parse_allocation(
        claim([result("pci-0000-65-00-0", request=request_name)]), REF, DRIVER, "node-a"
    )
    assert [d.request for d in allocation.devices] == [request_name]


@pytest.mark.parametrize(
    "request_name",
    [
        "/abs/dir",
        "..",
        "../..",
        ".",
        "../4f1c7d2e-0000-4000-8000-000000000002/gpu",
        "gpu/..",
        "gpu/sub/more",
        "gpu/",
        "/gpu",
        "a_b",
        "GPU",
        "-gpu",
        "gpu-",
        "a" * 64,
        "gpu/" + "b" * 64,
        "gpu.x",
        "gpu x",
    ],
)
def test_a_request_name_the_api_never_allows_is_refused(request_name: str) -> None:
    with pytest.raises(ClaimError) as caught:
        parse_allocation(
            claim([result("pci-0000-65-00-0", request=request_name)]), REF, DRIVER, "node-a"
        )
    message = str(caught.value)
    assert message.startswith(f"{REF}: status.allocation.devices.results[0].request is ")
    assert "a DNS label, or <request>/<subrequest>" in message
    assert "the API server never sends this; something other than the API server answered" in (
        message
    )


@pytest.mark.parametrize(
    "pod_claim_name", ["../../../../etc/x", "gpus/x", "..", ".", "GPUs", "a" * 64, "gpu_s", "-g"]
)
def test_a_pod_claim_name_that_is_no_dns_label_is_refused(pod_claim_name: str) -> None:
    document = with_metadata(annotations={"resource.kubernetes.io/pod-claim-name": pod_claim_name})
    with pytest.raises(ClaimError) as caught:
        parse_allocation(document, REF, DRIVER, "node-a")
    message = str(caught.value)
    assert message.startswith(
        f"{REF}: metadata.annotations[resource.kubernetes.io/pod-claim-name] is "
    )
    assert "not a pod's claim name (a DNS label, as pod.spec.resourceClaims[].name)" in message
    assert "recreate the pod" in message
