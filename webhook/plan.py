"""What a mutation plan is, and the small readers the pod and VMI planners share.

An API server only ever sends well-typed objects, so a shape we cannot read means a bug or a
misconfiguration somewhere; the readers raise `Unintelligible` naming the field, and the review
decides whether that warns (default) or denies (`strict`). A planner raises `Refused` instead
where letting the object through unchanged would break a promise (a VMI requiring iommufd
admitted without its node affinity) or where the object is over a limit: that is always denied.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from hostdev.untrusted import quote_untrusted

Operation = dict[str, Any]
# Names in a reason come from the object under review and end up in logs and in the warnings
# kubectl shows: each is quoted (a newline would forge a log line) and cut, and only a few shown.
SHOWN_NAMES = 5
NAME_LIMIT = 100


class Unintelligible(ValueError):
    """An object whose shape we cannot make sense of; the message names the field."""


class Refused(ValueError):
    """An object to deny whatever the config says; the message names the field or the limit,
    and what to do."""


@dataclass(frozen=True, slots=True)
class Plan:
    """The RFC 6902 operations to apply (none: leave the object as it is) and why, with what
    the object's owner should hear in the AdmissionReview's `warnings`."""

    operations: tuple[Operation, ...]
    reason: str
    warnings: tuple[str, ...] = ()


def pointer(*tokens: str | int) -> str:
    """An RFC 6901 JSON Pointer; `~` is escaped before `/` so `~1` in a key stays literal."""
    return "".join("/" + str(t).replace("~", "~0").replace("/", "~1") for t in tokens)


def mapping(value: object, where: str) -> dict[str, Any]:
    """`value` as an object; JSON null and an absent field (None) read as empty."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise Unintelligible(f"{where} is not an object")
    return value


def listing(value: object, where: str) -> list[Any]:
    """`value` as a list; JSON null and an absent field (None) read as empty."""
    if value is None:
        return []
    if not isinstance(value, list):
        raise Unintelligible(f"{where} is not a list")
    return value


def quoted_names(names: Sequence[str]) -> str:
    """`names` for a reason: the first few, each quoted and capped, then how many more."""
    shown = ", ".join(quote_untrusted(name, NAME_LIMIT) for name in names[:SHOWN_NAMES])
    rest = len(names) - SHOWN_NAMES
    return f"{shown} and {rest} more" if rest > 0 else shown
