"""Benchmark the mutating webhook over loopback HTTPS with keep-alive clients.

Run: .venv/bin/python bench/webhook.py  (about 25 s; loopback only; needs trustme and PyYAML)

The server runs as `kubevirt-iommufd webhook` in its own process, pinned to one CPU when there
are two or more; the clients are separate processes on the other CPUs, so Python's cost of
generating load is not charged to the server. Each request is an AdmissionReview for the GPU
launcher pod of the test data (tests/webhook/data/pod-gpu.yaml), which the webhook patches.

Scenarios: closed loops with 1 and 16 connections (throughput, latency under saturation), and an
open loop paced at 500 requests/s over 4 connections, where latency is measured from each
request's scheduled time so a stalled server cannot hide its queue (no coordinated omission).
"""

from __future__ import annotations

import http.client
import json
import multiprocessing
import os
import socket
import ssl
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import trustme
import yaml

ROOT = Path(__file__).resolve().parent.parent
POD = ROOT / "tests" / "webhook" / "data" / "pod-gpu.yaml"
# The subcommand on a parser of its own, as kubevirt_iommufd.cli registers it.
RUN_WEBHOOK = (
    "import argparse, sys\n"
    "from webhook import command\n"
    "parser = argparse.ArgumentParser(prog='kubevirt-iommufd')\n"
    "command.add_parser(parser.add_subparsers(dest='command', required=True))\n"
    "args = parser.parse_args(sys.argv[1:])\n"
    "sys.exit(args.run(args))\n"
)
DURATION = 5.0
WARMUP = 0.5
PACED_RATE = 500
PACED_CLIENTS = 4
TARGET_THROUGHPUT = 1500
TARGET_P99_MS = 5.0


@dataclass(frozen=True)
class Target:
    port: int
    cafile: str
    request: bytes


@dataclass(frozen=True)
class Result:
    name: str
    clients: int
    requests: int
    seconds: float
    latencies: list[float]
    server_cpu: float

    def percentile(self, q: float) -> float:
        ordered = sorted(self.latencies)
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1000


def main() -> int:
    cpus = sorted(os.sched_getaffinity(0))
    server_cpus, client_cpus = (
        ({cpus[0]}, set(cpus[1:])) if len(cpus) > 1 else (set(cpus), set(cpus))
    )
    with tempfile.TemporaryDirectory(prefix="webhook-bench-") as tmp:
        target, server = _start_server(Path(tmp), server_cpus)
        try:
            tls_version = _tls_version(target)
            results = [
                _run("closed loop", 1, target, client_cpus, server.pid, _closed_loop),
                _run("closed loop", 16, target, client_cpus, server.pid, _closed_loop),
                _run(
                    f"paced {PACED_RATE}/s", PACED_CLIENTS, target, client_cpus, server.pid, _paced
                ),
            ]
        finally:
            server.terminate()
            server.wait(timeout=10)
    review_size = len(target.request.partition(b"\r\n\r\n")[2])
    print(
        f"webhook benchmark: AdmissionReview of {review_size} bytes (launcher pod"
        f" {POD.name}), keep-alive HTTPS on loopback, TLS {tls_version}, server on CPU"
        f" {sorted(server_cpus)}, clients on CPU {sorted(client_cpus)}, {DURATION:.0f} s each"
    )
    print(_table(results))
    closed = max(r.requests / r.seconds for r in results if r.name == "closed loop")
    paced = results[-1].percentile(0.99)
    print(
        f"targets: >= {TARGET_THROUGHPUT} admissions/s on one core: {closed:.0f}"
        f" {'ok' if closed >= TARGET_THROUGHPUT else 'MISSED'};"
        f" p99 < {TARGET_P99_MS} ms at {PACED_RATE}/s: {paced:.2f} ms"
        f" {'ok' if paced < TARGET_P99_MS else 'MISSED'}"
    )
    return 0


def _start_server(tmp: Path, cpus: set[int]) -> tuple[Target, subprocess.Popen[bytes]]:
    ca = trustme.CA()
    leaf = ca.issue_cert("127.0.0.1")
    cert, key, cafile = tmp / "tls.crt", tmp / "tls.key", tmp / "ca.crt"
    cert.write_bytes(b"".join(pem.bytes() for pem in leaf.cert_chain_pems))
    key.write_bytes(leaf.private_key_pem.bytes())
    cafile.write_bytes(ca.cert_pem.bytes())
    port, health = _free_port(), _free_port()
    server = subprocess.Popen(
        [
            sys.executable,
            "-c",
            RUN_WEBHOOK,
            "webhook",
            "--cert",
            str(cert),
            "--key",
            str(key),
            "--port",
            str(port),
            "--health-port",
            str(health),
        ],
        cwd=ROOT,
        stderr=subprocess.DEVNULL,
    )
    os.sched_setaffinity(server.pid, cpus)
    deadline = time.monotonic() + 20
    while not _ready(health):
        if server.poll() is not None or time.monotonic() > deadline:
            raise SystemExit("the webhook did not start; run the command by hand to see why")
        time.sleep(0.05)
    return Target(port, str(cafile), _request(port)), server


def _request(port: int) -> bytes:
    pod = yaml.safe_load(POD.read_text())
    review = {
        "apiVersion": "admission.k8s.io/v1",
        "kind": "AdmissionReview",
        "request": {
            "uid": str(uuid.uuid4()),
            "kind": {"group": "", "version": "v1", "kind": "Pod"},
            "resource": {"group": "", "version": "v1", "resource": "pods"},
            "requestKind": {"group": "", "version": "v1", "kind": "Pod"},
            "requestResource": {"group": "", "version": "v1", "resource": "pods"},
            "namespace": pod["metadata"]["namespace"],
            "operation": "CREATE",
            "userInfo": {
                "username": "system:serviceaccount:kubevirt:kubevirt-controller",
                "uid": "4d2c1e8f-0b7a-4f6e-9c3d-8a5b2e1f7c60",
                "groups": ["system:serviceaccounts", "system:authenticated"],
            },
            "object": pod,
            "oldObject": None,
            "dryRun": False,
            "options": {"apiVersion": "meta.k8s.io/v1", "kind": "CreateOptions"},
        },
    }
    body = json.dumps(review).encode()
    head = (
        f"POST /mutate-pod?timeout=10s HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
        f"Content-Type: application/json\r\nAccept: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    )
    return head.encode() + body


Worker = Callable[[Target, int, int, float, "multiprocessing.Queue[Any]"], None]


def _run(
    name: str, clients: int, target: Target, cpus: set[int], server_pid: int, worker: Worker
) -> Result:
    queue: multiprocessing.Queue[Any] = multiprocessing.Queue()
    start = time.time() + WARMUP + 0.3 + 0.02 * clients  # time for every worker to connect
    processes = [
        multiprocessing.Process(
            target=_pinned, args=(cpus, worker, target, i, clients, start, queue)
        )
        for i in range(clients)
    ]
    for process in processes:
        process.start()
    time.sleep(max(0.0, start + WARMUP - time.time()))
    cpu_before = _cpu_seconds(server_pid)
    latencies: list[float] = []
    for _ in processes:
        latencies += queue.get(timeout=DURATION + 30)
    cpu = _cpu_seconds(server_pid) - cpu_before
    for process in processes:
        process.join(timeout=10)
    return Result(name, clients, len(latencies), DURATION, latencies, cpu / DURATION)


def _pinned(cpus: set[int], worker: Worker, *args: Any) -> None:
    os.sched_setaffinity(0, cpus)
    worker(*args)


def _closed_loop(
    target: Target, index: int, clients: int, start: float, queue: multiprocessing.Queue[Any]
) -> None:
    sock, buffer = _connect(target), bytearray()
    while time.time() < start:  # warm up: the connection, the server's caches, ours
        buffer = _exchange(sock, target.request, buffer)
    measured_from, end = start + WARMUP, start + WARMUP + DURATION
    latencies: list[float] = []
    while (now := time.time()) < end:
        began = time.perf_counter()
        buffer = _exchange(sock, target.request, buffer)
        if now >= measured_from:
            latencies.append(time.perf_counter() - began)
    sock.close()
    queue.put(latencies)


def _paced(
    target: Target, index: int, clients: int, start: float, queue: multiprocessing.Queue[Any]
) -> None:
    sock, buffer = _connect(target), bytearray()
    while time.time() < start:
        buffer = _exchange(sock, target.request, buffer)
        time.sleep(0.01)
    interval = clients / PACED_RATE
    first = start + WARMUP + index / PACED_RATE  # the clients' sends interleave evenly
    latencies: list[float] = []
    for n in range(int(DURATION / interval)):
        scheduled = first + n * interval
        delay = scheduled - time.time()
        if delay > 0:
            time.sleep(delay)
        buffer = _exchange(sock, target.request, buffer)
        latencies.append(time.time() - scheduled)
    sock.close()
    queue.put(latencies)


def _connect(target: Target) -> ssl.SSLSocket:
    context = ssl.create_default_context(cafile=target.cafile)
    raw = socket.create_connection(("127.0.0.1", target.port), timeout=10)
    raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return context.wrap_socket(raw, server_hostname="127.0.0.1")


def _exchange(sock: ssl.SSLSocket, request: bytes, buffer: bytearray) -> bytearray:
    """Send one request, read its response; return bytes already read past it (none, normally)."""
    sock.sendall(request)
    while (end := buffer.find(b"\r\n\r\n")) < 0:
        buffer += _recv(sock)
    head = bytes(buffer[:end]).lower()
    if not head.startswith(b"http/1.1 200"):
        raise SystemExit(f"unexpected answer: {head[:200]!r}")
    length = int(head.partition(b"content-length:")[2].split(b"\r\n")[0])
    total = end + 4 + length
    while len(buffer) < total:
        buffer += _recv(sock)
    if b'"patch"' not in buffer[end:total]:
        raise SystemExit("the webhook answered without a patch; the benchmark pod needs one")
    return buffer[total:]


def _recv(sock: ssl.SSLSocket) -> bytes:
    data = sock.recv(65536)
    if not data:
        raise SystemExit("the webhook closed a keep-alive connection")
    return data


def _ready(port: int) -> bool:
    try:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=1)
        conn.request("GET", "/readyz")
        return conn.getresponse().status == 200
    except OSError:
        return False


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _tls_version(target: Target) -> str:
    sock = _connect(target)
    version = sock.version() or "?"
    sock.close()
    return version


def _table(results: list[Result]) -> str:
    rows = [
        ("scenario", "clients", "requests", "adm/s", "p50 ms", "p99 ms", "max ms", "server CPU")
    ]
    for r in results:
        rows.append(
            (
                r.name,
                str(r.clients),
                str(r.requests),
                f"{r.requests / r.seconds:.0f}",
                f"{r.percentile(0.50):.2f}",
                f"{r.percentile(0.99):.2f}",
                f"{max(r.latencies) * 1000:.2f}",
                f"{r.server_cpu:.0%}",
            )
        )
    return format_table(rows)


def format_table(rows: Sequence[tuple[str, ...]]) -> str:
    """Rows of cells as aligned columns: the first left-aligned, the others right."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join(
        "  ".join(
            cell.ljust(w) if i == 0 else cell.rjust(w)
            for i, (cell, w) in enumerate(zip(row, widths, strict=True))
        )
        for row in rows
    )


if __name__ == "__main__":
    sys.exit(main())
