"""The webhook's configuration: a frozen value parsed from YAML or JSON and checked key by key.

Unknown keys are refused rather than ignored: a misspelt opt-out (`namespace:` for `namespaces:`)
would otherwise silently inject devices into pods the operator meant to leave alone.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any

from hostdev.documents import DocumentError, read_document
from hostdev.untrusted import quote_untrusted

IOMMUFD_RESOURCE = "devices.kubevirt.io/iommufd"
DEFAULT_PREFIXES: tuple[str, ...] = ("nvidia.com/",)
PULL_POLICIES = ("Always", "IfNotPresent", "Never")


class ConfigError(ValueError):
    """A configuration file that cannot be read or does not follow the schema."""


# The sidecar cannot see the compute container's /dev, so it judges cdevs from sysfs.
DEFAULT_HOOK_ARGS = ("hook", "--cdev-check", "sysfs")


@dataclass(frozen=True, slots=True)
class HookSidecar:
    """The entry `/mutate-vmi` appends to a VMI's `hooks.kubevirt.io/hookSidecars` annotation."""

    image: str
    image_pull_policy: str = "IfNotPresent"
    command: tuple[str, ...] = ()
    args: tuple[str, ...] = DEFAULT_HOOK_ARGS
    dra_claims: bool = False
    """`draClaims`: also for VMIs whose GPUs or host devices come from DRA claims (`claimName`
    and `requestName`, KubeVirt's HostDevicesWithDRA and GPUsWithDRA gates). The webhook reads no
    claim, so which driver a claim is for is unknown here: the hook leaves a device it cannot
    give iommufd on legacy VFIO, so a claim of another driver is safe."""

    def entry(self) -> dict[str, Any]:
        """The annotation entry in KubeVirt's field names."""
        entry: dict[str, Any] = {"image": self.image, "imagePullPolicy": self.image_pull_policy}
        if self.command:
            entry["command"] = list(self.command)
        entry["args"] = list(self.args)
        return entry


@dataclass(frozen=True, slots=True)
class Config:
    """What the webhook manages and where it keeps out."""

    resource_names: frozenset[str] = frozenset()
    resource_prefixes: tuple[str, ...] = DEFAULT_PREFIXES
    strict: bool = False
    skip_namespaces: frozenset[str] = frozenset()
    # Label → value; a VMI carrying any of these (and so its launcher pod, which virt-controller
    # gives the VMI's labels) is left alone.
    skip_labels: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))
    hook_sidecar: HookSidecar | None = None

    def is_managed(self, resource: str) -> bool:
        """True for a VFIO resource served by our device plugin (never the iommufd slot itself)."""
        return resource != IOMMUFD_RESOURCE and (
            resource in self.resource_names or resource.startswith(self.resource_prefixes)
        )

    def skips(self, namespace: str, labels: Mapping[str, object]) -> str | None:
        """Why an object in `namespace` with `labels` is opted out, or None when it is not."""
        if namespace in self.skip_namespaces:
            return f"namespace {namespace} is opted out"
        for key, value in self.skip_labels.items():
            if labels.get(key) == value:
                return f"label {key}={value} opts it out"
        return None


def read_config(path: Path) -> Config:
    """Load and check a YAML or JSON (by the `.json` suffix) configuration file."""
    try:
        data = read_document(path, "config file")
    except DocumentError as error:
        raise ConfigError(str(error)) from error
    try:
        return parse_config({} if data is None else data)
    except ConfigError as error:
        raise ConfigError(f"config file {path}: {error}") from error


def parse_config(data: object) -> Config:
    """Check a decoded document against the schema (see docs/webhook.md) and build the value."""
    top = _mapping(data, "the top level", {"managedResources", "strict", "skip", "hookSidecar"})
    names: frozenset[str] = frozenset()
    prefixes: tuple[str, ...] = DEFAULT_PREFIXES
    if "managedResources" in top:
        managed = _mapping(top["managedResources"], "managedResources", {"names", "prefixes"})
        names = frozenset(_names(managed.get("names", []), "managedResources.names"))
        prefixes = tuple(_prefixes(managed.get("prefixes", []), "managedResources.prefixes"))
        if not names and not prefixes:
            raise ConfigError(
                "managedResources: both names and prefixes are empty; list at least one"
                " resource name (e.g. nvidia.com/GH100_H100) or prefix (e.g. nvidia.com/)"
            )
    skip = _mapping(top.get("skip", {}), "skip", {"namespaces", "vmiLabels"})
    return Config(
        resource_names=names,
        resource_prefixes=prefixes,
        strict=_bool(top.get("strict", False), "strict"),
        skip_namespaces=frozenset(_strings(skip.get("namespaces", []), "skip.namespaces")),
        skip_labels=MappingProxyType(_labels(skip.get("vmiLabels", {}), "skip.vmiLabels")),
        hook_sidecar=_hook_sidecar(top.get("hookSidecar", {})),
    )


def _hook_sidecar(data: object) -> HookSidecar | None:
    keys = {"enabled", "image", "imagePullPolicy", "command", "args", "draClaims"}
    section = _mapping(data, "hookSidecar", keys)
    if not _bool(section.get("enabled", False), "hookSidecar.enabled"):
        return None
    image = section.get("image")
    if not isinstance(image, str) or not image.strip():
        raise ConfigError(
            f"hookSidecar.image: expected the sidecar's image reference (e.g."
            f" ghcr.io/example/kubevirt-iommufd:v0.1.0) when hookSidecar.enabled is true,"
            f" got {_shown(image)}"
        )
    policy = section.get("imagePullPolicy", "IfNotPresent")
    if policy not in PULL_POLICIES:
        raise ConfigError(
            f"hookSidecar.imagePullPolicy: expected one of {', '.join(PULL_POLICIES)},"
            f" got {_shown(policy)}"
        )
    return HookSidecar(
        image=image.strip(),
        image_pull_policy=str(policy),
        command=tuple(_strings(section.get("command", []), "hookSidecar.command")),
        args=tuple(_strings(section.get("args", list(DEFAULT_HOOK_ARGS)), "hookSidecar.args")),
        dra_claims=_bool(section.get("draClaims", False), "hookSidecar.draClaims"),
    )


def _mapping(data: object, where: str, allowed: set[str]) -> dict[str, object]:
    if not isinstance(data, dict):
        raise ConfigError(f"{where}: expected a mapping of keys to values, got {_shown(data)}")
    unknown = sorted(str(key) for key in data if key not in allowed)
    if unknown:
        prefix = "" if where == "the top level" else f"{where}."
        # Quoted when it could break the one-line message (a newline, a megabyte).
        name = unknown[0]
        shown = name if name.isprintable() and len(name) <= 60 else quote_untrusted(name, 60)
        raise ConfigError(
            f"unknown key {prefix}{shown}; expected one of: {', '.join(sorted(allowed))}"
        )
    return data


def _strings(data: object, where: str) -> list[str]:
    if not isinstance(data, list) or not all(isinstance(item, str) and item for item in data):
        raise ConfigError(f"{where}: expected a list of non-empty strings, got {_shown(data)}")
    return data


def _names(data: object, where: str) -> list[str]:
    names = _strings(data, where)
    for name in names:
        domain, slash, rest = name.partition("/")
        if not slash or not domain or not rest or "/" in rest:
            raise ConfigError(
                f"{where}: {name!r} is not an extended resource name; expected domain/name,"
                " e.g. nvidia.com/GH100_H100"
            )
        if name == IOMMUFD_RESOURCE:
            raise ConfigError(f"{where}: {IOMMUFD_RESOURCE} is what the webhook adds; remove it")
    return names


def _prefixes(data: object, where: str) -> list[str]:
    prefixes = _strings(data, where)
    for prefix in prefixes:
        if "/" not in prefix:
            raise ConfigError(
                f"{where}: {prefix!r} has no '/'; a prefix names a domain with its slash"
                " (nvidia.com/) and may go on into the name (nvidia.com/GH100)"
            )
    return prefixes


def _labels(data: object, where: str) -> dict[str, str]:
    if not isinstance(data, dict) or not all(
        isinstance(key, str) and key and isinstance(value, str) for key, value in data.items()
    ):
        raise ConfigError(
            f"{where}: expected a mapping of label keys to string values"
            f' (quote "true"/"false"), got {_shown(data)}'
        )
    return data


def _bool(data: object, where: str) -> bool:
    if not isinstance(data, bool):
        raise ConfigError(f"{where}: expected true or false, got {_shown(data)}")
    return data


def _shown(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
