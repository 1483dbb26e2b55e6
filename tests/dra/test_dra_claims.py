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
        (claim([result("pci-0000-65-00-0", pool="node-b")]), "pool node-b"),
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
