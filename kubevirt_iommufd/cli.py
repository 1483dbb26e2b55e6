"""Command line: parse arguments, dispatch to a subcommand, turn errors into one clear line.

Each subcommand lives in its own module exposing `add_parser(commands)`, which registers the
subcommand and sets `run(args) -> int` as its default; this module only wires them together.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from deviceplugin import command as plugin_command
from dra import command as dra_command
from hostdev.errors import HostdevError
from kubevirt_iommufd import (
    bind_command,
    certs_command,
    demo_command,
    dra_classes_command,
    inspect_command,
)
from launcher_hook import command as hook_command
from webhook import command as webhook_command

PROG = "kubevirt-iommufd"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG,
        description=(
            "PCI passthrough for KubeVirt VMs through iommufd and VFIO cdevs, with a safe"
            " fall-back to legacy VFIO groups."
        ),
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    inspect_command.add_parser(commands)
    bind_command.add_parser(commands)
    plugin_command.add_parser(commands)
    dra_command.add_parser(commands)
    dra_classes_command.add_parser(commands)
    webhook_command.add_parser(commands)
    hook_command.add_parser(commands)
    demo_command.add_parser(commands)
    certs_command.add_parser(commands)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        result: int = args.run(args)
    except HostdevError as error:
        print(f"{PROG}: error: {error}", file=sys.stderr)
        return 1
    except BrokenPipeError:
        return 0  # `inspect | head` closed the pipe: not an error of ours
    return result
