"""Plan the node affinity that keeps a VMI requiring iommufd off nodes where it cannot work.

A VMI annotated `iommufd.kubevirt.io/mode: require` fails at domain definition on a node without
iommufd, after it was scheduled. Requiring the node label `kubevirt-iommufd.io/iommufd=true` (set
by the device plugin or the DRA driver, docs/node-labels.md) moves that failure to scheduling,
where the VMI waits for a fitting node instead.

Required node selector terms are ORed and the expressions in a term ANDed, so the requirement is
added to every existing term; the owner's expressions stay as they are. Nothing is changed, and
the owner is warned, when the VMI already keeps itself off such nodes (`nodeSelector` naming
another value, or a term whose expressions on the label exclude `true`): ANDing would make it
unschedulable, and which of the two the owner meant is theirs to say.
"""

from __future__ import annotations

from typing import Any

from hostdev.labels.node_labels import IOMMUFD_LABEL
from hostdev.untrusted import quote_untrusted
from webhook.plan import Operation, Plan, listing, mapping, pointer

# The launcher hook's policy annotation (launcher_hook.model.ANNOTATION_MODE).
MODE_ANNOTATION = "iommufd.kubevirt.io/mode"
REQUIRE = "require"
REQUIREMENT = {"key": IOMMUFD_LABEL, "operator": "In", "values": ["true"]}
REQUIRED = "requiredDuringSchedulingIgnoredDuringExecution"
_TERMS = ("spec", "affinity", "nodeAffinity", REQUIRED, "nodeSelectorTerms")


def plan_iommufd_affinity(vmi: dict[str, Any], annotations: dict[str, Any]) -> Plan | None:
    """The operations requiring an iommufd node for a VMI that requires iommufd; None for a VMI
    that does not ask."""
    if annotations.get(MODE_ANNOTATION) != REQUIRE:
        return None
    spec = mapping(vmi.get("spec"), "spec")
    selector = mapping(spec.get("nodeSelector"), "spec.nodeSelector")
    if IOMMUFD_LABEL in selector:
        value = selector[IOMMUFD_LABEL]
        if value == "true":
            return Plan((), f"nodeSelector already requires {IOMMUFD_LABEL}=true")
        shown = quote_untrusted(value if isinstance(value, str) else repr(value), 40)
        return _conflict(f"its nodeSelector asks for {IOMMUFD_LABEL}={shown}")
    return _plan_terms(vmi, spec)


def _plan_terms(vmi: dict[str, Any], spec: dict[str, Any]) -> Plan:
    affinity = mapping(spec.get("affinity"), "spec.affinity")
    node_affinity = mapping(affinity.get("nodeAffinity"), "spec.affinity.nodeAffinity")
    required = mapping(node_affinity.get(REQUIRED), f"spec.affinity.nodeAffinity.{REQUIRED}")
    terms = listing(required.get("nodeSelectorTerms"), "nodeSelectorTerms")
    if not terms:
        term = {"matchExpressions": [REQUIREMENT]}
        operation = _add_missing(vmi, list(_TERMS), [term])
        return Plan((operation,), f"required node affinity {IOMMUFD_LABEL}=true added")
    operations: list[Operation] = []
    for index, term in enumerate(terms):
        where = f"nodeSelectorTerms[{index}]"
        expressions = listing(mapping(term, where).get("matchExpressions"), where)
        verdict = _judge(expressions, where)
        if verdict == "excludes":
            return _conflict(f"its required node affinity {where} excludes {IOMMUFD_LABEL}=true")
        if verdict == "satisfied":
            continue
        if isinstance(term.get("matchExpressions"), list):
            path = pointer(*_TERMS, index, "matchExpressions", "-")
            operations.append({"op": "add", "path": path, "value": REQUIREMENT})
        else:
            path = pointer(*_TERMS, index, "matchExpressions")
            operations.append({"op": "add", "path": path, "value": [REQUIREMENT]})
    if not operations:
        return Plan((), f"required node affinity already asks for {IOMMUFD_LABEL}=true")
    return Plan(
        tuple(operations),
        f"{IOMMUFD_LABEL}=true added to {len(operations)} required node selector term(s)",
    )


def _judge(expressions: list[Any], where: str) -> str:
    """`satisfied` when the term already has our requirement, `excludes` when its expressions
    on the label rule out `true`, else `open`."""
    satisfied = False
    for index, expression in enumerate(expressions):
        item = mapping(expression, f"{where}.matchExpressions[{index}]")
        if item.get("key") != IOMMUFD_LABEL:
            continue
        operator = item.get("operator")
        values = item.get("values")
        values = values if isinstance(values, list) else []
        if operator == "In" and values == ["true"]:
            satisfied = True
        elif (
            (operator == "In" and "true" not in values)
            or (operator == "NotIn" and "true" in values)
            or operator in ("DoesNotExist", "Gt", "Lt")
        ):
            return "excludes"
    return "satisfied" if satisfied else "open"


def _add_missing(vmi: dict[str, Any], path: list[str], value: object) -> Operation:
    """One `add` at the first object on `path` the VMI lacks (absent or null), holding the rest
    of the path down to `value`; at `path` itself when every object above it is there."""
    node: dict[str, Any] = vmi
    for depth, key in enumerate(path[:-1]):
        child = node.get(key)
        if not isinstance(child, dict):
            for inner in reversed(path[depth + 1 :]):
                value = {inner: value}
            return {"op": "add", "path": pointer(*path[: depth + 1]), "value": value}
        node = child
    return {"op": "add", "path": pointer(*path), "value": value}


def _conflict(why: str) -> Plan:
    return Plan(
        (),
        f"no iommufd node affinity: {why}",
        warnings=(
            f"{MODE_ANNOTATION}={REQUIRE} wants a node with {IOMMUFD_LABEL}=true, but {why};"
            " node affinity left unchanged, so the VMI may land where iommufd does not work",
        ),
    )
