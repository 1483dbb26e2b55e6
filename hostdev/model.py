"""The host model: plain immutable values that discovery produces and decisions consume."""

from __future__ import annotations

import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TypeVar

from hostdev.bdf import Bdf

PCI_CLASS_BRIDGE = 0x06
# Host, ISA, PCI-to-PCI and semi-transparent PCI bridges: chipset plumbing, never assignable.
# Other class-06 devices (0x0680 "other bridge", e.g. NVIDIA NVSwitch) can be.
_CHIPSET_BRIDGE_SUBCLASSES = frozenset({0x00, 0x01, 0x04, 0x09})
_K = TypeVar("_K", Bdf, int)
_V = TypeVar("_V")


def is_vfio_driver(driver: str | None) -> bool:
    """vfio-pci itself, or a variant driver such as nvgrace_gpu_vfio_pci or mlx5_vfio_pci."""
    if driver is None:
        return False
    name = driver.replace("-", "_")
    return name == "vfio_pci" or name.endswith("_vfio_pci")


# Drivers that leave a group usable by VFIO. pcieport declares driver_managed_dma, so the kernel
# lets a group holding a bridge on it be claimed (Linux >= 5.19).
_GROUP_SAFE_DRIVERS = frozenset({"pci-stub", "pcieport"})


def is_group_safe_driver(driver: str | None) -> bool:
    """True when a group member on this driver does not block assignment of the group."""
    return driver is None or is_vfio_driver(driver) or driver in _GROUP_SAFE_DRIVERS


@dataclass(frozen=True, slots=True)
class Sriov:
    """SR-IOV state of a physical function."""

    total_vfs: int
    num_vfs: int


@dataclass(frozen=True, slots=True)
class PciFunction:
    """One PCI function as sysfs shows it."""

    bdf: Bdf
    vendor_id: int
    device_id: int
    subsystem_vendor_id: int | None
    subsystem_device_id: int | None
    class_code: int
    revision: int | None
    driver: str | None
    iommu_group: int | None
    numa_node: int | None
    sriov: Sriov | None
    physfn: Bdf | None
    modalias: str | None
    # Upstream bridges from the root port down to the direct parent; shared entries mean a shared
    # PCIe switch.
    upstream: tuple[Bdf, ...]
    # Functions that declared a device link on this one (a GPU's HD-audio function, for one).
    consumers: tuple[Bdf, ...]
    vfio_cdev: str | None
    """Name of the VFIO cdev (`vfio0`) when the kernel gave the device one."""
    vfio_cdev_present: bool
    """Whether `/dev/vfio/devices/<vfio_cdev>` exists."""
    vfio_sysfs_without_cdev: bool
    """The device has a `vfio-dev` entry with no char device: a kernel without VFIO cdevs."""
    reset_methods: tuple[str, ...] | None = None
    """The kernel's reset methods in the order it tries them (`reset_method`: `flr`, `pm`,
    `bus`, ...), `("default",)` on kernels before 5.15 that only offer `reset`, `()` when the
    device cannot be reset, None when discovery was not asked to read them."""
    pcie_root: str | None = None
    """The PCI host bridge the device hangs off, as sysfs names it (`pci0000:00`): the value of
    the standard DRA attribute `resource.kubernetes.io/pcieRoot`."""

    @property
    def is_bridge(self) -> bool:
        """A chipset bridge (host, ISA or PCI-to-PCI), which no VM can be given."""
        return (
            self.class_code >> 16 == PCI_CLASS_BRIDGE
            and (self.class_code >> 8) & 0xFF in _CHIPSET_BRIDGE_SUBCLASSES
        )

    @property
    def is_virtual_function(self) -> bool:
        return self.physfn is not None

    @property
    def cdev_path(self) -> str | None:
        """Container/host path of the cdev node, when the kernel gave the device one."""
        # Interned: every device of a group lists its siblings' paths, and a 4,096-function host
        # would otherwise hold each path once per sibling.
        return sys.intern(f"/dev/vfio/devices/{self.vfio_cdev}") if self.vfio_cdev else None


@dataclass(frozen=True, slots=True)
class GroupMember:
    """A device in an IOMMU group: a PCI function, or another bus's device named as sysfs does."""

    name: str
    bdf: Bdf | None
    driver: str | None


@dataclass(frozen=True, slots=True)
class IommuGroup:
    """An IOMMU group: the unit the kernel isolates, and so the unit VFIO hands out."""

    number: int
    members: tuple[GroupMember, ...]
    legacy_node_present: bool
    """Whether `/dev/vfio/<number>` exists (legacy VFIO)."""

    @property
    def blockers(self) -> tuple[GroupMember, ...]:
        """Members whose driver keeps the group from being claimed by VFIO."""
        return tuple(m for m in self.members if not is_group_safe_driver(m.driver))

    @property
    def viable(self) -> bool:
        return not self.blockers

    @property
    def legacy_node(self) -> str:
        return sys.intern(f"/dev/vfio/{self.number}")


@dataclass(frozen=True, slots=True)
class HostCapabilities:
    """What the node's kernel offers for device assignment."""

    iommu: bool
    """An IOMMU is active: `/sys/class/iommu` has units or `/sys/kernel/iommu_groups` has groups."""
    iommufd: bool
    """The kernel has iommufd: `/dev/iommu` or `/sys/class/misc/iommu` exists."""
    iommufd_node_present: bool
    """`/dev/iommu` exists."""
    iommufd_devnum: str | None
    """`major:minor` of /dev/iommu from sysfs; dynamic, so never assumed."""
    vfio_cdev: bool | None
    """CONFIG_VFIO_DEVICE_CDEV: True/False once a VFIO device shows it, None while none does."""
    legacy_vfio_node_present: bool
    """`/dev/vfio/vfio` exists (the legacy VFIO container)."""
    kernel_release: str | None


@dataclass(frozen=True, slots=True)
class HostInventory:
    """Everything discovery found on one host, with look-ups by address and group."""

    functions: tuple[PciFunction, ...]
    groups: tuple[IommuGroup, ...]
    capabilities: HostCapabilities
    _by_bdf: MappingProxyType[Bdf, PciFunction] = field(init=False, repr=False, compare=False)
    _by_group: MappingProxyType[int, IommuGroup] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_by_bdf", MappingProxyType({f.bdf: f for f in self.functions}))
        object.__setattr__(self, "_by_group", MappingProxyType({g.number: g for g in self.groups}))

    def with_changes(
        self,
        functions: Mapping[Bdf, PciFunction | None] = MappingProxyType({}),
        groups: Mapping[int, IommuGroup | None] = MappingProxyType({}),
        capabilities: HostCapabilities | None = None,
    ) -> HostInventory:
        """This inventory with `functions` and `groups` put in (None takes one out), and
        `capabilities` if given. Everything else is shared, and the look-ups are copied rather
        than built again: on a host of thousands of functions a change of a few costs little."""
        by_bdf = _changed(self._by_bdf, functions)
        by_group = _changed(self._by_group, groups)
        changed = object.__new__(HostInventory)
        object.__setattr__(changed, "functions", tuple(by_bdf.values()))
        object.__setattr__(changed, "groups", tuple(by_group.values()))
        object.__setattr__(changed, "capabilities", capabilities or self.capabilities)
        object.__setattr__(changed, "_by_bdf", MappingProxyType(by_bdf))
        object.__setattr__(changed, "_by_group", MappingProxyType(by_group))
        return changed

    def function(self, bdf: Bdf) -> PciFunction | None:
        return self._by_bdf.get(bdf)

    def group(self, number: int | None) -> IommuGroup | None:
        return None if number is None else self._by_group.get(number)

    def group_of(self, function: PciFunction) -> IommuGroup | None:
        return self.group(function.iommu_group)


def _changed(current: MappingProxyType[_K, _V], changes: Mapping[_K, _V | None]) -> dict[_K, _V]:
    """`current` (in key order) with `changes` put in, still in key order. The copy is the
    dict's own, which keeps the keys' hashes, and the keys are only sorted again when one is
    new."""
    merged = current.copy()
    added = False
    for key, value in changes.items():
        if value is None:
            merged.pop(key, None)
        else:
            added |= key not in merged
            merged[key] = value
    return dict(sorted(merged.items(), key=lambda item: item[0])) if added else merged
