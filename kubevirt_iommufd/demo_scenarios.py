"""The demo's scenarios: the simulated node, the launcher's libvirt, and what the VM's GPUs should
get. The command offers them, the flows run them."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from sim.host import HostSpec, hgx_h100, legacy_only


@dataclass(frozen=True, slots=True)
class Scenario:
    description: str
    node: Callable[[], HostSpec]
    libvirt: str
    backend: str
    """What the VM's GPUs should get: from the hook, or in the dra flow from the CDI spec."""
    flow: Literal["device-plugin", "dra", "migrate"] = "device-plugin"
    """device-plugin (plugin, webhook, fd hand-off, hook), dra (the DRA driver) or migrate (a
    `deviceName` VMI served by the DRA driver, then by the device plugin)."""

    @property
    def steps(self) -> int:
        return {"dra": 7, "migrate": 8}.get(self.flow, 5)


SCENARIOS = {
    "iommufd": Scenario(
        "8 H100 GPUs on vfio-pci, a kernel with iommufd and VFIO cdevs, libvirt 12.9",
        hgx_h100,
        "12.9.0",
        "iommufd",
    ),
    "legacy-node": Scenario(
        "the same GPUs on Debian bookworm's 6.1 kernel: no iommufd, no cdevs, libvirt 12.9",
        legacy_only,
        "12.9.0",
        "legacy",
    ),
    "old-libvirt": Scenario(
        "8 H100 GPUs with iommufd and cdevs, but the launcher's libvirt is 11.10",
        hgx_h100,
        "11.10.0",
        "legacy",
    ),
    "dra": Scenario(
        "the DRA driver on 8 H100 GPUs: ResourceSlices, a claim prepared with CDI and the"
        " device metadata file KubeVirt reads, a GPU going unhealthy and back",
        hgx_h100,
        "12.9.0",
        "iommufd",
        flow="dra",
    ),
    "migrate": Scenario(
        "a VMI written for the device plugin (gpus[].deviceName) on a node switched to the DRA"
        " driver: extended resources, the iommufd fd, the hook; then on a device-plugin node",
        hgx_h100,
        "12.9.0",
        "iommufd",
        flow="migrate",
    ),
}
