"""Discovery: read a host's PCI functions, IOMMU groups and capabilities from a rooted sysfs/dev.

Every path is joined under `root` (`/` on a node, a fixture tree in tests). A 4,096-function host
means tens of thousands of tiny sysfs reads, so the per-device work is kept to a few system calls:
reads go through a directory fd with `os` calls (no path walks, no text IO set-up), optional
entries are tried rather than listed (a real device directory has ~40 entries), vendor/device/
subsystem/class come from the one `modalias` file, and device links come from one listing of
`/sys/class/devlink` instead of every device's directory.
"""

from __future__ import annotations

import errno
import functools
import os
import re
import sys
from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from hostdev.bdf import Bdf, is_bdf
from hostdev.errors import HostReadError, InvalidBdf, RootNotFound
from hostdev.model import (
    GroupMember,
    HostCapabilities,
    HostInventory,
    IommuGroup,
    PciFunction,
    Sriov,
    is_vfio_driver,
)

PCI_DEVICES = "sys/bus/pci/devices"
IOMMU_GROUPS = "sys/kernel/iommu_groups"
DEVLINKS = "sys/class/devlink"
VFIO_DEVICES = "sys/class/vfio-dev"
_MODALIAS = re.compile(
    r"pci:v([0-9A-F]{8})d([0-9A-F]{8})sv([0-9A-F]{8})sd([0-9A-F]{8})"
    r"bc([0-9A-F]{2})sc([0-9A-F]{2})i([0-9A-F]{2})"
)
# /sys/class/devlink entries are named "<supplier bus>:<supplier>--<consumer bus>:<consumer>".
_PCI_DEVLINK = re.compile(r"pci:(.+)--pci:(.+)")
_READ_FIX = "run as root, or point --root at a complete copy of the host's /sys and /dev"


def scan_host(root: Path | str = "/", *, reset_methods: bool = False) -> HostInventory:
    """Discover the PCI functions, IOMMU groups and capabilities of the host under `root`.

    With `reset_methods`, also read each function's reset methods (one more read per function,
    which callers that never reset devices need not pay for)."""
    base = Path(root)
    if not base.is_dir():
        raise RootNotFound(str(root))
    group_members = _read_group_members(base)
    group_of = {name: number for number, names in group_members.items() for name in names}
    links = _read_host_links(base)
    devices_dir = str(base / PCI_DEVICES)
    functions: list[PciFunction] = []
    for name in sorted(_listdir_or_empty(devices_dir)):
        link = f"{devices_dir}/{name}"
        try:
            bdf = Bdf.parse(name)
        except InvalidBdf:
            raise HostReadError(link, "not a PCI address", _READ_FIX) from None
        function = _read_function(link, name, bdf, group_of.get(name), links, reset_methods)
        if function is not None:
            functions.append(function)
    groups = _build_groups(base, group_members, functions, _listdir_or_empty(base / "dev/vfio"))
    return HostInventory(tuple(functions), groups, _read_capabilities(base, functions, groups))


def refresh_host(
    root: Path | str,
    previous: HostInventory,
    changed: Iterable[Bdf],
    *,
    reset_methods: bool = False,
) -> HostInventory:
    """`previous` with the `changed` functions and their IOMMU groups read again.

    For event-driven updates: a bind, an unbind or a node coming and going touches a few
    functions, and reading a 4,096-function host again for each would be too slow to react.
    Only the named functions' sysfs entries are read (their vfio-dev entries from their own
    directories, not from the host-wide listing a scan reads); the result equals a full scan's
    for them, and everything else is `previous`'s, shared. Which /dev nodes exist (cdevs, group
    nodes, /dev/iommu) is re-checked for every function, since that costs two directory
    listings. Functions caught half-way through a bind are read again too, so a burst of events
    read at any point converges on the final state.
    """
    base = Path(root)
    if not base.is_dir():
        raise RootNotFound(str(root))
    changed = set(changed)
    cdev_nodes = _listdir_or_empty(base / "dev/vfio/devices")
    # A function on a VFIO driver without its vfio-dev entry was read mid-bind (the entry and
    # the driver link appear one after the other): read it again with the rest. Kernels before
    # 6.1 give no VFIO device an entry, and re-reading all of them at every event would undo
    # the point of a refresh.
    mid_bind = (base / VFIO_DEVICES).is_dir()
    updates: dict[Bdf, PciFunction | None] = {}
    for function in previous.functions:
        cdev = function.vfio_cdev
        if cdev is None:
            if (
                mid_bind
                and not function.vfio_sysfs_without_cdev
                and is_vfio_driver(function.driver)
            ):
                changed.add(function.bdf)
        elif (cdev in cdev_nodes) != function.vfio_cdev_present:
            updates[function.bdf] = replace(
                function, vfio_cdev_present=not function.vfio_cdev_present
            )
    links = _HostLinks(
        consumers=_read_pci_consumers(base),
        cdev_nodes=cdev_nodes,
        vfio_names={str(bdf): _read_own_vfio_names(base, str(bdf)) for bdf in changed},
    )
    fresh = {bdf: _read_one(base, bdf, links, reset_methods) for bdf in changed}
    updates.update(fresh)
    touched = {f.iommu_group for b in changed if (f := previous.function(b)) is not None}
    touched |= {f.iommu_group for f in fresh.values() if f is not None}
    touched.discard(None)

    def function_named(name: str) -> PciFunction | None:
        if not is_bdf(name):
            return None
        bdf = Bdf.parse(name)
        return updates[bdf] if bdf in updates else previous.function(bdf)

    group_nodes = _listdir_or_empty(base / "dev/vfio")
    groups: dict[int, IommuGroup | None] = {}
    for number in (n for n in touched if n is not None):
        names = sorted(_listdir_or_empty(base / IOMMU_GROUPS / str(number) / "devices"))
        # A scan keeps a group that has lost its last member while the kernel keeps its entry.
        gone = not names and not (base / IOMMU_GROUPS / str(number)).is_dir()
        groups[number] = (
            None
            if gone
            else IommuGroup(
                number=number,
                members=tuple(_group_member(base, number, name, function_named) for name in names),
                legacy_node_present=str(number) in group_nodes,
            )
        )
    # Groups no event touched keep their objects (consumers compare them by identity), unless
    # their /dev/vfio node came or went.
    for kept in previous.groups:
        if (
            kept.number not in touched
            and (str(kept.number) in group_nodes) != kept.legacy_node_present
        ):
            groups[kept.number] = replace(kept, legacy_node_present=not kept.legacy_node_present)
    refreshed = previous.with_changes(updates, groups)
    return refreshed.with_changes(
        capabilities=_read_capabilities(base, refreshed.functions, refreshed.groups)
    )


def read_function(root: Path | str, bdf: Bdf) -> PciFunction | None:
    """One function, read as `scan_host` reads it (its IOMMU group from its own link); None when
    the host has no such function. For callers that need a few devices, not the whole host."""
    return read_functions(root, [bdf])[bdf]


def read_reset_methods(root: Path | str, bdf: Bdf) -> tuple[str, ...]:
    """`PciFunction.reset_methods` of one function, read now: a reset wants the current list."""
    link = f"{Path(root) / PCI_DEVICES}/{bdf}"
    try:
        fd = os.open(link, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except FileNotFoundError:
        return ()
    except OSError as error:
        raise HostReadError(link, error.strerror or str(error), _READ_FIX) from error
    try:
        return _DeviceReader(link, fd).reset_methods()
    finally:
        os.close(fd)


def read_functions(root: Path | str, bdfs: Iterable[Bdf]) -> dict[Bdf, PciFunction | None]:
    """`read_function` for several functions, sharing the host-wide listings."""
    base = Path(root)
    links = _read_host_links(base)
    return {bdf: _read_one(base, bdf, links, reset_methods=False) for bdf in bdfs}


def _read_one(base: Path, bdf: Bdf, links: _HostLinks, reset_methods: bool) -> PciFunction | None:
    """A function outside a full scan: its group comes from its own `iommu_group` link."""
    link = f"{base / PCI_DEVICES}/{bdf}"
    group = _link_name(f"{link}/iommu_group")
    return _read_function(link, str(bdf), bdf, int(group) if group else None, links, reset_methods)


def _build_groups(
    base: Path,
    group_members: dict[int, list[str]],
    functions: list[PciFunction],
    group_nodes: set[str],
) -> tuple[IommuGroup, ...]:
    by_name = {str(f.bdf): f for f in functions}
    return tuple(
        IommuGroup(
            number=number,
            members=tuple(_group_member(base, number, name, by_name.get) for name in names),
            legacy_node_present=str(number) in group_nodes,
        )
        for number, names in sorted(group_members.items())
    )


@dataclass(frozen=True, slots=True)
class _HostLinks:
    """Host-wide listings each function's reading needs, read once per scan."""

    consumers: dict[str, list[Bdf]]
    cdev_nodes: set[str]
    vfio_names: dict[str, list[str]]


def _read_host_links(base: Path) -> _HostLinks:
    return _HostLinks(
        consumers=_read_pci_consumers(base),
        cdev_nodes=_listdir_or_empty(base / "dev/vfio/devices"),
        vfio_names=_read_vfio_names(base),
    )


def _read_vfio_names(base: Path) -> dict[str, list[str]]:
    """VFIO device entries by PCI function, from one listing of /sys/class/vfio-dev (Linux >=
    6.1), whose entries link to `<function>/vfio-dev/vfioN`: a readlink each, where listing every
    function's vfio-dev directory cost a directory read each."""
    directory = base / VFIO_DEVICES
    owners: dict[str, list[str]] = defaultdict(list)
    for name in _listdir_or_empty(directory):
        try:
            target = os.readlink(f"{directory}/{name}")
        except FileNotFoundError:
            continue  # went away while we listed
        except OSError as error:
            raise HostReadError(
                f"{directory}/{name}", error.strerror or str(error), _READ_FIX
            ) from error
        parts = target.rsplit("/", 3)
        if len(parts) == 4 and parts[2] == "vfio-dev" and parts[3] == name:
            owners[parts[1]].append(name)
    return owners


def _read_own_vfio_names(base: Path, name: str) -> list[str]:
    """A function's VFIO device entries from its own `vfio-dev` directory: what the host-wide
    listing (`_read_vfio_names`) finds for it, at one directory read instead of a readlink per
    VFIO device of the host."""
    return list(_listdir_or_empty(f"{base / PCI_DEVICES}/{name}/vfio-dev"))


def _read_group_members(base: Path) -> dict[int, list[str]]:
    groups_dir = base / IOMMU_GROUPS
    members: dict[int, list[str]] = {}
    for entry in _listdir_or_empty(groups_dir):
        if not entry.isdigit():
            raise HostReadError(str(groups_dir / entry), "not an IOMMU group number", _READ_FIX)
        members[int(entry)] = sorted(_listdir_or_empty(groups_dir / entry / "devices"))
    return members


def _read_pci_consumers(base: Path) -> dict[str, list[Bdf]]:
    consumers: dict[str, list[Bdf]] = defaultdict(list)
    for entry in sorted(_listdir_or_empty(base / DEVLINKS)):
        match = _PCI_DEVLINK.fullmatch(entry)
        if match and is_bdf(match[1]) and is_bdf(match[2]):
            consumers[match[1]].append(Bdf.parse(match[2]))
    return consumers


def _group_member(
    base: Path, number: int, name: str, function_named: Callable[[str], PciFunction | None]
) -> GroupMember:
    function = function_named(name)
    if function is not None:
        return GroupMember(name, function.bdf, function.driver)
    # A member that is not a PCI function (a platform device, say): its driver still counts.
    driver_link = base / IOMMU_GROUPS / str(number) / "devices" / name / "driver"
    return GroupMember(name, None, _link_name(str(driver_link)))


def _read_function(
    link: str,
    name: str,
    bdf: Bdf,
    group: int | None,
    links: _HostLinks,
    reset_methods: bool = False,
) -> PciFunction | None:
    try:
        target = os.readlink(link)
        fd = os.open(link, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except FileNotFoundError:
        return None  # removed while we scanned (hot-unplug, SR-IOV VFs going away)
    except OSError as error:
        if error.errno == errno.ENODEV:
            return None
        raise HostReadError(link, error.strerror or str(error), _READ_FIX) from error
    try:
        read = _DeviceReader(link, fd)
        modalias = read.text("modalias")
        if modalias is not None:
            modalias = sys.intern(modalias)
        ids: tuple[int, int, int | None, int | None, int] | None = (
            ids_from_modalias(modalias) if modalias else None
        )
        if ids is None:
            ids = (
                read.required_hex("vendor"),
                read.required_hex("device"),
                read.hex("subsystem_vendor"),
                read.hex("subsystem_device"),
                read.required_hex("class"),
            )
        # SR-IOV entries are rare: test for them rather than pay for a failed open on every device.
        total_vfs = read.integer("sriov_totalvfs") if read.has("sriov_totalvfs") else None
        physfn = read.link_name("physfn") if read.has("physfn") else None
        driver = read.link_name("driver")
        # Only a device bound to a VFIO driver has a vfio-dev entry.
        vfio_cdev, vfio_without_cdev = (
            read.vfio_cdev(links.vfio_names.get(name, ()), links.cdev_nodes)
            if is_vfio_driver(driver)
            else (None, False)
        )
        numa_node = read.integer("numa_node")
        pcie_root, upstream = _placement(target, name)
        return PciFunction(
            bdf=bdf,
            vendor_id=ids[0],
            device_id=ids[1],
            subsystem_vendor_id=ids[2],
            subsystem_device_id=ids[3],
            class_code=ids[4],
            revision=read.hex("revision"),
            driver=driver,
            iommu_group=group,
            numa_node=None if numa_node is None or numa_node < 0 else numa_node,
            sriov=(
                None if total_vfs is None else Sriov(total_vfs, read.integer("sriov_numvfs") or 0)
            ),
            physfn=Bdf.parse(physfn) if physfn else None,
            modalias=modalias,
            upstream=upstream,
            consumers=tuple(links.consumers.get(name, ())),
            vfio_cdev=vfio_cdev,
            vfio_cdev_present=vfio_cdev is not None and vfio_cdev in links.cdev_nodes,
            vfio_sysfs_without_cdev=vfio_without_cdev,
            reset_methods=read.reset_methods() if reset_methods else None,
            pcie_root=pcie_root,
        )
    except _DeviceGone:
        return None  # its attributes went away under us: hot-unplug
    finally:
        os.close(fd)


@functools.lru_cache(maxsize=1024)
def ids_from_modalias(modalias: str) -> tuple[int, int, int, int, int] | None:
    """Vendor, device, subsystem ids and class from `modalias`, which the kernel builds from the
    same fields as the separate attribute files: one read instead of five. Cached: a node's
    functions come in few kinds, so most are parsed once and share their ids."""
    match = _MODALIAS.fullmatch(modalias)
    if match is None:
        return None
    vendor, device, sub_vendor, sub_device, base, sub, prog_if = (
        int(g, 16) for g in match.groups()
    )
    return vendor, device, sub_vendor, sub_device, base << 16 | sub << 8 | prog_if


def _placement(link_target: str, name: str) -> tuple[str | None, tuple[Bdf, ...]]:
    """The PCI host bridge (`pci0000:00`) and the bridges above a device, read from its
    /sys/devices path: `…/devices/pci0000:00/<bridge>/…/<bdf>`."""
    parents, _, last = link_target.rpartition("/")
    root, bridges = _placement_below(parents)
    if root is None and last.startswith("pci") and last != "pci":
        root = sys.intern(last)
    return root, bridges if last == name else ()


@functools.lru_cache(maxsize=1024)
def _placement_below(parents: str) -> tuple[str | None, tuple[Bdf, ...]]:
    """`_placement` of what is below the directory `parents`. Cached: the functions of a device,
    and the devices behind one switch, share it."""
    root = next((p for p in parents.split("/") if p.startswith("pci") and p != "pci"), None)
    _, _, below_root_bus = parents.partition("/pci")
    bridges = tuple(Bdf.parse(part) for part in below_root_bus.split("/")[1:] if is_bdf(part))
    return None if root is None else sys.intern(root), bridges


def _read_capabilities(
    base: Path, functions: Sequence[PciFunction], groups: tuple[IommuGroup, ...]
) -> HostCapabilities:
    vfio_cdev: bool | None = None
    if any(f.vfio_cdev for f in functions) or (base / "dev/vfio/devices").is_dir():
        vfio_cdev = True
    elif any(f.vfio_sysfs_without_cdev for f in functions):
        vfio_cdev = False
    misc_iommu = base / "sys/class/misc/iommu"
    iommu_node = (base / "dev/iommu").exists()
    return HostCapabilities(
        iommu=bool(groups) or bool(_listdir_or_empty(base / "sys/class/iommu")),
        iommufd=iommu_node or misc_iommu.exists(),
        iommufd_node_present=iommu_node,
        iommufd_devnum=_read_optional_text(misc_iommu / "dev"),
        vfio_cdev=vfio_cdev,
        legacy_vfio_node_present=(base / "dev/vfio/vfio").exists(),
        kernel_release=_read_optional_text(base / "proc/sys/kernel/osrelease"),
    )


class _DeviceGone(Exception):
    """A device's attribute answered ENODEV: the device is being removed."""


class _DeviceReader:
    """Reads the entries of one sysfs device directory through its open fd; a missing entry
    reads as None, any other failure is a HostReadError naming the path."""

    def __init__(self, path: str, fd: int) -> None:
        self._path = path
        self._fd = fd

    def has(self, name: str) -> bool:
        return os.access(name, os.F_OK, dir_fd=self._fd, follow_symlinks=False)

    def text(self, name: str) -> str | None:
        data = self._read(name)
        return None if data is None else data.decode("ascii", "replace").strip()

    def _read(self, name: str) -> bytes | None:
        try:
            attr = os.open(name, os.O_RDONLY | os.O_CLOEXEC, dir_fd=self._fd)
            try:
                return os.read(attr, 4096)
            finally:
                os.close(attr)
        except FileNotFoundError:
            return None
        except OSError as error:
            if error.errno == errno.ENODEV:
                raise _DeviceGone from error
            raise self._error(name, error.strerror or str(error)) from error

    def hex(self, name: str) -> int | None:
        return self._number(name, 16)

    def required_hex(self, name: str) -> int:
        value = self._number(name, 16)
        if value is None:
            raise self._error(name, "missing")
        return value

    def integer(self, name: str) -> int | None:
        return self._number(name, 10)

    def link_name(self, name: str) -> str | None:
        try:
            # Interned: thousands of functions share a handful of driver names.
            return sys.intern(os.path.basename(os.readlink(name, dir_fd=self._fd)))
        except FileNotFoundError:
            return None
        except OSError as error:
            raise self._error(name, error.strerror or str(error)) from error

    def vfio_cdev(self, names: Iterable[str], cdev_nodes: set[str]) -> tuple[str | None, bool]:
        """The device's VFIO cdev among its vfio-dev entries `names`, and whether it has an
        entry without one."""
        names = sorted(names)
        for cdev in names:
            # A /dev node proves the cdev; without one, look for the `dev` attribute: vfio-dev/vfioN
            # exists since Linux 6.1, but only CONFIG_VFIO_DEVICE_CDEV gives it a char device.
            if cdev in cdev_nodes:
                return cdev, False
            try:
                os.stat(f"vfio-dev/{cdev}/dev", dir_fd=self._fd)
            except FileNotFoundError:
                continue
            except OSError as error:
                raise self._error(f"vfio-dev/{cdev}/dev", error.strerror or str(error)) from error
            return cdev, False
        return None, bool(names)

    def reset_methods(self) -> tuple[str, ...]:
        """`reset_method` (Linux >= 5.15); before that, `reset` alone says the kernel can reset
        the device somehow. The kernel hides both when it cannot."""
        methods = self.text("reset_method")
        if methods is not None:
            return tuple(methods.split())
        return ("default",) if self.has("reset") else ()

    def _number(self, name: str, base: int) -> int | None:
        data = self._read(name)
        if data is None:
            return None
        try:
            return int(data, base)
        except ValueError:
            expected = "a hex number like 0x10de" if base == 16 else "a decimal number"
            raise self._error(name, f"expected {expected}, found {data[:40]!r}") from None

    def _error(self, name: str, problem: str) -> HostReadError:
        return HostReadError(f"{self._path}/{name}", problem, _READ_FIX)


def _listdir_or_empty(path: Path | str) -> set[str]:
    try:
        return set(os.listdir(path))
    except (FileNotFoundError, NotADirectoryError):
        return set()
    except OSError as error:
        raise HostReadError(str(path), error.strerror or str(error), _READ_FIX) from error


def _link_name(path: str) -> str | None:
    try:
        return os.path.basename(os.readlink(path))
    except FileNotFoundError:
        return None
    except OSError as error:
        raise HostReadError(path, error.strerror or str(error), _READ_FIX) from error


def _read_optional_text(path: Path) -> str | None:
    """The file's text, stripped; None when it is missing or blank. Read with `os` calls: every
    prepare reads the host's capabilities again, and a text file object costs an fstat, an
    ioctl and a seek more per file."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            data = b"".join(iter(lambda: os.read(fd, 4096), b""))
        finally:
            os.close(fd)
    except FileNotFoundError:
        return None
    except OSError as error:
        raise HostReadError(str(path), error.strerror or str(error), _READ_FIX) from error
    return data.decode("ascii", "replace").strip() or None
