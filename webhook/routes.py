"""The two HTTP faces: admissions on the TLS port; probes and metrics on the plain one."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from time import perf_counter

from prometheus_client.exposition import CONTENT_TYPE_LATEST

from hostdev.untrusted import quote_untrusted
from webhook.config import Config
from webhook.http_protocol import Handler, Request, Response, text
from webhook.metrics import Metrics
from webhook.review import BadReview, Verdict, review_pod, review_vmi

log = logging.getLogger(__name__)

Reviewer = Callable[[object, Config], Verdict]
ADMISSION_ROUTES: dict[str, tuple[str, Reviewer]] = {
    "/mutate-pod": ("pod", review_pod),
    "/mutate-vmi": ("vmi", review_vmi),
}


def build_admission_handler(config: Config, metrics: Metrics) -> Handler:
    """Answer AdmissionReviews POSTed as JSON to /mutate-pod and /mutate-vmi."""

    def handle(request: Request) -> Response:
        route = ADMISSION_ROUTES.get(request.path)
        if route is None:
            return text(404, f"no path {request.path[:80]!r}; use /mutate-pod or /mutate-vmi")
        endpoint, reviewer = route
        if request.method != "POST":
            return Response(405, b"POST an AdmissionReview here\n", headers=(("allow", "POST"),))
        if request.content_type != "application/json":
            metrics.admissions.labels(endpoint, "rejected").inc()
            return text(415, "expected Content-Type: application/json (an AdmissionReview)")
        started = perf_counter()
        try:
            verdict = reviewer(json.loads(request.body), config)
        except (ValueError, RecursionError) as error:
            metrics.admissions.labels(endpoint, "rejected").inc()
            return text(400, _bad_body(error))
        body = json.dumps(verdict.review, separators=(",", ":")).encode()
        metrics.count_admission(endpoint, verdict.outcome, perf_counter() - started)
        level = (
            logging.ERROR
            if verdict.internal_error
            else logging.DEBUG
            if verdict.outcome == "unchanged"
            else logging.INFO
        )
        if log.isEnabledFor(level):
            # Subject and uid come from the request as they are; the reason quotes what it names.
            log.log(
                level,
                "%s %s uid=%s %s: %s",
                endpoint,
                quote_untrusted(verdict.subject, 200),
                quote_untrusted(verdict.uid, 60),
                verdict.outcome,
                verdict.reason,
            )
        return Response(200, body, "application/json")

    return handle


def _bad_body(error: Exception) -> str:
    if isinstance(error, BadReview):
        return f"not an AdmissionReview: {error}; send admission.k8s.io/v1 AdmissionReview JSON"
    if isinstance(error, RecursionError):
        return "the body is not valid JSON: nested too deeply"
    return f"the body is not valid JSON: {error}"


def build_health_handler(metrics: Metrics, ready: Callable[[], bool]) -> Handler:
    """Liveness, readiness and Prometheus metrics for the kubelet and the scraper."""

    def handle(request: Request) -> Response:
        if request.path not in ("/healthz", "/readyz", "/metrics"):
            return text(404, f"no path {request.path[:80]!r}; use /healthz, /readyz or /metrics")
        if request.method != "GET":
            return Response(405, b"use GET\n", headers=(("allow", "GET"),))
        if request.path == "/metrics":
            return Response(200, metrics.render(), CONTENT_TYPE_LATEST)
        if request.path == "/readyz" and not ready():
            return text(503, "not ready: the admission port is not serving")
        return text(200, "ok")

    return handle
