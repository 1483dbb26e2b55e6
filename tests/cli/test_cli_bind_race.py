"""Two `bind`/`unbind` runs on one device at the same time, as separate processes: the binding
lock makes them take turns, so the host always ends as the run that wrote last reported."""

from __future__ import annotations

import multiprocessing
from pathlib import Path
from typing import Any

from binding_kit import race_worker
from sim.host import BuildHost, FunctionSpec, HostSpec
from sim.kernel import KernelSimulator

DEVICE = "0000:00:04.0"
ROUNDS = 24
# What each run reports having left: bind puts the device on vfio-pci with the override set (so
# a reprobe keeps it there), unbind on no driver with the override cleared.
REPORTED_END = {"bind": ("vfio-pci", "vfio-pci"), "unbind": (None, None)}


def edu_host() -> HostSpec:
    return HostSpec((FunctionSpec(DEVICE, 0x1234, 0x11E8, 0x00FF00, group=4),))


def test_racing_bind_and_unbind_always_end_as_the_last_writer_reported(
    build_host: BuildHost, tmp_path: Path
) -> None:
    root = build_host(edu_host())
    log = tmp_path / "writes.log"
    # Worker 0 binds and worker 1 unbinds in even rounds, the other way round in odd ones;
    # --wait covers waiting for the other run.
    bind, unbind = ["bind", DEVICE, "--wait", "20"], ["unbind", DEVICE, "--wait", "20"]
    plans = [[bind if n % 2 == w else unbind for n in range(ROUNDS)] for w in range(2)]
    context = multiprocessing.get_context("spawn")
    barrier = context.Barrier(3, timeout=60)
    results: Any = context.Queue()
    workers = [
        context.Process(
            target=race_worker, args=(w, str(root), str(log), plans[w], barrier, results)
        )
        for w in range(2)
    ]
    for worker in workers:
        worker.start()
    kernel = KernelSimulator(root)
    problems: list[str] = []
    try:
        for number in range(ROUNDS):
            log.write_text("")
            before = (kernel.driver(DEVICE), kernel.override(DEVICE))
            barrier.wait()
            barrier.wait()
            reports = {}
            for _ in range(2):
                _, worker_index, argv, document = results.get(timeout=60)
                reports[worker_index] = (argv[0], document["result"])
            state = (kernel.driver(DEVICE), kernel.override(DEVICE))
            writers = [int(line.split()[0]) for line in log.read_text().splitlines()]
            for action, result in reports.values():
                if result not in ("done", "nothing-to-do"):
                    problems.append(f"round {number}: {action} ended {result}")
            expected = REPORTED_END[reports[writers[-1]][0]] if writers else before
            if state != expected:
                problems.append(
                    f"round {number}: host left at {state} from {before}, but the last writer"
                    f" reported {reports[writers[-1]] if writers else 'nothing'}"
                    f" (reports: {reports})"
                )
    finally:
        for worker in workers:
            worker.join(timeout=60)
            if worker.is_alive():
                worker.kill()
    assert problems == [], "\n".join(problems)
    assert [w.exitcode for w in workers] == [0, 0]
