"""`kubevirt-iommufd hook`: serve the sidecar's gRPC socket, or rewrite one domain and exit.

`hook on-define-domain --vmi JSON --domain XML` and the `onDefineDomain` executable (`main`) are
the same one-shot rewrite for KubeVirt's sidecar-shim, which runs `onDefineDomain --vmi <json>
--domain <xml>` and defines what it prints. The shim passes no other flags, so in that mode the
policy and libvirt version come from the defaults and the VMI's annotations.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from launcher_hook.errors import HookError
from launcher_hook.model import ANNOTATION_LIBVIRT_VERSION, ANNOTATION_MODE, LibvirtVersion, Policy

PROG = "kubevirt-iommufd hook"
SOCKET_DIR = "/var/run/kubevirt-hooks"
_LOG_LEVELS = ("debug", "info", "warning", "error")


def add_parser(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    hook = commands.add_parser(
        "hook",
        help="KubeVirt hook sidecar: move a VMI's PCI host devices to iommufd where they can",
        description=(
            "Serve KubeVirt's hook API (Info, Callbacks v1alpha1..3) on <socket-dir>/<name>.sock."
            " OnDefineDomain moves each PCI <hostdev> to iommufd when the kernel has iommufd,"
            " the device has its VFIO cdev and libvirt is new enough, keeps the rest on legacy"
            " VFIO, and records the choice in the domain's <metadata>. Per VMI, annotation"
            f" {ANNOTATION_MODE} overrides --policy and {ANNOTATION_LIBVIRT_VERSION} names the"
            " libvirt version when libvirt and --libvirt-version do not. Exit 0 after Shutdown"
            " or SIGTERM."
        ),
    )
    _add_decision_options(hook, suppress=False)
    hook.add_argument(
        "--socket-dir",
        default=SOCKET_DIR,
        metavar="DIR",
        help=f"directory virt-launcher scans for hook sockets (default: {SOCKET_DIR})",
    )
    hook.add_argument(
        "--name",
        default="iommufd",
        type=_socket_name,
        help="hook name in Info and socket file name (default: iommufd)",
    )
    actions = hook.add_subparsers(dest="hook_action", metavar="ACTION")
    once = actions.add_parser(
        "on-define-domain",
        help="rewrite one domain: new XML on stdout, errors on stderr, exit 1 on failure",
        description=(
            "The OnDefineDomain rewrite once, as KubeVirt's sidecar-shim runs it: print the new"
            " domain XML; on refused input or an unmet `require`, print the reason to stderr"
            " and exit 1."
        ),
    )
    _add_once_options(once)
    _add_decision_options(once, suppress=True)
    hook.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    # Imported here so that the CLI's other subcommands start without gRPC and lxml.
    from launcher_hook.capabilities import LibvirtVersionSource
    from launcher_hook.handler import HookConfig, define_domain
    from launcher_hook.server import HookServer

    _configure_logging(args.log_level)
    config = HookConfig(
        policy=Policy(args.policy),
        root=Path(args.root),
        require_cdev_node=args.cdev_check == "node",
        libvirt=LibvirtVersionSource(args.libvirt_uri, args.libvirt_version),
    )

    def define(domain_xml: bytes, vmi_json: bytes) -> bytes:
        return define_domain(domain_xml, vmi_json, config)

    if args.hook_action == "on-define-domain":
        return _define_once(args.domain, args.vmi, define)
    server = HookServer(Path(args.socket_dir) / f"{args.name}.sock", args.name, define)
    # Before start: a kubelet SIGTERM right after the socket appears must still stop us cleanly.
    for number in (signal.SIGTERM, signal.SIGINT):
        signal.signal(number, lambda _signum, _frame: server.stop())
    try:
        server.start()
    except (OSError, RuntimeError) as error:
        print(f"{PROG}: error: cannot serve on {server.socket_path}: {error}", file=sys.stderr)
        return 1
    server.wait()
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """The `onDefineDomain` executable for KubeVirt's sidecar-shim."""
    parser = argparse.ArgumentParser(
        prog="onDefineDomain",
        description=(
            "kubevirt-iommufd's OnDefineDomain for KubeVirt's sidecar-shim: print the domain XML"
            " with its PCI host devices moved to iommufd where they can be."
        ),
    )
    _add_once_options(parser)
    _add_decision_options(parser, suppress=False)
    # The shim runs this inside the sidecar and passes no flags; a sidecar's /dev never shows
    # the compute container's VFIO nodes, so sysfs must judge the cdevs here.
    parser.set_defaults(cdev_check="sysfs")
    args = parser.parse_args(argv)
    args.hook_action = "on-define-domain"
    return run(args)


def _define_once(domain: str, vmi: str, define: Callable[[bytes, bytes], bytes]) -> int:
    try:
        output = define(os.fsencode(domain), os.fsencode(vmi))
    except HookError as error:
        print(f"{PROG}: error: {error}", file=sys.stderr)
        return 1
    # Bytes as libvirt gets them, whatever the locale's encoding.
    sys.stdout.buffer.write(output)
    sys.stdout.flush()
    return 0


def _add_once_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--vmi", required=True, metavar="JSON", help="the VMI as JSON")
    parser.add_argument("--domain", required=True, metavar="XML", help="the libvirt domain XML")


def _add_decision_options(parser: argparse.ArgumentParser, suppress: bool) -> None:
    # Given again after `on-define-domain`, an option overrides; not given, the hook-level value
    # (or its default) stays, which argparse only does when the sub-parser's default is SUPPRESS.
    def default(value: object) -> object:
        return argparse.SUPPRESS if suppress else value

    parser.add_argument(
        "--policy",
        choices=[p.value for p in Policy],
        default=default(Policy.AUTO.value),
        help=(
            "auto: iommufd where possible, legacy VFIO elsewhere; require: fail the VMI when a"
            " PCI host device cannot use iommufd; disable: legacy VFIO only (default: auto)"
        ),
    )
    parser.add_argument(
        "--root",
        default=default("/"),
        metavar="DIR",
        help="directory holding the node's sys/ and dev/ (default: /)",
    )
    parser.add_argument(
        "--cdev-check",
        choices=["node", "sysfs"],
        default=default("node"),
        help=(
            "node: a device's cdev counts when sysfs has it and its /dev/vfio/devices node is"
            " visible under --root; sysfs: sysfs alone, for a hook sidecar (its /dev never shows"
            " the nodes) beside this project's device plugin, which hands the compute container"
            " the node of every device it allocates (default: node)"
        ),
    )
    parser.add_argument(
        "--libvirt-uri",
        default=default(None),
        metavar="URI",
        help="ask this libvirt its version (read-only connection), e.g. qemu:///system",
    )
    parser.add_argument(
        "--libvirt-version",
        default=default(None),
        type=_libvirt_version,
        metavar="X.Y.Z",
        help="libvirt version of the launcher, used when --libvirt-uri does not answer",
    )
    parser.add_argument(
        "--log-level", choices=_LOG_LEVELS, default=default("info"), help="(default: info)"
    )


def _libvirt_version(text: str) -> LibvirtVersion:
    try:
        return LibvirtVersion.parse(text, "--libvirt-version")
    except HookError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def _socket_name(text: str) -> str:
    if not text or "/" in text or text.startswith("."):
        raise argparse.ArgumentTypeError(f"{text!r} is not a plain file name")
    return text


def _configure_logging(level: str) -> None:
    logging.basicConfig(
        level=level.upper(),
        stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
