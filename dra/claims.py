"""What a ResourceClaim asks of this driver on this node, read from the claim the API server
returns. Pure: a JSON object in, typed values or a ClaimError naming the fix out.

The kubelet names only namespace, name and UID; the allocation the scheduler wrote into
`status.allocation.devices.results[]` says which devices, for which request, from which pool.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

from hostdev.untrusted import quote_untrusted

POD_CLAIM_NAME_ANNOTATION = "resource.kubernetes.io/pod-claim-name"
EXTENDED_RESOURCE_CLAIM_ANNOTATION = "resource.kubernetes.io/extended-resource-claim"
"""Set to "true" on the claim the scheduler creates for a pod's extended resources backed by DRA
(KEP-5004; `resourceapi.ExtendedResourceClaimAnnotation` in k8s.io/api/resource/v1, written by
`preFilterExtendedResources` in kubernetes/kubernetes
pkg/scheduler/framework/plugins/dynamicresources/extendeddynamicresources.go). Such a claim has
`generateName: <pod>-extended-resources-`, the pod as its controlling owner, no pod-claim-name
annotation, and one request per container and extended resource named
`container-<container index>-request-<index of the resource among the container's sorted
requests>` (init containers counted first), each `exactly{deviceClassName, count}`."""
API_MAX_RESULTS = 32
"""`AllocationResultsMaxSize` (k8s.io/api/resource/v1): the API server refuses more results."""
MAX_RESULTS = 4 * API_MAX_RESULTS
"""Room for the API to grow its limit; beyond it the answer is refused."""
MAX_TEXT = 1024
"""Names in a claim are DNS labels or subdomains (at most 253 characters), requests at most
`request/subrequest`."""
_DNS_LABEL = r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?"
_REQUEST_NAME = re.compile(rf"{_DNS_LABEL}(/{_DNS_LABEL})?")
"""What the API allows in a result's `request` (k8s.io/kubernetes pkg/apis/resource/validation):
a request name, or `<request>/<subrequest>` for the subrequest of a prioritized-list request that
was allocated; each a DNS label. Request names become metadata paths."""
_POD_CLAIM_NAME = re.compile(_DNS_LABEL)
"""`pod.spec.resourceClaims[].name` as the API allows it; it becomes the metadata's path in the
container."""


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
    extended_resources: bool = False
    """Made by the scheduler for a pod's extended resources (a launcher pod of a `deviceName`
    VMI): its container finds the devices in `PCI_RESOURCE_<NAME>`, as from the device plugin."""


def parse_allocation(claim: object, ref: ClaimRef, driver: str, pool: str) -> ClaimAllocation:
    """The devices `driver` must prepare for `ref` from `pool`, checked against the claim. Total
    over any JSON value: whatever the API server sent, a ClaimAllocation or a ClaimError."""
    document = _object(claim, ref, "the claim")
    metadata = _object(document.get("metadata"), ref, "metadata", required=True)
    uid = _text(metadata.get("uid"), ref, "metadata.uid")
    if uid != ref.uid:
        raise ClaimError(
            f"{ref}: the API server holds a claim of that name with uid {quote_untrusted(uid)};"
            " the claim was deleted and recreated, so the kubelet's request is stale and the"
            " pod must be recreated"
        )
    generation = metadata.get("generation", 0)
    if generation is None:
        generation = 0
    if not isinstance(generation, int) or isinstance(generation, bool) or generation < 0:
        raise _malformed(ref, "metadata.generation", generation, "a non-negative integer")
    annotations = _object(metadata.get("annotations"), ref, "metadata.annotations")
    pod_claim_name = annotations.get(POD_CLAIM_NAME_ANNOTATION)
    if pod_claim_name is not None:
        pod_claim_name = _pod_claim_name(pod_claim_name, ref)
    extended_resources = annotations.get(EXTENDED_RESOURCE_CLAIM_ANNOTATION) == "true"
    status = _object(document.get("status"), ref, "status")
    allocation = _object(status.get("allocation"), ref, "status.allocation")
    if not allocation:
        raise ClaimError(
            f"{ref}: not allocated yet; the scheduler allocates it before the pod runs"
        )
    devices = _object(allocation.get("devices"), ref, "status.allocation.devices")
    results = devices.get("results")
    field = "status.allocation.devices.results"
    if results is None:
        results = []
    if not isinstance(results, list):
        raise _malformed(ref, field, results, "a list")
    if len(results) > MAX_RESULTS:
        raise ClaimError(
            f"{ref}: its allocation lists {len(results)} devices; the API allows at most"
            f" {API_MAX_RESULTS} and this driver reads at most {MAX_RESULTS}: refused (is"
            " something other than the API server answering?)"
        )
    parsed = [_result(r, ref, f"{field}[{i}]") for i, r in enumerate(results)]
    ours = [
        _checked_request(r, ref, f"{field}[{i}]")
        for i, r in enumerate(parsed)
        if r.driver == driver
    ]
    if not ours:
        drivers = sorted({r.driver for r in parsed}) or ["none"]
        raise ClaimError(
            f"{ref}: its allocation names no device of driver {driver} (drivers: "
            f"{quote_untrusted(', '.join(drivers))}); the kubelet sent it to the wrong driver"
        )
    elsewhere = sorted({r.pool for r in ours if r.pool != pool})
    if elsewhere:
        raise ClaimError(
            f"{ref}: allocated devices from pool {quote_untrusted(', '.join(elsewhere))}, not"
            f" from this node's pool {pool}; the claim belongs to another node (check"
            " --node-name)"
        )
    return ClaimAllocation(
        ref=ref,
        generation=generation,
        pod_claim_name=pod_claim_name,
        devices=tuple(Allocated(request=r.request, pool=pool, device=r.device) for r in ours),
        extended_resources=extended_resources,
    )


@dataclass(frozen=True, slots=True)
class _Result:
    driver: str
    pool: str
    request: str
    device: str


def _checked_request(result: _Result, ref: ClaimRef, field: str) -> _Result:
    if not _REQUEST_NAME.fullmatch(result.request):
        raise ClaimError(
            f"{ref}: {field}.request is {quote_untrusted(result.request, 80)}: not a request"
            " name the API allows (a DNS label, or <request>/<subrequest> for a subrequest of a"
            " prioritized-list request); it would become a metadata path, so it is refused; the"
            " API server never sends this; something other than the API server answered"
        )
    return result


def _pod_claim_name(value: object, ref: ClaimRef) -> str:
    field = f"metadata.annotations[{POD_CLAIM_NAME_ANNOTATION}]"
    name = _text(value, ref, field)
    if not _POD_CLAIM_NAME.fullmatch(name):
        # Not the API's own check: users may edit a claim's annotations.
        raise ClaimError(
            f"{ref}: {field} is {quote_untrusted(name, 80)}: not a pod's claim name (a DNS"
            " label, as pod.spec.resourceClaims[].name); it would become the metadata's path in"
            " the container, so it is refused; the claim controller sets it for a claim made"
            " from a template: remove or correct the annotation and recreate the pod"
        )
    return name


def _result(value: object, ref: ClaimRef, field: str) -> _Result:
    result = _object(value, ref, field, required=True)
    texts = {
        name: _text(result.get(name), ref, f"{field}.{name}", required=False)
        for name in ("driver", "pool", "request", "device")
    }
    if texts["driver"] and not (texts["request"] and texts["device"]):
        raise ClaimError(f"{ref}: the allocation result {field} lacks its request or device name")
    return _Result(**texts)


def _object(
    value: object, ref: ClaimRef, field: str, *, required: bool = False
) -> Mapping[str, object]:
    if value is None and not required:
        return {}
    if not isinstance(value, dict):
        raise _malformed(ref, field, value, "an object")
    return value


def _text(value: object, ref: ClaimRef, field: str, *, required: bool = True) -> str:
    if value is None and not required:
        return ""
    if not isinstance(value, str) or (required and not value):
        raise _malformed(ref, field, value, "a non-empty string")
    if len(value) > MAX_TEXT or not (value.isascii() and value.isprintable()):
        raise ClaimError(
            f"{ref}: {field} is {quote_untrusted(value, 80)}: longer than {MAX_TEXT} characters"
            " or with characters the API allows in no name; refused"
        )
    return value


def _malformed(ref: ClaimRef, field: str, value: object, expected: str) -> ClaimError:
    return ClaimError(
        f"{ref}: the claim's {field} is {_json_kind(value)}, not {expected}; the API server never"
        " sends that shape: refused (is something other than the API server answering?)"
    )


def _json_kind(value: object) -> str:
    if value is None:
        return "missing"
    kinds = {bool: "a boolean", int: "a number", float: "a number", str: "a string"}
    kinds |= {list: "a list", dict: "an object"}
    return kinds.get(type(value), type(value).__name__)
