"""Simulated nodes: sysfs and /dev trees shaped like the kernel's, for tests, benchmarks and demos.

A `HostSpec` says what a node has; `build_tree` writes it under a directory the way Linux lays it
out: `/sys/bus/pci/devices/<BDF>` symlinks into `/sys/devices/pci…/`, `driver` and `iommu_group`
links, `/sys/kernel/iommu_groups/N/devices/`, `vfio-dev/vfioN/dev` (and its
`/sys/class/vfio-dev/vfioN` link), `/dev/vfio/N`,
`/dev/vfio/vfio`, `/dev/vfio/devices/vfioN` and `/dev/iommu`. Device nodes are empty regular files:
discovery only checks that they exist.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from pathlib import Path

from hostdev.aer import FATAL_FILE, FATAL_TOTAL, NONFATAL_FILE, NONFATAL_TOTAL
from hostdev.bdf import Bdf
from hostdev.model import is_vfio_driver

NVIDIA = 0x10DE
CLASS_3D = 0x030200
CLASS_VGA = 0x030000
CLASS_AUDIO = 0x040300
CLASS_HOST_BRIDGE = 0x060000
CLASS_PCI_BRIDGE = 0x060400
CLASS_NVME = 0x010802
CLASS_ETHERNET = 0x020000
VFIO_CDEV_MAJOR = 511


@dataclass(frozen=True, slots=True)
class FunctionSpec:
    """One PCI function of a simulated node."""

    bdf: str
    vendor: int
    device: int
    class_code: int
    subsystem: tuple[int, int] | None = None
    revision: int = 0
    driver: str | None = None
    group: int | None = None
    numa_node: int = -1
    parent: str | None = None
    """The bridge it sits behind, or None for a device on a root bus."""
    sriov_total: int | None = None
    sriov_num: int = 0
    physfn: str | None = None
    consumers: tuple[str, ...] = ()
    reset_methods: tuple[str, ...] = ("flr", "bus")
    """Written to `reset_method`; empty: a device the kernel cannot reset (no `reset_method`
    and no `reset` entry, as the kernel hides both then)."""
    aer: bool = True
    """AER-capable: the kernel gives it `aer_dev_fatal` and `aer_dev_nonfatal` counters."""


@dataclass(frozen=True, slots=True)
class HostSpec:
    """A simulated node: its functions and what its kernel was built with."""

    functions: tuple[FunctionSpec, ...]
    iommu: bool = True
    iommufd: bool = True
    vfio_cdev: bool = True
    """CONFIG_VFIO_DEVICE_CDEV: VFIO devices get `/dev/vfio/devices/vfioN`."""
    vfio_sysfs: bool = True
    """Linux >= 6.1: VFIO devices get a `vfio-dev/vfioN` sysfs entry (with a `dev` file only
    when `vfio_cdev`)."""
    legacy_container: bool = True
    kernel_release: str = "6.12.0-kubevirt-iommufd"
    iommufd_devnum: str = "10:257"
    description: str = ""
    extra_groups: dict[int, tuple[str, ...]] = field(default_factory=dict)
    """Non-PCI group members, by group number: name of a platform device on no driver."""


BuildHost = Callable[[HostSpec], Path]
"""Writes a simulated node and returns its root (the tests' `build_host` fixture is one)."""


def build_tree(spec: HostSpec, root: Path) -> Path:
    """Write the node under `root` (created if needed) and return `root`."""
    _Builder(spec, root).build()
    return root


class _Builder:
    def __init__(self, spec: HostSpec, root: Path) -> None:
        self.spec = spec
        self.root = root
        self.sys = root / "sys"
        self.by_bdf = {f.bdf: f for f in spec.functions}
        self.next_cdev = 0

    def build(self) -> None:
        for directory in ("sys/bus/pci/devices", "sys/bus/pci/drivers", "sys/kernel", "dev"):
            (self.root / directory).mkdir(parents=True, exist_ok=True)
        (self.sys / "kernel/iommu_groups").mkdir(exist_ok=True)
        proc = self.root / "proc/sys/kernel"
        proc.mkdir(parents=True, exist_ok=True)
        (proc / "osrelease").write_text(self.spec.kernel_release + "\n")
        if self.spec.iommu:
            (self.sys / "class/iommu/dmar0").mkdir(parents=True, exist_ok=True)
        if self.spec.iommufd:
            (self.sys / "class/misc/iommu").mkdir(parents=True, exist_ok=True)
            (self.sys / "class/misc/iommu/dev").write_text(self.spec.iommufd_devnum + "\n")
            (self.root / "dev/iommu").touch()
        for function in self.spec.functions:
            self._function(function)
        for number, names in self.spec.extra_groups.items():
            for name in names:
                device = self.sys / "devices/platform" / name
                device.mkdir(parents=True, exist_ok=True)
                self._link(self._group_dir(number) / "devices" / name, device)
        vfio_groups = sorted(
            {
                f.group
                for f in self.spec.functions
                if f.group is not None and is_vfio_driver(f.driver)
            }
        )
        if self.spec.iommu and vfio_groups:
            (self.root / "dev/vfio").mkdir(exist_ok=True)
            for number in vfio_groups:
                (self.root / "dev/vfio" / str(number)).touch()
            if self.spec.legacy_container:
                (self.root / "dev/vfio/vfio").touch()

    def _device_path(self, bdf: str) -> Path:
        chain = [bdf]
        while (parent := self.by_bdf[chain[-1]].parent) is not None:
            chain.append(parent)
        top = Bdf.parse(chain[-1])
        path = self.sys / "devices" / f"pci{top.domain:04x}:{top.bus:02x}"
        for name in reversed(chain):
            path /= name
        return path

    def _group_dir(self, number: int) -> Path:
        group_dir = self.sys / "kernel/iommu_groups" / str(number)
        (group_dir / "devices").mkdir(parents=True, exist_ok=True)
        return group_dir

    def _function(self, spec: FunctionSpec) -> None:
        path = self._device_path(spec.bdf)
        path.mkdir(parents=True, exist_ok=True)
        sub_vendor, sub_device = spec.subsystem or (spec.vendor, spec.device)
        attributes = {
            "vendor": f"0x{spec.vendor:04x}",
            "device": f"0x{spec.device:04x}",
            "subsystem_vendor": f"0x{sub_vendor:04x}",
            "subsystem_device": f"0x{sub_device:04x}",
            "class": f"0x{spec.class_code:06x}",
            "revision": f"0x{spec.revision:02x}",
            "numa_node": str(spec.numa_node),
            "driver_override": "(null)",
            "modalias": (
                f"pci:v{spec.vendor:08X}d{spec.device:08X}sv{sub_vendor:08X}sd{sub_device:08X}"
                f"bc{spec.class_code >> 16:02X}sc{(spec.class_code >> 8) & 0xFF:02X}"
                f"i{spec.class_code & 0xFF:02X}"
            ),
        }
        if spec.reset_methods:
            attributes["reset_method"] = " ".join(spec.reset_methods)
            attributes["reset"] = ""
        if spec.sriov_total is not None:
            attributes["sriov_totalvfs"] = str(spec.sriov_total)
            attributes["sriov_numvfs"] = str(spec.sriov_num)
        for name, value in attributes.items():
            (path / name).write_text(value + "\n")
        if spec.aer:
            _write_aer(path, FATAL_FILE, {})
            _write_aer(path, NONFATAL_FILE, {})
        self._link(self.sys / "bus/pci/devices" / spec.bdf, path)
        if spec.driver is not None:
            driver_dir = self.sys / "bus/pci/drivers" / spec.driver
            driver_dir.mkdir(parents=True, exist_ok=True)
            self._link(path / "driver", driver_dir)
            self._link(driver_dir / spec.bdf, path)
            if spec.driver == "nvidia":
                self._nvidia_gpu(spec.bdf)
        if spec.physfn is not None:
            self._link(path / "physfn", self._device_path(spec.physfn))
            siblings = [f.bdf for f in self.spec.functions if f.physfn == spec.physfn]
            pf_path = self._device_path(spec.physfn)
            pf_path.mkdir(parents=True, exist_ok=True)
            self._link(pf_path / f"virtfn{siblings.index(spec.bdf)}", path)
        for consumer in spec.consumers:
            name = f"pci:{spec.bdf}--pci:{consumer}"
            devlink = self.sys / "devices/virtual/devlink" / name
            devlink.mkdir(parents=True, exist_ok=True)
            self._link(path / f"consumer:pci:{consumer}", devlink)
            self._link(self.sys / "class/devlink" / name, devlink)
        if self.spec.iommu and spec.group is not None:
            group_dir = self._group_dir(spec.group)
            self._link(group_dir / "devices" / spec.bdf, path)
            self._link(path / "iommu_group", group_dir)
            if is_vfio_driver(spec.driver):
                self._vfio_device(path)

    def _nvidia_gpu(self, bdf: str) -> None:
        """What the NVIDIA driver adds per GPU: /proc/driver/nvidia/gpus/<BDF>/ with its minor
        and the unbindLock, and /dev/nvidia<minor>."""
        gpus = self.root / "proc/driver/nvidia/gpus"
        minor = len(list(gpus.iterdir())) if gpus.is_dir() else 0
        (gpus / bdf).mkdir(parents=True)
        (gpus / bdf / "information").write_text(f"Model:\t\t NVIDIA GPU\nDevice Minor:\t {minor}\n")
        (gpus / bdf / "unbindLock").write_text("0\n")
        (self.root / "dev" / f"nvidia{minor}").touch()

    def _vfio_device(self, path: Path) -> None:
        index = self.next_cdev
        self.next_cdev += 1
        if not self.spec.vfio_sysfs:
            return
        entry = path / "vfio-dev" / f"vfio{index}"
        entry.mkdir(parents=True)
        self._link(self.sys / "class/vfio-dev" / entry.name, entry)
        if self.spec.vfio_cdev:
            (entry / "dev").write_text(f"{VFIO_CDEV_MAJOR}:{index}\n")
            nodes = self.root / "dev/vfio/devices"
            nodes.mkdir(parents=True, exist_ok=True)
            (nodes / f"vfio{index}").touch()

    @staticmethod
    def _link(link: Path, target: Path) -> None:
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(target, link.parent))


# Driver changes on a built tree, as the kernel makes them ------------------------------------


def unbind_driver(root: Path, bdf: str) -> None:
    """What `echo BDF > driver/unbind` does, in the kernel's order: the driver links go first;
    then a VFIO driver's remove takes the device's vfio-dev entry and cdev node, and the group
    node once no member of the group is left on VFIO."""
    device = (root / "sys/bus/pci/devices" / bdf).resolve()
    driver_link = device / "driver"
    driver = driver_link.readlink().name
    driver_link.unlink()
    (root / "sys/bus/pci/drivers" / driver / bdf).unlink()
    if not is_vfio_driver(driver):
        return
    for entry in sorted((device / "vfio-dev").glob("vfio*")):
        (root / "sys/class/vfio-dev" / entry.name).unlink(missing_ok=True)
        (root / "dev/vfio/devices" / entry.name).unlink(missing_ok=True)
        (entry / "dev").unlink(missing_ok=True)
        entry.rmdir()
    (device / "vfio-dev").rmdir()
    group = _group_of(device)
    if group is not None and not any(
        is_vfio_driver(_driver_of(member)) for member in _group_members(root, group)
    ):
        (root / "dev/vfio" / group).unlink(missing_ok=True)


def bind_driver(root: Path, bdf: str, driver: str, *, cdev: bool = True) -> None:
    """What a successful bind does, in the kernel's order: a VFIO driver's probe first adds the
    vfio-dev entry (lowest free vfioN), its cdev node when `cdev`, and the group node; then the
    driver links appear."""
    device = (root / "sys/bus/pci/devices" / bdf).resolve()
    group = _group_of(device)
    if is_vfio_driver(driver) and group is not None:
        taken = {e.name for e in (root / "sys/bus/pci/devices").glob("*/vfio-dev/vfio*")}
        index = next(i for i in range(len(taken) + 1) if f"vfio{i}" not in taken)
        entry = device / "vfio-dev" / f"vfio{index}"
        entry.mkdir(parents=True)
        _Builder._link(root / "sys/class/vfio-dev" / entry.name, entry)
        if cdev:
            (entry / "dev").write_text(f"{VFIO_CDEV_MAJOR}:{index}\n")
            (root / "dev/vfio/devices").mkdir(parents=True, exist_ok=True)
            (root / "dev/vfio/devices" / entry.name).touch()
        (root / "dev/vfio").mkdir(exist_ok=True)
        (root / "dev/vfio" / group).touch()
    driver_dir = root / "sys/bus/pci/drivers" / driver
    driver_dir.mkdir(parents=True, exist_ok=True)
    _Builder._link(device / "driver", driver_dir)
    _Builder._link(driver_dir / bdf, device)


def remove_function(root: Path, bdf: str) -> None:
    """What a surprise removal (a GPU falling off the bus) or `echo 1 > remove` does: the driver
    lets go as on an unbind, then the function leaves its group and the bus."""
    device = (root / "sys/bus/pci/devices" / bdf).resolve()
    if (device / "driver").is_symlink():
        unbind_driver(root, bdf)
    group = _group_of(device)
    if group is not None:
        (root / "sys/kernel/iommu_groups" / group / "devices" / bdf).unlink()
    (root / "sys/bus/pci/devices" / bdf).unlink()
    shutil.rmtree(device)


def report_aer_error(root: Path, bdf: str, *, fatal: bool) -> None:
    """What the kernel's AER handler does when the device reports an uncorrectable error: one
    more of a kind (a completion timeout, the commonest on GPUs) and of the total."""
    device = root / "sys/bus/pci/devices" / bdf
    name = FATAL_FILE if fatal else NONFATAL_FILE
    counts = _read_aer(device / name)
    counts[_AER_KIND] = counts.get(_AER_KIND, 0) + 1
    _write_aer(device, name, counts)


# The kernel's uncorrectable error names (drivers/pci/pcie/aer.c), in its order.
_AER_KINDS = (
    "Undefined",
    "Data Link Protocol",
    "Surprise Down Error",
    "Poisoned TLP",
    "Flow Control Protocol",
    "Completion Timeout",
    "Completer Abort",
    "Unexpected Completion",
    "Receiver Overflow",
    "Malformed TLP",
    "ECRC",
    "Unsupported Request",
    "ACS Violation",
)
_AER_KIND = "Completion Timeout"


def _read_aer(path: Path) -> dict[str, int]:
    counts: dict[str, int] = {}
    for line in path.read_text().splitlines():
        name, _, count = line.rpartition(" ")
        if name in _AER_KINDS:
            counts[name] = int(count)
    return counts


def _write_aer(device: Path, name: str, counts: dict[str, int]) -> None:
    """The file as the kernel prints it: every kind, then the total; written whole and renamed
    in, so a reader never sees half of it (the kernel's read is atomic too)."""
    total = FATAL_TOTAL if name == FATAL_FILE else NONFATAL_TOTAL
    lines = [f"{kind} {counts.get(kind, 0)}" for kind in _AER_KINDS]
    lines.append(f"{total} {sum(counts.values())}")
    staged = device / f".{name}.new"
    staged.write_text("\n".join(lines) + "\n")
    staged.replace(device / name)


def _group_of(device: Path) -> str | None:
    link = device / "iommu_group"
    return link.readlink().name if link.is_symlink() else None


def _group_members(root: Path, group: str) -> list[Path]:
    return [m.resolve() for m in (root / "sys/kernel/iommu_groups" / group / "devices").iterdir()]


def _driver_of(device: Path) -> str | None:
    link = device / "driver"
    return link.readlink().name if link.is_symlink() else None


# Scenarios -----------------------------------------------------------------------------------

H100_SXM = (0x2330, (NVIDIA, 0x16C1), 0xA1)


INTEL_ROOT_PORT = (0x8086, 0x352A)
BROADCOM_PEX890XX = (0x1000, 0xC030)


def _bridge(
    bdf: str, ids: tuple[int, int], parent: str | None, group: int, numa: int
) -> FunctionSpec:
    return FunctionSpec(
        bdf,
        ids[0],
        ids[1],
        CLASS_PCI_BRIDGE,
        driver="pcieport",
        group=group,
        numa_node=numa,
        parent=parent,
    )


def hgx_h100() -> HostSpec:
    """8 H100 SXM5 GPUs on vfio-pci with cdevs, two per PCIe switch, four per NUMA node."""
    functions = [
        FunctionSpec("0000:00:00.0", 0x8086, 0x09A2, CLASS_HOST_BRIDGE, group=0, numa_node=0),
        FunctionSpec(
            "0000:00:17.0", 0x144D, 0xA80A, CLASS_NVME, driver="nvme", group=1, numa_node=0
        ),
    ]
    group = 10
    gpu_buses = (0x18, 0x2A, 0x3A, 0x5D, 0x9A, 0xAB, 0xBA, 0xDB)
    for switch in range(4):
        numa = switch // 2
        first_bus = gpu_buses[switch * 2]
        root_port = f"0000:{first_bus - 3:02x}:01.0"
        upstream = f"0000:{first_bus - 2:02x}:00.0"
        functions.append(_bridge(root_port, INTEL_ROOT_PORT, None, group, numa))
        functions.append(_bridge(upstream, BROADCOM_PEX890XX, root_port, group + 1, numa))
        group += 2
        for index in range(2):
            bus = gpu_buses[switch * 2 + index]
            downstream = f"0000:{first_bus - 1:02x}:{index:02x}.0"
            functions.append(_bridge(downstream, BROADCOM_PEX890XX, upstream, group, numa))
            device, subsystem, revision = H100_SXM
            functions.append(
                FunctionSpec(
                    f"0000:{bus:02x}:00.0",
                    NVIDIA,
                    device,
                    CLASS_3D,
                    subsystem,
                    revision,
                    driver="vfio-pci",
                    group=group + 1,
                    numa_node=numa,
                    parent=downstream,
                )
            )
            group += 2
    return HostSpec(tuple(functions), description="8 H100 GPUs on vfio-pci, iommufd and cdevs")


def vga_with_audio() -> HostSpec:
    """A VGA GPU on vfio-pci whose HD-audio function shares group 14 and is on snd_hda_intel."""
    return HostSpec(
        (
            FunctionSpec(
                "0000:3b:00.0",
                NVIDIA,
                0x2204,
                CLASS_VGA,
                (0x1458, 0x403B),
                0xA1,
                driver="vfio-pci",
                group=14,
                numa_node=0,
                consumers=("0000:3b:00.1",),
            ),
            FunctionSpec(
                "0000:3b:00.1",
                NVIDIA,
                0x1AEF,
                CLASS_AUDIO,
                (0x1458, 0x403B),
                0xA1,
                driver="snd_hda_intel",
                group=14,
                numa_node=0,
            ),
        ),
        description="a VGA GPU whose HD-audio function is still on snd_hda_intel",
    )


def nvidia_driver() -> HostSpec:
    """A GPU still on the host's nvidia driver."""
    return HostSpec(
        (
            FunctionSpec(
                "0000:17:00.0",
                NVIDIA,
                0x20B5,
                CLASS_3D,
                (NVIDIA, 0x1533),
                0xA1,
                driver="nvidia",
                group=20,
                numa_node=0,
            ),
        ),
        description="an A100 on the nvidia driver",
    )


def legacy_only() -> HostSpec:
    """Debian bookworm's 6.1 kernel: VFIO groups, vfio-dev entries, but no iommufd and no cdevs."""
    spec = hgx_h100()
    return replace(
        spec,
        iommufd=False,
        vfio_cdev=False,
        kernel_release="6.1.0-18-amd64",
        description="8 H100 GPUs on vfio-pci, legacy VFIO only (no iommufd, no cdevs)",
    )


def no_iommu() -> HostSpec:
    """IOMMU off in the firmware or on the kernel command line: no groups, nothing assignable."""
    return HostSpec(
        (
            FunctionSpec(
                "0000:17:00.0", NVIDIA, 0x2330, CLASS_3D, (NVIDIA, 0x16C1), 0xA1, numa_node=0
            ),
        ),
        iommu=False,
        iommufd=False,
        description="an H100 on a host without an IOMMU",
    )


def sriov_nic() -> HostSpec:
    """A ConnectX-6 Dx PF on mlx5_core with 4 of 8 VFs enabled and bound to vfio-pci."""
    pf = "0000:5e:00.0"
    vfs = tuple(
        FunctionSpec(
            f"0000:5e:00.{index + 2}",
            0x15B3,
            0x101E,
            CLASS_ETHERNET,
            (0x15B3, 0x0061),
            driver="vfio-pci",
            group=40 + index,
            numa_node=0,
            physfn=pf,
        )
        for index in range(4)
    )
    pf_spec = FunctionSpec(
        pf,
        0x15B3,
        0x101D,
        CLASS_ETHERNET,
        (0x15B3, 0x0061),
        driver="mlx5_core",
        group=39,
        numa_node=0,
        sriov_total=8,
        sriov_num=4,
    )
    return HostSpec((pf_spec, *vfs), description="an SR-IOV PF with 4 VFs on vfio-pci")


def scale(count: int = 4096) -> HostSpec:
    """`count` functions on vfio-pci, eight per multi-function device, one group per device."""
    functions = tuple(
        FunctionSpec(
            f"0000:{1 + index // 256:02x}:{(index // 8) % 32:02x}.{index % 8}",
            NVIDIA,
            0x2330,
            CLASS_3D,
            (NVIDIA, 0x16C1),
            0xA1,
            driver="vfio-pci",
            group=index // 8,
            numa_node=(index // 256) % 2,
            # Discovery does not read reset entries by default; leaving them out keeps the
            # benchmark's tree the same as before they were simulated.
            reset_methods=(),
        )
        for index in range(count)
    )
    return HostSpec(functions, description=f"{count} functions on vfio-pci")


SCENARIOS: dict[str, Callable[[], HostSpec]] = {
    "hgx-h100": hgx_h100,
    "vga-audio": vga_with_audio,
    "nvidia-driver": nvidia_driver,
    "legacy-only": legacy_only,
    "no-iommu": no_iommu,
    "sriov": sriov_nic,
    "scale": scale,
}


def scenario_names() -> Iterable[str]:
    return SCENARIOS.keys()
