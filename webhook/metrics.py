"""Prometheus metrics of one webhook process, in a registry of its own."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, ProcessCollector
from prometheus_client.exposition import generate_latest

# Admissions take well under a millisecond; the API server's timeout is 10 s at most.
LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        ProcessCollector(registry=self.registry)
        self.admissions = Counter(
            "kubevirt_iommufd_webhook_admissions",
            "AdmissionReviews answered, by endpoint and outcome"
            " (patched, unchanged, warned, denied; rejected: HTTP 4xx)",
            ["endpoint", "outcome"],
            registry=self.registry,
        )
        self.latency = Histogram(
            "kubevirt_iommufd_webhook_admission_duration_seconds",
            "Time from a complete request to its encoded answer, by endpoint",
            ["endpoint"],
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.certificate_reloads = Counter(
            "kubevirt_iommufd_webhook_certificate_reloads",
            "Certificate reloads after the files changed, by result (ok, failed)",
            ["result"],
            registry=self.registry,
        )

    def count_admission(self, endpoint: str, outcome: str, seconds: float) -> None:
        self.admissions.labels(endpoint, outcome).inc()
        self.latency.labels(endpoint).observe(seconds)

    def count_reload(self, ok: bool) -> None:
        self.certificate_reloads.labels("ok" if ok else "failed").inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
