"""CDI specs checked as a container runtime loading them would: `validate_cdi_spec(spec)` raises
`CdiSpecError` naming the first problem found.

Two layers, as in the CDI library the runtimes use (tags.cncf.io/container-device-interface,
`pkg/cdi`, which containerd and CRI-O load specs with):
- a JSON Schema (draft 7) of the spec format, written here from the CDI specification (SPEC.md,
  v1.1.0) rather than copied from the project. It is stricter than the project's
  `schema/schema.json` in the ways the loader is: unknown fields are refused (the loader decodes
  with yaml.UnmarshalStrict), `env` entries must be `NAME=value`, ids are 32-bit unsigned;
- the checks the loader runs on a decoded spec: a known `cdiVersion` that is new enough for the
  fields used, a `vendor/class` kind, device names, unique devices with edits, device node types
  and permissions, hook names.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import jsonschema

# The released spec versions (specs-go/version.go), oldest first.
CDI_VERSIONS = (
    "0.1.0",
    "0.2.0",
    "0.3.0",
    "0.4.0",
    "0.5.0",
    "0.6.0",
    "0.7.0",
    "0.8.0",
    "1.0.0",
    "1.1.0",
)
_HOOK_NAMES = {
    "prestart",
    "createRuntime",
    "createContainer",
    "startContainer",
    "poststart",
    "poststop",
}
_DEVICE_NODE_TYPES = {"", "b", "c", "u", "p"}

_UINT32 = {"type": "integer", "minimum": 0, "maximum": 2**32 - 1}
_INT64 = {"type": "integer", "minimum": -(2**63), "maximum": 2**63 - 1}
_STRINGS = {"type": "array", "items": {"type": "string"}}
_ENV = {"type": "array", "items": {"type": "string", "pattern": "^[^=]+="}}
_ANNOTATIONS = {"type": "object", "additionalProperties": {"type": "string"}}


def _object(required: list[str], **properties: Any) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": properties,
        "required": required,
        "additionalProperties": False,
    }


_CONTAINER_EDITS = _object(
    [],
    env=_ENV,
    deviceNodes={
        "type": "array",
        "items": _object(
            ["path"],
            path={"type": "string"},
            hostPath={"type": "string"},
            type={"type": "string"},
            major=_INT64,
            minor=_INT64,
            fileMode=_UINT32,
            permissions={"type": "string"},
            uid=_UINT32,
            gid=_UINT32,
        ),
    },
    mounts={
        "type": "array",
        "items": _object(
            ["hostPath", "containerPath"],
            hostPath={"type": "string"},
            containerPath={"type": "string"},
            options=_STRINGS,
            type={"type": "string"},
        ),
    },
    hooks={
        "type": "array",
        "items": _object(
            ["hookName", "path"],
            hookName={"type": "string"},
            path={"type": "string"},
            args=_STRINGS,
            env=_ENV,
            timeout={"type": "integer", "minimum": 1},
        ),
    },
    intelRdt=_object(
        [],
        closID={"type": "string"},
        l3CacheSchema={"type": "string"},
        memBwSchema={"type": "string"},
        schemata=_STRINGS,
        enableMonitoring={"type": "boolean"},
    ),
    additionalGids={"type": "array", "items": _UINT32},
    netDevices={
        "type": "array",
        "items": _object(
            ["hostInterfaceName", "name"],
            hostInterfaceName={"type": "string"},
            name={"type": "string"},
        ),
    },
)

CDI_SPEC_SCHEMA: dict[str, Any] = {
    "$schema": "http://json-schema.org/draft-07/schema#",
    **_object(
        ["cdiVersion", "kind", "devices"],
        cdiVersion={"type": "string"},
        kind={"type": "string"},
        annotations=_ANNOTATIONS,
        devices={
            "type": "array",
            "minItems": 1,
            "items": _object(
                ["name", "containerEdits"],
                name={"type": "string"},
                annotations=_ANNOTATIONS,
                containerEdits=_CONTAINER_EDITS,
            ),
        },
        containerEdits=_CONTAINER_EDITS,
    ),
}
jsonschema.Draft7Validator.check_schema(CDI_SPEC_SCHEMA)
_VALIDATOR = jsonschema.Draft7Validator(CDI_SPEC_SCHEMA)

_VENDOR_OR_CLASS = re.compile(r"^[A-Za-z]([A-Za-z0-9_.-]*[A-Za-z0-9])?$")
_DEVICE_NAME = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9_.:-]*[A-Za-z0-9])?$")


class CdiSpecError(ValueError):
    """A CDI spec a container runtime would refuse to load."""


def validate_cdi_spec(spec: dict[str, Any]) -> None:
    """Raise CdiSpecError unless `spec` is a CDI spec the runtimes load."""
    where = f"CDI spec of kind {spec.get('kind')!r}" if isinstance(spec, dict) else "CDI spec"
    error = jsonschema.exceptions.best_match(_VALIDATOR.iter_errors(spec))
    if error is not None:
        raise CdiSpecError(f"{where}: {_json_path(error.absolute_path)}: {error.message}")
    problem = next(_loader_problems(spec), None)
    if problem is not None:
        raise CdiSpecError(f"{where}: {problem}")


def minimum_cdi_version(spec: dict[str, Any]) -> str:
    """The oldest spec version that has every field `spec` uses (specs-go/version.go)."""
    edits = list(_all_edits(spec))
    devices = spec["devices"]
    if any(e.get("netDevices") for e in edits) or any(
        "schemata" in e.get("intelRdt", {}) or e.get("intelRdt", {}).get("enableMonitoring")
        for e in edits
    ):
        return "1.1.0"
    if any("intelRdt" in e or e.get("additionalGids") for e in edits):
        return "0.7.0"
    _, _, cdi_class = spec["kind"].partition("/")
    if spec.get("annotations") or any(d.get("annotations") for d in devices) or "." in cdi_class:
        return "0.6.0"
    if any(d["name"][:1].isdigit() for d in devices) or any(
        n.get("hostPath") for e in edits for n in e.get("deviceNodes", [])
    ):
        return "0.5.0"
    if any(m.get("type") for e in edits for m in e.get("mounts", [])):
        return "0.4.0"
    return "0.3.0"


def _loader_problems(spec: dict[str, Any]) -> Iterator[str]:
    version = spec["cdiVersion"]
    if version not in CDI_VERSIONS:
        yield f"cdiVersion {version!r} is not a released CDI version ({', '.join(CDI_VERSIONS)})"
        return
    needed = minimum_cdi_version(spec)
    if CDI_VERSIONS.index(needed) > CDI_VERSIONS.index(version):
        yield f"the fields used need cdiVersion {needed} or later, not {version}"
    vendor, _, cdi_class = spec["kind"].partition("/")
    for part, value in (("vendor", vendor), ("class", cdi_class)):
        if not _VENDOR_OR_CLASS.match(value):
            yield (
                f"kind {spec['kind']!r} needs the form vendor/class, with a {part} that starts"
                " with a letter, ends with a letter or digit and has only letters, digits, '_',"
                " '-' and '.'"
            )
    for problem in _edits_problems(spec.get("containerEdits", {})):
        yield f"containerEdits: {problem}"
    seen: set[str] = set()
    for device in spec["devices"]:
        name = device["name"]
        if not _DEVICE_NAME.match(name):
            yield (
                f"device name {name!r} must start and end with a letter or digit and have only"
                " letters, digits, '_', '-', '.' and ':'"
            )
        if name in seen:
            yield f"device {name!r} is defined twice"
        seen.add(name)
        if not any(device["containerEdits"].values()):
            yield f"device {name!r} has no container edits"
        for problem in _edits_problems(device["containerEdits"]):
            yield f"device {name!r}: {problem}"


def _edits_problems(edits: dict[str, Any]) -> Iterator[str]:
    for node in edits.get("deviceNodes", []):
        if not node["path"]:
            yield "a device node has an empty path"
        if node.get("type", "") not in _DEVICE_NODE_TYPES:
            yield f"device node {node['path']!r} has type {node['type']!r}: use b, c, u or p"
        permissions = node.get("permissions", "")
        if permissions not in ("", "none") and permissions.strip("rwm"):
            yield f"device node {node['path']!r} has permissions {permissions!r}: use r, w, m"
    for mount in edits.get("mounts", []):
        if not mount["hostPath"] or not mount["containerPath"]:
            yield "a mount has an empty hostPath or containerPath"
    for hook in edits.get("hooks", []):
        if hook["hookName"] not in _HOOK_NAMES:
            yield f"hook name {hook['hookName']!r} is not one of {sorted(_HOOK_NAMES)}"
        if not hook["path"]:
            yield f"hook {hook['hookName']!r} has an empty path"


def _all_edits(spec: dict[str, Any]) -> Iterator[dict[str, Any]]:
    yield spec.get("containerEdits", {})
    for device in spec["devices"]:
        yield device["containerEdits"]


def _json_path(parts: Any) -> str:
    path = ""
    for part in parts:
        path += f"[{part}]" if isinstance(part, int) else (f".{part}" if path else part)
    return path or "<the spec>"
