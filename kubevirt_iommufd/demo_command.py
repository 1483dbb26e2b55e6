"""`kubevirt-iommufd demo`: its arguments; the scenarios are in `demo_scenarios`, the flow itself
in `demo`, which only this command imports."""

from __future__ import annotations

import argparse

from kubevirt_iommufd.demo_scenarios import SCENARIOS


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
            " (the CDI spec and KubeVirt's device metadata file printed), its GPU unbound and"
            " bound again (the kubelet's health stream and the slice's taint follow, timed) and"
            " the claim unprepared. The migrate scenario serves a VMI written for the device"
            " plugin (deviceName) through the DRA driver with no change to it: the webhook"
            " admits it, the scheduler stand-in makes the extended-resource claim, the driver"
            " prepares it over gRPC, the CDI spec is applied as the runtime applies it (device"
            " nodes, PCI_RESOURCE_<NAME>, the iommufd socket), the fd is taken as the launcher"
            " takes it and the hook moves the domain to iommufd; then the same VMI on a"
            " device-plugin node, for comparison."
            " Exit 0 only when every step did what it should."
        ),
    )
    demo.add_argument(
        "--scenario",
        choices=sorted(SCENARIOS),
        default="iommufd",
        help="iommufd (default), legacy-node or old-libvirt (the last two show the fall-back),"
        " dra (the DRA driver), or migrate (a deviceName VMI served by the DRA driver)",
    )
    demo.add_argument("--verbose", action="store_true", help="also print the components' logs")
    demo.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    # The demo loads every component (gRPC, lxml, the webhook's server): only when it runs.
    from kubevirt_iommufd import demo

    return demo.run(args)
