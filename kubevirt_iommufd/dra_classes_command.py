"""`kubevirt-iommufd dra-classes`: print the DeviceClasses that let pods asking for the device
plugin's resource names be served by the DRA driver, for a configuration of one's own."""

from __future__ import annotations

import argparse
import sys

import yaml

from dra.device_classes import (
    DeviceClassError,
    build_device_classes,
    plan_iommufd_resource_names,
    plan_resource_names,
)
from hostdev.errors import HostdevError
from hostdev.model import PciFunction
from kubevirt_iommufd.options import read_config_option, read_pci_ids_option, scan_node_option
from sim.host import SCENARIOS

DEFAULT_DRIVER = "vfio.kubevirt-iommufd.io"


def add_parser(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = commands.add_parser(
        "dra-classes",
        help="print the DeviceClasses that serve the device plugin's resource names through DRA",
        description=(
            "Print, as YAML for `kubectl apply -f -`, one DeviceClass per resource of the"
            " configuration, whose spec.extendedResourceName is the resource's name (Kubernetes"
            " 1.34+ with the DRAExtendedResource feature; beta from 1.36): on nodes without the"
            " device plugin, a pod asking for that resource (a launcher pod of a deviceName VMI)"
            " is served by the DRA driver's devices of that resource; and one for the iommufd"
            " slots (devices.kubevirt.io/iommufd, unless iommufd.enabled is false), whose claims"
            " get the prepared iommufd fd. Resources named per device"
            " (the default configuration, NVIDIA's naming) get their names from the devices of"
            " --root or --example and from --device. Exit 0 on success, 1 on an error."
        ),
    )
    parser.add_argument(
        "--config",
        metavar="FILE",
        help="the DRA driver's configuration (default: the built-in one: NVIDIA GPUs and"
        " NVSwitches, named per device)",
    )
    parser.add_argument(
        "--driver-name",
        default=DEFAULT_DRIVER,
        metavar="NAME",
        help=f"the driver's --driver-name (default: {DEFAULT_DRIVER})",
    )
    source = parser.add_mutually_exclusive_group()
    source.add_argument(
        "--root",
        metavar="DIR",
        help="name the devices of the host whose sys/ is under DIR (e.g. / on a node)",
    )
    source.add_argument(
        "--example",
        choices=sorted(SCENARIOS),
        help="name the devices of a built-in simulated node",
    )
    parser.add_argument(
        "--device",
        action="append",
        default=[],
        metavar="VENDOR:DEVICE",
        type=_device_id,
        help="name this device id (hex, e.g. 10de:2330); may be repeated",
    )
    parser.add_argument(
        "--pci-ids",
        metavar="FILE",
        help="pci.ids database for the names; 'none' for ids only (default: the system's copy;"
        " give the one the driver's image has, for the same names)",
    )
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    config = read_config_option(args.config)
    names = read_pci_ids_option(args.pci_ids)
    functions = _functions(args)
    resources = plan_resource_names(config, names, functions, args.device)
    if not resources:
        raise HostdevError(
            "no resource to make a DeviceClass for: the configuration names its resources per"
            " device; pass --root / (on a node), --example or --device VENDOR:DEVICE"
        )
    try:
        classes = build_device_classes(
            args.driver_name, [*resources, *plan_iommufd_resource_names(config)]
        )
    except DeviceClassError as error:
        raise HostdevError(str(error)) from None
    yaml.safe_dump_all(classes, sys.stdout, sort_keys=False)
    return 0


def _functions(args: argparse.Namespace) -> tuple[PciFunction, ...]:
    if args.root is None and args.example is None:
        return ()
    return scan_node_option(args.root or "/", args.example).functions


def _device_id(text: str) -> tuple[int, int]:
    vendor, sep, device = text.partition(":")
    try:
        if sep and len(vendor) == 4 and len(device) == 4:
            return int(vendor, 16), int(device, 16)
    except ValueError:
        pass
    raise argparse.ArgumentTypeError(f"{text!r} is not VENDOR:DEVICE in hex, such as 10de:2330")
