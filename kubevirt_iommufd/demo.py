"""`kubevirt-iommufd demo`: the whole flow on a simulated node, with no cluster and no GPU.

Every part is the real one, over its real transport: the device plugin over gRPC on unix sockets
against the kubelet stand-in, the webhook over HTTPS, the iommufd fd hand-off over its socket,
the launcher hook over its gRPC socket; in the `dra` scenario, the DRA driver instead
(`demo_dra`); in the `migrate` scenario, a VMI written for the device plugin served by the DRA
driver, then by the device plugin for comparison (`demo_migrate`). Each step prints what
happened and checks it; the exit status is 0 only when every check held.
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import tempfile
from pathlib import Path

from hostdev.iommufd_handoff import IommufdHandoff
from hostdev.naming import pci_resource_env
from hostdev.pciids import PciIds
from hostdev.scan import scan_host
from kubevirt_iommufd.demo_checks import Checks, eventually
from kubevirt_iommufd.demo_dra import run_dra
from kubevirt_iommufd.demo_hook import ask_hook, domain_diff, read_decisions
from kubevirt_iommufd.demo_launcher import take_iommufd
from kubevirt_iommufd.demo_migrate import run_migrate
from kubevirt_iommufd.demo_plugin import registered_resources, running_plugin
from kubevirt_iommufd.demo_scenarios import SCENARIOS, Scenario
from kubevirt_iommufd.demo_templates import build_domain, build_launcher_pod, build_vmi
from kubevirt_iommufd.demo_webhook import admit
from kubevirt_iommufd.inspect_report import build_report, render_table
from sim.host import build_tree, hgx_h100
from sim.kubelet import KubeletStandIn
from webhook.config import IOMMUFD_RESOURCE
from webhook.config import parse_config as parse_webhook_config
from webhook.plan import pointer


def run(args: argparse.Namespace) -> int:
    scenario = SCENARIOS[args.scenario]
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.CRITICAL,
        format="      log: %(levelname)s %(name)s %(message)s",
    )
    checks = Checks(scenario.steps)
    print(f"kubevirt-iommufd demo, scenario {args.scenario}: {scenario.description}")
    # Unix socket paths hold 107 bytes: keep the work directory short.
    work = Path(tempfile.mkdtemp(prefix="kid-", dir="/tmp"))
    try:
        if scenario.flow == "dra":
            run_dra(scenario, work, checks)
        elif scenario.flow == "migrate":
            run_migrate(scenario, work, checks)
        else:
            _run(scenario, work, checks)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    if checks.failed:
        print(f"\ndemo FAILED: {len(checks.failed)} check(s) did not hold")
        return 1
    print("\ndemo passed: every step did what it should")
    return 0


def _run(scenario: Scenario, work: Path, checks: Checks) -> None:
    names = PciIds.find()
    root = build_tree(scenario.node(), work / "node")
    checks.step(1, "a simulated node, as `kubevirt-iommufd inspect` sees it")
    inventory = scan_host(root)
    report = build_report(inventory, names)
    gpus = [
        device
        for group in report["groups"]
        for device in group["functions"]
        if device["vendor_id"] == "10de"
    ]
    gpu_groups = [g for g in report["groups"] if any(d in gpus for d in g["functions"])]
    checks.show(render_table({**report, "groups": gpu_groups}))
    node_backend = "iommufd" if scenario.node is hgx_h100 else "legacy"
    checks.check(
        len(gpus) == 8 and all(g["backend"] == node_backend for g in gpus),
        f"8 GPUs assignable over {node_backend}",
    )
    with running_plugin(root, work, names) as (kubelet, handoff):
        resource = _step_plugin(kubelet, checks, iommufd=node_backend == "iommufd")
        if resource is None:
            return
        _step_webhook(resource, checks)
        chosen = _step_allocate(kubelet, handoff, resource, checks, root)
        if chosen:
            _step_hook(scenario, root, work, resource, chosen, checks)


def _step_plugin(kubelet: KubeletStandIn, checks: Checks, *, iommufd: bool) -> str | None:
    checks.step(2, "the device plugin registers with the kubelet and advertises")

    def both_registered() -> bool:
        return len(registered_resources(kubelet)) >= 2

    try:
        kubelet.wait_for(both_registered)
    except AssertionError:
        checks.check(False, "the plugin registered two resources within 5 s")
        return None
    resources = sorted({r.request.resource_name for r in kubelet.registrations})
    for name in resources:
        health = kubelet.health(name)
        healthy = sum(1 for h in health.values() if h == "Healthy")
        checks.show(f"{name}: {len(health)} devices, {healthy} Healthy")
    gpu = next((r for r in resources if r != IOMMUFD_RESOURCE), None)
    named = gpu is not None and gpu.startswith("nvidia.com/")
    if not checks.check(named, "a GPU resource named as NVIDIA's plugin names it"):
        return None
    assert gpu is not None
    checks.check(
        set(kubelet.health(gpu).values()) == {"Healthy"} and len(kubelet.health(gpu)) == 8,
        f"{gpu}: all 8 GPUs Healthy, each with its NUMA node",
    )
    iommufd_health = set(kubelet.health(IOMMUFD_RESOURCE).values())
    where = "" if iommufd else " (no /dev/iommu here: allocatable, for launchers on legacy VFIO)"
    checks.check(iommufd_health == {"Healthy"}, f"{IOMMUFD_RESOURCE}: 110 slots, Healthy{where}")
    return gpu


def _step_webhook(resource: str, checks: Checks) -> None:
    checks.step(3, "the webhook admits the VM's virt-launcher pod (HTTPS, AdmissionReview v1)")
    pod = build_launcher_pod(resource)
    patch = admit(parse_webhook_config({}), "/mutate-pod", pod)
    checks.show("JSON patch: " + json.dumps(patch))
    compute = next(i for i, c in enumerate(pod["spec"]["containers"]) if c["name"] == "compute")
    wanted = [
        {
            "op": "add",
            "path": pointer("spec", "containers", compute, "resources", part, IOMMUFD_RESOURCE),
            "value": "1",
        }
        for part in ("limits", "requests")
    ]
    checks.check(
        patch == wanted,
        f"adds {IOMMUFD_RESOURCE}: 1 to container compute's limits and requests",
    )


def _step_allocate(
    kubelet: KubeletStandIn,
    handoff: IommufdHandoff,
    resource: str,
    checks: Checks,
    root: Path,
) -> list[str]:
    checks.step(4, "the kubelet allocates the pod's devices (gRPC)")
    available = sorted(d for d, h in kubelet.health(resource).items() if h == "Healthy")
    chosen = kubelet.preferred(resource, available, [], 2)
    checks.show(f"GetPreferredAllocation(2 of {len(available)}) -> {', '.join(chosen)}")
    response = kubelet.allocate(resource, chosen).container_responses[0]
    nodes = [d.host_path for d in response.devices]
    env = dict(response.envs)
    checks.show("Allocate -> devices: " + " ".join(nodes))
    checks.show("            env: " + " ".join(f"{k}={v}" for k, v in env.items()))
    checks.check(
        env == {pci_resource_env(resource): ",".join(chosen)},
        "PCI_RESOURCE_* lists the two allocated GPUs, in order",
    )
    iommufd_node = (root / "dev/iommu").exists()
    cdevs = [n for n in nodes if n.startswith("/dev/vfio/devices/")]
    if iommufd_node:
        checks.check(
            len(cdevs) == 2 and "/dev/iommu" in nodes, "hands out each GPU's cdev and /dev/iommu"
        )
    else:
        checks.check(not cdevs, "hands out legacy VFIO nodes only (the node has no cdevs)")
    checks.check(
        "/dev/vfio/vfio" in nodes, "and the legacy group nodes, for launchers on legacy VFIO"
    )
    if iommufd_node:
        _handoff(kubelet, handoff, checks, root)
    else:
        (slot,) = kubelet.allocate(IOMMUFD_RESOURCE, ["iommufd-000"]).container_responses
        checks.show(f"Allocate {IOMMUFD_RESOURCE} -> nothing (this node has no /dev/iommu)")
        checks.check(
            not slot.devices and not slot.mounts,
            "the pod still schedules here and its launcher stays on legacy VFIO",
        )
    return chosen


def _handoff(kubelet: KubeletStandIn, handoff: IommufdHandoff, checks: Checks, root: Path) -> None:
    response = kubelet.allocate(IOMMUFD_RESOURCE, ["iommufd-000"]).container_responses[0]
    (mount,) = response.mounts
    checks.show(
        f"Allocate {IOMMUFD_RESOURCE} -> /dev/iommu and {mount.host_path} mounted at"
        f" {mount.container_path}"
    )
    same = take_iommufd(mount.host_path, root / "dev/iommu")
    checks.check(same, "a launcher-like client received the /dev/iommu fd (SCM_RIGHTS), ACKed")
    checks.check(
        eventually(lambda: not Path(mount.host_path).exists() and handoff.stats().served == 1),
        "the one-shot socket is gone afterwards",
    )


def _step_hook(
    scenario: Scenario, root: Path, work: Path, resource: str, chosen: list[str], checks: Checks
) -> None:
    checks.step(5, "the launcher hook rewrites the domain KubeVirt generated (gRPC sidecar)")
    domain = build_domain(chosen)
    vmi = json.dumps(build_vmi(resource))
    answer = ask_hook(work / "hooks" / "iommufd.sock", root, scenario.libvirt, domain, vmi)
    checks.show(answer.info)
    checks.show(domain_diff(domain.encode(), answer.domain))
    decisions = read_decisions(answer.domain)
    for d in decisions:
        checks.show(f"{d.alias} {d.bdf}: {d.backend} ({d.reason})")
    checks.check(
        len(decisions) == 2 and all(d.backend == scenario.backend for d in decisions),
        f"both GPUs on {scenario.backend}, the decision recorded in <metadata>",
    )
