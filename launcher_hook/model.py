"""Values the hook decides from and the decision it reports: plain, immutable, no IO."""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import Enum
from types import MappingProxyType
from typing import Generic, TypeVar

from hostdev.bdf import Bdf
from hostdev.untrusted import quote_untrusted
from launcher_hook.errors import InvalidInput

ANNOTATION_MODE = "iommufd.kubevirt.io/mode"
ANNOTATION_LIBVIRT_VERSION = "iommufd.kubevirt.io/libvirt-version"

T = TypeVar("T")
_VERSION = re.compile(r"(\d{1,4})\.(\d{1,4})(?:\.(\d{1,4}))?")


class Policy(Enum):
    """What the VMI may get: iommufd where possible, iommufd or fail, or legacy VFIO only."""

    AUTO = "auto"
    REQUIRE = "require"
    DISABLE = "disable"

    @classmethod
    def parse(cls, text: str, where: str) -> Policy:
        try:
            return cls(text)
        except ValueError:
            choices = "|".join(p.value for p in cls)
            raise InvalidInput(
                f"{where}: expected {choices}, found {quote_untrusted(text, 40)}"
            ) from None


class Backend(Enum):
    IOMMUFD = "iommufd"
    LEGACY = "legacy"


@dataclass(frozen=True, order=True, slots=True)
class LibvirtVersion:
    major: int
    minor: int
    micro: int = 0

    @classmethod
    def parse(cls, text: str, where: str) -> LibvirtVersion:
        match = _VERSION.fullmatch(text.strip())
        if match is None:
            raise InvalidInput(
                f"{where}: expected a libvirt version like 12.2.0,"
                f" found {quote_untrusted(text, 40)}"
            )
        return cls(int(match[1]), int(match[2]), int(match[3] or 0))

    @classmethod
    def from_number(cls, number: int) -> LibvirtVersion:
        """From `virConnectGetLibVersion`'s major * 1,000,000 + minor * 1,000 + micro."""
        return cls(number // 1_000_000, number // 1_000 % 1_000, number % 1_000)

    def __str__(self) -> str:
        return f"{self.major}.{self.minor}.{self.micro}"


# libvirt 12.1 added <driver iommufd=…> on a hostdev; 12.2 the domain-wide <iommufd enabled=…>.
PER_DEVICE_IOMMUFD = LibvirtVersion(12, 1)
DOMAIN_IOMMUFD = LibvirtVersion(12, 2)


@dataclass(frozen=True, slots=True)
class Sourced(Generic[T]):
    """A setting and where it came from, so a decision can say why."""

    value: T
    source: str


@dataclass(frozen=True, slots=True)
class DeviceSupport:
    """Whether one PCI function can be reached through its VFIO cdev."""

    cdev: str | None
    """The cdev's name (`vfio3`) when sysfs and /dev both have it."""
    gap: str | None
    """Why the device cannot use its cdev; None when it can."""


@dataclass(frozen=True, slots=True)
class Capabilities:
    """What the node offers the VMI's PCI host devices, and the libvirt that will run them."""

    kernel_iommufd: bool
    devices: Mapping[Bdf, DeviceSupport]
    libvirt: Sourced[LibvirtVersion] | None
    """None when neither libvirt nor the hook's flag said; the VMI annotation may still say."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "devices", MappingProxyType(dict(self.devices)))


@dataclass(frozen=True, slots=True)
class Vmi:
    """The parts of a VirtualMachineInstance the hook reads."""

    name: str
    namespace: str
    annotations: Mapping[str, str] = field(default_factory=dict)

    @property
    def key(self) -> str:
        return f"{self.namespace}/{self.name}"

    @property
    def label(self) -> str:
        """`key` quoted for logs and errors: names come from the VMI JSON, which we don't trust."""
        return quote_untrusted(self.key)


@dataclass(frozen=True, slots=True)
class DeviceDecision:
    alias: str | None
    bdf: Bdf | None
    backend: Backend
    reason: str

    @property
    def label(self) -> str:
        """The alias quoted for logs and errors: it comes from the domain XML."""
        return "(no alias)" if self.alias is None else quote_untrusted(self.alias)

    def describe(self) -> str:
        where = str(self.bdf) if self.bdf else "no PCI address"
        return f"{self.label} {where} {self.backend.value} ({self.reason})"


@dataclass(frozen=True, slots=True)
class Decision:
    """What the hook chose for one VMI, device by device, and on what grounds."""

    vmi: Vmi
    policy: Sourced[Policy]
    libvirt: Sourced[LibvirtVersion] | None
    devices: tuple[DeviceDecision, ...]

    def summary(self) -> str:
        """The one log line per VMI."""
        if not self.devices:
            return f"vmi {self.vmi.label}: no PCI host devices, domain unchanged"
        chosen = "; ".join(d.describe() for d in self.devices)
        return f"vmi {self.vmi.label}: policy {self.policy.value.value}: {chosen}"


@dataclass(frozen=True, slots=True)
class Rewrite:
    domain_xml: bytes
    decision: Decision
