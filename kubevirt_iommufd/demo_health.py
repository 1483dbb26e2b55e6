"""Timing a device's health change where the cluster sees it: in the kubelet's health cache (fed by
the driver's NodeWatchResources stream over gRPC) and in the device's slice entry at the API
server (its taint, written over HTTPS). The dra demo times one change each way; `bench.
health_latency` times many, next to the device plugin's ListAndWatch.

Each watcher is given a deadline (`time.monotonic()`) and answers when what it waits for first
held, or None if not by then. The watchers wake on every change of what they watch (the stand-in's
health cache, the API server's store), so the time they answer with is when it arrived, not when
a poll came round.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from dra.slices import unhealthy_taint_key
from sim.apiserver import ApiServerStandIn
from sim.dra_kubelet import DRAKubeletStandIn

Watcher = Callable[[float], float | None]
"""Given a deadline, the monotonic time at which what it waits for held; None if not by then."""
Object = dict[str, Any]


def time_change(
    change: Callable[[], None], watchers: Sequence[Watcher], timeout: float
) -> list[float | None]:
    """Seconds from `change()` until each watcher saw its condition hold (None: not within
    `timeout`). The watchers wait side by side, all started before the change."""
    started = threading.Barrier(len(watchers) + 1)
    deadline = time.monotonic() + timeout + 1.0

    def watch(watcher: Watcher) -> float | None:
        started.wait()
        return watcher(deadline)

    with ThreadPoolExecutor(len(watchers), thread_name_prefix="health-watch") as pool:
        futures = [pool.submit(watch, w) for w in watchers]
        started.wait()
        start = time.monotonic()
        change()
        seen = [f.result() for f in futures]
    return [None if t is None or t - start > timeout else max(0.0, t - start) for t in seen]


def stream_says(kubelet: DRAKubeletStandIn, driver: str, key: str, health: str) -> Watcher:
    """The kubelet's health cache for `driver` reads device `key` ("<pool>/<device>") as
    `health` ("Healthy", "Unhealthy")."""

    def watch(deadline: float) -> float | None:
        def holds() -> bool:
            seen = kubelet.health(driver).get(key)
            return seen is not None and seen.health == health

        try:
            kubelet.wait_for(holds, max(0.0, deadline - time.monotonic()), f"{key} {health}")
        except TimeoutError:
            return None
        return time.monotonic()

    return watch


def slice_shows(
    api: ApiServerStandIn, node: str, driver: str, device: str, *, tainted: bool
) -> Watcher:
    """The API server holds `device` in `node`'s pool with (or without) the driver's unhealthy
    taint."""

    def watch(deadline: float) -> float | None:
        def holds() -> bool:
            taints = device_taints(api.slices(node, driver), driver, device)
            return taints is not None and bool(taints) is tainted

        # The store's condition is re-entrant: reading the slices under it is allowed, and
        # holding it between the reading and the wait misses no write.
        store = api.store
        with store.changed:
            while not holds():
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                store.changed.wait(left)
            return time.monotonic()

    return watch


def device_taints(slices: list[Object], driver: str, device: str) -> list[Object] | None:
    """The driver's unhealthy taints on `device`'s entry in the newest generation of the pool's
    slices; None when the device is not published there."""
    if not slices:
        return None
    newest = max(s["spec"]["pool"]["generation"] for s in slices)
    key = unhealthy_taint_key(driver)
    for entry in (
        d for s in slices if s["spec"]["pool"]["generation"] == newest for d in s["spec"]["devices"]
    ):
        if entry["name"] == device:
            return [t for t in entry.get("taints") or [] if t.get("key") == key]
    return None
