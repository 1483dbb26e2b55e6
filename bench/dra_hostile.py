"""The DRA driver against a hostile or hung API server: the driver as its own process
(`kubevirt-iommufd dra`) on a simulated 8-GPU node, the DRA kubelet stand-in calling it over gRPC,
the API server stand-in (HTTPS on loopback) told to misbehave for one claim's GET. Printed:
- the driver's RSS before, and its RSS and peak RSS after, NodePrepare of a claim whose GET
  answers a 256 MB body (once with Content-Length, once chunked), and what NodePrepare answered;
- how long NodePrepare takes to fail when the API server trickles the claim, one byte every 2 s;
- NodeUnprepare of a prepared claim while another claim's NodePrepare waits on an API server
  that never answers (measured once that GET has reached the API server, so the prepare is
  really in flight; the row says whether it was still waiting when the unprepare returned).
Run: `python -m bench.dra_hostile` from the repository root; on a shared machine, under `nice`.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from bench.benchkit import Row, peak_rss_mb, print_rows
from bench.dra_driver import DRIVER, NODE, complete_pool, ms
from sim.apiserver import (
    AllocatedDevice,
    ApiServerStandIn,
    build_resource_claim,
    running_apiserver,
)
from sim.dra_kubelet import Claim, DRAKubeletStandIn
from sim.host import build_tree, hgx_h100

HUGE = 256 * 1024 * 1024
LABEL = "8 GPUs"


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS in /proc status")


def allocated_claim(api: ApiServerStandIn, name: str, device: str) -> Claim:
    claim = api.put_claim(build_resource_claim("vms", name, ["gpu"], "vfio-gpu"))
    api.set_allocation("vms", name, [AllocatedDevice("gpu", DRIVER, NODE, device)], NODE)
    return Claim("vms", claim["metadata"]["uid"], name)


def prepare_error(kubelet: DRAKubeletStandIn, claim: Claim) -> tuple[str, float]:
    start = time.monotonic()
    answer = kubelet.node_prepare_resources([claim])[claim.uid]
    took = time.monotonic() - start
    if not answer.error:
        raise RuntimeError(f"NodePrepare of {claim.name} succeeded against a hostile API server")
    return answer.error, took


def short(error: str) -> str:
    """The error without the claim it names first (`claim ns/name (uid ...): `)."""
    return error.split("): ", 1)[-1]


def huge_rows(
    api: ApiServerStandIn, kubelet: DRAKubeletStandIn, pid: int, device: str
) -> list[Row]:
    rows = [(LABEL, "driver RSS before", f"{rss_mb(pid):.1f} MB (peak {peak_rss_mb(pid):.1f})")]
    for chunked in (False, True):
        claim = allocated_claim(api, f"huge-{'chunked' if chunked else 'length'}", device)
        api.misbehave("huge", path=f"/resourceclaims/{claim.name}", size=HUGE, chunked=chunked)
        error, took = prepare_error(kubelet, claim)
        framing = "chunked" if chunked else "Content-Length"
        rows.append((LABEL, f"256 MB claim ({framing}): answer in", f"{ms(took)} ms"))
        rows.append((LABEL, f"256 MB claim ({framing}): error", short(error)))
    rows.append((LABEL, "driver RSS after", f"{rss_mb(pid):.1f} MB (peak {peak_rss_mb(pid):.1f})"))
    return rows


def trickle_rows(api: ApiServerStandIn, kubelet: DRAKubeletStandIn, device: str) -> list[Row]:
    claim = allocated_claim(api, "trickled", device)
    api.misbehave("trickle", path=f"/resourceclaims/{claim.name}", interval=2.0)
    error, took = prepare_error(kubelet, claim)
    return [
        (LABEL, "trickled claim (1 byte / 2 s): NodePrepare fails in", f"{took:.2f} s"),
        (LABEL, "trickled claim: error", short(error)),
    ]


def hung_unprepare_rows(
    api: ApiServerStandIn, kubelet: DRAKubeletStandIn, held_device: str, other_device: str
) -> list[Row]:
    held = allocated_claim(api, "held", held_device)
    answer = kubelet.node_prepare_resources([held])[held.uid]
    if answer.error:
        raise RuntimeError(f"NodePrepare of {held.name} failed: {answer.error}")
    stuck = allocated_claim(api, "stuck", other_device)
    path = f"/resourceclaims/{stuck.name}"
    api.misbehave("hang", path=path)
    outcome: list[tuple[str, float]] = []
    preparing = threading.Thread(target=lambda: outcome.append(prepare_error(kubelet, stuck)))
    preparing.start()
    if not api.wait_until(lambda: any(path in r.path for r in api.requests), 10):
        raise RuntimeError("the driver did not GET the stuck claim within 10 s")
    start = time.monotonic()
    errors = kubelet.node_unprepare_resources([held])
    took = time.monotonic() - start
    still_waiting = preparing.is_alive()
    if errors != {held.uid: ""}:
        raise RuntimeError(f"NodeUnprepare of {held.name} failed: {errors}")
    preparing.join(60)
    state = (
        "while the other prepare still waited on the API server"
        if still_waiting
        else "after the other prepare gave up: it waited for the preparer's lock"
    )
    rows = [(LABEL, "NodeUnprepare while the API server hangs", f"{ms(took)} ms ({state})")]
    if outcome:
        error, failed_in = outcome[0]
        rows.append((LABEL, "hung claim: NodePrepare fails in", f"{failed_in:.2f} s"))
        rows.append((LABEL, "hung claim: error", short(error)))
    return rows


def main() -> int:
    work = Path(tempfile.mkdtemp(prefix="kd-hostile-", dir="/tmp"))
    rows: list[Row] = []
    try:
        root = build_tree(hgx_h100(), work / "root")
        with running_apiserver() as api, DRAKubeletStandIn(work / "kubelet") as kubelet:
            api.put_node(NODE)
            kubeconfig = api.write_kubeconfig(work / "kubeconfig")
            process = subprocess.Popen(
                [
                    sys.executable, "-m", "kubevirt_iommufd", "dra", "--node-name", NODE,
                    "--root", str(root), "--kubelet-dir", str(work / "kubelet"),
                    "--cdi-dir", str(work / "cdi"), "--state-dir", str(work / "state"),
                    "--run-dir", str(work / "run"),
                    "--kubeconfig", str(kubeconfig), "--log-level", "error",
                ],
            )  # fmt: skip
            try:
                kubelet.wait_registered(DRIVER, timeout=60)
                if not api.wait_until(lambda: complete_pool(api.slices(NODE, DRIVER)), 120):
                    raise RuntimeError("the driver did not publish its slices within 120 s")
                devices = sorted(
                    d["name"] for s in api.slices(NODE, DRIVER) for d in s["spec"]["devices"]
                )
                # One prepare and unprepare first, so the baseline has everything imported.
                warm = allocated_claim(api, "warm-up", devices[0])
                kubelet.node_prepare_resources([warm])
                kubelet.node_unprepare_resources([warm])
                rows += huge_rows(api, kubelet, process.pid, devices[0])
                rows += trickle_rows(api, kubelet, devices[0])
                rows += hung_unprepare_rows(api, kubelet, devices[0], devices[1])
            finally:
                process.terminate()
                process.wait(10)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print_rows(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
