"""AdmissionReview in, AdmissionReview out: the webhook's answer as a pure function of the request.

A body that is not an AdmissionReview we can answer (no `request.uid`) raises `BadReview`, which
the server turns into HTTP 400. Anything past that gets an answer: a pod we cannot read is let
through with a warning, because a bug of ours must not block VMs, unless the config is `strict`;
an object a planner refuses (`Refused`) and an answer over `MAX_PATCH_BYTES` are denied.

A bug of ours while planning (any other exception) is never an HTTP 500: under the VMI webhook's
`failurePolicy: Ignore` a 500 admits the VMI unchanged, so a `require` VMI would run without the
affinity that keeps it on iommufd nodes. A VMI is denied instead (it can be created again once
the bug is fixed); a pod is let through with a warning as above, unless `strict`.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from hostdev.untrusted import quote_untrusted
from webhook.config import Config
from webhook.plan import Plan, Refused, Unintelligible
from webhook.pod import plan_pod
from webhook.vmi import plan_vmi

API_VERSION = "admission.k8s.io/v1"
KIND = "AdmissionReview"
WARNING_PREFIX = "kubevirt-iommufd: "
# As much as the largest review we read (webhook.http_protocol.MAX_BODY): more can only be
# amplification, and a patch this big would take the object past what etcd stores (1.5 MiB).
MAX_PATCH_BYTES = 1024 * 1024

Planner = Callable[[object, str, Config], Plan]


class BadReview(ValueError):
    """A request body that is not an AdmissionReview with a `request.uid`."""


@dataclass(frozen=True, slots=True)
class Verdict:
    """The AdmissionReview to send back, with what happened for logs and metrics."""

    review: dict[str, Any]
    outcome: str  # patched | unchanged | warned | denied
    reason: str
    uid: str
    subject: str  # namespace/name of the object, for logs
    internal_error: bool = False
    """The answer stands in for a plan a bug of ours kept us from making: logged as an error."""


@dataclass(frozen=True, slots=True)
class Endpoint:
    """One mutating endpoint: which kind of object it reads and how it plans the change."""

    kind: str
    noun: str
    planner: Planner
    fail_closed: bool
    """Deny, rather than admit unchanged, when planning fails on a bug of ours."""


POD = Endpoint("Pod", "pod", plan_pod, fail_closed=False)
VMI = Endpoint("VirtualMachineInstance", "VMI", plan_vmi, fail_closed=True)


def review_pod(body: object, config: Config) -> Verdict:
    """Answer an AdmissionReview for a pod (`/mutate-pod`)."""
    return review(body, config, POD)


def review_vmi(body: object, config: Config) -> Verdict:
    """Answer an AdmissionReview for a VirtualMachineInstance (`/mutate-vmi`)."""
    return review(body, config, VMI)


def review(body: object, config: Config, endpoint: Endpoint) -> Verdict:
    """Answer an AdmissionReview with the change `endpoint` plans for its object."""
    if not isinstance(body, dict):
        raise BadReview("the body is not a JSON object; expected an AdmissionReview")
    request = body.get("request")
    if not isinstance(request, dict):
        raise BadReview("the AdmissionReview has no request object")
    uid = request.get("uid")
    if not isinstance(uid, str) or not uid:
        raise BadReview("request.uid is missing or not a non-empty string")
    api_version = body.get("apiVersion")
    kind = body.get("kind")
    envelope = {
        "apiVersion": api_version if isinstance(api_version, str) else API_VERSION,
        "kind": kind if isinstance(kind, str) else KIND,
    }
    namespace = request.get("namespace")
    namespace = namespace if isinstance(namespace, str) else ""
    subject = f"{namespace}/{_name(request)}"
    response: dict[str, Any] = {"uid": uid, "allowed": True}
    try:
        plan = _plan(request, namespace, config, endpoint)
    except Refused as refused:
        return _denied(envelope, response, str(refused), subject)
    except Unintelligible as problem:
        reason = f"cannot read the {endpoint.noun}: {problem}"
        return _unplanned(envelope, response, reason, subject, deny=config.strict)
    except Exception as bug:  # any bug of ours is an answer, never an HTTP 500
        reason = (
            f"internal error planning this {endpoint.noun} ({type(bug).__name__}: "
            f"{quote_untrusted(str(bug), 200)}); the webhook's log has it, please report it"
        )
        verdict = _unplanned(
            envelope, response, reason, subject, deny=endpoint.fail_closed or config.strict
        )
        return replace(verdict, internal_error=True)
    if plan.operations:
        patch = json.dumps(plan.operations, separators=(",", ":")).encode()
        if len(patch) > MAX_PATCH_BYTES:
            reason = (
                f"the patch for this {endpoint.noun} would be {len(patch)} bytes, over the"
                f" webhook's limit of {MAX_PATCH_BYTES}; {plan.reason}"
            )
            return _denied(envelope, response, reason, subject)
        response["patchType"] = "JSONPatch"
        response["patch"] = base64.b64encode(patch).decode("ascii")
    if plan.warnings:
        response["warnings"] = [f"{WARNING_PREFIX}{warning}" for warning in plan.warnings]
    outcome = "patched" if plan.operations else "warned" if plan.warnings else "unchanged"
    return Verdict({**envelope, "response": response}, outcome, plan.reason, uid, subject)


def _unplanned(
    envelope: dict[str, Any], response: dict[str, Any], reason: str, subject: str, *, deny: bool
) -> Verdict:
    """No plan could be made: denied, or let through unchanged with a warning."""
    if deny:
        return _denied(envelope, response, reason, subject)
    response["warnings"] = [f"{WARNING_PREFIX}{reason}; left unchanged"]
    review = {**envelope, "response": response}
    return Verdict(review, "warned", reason, response["uid"], subject)


def _denied(
    envelope: dict[str, Any], response: dict[str, Any], reason: str, subject: str
) -> Verdict:
    response["allowed"] = False
    response["status"] = {"code": 400, "message": f"{WARNING_PREFIX}{reason}"}
    return Verdict({**envelope, "response": response}, "denied", reason, response["uid"], subject)


def _plan(request: dict[str, Any], namespace: str, config: Config, endpoint: Endpoint) -> Plan:
    operation = request.get("operation")
    if operation != "CREATE":
        return Plan((), f"operation {_shown(operation, 20)} is not CREATE")
    kind = request.get("kind")
    if isinstance(kind, dict) and kind.get("kind") != endpoint.kind:
        raise Unintelligible(
            f"this endpoint takes {endpoint.kind} objects, not {_shown(kind.get('kind'), 40)};"
            " check the webhook configuration's rules"
        )
    return endpoint.planner(request.get("object"), namespace, config)


def _shown(value: object, limit: int) -> str:
    """A field of the request for a reason: a string quoted and capped, anything else its type.

    Not repr(): a list nested as deep as the JSON parser allows would overflow it.
    """
    return quote_untrusted(value, limit) if isinstance(value, str) else f"<{type(value).__name__}>"


def _name(request: dict[str, Any]) -> str:
    """The object's name; pods from a controller have only a generateName at CREATE."""
    name = request.get("name")
    if isinstance(name, str) and name:
        return name
    obj = request.get("object")
    metadata = obj.get("metadata") if isinstance(obj, dict) else None
    if isinstance(metadata, dict):
        for key in ("name", "generateName"):
            value = metadata.get(key)
            if isinstance(value, str) and value:
                return value
    return "?"
