"""What a container runtime makes of the CDI devices the kubelet names for a container: the
environment, device nodes and mounts it adds to the container's OCI spec. Pure: the CDI specs in
the runtime's directories, the ids and the pod's own mounts in, the container's edits out.

As tags.cncf.io/container-device-interface does (pkg/cdi/cache.go InjectDevices, container-
edits.go Apply, at github.com/cncf-tags/container-device-interface 05ae4b5): the devices' specs
are found by kind (`<vendor>/<class>`) and device name; a spec's own edits are applied before its
first device's, then each device's; a variable set again keeps the value set last; a device node
at a path already given replaces it; after the mounts are added, all of the spec's mounts (the
pod's volumes included: containerd applies CDI last, to a spec that holds them) are sorted,
stably, by the depth of their destination, so a file mounted inside a volume comes after it.
"""

from __future__ import annotations

import posixpath
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

Object = dict[str, Any]


class UnresolvedDevice(LookupError):
    """A CDI id no spec provides: the runtime fails the container."""


@dataclass(frozen=True, slots=True)
class Mount:
    container_path: str
    host_path: str
    options: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class ContainerEdits:
    env: dict[str, str]
    """In the order first set, each with the value set last."""
    device_nodes: tuple[str, ...]
    """Their paths in the container."""
    mounts: tuple[Mount, ...]
    """In the order the runtime mounts them."""


def apply_cdi_devices(
    specs: Iterable[Object], cdi_ids: Sequence[str], pod_mounts: Sequence[Mount] = ()
) -> ContainerEdits:
    """The edits `cdi_ids` (`<vendor>/<class>=<name>`) make to a container that has
    `pod_mounts` from its pod."""
    by_kind: dict[str, list[Object]] = {}
    for spec in specs:
        by_kind.setdefault(spec["kind"], []).append(spec)
    env: dict[str, str] = {}
    nodes: dict[str, None] = {}
    mounts = list(pod_mounts)
    applied: list[int] = []
    for cdi_id in cdi_ids:
        spec, device = _resolve(by_kind, cdi_id)
        edits = [device.get("containerEdits", {})]
        if id(spec) not in applied:
            applied.append(id(spec))
            edits.insert(0, spec.get("containerEdits", {}))
        for edit in edits:
            env |= dict(e.split("=", 1) for e in edit.get("env", []))
            nodes |= dict.fromkeys(n["path"] for n in edit.get("deviceNodes", []))
            mounts += [
                Mount(m["containerPath"], m["hostPath"], tuple(m.get("options", [])))
                for m in edit.get("mounts", [])
            ]
    return ContainerEdits(env, tuple(nodes), in_runtime_order(mounts))


def in_runtime_order(mounts: Iterable[Mount]) -> tuple[Mount, ...]:
    """A container's mounts as the runtime mounts them: stably by the depth of the destination."""
    return tuple(sorted(mounts, key=lambda m: posixpath.normpath(m.container_path).count("/")))


def _resolve(by_kind: dict[str, list[Object]], cdi_id: str) -> tuple[Object, Object]:
    kind, _, name = cdi_id.partition("=")
    for spec in by_kind.get(kind, []):
        for device in spec.get("devices", []):
            if device.get("name") == name:
                return spec, device
    raise UnresolvedDevice(f"unresolvable CDI device {cdi_id}")
