"""The floors `bench.lean` measures our daemons against: the least a Python kubelet plugin of
each kind does, as processes of their own (`python -m bench.floor.dra`, `… .plugin`). They are
not benchmarks themselves, so `./dev.sh bench` (which runs bench/*.py) leaves them alone."""

from __future__ import annotations

import signal
import threading

import grpc


def serve_until_terminated(
    servers: list[grpc.Server], stopping: threading.Event | None = None
) -> None:
    """Keep serving until SIGTERM, then set `stopping` (ending the streams that wait on it) and
    stop every server."""
    stopping = stopping or threading.Event()
    signal.signal(signal.SIGTERM, lambda number, frame: stopping.set())
    stopping.wait()
    for server in servers:
        server.stop(0.2).wait()
