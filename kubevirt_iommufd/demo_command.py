"""`kubevirt-iommufd demo`: its scenarios and arguments; the flow itself is in `demo`."""

from __future__ import annotations

import argparse
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
    flow: Literal["device-plugin", "dra"] = "device-plugin"
    """device-plugin (plugin, webhook, fd hand-off, hook) or dra (the DRA driver)."""

    @property
    def steps(self) -> int:
        return 6 if self.flow == "dra" else 5


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
        " device metadata file KubeVirt reads",
        hgx_h100,
        "12.9.0",
        "iommufd",
        flow="dra",
    ),
}


def add_parser(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    demo = commands.add_parser(
        "demo",
        help="run the whole flow on a simulated node: plugin, webhook, fd hand-off, hook; or DRA",
        description=(
            "Build a simulated node, run the real device plugin against a kubelet stand-in,"
            " admit a virt-launcher pod through the real webhook over HTTPS, allocate GPUs and"
            " an iommufd fd over gRPC, and rewrite the domain with the real launcher hook over"
            " its gRPC socket, printing each step. The dra scenario runs the real DRA driver"
            " instead, against a kubelet stand-in and an API server stand-in over HTTPS:"
            " ResourceSlices published, a claim allocated as the scheduler would, prepared"
            " (the CDI spec and KubeVirt's device metadata file printed) and unprepared."
            " Exit 0 only when every step did what it should."
        ),
    )
    demo.add_argument(
        "--scenario",
        choices=sorted(SCENARIOS),
        default="iommufd",
        help="iommufd (default), legacy-node or old-libvirt (the last two show the fall-back),"
        " or dra (the DRA driver)",
    )
    demo.add_argument("--verbose", action="store_true", help="also print the components' logs")
    demo.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    # The demo loads every component (gRPC, lxml, the webhook's server): only when it runs.
    from kubevirt_iommufd import demo

    return demo.run(args)
