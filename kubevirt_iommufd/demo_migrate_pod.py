"""Inside the launcher pod of `demo --scenario migrate` (steps 5-7): the claim's CDI spec applied
to container `compute` as the container runtime applies it (`sim.container_runtime`), what
virt-launcher then does (its devices from `PCI_RESOURCE_<NAME>`, the iommufd fd from the socket,
`<iommufd enabled='yes' fdgroup='iommu'/>`), and the real launcher hook over its gRPC socket."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lxml import etree

from hostdev.bdf import Bdf
from hostdev.iommufd_handoff import CONTAINER_SOCKET_PATH
from hostdev.iommufd_handoff import LAUNCHER_PUBLIC_DIR as PUBLIC_DIR
from hostdev.naming import pci_resource_env
from hostdev.scan import scan_host
from kubevirt_iommufd.demo_checks import Checks, eventually
from kubevirt_iommufd.demo_hook import ask_hook, domain_diff, read_decisions
from kubevirt_iommufd.demo_launcher import take_iommufd
from kubevirt_iommufd.demo_scenarios import Scenario
from kubevirt_iommufd.demo_templates import build_domain
from sim.container_runtime import ContainerEdits, Mount, UnresolvedDevice, apply_cdi_devices

Object = dict[str, Any]


@dataclass(frozen=True, slots=True)
class InPod:
    scenario: Scenario
    root: Path
    work: Path
    resource: str
    vmi: Object
    """As admitted (the hook attached)."""
    pod: Object
    """As admitted."""
    cdi_ids: list[str]
    """What the kubelet hands the runtime for container `compute`."""
    cdi_dir: Path


@dataclass(frozen=True, slots=True)
class Served:
    """What the VM's container got from DRA, to compare with the device plugin's."""

    bdfs: tuple[str, ...]
    env: dict[str, str]
    device_nodes: tuple[str, ...]
    socket_path: str
    """Where the hand-off socket is in the container."""


def run_in_pod(pod: InPod, checks: Checks) -> Served | None:
    edits = _step_runtime(pod, checks)
    if edits is None:
        return None
    bdfs = tuple(edits.env.get(pci_resource_env(pod.resource), "").split(","))
    domain = _step_launcher(pod, edits, bdfs, checks)
    if domain is None:
        return None
    _step_hook(pod, domain, checks)
    sockets = [m.container_path for m in edits.mounts if m.container_path == CONTAINER_SOCKET_PATH]
    return Served(bdfs, edits.env, edits.device_nodes, sockets[0])


def _step_runtime(pod: InPod, checks: Checks) -> ContainerEdits | None:
    checks.step(5, "the container runtime applies the claim's CDI devices to container compute")
    compute = next(c for c in pod.pod["spec"]["containers"] if c["name"] == "compute")
    volumes = [Mount(m["mountPath"], f"(emptyDir {m['name']})") for m in compute["volumeMounts"]]
    specs = [json.loads(p.read_text()) for p in sorted(pod.cdi_dir.glob("*.json"))]
    try:
        edits = apply_cdi_devices(specs, pod.cdi_ids, volumes)
    except UnresolvedDevice as error:
        checks.check(False, f"every CDI device resolves ({error})")
        return None
    checks.show("device nodes: " + " ".join(edits.device_nodes))
    checks.show("env: " + " ".join(f"{k}={v}" for k, v in edits.env.items()))
    checks.show("mounts, in the order the runtime mounts them:")
    for mount in edits.mounts:
        checks.show(f"  {mount.container_path} <- {mount.host_path}")
    variable = pci_resource_env(pod.resource)
    bdfs = edits.env.get(variable, "").split(",")
    checks.check(
        list(edits.env) == [variable] and len(bdfs) == 2,
        f"{variable} lists the claim's 2 GPUs, as the device plugin's Allocate sets it",
    )
    inventory = scan_host(pod.root)
    functions = [inventory.function(b) for b in _addresses(bdfs)]
    cdevs = [f.cdev_path for f in functions if f is not None and f.cdev_path]
    wanted = {*cdevs, "/dev/iommu", "/dev/vfio/vfio"}
    checks.check(
        len(cdevs) == 2
        and wanted <= set(edits.device_nodes)
        and all((pod.root / n.lstrip("/")).exists() for n in edits.device_nodes),
        "each GPU's cdev, /dev/iommu and the legacy nodes, all on the node",
    )
    order = [m.container_path for m in edits.mounts]
    socket = next((m for m in edits.mounts if m.container_path == CONTAINER_SOCKET_PATH), None)
    checks.check(
        socket is not None
        and PUBLIC_DIR in order
        and order.index(PUBLIC_DIR) < order.index(CONTAINER_SOCKET_PATH)
        and Path(socket.host_path).is_socket(),
        f"the claim's hand-off socket at {CONTAINER_SOCKET_PATH}, mounted after the"
        f" {PUBLIC_DIR} emptyDir that would hide it",
    )
    return edits if socket is not None and len(bdfs) == 2 else None


def _step_launcher(
    pod: InPod, edits: ContainerEdits, bdfs: tuple[str, ...], checks: Checks
) -> str | None:
    checks.step(6, "virt-launcher finds its devices and takes the prepared iommufd fd")
    variable = pci_resource_env(pod.resource)
    checks.show(f"{variable} -> ua-gpu-gpu1 = {bdfs[0]}, ua-hostdevice-gpu2 = {bdfs[1]}")
    socket = next(m for m in edits.mounts if m.container_path == CONTAINER_SOCKET_PATH)
    same = take_iommufd(socket.host_path, pod.root / "dev/iommu")
    checks.show(f"{CONTAINER_SOCKET_PATH}: one fd (SCM_RIGHTS, 1-byte payload), ACKed")
    checks.check(same, "the fd is the node's /dev/iommu, opened and set up by the driver")
    checks.check(
        eventually(lambda: not Path(socket.host_path).exists()),
        "the one-shot socket is gone afterwards",
    )
    if not same:
        return None
    checks.show("so the domain gets <iommufd enabled='yes' fdgroup='iommu'/> and the fd")
    checks.show("is associated with it (virDomainFDAssociate): QEMU's pinned memory is charged")
    checks.show("to QEMU itself (per-process accounting), as with the device plugin")
    tree = etree.fromstring(build_domain(bdfs).encode())
    devices = tree.find("devices")
    if devices is not None:
        devices.addprevious(etree.Element("iommufd", enabled="yes", fdgroup="iommu"))
    return etree.tostring(tree).decode()


def _step_hook(pod: InPod, domain: str, checks: Checks) -> None:
    checks.step(7, "the launcher hook (attached by the webhook) moves the devices to iommufd")
    answer = ask_hook(
        pod.work / "hooks" / "iommufd.sock",
        pod.root,
        pod.scenario.libvirt,
        domain,
        json.dumps(pod.vmi),
    )
    checks.show(answer.info)
    checks.show(domain_diff(domain.encode(), answer.domain))
    decisions = read_decisions(answer.domain)
    for d in decisions:
        checks.show(f"{d.alias} {d.bdf}: {d.backend} ({d.reason})")
    kept = etree.fromstring(answer.domain).find("iommufd")
    checks.check(
        len(decisions) == 2
        and all(d.backend == pod.scenario.backend for d in decisions)
        and kept is not None
        and kept.get("fdgroup") == "iommu",
        "both GPUs on iommufd, on the handed-over fd (fdgroup='iommu' kept)",
    )


def _addresses(texts: list[str]) -> list[Bdf]:
    addresses = []
    for text in texts:
        try:
            addresses.append(Bdf.parse(text))
        except ValueError:
            continue
    return addresses
