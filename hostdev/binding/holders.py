"""Who has a device open: processes whose `/proc/<pid>/fd` links point at its char nodes.

A device may only change drivers, or be reset, while no process holds it: a VM's QEMU holds
`/dev/vfio/devices/vfioN` or `/dev/vfio/<group>`, a CUDA program or nvidia-persistenced holds
`/dev/nvidia<minor>`, a compositor holds `/dev/dri/cardN`, a DPDK program on `uio_pci_generic`
holds `/dev/uioN`. The links name the node as the holding process sees it; the plugin hands
nodes out at their host paths, so they match.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from hostdev.bdf import Bdf
from hostdev.model import IommuGroup, PciFunction, is_vfio_driver

_NVIDIA_MINOR = re.compile(r"^Device Minor:\s*(\d+)\s*$", re.MULTILINE)


@dataclass(frozen=True, slots=True)
class Holder:
    """A process holding one of a device's nodes."""

    pid: int
    command: str
    path: str

    def __str__(self) -> str:
        return f"pid {self.pid} ({self.command}) holds {self.path}"


@dataclass(frozen=True, slots=True)
class HolderScan:
    holders: tuple[Holder, ...]
    unreadable: tuple[int, ...]
    """Processes whose open files could not be listed (not root): the device may be held."""


def nvidia_proc_dir(root: Path, bdf: Bdf) -> Path:
    return root / "proc/driver/nvidia/gpus" / str(bdf)


def read_device_nodes(
    root: Path, function: PciFunction, group: IommuGroup | None
) -> tuple[str, ...]:
    """Host paths of the char nodes through which a process can hold this function."""
    nodes: list[str] = []
    if function.cdev_path is not None:
        nodes.append(function.cdev_path)
    if group is not None and is_vfio_driver(function.driver):
        nodes.append(group.legacy_node)
    if function.driver == "nvidia":
        minor = _read_nvidia_minor(root, function.bdf)
        if minor is not None:
            nodes.append(f"/dev/nvidia{minor}")
    device = root / "sys/bus/pci/devices" / str(function.bdf)
    drm = _children(device / "drm")
    nodes.extend(f"/dev/dri/{name}" for name in drm if name.startswith(("card", "renderD")))
    nodes.extend(f"/dev/{name}" for name in _children(device / "uio") if name.startswith("uio"))
    return tuple(nodes)


def _children(directory: Path) -> list[str]:
    try:
        return sorted(p.name for p in directory.iterdir())
    except (FileNotFoundError, NotADirectoryError):
        return []


def _read_nvidia_minor(root: Path, bdf: Bdf) -> int | None:
    try:
        text = (nvidia_proc_dir(root, bdf) / "information").read_text(errors="replace")
    except OSError:
        return None
    match = _NVIDIA_MINOR.search(text)
    return int(match[1]) if match else None


def find_holders(root: Path, paths: Iterable[str]) -> HolderScan:
    """Every process (under `root`/proc) with one of `paths` open."""
    wanted = set(paths)
    if not wanted:
        return HolderScan((), ())
    proc = root / "proc"
    holders: list[Holder] = []
    unreadable: list[int] = []
    try:
        pids = sorted(int(p.name) for p in proc.iterdir() if p.name.isdigit())
    except FileNotFoundError:
        return HolderScan((), ())
    for pid in pids:
        fd_dir = proc / str(pid) / "fd"
        try:
            fds = sorted(fd_dir.iterdir(), key=lambda p: (len(p.name), p.name))
        except FileNotFoundError:
            continue  # exited while we looked
        except PermissionError:
            unreadable.append(pid)
            continue
        held: list[str] = []
        for fd in fds:
            try:
                target = str(fd.readlink())
            except OSError:
                continue  # closed while we looked
            if target in wanted and target not in held:
                held.append(target)
        if held:
            command = _read_command(proc / str(pid))
            holders.extend(Holder(pid, command, path) for path in held)
    return HolderScan(tuple(holders), tuple(unreadable))


def _read_command(pid_dir: Path) -> str:
    try:
        return (pid_dir / "comm").read_text(errors="replace").strip() or "?"
    except OSError:
        return "?"
