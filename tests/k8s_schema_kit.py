"""Objects checked against the official Kubernetes OpenAPI schema (kubernetes-validate, strict:
unknown fields are errors), as `FieldError`s the API server stand-in answers 422 with."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import kubernetes_validate

from sim.apiserver_rules import FieldError

K8S_VERSION = "1.37"


def schema_errors(obj: dict[str, Any], version: str = K8S_VERSION) -> list[FieldError]:
    """What the Kubernetes `version` schema finds wrong with `obj` (the first finding)."""
    try:
        kubernetes_validate.validate(obj, version, strict=True)
    except kubernetes_validate.ValidationError as e:
        instance = e.instance if isinstance(e.instance, str | int | float | bool) else None
        return [FieldError(field_path(e.absolute_path), "FieldValueInvalid", instance, e.message)]
    except kubernetes_validate.SchemaNotFoundError as e:
        return [FieldError("kind", "FieldValueNotSupported", obj.get("kind"), e.message)]
    return []


def assert_valid(obj: dict[str, Any], version: str = K8S_VERSION) -> None:
    errors = schema_errors(obj, version)
    assert not errors, "; ".join(e.render() for e in errors)


def field_path(parts: Iterable[str | int]) -> str:
    """`spec.devices[0].name` from the parts of a JSON path."""
    path = ""
    for part in parts:
        path += f"[{part}]" if isinstance(part, int) else (f".{part}" if path else part)
    return path or "<root>"
