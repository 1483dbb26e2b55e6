"""The node configuration the device plugin and the DRA driver share: which PCI functions each
resource takes and how they are handed out. Parsed and validated on load, defaults filled in one
place.

A file is YAML or JSON (JSON is read as JSON, anything else as YAML). Every error names the key
and what was expected, for example `resources[1].selectors.vendors[0]: expected 4 hex digits
such as "10de", got "nvidia"`.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any, TypeVar

from hostdev.bdf import Bdf
from hostdev.documents import DocumentError, read_document
from hostdev.errors import InvalidBdf
from hostdev.untrusted import quote_untrusted

NVIDIA_VENDOR = 0x10DE
# Class prefixes of NVIDIA devices worth passing through: VGA and 3D controllers (GPUs) and
# "other bridge" (NVSwitch).
NVIDIA_CLASSES = ("0300", "0302", "0680")
ANY_VFIO_DRIVER = "vfio"
IOMMUFD_RESOURCE = "devices.kubevirt.io/iommufd"
KUBEVIRT_QEMU_ID = 107
POD_RESOURCES_SOCKET = Path("/var/lib/kubelet/pod-resources/kubelet.sock")
# Node Feature Discovery's local feature source reads this directory (its default deployments
# mount it into nfd-worker).
NFD_FEATURES_DIR = Path("/etc/kubernetes/node-feature-discovery/features.d")
_RESOURCE_NAME = re.compile(
    r"(?=.{1,253}/)[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*"
    r"/[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?"
)


class ConfigError(ValueError):
    """A configuration that cannot be used; the message names the key and the fix."""


class Binding(Enum):
    """When the DRA driver's devices get onto a VFIO driver."""

    STATIC = "static"
    """Already there (an admin's `bind`, the init container): only VFIO-bound devices are
    published."""
    ON_DEMAND = "on-demand"
    """Devices on their host driver are published too and bound to VFIO when a VM's claim is
    prepared, then given back when it is released. The device plugin ignores it."""


class DeviceMode(Enum):
    """Which device nodes Allocate hands out for VFIO resources."""

    BOTH = "both"
    IOMMUFD = "iommufd"
    LEGACY = "legacy"


@dataclass(frozen=True, slots=True)
class Selectors:
    """Which PCI functions a resource takes; an empty list places no condition."""

    vendors: tuple[int, ...] = ()
    devices: tuple[int, ...] = ()
    classes: tuple[str, ...] = ()
    """Hex prefixes of the 24-bit class code: "03" (display), "0302" (3D), "030200"."""
    drivers: tuple[str, ...] = ()
    """Driver names; "vfio" stands for any VFIO driver. Only decides which devices join: a
    device that joined stays (and turns Unhealthy) when it leaves the driver."""
    pci_addresses: tuple[Bdf, ...] = ()


@dataclass(frozen=True, slots=True)
class ResourceConfig:
    """One VFIO resource named `resource_name`, or (without one) one resource per device id,
    named as NVIDIA's kubevirt-gpu-device-plugin names them."""

    selectors: Selectors
    resource_name: str | None = None
    reset_after_use: bool = False
    """Reset a device through sysfs once the pod that had it is gone, and offer it again only
    then (assignments come from the kubelet's pod resources API)."""
    binding: Binding = Binding.STATIC

    @property
    def auto_name(self) -> bool:
        return self.resource_name is None


@dataclass(frozen=True, slots=True)
class IommufdConfig:
    """The prepared /dev/iommu resource that hands the launcher an iommufd fd."""

    enabled: bool = True
    resource_name: str = IOMMUFD_RESOURCE
    slots: int = 110
    socket_dir: Path = Path("/var/run/kubevirt-iommufd")
    socket_uid: int = KUBEVIRT_QEMU_ID
    socket_gid: int = KUBEVIRT_QEMU_ID
    socket_mode: int = 0o660
    handoff_timeout_seconds: float = 900.0
    without_iommu_legacy: bool = False
    """`withoutIommu: legacy`: on a node without /dev/iommu keep the slots allocatable and hand
    out nothing (the launcher stays on legacy VFIO), rather than mark them Unhealthy."""


@dataclass(frozen=True, slots=True)
class PodResourcesConfig:
    """Where the kubelet's pod resources API is, and how often to ask it which devices pods
    hold (only asked when a resource has resetAfterUse)."""

    socket: Path = POD_RESOURCES_SOCKET
    poll_interval_seconds: float = 2.0


@dataclass(frozen=True, slots=True)
class NodeLabelsConfig:
    """Where the node's `kubevirt-iommufd.io/` labels go besides the Node itself (`--label-node`):
    a Node Feature Discovery feature file in `features_dir`, or none (None)."""

    features_dir: Path | None = NFD_FEATURES_DIR


@dataclass(frozen=True, slots=True)
class PluginConfig:
    resources: tuple[ResourceConfig, ...]
    device_mode: DeviceMode = DeviceMode.BOTH
    iommufd: IommufdConfig = field(default_factory=IommufdConfig)
    rescan_interval_seconds: float = 30.0
    pci_ids: Path | None = None
    pod_resources: PodResourcesConfig = field(default_factory=PodResourcesConfig)
    node_labels: NodeLabelsConfig = field(default_factory=NodeLabelsConfig)

    @property
    def resets_after_use(self) -> bool:
        return any(r.reset_after_use for r in self.resources)


def default_resources() -> tuple[ResourceConfig, ...]:
    """With no configuration: every NVIDIA GPU and NVSwitch on a VFIO driver, auto-named."""
    return (
        ResourceConfig(
            Selectors(vendors=(NVIDIA_VENDOR,), classes=NVIDIA_CLASSES, drivers=(ANY_VFIO_DRIVER,)),
        ),
    )


def default_config() -> PluginConfig:
    return PluginConfig(resources=default_resources())


def load_config(path: Path) -> PluginConfig:
    """Read and validate a configuration file."""
    try:
        data = read_document(path, "config")
    except DocumentError as error:
        raise ConfigError(str(error)) from error
    try:
        return parse_config({} if data is None else data)
    except ConfigError as error:
        raise ConfigError(f"config {path}: {error}") from error


def parse_config(data: object) -> PluginConfig:
    """Validate an already-decoded document (a mapping)."""
    top = _mapping(data, "the document")
    _known_keys(
        top,
        "",
        {
            "resources",
            "deviceMode",
            "iommufd",
            "rescanIntervalSeconds",
            "pciIds",
            "podResources",
            "nodeLabels",
        },
    )
    resources = (
        tuple(
            _resource(item, f"resources[{i}]")
            for i, item in enumerate(_list(top["resources"], "resources"))
        )
        if "resources" in top
        else default_resources()
    )
    mode_text = _string(top.get("deviceMode", "both"), "deviceMode")
    try:
        mode = DeviceMode(mode_text)
    except ValueError:
        raise ConfigError(
            f'deviceMode: expected "both", "iommufd" or "legacy", got {mode_text!r}'
        ) from None
    interval = _number(top.get("rescanIntervalSeconds", 30), "rescanIntervalSeconds", low=1)
    pci_ids = top.get("pciIds")
    iommufd = _iommufd(top.get("iommufd", {}), "iommufd")
    for index, resource in enumerate(resources):
        # Two resources of one name would be served on one socket.
        if resource.resource_name == iommufd.resource_name:
            raise ConfigError(
                f"resources[{index}].resourceName: {resource.resource_name!r} is the iommufd"
                " resource's name (iommufd.resourceName); give the VFIO resource another"
            )
    return PluginConfig(
        resources=resources,
        device_mode=mode,
        iommufd=iommufd,
        rescan_interval_seconds=interval,
        pci_ids=None if pci_ids is None else Path(_string(pci_ids, "pciIds")),
        pod_resources=_pod_resources(top.get("podResources", {}), "podResources"),
        node_labels=_node_labels(top.get("nodeLabels", {}), "nodeLabels"),
    )


def _node_labels(data: object, key: str) -> NodeLabelsConfig:
    item = _mapping(data, key)
    _known_keys(item, key, {"featuresDir"})
    text = _string(item.get("featuresDir", str(NFD_FEATURES_DIR)), f"{key}.featuresDir")
    if text == "none":
        return NodeLabelsConfig(features_dir=None)
    if not text.startswith("/"):
        raise ConfigError(
            f"{key}.featuresDir: expected an absolute directory (NFD's is {NFD_FEATURES_DIR})"
            f" or none, got {text!r}"
        )
    return NodeLabelsConfig(features_dir=Path(text))


def _pod_resources(data: object, key: str) -> PodResourcesConfig:
    item = _mapping(data, key)
    _known_keys(item, key, {"socket", "pollIntervalSeconds"})
    defaults = PodResourcesConfig()
    return PodResourcesConfig(
        socket=Path(_string(item.get("socket", str(defaults.socket)), f"{key}.socket")),
        poll_interval_seconds=_number(
            item.get("pollIntervalSeconds", defaults.poll_interval_seconds),
            f"{key}.pollIntervalSeconds",
            low=0.1,
        ),
    )


def _resource(data: object, key: str) -> ResourceConfig:
    item = _mapping(data, key)
    _known_keys(item, key, {"resourceName", "autoName", "selectors", "resetAfterUse", "binding"})
    selectors = _selectors(item.get("selectors", {}), f"{key}.selectors")
    reset = item.get("resetAfterUse", False)
    if not isinstance(reset, bool):
        raise ConfigError(f"{key}.resetAfterUse: expected true or false, got {_kind(reset)}")
    binding_text = _string(item.get("binding", Binding.STATIC.value), f"{key}.binding")
    try:
        binding = Binding(binding_text)
    except ValueError:
        raise ConfigError(
            f'{key}.binding: expected "static" or "on-demand", got {binding_text!r}'
        ) from None
    if "resourceName" in item and "autoName" in item:
        raise ConfigError(f"{key}: give resourceName or autoName, not both")
    if "autoName" in item:
        style = _string(item["autoName"], f"{key}.autoName")
        if style != "nvidia":
            raise ConfigError(f'{key}.autoName: expected "nvidia", got {style!r}')
        return ResourceConfig(selectors, reset_after_use=reset, binding=binding)
    if "resourceName" not in item:
        raise ConfigError(f"{key}: missing resourceName (or autoName: nvidia)")
    name = validate_resource_name(
        _string(item["resourceName"], f"{key}.resourceName"), f"{key}.resourceName"
    )
    if selectors == Selectors():
        raise ConfigError(f"{key}.selectors: give at least one selector, or every device matches")
    return ResourceConfig(selectors, resource_name=name, reset_after_use=reset, binding=binding)


def validate_resource_name(name: str, key: str = "resourceName") -> str:
    if not _RESOURCE_NAME.fullmatch(name):
        raise ConfigError(
            f"{key}: {name!r} is not an extended resource name like vendor.com/device"
            " (a DNS domain, '/', then up to 63 letters, digits, '-', '_' or '.')"
        )
    if name.startswith(("kubernetes.io/", "requests.")):
        raise ConfigError(f"{key}: {name!r} is in a namespace Kubernetes reserves")
    return name


def _selectors(data: object, key: str) -> Selectors:
    item = _mapping(data, key)
    _known_keys(item, key, {"vendors", "devices", "classes", "drivers", "pciAddresses"})
    return Selectors(
        vendors=_each(item, "vendors", key, _hex_id),
        devices=_each(item, "devices", key, _hex_id),
        classes=_each(item, "classes", key, _class_prefix),
        drivers=_each(item, "drivers", key, _driver),
        pci_addresses=_each(item, "pciAddresses", key, _bdf),
    )


T = TypeVar("T")


def _each(
    item: Mapping[str, Any], name: str, key: str, parse: Callable[[object, str], T]
) -> tuple[T, ...]:
    values = _list(item.get(name, []), f"{key}.{name}")
    return tuple(parse(value, f"{key}.{name}[{i}]") for i, value in enumerate(values))


def _hex_id(value: object, key: str) -> int:
    text = _string(value, key).lower().removeprefix("0x")
    if not re.fullmatch(r"[0-9a-f]{4}", text):
        raise ConfigError(f'{key}: expected 4 hex digits such as "10de", got {value!r}')
    return int(text, 16)


def _class_prefix(value: object, key: str) -> str:
    text = _string(value, key).lower().removeprefix("0x")
    if not re.fullmatch(r"[0-9a-f]{2}|[0-9a-f]{4}|[0-9a-f]{6}", text):
        raise ConfigError(
            f'{key}: expected a class prefix of 2, 4 or 6 hex digits such as "0302", got {value!r}'
        )
    return text


def _driver(value: object, key: str) -> str:
    text = _string(value, key)
    if not re.fullmatch(r"[A-Za-z0-9_.-]{1,64}", text):
        raise ConfigError(f"{key}: expected a driver name such as vfio-pci, got {value!r}")
    return text


def _bdf(value: object, key: str) -> Bdf:
    try:
        return Bdf.parse(_string(value, key))
    except InvalidBdf as error:
        raise ConfigError(f"{key}: {error}") from None


def _iommufd(data: object, key: str) -> IommufdConfig:
    item = _mapping(data, key)
    allowed = {
        "enabled",
        "resourceName",
        "slots",
        "socketDir",
        "socketOwner",
        "socketMode",
        "handoffTimeoutSeconds",
        "withoutIommu",
    }
    _known_keys(item, key, allowed)
    defaults = IommufdConfig()
    owner = _mapping(item.get("socketOwner", {}), f"{key}.socketOwner")
    _known_keys(owner, f"{key}.socketOwner", {"uid", "gid"})
    mode_text = _string(item.get("socketMode", "0660"), f"{key}.socketMode")
    if not re.fullmatch(r"0?[0-7]{3}", mode_text):
        raise ConfigError(
            f'{key}.socketMode: expected an octal mode such as "0660", got {mode_text!r}'
        )
    mode = int(mode_text, 8)
    if mode & 0o002:
        raise ConfigError(
            f"{key}.socketMode: {mode_text} lets any user take the iommufd fd; drop the"
            " world-write bit (the default 0660 admits the launcher's uid/gid only)"
        )
    enabled = item.get("enabled", True)
    if not isinstance(enabled, bool):
        raise ConfigError(f"{key}.enabled: expected true or false, got {enabled!r}")
    return IommufdConfig(
        enabled=enabled,
        resource_name=validate_resource_name(
            _string(item.get("resourceName", defaults.resource_name), f"{key}.resourceName"),
            f"{key}.resourceName",
        ),
        slots=int(_number(item.get("slots", defaults.slots), f"{key}.slots", low=1, integer=True)),
        socket_dir=Path(
            _string(item.get("socketDir", str(defaults.socket_dir)), f"{key}.socketDir")
        ),
        socket_uid=int(
            _number(
                owner.get("uid", defaults.socket_uid), f"{key}.socketOwner.uid", low=0, integer=True
            )
        ),
        socket_gid=int(
            _number(
                owner.get("gid", defaults.socket_gid), f"{key}.socketOwner.gid", low=0, integer=True
            )
        ),
        socket_mode=mode,
        handoff_timeout_seconds=_number(
            item.get("handoffTimeoutSeconds", defaults.handoff_timeout_seconds),
            f"{key}.handoffTimeoutSeconds",
            low=1,
        ),
        without_iommu_legacy=_without_iommu(item.get("withoutIommu", "unhealthy"), key),
    )


def _without_iommu(value: object, key: str) -> bool:
    choice = _string(value, f"{key}.withoutIommu")
    if choice not in ("unhealthy", "legacy"):
        raise ConfigError(f'{key}.withoutIommu: expected "unhealthy" or "legacy", got {choice!r}')
    return choice == "legacy"


def _mapping(value: object, key: str) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise ConfigError(f"{key}: expected a mapping, got {_kind(value)}")
    return value


def _list(value: object, key: str) -> list[Any]:
    if not isinstance(value, list):
        raise ConfigError(f"{key}: expected a list, got {_kind(value)}")
    return value


def _string(value: object, key: str) -> str:
    if not isinstance(value, str) or not value:
        raise ConfigError(f"{key}: expected a non-empty string, got {_kind(value)}")
    return value


def _number(value: object, key: str, *, low: float, integer: bool = False) -> float:
    kind = "an integer" if integer else "a number"
    problem = ConfigError(f"{key}: expected {kind} of at least {low:g}, got {value!r}")
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise problem
    if (integer and not isinstance(value, int)) or value < low:
        raise problem
    return float(value)


def _known_keys(item: Mapping[str, Any], key: str, allowed: set[str]) -> None:
    for name in item:
        if name not in allowed:
            text = str(name)
            # Quoted when it could break the one-line message (a newline, a megabyte).
            shown = text if text.isprintable() and len(text) <= 60 else quote_untrusted(text, 60)
            where = f"{key}.{shown}" if key else shown
            raise ConfigError(f"{where}: unknown key; expected one of {', '.join(sorted(allowed))}")


def _kind(value: object) -> str:
    if value is None:
        return "nothing"
    return f"{type(value).__name__} {value!r}"[:80]
