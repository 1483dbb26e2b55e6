"""The node labels that say what a node offers for iommufd, as a pure function of what the device
plugin or the DRA driver found; the feature file and the Node patcher publish them.

Every key is under `kubevirt-iommufd.io/`:
- `iommufd`: `true` when `/dev/iommu` exists and at least one managed device can be handed out
  over iommufd (its VFIO cdev is there), else `false`;
- `vfio-cdev`: `true`/`false`, whether the kernel gives VFIO devices cdevs; absent while no
  device on a VFIO driver shows either way;
- `kernel`: the kernel's `major.minor` (`6.12`); absent when the release cannot be read;
- one count per managed resource: how many of its devices can be handed out over iommufd (a
  device a DRA claim binds on demand counts by what it offers once bound).

A resource name (`nvidia.com/GH100H100_SXM5_80GB`) is not a label name: its `/` is not allowed
and it may be longer than 63 characters. Its count's name is `iommufd-devices.` + the resource
name with its `/` made `_` (`iommufd-devices.nvidia.com_GH100H100_SXM5_80GB`): a resource
domain never holds `_`, so the first `_` marks where the `/` was and the name maps back to one
resource. A resource that does not fit (or holds characters a label name cannot) gets
`iommufd-devices-<10 hex digits of its SHA-256>.<as much of the name as fits>`; its `-` after
`devices` keeps it apart from every plain name.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping

from hostdev.assess import Backend, assess_function, iommufd_once_bound, on_demand_gaps
from hostdev.config import Binding, DeviceMode, PluginConfig
from hostdev.model import HostCapabilities, HostInventory, PciFunction, is_vfio_driver
from hostdev.pciids import PciIds
from hostdev.selection import resource_for

LABEL_PREFIX = "kubevirt-iommufd.io/"
IOMMUFD_LABEL = LABEL_PREFIX + "iommufd"
VFIO_CDEV_LABEL = LABEL_PREFIX + "vfio-cdev"
KERNEL_LABEL = LABEL_PREFIX + "kernel"
_COUNT_STEM = "iommufd-devices"
COUNT_NAME = _COUNT_STEM + "."
_HASHED_COUNT_NAME = _COUNT_STEM + "-"
_FIXED_LABELS = frozenset({IOMMUFD_LABEL, VFIO_CDEV_LABEL, KERNEL_LABEL})
_MAX_NAME = 63
_LABEL_NAME = re.compile(r"[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?")
_NOT_NAME = re.compile(r"[^-A-Za-z0-9_.]")
_KERNEL = re.compile(r"(\d{1,4})\.(\d{1,4})")


def build_node_labels(
    capabilities: HostCapabilities, iommufd_devices: Mapping[str, int]
) -> dict[str, str]:
    """The labels for a node whose managed resources have `iommufd_devices[resource]` devices
    that can be handed out over iommufd (every managed resource listed, 0 included)."""
    usable = capabilities.iommufd_node_present and any(n > 0 for n in iommufd_devices.values())
    labels = {IOMMUFD_LABEL: _bool(usable)}
    if capabilities.vfio_cdev is not None:
        labels[VFIO_CDEV_LABEL] = _bool(capabilities.vfio_cdev)
    kernel = kernel_version(capabilities.kernel_release)
    if kernel is not None:
        labels[KERNEL_LABEL] = kernel
    for resource, count in sorted(iommufd_devices.items()):
        labels[resource_count_label(resource)] = str(count)
    return labels


def count_iommufd_devices(
    inventory: HostInventory, config: PluginConfig, names: PciIds
) -> dict[str, int]:
    """Per resource the configuration selects functions for, how many of them a VM could be
    given over iommufd: what `inspect` shows before any component runs. A function on its host
    driver for an on-demand resource counts by what it will offer once a claim binds it."""
    counts: dict[str, int] = {}
    for function in inventory.functions:
        chosen = resource_for(function, config.resources, names)
        if chosen is None:
            continue
        usable = config.device_mode is not DeviceMode.LEGACY and (
            _iommufd_once_bound(function, inventory)
            if chosen[1].binding is Binding.ON_DEMAND and not is_vfio_driver(function.driver)
            else assess_function(function, inventory).backend is Backend.IOMMUFD
        )
        counts[chosen[0]] = counts.get(chosen[0], 0) + int(usable)
    return counts


def _iommufd_once_bound(function: PciFunction, inventory: HostInventory) -> bool:
    group = inventory.group_of(function)
    caps = inventory.capabilities
    return not on_demand_gaps(function, group, caps) and iommufd_once_bound(caps)


def resource_count_label(resource: str) -> str:
    """The key of a resource's count label (see the module's docstring for the mapping)."""
    domain, slash, rest = resource.partition("/")
    plain = COUNT_NAME + domain + "_" + rest
    if slash and "_" not in domain and len(plain) <= _MAX_NAME and _LABEL_NAME.fullmatch(plain):
        return LABEL_PREFIX + plain
    digest = hashlib.sha256(resource.encode()).hexdigest()[:10]
    head = f"{_HASHED_COUNT_NAME}{digest}."
    tail = _NOT_NAME.sub("-", resource.replace("/", "_"))[: _MAX_NAME - len(head)]
    return LABEL_PREFIX + (head + tail).rstrip("-_.")


def kernel_version(release: str | None) -> str | None:
    """`6.12.0-kubevirt-iommufd` → `6.12`; None for a release that does not start so."""
    match = _KERNEL.match(release or "")
    return None if match is None else f"{int(match[1])}.{int(match[2])}"


def is_ours(key: str) -> bool:
    """A label these functions publish, and so may remove. Other keys under the prefix are the
    operator's: `kubevirt-iommufd.io/passthrough` picks the nodes the plugin DaemonSet runs on."""
    return key in _FIXED_LABELS or key.startswith(LABEL_PREFIX + _COUNT_STEM)


class NodeShapeError(ValueError):
    """The API's answer to a Node read is not a Node whose labels can be read."""


def build_node_label_patch(node: object, wanted: Mapping[str, str]) -> dict[str, str | None]:
    """`build_label_patch` from the Node as the API answered it, whatever JSON that is: a Node
    whose `metadata.labels` is absent or null has none; any other shape (not an object, no
    `metadata` object, labels not an object) is a NodeShapeError, as nothing of ours can be
    known to be there or not."""
    if not isinstance(node, dict):
        raise NodeShapeError(f"the answer is {_json_type(node)}, not a Node")
    metadata = node.get("metadata")
    if not isinstance(metadata, dict):
        raise NodeShapeError(f"the Node's metadata is {_json_type(metadata)}, not an object")
    labels = metadata.get("labels")
    if labels is None:
        return build_label_patch({}, wanted)
    if not isinstance(labels, dict):
        raise NodeShapeError(f"the Node's metadata.labels is {_json_type(labels)}, not an object")
    return build_label_patch(labels, wanted)


def build_label_patch(
    current: Mapping[str, object], wanted: Mapping[str, str]
) -> dict[str, str | None]:
    """The `metadata.labels` of a JSON merge patch taking a Node from `current` to `wanted`
    labels of ours: changed and new ones set, ours (`is_ours`) no longer wanted removed (null),
    every other label left out, so it is never touched. Empty when nothing is to change."""
    patch: dict[str, str | None] = {
        key: value for key, value in wanted.items() if current.get(key) != value
    }
    patch |= {key: None for key in current if is_ours(key) and key not in wanted}
    return patch


def _json_type(value: object) -> str:
    if value is None:
        return "null or missing"
    names = {dict: "an object", list: "an array", str: "a string", bool: "a boolean"}
    return names.get(type(value), "a number")


def _bool(value: bool) -> str:
    return "true" if value else "false"
