"""Prometheus metrics of the device plugin, on their own registry."""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from hostdev.iommufd_handoff import HandoffStats


class PluginMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.devices = Gauge(
            "kubevirt_iommufd_devices",
            "Devices advertised, by resource and health.",
            ["resource", "health"],
            registry=self.registry,
        )
        self.allocations = Counter(
            "kubevirt_iommufd_allocations",
            "Allocate calls answered, by resource and result (ok, refused).",
            ["resource", "result"],
            registry=self.registry,
        )
        self.registrations = Counter(
            "kubevirt_iommufd_registrations",
            "Registrations with the kubelet, by resource and result (ok, failed).",
            ["resource", "result"],
            registry=self.registry,
        )

    def set_devices(self, resource: str, healthy: int, unhealthy: int) -> None:
        self.devices.labels(resource, "Healthy").set(healthy)
        self.devices.labels(resource, "Unhealthy").set(unhealthy)

    def forget_resource(self, resource: str) -> None:
        for health in ("Healthy", "Unhealthy"):
            self.devices.remove(resource, health)

    def allocation(self, resource: str, result: str) -> None:
        self.allocations.labels(resource, result).inc()

    def registration(self, resource: str, result: str) -> None:
        self.registrations.labels(resource, result).inc()

    def watch_handoffs(self, stats: Callable[[], HandoffStats]) -> None:
        self.registry.register(_HandoffCollector(stats))

    def serve(self, port: int, address: str = "0.0.0.0") -> None:  # noqa: S104 - scraped from the pod network
        start_http_server(port, addr=address, registry=self.registry)


class _HandoffCollector(Collector):
    """Reads the hand-off counters at scrape time rather than mirroring them."""

    def __init__(self, stats: Callable[[], HandoffStats]) -> None:
        self._stats = stats

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        stats = self._stats()
        handoffs = CounterMetricFamily(
            "kubevirt_iommufd_handoffs",
            "iommufd fd hand-offs, by outcome (served, expired, failed).",
            labels=["outcome"],
        )
        handoffs.add_metric(["served"], stats.served)
        handoffs.add_metric(["expired"], stats.expired)
        handoffs.add_metric(["failed"], stats.failed)
        yield handoffs
        yield GaugeMetricFamily(
            "kubevirt_iommufd_handoffs_pending",
            "iommufd hand-off sockets waiting for their launcher.",
            value=stats.pending,
        )
