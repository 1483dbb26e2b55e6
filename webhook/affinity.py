"""Plan the node affinity that keeps a VMI requiring iommufd off nodes where it cannot work.

A VMI annotated `iommufd.kubevirt.io/mode: require` fails at domain definition on a node without
iommufd, after it was scheduled. Requiring the node label `kubevirt-iommufd.io/iommufd=true` (set
by the device plugin or the DRA driver, docs/node-labels.md) moves that failure to scheduling,
where the VMI waits for a fitting node instead.

Required node selector terms are ORed and the expressions in a term ANDed, so the requirement is
added to every existing term; the owner's expressions stay as they are. Nothing is changed, and
the owner is warned, when the VMI already keeps itself off such nodes (`nodeSelector` naming
another value, or a term whose expressions on the label exclude `true`): ANDing would make it
unschedulable, and which of the two the owner meant is theirs to say. An empty term selects no
node at all (Kubernetes skips it), so it is left empty: ANDing the requirement into it would
open it to every iommufd node.

Whatever the VMI holds, it gets a patch that keeps it on iommufd nodes or a refusal: a field we
cannot read, or more terms than we read, is refused (`Refused`) rather than let through
unchanged, which would admit the VMI with no requirement at all.
"""

from __future__ import annotations

from typing import Any

from hostdev.labels.node_labels import IOMMUFD_LABEL
from hostdev.untrusted import quote_untrusted
from webhook.plan import Operation, Plan, Refused, Unintelligible, listing, mapping, pointer

# The launcher hook's policy annotation (launcher_hook.model.ANNOTATION_MODE).
MODE_ANNOTATION = "iommufd.kubevirt.io/mode"
REQUIRE = "require"
REQUIREMENT = {"key": IOMMUFD_LABEL, "operator": "In", "values": ["true"]}
REQUIRED = "requiredDuringSchedulingIgnoredDuringExecution"
_TERMS = ("spec", "affinity", "nodeAffinity", REQUIRED, "nodeSelectorTerms")
TERMS_FIELD = ".".join(_TERMS)
# Kubernetes caps neither the terms nor their expressions; only the 1 MiB body we read bounds
# them. Each term without the requirement costs one operation (~150 bytes of patch), so 250,000
# empty terms in 1 MiB once made a 73 MB patch. Real VMIs have a handful of terms (one per node
# pool or zone; one `In` expression lists many values), so a thousand leaves ample room while
# the patch stays under 150 KB, a tenth of what etcd stores in one object (1.5 MiB).
MAX_TERMS = 1_000
# Reading an expression is cheap, but each is work done while launcher pods wait: ten per term.
MAX_EXPRESSIONS = 10 * MAX_TERMS


def requires_iommufd(annotations: dict[str, Any]) -> bool:
    return annotations.get(MODE_ANNOTATION) == REQUIRE


def plan_iommufd_affinity(vmi: dict[str, Any], annotations: dict[str, Any]) -> Plan | None:
    """The operations requiring an iommufd node for a VMI that requires iommufd; None for a VMI
    that does not ask. Raises `Refused` for affinity beyond the limits."""
    if not requires_iommufd(annotations):
        return None
    spec = mapping(vmi.get("spec"), "spec")
    selector = mapping(spec.get("nodeSelector"), "spec.nodeSelector")
    if IOMMUFD_LABEL in selector:
        value = selector[IOMMUFD_LABEL]
        if not isinstance(value, str):
            raise Unintelligible(f"spec.nodeSelector[{IOMMUFD_LABEL}] is not a string")
        if value == "true":
            return Plan((), f"nodeSelector already requires {IOMMUFD_LABEL}=true")
        return _conflict(f"its nodeSelector asks for {IOMMUFD_LABEL}={quote_untrusted(value, 40)}")
    return _plan_terms(vmi, spec)


def refusal(problem: Unintelligible) -> Refused:
    """Why a VMI requiring iommufd is refused when a field it holds cannot be read."""
    return Refused(
        f"{MODE_ANNOTATION}={REQUIRE}, but {problem}, so the webhook cannot keep the VMI on a"
        f" node with {IOMMUFD_LABEL}=true; correct that field and create the VMI again"
    )


def _plan_terms(vmi: dict[str, Any], spec: dict[str, Any]) -> Plan:
    affinity = mapping(spec.get("affinity"), "spec.affinity")
    node_affinity = mapping(affinity.get("nodeAffinity"), "spec.affinity.nodeAffinity")
    required = mapping(node_affinity.get(REQUIRED), f"spec.affinity.nodeAffinity.{REQUIRED}")
    terms = listing(required.get("nodeSelectorTerms"), TERMS_FIELD)
    if not terms:
        term = {"matchExpressions": [REQUIREMENT]}
        operation = _add_missing(vmi, list(_TERMS), [term])
        return Plan((operation,), f"required node affinity {IOMMUFD_LABEL}=true added")
    if len(terms) > MAX_TERMS:
        raise Refused(
            f"{TERMS_FIELD} has {len(terms)} terms, over the webhook's limit of {MAX_TERMS};"
            " merge terms (one `In` expression can list many values) and create the VMI again"
        )
    read = [_read_term(term, f"{TERMS_FIELD}[{index}]") for index, term in enumerate(terms)]
    total = sum(len(expressions) for expressions, _ in read)
    if total > MAX_EXPRESSIONS:
        raise Refused(
            f"{TERMS_FIELD} hold {total} matchExpressions in all, over the webhook's limit of"
            f" {MAX_EXPRESSIONS}; merge expressions (one `In` expression can list many values)"
            " and create the VMI again"
        )
    operations: list[Operation] = []
    for index, (expressions, empty) in enumerate(read):
        where = f"{TERMS_FIELD}[{index}]"
        verdict = _judge(expressions, where)
        if verdict == "excludes":
            return _conflict(f"its required node affinity {where} excludes {IOMMUFD_LABEL}=true")
        if verdict == "satisfied" or empty:
            continue
        if isinstance(terms[index].get("matchExpressions"), list):
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


def _read_term(term: object, where: str) -> tuple[list[Any], bool]:
    """A term's matchExpressions, and whether the term is empty (selects no node)."""
    if term is None:
        raise Unintelligible(
            f"{where} is null; a term is an object with matchExpressions or matchFields:"
            " remove the null entry"
        )
    entry = mapping(term, where)
    expressions = listing(entry.get("matchExpressions"), f"{where}.matchExpressions")
    fields = listing(entry.get("matchFields"), f"{where}.matchFields")
    return expressions, not expressions and not fields


def _judge(expressions: list[Any], where: str) -> str:
    """`satisfied` when the term already has our requirement, `excludes` when its expressions
    on the label rule out `true`, else `open`."""
    satisfied = False
    for index, expression in enumerate(expressions):
        at = f"{where}.matchExpressions[{index}]"
        item = mapping(expression, at)
        if item.get("key") != IOMMUFD_LABEL:
            continue
        operator = item.get("operator")
        values = listing(item.get("values"), f"{at}.values")
        if not all(isinstance(value, str) for value in values):
            raise Unintelligible(f"{at}.values is not a list of strings")
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
