"""`kubevirt-iommufd demo --scenario migrate`: a VMI written for the device plugin (`deviceName`)
served by the DRA driver on a simulated node with no cluster, unchanged; then on a device-plugin
node for comparison.

This module is the cluster's side (steps 1-4): the real driver publishes the node's devices and
the DeviceClasses `kubevirt-iommufd dra-classes` prints map the device plugin's resource names
onto them; the real webhook admits the VMI and its launcher pod over HTTPS; the scheduler
stand-in (`sim.scheduler`) writes the extended-resource claim as kube-scheduler does; the
kubelet stand-in prepares it through the driver over gRPC. Inside the pod (steps 5-7):
`demo_migrate_pod`; the device-plugin node (step 8): `demo_migrate_plugin`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from dra.command import DEFAULT_DRIVER
from dra.device_classes import (
    build_device_classes,
    plan_iommufd_resource_names,
    plan_resource_names,
)
from dra.iommufd_slots import slot_index
from hostdev.config import IOMMUFD_RESOURCE, PluginConfig, default_config
from hostdev.pciids import PciIds
from hostdev.scan import scan_host
from kubevirt_iommufd.demo_checks import Checks
from kubevirt_iommufd.demo_dra import (
    NODE,
    attribute_value,
    build_settings,
    check_registered,
    complete_pool,
    prepare_shown,
    running_cluster,
)
from kubevirt_iommufd.demo_migrate_plugin import compare_with_plugin
from kubevirt_iommufd.demo_migrate_pod import InPod, run_in_pod
from kubevirt_iommufd.demo_scenarios import Scenario
from kubevirt_iommufd.demo_templates import build_launcher_pod, build_vmi
from kubevirt_iommufd.demo_webhook import admit, apply_patch
from sim.apiserver import AllocatedDevice, ApiServerStandIn
from sim.dra_kubelet import Claim, DRAKubeletStandIn, PrepareResult
from sim.host import build_tree
from sim.scheduler import (
    ExtendedRequest,
    build_extended_resource_claim,
    build_extended_resource_claim_status,
    plan_extended_requests,
)
from webhook.config import parse_config as parse_webhook_config
from webhook.vmi import HOOK_SIDECARS

Object = dict[str, Any]
HOOK_IMAGE = "registry.example/kubevirt-iommufd:0.1.0"
WEBHOOK_CONFIG = {
    # As manifests/components/hook-sidecar: a `deviceName` VMI gets the hook as on a
    # device-plugin node; `draClaims` is only for VMIs that name claims.
    "hookSidecar": {"enabled": True, "image": HOOK_IMAGE, "args": ["hook", "--cdev-check", "sysfs"]}
}
CLAIM_SUFFIX = "k8w2q"
"""What the API server makes of the claim's generateName."""


@dataclass(frozen=True, slots=True)
class Published:
    """What the driver published and which DeviceClass maps which resource name onto it."""

    resource: str
    """The GPUs' resource name, the device plugin's."""
    devices: dict[str, Object]
    """The slices' entries by device name."""
    classes: dict[str, str]
    """DeviceClass name by extendedResourceName."""


def run_migrate(scenario: Scenario, work: Path, checks: Checks) -> None:
    root = build_tree(scenario.node(), work / "node")
    names = PciIds.find()
    config = _config()
    settings = build_settings(root, work)
    checks.step(1, "a node switched to the DRA driver: its devices, and the DeviceClasses")
    with running_cluster(settings, config) as (api, kubelet, driver):
        if not check_registered(kubelet, driver, checks):
            return
        published = _step_classes(api, config, names, root, checks)
        if published is None:
            return
        vmi, pod = _step_webhook(published.resource, checks)
        claim, requests = _step_schedule(api, pod, published, checks)
        result = _step_prepare(kubelet, claim, requests, checks)
        if result is None:
            return
        compute = [r.request for r in requests if r.container == "compute"]
        ids = [
            i
            for d in result.devices
            if set(d.request_names) & set(compute)
            for i in d.cdi_device_ids
        ]
        served = run_in_pod(
            InPod(scenario, root, work, published.resource, vmi, pod, ids, settings.cdi_dir),
            checks,
        )
    if served:
        compare_with_plugin(scenario, work, names, published.resource, served, checks)


def _config() -> PluginConfig:
    """The shipped configuration, with the hand-off sockets owned by the demo's user (the
    launcher's 107 needs root)."""
    config = default_config()
    iommufd = replace(config.iommufd, socket_uid=os.getuid(), socket_gid=os.getgid())
    return replace(config, iommufd=iommufd)


def _step_classes(
    api: ApiServerStandIn, config: PluginConfig, names: PciIds, root: Path, checks: Checks
) -> Published | None:
    if not api.wait_until(lambda: complete_pool(api.slices(NODE, DEFAULT_DRIVER)), 10):
        checks.check(False, "the pool's slices were published within 10 s")
        return None
    entries = [d for s in api.slices(NODE, DEFAULT_DRIVER) for d in s["spec"]["devices"]]
    devices = {d["name"]: d for d in entries}
    functions = scan_host(root).functions
    resources = [
        *plan_resource_names(config, names, functions),
        *plan_iommufd_resource_names(config),
    ]
    classes = build_device_classes(DEFAULT_DRIVER, resources)
    checks.show(
        "kubevirt-iommufd dra-classes --example hgx-h100 prints (the DRA overlay ships them):"
    )
    selected: dict[str, list[str]] = {}
    for device_class in classes:
        name = device_class["spec"]["extendedResourceName"]
        selected[name] = [
            d["name"]
            for d in entries
            if attribute_value(d["attributes"].get("resourceName", {})) == name
        ]
        checks.show(
            f"  DeviceClass {device_class['metadata']['name']}: extendedResourceName {name},"
            f" selects {len(selected[name])} device(s)"
        )
    gpus = [r for r in selected if r != IOMMUFD_RESOURCE and len(selected[r]) == 8]
    slots = [n for n in devices if slot_index(n) is not None]
    node = api.read("Node", NODE) or {}
    allocatable = node.get("status", {}).get("allocatable", {})
    checks.show(
        f"Node {NODE} status.allocatable: {allocatable or '{}'} (no device plugin runs here)"
    )
    checks.check(
        len(gpus) == 1 and selected.get(IOMMUFD_RESOURCE) == slots and len(slots) == 110,
        f"one class selects the 8 GPUs, {IOMMUFD_RESOURCE}'s the 110 iommufd slots",
    )
    if not gpus:
        return None
    return Published(
        gpus[0],
        devices,
        {c["spec"]["extendedResourceName"]: c["metadata"]["name"] for c in classes},
    )


def _step_webhook(resource: str, checks: Checks) -> tuple[Object, Object]:
    checks.step(2, "the webhook admits the unchanged VMI and its launcher pod (HTTPS)")
    config = parse_webhook_config(WEBHOOK_CONFIG)
    vmi = build_vmi(resource)
    vmi["metadata"]["annotations"].pop(HOOK_SIDECARS)
    devices = vmi["spec"]["domain"]["devices"]
    checks.show(
        "VMI demo/vmi-h100: "
        + ", ".join(
            f"{kind}[].deviceName {d['deviceName']}"
            for kind in ("gpus", "hostDevices")
            for d in devices[kind]
        )
    )
    vmi_patch = admit(config, "/mutate-vmi", vmi)
    vmi = apply_patch(vmi, vmi_patch)
    sidecars = vmi["metadata"].get("annotations", {}).get(HOOK_SIDECARS, "")
    checks.show(f"/mutate-vmi -> {HOOK_SIDECARS}: {sidecars}")
    checks.check(HOOK_IMAGE in sidecars, "the hook sidecar is attached, as on a device-plugin node")
    pod = build_launcher_pod(resource)
    pod = apply_patch(pod, admit(config, "/mutate-pod", pod))
    compute = next(c for c in pod["spec"]["containers"] if c["name"] == "compute")
    limits = compute["resources"]["limits"]
    devices = {k: v for k, v in limits.items() if "/" in k}
    checks.show(f"/mutate-pod -> container compute's device limits: {devices}")
    checks.check(
        limits.get(resource) == "2" and limits.get(IOMMUFD_RESOURCE) == "1",
        f"the launcher pod asks for {resource}: 2 and {IOMMUFD_RESOURCE}: 1, as virt-controller"
        " renders it (with KubeVirt's IOMMUFD gate the second is there already)",
    )
    return vmi, pod


def _step_schedule(
    api: ApiServerStandIn, pod: Object, published: Published, checks: Checks
) -> tuple[Claim, tuple[ExtendedRequest, ...]]:
    checks.step(3, "the scheduler makes the pod's extended-resource claim and allocates it")
    node = api.read("Node", NODE) or {}
    allocatable = {k: int(v) for k, v in node.get("status", {}).get("allocatable", {}).items()}
    requests = plan_extended_requests(pod, published.classes, allocatable)
    name = f"{pod['metadata']['name']}-extended-resources-{CLAIM_SUFFIX}"
    stored = api.put_claim(build_extended_resource_claim(pod, requests, name))
    free = list(api.allocatable(NODE, DEFAULT_DRIVER))
    allocated: list[AllocatedDevice] = []
    for request in requests:
        wanted = [
            d
            for d in free
            if attribute_value(published.devices[d]["attributes"].get("resourceName", {}))
            == request.resource
        ][: request.count]
        free = [d for d in free if d not in wanted]
        allocated += [AllocatedDevice(request.request, DEFAULT_DRIVER, NODE, d) for d in wanted]
    api.set_allocation(pod["metadata"]["namespace"], name, allocated, node_name=NODE)
    annotations = stored["metadata"]["annotations"]
    checks.show(
        f"ResourceClaim {name} (owner Pod {pod['metadata']['name']}), annotations {annotations}"
    )
    for request in requests:
        devices = [a.device for a in allocated if a.request == request.request]
        checks.show(
            f"  {request.request}: {request.count} x {request.device_class}"
            f" ({request.container}'s {request.resource}) -> {', '.join(devices)}"
        )
    left = sorted(
        r
        for r in pod["spec"]["containers"][0]["resources"]["requests"]
        if r.startswith("devices.kubevirt.io/") and r not in published.classes
    )
    checks.show(
        f"  {', '.join(left)}: no DeviceClass names them; virt-handler's device plugins serve them"
    )
    status = build_extended_resource_claim_status(name, requests)
    checks.show(f"pod status.extendedResourceClaimStatus.resourceClaimName: {name}")
    for mapping in status["requestMappings"]:
        checks.show(
            f"  requestMappings: {mapping['containerName']} {mapping['resourceName']}"
            f" -> {mapping['requestName']}"
        )
    checks.check(
        sorted((r.resource, r.count) for r in requests)
        == sorted([(published.resource, 2), (IOMMUFD_RESOURCE, 1)])
        and len(allocated) == 3,
        "one request per resource of container compute: 2 GPUs and 1 iommufd slot allocated",
    )
    return Claim(pod["metadata"]["namespace"], stored["metadata"]["uid"], name), requests


def _step_prepare(
    kubelet: DRAKubeletStandIn, claim: Claim, requests: tuple[ExtendedRequest, ...], checks: Checks
) -> PrepareResult | None:
    checks.step(4, "the kubelet prepares the claim through the driver: NodePrepareResources (gRPC)")
    result = prepare_shown(kubelet, claim, checks)
    if result is None:
        return None
    by_request = {
        r.request: sum(1 for d in result.devices if r.request in d.request_names) for r in requests
    }
    checks.check(
        by_request == {r.request: r.count for r in requests},
        "each request's devices prepared, each with its CDI devices",
    )
    return result
