"""Lean daemons: our DRA driver and device plugin against the least a Python plugin of each kind
does (`bench.floor.dra`, `bench.floor.plugin`), in the same run, in alternating rounds.

Each daemon runs as its own process, as on a node, against the kubelet stand-ins over real gRPC
on unix sockets (`sim.dra_kubelet`, `sim.kubelet`) and, for DRA, the API server stand-in over
HTTPS (the claim GET through the official `kubernetes` client's configuration and pool). Two
simulated nodes: 8 GPUs on vfio-pci with 200 other functions on host drivers, and 4,096 functions
on vfio-pci. Per node, ROUNDS rounds, ours and the floor taking turns to go first; each figure is
the median over the rounds of:
- exec -> GetInfo answered (DRA): spawning the process to the kubelet registering the driver;
  exec -> Register (device plugin): to the kubelet holding both resources' registrations;
- NodePrepare p50/p99 and NodeUnprepare p50 over CYCLES prepare/unprepare cycles of a fresh
  one-device claim each, timed at the kubelet stand-in;
- CPU per cycle: the process's user+system time (/proc/<pid>/stat) over those cycles / CYCLES;
- idle RSS (VmRSS) after start and one cycle (device plugin: one Allocate), once it is quiet;
- ours only: exec -> every slice of the pool in the API server.
Before the rounds each daemon starts once uncounted, so that none is measured reading its
bytecode from disk while the other finds it in the page cache.
Targets (PASS/FAIL): DRA exec->GetInfo <= 1.2x the floor, NodePrepare p50 and CPU per cycle
<= 1.5x, idle RSS <= 1.3x (on the 8-GPU node); on 4,096 functions NodePrepare p99 < 50 ms and
slices < 1 s; device plugin exec->Register and RSS <= 1.2x its floor (both nodes).
CDI specs go to tmpfs (/dev/shm), as /var/run/cdi is on a node, and so does our run directory
(metadata files, unprepared marks; the floor has none); state stays on disk. Both
daemons run from compiled bytecode, as on a node (the image's `pip install` compiles every
module): the project's and the floor's sources are compiled once into a cache of this run
(PYTHONPYCACHEPREFIX), whatever PYTHONDONTWRITEBYTECODE says, so neither pays the compiler at
each start (about 80 ms of CPU for ours, 20 ms for the floor, before this).
Run: `python -m bench.lean [--rounds N] [--cycles N] [--only dra|plugin] [--node gpus|4096]`
(or `./dev.sh bench`).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from bench.benchkit import cpu_seconds, rss_mb
from bench.dra_driver import DRIVER, NODE, complete_pool, percentile
from dra.devices import PCI_BUS_ID
from sim.apiserver import AllocatedDevice, ApiServerStandIn, build_resource_claim, running_apiserver
from sim.apiserver_rules import RESOURCE_SLICES
from sim.dra_kubelet import Claim, DRAKubeletStandIn
from sim.host import CLASS_ETHERNET, FunctionSpec, HostSpec, build_tree, hgx_h100, scale
from sim.kubelet import KubeletStandIn

ROUNDS = 5
CYCLES = 200
QUIET_SECONDS = 0.5
"""Waited after the warm-up cycle before reading the idle RSS: what it started settles."""
OURS, FLOOR = "ours", "floor"
Figures = dict[str, list[float]]


@dataclass(frozen=True)
class Target:
    figure: str
    limit: float
    ratio: bool
    """A ratio of ours to the floor, else an absolute figure of ours."""


@dataclass
class Node:
    label: str
    spec: Callable[[], HostSpec]
    dra_targets: tuple[Target, ...]
    plugin_targets: tuple[Target, ...]
    figures: dict[tuple[str, str], Figures] = field(default_factory=dict)
    """By (daemon, ours or floor): each figure's value in each round."""

    def add(self, daemon: str, kind: str, name: str, value: float) -> None:
        self.figures.setdefault((daemon, kind), {}).setdefault(name, []).append(value)


EXEC_GETINFO = "exec -> GetInfo answered (ms)"
PREPARE_P50 = "NodePrepare p50 (ms)"
PREPARE_P99 = "NodePrepare p99 (ms)"
UNPREPARE_P50 = "NodeUnprepare p50 (ms)"
CPU_CYCLE = "CPU per prepare+unprepare (ms)"
RSS_IDLE = "RSS idle (MB)"
SLICES = "exec -> all slices in the API server (ms)"
EXEC_REGISTER = "exec -> Register (ms)"
PLUGIN_TARGETS = (Target(EXEC_REGISTER, 1.2, True), Target(RSS_IDLE, 1.2, True))


def gpus_and_others(others: int = 200) -> HostSpec:
    """The 8-GPU node with `others` functions on a host driver, each in a group of its own."""
    spec = hgx_h100()
    functions = tuple(
        FunctionSpec(
            f"0000:{0xC0 + index // 32:02x}:{index % 32:02x}.0",
            0x8086,
            0x10FB,
            CLASS_ETHERNET,
            driver="ixgbe",
            group=100 + index,
            numa_node=1,
        )
        for index in range(others)
    )
    return replace(spec, functions=spec.functions + functions)


PACKAGES = (
    "kubevirt_iommufd",
    "hostdev",
    "deviceplugin",
    "dra",
    "webhook",
    "launcher_hook",
    "bench",
)


def compiled_bytecode() -> dict[str, str]:
    """The environment that runs a daemon from bytecode compiled once into this run's cache."""
    cache = tempfile.mkdtemp(prefix="kl-pyc-", dir="/tmp")
    env = {key: value for key, value in os.environ.items() if key != "PYTHONDONTWRITEBYTECODE"}
    env["PYTHONPYCACHEPREFIX"] = cache
    repo = Path(__file__).resolve().parents[1]
    subprocess.run(
        [sys.executable, "-m", "compileall", "-q", *(str(repo / p) for p in PACKAGES)],
        env=env,
        check=True,
    )
    return env


BYTECODE_ENV: dict[str, str] = {}


@contextmanager
def spawned(command: list[str]) -> Iterator[tuple[subprocess.Popen[bytes], float]]:
    started = time.monotonic()
    process = subprocess.Popen(command, env=BYTECODE_ENV or None)
    try:
        yield process, started
    finally:
        process.terminate()
        process.wait(10)


def dra_round(
    node: Node, kind: str, root: Path, api: ApiServerStandIn, devices: list[str], cycles: int
) -> list[str]:
    """One run of a DRA plugin; the names of the devices it may be given (ours publishes them)."""
    work = Path(tempfile.mkdtemp(prefix="kl-", dir="/tmp"))
    cdi = Path(tempfile.mkdtemp(prefix="kl-cdi-", dir=_tmpfs(work)))
    kubeconfig = api.write_kubeconfig(work / "kubeconfig")
    common = ["--kubelet-dir", str(work / "kubelet"), "--cdi-dir", str(cdi)]
    common += ["--state-dir", str(work / "state"), "--kubeconfig", str(kubeconfig)]
    run = ["--run-dir", str(cdi / "run")]
    since = 0
    if kind == OURS:
        api.delete_slices(NODE, DRIVER)
        since = api.store.revision
        command = [sys.executable, "-m", "kubevirt_iommufd", "dra", "--node-name", NODE]
        command += ["--root", str(root), "--log-level", "error", *common, *run]
    else:
        command = [sys.executable, "-m", "bench.floor.dra", "--driver", DRIVER, *common]
    try:
        with (
            DRAKubeletStandIn(work / "kubelet") as kubelet,
            spawned(command) as (process, started),
        ):
            registered = kubelet.wait_registered(DRIVER, timeout=60)
            node.add("dra", kind, EXEC_GETINFO, (registered.at - started) * 1000)
            if kind == OURS:
                if not wait_complete_pool(api, since, 120):
                    raise RuntimeError("the driver did not publish its slices within 120 s")
                node.add("dra", kind, SLICES, (time.monotonic() - started) * 1000)
                slices = api.slices(NODE, DRIVER)
                # PCI functions only: the pool also has the node's iommufd slots, which a stride
                # over all of them would mostly pick.
                published = [
                    d["name"]
                    for s in slices
                    for d in s["spec"]["devices"]
                    if PCI_BUS_ID in d.get("attributes", {})
                ]
                # Eight devices in eight IOMMU groups, as eight GPUs would be.
                devices = published[:: max(1, len(published) // 8)][:8]
            prepare_cycle(api, kubelet, f"{kind}-warm-{time.monotonic_ns()}", devices[0])
            time.sleep(QUIET_SECONDS)
            node.add("dra", kind, RSS_IDLE, rss_mb(process.pid))
            prepare: list[float] = []
            unprepare: list[float] = []
            cpu = cpu_seconds(process.pid)
            for cycle in range(cycles):
                name = f"{kind}-{time.monotonic_ns()}-{cycle}"
                times = prepare_cycle(api, kubelet, name, devices[cycle % len(devices)])
                prepare.append(times[0])
                unprepare.append(times[1])
            node.add("dra", kind, CPU_CYCLE, (cpu_seconds(process.pid) - cpu) / cycles * 1000)
            node.add("dra", kind, PREPARE_P50, percentile(prepare, 0.5) * 1000)
            node.add("dra", kind, PREPARE_P99, percentile(prepare, 0.99) * 1000)
            node.add("dra", kind, UNPREPARE_P50, percentile(unprepare, 0.5) * 1000)
    finally:
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(cdi, ignore_errors=True)
    return devices


def wait_complete_pool(api: ApiServerStandIn, since: int, timeout: float) -> bool:
    """Wait until every slice of the newest generation of the node's pool is in the API server,
    following the slices' events written after revision `since`: the objects as stored, not
    copied. Listing the slices after every write instead copied the whole pool each time, in
    the process of the stand-in taking the driver's writes, and so took their time (0.6-0.8 s of
    exec -> all slices on 4,096 functions)."""
    deadline = time.monotonic() + timeout
    held: dict[str, dict[str, Any]] = {}
    while time.monotonic() < deadline:
        events, since = api.store.events_after(RESOURCE_SLICES, since)
        for event in events:
            spec = event.object.get("spec") or {}
            if spec.get("nodeName") != NODE or spec.get("driver") != DRIVER:
                continue
            name = event.object["metadata"]["name"]
            if event.type == "DELETED":
                held.pop(name, None)
            else:
                held[name] = event.object
        if complete_pool(list(held.values())):
            return True
        api.store.wait(since, min(deadline, time.monotonic() + 0.1), lambda: False)
    return False


def prepare_cycle(
    api: ApiServerStandIn, kubelet: DRAKubeletStandIn, name: str, device: str
) -> tuple[float, float]:
    """A fresh claim for `device`, allocated as the scheduler would, prepared and unprepared
    through the kubelet stand-in; the two calls' times."""
    claim = api.put_claim(build_resource_claim("vms", name, ["gpu"], "vfio-gpu"))
    api.set_allocation("vms", name, [AllocatedDevice("gpu", DRIVER, NODE, device)], node_name=NODE)
    refs = [Claim("vms", claim["metadata"]["uid"], name)]
    start = time.perf_counter()
    answer = kubelet.node_prepare_resources(refs)[refs[0].uid]
    prepared = time.perf_counter()
    if answer.error or len(answer.devices) != 1:
        raise RuntimeError(f"NodePrepare of {name} failed: {answer}")
    errors = kubelet.node_unprepare_resources(refs)
    unprepared = time.perf_counter()
    if errors != {refs[0].uid: ""}:
        raise RuntimeError(f"NodeUnprepare of {name} failed: {errors}")
    api.delete("ResourceClaim", name, "vms")
    return prepared - start, unprepared - prepared


def plugin_round(node: Node, kind: str, root: Path) -> None:
    work = Path(tempfile.mkdtemp(prefix="kl-", dir="/tmp"))
    kubelet = KubeletStandIn(work / "kubelet")
    common = ["--root", str(root), "--kubelet-dir", str(kubelet.directory)]
    if kind == OURS:
        config = work / "config.yaml"
        config.write_text(
            f"deviceMode: iommufd\npciIds: {work / 'none'}\n"
            f"iommufd: {{socketDir: {work / 'fds'}, socketOwner: {{uid: 0, gid: 0}}}}\n"
        )
        command = [sys.executable, "-m", "kubevirt_iommufd", "plugin", *common]
        command += ["--config", str(config), "--log-level", "error"]
    else:
        command = [sys.executable, "-m", "bench.floor.plugin", *common]
    kubelet.start()
    try:
        with spawned(command) as (process, started):
            kubelet.wait_for(lambda: _listed(kubelet) >= 2 or _exited(process), 60)
            if _exited(process):
                raise RuntimeError(f"{command} exited with {process.returncode}")
            registered = max(r.at for r in kubelet.registrations)
            node.add("plugin", kind, EXEC_REGISTER, (registered - started) * 1000)
            gpus = next(
                r for r in kubelet.registrations if "iommufd" not in r.request.resource_name
            )
            kubelet.allocate(gpus.request.resource_name, list(gpus.snapshots[-1][1])[:1])
            time.sleep(QUIET_SECONDS)
            node.add("plugin", kind, RSS_IDLE, rss_mb(process.pid))
    finally:
        kubelet.stop()
        shutil.rmtree(work, ignore_errors=True)


def _listed(kubelet: KubeletStandIn) -> int:
    """Registrations whose device list has come."""
    return sum(1 for r in kubelet.registrations if r.snapshots)


def _exited(process: subprocess.Popen[bytes]) -> bool:
    return process.poll() is not None


def _tmpfs(fallback: Path) -> Path:
    shm = Path("/dev/shm")  # noqa: S108 - a private mkdtemp directory in it, removed after
    return shm if shm.is_dir() else fallback


def bench_node(node: Node, daemons: list[str], rounds: int, cycles: int) -> None:
    work = Path(tempfile.mkdtemp(prefix="kl-root-", dir="/tmp"))
    try:
        root = build_tree(node.spec(), work / "root")
        # One start of each, not counted: the first start of a process reads its modules'
        # bytecode from disk and the second finds it in the page cache, so without this the one
        # that went first in the first round paid for both.
        scratch = replace(node, figures={})
        if "plugin" in daemons:
            for kind in (OURS, FLOOR):
                plugin_round(scratch, kind, root)
            for number in range(rounds):
                for kind in _turns(number):
                    plugin_round(node, kind, root)
        if "dra" in daemons:
            with running_apiserver() as api:
                api.put_node(NODE)
                devices: list[str] = []
                for kind in (OURS, FLOOR):
                    devices = dra_round(scratch, kind, root, api, devices, 1)
                for number in range(rounds):
                    for kind in _turns(number):
                        devices = dra_round(node, kind, root, api, devices, cycles)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _turns(number: int) -> tuple[str, str]:
    """Ours first in even rounds (the first one too: it names the devices), the floor in odd."""
    return (OURS, FLOOR) if number % 2 == 0 else (FLOOR, OURS)


def report(node: Node) -> list[tuple[str, str, str, str, str, str]]:
    """One line per figure: node, figure, ours, floor, ratio, verdict."""
    lines = []
    for daemon, targets in (("dra", node.dra_targets), ("plugin", node.plugin_targets)):
        ours = node.figures.get((daemon, OURS), {})
        floor = node.figures.get((daemon, FLOOR), {})
        for name, values in ours.items():
            mine = statistics.median(values)
            theirs = statistics.median(floor[name]) if name in floor else None
            ratio = mine / theirs if theirs else None
            verdict = ""
            for target in targets:
                if target.figure != name:
                    continue
                measured = ratio if target.ratio else mine
                bound = (
                    f"{'<=' if target.ratio else '<'} {target.limit:g}{'x' if target.ratio else ''}"
                )
                held = measured is not None and (
                    measured <= target.limit if target.ratio else measured < target.limit
                )
                verdict = f"{'PASS' if held else 'FAIL'} ({bound})"
            lines.append(
                (
                    node.label,
                    f"{'DRA' if daemon == 'dra' else 'device plugin'}: {name}",
                    f"{mine:.1f}",
                    "-" if theirs is None else f"{theirs:.1f}",
                    "-" if ratio is None else f"{ratio:.2f}x",
                    verdict,
                )
            )
    return lines


def print_report(lines: list[tuple[str, str, str, str, str, str]]) -> None:
    header = ("node", "figure", "ours", "floor", "ratio", "target")
    widths = [max(len(row[i]) for row in (header, *lines)) for i in range(6)]
    for row in (header, *lines):
        print("  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)))


def main() -> int:
    parser = argparse.ArgumentParser(prog="bench.lean", description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=ROUNDS)
    parser.add_argument("--cycles", type=int, default=CYCLES)
    parser.add_argument("--only", choices=["dra", "plugin"])
    parser.add_argument("--node", choices=["gpus", "4096"], help="one of the two nodes only")
    args = parser.parse_args()
    BYTECODE_ENV.update(compiled_bytecode())
    daemons = [args.only] if args.only else ["plugin", "dra"]
    nodes = [
        Node(
            "8 GPUs + 200",
            gpus_and_others,
            (
                Target(EXEC_GETINFO, 1.2, True),
                Target(PREPARE_P50, 1.5, True),
                Target(CPU_CYCLE, 1.5, True),
                Target(RSS_IDLE, 1.3, True),
            ),
            PLUGIN_TARGETS,
        ),
        Node(
            "4,096 functions",
            lambda: scale(4096),
            (Target(PREPARE_P99, 50.0, False), Target(SLICES, 1000.0, False)),
            PLUGIN_TARGETS,
        ),
    ]
    if args.node:
        nodes = nodes[:1] if args.node == "gpus" else nodes[1:]
    for node in nodes:
        bench_node(node, daemons, args.rounds, args.cycles)
    print(f"medians of {args.rounds} alternating rounds, {args.cycles} cycles each")
    print_report([line for node in nodes for line in report(node)])
    return 0


if __name__ == "__main__":
    sys.exit(main())
