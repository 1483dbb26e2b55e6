"""DRA health benchmark: how fast the driver's judgement follows the host, and what its counter
poll costs idle. The driver runs in this process (its event thread, inotify watch and publisher
as in production) on a simulated 8-GPU node, against the API server stand-in. Printed:
- unbind -> UNHEALTHY and bind -> HEALTHY: from the sysfs change to `on_health` handing on the
  list that says so (inotify on the driver links), p50/p99 over 50 each;
- AER fatal -> UNHEALTHY: from the counter file's change to the list (the counter poll, every
  `aer_poll_interval`: at most one interval), p50/p99 over 50, each at a random moment and
  followed by a re-probe, which clears it;
- idle CPU of the driver process (all its threads) over 10 s with nothing happening, with the
  counter poll at 50 ms and with it off, in % of one core.
Run: `python -m bench.dra_health` (on a shared machine, under `nice`).
"""

from __future__ import annotations

import resource
import statistics
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

from bench.benchkit import print_rows
from dra.api import ResourceApi
from dra.driver import DraDriver, DriverSettings
from dra.health import DeviceHealth, Health
from hostdev.config import default_config
from hostdev.pciids import PciIds
from sim.apiserver import running_apiserver
from sim.host import bind_driver, build_tree, hgx_h100, report_aer_error, unbind_driver

NODE = "bench-node"
DRIVER = "vfio.kubevirt-iommufd.io"
GPU = "0000:2a:00.0"
GPU_DEVICE = "pci-0000-2a-00-0"
RUNS = 50
IDLE_SECONDS = 10.0


class Watcher:
    """The lists `on_health` hands on, and a wait for the device's health in one of them."""

    def __init__(self) -> None:
        self._changed = threading.Condition()
        self._last: dict[str, Health] = {}

    def report(self, health: tuple[DeviceHealth, ...]) -> None:
        with self._changed:
            self._last = {h.device: h.health for h in health}
            self._changed.notify_all()

    def wait(self, health: Health, timeout: float = 5.0) -> None:
        with self._changed:
            if not self._changed.wait_for(lambda: self._last.get(GPU_DEVICE) is health, timeout):
                raise SystemExit(f"{GPU_DEVICE} not {health.name} within {timeout} s")


def timed(change: Callable[[], None], watcher: Watcher, health: Health) -> float:
    start = time.perf_counter()
    change()
    watcher.wait(health)
    return time.perf_counter() - start


def cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def stats(values: list[float]) -> str:
    ordered = sorted(values)
    p99 = ordered[min(len(ordered) - 1, round(0.99 * (len(ordered) - 1)))]
    return f"{statistics.median(ordered) * 1000:.1f} / {p99 * 1000:.1f} ms"


def run_driver(work: Path, api: ResourceApi, poll: float, watcher: Watcher) -> DraDriver:
    root = build_tree(hgx_h100(), work / f"host-{poll}")
    settings = DriverSettings(
        node=NODE,
        driver=DRIVER,
        root=root,
        kubelet_dir=work / f"kubelet-{poll}",
        cdi_dir=work / f"cdi-{poll}",
        state_dir=work / f"state-{poll}",
        run_dir=work / f"run-{poll}",
        rescan_interval=30.0,
    )
    driver = DraDriver(
        replace(settings, aer_poll_interval=poll),
        default_config(),
        PciIds(None),
        api,
        on_health=watcher.report,
    )
    driver.start()
    return driver


def idle_cpu(driver: DraDriver) -> str:
    time.sleep(1.0)
    before, start = cpu_seconds(), time.monotonic()
    time.sleep(IDLE_SECONDS)
    share = (cpu_seconds() - before) / (time.monotonic() - start)
    return f"{share * 100:.2f} % of a core"


def main() -> None:
    rows: list[tuple[str, str, str]] = []
    with (
        tempfile.TemporaryDirectory(prefix="dra-health-", dir="/tmp") as tmp,
        running_apiserver() as apiserver,
        apiserver.api_client() as client,
    ):
        work = Path(tmp)
        apiserver.put_node(NODE)
        api = ResourceApi(client)
        watcher = Watcher()
        driver = run_driver(work, api, 0.05, watcher)
        root = driver.settings.root
        try:
            down, up, fatal = [], [], []
            for _ in range(RUNS):
                down.append(timed(lambda: unbind_driver(root, GPU), watcher, Health.UNHEALTHY))
                up.append(
                    timed(lambda: bind_driver(root, GPU, "vfio-pci"), watcher, Health.HEALTHY)
                )
            for run in range(RUNS):
                # Each event has the counters read at once, and the next reading is one
                # interval later: errors come at any time, so spread them over an interval.
                time.sleep(0.1 + (run % 10) * 0.005)
                fatal.append(
                    timed(
                        lambda: report_aer_error(root, GPU, fatal=True), watcher, Health.UNHEALTHY
                    )
                )
                unbind_driver(root, GPU)
                bind_driver(root, GPU, "vfio-pci")
                watcher.wait(Health.HEALTHY)
            rows.append(("unbind -> UNHEALTHY", "p50 / p99", stats(down)))
            rows.append(("bind -> HEALTHY", "p50 / p99", stats(up)))
            rows.append(("AER fatal -> UNHEALTHY (poll 50 ms)", "p50 / p99", stats(fatal)))
            rows.append(("idle CPU, counter poll 50 ms", "8 GPUs", idle_cpu(driver)))
        finally:
            driver.stop()
        quiet = run_driver(work, api, 0.0, Watcher())
        try:
            rows.append(("idle CPU, counter poll off", "8 GPUs", idle_cpu(quiet)))
        finally:
            quiet.stop()
    print_rows(rows)


if __name__ == "__main__":
    main()
