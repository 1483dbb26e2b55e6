"""What the host is doing with a device right now, read just before its driver changes.

Discovery (`scan_host`) stays fast by reading only what every caller needs; binding needs more,
for a few functions: the current `driver_override`, who holds the device's nodes, whether a
storage controller's disks are mounted or a NIC's interfaces are up, and whether the NVIDIA
driver offers an `unbindLock`.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from hostdev.bdf import Bdf
from hostdev.binding.holders import Holder, find_holders, nvidia_proc_dir, read_device_nodes
from hostdev.model import HostInventory, PciFunction, is_vfio_driver

PCI_CLASS_STORAGE = 0x01
PCI_CLASS_NETWORK = 0x02
_NO_OVERRIDE = "(null)"


@dataclass(frozen=True, slots=True)
class FunctionUsage:
    """One function's state beyond the inventory."""

    bdf: Bdf
    override: str | None
    """`driver_override`, None when unset."""
    holders: tuple[Holder, ...] = ()
    unreadable_pids: tuple[int, ...] = ()
    in_use: tuple[str, ...] = ()
    """Host uses of a storage or network controller: "nvme0n1p2 is mounted on /"."""
    unbind_lock: bool = False
    """The NVIDIA driver offers `/proc/driver/nvidia/gpus/<BDF>/unbindLock`."""


@dataclass(frozen=True, slots=True)
class FunctionState:
    """Where a function is, as far as binding goes."""

    driver: str | None
    override: str | None
    """`driver_override`, None when unset."""
    unbind_locked: bool = False
    """The NVIDIA driver's unbind lock on it is taken."""


def read_usage(
    root: Path, inventory: HostInventory, bdfs: Iterable[Bdf]
) -> dict[Bdf, FunctionUsage]:
    """The usage of each function in `bdfs` (skipping any the inventory lacks), with one pass
    over /proc for all of them."""
    functions = [f for f in (inventory.function(b) for b in dict.fromkeys(bdfs)) if f is not None]
    nodes = {f.bdf: read_device_nodes(root, f, inventory.group_of(f)) for f in functions}
    scan = find_holders(root, (path for paths in nodes.values() for path in paths))
    mounts = _Mounts(root)
    usage: dict[Bdf, FunctionUsage] = {}
    for function in functions:
        device = root / "sys/bus/pci/devices" / str(function.bdf)
        usage[function.bdf] = FunctionUsage(
            bdf=function.bdf,
            override=read_override(root, function.bdf),
            holders=tuple(h for h in scan.holders if h.path in nodes[function.bdf]),
            unreadable_pids=scan.unreadable,
            in_use=_host_uses(root, device, function, mounts),
            unbind_lock=function.driver == "nvidia"
            and (nvidia_proc_dir(root, function.bdf) / "unbindLock").exists(),
        )
    return usage


def read_function_state(root: Path, bdf: Bdf) -> FunctionState:
    device = root / "sys/bus/pci/devices" / str(bdf)
    try:
        driver: str | None = (device / "driver").readlink().name
    except FileNotFoundError:
        driver = None
    try:
        lock = (nvidia_proc_dir(root, bdf) / "unbindLock").read_text().strip()
    except FileNotFoundError:
        lock = ""
    return FunctionState(driver, read_override(root, bdf), unbind_locked=lock == "1")


def read_override(root: Path, bdf: Bdf) -> str | None:
    path = root / "sys/bus/pci/devices" / str(bdf) / "driver_override"
    try:
        text = path.read_text(errors="replace").strip()
    except FileNotFoundError:
        return None
    return None if text in ("", _NO_OVERRIDE) else text


def _host_uses(root: Path, device: Path, function: PciFunction, mounts: _Mounts) -> tuple[str, ...]:
    if function.driver is None or is_vfio_driver(function.driver):
        return ()
    base_class = function.class_code >> 16
    if base_class == PCI_CLASS_STORAGE:
        return _block_uses(root, device, mounts)
    if base_class == PCI_CLASS_NETWORK:
        return _interfaces_up(device)
    return ()


def _interfaces_up(device: Path) -> tuple[str, ...]:
    try:
        names = sorted(p.name for p in (device / "net").iterdir())
    except (FileNotFoundError, NotADirectoryError):
        return ()
    uses = []
    for name in names:
        try:
            state = (device / "net" / name / "operstate").read_text().strip()
        except OSError:
            state = "unknown"
        if state != "down":
            uses.append(f"network interface {name} is {state}")
    return tuple(uses)


def _block_uses(root: Path, device: Path, mounts: _Mounts) -> tuple[str, ...]:
    """Disks and partitions below the controller that are mounted, swapped on or stacked
    under another block device (LVM, md, dm-crypt)."""
    class_block = root / "sys/class/block"
    try:
        names = sorted(p.name for p in class_block.iterdir())
    except FileNotFoundError:
        return ()
    prefix = str(device.resolve()) + "/"
    uses: list[str] = []
    for name in names:
        entry = class_block / name
        if not str(entry.resolve()).startswith(prefix):
            continue
        try:
            devnum = (entry / "dev").read_text().strip()
        except OSError:
            devnum = ""
        uses.extend(f"{name} is mounted on {point}" for point in mounts.points.get(devnum, ()))
        if name in mounts.swaps:
            uses.append(f"{name} is used as swap")
        try:
            stacked = sorted(p.name for p in (entry / "holders").iterdir())
        except (FileNotFoundError, NotADirectoryError):
            stacked = []
        uses.extend(f"{name} is used by {holder}" for holder in stacked)
    return tuple(uses)


class _Mounts:
    """The host's mounts by `major:minor` (from init's mount namespace, so a containerised
    caller with the host's /proc sees the host's) and its swap devices."""

    def __init__(self, root: Path) -> None:
        self.points: dict[str, list[str]] = {}
        for candidate in ("proc/1/mountinfo", "proc/self/mountinfo"):
            try:
                text = (root / candidate).read_text(errors="replace")
            except OSError:
                continue
            for line in text.splitlines():
                fields = line.split()
                if len(fields) >= 5:
                    self.points.setdefault(fields[2], []).append(fields[4])
            break
        self.swaps: set[str] = set()
        try:
            lines = (root / "proc/swaps").read_text(errors="replace").splitlines()[1:]
        except OSError:
            lines = []
        self.swaps = {Path(line.split()[0]).name for line in lines if line.split()}
