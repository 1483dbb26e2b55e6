"""What a ResourceClaim asks of this driver on this node, read from the claim the API server
returns. Pure: a JSON object in, typed values or a ClaimError naming the fix out.

The kubelet names only namespace, name and UID; the allocation the scheduler wrote into
`status.allocation.devices.results[]` says which devices, for which request, from which pool.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

POD_CLAIM_NAME_ANNOTATION = "resource.kubernetes.io/pod-claim-name"


class ClaimError(Exception):
    """A claim this driver cannot prepare; the message names the claim and what to do."""


@dataclass(frozen=True, slots=True)
class ClaimRef:
    """A claim as the kubelet names it."""

    namespace: str
    name: str
    uid: str

    def __str__(self) -> str:
        return f"claim {self.namespace}/{self.name} (uid {self.uid})"


@dataclass(frozen=True, slots=True)
class Allocated:
    """One device of the claim's allocation that this driver must prepare."""

    request: str
    pool: str
    device: str


@dataclass(frozen=True, slots=True)
class ClaimAllocation:
    ref: ClaimRef
    generation: int
    pod_claim_name: str | None
    """The pod's name for a claim made from a template (KubeVirt reads its metadata there)."""
    devices: tuple[Allocated, ...]


def parse_allocation(
    claim: Mapping[str, Any], ref: ClaimRef, driver: str, pool: str
) -> ClaimAllocation:
    """The devices `driver` must prepare for `ref` from `pool`, checked against the claim."""
    metadata = claim.get("metadata") or {}
    if metadata.get("uid") != ref.uid:
        raise ClaimError(
            f"{ref}: the API server holds a claim of that name with uid {metadata.get('uid')!r};"
            " the claim was deleted and recreated, so the kubelet's request is stale and the"
            " pod must be recreated"
        )
    allocation = (claim.get("status") or {}).get("allocation")
    if not allocation:
        raise ClaimError(
            f"{ref}: not allocated yet; the scheduler allocates it before the pod runs"
        )
    results = ((allocation.get("devices") or {}).get("results")) or []
    ours = [r for r in results if r.get("driver") == driver]
    if not ours:
        drivers = sorted({str(r.get("driver")) for r in results}) or ["none"]
        raise ClaimError(
            f"{ref}: its allocation names no device of driver {driver} (drivers: "
            f"{', '.join(drivers)}); the kubelet sent it to the wrong driver"
        )
    elsewhere = sorted({str(r.get("pool")) for r in ours if r.get("pool") != pool})
    if elsewhere:
        raise ClaimError(
            f"{ref}: allocated devices from pool {', '.join(elsewhere)}, not from this node's"
            f" pool {pool}; the claim belongs to another node (check --node-name)"
        )
    devices = tuple(
        Allocated(request=str(r.get("request", "")), pool=pool, device=str(r.get("device", "")))
        for r in ours
    )
    for item in devices:
        if not item.request or not item.device:
            raise ClaimError(f"{ref}: an allocation result lacks its request or device name")
    annotations = metadata.get("annotations") or {}
    return ClaimAllocation(
        ref=ref,
        generation=int(metadata.get("generation") or 0),
        pod_claim_name=annotations.get(POD_CLAIM_NAME_ANNOTATION),
        devices=devices,
    )
