"""The decision: which backend each PCI host device gets, and what has to change for it. No XML.

Rules (issue 4): libvirt >= 12.2 takes a domain-wide `<iommufd enabled='yes'/>` plus
`<driver iommufd='no'/>` on each device that cannot follow it; 12.1 only knows the per-device
`<driver iommufd='yes'/>`; anything older or unknown stays legacy. A domain-wide `<iommufd>` that
is already there (KubeVirt's own IOMMUFD gate) is kept, and only the per-device fall-backs it lacks
are added. A per-device `iommufd` someone set before us is respected.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum

from hostdev.bdf import Bdf
from hostdev.untrusted import quote_untrusted
from launcher_hook.errors import IommufdRequired
from launcher_hook.model import (
    ANNOTATION_LIBVIRT_VERSION,
    ANNOTATION_MODE,
    DOMAIN_IOMMUFD,
    PER_DEVICE_IOMMUFD,
    Backend,
    Capabilities,
    DeviceDecision,
    DeviceSupport,
    LibvirtVersion,
    Policy,
    Sourced,
    Vmi,
)


@dataclass(frozen=True, slots=True)
class PciHostdev:
    """A `<hostdev mode='subsystem' type='pci'>` as found in the domain."""

    alias: str | None
    bdf: Bdf | None
    preset: str | None
    """`iommufd` on its `<driver>` before this hook ran, if anything set it."""


@dataclass(frozen=True, slots=True)
class DevicePlan:
    decision: DeviceDecision
    driver_iommufd: str | None
    """Value of `<driver iommufd=…>` to add, or None to leave the device as it is."""


@dataclass(frozen=True, slots=True)
class Plan:
    add_domain_iommufd: bool
    devices: tuple[DevicePlan, ...]


class _Mode(Enum):
    IN_TREE_ON = "in-tree-on"
    IN_TREE_OFF = "in-tree-off"
    DOMAIN = "domain"
    PER_DEVICE = "per-device"
    LEGACY = "legacy"


def resolve_policy(flag: Policy, vmi: Vmi) -> Sourced[Policy]:
    text = vmi.annotations.get(ANNOTATION_MODE)
    if text is None:
        return Sourced(flag, "--policy")
    where = f"annotation {ANNOTATION_MODE}"
    return Sourced(Policy.parse(text, f"VMI {vmi.label} {where}"), where)


def resolve_libvirt(caps: Capabilities, vmi: Vmi) -> Sourced[LibvirtVersion] | None:
    if caps.libvirt is not None:
        return caps.libvirt
    text = vmi.annotations.get(ANNOTATION_LIBVIRT_VERSION)
    if text is None:
        return None
    where = f"annotation {ANNOTATION_LIBVIRT_VERSION}"
    return Sourced(LibvirtVersion.parse(text, f"VMI {vmi.label} {where}"), where)


def plan_devices(
    hostdevs: Sequence[PciHostdev],
    domain_iommufd: str | None,
    interface_hostdevs: bool,
    caps: Capabilities,
    policy: Sourced[Policy],
    libvirt: Sourced[LibvirtVersion] | None,
) -> Plan:
    """Decide every PCI host device.

    `domain_iommufd` is the `enabled` value of a domain `<iommufd>` present before this hook;
    `interface_hostdevs` says the domain also has `<interface type='hostdev'>` devices, which a
    domain-wide default would move to iommufd too although this hook never checked them.
    """
    mode, mode_reason = _mode(domain_iommufd, interface_hostdevs, libvirt)
    supports = [_device_support(h, caps) for h in hostdevs]
    ours = policy.value is not Policy.DISABLE
    add_domain = (
        mode is _Mode.DOMAIN
        and ours
        and any(s.gap is None and h.preset is None for h, s in zip(hostdevs, supports, strict=True))
    )
    # Devices left out of a domain-wide default need their own opt-out.
    opt_out = "no" if mode is _Mode.IN_TREE_ON or add_domain else None
    plans = []
    for hostdev, support in zip(hostdevs, supports, strict=True):
        if hostdev.preset is not None:
            backend = Backend.IOMMUFD if hostdev.preset == "yes" else Backend.LEGACY
            reason = f"<driver iommufd={_shown(hostdev.preset)}> set before this hook"
            change = None
        elif not ours:
            backend, reason, change = Backend.LEGACY, f"policy disable ({policy.source})", opt_out
        elif mode in (_Mode.LEGACY, _Mode.IN_TREE_OFF):
            backend, reason, change = Backend.LEGACY, mode_reason, None
        elif support.gap is not None:
            backend, reason, change = Backend.LEGACY, support.gap, opt_out
        else:
            backend = Backend.IOMMUFD
            reason = f"cdev {support.cdev}, kernel iommufd, {mode_reason}"
            change = "yes" if mode is _Mode.PER_DEVICE else None
        plans.append(
            DevicePlan(DeviceDecision(hostdev.alias, hostdev.bdf, backend, reason), change)
        )
    return Plan(add_domain, tuple(plans))


def check_required(plan: Plan, policy: Sourced[Policy], vmi: Vmi) -> None:
    """Under `require`, every PCI host device must have come out on iommufd."""
    if policy.value is not Policy.REQUIRE:
        return
    problems = tuple(
        f"hostdev {p.decision.label} ({p.decision.bdf or 'no PCI address'})"
        f" cannot use iommufd: {p.decision.reason}"
        for p in plan.devices
        if p.decision.backend is Backend.LEGACY
    )
    if problems:
        raise IommufdRequired(vmi.label, policy.source, problems)


def _mode(
    domain_iommufd: str | None, interface_hostdevs: bool, libvirt: Sourced[LibvirtVersion] | None
) -> tuple[_Mode, str]:
    # A domain <iommufd> that libvirt is going to accept is itself proof of libvirt >= 12.2.
    if domain_iommufd is not None:
        mode = _Mode.IN_TREE_ON if domain_iommufd == "yes" else _Mode.IN_TREE_OFF
        return mode, f"domain <iommufd enabled={_shown(domain_iommufd)}> set before this hook"
    if libvirt is None:
        return _Mode.LEGACY, (
            "libvirt version unknown: libvirt did not answer and neither --libvirt-version nor"
            f" annotation {ANNOTATION_LIBVIRT_VERSION} gives it"
        )
    said = f"libvirt {libvirt.value} ({libvirt.source})"
    if libvirt.value < PER_DEVICE_IOMMUFD:
        return _Mode.LEGACY, f"{said} predates iommufd (needs {PER_DEVICE_IOMMUFD})"
    if libvirt.value < DOMAIN_IOMMUFD:
        return _Mode.PER_DEVICE, said
    if interface_hostdevs:
        return _Mode.PER_DEVICE, (
            f"{said}, per device: a domain-wide default would also move the domain's"
            " <interface type='hostdev'> devices"
        )
    return _Mode.DOMAIN, said


def _shown(value: str) -> str:
    """An attribute value from the domain, quoted and short: it lands in logs and errors."""
    return quote_untrusted(value, 20)


def _device_support(hostdev: PciHostdev, caps: Capabilities) -> DeviceSupport:
    if hostdev.bdf is None:
        return DeviceSupport(None, "its <source><address> is not a PCI address the hook can read")
    if not caps.kernel_iommufd:
        return DeviceSupport(
            None,
            "no iommufd: the kernel lacks CONFIG_IOMMUFD (no /dev/iommu, no /sys/class/misc/iommu)",
        )
    return caps.devices.get(hostdev.bdf) or DeviceSupport(None, "its VFIO cdev was not examined")
