"""Plan the change to a VMI: our hook sidecar in `hooks.kubevirt.io/hookSidecars` if it wants VFIO,
and the iommufd node affinity if it requires iommufd (`webhook.affinity`).

The annotation's value is a JSON list held in a string; existing entries are kept as they are.
Our entry counts as present when an entry runs the same image repository, whatever its tag or
digest, so a VMI whose owner pinned another release of the hook does not get a second one.
"""

from __future__ import annotations

import json
from typing import Any

from webhook.affinity import plan_iommufd_affinity, refusal, requires_iommufd
from webhook.config import Config, HookSidecar
from webhook.plan import (
    Operation,
    Plan,
    Unintelligible,
    listing,
    mapping,
    pointer,
    quoted_names,
)

HOOK_SIDECARS = "hooks.kubevirt.io/hookSidecars"


def plan_vmi(vmi: object, namespace: str, config: Config) -> Plan:
    """The patch that adds the configured hook sidecar to a VMI asking for managed devices, and
    a required iommufd node affinity to a VMI requiring iommufd (`webhook.affinity`)."""
    if not isinstance(vmi, dict):
        raise Unintelligible("request.object is not an object")
    metadata = vmi.get("metadata")
    if not isinstance(metadata, dict):
        raise Unintelligible("metadata is not an object")
    annotations = mapping(metadata.get("annotations"), "metadata.annotations")
    if not requires_iommufd(annotations):
        return _plan(vmi, metadata, annotations, namespace, config)
    try:
        return _plan(vmi, metadata, annotations, namespace, config)
    except Unintelligible as problem:
        # Warned and let through, the VMI would run without the affinity it relies on.
        raise refusal(problem) from problem


def _plan(
    vmi: dict[str, Any],
    metadata: dict[str, Any],
    annotations: dict[str, Any],
    namespace: str,
    config: Config,
) -> Plan:
    labels = mapping(metadata.get("labels"), "metadata.labels")
    skipped = config.skips(namespace, labels)
    if skipped:
        return Plan((), skipped)
    sidecar = _plan_sidecar(vmi, metadata, annotations, config)
    affinity = plan_iommufd_affinity(vmi, annotations)
    if affinity is None:
        return sidecar
    return Plan(
        sidecar.operations + affinity.operations,
        f"{sidecar.reason}; {affinity.reason}",
        sidecar.warnings + affinity.warnings,
    )


def _plan_sidecar(
    vmi: dict[str, Any], metadata: dict[str, Any], annotations: dict[str, Any], config: Config
) -> Plan:
    sidecar = config.hook_sidecar
    if sidecar is None:
        return Plan((), "hook sidecar injection is off (hookSidecar.enabled)")
    managed = _managed_devices(vmi, config, sidecar.dra_claims)
    if not managed:
        return Plan((), "no managed GPU or host device")
    existing = _sidecars(annotations.get(HOOK_SIDECARS))
    if any(_same_repository(entry, sidecar) for entry in existing):
        return Plan((), f"{HOOK_SIDECARS} already runs {_repository(sidecar.image)}")
    value = json.dumps([*existing, sidecar.entry()], separators=(",", ":"))
    return Plan(
        (_operation(metadata, annotations, value),),
        f"added hook sidecar for {quoted_names(managed)}",
    )


def _managed_devices(vmi: dict[str, Any], config: Config, dra_claims: bool) -> list[str]:
    """The managed device-plugin resources the VMI asks for, and with `dra_claims` its DRA
    devices as `claim <claimName>/<requestName>`."""
    spec = mapping(vmi.get("spec"), "spec")
    domain = mapping(spec.get("domain"), "spec.domain")
    devices = mapping(domain.get("devices"), "spec.domain.devices")
    names: set[str] = set()
    for kind in ("gpus", "hostDevices"):
        for index, device in enumerate(listing(devices.get(kind), f"spec.domain.devices.{kind}")):
            where = f"spec.domain.devices.{kind}[{index}]"
            entry = mapping(device, where)
            name = entry.get("deviceName")
            if name is None and "claimName" in entry:
                if dra_claims:
                    names.add(_claim_request(entry, where))
                continue
            if not isinstance(name, str):
                raise Unintelligible(f"{where}.deviceName is not a string")
            if config.is_managed(name):
                names.add(name)
    return sorted(names)


def _claim_request(entry: dict[str, Any], where: str) -> str:
    """`claim <claimName>/<requestName>` of a DRA device entry (KubeVirt's ClaimRequest, both
    required by its validation)."""
    claim, request = entry.get("claimName"), entry.get("requestName")
    if not isinstance(claim, str) or not isinstance(request, str):
        raise Unintelligible(f"{where}: claimName and requestName are not both strings")
    return f"claim {claim}/{request}"


def _sidecars(annotation: object) -> list[Any]:
    if annotation is None:
        return []
    try:
        entries = json.loads(annotation) if isinstance(annotation, str) else None
    except (ValueError, RecursionError):
        entries = None
    if not isinstance(entries, list):
        raise Unintelligible(f"annotation {HOOK_SIDECARS} is not a JSON list")
    return entries


def _same_repository(entry: object, sidecar: HookSidecar) -> bool:
    if not isinstance(entry, dict) or not isinstance(entry.get("image"), str):
        return False
    return _repository(entry["image"]) == _repository(sidecar.image)


def _repository(image: str) -> str:
    """`registry:5000/org/name:tag@sha256:…` → `registry:5000/org/name`."""
    name = image.partition("@")[0]
    head, slash, last = name.rpartition("/")
    return head + slash + last.partition(":")[0]


def _operation(metadata: dict[str, Any], annotations: dict[str, Any], value: str) -> Operation:
    if not isinstance(metadata.get("annotations"), dict):
        return {"op": "add", "path": "/metadata/annotations", "value": {HOOK_SIDECARS: value}}
    path = pointer("metadata", "annotations", HOOK_SIDECARS)
    return {
        "op": "replace" if HOOK_SIDECARS in annotations else "add",
        "path": path,
        "value": value,
    }
