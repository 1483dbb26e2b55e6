"""Device plugin benchmark, against the kubelet stand-in over real gRPC on unix sockets.

The plugin runs as its own process (`kubevirt-iommufd plugin`), as on a node, on a simulated
8-GPU node and on a 4,096-function node. Printed per node:
- start -> Register: from spawning the process to the kubelet seeing both registrations;
- Allocate latency p50/p99 for 1 device, 8 devices, and 1 device from 8 concurrent callers;
- re-registration after a kubelet restart (5 runs): from kubelet.sock reappearing to both
  resources registered again;
- health propagation: a device's cdev node removed -> Unhealthy in the stream, restored ->
  Healthy (iommufd device mode, where the cdev is what makes a device usable; 10 runs each);
- the plugin process's peak RSS (VmHWM).
Targets: Allocate p99 < 2 ms for 8 devices; re-registration < 100 ms p50 and < 1 s max;
health propagation < 100 ms both ways; start -> Register < 1 s; peak RSS < 60 MB.
Run: `python -m bench.plugin` (or `./dev.sh bench`).
"""

from __future__ import annotations

import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from bench.benchkit import peak_rss_mb, print_rows
from sim.host import HostSpec, build_tree, hgx_h100, scale
from sim.kubelet import KubeletStandIn

IOMMUFD = "devices.kubevirt.io/iommufd"
RESOURCE = "nvidia.com/2330"  # no pci.ids in the benchmark: the name is the device id


def percentile(values: list[float], fraction: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(fraction * (len(ordered) - 1)))]


def ms(seconds: float) -> str:
    return f"{seconds * 1000:.2f}"


def spawn_plugin(work: Path, root: Path, kubelet_dir: Path) -> subprocess.Popen[bytes]:
    """`kubevirt-iommufd plugin` as on a node, on the simulated `root`: iommufd device mode, no
    pci.ids (so `RESOURCE`), errors logged only."""
    config = work / "config.yaml"
    config.write_text(
        f"deviceMode: iommufd\npciIds: {work / 'none'}\n"
        f"iommufd: {{socketDir: {work / 'fds'}, socketOwner: {{uid: 0, gid: 0}}}}\n"
    )
    return subprocess.Popen(
        [
            sys.executable, "-m", "kubevirt_iommufd", "plugin", "--root", str(root),
            "--kubelet-dir", str(kubelet_dir), "--config", str(config), "--log-level", "error",
        ],
    )  # fmt: skip


def bench_node(label: str, spec: HostSpec) -> list[tuple[str, str, str]]:
    work = Path(tempfile.mkdtemp(prefix="kb-", dir="/tmp"))
    rows: list[tuple[str, str, str]] = []
    try:
        root = build_tree(spec, work / "root")
        kubelet = KubeletStandIn(work / "kubelet")
        kubelet.start()
        started = time.monotonic()
        process = spawn_plugin(work, root, kubelet.directory)
        try:
            kubelet.wait_registered(RESOURCE, timeout=30)
            kubelet.wait_registered(IOMMUFD, timeout=30)
            rows.append((label, "start -> Register", f"{ms(time.monotonic() - started)} ms"))
            devices = list(kubelet.health(RESOURCE))
            rows += allocate_rows(label, kubelet, devices)
            rows += restart_rows(label, kubelet)
            rows += health_rows(label, kubelet, root, devices[0])
            rows.append((label, "peak RSS", f"{peak_rss_mb(process.pid):.1f} MB"))
        finally:
            process.terminate()
            process.wait(10)
            kubelet.stop()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return rows


def timed(call: object, runs: int) -> list[float]:
    assert callable(call)
    results = []
    for _ in range(runs):
        start = time.perf_counter()
        call()
        results.append(time.perf_counter() - start)
    return results


def allocate_rows(
    label: str, kubelet: KubeletStandIn, devices: list[str]
) -> list[tuple[str, str, str]]:
    one = timed(lambda: kubelet.allocate(RESOURCE, devices[:1]), 300)
    eight = timed(lambda: kubelet.allocate(RESOURCE, devices[:8]), 300)
    with ThreadPoolExecutor(8) as pool:
        futures = [
            pool.submit(timed, lambda i=i: kubelet.allocate(RESOURCE, [devices[i]]), 100)
            for i in range(8)
        ]
        concurrent = [t for f in futures for t in f.result()]
    return [
        (label, "Allocate 1 device p50/p99", p50_p99(one)),
        (label, "Allocate 8 devices p50/p99", p50_p99(eight)),
        (label, "Allocate x8 concurrent p50/p99", p50_p99(concurrent)),
    ]


def p50_p99(values: list[float]) -> str:
    return f"{ms(percentile(values, 0.5))} / {ms(percentile(values, 0.99))} ms"


def median_max(values: list[float]) -> str:
    return f"{ms(statistics.median(values))} / {ms(max(values))} ms"


def restart_rows(label: str, kubelet: KubeletStandIn) -> list[tuple[str, str, str]]:
    times = []
    for run in range(5):
        kubelet.restart()
        restarted = time.monotonic()
        for resource in (RESOURCE, IOMMUFD):
            kubelet.wait_registered(resource, count=run + 2, timeout=10)
        times.append(max(r.at for r in kubelet.registrations[-2:]) - restarted)
    return [(label, "re-registration p50/max (5 runs)", median_max(times))]


def health_rows(
    label: str, kubelet: KubeletStandIn, root: Path, device: str
) -> list[tuple[str, str, str]]:
    node = root / "dev/vfio/devices/vfio0"
    down, up = [], []
    for _ in range(10):
        start = time.monotonic()
        node.unlink()
        kubelet.wait_for(lambda: kubelet.health(RESOURCE).get(device) == "Unhealthy", 10)
        down.append(kubelet.latest(RESOURCE).snapshots[-1][0] - start)  # type: ignore[union-attr]
        start = time.monotonic()
        node.touch()
        kubelet.wait_for(lambda: kubelet.health(RESOURCE).get(device) == "Healthy", 10)
        up.append(kubelet.latest(RESOURCE).snapshots[-1][0] - start)  # type: ignore[union-attr]
    return [
        (label, "health -> Unhealthy p50/max", median_max(down)),
        (label, "health -> Healthy p50/max", median_max(up)),
    ]


def main() -> int:
    rows = bench_node("8 GPUs", hgx_h100()) + bench_node("4,096 functions", scale(4096))
    print_rows(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
