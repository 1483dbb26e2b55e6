"""DRA driver benchmark: the driver as its own process (`kubevirt-iommufd dra`), as on a node,
against the DRA kubelet stand-in (registration and DRAPlugin over real gRPC on unix sockets) and
the API server stand-in (HTTPS on loopback, the driver's real `kubernetes` client through a
kubeconfig), on a simulated 8-GPU node and on a 4,096-function node. Printed per node:
- start -> registered: from spawning the process to the kubelet registering the driver;
- start -> slices: from spawning the process to every slice of the pool's newest generation
  being in the API server, with the number of slices and devices;
- republish: the kubelet deletes the node's slices (as it does when it starts) -> all back
  (p50/max of 5);
- NodePrepare p50/p99 for a claim of 1 device and of 8 devices (300 each): each iteration a
  fresh claim, allocated as the scheduler would, prepared through the kubelet stand-in (the
  driver GETs the claim over HTTPS, re-reads the devices' groups, writes the CDI spec, the
  metadata files and its state record), then unprepared (NodeUnprepare p50/p99, same runs);
- the driver process's peak RSS (VmHWM).
The machine's pci.ids is used, as the image has it. CDI specs go to tmpfs (/dev/shm), as
/var/run/cdi is on a node, and so does the run directory with the metadata files; the state
directory stays on disk, where each atomic write is two fsyncs. Run: `python -m bench.dra_driver`
(or `./dev.sh bench`); on a shared machine, under `nice`.
"""

from __future__ import annotations

import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from bench.benchkit import peak_rss_mb, print_rows
from sim.apiserver import (
    AllocatedDevice,
    ApiServerStandIn,
    build_resource_claim,
    running_apiserver,
)
from sim.dra_kubelet import Claim, DRAKubeletStandIn
from sim.host import HostSpec, build_tree, hgx_h100, scale

DRIVER = "vfio.kubevirt-iommufd.io"
NODE = "bench-node"
RUNS = 300
Row = tuple[str, str, str]
T = TypeVar("T")


def percentile(values: list[float], fraction: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(fraction * (len(ordered) - 1)))]


def ms(seconds: float) -> str:
    return f"{seconds * 1000:.2f}"


def p50_p99(values: list[float]) -> str:
    return f"{ms(percentile(values, 0.5))} / {ms(percentile(values, 0.99))} ms"


def complete_pool(slices: list[dict[str, Any]]) -> bool:
    """Every slice of the newest generation present, as the scheduler waits for."""
    if not slices:
        return False
    pools = [s["spec"]["pool"] for s in slices]
    newest = max(p["generation"] for p in pools)
    current = [p for p in pools if p["generation"] == newest]
    return bool(len(current) == len(pools) == current[0]["resourceSliceCount"])


def bench_node(label: str, spec: HostSpec) -> list[Row]:
    work = Path(tempfile.mkdtemp(prefix="kd-", dir="/tmp"))
    shm = Path("/dev/shm")  # noqa: S108 - a private mkdtemp directory in it, removed after
    cdi = Path(tempfile.mkdtemp(prefix="kd-cdi-", dir=shm if shm.is_dir() else work))
    rows: list[Row] = []
    try:
        root = build_tree(spec, work / "root")
        with running_apiserver() as api, DRAKubeletStandIn(work / "kubelet") as kubelet:
            api.put_node(NODE)
            kubeconfig = api.write_kubeconfig(work / "kubeconfig")
            started = time.monotonic()
            process = subprocess.Popen(
                [
                    sys.executable, "-m", "kubevirt_iommufd", "dra", "--node-name", NODE,
                    "--root", str(root), "--kubelet-dir", str(work / "kubelet"),
                    "--cdi-dir", str(cdi), "--state-dir", str(work / "state"),
                    "--run-dir", str(cdi / "run"),
                    "--kubeconfig", str(kubeconfig), "--log-level", "error",
                ],
            )  # fmt: skip
            try:
                kubelet.wait_registered(DRIVER, timeout=60)
                rows.append((label, "start -> registered", f"{ms(time.monotonic() - started)} ms"))
                if not api.wait_until(lambda: complete_pool(api.slices(NODE, DRIVER)), 120):
                    raise RuntimeError("the driver did not publish its slices within 120 s")
                published = time.monotonic() - started
                slices = api.slices(NODE, DRIVER)
                devices = [d["name"] for s in slices for d in s["spec"]["devices"]]
                rows.append(
                    (
                        label,
                        "start -> all slices in the API server",
                        f"{ms(published)} ms ({len(slices)} slices, {len(devices)} devices)",
                    )
                )
                rows.append((label, "republish after slices deleted p50/max", republish(api)))
                rows += prepare_rows(label, api, kubelet, devices)
                rows.append((label, "peak RSS", f"{peak_rss_mb(process.pid):.1f} MB"))
            finally:
                process.terminate()
                process.wait(10)
    finally:
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(cdi, ignore_errors=True)
    return rows


def republish(api: ApiServerStandIn) -> str:
    times = []
    for _ in range(5):
        start = time.monotonic()
        api.delete_slices(NODE, DRIVER)
        if not api.wait_until(lambda: complete_pool(api.slices(NODE, DRIVER)), 60):
            raise RuntimeError("the driver did not publish its slices again within 60 s")
        times.append(time.monotonic() - start)
    return f"{ms(statistics.median(times))} / {ms(max(times))} ms"


def prepare_rows(
    label: str, api: ApiServerStandIn, kubelet: DRAKubeletStandIn, devices: list[str]
) -> list[Row]:
    # Eight devices in eight IOMMU groups, as eight GPUs would be (the 4,096-function node has
    # eight functions per group).
    spread = devices[:: max(1, len(devices) // 8)][:8]
    rows: list[Row] = []
    for size, chosen in ((1, spread[:1]), (8, spread)):
        prepare, unprepare = timed_claims(api, kubelet, chosen, size)
        rows.append((label, f"NodePrepare {size} device(s) p50/p99", p50_p99(prepare)))
        rows.append((label, f"NodeUnprepare {size} device(s) p50/p99", p50_p99(unprepare)))
    return rows


def timed_claims(
    api: ApiServerStandIn, kubelet: DRAKubeletStandIn, devices: list[str], size: int
) -> tuple[list[float], list[float]]:
    requests = [f"gpu{i}" for i in range(len(devices))]
    prepare: list[float] = []
    unprepare: list[float] = []
    for run in range(RUNS):
        name = f"claim-{size}-{run}"
        claim = api.put_claim(build_resource_claim("vms", name, requests, "vfio-gpu"))
        api.set_allocation(
            "vms",
            name,
            [AllocatedDevice(r, DRIVER, NODE, d) for r, d in zip(requests, devices, strict=True)],
            node_name=NODE,
        )
        refs = [Claim("vms", claim["metadata"]["uid"], name)]
        answer = timed(kubelet.node_prepare_resources, refs, prepare)[refs[0].uid]
        if answer.error or len(answer.devices) != size:
            raise RuntimeError(f"NodePrepare of {name} failed: {answer}")
        errors = timed(kubelet.node_unprepare_resources, refs, unprepare)
        if errors != {refs[0].uid: ""}:
            raise RuntimeError(f"NodeUnprepare of {name} failed: {errors}")
    return prepare, unprepare


def timed(call: Callable[[list[Claim]], T], claims: list[Claim], into: list[float]) -> T:
    start = time.perf_counter()
    result = call(claims)
    into.append(time.perf_counter() - start)
    return result


def main() -> int:
    rows = bench_node("8 GPUs", hgx_h100()) + bench_node("4,096 functions", scale(4096))
    print_rows(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
