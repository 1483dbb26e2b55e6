"""A VMI written for the device plugin, served by the DRA driver on the real kernel (issue 21).

The VMI asks for the edu by its device-plugin resource (`hostDevices[].deviceName`), unchanged.
On a DRA node the launcher pod virt-controller renders for it asks for that extended resource
and for `devices.kubevirt.io/iommufd` (our webhook's or KubeVirt's `IOMMUFD` gate's request);
the DeviceClasses `kubevirt-iommufd dra-classes` prints for the driver's configuration carry
both as `extendedResourceName`, so the scheduler serves the pod from the DRA driver's devices:

1. the classes are printed by the CLI for the driver's configuration and must name both
   resources;
2. the scheduler's claim for the pod's extended resources is written by sim/scheduler.py, as
   kube-scheduler writes it (one request `container-<i>-request-<j>` per container and resource,
   the pod its controller, annotated `resource.kubernetes.io/extended-resource-claim`), and
   allocated the edu and the first free iommufd slot;
3. NodePrepare through the DRA driver binds the edu (on no driver) to vfio-pci on demand;
4. the claim's CDI devices are resolved and applied as the runtime does, and the VM is started
   through libvirt 12.9 as virt-launcher starts it (launcher_libvirt.py): `PCI_RESOURCE_<NAME>`
   names the edu, the fd comes from the mounted socket, QEMU uses exactly that fd and its RAM is
   charged to its own memlock;
5. NodeUnprepare gives the edu back to no driver.
"""

from __future__ import annotations

import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml
from guestkit import CLI, Edu, Runner, require
from launcher import IOMMUFD_RESOURCE, VMI
from launcher_libvirt import edits_from_cdi, public_dir, start_as_launcher

from hostdev.iommufd_handoff import CONTAINER_SOCKET_PATH
from hostdev.naming import pci_resource_env
from sim.apiserver import AllocatedDevice
from sim.dra_kubelet import Claim
from sim.scheduler import build_extended_resource_claim, plan_extended_requests

if TYPE_CHECKING:
    from guest_dra import DraRun

Object = dict[str, Any]
POD = "virt-launcher-vmi-edu-x7k2q"
POD_UID = "3f9b2c1e-8d4a-4e6f-9b7c-2a1d5e8f0c3b"


def launcher_pod(namespace: str, resource: str) -> Object:
    """The launcher pod's parts the scheduler reads: its compute container's requests (the API
    server fills an extended resource's request from its limit)."""
    wanted = {resource: "1", IOMMUFD_RESOURCE: "1"}
    return {
        "metadata": {"name": POD, "namespace": namespace, "uid": POD_UID},
        "spec": {
            "containers": [{"name": "compute", "resources": {"limits": wanted, "requests": wanted}}]
        },
    }


def printed_classes(config: Path, driver: str) -> dict[str, str]:
    """resource -> DeviceClass name, from `kubevirt-iommufd dra-classes` for the configuration."""
    out = subprocess.run(
        [CLI, "dra-classes", "--config", str(config), "--driver-name", driver],
        capture_output=True,
        text=True,
        check=False,
    )
    require(out.returncode == 0, f"dra-classes exit {out.returncode}: {out.stderr[-400:]}")
    return {
        document["spec"]["extendedResourceName"]: document["metadata"]["name"]
        for document in yaml.safe_load_all(out.stdout)
        if document and document.get("kind") == "DeviceClass"
    }


@dataclass(frozen=True)
class DraNode:
    """The names guest_dra.py runs the driver with."""

    driver: str
    node: str
    namespace: str
    resource: str
    config: Path


def check_migration(
    run: Runner, edu: Edu, dra: DraRun, name: str, names: DraNode, chroot: Path | None
) -> None:
    """Steps 1-5 on the edu the driver publishes as `name` (on no driver; left so)."""
    driver, node, namespace, resource_name = (
        names.driver,
        names.node,
        names.namespace,
        names.resource,
    )
    title = (
        f"migration: the deviceName VMI ({resource_name}) on DRA via extended resources, started by"
        " libvirt 12.9 as virt-launcher: the claim's fd, VmLck = VmPin"
    )
    if chroot is None:
        run.skip(title, "no --libvirt-chroot given")
        return
    with run.check(title) as check:
        classes = printed_classes(names.config, driver)
        for resource in (resource_name, IOMMUFD_RESOURCE):
            require(resource in classes, f"dra-classes printed no class for {resource}: {classes}")
        pod = launcher_pod(namespace, resource_name)
        # The node has no device-plugin resources: everything the classes name goes to DRA.
        requests = plan_extended_requests(pod, classes, allocatable={})
        stands_for = {r.request: r.resource for r in requests}
        require(
            sorted(stands_for.values()) == sorted([resource_name, IOMMUFD_RESOURCE]),
            f"the scheduler would ask DRA for {stands_for}",
        )
        claim = build_extended_resource_claim(pod, requests, f"{POD}-extended-resources-4xq7n")
        created = dra.api.put_claim(claim)
        slots = [d for d in dra.api.allocatable(node, driver) if d.startswith("iommufd-")]
        require(bool(slots), "the driver publishes no iommufd slot")
        device_of = {resource_name: name, IOMMUFD_RESOURCE: slots[0]}
        metadata = created["metadata"]
        dra.api.set_allocation(
            namespace,
            metadata["name"],
            [
                AllocatedDevice(request, driver, node, device_of[resource])
                for request, resource in stands_for.items()
            ],
            node_name=node,
        )
        ref = Claim(namespace, metadata["uid"], metadata["name"])
        result = dra.kubelet.node_prepare_resources([ref])[ref.uid]
        require(not result.error, f"NodePrepare answered {result.error!r}\n{dra.log_tail()}")
        try:
            require(edu.driver() == "vfio-pci", f"{edu.bdf} is on {edu.driver()} after prepare")
            edu.cdev = edu.read_cdev()
            edu.group = (edu.sysfs / "iommu_group").readlink().name
            edits = edits_from_cdi(
                dra.cdi_dir,
                [i for device in result.devices for i in device.cdi_device_ids],
                [public_dir()],
            )
            mounted = [each.container_path for each in edits.mounts]
            require(
                CONTAINER_SOCKET_PATH in mounted,
                f"the CDI spec mounts {mounted}, not {CONTAINER_SOCKET_PATH}",
            )
            started = start_as_launcher(chroot, VMI, pci_resource_env(resource_name), edits, [edu])
        finally:
            errors = dra.kubelet.node_unprepare_resources([ref])
        require(not errors[ref.uid], f"NodeUnprepare answered {errors[ref.uid]!r}")
        require(edu.driver() is None, f"{edu.bdf} is on {edu.driver()} after unprepare")
        check.detail = (
            f"claim {metadata['name']} requests {stands_for}; {edu.bdf} and {slots[0]} prepared"
            f" (bound on demand), given back after; {started}"
        )
