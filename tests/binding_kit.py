"""Other processes for binding-lock tests: one holding the lock, and racing `bind` and `unbind`
runs on one simulated host.

Each worker process runs the real CLI (`run_bind`/`run_unbind`, `--json`) against the kernel
simulator, with a short random pause before every sysfs write so that two runs' reads and writes
interleave the way two processes' do on a busy node. Every write is also appended to a log shared
by the workers, which tells the test whose write came last.

Both tests/cli and tests/hostdev/binding use it, so it sits in tests/ itself, on pytest's
pythonpath.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import random
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from contextlib import contextmanager, redirect_stdout
from dataclasses import dataclass
from multiprocessing.synchronize import Barrier
from pathlib import Path
from typing import Any

from kubevirt_iommufd import bind_command
from sim.kernel import KernelSimulator

HOLDER = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    from hostdev.binding.lock import hold_binding_lock
    with hold_binding_lock(Path(sys.argv[1]), 0, who=sys.argv[3]):
        print("held", flush=True)
        time.sleep(float(sys.argv[2]))
    """
)


@contextmanager
def held_elsewhere(root: Path, seconds: float, who: str) -> Iterator[subprocess.Popen[str]]:
    """Another process holding the lock for `seconds` (yields once it holds it)."""
    process = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(root), str(seconds), who],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )
    try:
        assert process.stdout is not None
        assert process.stdout.readline() == "held\n"
        yield process
    finally:
        process.kill()
        process.wait()


@dataclass
class JitteryKernel:
    """The simulator, pausing before each write and logging it as `worker path text`."""

    kernel: KernelSimulator
    log: Path
    worker: int
    rng: random.Random

    def write(self, path: Path, text: str) -> None:
        time.sleep(self.rng.uniform(0, 0.003))
        line = f"{self.worker} {path.relative_to(self.kernel.root)} {text.strip() or '-'}\n"
        fd = os.open(self.log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, line.encode())
        finally:
            os.close(fd)
        self.kernel.write(path, text)


def race_worker(
    worker: int,
    root: str,
    log: str,
    rounds: list[list[str]],
    barrier: Barrier,
    results: Any,
) -> None:
    """Run `rounds[i]` (an argv) in round i, each round starting at the barrier with the other
    worker; put (round, worker, argv, document) on `results`."""
    parser = argparse.ArgumentParser(prog="kubevirt-iommufd")
    bind_command.add_parser(parser.add_subparsers(dest="command", required=True))
    kernel = KernelSimulator(Path(root))
    for number, argv in enumerate(rounds):
        rng = random.Random(number * 2 + worker)  # noqa: S311 - timing jitter, not secrets
        writer = JitteryKernel(kernel, Path(log), worker, rng)
        args = parser.parse_args([*argv, "--root", root, "--json"])
        barrier.wait()
        time.sleep(rng.uniform(0, 0.004))
        out = io.StringIO()
        with redirect_stdout(out):
            code = args.run(args, writer=writer, runner=kernel.run)
        document = json.loads(out.getvalue()) if out.getvalue() else {"result": f"exit {code}"}
        results.put((number, worker, argv, document))
        barrier.wait()
