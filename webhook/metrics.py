"""Prometheus metrics of one webhook process, in a registry of its own."""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector
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

        self.connections = Gauge(
            "kubevirt_iommufd_webhook_connections",
            "Open connections, by listener (admission, health)",
            ["listener"],
            registry=self.registry,
        )
        self.connections_closed = Counter(
            "kubevirt_iommufd_webhook_connections_closed",
            "Connections the server closed, by listener and reason (evicted: the listener was"
            " full; request_timeout: no complete request in time; idle_timeout: idle keep-alive)",
            ["listener", "reason"],
            registry=self.registry,
        )

    def watch_connections(self, listener: str, count: Callable[[], int]) -> None:
        self.connections.labels(listener).set_function(count)

    def counter_of_closed(self, listener: str) -> Callable[[str], None]:
        def count(reason: str) -> None:
            self.connections_closed.labels(listener, reason).inc()

        return count

    def count_admission(self, endpoint: str, outcome: str, seconds: float) -> None:
        self.admissions.labels(endpoint, outcome).inc()
        self.latency.labels(endpoint).observe(seconds)

    def count_reload(self, ok: bool) -> None:
        self.certificate_reloads.labels("ok" if ok else "failed").inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
