"""Command line: parse arguments, dispatch to a subcommand, turn errors into one clear line.

Each subcommand lives in its own module exposing `add_parser(commands)`, which registers the
subcommand and sets `run(args) -> int` as its default; this module only wires them together.
A daemon's start imports its own subcommand's module alone: when the first argument names a
subcommand, only that module is loaded (tests/test_start_imports.py).
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from hostdev.errors import HostdevError

PROG = "kubevirt-iommufd"
COMMANDS = {
    "inspect": "kubevirt_iommufd.inspect_command",
    "bind": "kubevirt_iommufd.bind_command",
    "unbind": "kubevirt_iommufd.bind_command",
    "plugin": "deviceplugin.command",
    "dra": "dra.command",
    "dra-classes": "kubevirt_iommufd.dra_classes_command",
    "webhook": "webhook.command",
    "hook": "launcher_hook.command",
    "demo": "kubevirt_iommufd.demo_command",
    "certs": "kubevirt_iommufd.certs_command",
}
"""Each subcommand's module, in the order `--help` lists them (a module may register several)."""


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The parser of every subcommand, or of `command` alone."""
    parser = argparse.ArgumentParser(
        prog=PROG,
        description=(
            "PCI passthrough for KubeVirt VMs through iommufd and VFIO cdevs, with a safe"
            " fall-back to legacy VFIO groups."
        ),
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    wanted = [COMMANDS[command]] if command in COMMANDS else COMMANDS.values()
    for module in dict.fromkeys(wanted):
        importlib.import_module(module).add_parser(commands)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    arguments = sys.argv[1:] if argv is None else list(argv)
    args = build_parser(arguments[0] if arguments else None).parse_args(arguments)
    try:
        result: int = args.run(args)
    except HostdevError as error:
        print(f"{PROG}: error: {error}", file=sys.stderr)
        return 1
    except BrokenPipeError:
        return 0  # `inspect | head` closed the pipe: not an error of ours
    return result
