"""The last step of `demo --scenario migrate`: the same VMI on a node that still runs the device
plugin. The kubelet stand-in allocates the same GPUs and an iommufd slot through the real plugin
over gRPC, and what the container gets is set beside what DRA gave it."""

from __future__ import annotations

from pathlib import Path

from hostdev.config import IOMMUFD_RESOURCE
from hostdev.pciids import PciIds
from kubevirt_iommufd.demo_checks import Checks, eventually
from kubevirt_iommufd.demo_launcher import take_iommufd
from kubevirt_iommufd.demo_migrate_pod import Served
from kubevirt_iommufd.demo_plugin import registered_resources, running_plugin
from kubevirt_iommufd.demo_scenarios import Scenario
from sim.host import build_tree


def compare_with_plugin(
    scenario: Scenario, work: Path, names: PciIds, resource: str, dra: Served, checks: Checks
) -> None:
    checks.step(8, "the same VMI on a device-plugin node: the kubelet's Allocate (gRPC)")
    root = build_tree(scenario.node(), work / "plugin-node")
    with running_plugin(root, work / "plugin", names) as (kubelet, _):
        if not eventually(
            lambda: {resource, IOMMUFD_RESOURCE} <= set(registered_resources(kubelet)), 5
        ):
            checks.check(
                False, f"the plugin registered {resource} and {IOMMUFD_RESOURCE} within 5 s"
            )
            return
        (gpus,) = kubelet.allocate(resource, list(dra.bdfs)).container_responses
        (slot,) = kubelet.allocate(IOMMUFD_RESOURCE, ["iommufd-000"]).container_responses
        nodes = tuple(dict.fromkeys(d.container_path for d in (*gpus.devices, *slot.devices)))
        env = dict(gpus.envs)
        checks.show(f"Allocate {resource} {', '.join(dra.bdfs)} ->")
        checks.show(f"  devices: {' '.join(d.container_path for d in gpus.devices)}")
        checks.show(f"  env: {' '.join(f'{k}={v}' for k, v in env.items())}")
        mounts = list(slot.mounts)
        checks.show(f"Allocate {IOMMUFD_RESOURCE} iommufd-000 ->")
        checks.show(f"  devices: {' '.join(d.container_path for d in slot.devices)}")
        for mount in mounts:
            checks.show(f"  mount: {mount.container_path} <- {mount.host_path}")
        sockets = ", ".join(m.container_path for m in mounts)
        checks.show(f"device plugin: {_listed(env)}; {len(nodes)} device nodes; socket {sockets}")
        checks.show(
            f"DRA driver:    {_listed(dra.env)}; {len(dra.device_nodes)} device nodes;"
            f" socket {dra.socket_path}"
        )
        checks.check(
            env == dra.env, "the same PCI_RESOURCE_<NAME>, the same addresses in the same order"
        )
        checks.check(set(nodes) == set(dra.device_nodes), "the same device nodes in the container")
        same = len(mounts) == 1 and take_iommufd(mounts[0].host_path, root / "dev/iommu")
        checks.check(
            same and [m.container_path for m in mounts] == [dra.socket_path],
            f"the fd at the same {dra.socket_path}, taken the same way",
        )


def _listed(env: dict[str, str]) -> str:
    return " ".join(f"{k}={v}" for k, v in env.items())
