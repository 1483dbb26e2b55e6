"""`kubevirt-iommufd demo`: the whole flow on a simulated node, with no cluster and no GPU.

Every part is the real one, over its real transport: the device plugin over gRPC on unix sockets
against the kubelet stand-in, the webhook over HTTPS, the iommufd fd hand-off over its socket,
the launcher hook over its gRPC socket; in the `dra` scenario, the DRA driver instead
(`demo_dra`). Each step prints what happened and checks it; the exit status is 0 only when every
check held.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import difflib
import http.client
import json
import logging
import os
import shutil
import socket
import ssl
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import replace
from importlib import resources
from pathlib import Path
from string import Template
from typing import Any

import grpc
import yaml
from lxml import etree

from deviceplugin.manager import PluginManager
from deviceplugin.metrics import PluginMetrics
from hostdev.config import IommufdConfig, default_config
from hostdev.iommufd_handoff import HandoffConfig, IommufdHandoff
from hostdev.naming import pci_resource_env
from hostdev.pciids import PciIds
from hostdev.scan import scan_host
from kubevirt_iommufd.demo_checks import Checks
from kubevirt_iommufd.demo_dra import run_dra
from kubevirt_iommufd.demo_scenarios import SCENARIOS, Scenario
from kubevirt_iommufd.inspect_report import build_report, render_table
from launcher_hook.capabilities import LibvirtVersionSource
from launcher_hook.domain import DECISION_NS
from launcher_hook.handler import HookConfig, define_domain
from launcher_hook.hooks.info import api_pb2 as info_pb2
from launcher_hook.hooks.info import api_pb2_grpc as info_grpc
from launcher_hook.hooks.v1alpha3 import api_pb2 as hooks_pb2
from launcher_hook.hooks.v1alpha3 import api_pb2_grpc as hooks_grpc
from launcher_hook.model import LibvirtVersion, Policy
from launcher_hook.server import HookServer
from sim.host import build_tree, hgx_h100
from sim.kubelet import KubeletStandIn
from webhook.certs import build_serving_certificate
from webhook.config import IOMMUFD_RESOURCE
from webhook.config import parse_config as parse_webhook_config
from webhook.plan import pointer
from webhook.server import WebhookServer


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
    with _plugin(root, work, names) as (kubelet, handoff):
        resource = _step_plugin(kubelet, checks, iommufd=node_backend == "iommufd")
        if resource is None:
            return
        _step_webhook(resource, checks)
        chosen = _step_allocate(kubelet, handoff, resource, checks, root)
        if chosen:
            _step_hook(scenario, root, work, resource, chosen, checks)


@contextmanager
def _plugin(
    root: Path, work: Path, names: PciIds
) -> Iterator[tuple[KubeletStandIn, IommufdHandoff]]:
    kubelet = KubeletStandIn(work / "kubelet")
    kubelet.start()
    socket_dir = work / "fds"
    config = replace(
        default_config(),
        # As the shipped manifests: a node without /dev/iommu keeps the slots allocatable.
        iommufd=IommufdConfig(
            socket_dir=socket_dir,
            socket_uid=os.getuid(),
            socket_gid=os.getgid(),
            without_iommu_legacy=True,
        ),
    )
    handoff = IommufdHandoff(
        HandoffConfig(
            socket_dir=socket_dir, root=root, owner_uid=os.getuid(), owner_gid=os.getgid()
        )
    )
    manager = PluginManager(config, root, kubelet.directory, names, PluginMetrics(), handoff)
    manager.start()
    thread = threading.Thread(target=manager.run, name="demo-plugin", daemon=True)
    thread.start()
    try:
        yield kubelet, handoff
    finally:
        manager.stop()
        handoff.close()
        kubelet.stop()


def _step_plugin(kubelet: KubeletStandIn, checks: Checks, *, iommufd: bool) -> str | None:
    checks.step(2, "the device plugin registers with the kubelet and advertises")

    def both_registered() -> bool:
        return len({r.request.resource_name for r in kubelet.registrations if r.snapshots}) >= 2

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
    pod = _mapping(
        yaml.safe_load(Template(_data("launcher-pod.yaml")).substitute(resource=resource))
    )
    patch = asyncio.run(_admit(pod))
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


async def _admit(pod: dict[str, Any]) -> list[dict[str, Any]]:
    certificate = build_serving_certificate(["127.0.0.1"])
    with tempfile.TemporaryDirectory(prefix="kid-tls-") as tls:
        cert, key = Path(tls) / "tls.crt", Path(tls) / "tls.key"
        cert.write_bytes(certificate.cert_pem)
        key.write_bytes(certificate.key_pem)
        server = WebhookServer(
            parse_webhook_config({}), cert, key, port=0, health_port=0, host="127.0.0.1"
        )
        await server.start()
        try:
            review = {
                "apiVersion": "admission.k8s.io/v1",
                "kind": "AdmissionReview",
                "request": {
                    "uid": str(uuid.uuid4()),
                    "kind": {"group": "", "version": "v1", "kind": "Pod"},
                    "resource": {"group": "", "version": "v1", "resource": "pods"},
                    "namespace": "demo",
                    "operation": "CREATE",
                    "object": pod,
                },
            }
            answer = await asyncio.to_thread(
                _post, server.port, certificate.ca_pem, json.dumps(review).encode()
            )
        finally:
            await server.stop()
    response = answer["response"]
    if "patch" not in response:
        return []
    patch: list[dict[str, Any]] = json.loads(base64.b64decode(response["patch"]))
    return patch


def _post(port: int, ca_pem: bytes, body: bytes) -> dict[str, Any]:
    context = ssl.create_default_context(cadata=ca_pem.decode())
    connection = http.client.HTTPSConnection("127.0.0.1", port, context=context, timeout=10)
    try:
        connection.request(
            "POST", "/mutate-pod", body, headers={"Content-Type": "application/json"}
        )
        answer: dict[str, Any] = json.loads(connection.getresponse().read())
        return answer
    finally:
        connection.close()


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
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as client:
        client.settimeout(5)
        client.connect(mount.host_path)
        _, fds, _, _ = socket.recv_fds(client, 1, 1)
        try:
            same = bool(fds) and os.fstat(fds[0]).st_ino == (root / "dev/iommu").stat().st_ino
        finally:
            for fd in fds:
                os.close(fd)
        client.sendall(b"\x00")
    checks.check(same, "a launcher-like client received the /dev/iommu fd (SCM_RIGHTS), ACKed")
    checks.check(
        _eventually(lambda: not Path(mount.host_path).exists() and handoff.stats().served == 1),
        "the one-shot socket is gone afterwards",
    )


def _step_hook(
    scenario: Scenario, root: Path, work: Path, resource: str, chosen: list[str], checks: Checks
) -> None:
    checks.step(5, "the launcher hook rewrites the domain KubeVirt generated (gRPC sidecar)")
    config = HookConfig(
        policy=Policy.AUTO,
        root=root,
        libvirt=LibvirtVersionSource(None, LibvirtVersion.parse(scenario.libvirt, "demo")),
    )
    server = HookServer(
        work / "hooks" / "iommufd.sock", "iommufd", lambda d, v: define_domain(d, v, config)
    )
    server.start()
    waiter = threading.Thread(target=server.wait, daemon=True)
    waiter.start()
    domain = Template(_data("domain.xml")).substitute(hostdevs=_hostdevs(chosen))
    vmi = Template(_data("vmi.json")).substitute(resource=resource)
    try:
        with grpc.insecure_channel(f"unix://{server.socket_path}") as channel:
            info = info_grpc.InfoStub(channel).Info(info_pb2.InfoParams(), timeout=5)
            checks.show(
                f"Info -> name {info.name}, versions {', '.join(info.versions)}, hook points "
                + ", ".join(p.name for p in info.hookPoints)
            )
            callbacks = hooks_grpc.CallbacksStub(channel)
            result = callbacks.OnDefineDomain(
                hooks_pb2.OnDefineDomainParams(domainXML=domain.encode(), vmi=vmi.encode()),
                timeout=10,
            )
            callbacks.Shutdown(hooks_pb2.ShutdownParams(), timeout=5)
    finally:
        server.stop()
        waiter.join(5)
    # Both through one serializer, so the diff shows what the hook changed, not lxml's spelling.
    before = etree.tostring(etree.fromstring(domain.encode())).decode()
    after = etree.tostring(etree.fromstring(result.domainXML)).decode()
    diff = difflib.unified_diff(
        before.splitlines(),
        after.splitlines(),
        "domain.xml (KubeVirt)",
        "domain.xml (hook)",
        lineterm="",
        n=1,
    )
    checks.show("\n".join(diff) or "(no change)")
    decisions = etree.fromstring(result.domainXML).findall(f".//{{{DECISION_NS}}}hostdev")
    for entry in decisions:
        alias, bdf, backend = entry.get("alias"), entry.get("bdf"), entry.get("backend")
        checks.show(f"{alias} {bdf}: {backend} ({entry.get('reason')})")
    checks.check(
        len(decisions) == 2 and all(d.get("backend") == scenario.backend for d in decisions),
        f"both GPUs on {scenario.backend}, the decision recorded in <metadata>",
    )


def _hostdevs(bdfs: list[str]) -> str:
    aliases = ["ua-gpu-gpu1", "ua-hostdevice-gpu2"]
    entries = []
    for alias, bdf in zip(aliases, bdfs, strict=False):
        domain, bus, rest = bdf.split(":")
        slot, function = rest.split(".")
        entries.append(
            '    <hostdev type="pci" managed="no" mode="subsystem">\n'
            "      <source>\n"
            f'        <address type="pci" domain="0x{domain}" bus="0x{bus}" slot="0x{slot}"'
            f' function="0x{function}"></address>\n'
            "      </source>\n"
            f'      <alias name="{alias}"></alias>\n'
            "    </hostdev>"
        )
    return "\n".join(entries)


def _mapping(value: object) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise TypeError(f"expected a mapping, got {type(value).__name__}")
    return value


def _data(name: str) -> str:
    return resources.files("kubevirt_iommufd").joinpath("demo_data", name).read_text()


def _eventually(condition: Callable[[], bool], timeout: float = 2.0) -> bool:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True
