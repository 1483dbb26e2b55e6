"""`kubevirt-iommufd bind` and `unbind`: move devices onto VFIO drivers and back, safely."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from functools import partial
from pathlib import Path

from hostdev.bdf import Bdf
from hostdev.binding.bind import (
    HostAccess,
    Outcome,
    Requests,
    Runner,
    bind_devices,
    run_command,
    unbind_devices,
)
from hostdev.binding.lock import LockHolder
from hostdev.binding.plan import AUTO, BindRequest
from hostdev.binding.sysfs_write import KernelSysfs, SysfsWriter
from hostdev.errors import HostdevError, InvalidBdf
from hostdev.model import HostInventory
from hostdev.selector import DeviceSelector, InvalidSelector, select_functions
from kubevirt_iommufd.bind_report import EXIT_CODES, SCHEMA, build_bind_document, render_bind_table
from kubevirt_iommufd.reservations import ReservationError, load_reservations, resolve_reservations

EXIT_HELP = (
    "Exit status: 0 done or nothing to do, 1 refused (nothing changed) or an error, 2 a usage"
    " or configuration error, 3 failed and everything was restored, 4 failed and restoring"
    " failed too (the output says what to fix by hand)."
)


def add_parser(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    bind = commands.add_parser(
        "bind",
        help="move devices (with their IOMMU groups and companions) onto VFIO drivers",
        description=(
            "Bind PCI functions to a VFIO driver: the best variant driver for each device"
            " (from modules.alias) or vfio-pci, loading the module when needed. The whole IOMMU"
            " group and companion functions (a GPU's HD-audio) move together. Refuses while"
            " the device is in use (open char nodes, SR-IOV VFs enabled, NVIDIA unbindLock"
            " held, a disk mounted or an interface up) or when its group holds a bridge that"
            " must not move. Transactional: on a failure every function touched goes back to"
            " its previous driver and override. One run at a time per node: holds the binding"
            " lock <root>/var/lib/kubevirt-iommufd/binding.lock from reading the host to the last"
            f" write. {EXIT_HELP}"
        ),
    )
    bind.add_argument("bdfs", nargs="*", type=_bdf, metavar="BDF", help="e.g. 0000:3b:00.0")
    bind.add_argument(
        "--match",
        action="append",
        type=_selector,
        metavar="SELECTOR",
        help="every function matching: VVVV:DDDD (e.g. 10de:2330), or terms such as"
        " vendor=10de,class=0302,driver=nvidia; may be repeated",
    )
    bind.add_argument(
        "--from-config",
        type=Path,
        metavar="FILE",
        help="apply a reservations file (YAML or JSON, see docs/lifecycle.md)",
    )
    bind.add_argument(
        "--driver",
        metavar="auto|NAME",
        help="driver for the named functions (default: auto, the best VFIO variant or"
        " vfio-pci); companions always get auto",
    )
    bind.add_argument(
        "--host-root",
        type=Path,
        default=Path("/"),
        metavar="DIR",
        help="the host's / for /lib/modules and modprobe (chrooted into); /host in a container",
    )
    _common(bind)
    bind.set_defaults(run=run_bind)

    unbind = commands.add_parser(
        "unbind",
        help="take devices (and their companions) off VFIO drivers",
        description=(
            "Unbind PCI functions from their VFIO driver and clear the driver override: onto"
            " no driver (default), onto --to-driver NAME, or back to whatever driver the kernel"
            " picks (--reprobe). Companion functions follow. Refuses while a process holds the"
            f" device. Transactional like bind. {EXIT_HELP}"
        ),
    )
    unbind.add_argument("bdfs", nargs="+", type=_bdf, metavar="BDF", help="e.g. 0000:3b:00.0")
    target = unbind.add_mutually_exclusive_group()
    target.add_argument("--to-driver", metavar="NAME", help="bind the functions to this driver")
    target.add_argument(
        "--reprobe", action="store_true", help="let the kernel pick the driver (drivers_probe)"
    )
    unbind.add_argument(
        "--host-root",
        type=Path,
        default=Path("/"),
        metavar="DIR",
        help="the host's / for modprobe of --to-driver (default: /)",
    )
    _common(unbind)
    unbind.set_defaults(run=run_unbind)


def _common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--root",
        type=Path,
        default=Path("/"),
        metavar="DIR",
        help="directory holding the host's sys/, dev/ and proc/ (default: /)",
    )
    parser.add_argument(
        "--wait",
        type=_seconds,
        default=0.0,
        metavar="SECONDS",
        help="wait up to SECONDS in all for another bind, unbind or reset on this node to finish"
        " (the binding lock) and for busy devices to become free (default: 0, refuse at once)",
    )
    parser.add_argument(
        "--dry-run", action="store_true", help="print what would be done; change nothing"
    )
    parser.add_argument("--json", action="store_true", help=f"print a JSON document ({SCHEMA})")


def run_bind(
    args: argparse.Namespace, *, writer: SysfsWriter | None = None, runner: Runner | None = None
) -> int:
    sources = [bool(args.bdfs), bool(args.match), args.from_config is not None]
    if sum(sources) != 1:
        return _usage("bind", "give BDFs, --match SELECTOR or --from-config FILE (one of them)")
    if args.from_config is not None and args.driver is not None:
        return _usage("bind", "--driver does not apply to --from-config; set driver in the file")
    requests: Requests
    try:
        if args.from_config is not None:
            # The file is read now; which functions it names on this host is decided under the
            # binding lock, from the host as it is then.
            reservations = load_reservations(args.from_config)
            requests = partial(resolve_reservations, reservations)
        elif args.match:
            requests = partial(_matching, tuple(args.match), args.driver or AUTO)
        else:
            requests = tuple(BindRequest(bdf, args.driver or AUTO) for bdf in args.bdfs)
        outcome = bind_devices(
            _access(args, writer, runner),
            requests,
            wait_seconds=args.wait,
            dry_run=args.dry_run,
            on_lock_wait=_say_waiting("bind", args.wait),
        )
    except ReservationError as error:
        return _usage("bind", str(error))
    except HostdevError as error:
        print(f"kubevirt-iommufd bind: error: {error}", file=sys.stderr)
        return 1
    plan = outcome.plan
    if args.from_config is not None and not (plan.moves or plan.unchanged or plan.refusals):
        print(f"bind: {args.from_config} matches no function on this host; nothing to do")
        return 0
    return _print(outcome, args.json)


def run_unbind(
    args: argparse.Namespace, *, writer: SysfsWriter | None = None, runner: Runner | None = None
) -> int:
    try:
        outcome = unbind_devices(
            _access(args, writer, runner),
            args.bdfs,
            to_driver=args.to_driver,
            reprobe=args.reprobe,
            wait_seconds=args.wait,
            dry_run=args.dry_run,
            on_lock_wait=_say_waiting("unbind", args.wait),
        )
    except HostdevError as error:
        print(f"kubevirt-iommufd unbind: error: {error}", file=sys.stderr)
        return 1
    return _print(outcome, args.json)


def _matching(
    selectors: tuple[DeviceSelector, ...], driver: str, inventory: HostInventory
) -> tuple[BindRequest, ...]:
    found = {f.bdf for s in selectors for f in select_functions(inventory, s)}
    if not found:
        texts = ", ".join(s.text for s in selectors)
        raise HostdevError(
            f"no PCI function matches {texts} on this host; see `kubevirt-iommufd inspect`"
        )
    return tuple(BindRequest(bdf, driver) for bdf in sorted(found))


def _say_waiting(command: str, wait_seconds: float) -> Callable[[LockHolder | None], None]:
    def say(holder: LockHolder | None) -> None:
        whom = str(holder) if holder is not None else "another process (it has not said who yet)"
        print(
            f"kubevirt-iommufd {command}: waiting up to {wait_seconds:g} s for the binding lock,"
            f" held by {whom}",
            file=sys.stderr,
            flush=True,
        )

    return say


def _access(
    args: argparse.Namespace, writer: SysfsWriter | None, runner: Runner | None
) -> HostAccess:
    return HostAccess(
        root=args.root,
        host_root=args.host_root,
        writer=writer or KernelSysfs(),
        runner=runner or run_command,
    )


def _print(outcome: Outcome, as_json: bool) -> int:
    document = build_bind_document(outcome)
    if as_json:
        json.dump(document, sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        sys.stdout.write(render_bind_table(document))
    return EXIT_CODES[outcome.status]


def _usage(command: str, message: str) -> int:
    print(f"kubevirt-iommufd {command}: error: {message}", file=sys.stderr)
    return 2


def _bdf(text: str) -> Bdf:
    try:
        return Bdf.parse(text)
    except InvalidBdf as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def _selector(text: str) -> DeviceSelector:
    try:
        return DeviceSelector.parse(text)
    except InvalidSelector as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 <= value <= 86400:
        raise argparse.ArgumentTypeError(f"expected seconds between 0 and 86400, got {text!r}")
    return value
