"""`kubevirt-iommufd dra`: the DRA kubelet plugin daemon."""

from __future__ import annotations

import argparse
import logging
import os
import re
import signal
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING

from dra.health import TaintEffect
from hostdev.labels.publisher import add_label_arguments

DEFAULT_DRIVER = "vfio.kubevirt-iommufd.io"
DEFAULT_KUBELET_DIR = Path("/var/lib/kubelet")
DEFAULT_CDI_DIR = Path("/var/run/cdi")
DEFAULT_STATE_DIR = Path("/var/lib/kubevirt-iommufd/dra")
DEFAULT_RUN_DIR = Path("/var/run/kubevirt-iommufd/dra")
_DNS_SUBDOMAIN = re.compile(
    r"(?=.{1,253}$)[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*"
)
# A pod UID goes into socket file names: nothing but what a UID is made of.
_INSTANCE_UID = re.compile(r"[A-Za-z0-9][-A-Za-z0-9]{0,62}")
if TYPE_CHECKING:
    from dra.api import ResourceApi
    from dra.driver import DraDriver
    from dra.kubelet_sockets import KubeletFront
    from hostdev.labels.kube_connection import KubeConnection
    from hostdev.labels.node_patch import NodeLabeler

log = logging.getLogger("dra")
SWITCH_INTERVAL = 0.0005
"""Seconds a thread holds the GIL while another waits for it (Python's default: 0.005)."""


def add_parser(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    dra = commands.add_parser(
        "dra",
        help="run the DRA driver (ResourceSlices, NodePrepare/NodeUnprepare with CDI)",
        description=(
            "Publish this node's VFIO PCI devices as ResourceSlices (resource.k8s.io/v1) and"
            " prepare the claims the scheduler allocates on them: a CDI spec with the device's"
            " cdev, /dev/iommu, /dev/vfio/vfio and group node, and the device metadata file"
            " KubeVirt reads. Serves the kubelet's plugin registration, DRAPlugin v1 and"
            " v1beta1, and each device's health (DRAResourceHealth v1, v1beta1, v1alpha1); an"
            " unhealthy device's slice entry carries a taint. With --instance-uid, the old and"
            " the new pod of a rolling update serve side by side, each registering with the"
            " kubelet only once ready for its calls. Runs until SIGTERM or SIGINT, then removes"
            " its own sockets and exits 0."
        ),
    )
    dra.add_argument("--node-name", required=True, metavar="NAME", help="this node's name")
    dra.add_argument(
        "--driver-name",
        default=DEFAULT_DRIVER,
        metavar="NAME",
        help=f"the driver's name in slices, classes and claims (default: {DEFAULT_DRIVER})",
    )
    dra.add_argument(
        "--config", type=Path, metavar="FILE", help="YAML or JSON config (the device plugin's)"
    )
    dra.add_argument(
        "--root", type=Path, default=Path("/"), metavar="DIR", help="host root (default: /)"
    )
    dra.add_argument(
        "--host-root",
        type=Path,
        default=Path("/"),
        metavar="DIR",
        help="where the host's / is mounted, for its /lib/modules and modprobe when a device is"
        " bound to VFIO on demand (default: /)",
    )
    dra.add_argument(
        "--kubelet-dir",
        type=Path,
        default=DEFAULT_KUBELET_DIR,
        metavar="DIR",
        help=f"the kubelet's root directory (default: {DEFAULT_KUBELET_DIR})",
    )
    dra.add_argument(
        "--cdi-dir",
        type=Path,
        default=DEFAULT_CDI_DIR,
        metavar="DIR",
        help=f"where the container runtime reads CDI specs (default: {DEFAULT_CDI_DIR})",
    )
    dra.add_argument(
        "--state-dir",
        type=Path,
        default=DEFAULT_STATE_DIR,
        metavar="DIR",
        help=f"prepared claims, kept across restarts and reboots (default: {DEFAULT_STATE_DIR})",
    )
    dra.add_argument(
        "--run-dir",
        type=Path,
        default=DEFAULT_RUN_DIR,
        metavar="DIR",
        help="the device metadata files KubeVirt reads, mounted into pods from here, and what"
        " else need not survive a reboot; a tmpfs, at the same path on the host"
        f" (default: {DEFAULT_RUN_DIR})",
    )
    dra.add_argument(
        "--kubeconfig",
        type=Path,
        metavar="FILE",
        help="kubeconfig for the API server (default: the pod's service account)",
    )
    dra.add_argument(
        "--rescan-interval",
        type=float,
        default=5.0,
        metavar="SECONDS",
        help="how often the whole host is read again; on a node (--root /) kernel uevents"
        " also trigger a re-read of the devices they name (default: 5)",
    )
    dra.add_argument(
        "--instance-uid",
        default=os.environ.get("POD_UID") or None,
        metavar="UID",
        help="this pod's UID, so that the old and the new pod of a rolling update serve side by"
        " side under names of their own; the new one registers with the kubelet once ready"
        " (recovered, host read, API client loaded), the old one taking the calls until then"
        " (default: $POD_UID; none: the node's only instance, registered at once)",
    )
    dra.add_argument(
        "--unhealthy-taint-effect",
        type=TaintEffect,
        choices=list(TaintEffect),
        default=TaintEffect.NO_SCHEDULE,
        metavar="{NoSchedule,NoExecute,None}",
        help="the effect of the taint an unhealthy device gets in its slice: NoSchedule keeps"
        " new VMs off it and leaves running VMs on it alone; NoExecute also evicts the pods"
        " (so the VMs) using it, unless their claims tolerate the taint; None only shows it"
        " (default: NoSchedule)",
    )
    add_label_arguments(dra, "dra")
    dra.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    dra.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    # The kubelet's calls wait on the GIL behind a thread that computes (a rewrite of 4,096
    # devices' slices, a judgement of their health): each time a call's thread comes back from a
    # system call, it waits up to the switch interval for the GIL, dozens of times per prepare.
    # At Python's 5 ms a prepare beside a rewrite took 86 ms (p99 on 4,096 functions), at
    # SWITCH_INTERVAL 42 ms.
    sys.setswitchinterval(SWITCH_INTERVAL)
    # The node's only instance is seen by the kubelet first: its sockets are served from grpc and
    # the protocol stubs alone (dra.kubelet_sockets), then the rest loads, recovers, reads the
    # host and publishes, while prepares wait. The API connection (urllib3 and a kubeconfig or the
    # service account: hostdev.labels.kube_connection) is made last, on this thread: made by a
    # thread of its own at once after registration, it took the GIL from recovery and the host
    # read, and the driver was ready 90 ms later on 8 GPUs, its slices out no sooner (later on
    # 4,096 functions). An instance of a rolling update registers only once ready, the other
    # instance answering the kubelet until then: it makes the connection, which its first prepare
    # needs, before it starts, and registers after recovery (KubeletFront.ready).
    from dra.api import ResourceApi
    from dra.kubelet_sockets import build_kubelet_front

    logging.basicConfig(
        level=args.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s %(message)s",
        stream=sys.stderr,
    )
    problem = _check_args(args)
    if problem:
        print(f"kubevirt-iommufd dra: {problem}", file=sys.stderr)
        return 2
    api = ResourceApi.loading(lambda: _load_connection(args.kubeconfig))
    # Labelling the node needs the API at once, and an instance of a rolling update before it
    # registers; the only instance makes the connection after the kubelet is served.
    api_first = args.label_node or bool(args.instance_uid)
    if api_first and not _api_loaded(api.load):
        return 2
    stopping = threading.Event()

    def on_signal(number: int, frame: FrameType | None) -> None:
        log.info("stopping signal=%s", signal.Signals(number).name)
        stopping.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    # Absolute: the kubelet dials the endpoint and the runtime mounts the metadata files by the
    # paths the driver hands out, from directories of their own.
    kubelet_dir = args.kubelet_dir.absolute()
    front = build_kubelet_front(
        kubelet_dir, args.driver_name, args.node_name, args.rescan_interval, args.instance_uid or ""
    )
    try:
        front.sockets.start()
    except OSError as error:
        # The DRA socket may be served already: it goes too.
        front.sockets.stop()
        print(f"kubevirt-iommufd dra: {error}", file=sys.stderr)
        return 1
    try:
        driver = _start_driver(args, kubelet_dir, api, front)
    except _StartFailed as failed:
        front.gate.failed(failed.message)
        front.sockets.stop()
        print(f"kubevirt-iommufd dra: {failed.message}", file=sys.stderr)
        return failed.code
    if not api_first and not _api_loaded(api.load):
        driver.stop()
        return 2
    # In slices: a SIGTERM the kernel delivers to one of gRPC's threads only marks the handler
    # as due, and the main thread runs it when it next runs Python code.
    while not stopping.wait(0.5):
        pass
    driver.stop()
    log.info("stopped")
    return 0


class _StartFailed(Exception):
    def __init__(self, message: str, code: int) -> None:
        super().__init__(message)
        self.message = message
        self.code = code


def _start_driver(
    args: argparse.Namespace, kubelet_dir: Path, api: ResourceApi, front: KubeletFront
) -> DraDriver:
    """Load the driver, recover, read the host and publish, the kubelet served meanwhile;
    _StartFailed with the exit code (2: the configuration) when the driver cannot run."""
    from dra.driver import DraDriver, DriverSettings
    from dra.state import StateError
    from hostdev.config import ConfigError, default_config, load_config
    from hostdev.errors import HostdevError
    from hostdev.labels.publisher import build_label_publisher, feature_file_path
    from hostdev.pciids import PciIds

    try:
        config = load_config(args.config) if args.config else default_config()
    except ConfigError as error:
        raise _StartFailed(str(error), 2) from error
    names = PciIds(config.pci_ids) if config.pci_ids else PciIds.find()
    settings = DriverSettings(
        node=args.node_name,
        driver=args.driver_name,
        root=args.root,
        kubelet_dir=kubelet_dir,
        cdi_dir=args.cdi_dir.absolute(),
        state_dir=args.state_dir.absolute(),
        run_dir=args.run_dir.absolute(),
        rescan_interval=args.rescan_interval,
        watch_udev=args.root == Path("/"),
        host_root=args.host_root,
        unhealthy_taint_effect=args.unhealthy_taint_effect,
        instance_uid=args.instance_uid or "",
    )
    labels = build_label_publisher(
        feature_file_path(args.feature_file, config, args.root, "dra"),
        "dra",
        _node_labeler(args.kubeconfig, args.node_name) if args.label_node else None,
    )
    try:
        driver = DraDriver(settings, config, names, api, labels=labels, front=front)
        driver.start()
    except (HostdevError, StateError, OSError) as error:
        raise _StartFailed(str(error), 1) from error
    return driver


def _load_connection(kubeconfig: Path | None) -> KubeConnection:
    from hostdev.labels.kube_connection import load_kube_connection

    return load_kube_connection(kubeconfig)


def _api_loaded(load: Callable[[], object]) -> bool:
    """Make the API connection now; False, with the reason said, when there is no usable
    configuration."""
    from hostdev.labels.kube_connection import ApiConfigError

    try:
        load()
    except ApiConfigError as error:
        print(
            f"kubevirt-iommufd dra: no API server configuration: {error}; run in a pod with a"
            " service account, or pass --kubeconfig",
            file=sys.stderr,
        )
        return False
    log.info("API client loaded: claims are read and slices written from now on")
    return True


def _node_labeler(kubeconfig: Path | None, node: str) -> NodeLabeler:
    """The labeler, on the official client (`hostdev.labels.node_patch`), loaded for it alone."""
    from hostdev.labels.kube_client import load_api_client
    from hostdev.labels.node_patch import NodeLabeler

    try:
        api_client = load_api_client(kubeconfig)
    # Its loaders raise many kinds of error for a configuration they cannot use.
    except Exception as error:
        raise _StartFailed(
            f"--label-node: the official kubernetes client cannot use the API server"
            f" configuration: {error}",
            2,
        ) from error
    labeler = NodeLabeler(api_client, node)
    labeler.start()
    return labeler


def _check_args(args: argparse.Namespace) -> str | None:
    if not _DNS_SUBDOMAIN.fullmatch(args.driver_name) or len(args.driver_name) > 63:
        return (
            f"--driver-name {args.driver_name!r}: expected a DNS subdomain of at most 63"
            " characters, such as vfio.kubevirt-iommufd.io"
        )
    if not _DNS_SUBDOMAIN.fullmatch(args.node_name):
        return f"--node-name {args.node_name!r}: expected a node name (a DNS subdomain)"
    if not args.root.is_dir():
        return f"--root {args.root} is not a directory"
    if args.instance_uid and not _INSTANCE_UID.fullmatch(args.instance_uid):
        return (
            f"--instance-uid {args.instance_uid!r}: expected a pod UID (letters, digits and"
            " dashes), as the downward API's metadata.uid gives it"
        )
    if args.rescan_interval < 0.1:
        return f"--rescan-interval {args.rescan_interval}: expected at least 0.1 seconds"
    return None
