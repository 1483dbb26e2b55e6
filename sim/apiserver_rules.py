"""What the Kubernetes API server decides about a request, as pure functions: the served kinds,
`Status` bodies, field and label selectors, and the ResourceSlice rules that the OpenAPI schema
does not carry (kubernetes pkg/apis/resource/validation: at most 128 devices, device names that
are DNS labels, exactly one node selection, attribute limits, device taints), and the defaults it
sets on what it decodes (a device taint's `timeAdded`). Messages are the real server's, so a
driver's error handling meets the text it will meet in a cluster.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

Object = dict[str, Any]

DEVICES_PER_SLICE = 128
DEVICES_PER_SLICE_WITH_ADVANCED_FEATURES = 64
ATTRIBUTES_AND_CAPACITIES_PER_DEVICE = 32
ATTRIBUTE_VALUE_MAX_LENGTH = 64
ATTRIBUTE_ID_MAX_LENGTH = 32
TAINTS_PER_DEVICE = 16
TAINT_EFFECTS = ("NoExecute", "NoSchedule", "None")
DRIVER_NAME_MAX_LENGTH = 63
POOL_NAME_MAX_LENGTH = 253

_LABEL = r"[a-z0-9]([-a-z0-9]*[a-z0-9])?"
_DNS_LABEL = re.compile(f"^{_LABEL}$")
_DNS_SUBDOMAIN = re.compile(rf"^{_LABEL}(\.{_LABEL})*$")
_C_IDENTIFIER = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_LABEL_NAME = re.compile(r"^([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]$")
_SEMVER = re.compile(
    r"^(0|[1-9]\d*)\.(0|[1-9]\d*)\.(0|[1-9]\d*)"
    r"(-(0|[1-9]\d*|\d*[a-zA-Z-][0-9a-zA-Z-]*)(\.(0|[1-9]\d*|\d*[a-zA-Z-][0-9a-zA-Z-]*))*)?"
    r"(\+[0-9a-zA-Z-]+(\.[0-9a-zA-Z-]+)*)?$"
)
_LABEL_MESSAGE = (
    "a lowercase RFC 1123 label must consist of lower case alphanumeric characters or '-', and"
    " must start and end with an alphanumeric character (e.g. 'my-name',  or '123-abc', regex"
    " used for validation is '[a-z0-9]([-a-z0-9]*[a-z0-9])?')"
)
_SUBDOMAIN_MESSAGE = (
    "a lowercase RFC 1123 subdomain must consist of lower case alphanumeric characters, '-' or"
    " '.', and must start and end with an alphanumeric character (e.g. 'example.com', regex used"
    " for validation is '[a-z0-9]([-a-z0-9]*[a-z0-9])?(\\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*')"
)
_C_IDENTIFIER_MESSAGE = (
    "a valid C identifier must start with alphabetic character or '_', followed by a string of"
    " alphanumeric characters or '_' (e.g. 'my_name',  or 'MY_NAME',  or 'MyName', regex used"
    " for validation is '[A-Za-z_][A-Za-z0-9_]*')"
)
_NAME_PART_MESSAGE = (
    "name part must consist of alphanumeric characters, '-', '_' or '.', and must start and end"
    " with an alphanumeric character (e.g. 'MyName',  or 'my.name',  or '123-abc', regex used for"
    " validation is '([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]')"
)
_LABEL_VALUE_MESSAGE = (
    "a valid label must be an empty string or consist of alphanumeric characters, '-', '_' or"
    " '.', and must start and end with an alphanumeric character (e.g. 'MyValue',  or"
    " 'my_value',  or '12345', regex used for validation is"
    " '(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?')"
)
_NODE_SELECTION = ("nodeName", "nodeSelector", "allNodes", "perDeviceNodeSelection")
_LIST_VALUE_KEYS = {"bools", "ints", "strings", "versions"}
_ATTRIBUTE_VALUE_KEYS = ("bool", "int", "string", "version", "bools", "ints", "strings", "versions")


@dataclass(frozen=True, slots=True)
class Kind:
    """A served resource: where it lives and which fields a field selector may name."""

    resource: str
    group: str
    version: str
    kind: str
    namespaced: bool
    selectable: Callable[[Object], dict[str, str]]

    @property
    def api_version(self) -> str:
        return f"{self.group}/{self.version}" if self.group else self.version

    @property
    def qualified_resource(self) -> str:
        return f"{self.resource}.{self.group}" if self.group else self.resource

    @property
    def qualified_kind(self) -> str:
        return f"{self.kind}.{self.group}" if self.group else self.kind


def _meta_fields(obj: Object, namespaced: bool) -> dict[str, str]:
    meta = obj.get("metadata", {})
    fields = {"metadata.name": meta.get("name", "")}
    if namespaced:
        fields["metadata.namespace"] = meta.get("namespace", "")
    return fields


def _slice_fields(obj: Object) -> dict[str, str]:
    spec = obj.get("spec", {})
    return {
        **_meta_fields(obj, namespaced=False),
        "spec.nodeName": spec.get("nodeName") or "",
        "spec.driver": spec.get("driver", ""),
    }


def _node_fields(obj: Object) -> dict[str, str]:
    unschedulable = obj.get("spec", {}).get("unschedulable", False)
    return {**_meta_fields(obj, namespaced=False), "spec.unschedulable": str(unschedulable).lower()}


NODES = Kind("nodes", "", "v1", "Node", False, _node_fields)
RESOURCE_CLAIMS = Kind(
    "resourceclaims", "resource.k8s.io", "v1", "ResourceClaim", True,
    lambda obj: _meta_fields(obj, namespaced=True),
)  # fmt: skip
RESOURCE_SLICES = Kind(
    "resourceslices", "resource.k8s.io", "v1", "ResourceSlice", False, _slice_fields
)
KINDS = (NODES, RESOURCE_CLAIMS, RESOURCE_SLICES)


# Status ------------------------------------------------------------------------------------------
_REASONS = {
    400: "BadRequest",
    401: "Unauthorized",
    404: "NotFound",
    405: "MethodNotAllowed",
    409: "Conflict",
    410: "Expired",
    422: "Invalid",
    429: "TooManyRequests",
    500: "InternalError",
    503: "ServiceUnavailable",
    504: "Timeout",
}


def build_status(
    code: int, message: str, reason: str | None = None, details: Object | None = None
) -> Object:
    """A failure `Status` as the API server writes it (kind, apiVersion v1, reason, code)."""
    status: Object = {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": message,
        "reason": reason or _REASONS.get(code, "Unknown"),
        "code": code,
    }
    if details is not None:
        status["details"] = details
    return status


def _details(kind: Kind, name: str) -> Object:
    details: Object = {"name": name, "kind": kind.resource}
    if kind.group:
        details["group"] = kind.group
    return details


def status_not_found(kind: Kind, name: str) -> Object:
    return build_status(
        404, f'{kind.qualified_resource} "{name}" not found', details=_details(kind, name)
    )


def status_already_exists(kind: Kind, name: str) -> Object:
    return build_status(
        409,
        f'{kind.qualified_resource} "{name}" already exists',
        "AlreadyExists",
        _details(kind, name),
    )


def status_conflict(kind: Kind, name: str, why: str) -> Object:
    return build_status(
        409,
        f'Operation cannot be fulfilled on {kind.qualified_resource} "{name}": {why}',
        details=_details(kind, name),
    )


STALE = (
    "the object has been modified; please apply your changes to the latest version and try again"
)


def status_invalid(kind: Kind, name: str, errors: list[FieldError]) -> Object:
    rendered = [e.render() for e in errors]
    what = rendered[0] if len(rendered) == 1 else f"[{', '.join(rendered)}]"
    details: Object = {
        "name": name,
        "kind": kind.kind,
        "causes": [{"reason": e.type, "message": e.body(), "field": e.field} for e in errors],
    }
    if kind.group:
        details["group"] = kind.group
    return build_status(422, f'{kind.qualified_kind} "{name}" is invalid: {what}', details=details)


def status_expired(requested: int, oldest: int) -> Object:
    return build_status(410, f"too old resource version: {requested} ({oldest})", "Expired")


# Field errors ------------------------------------------------------------------------------------
_TYPE_TEXT = {
    "FieldValueRequired": "Required value",
    "FieldValueInvalid": "Invalid value",
    "FieldValueDuplicate": "Duplicate value",
    "FieldValueTooLong": "Too long",
    "FieldValueTooMany": "Too many",
    "FieldValueForbidden": "Forbidden",
    "FieldValueTypeInvalid": "Invalid value",
    "FieldValueNotSupported": "Unsupported value",
}
_NO_VALUE_SHOWN = {"FieldValueRequired", "FieldValueTooLong", "FieldValueForbidden"}


@dataclass(frozen=True, slots=True)
class FieldError:
    """One entry of the server's field.ErrorList; `type` is the cause reason it reports."""

    field: str
    type: str
    value: object = None
    detail: str = ""

    def body(self) -> str:
        text = _TYPE_TEXT[self.type]
        if self.type not in _NO_VALUE_SHOWN:
            text += f": {_go_value(self.value)}"
        return f"{text}: {self.detail}" if self.detail else text

    def render(self) -> str:
        return f"{self.field}: {self.body()}"


def _go_value(value: object) -> str:
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, int | float):
        return str(value)
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    return "null" if value is None else repr(value)


def required(field: str, detail: str = "") -> FieldError:
    return FieldError(field, "FieldValueRequired", None, detail)


def invalid(field: str, value: object, detail: str) -> FieldError:
    return FieldError(field, "FieldValueInvalid", value, detail)


def too_long(field: str, limit: int) -> FieldError:
    return FieldError(field, "FieldValueTooLong", None, f"may not be more than {limit} bytes")


def _dns_label(value: str, field: str) -> list[FieldError]:
    errors = []
    if len(value) > 63:
        errors.append(invalid(field, value, "must be no more than 63 characters"))
    if not _DNS_LABEL.match(value):
        errors.append(invalid(field, value, _LABEL_MESSAGE))
    return errors


def _dns_subdomain(value: str, field: str) -> list[FieldError]:
    errors = []
    if len(value) > 253:
        errors.append(invalid(field, value, "must be no more than 253 characters"))
    if not _DNS_SUBDOMAIN.match(value):
        errors.append(invalid(field, value, _SUBDOMAIN_MESSAGE))
    return errors


def _driver_name(value: str, field: str) -> list[FieldError]:
    errors = [required(field)] if not value else []
    if len(value) > DRIVER_NAME_MAX_LENGTH:
        errors.append(FieldError(field, "FieldValueTooLong", None, "may not be more than 63 bytes"))
    # As the real server (ValidateCSIDriverName): upper case passes, the value shown is as sent.
    return errors + [replace(e, value=value) for e in _dns_subdomain(value.lower(), field)]


# Object metadata ---------------------------------------------------------------------------------
def validate_metadata(obj: Object) -> list[FieldError]:
    """The name rules every kind here shares: a name (or generateName) that is a DNS subdomain."""
    meta = obj.get("metadata") or {}
    name = meta.get("name") or ""
    if not name:
        if meta.get("generateName"):
            return []
        return [required("metadata.name", "name or generateName is required")]
    return _dns_subdomain(name, "metadata.name")


# ResourceSlice -----------------------------------------------------------------------------------
def validate_resource_slice(obj: Object, old: Object | None) -> list[FieldError]:
    """ValidateResourceSlice / ValidateResourceSliceUpdate for the fields a driver sets."""
    spec = obj.get("spec") or {}
    errors: list[FieldError] = []
    errors += _driver_name(spec.get("driver") or "", "spec.driver")
    pool = spec.get("pool") or {}
    errors += _pool(pool)
    if old is not None:
        old_spec = old.get("spec") or {}
        for path in (("pool", "name"), ("driver",), ("nodeName",)):
            if _dig(spec, path) != _dig(old_spec, path):
                field = "spec." + ".".join(path)
                errors.append(invalid(field, _dig(spec, path), "field is immutable"))
    errors += _node_selection(spec)
    if spec.get("sharedCounters") is not None and spec.get("devices") is not None:
        errors.append(invalid("spec", "", "only one of `sharedCounters` or `devices` is allowed"))
    errors += _devices(spec.get("devices") or [], bool(spec.get("perDeviceNodeSelection")))
    return errors


def _dig(mapping: Mapping[str, Any], path: tuple[str, ...]) -> Any:
    value: Any = mapping
    for key in path:
        value = value.get(key) if isinstance(value, Mapping) else None
    return value


def _pool(pool: Object) -> list[FieldError]:
    errors: list[FieldError] = []
    name = pool.get("name") or ""
    if not name:
        errors.append(required("spec.pool.name"))
    else:
        if len(name) > POOL_NAME_MAX_LENGTH:
            errors.append(too_long("spec.pool.name", POOL_NAME_MAX_LENGTH))
        for part in name.split("/"):
            errors += _dns_subdomain(part, "spec.pool.name")
    count = pool.get("resourceSliceCount") or 0
    if count <= 0:
        errors.append(invalid("spec.pool.resourceSliceCount", count, "must be greater than zero"))
    generation = pool.get("generation") or 0
    if generation < 0:
        errors.append(
            invalid("spec.pool.generation", generation, "must be greater than or equal to zero")
        )
    return errors


def _node_selection(spec: Object) -> list[FieldError]:
    errors: list[FieldError] = []
    chosen = []
    node_name = spec.get("nodeName")
    if node_name is not None:
        if node_name:
            chosen.append("`nodeName`")
            errors += _dns_subdomain(node_name, "spec.nodeName")
        else:
            errors.append(
                invalid("spec.nodeName", "", "must be either unset or set to a non-empty string")
            )
    selector = spec.get("nodeSelector")
    if selector is not None:
        chosen.append("`nodeSelector`")
        terms = selector.get("nodeSelectorTerms") or []
        if len(terms) != 1:
            errors.append(
                invalid(
                    "spec.nodeSelector.nodeSelectorTerms",
                    terms,
                    "must have exactly one node selector term",
                )
            )
    for flag in ("allNodes", "perDeviceNodeSelection"):
        if spec.get(flag) is not None:
            if spec[flag]:
                chosen.append(f"`{flag}`")
            else:
                errors.append(invalid(f"spec.{flag}", False, "must be either unset or set to true"))
    one_of = "exactly one of " + ", ".join(f"`{f}`" for f in _NODE_SELECTION) + " is required"
    if not chosen:
        errors.append(required("spec", one_of))
    elif len(chosen) > 1:
        errors.append(
            invalid("spec", "{" + ", ".join(chosen) + "}", one_of + ", but multiple fields are set")
        )
    return errors


def _devices(devices: list[Object], per_device_node_selection: bool) -> list[FieldError]:
    advanced = any(
        d.get("taints")
        or d.get("consumesCounters")
        or any(not _LIST_VALUE_KEYS.isdisjoint(a) for a in d.get("attributes", {}).values())
        for d in devices
    )
    limit = DEVICES_PER_SLICE_WITH_ADVANCED_FEATURES if advanced else DEVICES_PER_SLICE
    if len(devices) > limit:
        # The real server stops here too: the list is not walked when it is too long.
        detail = f"must have at most {limit} items"
        return [FieldError("spec.devices", "FieldValueTooMany", len(devices), detail)]
    errors: list[FieldError] = []
    seen: set[str] = set()
    for index, device in enumerate(devices):
        path = f"spec.devices[{index}]"
        name = device.get("name") or ""
        errors += [required(f"{path}.name")] if not name else _dns_label(name, f"{path}.name")
        errors += _device_body(device, path, per_device_node_selection)
        if name in seen:
            errors.append(FieldError(path, "FieldValueDuplicate", name))
        seen.add(name)
    return errors


def _device_body(device: Object, path: str, per_device_node_selection: bool) -> list[FieldError]:
    errors: list[FieldError] = []
    attributes: dict[str, Object] = device.get("attributes") or {}
    capacity: dict[str, Object] = device.get("capacity") or {}
    total = len(attributes) + len(capacity)
    if total > ATTRIBUTES_AND_CAPACITIES_PER_DEVICE:
        errors.append(
            invalid(
                path,
                total,
                "the total number of attributes and capacities must not exceed"
                f" {ATTRIBUTES_AND_CAPACITIES_PER_DEVICE}",
            )
        )
    for key, attribute in attributes.items():
        # The paths are built for a finding only: a slice has thousands of attributes.
        if not _valid_qualified_name(key):
            errors += _qualified_name(key, f"{path}.attributes")
        if not _plain_attribute(attribute):
            errors += _attribute(attribute, f"{path}.attributes[{key}]")
    for key in capacity:
        errors += _qualified_name(key, f"{path}.capacity")
    errors += _taints(device.get("taints") or [], f"{path}.taints")
    own_selection = [
        f for f in ("nodeName", "nodeSelector", "allNodes") if device.get(f) is not None
    ]
    if own_selection and not per_device_node_selection:
        errors.append(
            invalid(
                path,
                None,
                "`nodeName`, `nodeSelector` and `allNodes` can only be set if"
                " `perDeviceNodeSelection` is set to true in the ResourceSlice spec",
            )
        )
    return errors


@functools.lru_cache(maxsize=1024)
def _valid_qualified_name(name: str) -> bool:
    """Whether `_qualified_name` finds nothing wrong: a driver sends the same few names for
    every device."""
    return not _qualified_name(name, "")


def _qualified_name(name: str, field: str) -> list[FieldError]:
    parts = name.split("/")
    if len(parts) > 2:
        return [invalid(field, name, "must not contain more than one slash")]
    errors: list[FieldError] = []
    if len(parts) == 2:
        domain, parts = parts[0], parts[1:]
        if not domain:
            errors.append(invalid(field, "", "the domain must not be empty"))
        else:
            errors += _driver_name(domain, field)
        if not parts[0]:
            return [*errors, invalid(field, "", "the name must not be empty")]
    identifier = parts[0]
    if len(identifier) > ATTRIBUTE_ID_MAX_LENGTH:
        errors.append(too_long(field, ATTRIBUTE_ID_MAX_LENGTH))
    if not _C_IDENTIFIER.match(identifier):
        errors.append(invalid(field, identifier, _C_IDENTIFIER_MESSAGE))
    return errors


def _taints(taints: list[Object], path: str) -> list[FieldError]:
    """validateDeviceTaint: a label-name key, a label value, a known effect; at most 16."""
    if len(taints) > TAINTS_PER_DEVICE:
        detail = f"must have at most {TAINTS_PER_DEVICE} items"
        return [FieldError(path, "FieldValueTooMany", len(taints), detail)]
    errors: list[FieldError] = []
    for index, taint in enumerate(taints):
        at = f"{path}[{index}]"
        key = taint.get("key") or ""
        errors += [required(f"{at}.key")] if not key else _label_name(key, f"{at}.key")
        value = taint.get("value") or ""
        if len(value) > 63:
            errors.append(invalid(f"{at}.value", value, "must be no more than 63 characters"))
        if value and not _LABEL_NAME.match(value):
            errors.append(invalid(f"{at}.value", value, _LABEL_VALUE_MESSAGE))
        effect = taint.get("effect") or ""
        if not effect:
            errors.append(required(f"{at}.effect"))
        elif effect not in TAINT_EFFECTS:
            supported = "supported values: " + ", ".join(f'"{e}"' for e in TAINT_EFFECTS)
            errors.append(FieldError(f"{at}.effect", "FieldValueNotSupported", effect, supported))
    return errors


def _label_name(name: str, field: str) -> list[FieldError]:
    """IsQualifiedName: `[prefix/]name`, the prefix a DNS subdomain, the name at most 63."""
    prefix, _, part = name.rpartition("/")
    errors: list[FieldError] = []
    if "/" in prefix:
        return [invalid(field, name, "a qualified name " + _NAME_PART_MESSAGE)]
    if "/" in name:
        if not prefix:
            errors.append(invalid(field, name, "prefix part must be non-empty"))
        else:
            errors += [replace(e, value=name) for e in _dns_subdomain(prefix, field)]
    if not part:
        errors.append(invalid(field, name, "name part must be non-empty"))
    elif len(part) > 63:
        errors.append(invalid(field, name, "name part must be no more than 63 characters"))
    elif not _LABEL_NAME.match(part):
        errors.append(invalid(field, name, _NAME_PART_MESSAGE))
    return errors


def build_allocatable(slices: list[Object], tolerations: Sequence[Object]) -> list[str]:
    """The scheduler's view of one pool: the devices of its newest generation (none while that
    generation is incomplete: the scheduler waits for it) whose taints are all tolerated or
    have no effect on scheduling (`None`, and any effect it does not know)."""
    if not slices:
        return []
    generation = max(_pool_of(s).get("generation", 0) for s in slices)
    newest = [s for s in slices if _pool_of(s).get("generation", 0) == generation]
    if len(newest) != _pool_of(newest[0]).get("resourceSliceCount"):
        return []
    return [
        d["name"]
        for item in newest
        for d in _devices_of(item)
        if all(
            t.get("effect") not in ("NoSchedule", "NoExecute")
            or any(_tolerates(toleration, t) for toleration in tolerations)
            for t in d.get("taints") or []
        )
    ]


def _pool_of(item: Object) -> Object:
    pool: Object = (item.get("spec") or {}).get("pool") or {}
    return pool


def _tolerates(toleration: Object, taint: Object) -> bool:
    """DeviceToleration.ToleratesTaint: an empty key (with Exists) or effect matches any."""
    if toleration.get("effect") and toleration["effect"] != taint.get("effect"):
        return False
    if toleration.get("key") and toleration["key"] != taint.get("key"):
        return False
    operator = toleration.get("operator") or "Equal"
    if operator == "Exists":
        return True
    return operator == "Equal" and (toleration.get("value") or "") == (taint.get("value") or "")


def default_resource_slice(obj: Object, now: str) -> None:
    """SetDefaults_DeviceTaint: a taint sent without `timeAdded` gets the current time, to the
    second. The real server does this as it decodes a create or update, before it compares the
    spec with the stored one, so a taint sent without it is a change."""
    for device in _devices_of(obj):
        taints = device.get("taints")
        for taint in taints if isinstance(taints, list) else []:
            if isinstance(taint, dict) and not taint.get("timeAdded"):
                taint["timeAdded"] = now


def drop_disabled_slice_fields(obj: Object, old: Object | None) -> None:
    """dropDisabledDRADeviceTaintsFields on a server with the DRADeviceTaints gate off (before
    1.37 it may be): the taints of a write are dropped without a word, unless the stored slice
    already has some."""
    if old is not None and any(d.get("taints") for d in _devices_of(old)):
        return
    for device in _devices_of(obj):
        device.pop("taints", None)


def _devices_of(obj: Object) -> list[Object]:
    """A slice's devices that are objects: what a body of the wrong shape has is left to the
    checks, which answer for it."""
    spec = obj.get("spec")
    devices = spec.get("devices") if isinstance(spec, dict) else None
    return [d for d in devices if isinstance(d, dict)] if isinstance(devices, list) else []


def _plain_attribute(attribute: Object) -> bool:
    """Whether `_attribute` finds nothing wrong, seen at a glance for one bool, int or short
    string (what most attributes are); anything else is left to `_attribute`."""
    if type(attribute) is not dict or len(attribute) != 1:
        return False
    ((key, value),) = attribute.items()
    if key == "string":
        return type(value) is str and len(value.encode()) <= ATTRIBUTE_VALUE_MAX_LENGTH
    return key in ("bool", "int") and value is not None


def _attribute(attribute: Object, path: str) -> list[FieldError]:
    errors: list[FieldError] = []
    values = [k for k in _ATTRIBUTE_VALUE_KEYS if attribute.get(k) is not None]
    if len(values) != 1:
        shown = "" if not values else attribute
        errors.append(invalid(path, shown, "exactly one value must be specified"))
    for key in ("string", "version"):
        value = attribute.get(key)
        if value is None:
            continue
        if key == "version" and not _SEMVER.match(value):
            detail = "must be a string compatible with semver.org spec 2.0.0"
            errors.append(invalid(f"{path}.version", value, detail))
        if len(value.encode()) > ATTRIBUTE_VALUE_MAX_LENGTH:
            errors.append(too_long(f"{path}.{key}", ATTRIBUTE_VALUE_MAX_LENGTH))
    for index, value in enumerate(attribute.get("strings") or []):
        if len(value.encode()) > ATTRIBUTE_VALUE_MAX_LENGTH:
            errors.append(too_long(f"{path}.strings[{index}]", ATTRIBUTE_VALUE_MAX_LENGTH))
    return errors


# Selectors ---------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Requirement:
    key: str
    operator: str  # "=", "!=", "in", "notin", "exists", "!"
    values: frozenset[str]

    def matches(self, found: Mapping[str, str]) -> bool:
        if self.operator == "exists":
            return self.key in found
        if self.operator == "!":
            return self.key not in found
        present = self.key in found and found[self.key] in self.values
        return present if self.operator in {"=", "in"} else not present


class SelectorError(ValueError):
    """A selector the server answers with 400 BadRequest."""


def parse_field_selector(text: str, kind: Kind, sample: Object) -> list[Requirement]:
    """`spec.nodeName=node-1,spec.driver!=x`: only the fields `kind` can select by."""
    known = kind.selectable(sample)
    found = []
    for term in _terms(text):
        match = re.fullmatch(r"\s*([^=!\s]+)\s*(==|=|!=)\s*(.*?)\s*", term)
        if match is None:
            raise SelectorError(f"invalid selector: '{text}'; can't understand '{term}'")
        key, operator, value = match.groups()
        if key not in known:
            raise SelectorError(f"field label not supported: {key}")
        found.append(Requirement(key, "!=" if operator == "!=" else "=", frozenset({value})))
    return found


def parse_label_selector(text: str) -> list[Requirement]:
    """Equality (`a=b`, `a!=b`), set (`a in (x,y)`, `a notin (x)`) and existence (`a`, `!a`)."""
    found = []
    for raw in _terms(text):
        term = raw.strip()
        if m := re.fullmatch(r"([\w./-]+)\s+(in|notin)\s+\(([^)]*)\)", term):
            values = frozenset(v.strip() for v in m.group(3).split(",") if v.strip())
            found.append(Requirement(m.group(1), m.group(2), values))
        elif m := re.fullmatch(r"([\w./-]+)\s*(==|=|!=)\s*([\w.-]*)", term):
            operator = "!=" if m.group(2) == "!=" else "="
            found.append(Requirement(m.group(1), operator, frozenset({m.group(3)})))
        elif m := re.fullmatch(r"(!?)([\w./-]+)", term):
            found.append(Requirement(m.group(2), "!" if m.group(1) else "exists", frozenset()))
        else:
            raise SelectorError(f"unable to parse requirement: {term!r}")
    return found


def _terms(text: str) -> list[str]:
    """Split at the commas that are not inside a `( … )` value list."""
    terms, depth, current = [], 0, ""
    for char in text:
        depth += {"(": 1, ")": -1}.get(char, 0)
        if char == "," and depth == 0:
            terms.append(current)
            current = ""
        else:
            current += char
    if current.strip():
        terms.append(current)
    return [t for t in terms if t.strip()]
