"""Health latency where the cluster sees it: the DRA driver next to the device plugin, for the same
event on a simulated 8-GPU node (a GPU unbound from vfio-pci, then bound to it again).

Each component runs as its own process, as on a node (`kubevirt-iommufd dra`, `kubevirt-iommufd
plugin`), one after the other on a fresh tree, against the stand-ins in this process:
- DRA driver, event -> the kubelet stand-in's health cache reads the device UNHEALTHY (HEALTHY)
  from the driver's NodeWatchResources stream over gRPC;
- DRA driver, event -> the API server stand-in holds the device's slice entry with the
  `<driver>/unhealthy` taint (without it), written by the driver over HTTPS;
- device plugin, event -> its kubelet stand-in reads the device Unhealthy (Healthy) in
  ListAndWatch over gRPC.
p50/p99 over `RUNS` events each way, each timed from the sysfs change to the moment the stand-in
holds the news (`kubevirt_iommufd.demo_health`: the watchers wake on every change, not on a
poll). The events are spread over `SPACING` after the one before, so that they do not line up
with a periodic re-scan. The load average at the start is printed with the figures: run it on a
quiet machine.
Run: `python -m bench.health_latency` (or `./dev.sh bench`).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

from bench.benchkit import Row, print_rows
from bench.plugin import RESOURCE, p50_p99, spawn_plugin
from kubevirt_iommufd.demo_health import Watcher, slice_shows, stream_says, time_change
from sim.apiserver import running_apiserver
from sim.dra_kubelet import DRAKubeletStandIn
from sim.host import bind_driver, build_tree, hgx_h100, unbind_driver
from sim.kubelet import KubeletStandIn

NODE = "bench-node"
DRIVER = "vfio.kubevirt-iommufd.io"
GPU = "0000:2a:00.0"
GPU_DEVICE = "pci-0000-2a-00-0"
NODE_LABEL = "8 GPUs"
RUNS = 40
# Events come at any time: spread them over 50-230 ms after the previous one settled.
SPACING = [0.05 + 0.02 * step for step in range(10)]
TIMEOUT = 5.0
START_TIMEOUT = 30.0


def measure(
    root: Path, down: Sequence[Watcher], up: Sequence[Watcher]
) -> tuple[list[list[float]], list[list[float]], int]:
    """`RUNS` unbinds and binds: per watcher, the seconds each took; and how many were missed."""
    downs: list[list[float]] = [[] for _ in down]
    ups: list[list[float]] = [[] for _ in up]
    missed = 0
    changes = (
        (lambda: unbind_driver(root, GPU), down, downs),
        (lambda: bind_driver(root, GPU, "vfio-pci"), up, ups),
    )
    for run in range(RUNS):
        for change, watchers, times in changes:
            time.sleep(SPACING[run % len(SPACING)])
            for series, seen in zip(times, time_change(change, watchers, TIMEOUT), strict=True):
                if seen is None:
                    missed += 1
                else:
                    series.append(seen)
    return downs, ups, missed


def figures(seconds: list[float]) -> str:
    return p50_p99(seconds) if seconds else "- (none seen)"


def spawn_dra(*args: str) -> subprocess.Popen[bytes]:
    """`kubevirt-iommufd dra` as the node's only instance (not the new pod of a rolling
    update, whatever this shell's POD_UID), logging errors only."""
    return subprocess.Popen(
        [sys.executable, "-m", "kubevirt_iommufd", "dra", *args, "--log-level", "error"],
        env={k: v for k, v in os.environ.items() if k != "POD_UID"},
    )


@contextmanager
def running(name: str, process: subprocess.Popen[bytes]) -> Iterator[None]:
    """The process for the block's length, then SIGTERM (SIGKILL if not gone within 10 s, as
    the kubelet would do after a shorter grace period: said on stderr, not waited out)."""
    try:
        yield
    finally:
        process.terminate()
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            print(f"{name}: not stopped 10 s after SIGTERM; killed", file=sys.stderr)
            process.kill()
            process.wait()


def dra_rows(work: Path) -> list[Row]:
    root = build_tree(hgx_h100(), work / "dra-root")
    key = f"{NODE}/{GPU_DEVICE}"
    with (
        running_apiserver() as api,
        DRAKubeletStandIn(work / "dra-kubelet", info_poll_interval=None) as kubelet,
    ):
        api.put_node(NODE)
        kubeconfig = api.write_kubeconfig(work / "kubeconfig")
        process = spawn_dra(
            "--node-name", NODE, "--root", str(root),
            "--kubelet-dir", str(work / "dra-kubelet"), "--cdi-dir", str(work / "cdi"),
            "--state-dir", str(work / "state"), "--run-dir", str(work / "run"),
            "--kubeconfig", str(kubeconfig),
        )  # fmt: skip
        with running("kubevirt-iommufd dra", process):
            kubelet.wait_health(
                DRIVER,
                lambda h: len(h) == 8 and all(s.health == "Healthy" for s in h.values()),
                START_TIMEOUT,
                "8 devices Healthy",
            )
            downs, ups, missed = measure(
                root,
                [
                    stream_says(kubelet, DRIVER, key, "Unhealthy"),
                    slice_shows(api, NODE, DRIVER, GPU_DEVICE, tainted=True),
                ],
                [
                    stream_says(kubelet, DRIVER, key, "Healthy"),
                    slice_shows(api, NODE, DRIVER, GPU_DEVICE, tainted=False),
                ],
            )
    return [
        (NODE_LABEL, "DRA driver: unbind -> UNHEALTHY in the health stream", figures(downs[0])),
        (NODE_LABEL, "DRA driver: unbind -> taint in the slice", figures(downs[1])),
        (NODE_LABEL, "DRA driver: bind -> HEALTHY in the health stream", figures(ups[0])),
        (NODE_LABEL, "DRA driver: bind -> taint gone from the slice", figures(ups[1])),
        (NODE_LABEL, "DRA driver: events not seen within 5 s", str(missed)),
    ]


def plugin_says(kubelet: KubeletStandIn, health: str) -> Watcher:
    """The device plugin's kubelet stand-in reads the GPU as `health` in ListAndWatch."""

    def watch(deadline: float) -> float | None:
        try:
            kubelet.wait_for(
                lambda: kubelet.health(RESOURCE).get(GPU) == health,
                max(0.0, deadline - time.monotonic()),
            )
        except AssertionError:
            return None
        return time.monotonic()

    return watch


def plugin_rows(work: Path) -> list[Row]:
    root = build_tree(hgx_h100(), work / "plugin-root")
    kubelet = KubeletStandIn(work / "plugin-kubelet")
    kubelet.start()
    try:
        process = spawn_plugin(work, root, kubelet.directory)
        with running("kubevirt-iommufd plugin", process):
            kubelet.wait_registered(RESOURCE, timeout=START_TIMEOUT)
            downs, ups, missed = measure(
                root, [plugin_says(kubelet, "Unhealthy")], [plugin_says(kubelet, "Healthy")]
            )
    finally:
        kubelet.stop()
    return [
        (NODE_LABEL, "device plugin: unbind -> Unhealthy in ListAndWatch", figures(downs[0])),
        (NODE_LABEL, "device plugin: bind -> Healthy in ListAndWatch", figures(ups[0])),
        (NODE_LABEL, "device plugin: events not seen within 5 s", str(missed)),
    ]


def main() -> int:
    load = os.getloadavg()[0]
    work = Path(tempfile.mkdtemp(prefix="hl-", dir="/tmp"))
    try:
        rows = dra_rows(work) + plugin_rows(work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(f"{RUNS} events each way, p50 / p99; load average {load:.2f} on {os.cpu_count()} CPUs")
    print_rows(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
