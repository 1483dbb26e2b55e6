"""The device plugin's metrics: counted here as plain numbers, exported to Prometheus on their
own registry, which loads prometheus_client only when the metrics are served or read: the plugin
registers with the kubelet without it."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    from hostdev.iommufd_handoff import HandoffStats

Labelled = dict[tuple[str, str], int]


@dataclass(frozen=True)
class MetricsSnapshot:
    devices: Labelled
    """By (resource, health)."""
    allocations: Labelled
    """By (resource, result): ok, refused."""
    registrations: Labelled
    """By (resource, result): ok, failed."""
    handoffs: HandoffStats | None


class PluginMetrics:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._devices: Labelled = {}
        self._allocations: Labelled = {}
        self._registrations: Labelled = {}
        self._handoffs: Callable[[], HandoffStats] | None = None
        self._registry: CollectorRegistry | None = None
        # Apart from `_lock`: registering the collector may take a snapshot, which takes that.
        self._registry_lock = threading.Lock()

    def set_devices(self, resource: str, healthy: int, unhealthy: int) -> None:
        with self._lock:
            self._devices[resource, "Healthy"] = healthy
            self._devices[resource, "Unhealthy"] = unhealthy

    def forget_resource(self, resource: str) -> None:
        with self._lock:
            for health in ("Healthy", "Unhealthy"):
                self._devices.pop((resource, health), None)

    def allocation(self, resource: str, result: str) -> None:
        with self._lock:
            self._allocations[resource, result] = self._allocations.get((resource, result), 0) + 1

    def registration(self, resource: str, result: str) -> None:
        with self._lock:
            key = (resource, result)
            self._registrations[key] = self._registrations.get(key, 0) + 1

    def watch_handoffs(self, stats: Callable[[], HandoffStats]) -> None:
        """Read the hand-off counters at scrape time rather than mirroring them."""
        self._handoffs = stats

    def snapshot(self) -> MetricsSnapshot:
        with self._lock:
            devices, allocations = dict(self._devices), dict(self._allocations)
            registrations = dict(self._registrations)
        handoffs = self._handoffs() if self._handoffs is not None else None
        return MetricsSnapshot(devices, allocations, registrations, handoffs)

    @property
    def registry(self) -> CollectorRegistry:
        """The metrics as a Prometheus registry, made at first use."""
        from prometheus_client import CollectorRegistry
        from prometheus_client.registry import Collector

        snapshot = self.snapshot

        class Scraped(Collector):
            def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
                return _families(snapshot())

        with self._registry_lock:
            if self._registry is None:
                self._registry = CollectorRegistry()
                self._registry.register(Scraped())
            return self._registry

    def serve(self, port: int, address: str = "0.0.0.0") -> None:  # noqa: S104 - scraped from the pod network
        from prometheus_client import start_http_server

        start_http_server(port, addr=address, registry=self.registry)


def _families(now: MetricsSnapshot) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    devices = GaugeMetricFamily(
        "kubevirt_iommufd_devices",
        "Devices advertised, by resource and health.",
        labels=["resource", "health"],
    )
    allocations = CounterMetricFamily(
        "kubevirt_iommufd_allocations",
        "Allocate calls answered, by resource and result (ok, refused).",
        labels=["resource", "result"],
    )
    registrations = CounterMetricFamily(
        "kubevirt_iommufd_registrations",
        "Registrations with the kubelet, by resource and result (ok, failed).",
        labels=["resource", "result"],
    )
    for family, values in (
        (devices, now.devices),
        (allocations, now.allocations),
        (registrations, now.registrations),
    ):
        for labels, value in sorted(values.items()):
            family.add_metric(list(labels), value)
        yield family
    stats = now.handoffs
    if stats is None:
        return
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
