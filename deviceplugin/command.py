"""`kubevirt-iommufd plugin`: the device plugin daemon."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
from dataclasses import replace
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING

from hostdev.config import ConfigError, PluginConfig, default_config, load_config
from hostdev.labels.publisher import add_label_arguments, build_label_publisher, feature_file_path
from hostdev.pciids import PciIds

if TYPE_CHECKING:
    from hostdev.iommufd_handoff import IommufdHandoff
    from hostdev.labels.node_patch import NodeLabeler

DEFAULT_KUBELET_DIR = Path("/var/lib/kubelet/device-plugins")
log = logging.getLogger("deviceplugin")


def add_parser(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    plugin = commands.add_parser(
        "plugin",
        help="run the kubelet device plugin (VFIO resources and devices.kubevirt.io/iommufd)",
        description=(
            "Advertise VFIO PCI devices to the kubelet (one resource per device type, device"
            " ID = PCI address) with their cdevs and group nodes, and the"
            " devices.kubevirt.io/iommufd resource that hands launchers a prepared iommufd fd."
            " Publishes the node's kubevirt-iommufd.io/ labels in a Node Feature Discovery"
            " feature file. Runs until SIGTERM or SIGINT, then removes its sockets and feature"
            " file and exits 0."
        ),
    )
    plugin.add_argument("--config", type=Path, metavar="FILE", help="YAML or JSON config")
    plugin.add_argument(
        "--root", type=Path, default=Path("/"), metavar="DIR", help="host root (default: /)"
    )
    plugin.add_argument(
        "--kubelet-dir",
        type=Path,
        default=DEFAULT_KUBELET_DIR,
        metavar="DIR",
        help=f"the kubelet's device plugin directory (default: {DEFAULT_KUBELET_DIR})",
    )
    plugin.add_argument(
        "--pod-resources-socket",
        type=Path,
        metavar="SOCKET",
        help="the kubelet's pod resources API, asked which devices pods hold when a resource"
        " has resetAfterUse (default: podResources.socket in the config, else"
        " /var/lib/kubelet/pod-resources/kubelet.sock)",
    )
    plugin.add_argument(
        "--metrics-port",
        type=int,
        default=0,
        metavar="PORT",
        help="serve Prometheus metrics on this port (default: off)",
    )
    add_label_arguments(plugin, "plugin")
    plugin.add_argument(
        "--node-name",
        default=os.environ.get("NODE_NAME"),
        metavar="NAME",
        help="this node's name, for --label-node (default: $NODE_NAME)",
    )
    plugin.add_argument(
        "--kubeconfig",
        type=Path,
        metavar="FILE",
        help="kubeconfig for --label-node (default: the pod's service account)",
    )
    plugin.add_argument(
        "--log-level", default="info", choices=["debug", "info", "warning", "error"]
    )
    plugin.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    # Imported here so that the command's other subcommands start without gRPC and Prometheus.
    from deviceplugin.manager import PluginManager
    from deviceplugin.metrics import PluginMetrics
    from deviceplugin.registration import RegistrationError
    from hostdev.errors import HostdevError

    logging.basicConfig(
        level=args.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s %(message)s",
        stream=sys.stderr,
    )
    try:
        config = load_config(args.config) if args.config else default_config()
    except ConfigError as error:
        print(f"kubevirt-iommufd plugin: {error}", file=sys.stderr)
        return 2
    config = apply_flags(config, args)
    if not args.root.is_dir():
        print(f"kubevirt-iommufd plugin: --root {args.root} is not a directory", file=sys.stderr)
        return 2
    try:
        node_labeler = _node_labeler(args) if args.label_node else None
    except ValueError as error:
        print(f"kubevirt-iommufd plugin: {error}", file=sys.stderr)
        return 2
    metrics = PluginMetrics()
    handoff = _handoff(config, args.root) if config.iommufd.enabled else None
    if handoff is not None:
        metrics.watch_handoffs(handoff.stats)
    names = PciIds(config.pci_ids) if config.pci_ids else PciIds.find()
    labels = build_label_publisher(
        feature_file_path(args.feature_file, config, args.root, "plugin"), "plugin", node_labeler
    )
    manager = PluginManager(
        config,
        args.root,
        args.kubelet_dir,
        names,
        metrics,
        handoff,
        watch_udev=args.root == Path("/"),
        labels=labels,
    )

    def on_signal(number: int, frame: FrameType | None) -> None:
        log.info("stopping signal=%s", signal.Signals(number).name)
        manager.request_stop()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        try:
            manager.start()
        except (HostdevError, RegistrationError) as error:
            manager.stop()
            print(f"kubevirt-iommufd plugin: {error}", file=sys.stderr)
            return 1
        if args.metrics_port:
            # Once the kubelet knows the plugin: serving loads prometheus_client.
            try:
                metrics.serve(args.metrics_port)
            except OSError as error:
                manager.stop()
                print(
                    f"kubevirt-iommufd plugin: cannot serve metrics on port {args.metrics_port}:"
                    f" {error.strerror or error}",
                    file=sys.stderr,
                )
                return 1
        manager.run()
    finally:
        if handoff is not None:
            handoff.close()
    log.info("stopped")
    return 0


def apply_flags(config: PluginConfig, args: argparse.Namespace) -> PluginConfig:
    """Command-line flags win over the configuration file."""
    if args.pod_resources_socket is not None:
        pod_resources = replace(config.pod_resources, socket=args.pod_resources_socket)
        config = replace(config, pod_resources=pod_resources)
    return config


def _node_labeler(args: argparse.Namespace) -> NodeLabeler:
    from hostdev.labels.kube_client import load_api_client
    from hostdev.labels.node_patch import NodeLabeler

    if not args.node_name:
        raise ValueError("--label-node needs the node's name: pass --node-name or set NODE_NAME")
    try:
        api_client = load_api_client(args.kubeconfig)
    except Exception as error:
        raise ValueError(
            f"--label-node: no API server configuration: {error}; run in a pod with a service"
            " account, or pass --kubeconfig"
        ) from None
    labeler = NodeLabeler(api_client, args.node_name)
    labeler.start()
    return labeler


def _handoff(config: PluginConfig, root: Path) -> IommufdHandoff:
    from hostdev.iommufd_handoff import HandoffConfig, HandoffError, IommufdHandoff

    iommufd = config.iommufd
    try:
        return IommufdHandoff(
            HandoffConfig(
                socket_dir=iommufd.socket_dir,
                root=root,
                owner_uid=iommufd.socket_uid,
                owner_gid=iommufd.socket_gid,
                mode=iommufd.socket_mode,
                expiry_seconds=iommufd.handoff_timeout_seconds,
            )
        )
    except (HandoffError, OSError) as error:
        raise SystemExit(
            f"kubevirt-iommufd plugin: cannot set up the iommufd hand-off: {error}"
        ) from error
