"""Benchmark the webhook under a flood of idle TLS connections while it answers a paced load.

Run: .venv/bin/python -m bench.webhook_idle  (about 40 s; loopback only; needs trustme and PyYAML)

The server runs as `kubevirt-iommufd webhook` with its shipped defaults in its own process (pinned
to one CPU when there are two or more). An attacker process opens 2,000 TLS connections, 200 a
second, completes each handshake and sends nothing, and keeps re-dialling every connection the
server closes at the same rate, so the listener stays full for the whole run. Meanwhile a paced
load of 50 AdmissionReviews a second over 4 keep-alive connections plays the API server: a
connection the server closed while idle is re-dialled and the review sent again, as the API
server's HTTP client does, with the time that takes counted in its latency (measured from each
review's scheduled time, so a stall cannot hide); the attacker runs at the lowest priority, as
if on a machine of its own. The same load runs alone first, for 10 s, to show what the flood adds
on this machine. Reported: the server's resident memory (sampled every 0.1 s, and the kernel's
high-water mark) against the pod's 256 MiB limit, and the latencies.
"""

from __future__ import annotations

import http.client
import multiprocessing
import os
import selectors
import ssl
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.webhook import Target, _connect, _cpu_seconds, _start_server, format_table

IDLE = 2_000
DIAL_RATE = 200  # new connections a second: the first 2,000 in 10 s, then re-dials
RATE = 50
CLIENTS = 4
DURATION = 25.0
CONTROL = 10.0
LIMIT_MIB = 256
TARGET_RSS_MIB = LIMIT_MIB / 2
TARGET_P99_MS = 50.0
METRICS = ("kubevirt_iommufd_webhook_connections{", "kubevirt_iommufd_webhook_connections_closed")


@dataclass(frozen=True)
class Phase:
    name: str
    latencies: list[float]
    failed: int
    redials: int
    rss_peak: float
    cpu: float
    attack: dict[str, int]

    def percentile(self, q: float) -> float:
        ordered = sorted(self.latencies)
        return ordered[int(q * (len(ordered) - 1))] * 1000


def main() -> int:
    cpus = sorted(os.sched_getaffinity(0))
    server_cpus, client_cpus = (
        ({cpus[0]}, set(cpus[1:])) if len(cpus) > 1 else (set(cpus), set(cpus))
    )
    with tempfile.TemporaryDirectory(prefix="webhook-idle-bench-") as tmp:
        target, server = _start_server(Path(tmp), server_cpus)
        try:
            os.sched_setaffinity(0, client_cpus)
            for _ in range(50):  # warm up: imports, caches, the first handshakes
                _review(_connect(target), target.request)
            baseline = _rss_mib(server.pid)
            # The same load alone first: on a shared machine it shows what the flood adds.
            quiet = _phase("load alone", target, server.pid, CONTROL, attack=False)
            flood = _phase("load + flood", target, server.pid, DURATION, attack=True)
            high_water = _status_mib(server.pid, "VmHWM")
            metrics = _metrics(_health_port(server))
        finally:
            server.terminate()
            server.wait(timeout=10)
    attack = flood.attack
    print(
        f"webhook idle-connection benchmark: shipped defaults, server on CPU {sorted(server_cpus)};"
        f" load: {RATE} reviews/s over {CLIENTS} keep-alive connections; flood"
        f" ({DURATION:.0f} s): {attack['opened']} idle TLS connections opened, {DIAL_RATE}/s"
        f" (the server closed {attack['closed']}; the attacker never had more than"
        f" {attack['held_max']} open at once)"
    )
    print(_table([quiet, flood]))
    print(
        f"server RSS: {baseline:.1f} MiB before, high-water {high_water:.1f} MiB against the"
        f" {LIMIT_MIB} MiB limit"
    )
    for line in metrics:
        if "_created" not in line:
            print(f"  {line}")
    worst = max(high_water, flood.rss_peak)
    p99 = flood.percentile(0.99)
    ok_rss = worst < TARGET_RSS_MIB
    ok_p99 = p99 < TARGET_P99_MS and flood.failed == 0
    print(
        f"targets: RSS < {TARGET_RSS_MIB:.0f} MiB (half the limit): {worst:.1f}"
        f" {'ok' if ok_rss else 'MISSED'}; every review answered, p99 < {TARGET_P99_MS:.0f} ms"
        f" under the flood: {p99:.2f} {'ok' if ok_p99 else 'MISSED'}"
    )
    return 0 if ok_rss and ok_p99 else 1


def _phase(name: str, target: Target, pid: int, seconds: float, *, attack: bool) -> Phase:
    queue: multiprocessing.Queue[Any] = multiprocessing.Queue()
    start = time.time() + 1.0
    workers = [multiprocessing.Process(target=_paced_load, args=(target, start, seconds, queue))]
    if attack:
        workers.append(
            multiprocessing.Process(target=_attack, args=(target, start, seconds, queue))
        )
    for worker in workers:
        worker.start()
    cpu_before = _cpu_seconds(pid)
    peak = 0.0
    while time.time() < start + seconds:
        peak = max(peak, _rss_mib(pid))
        time.sleep(0.1)
    results = dict(queue.get(timeout=60) for _ in workers)
    cpu = _cpu_seconds(pid) - cpu_before
    for worker in workers:
        worker.join(timeout=30)
    load = results["load"]
    empty = {"opened": 0, "closed": 0, "held_max": 0}
    return Phase(
        name,
        load["latencies"],
        load["failed"],
        load["redials"],
        peak,
        cpu / seconds,
        results.get("attacker", empty),
    )


def _table(phases: list[Phase]) -> str:
    rows = [
        ("phase", "reviews", "failed", "re-dials", "p50 ms", "p99 ms", "max ms", "RSS peak", "CPU")
    ]
    for p in phases:
        rows.append(
            (
                p.name,
                str(len(p.latencies)),
                str(p.failed),
                str(p.redials),
                f"{p.percentile(0.5):.2f}",
                f"{p.percentile(0.99):.2f}",
                f"{max(p.latencies) * 1000:.2f}",
                f"{p.rss_peak:.1f} MiB",
                f"{p.cpu:.0%}",
            )
        )
    return format_table(rows)


def _attack(
    target: Target, start: float, seconds: float, queue: multiprocessing.Queue[Any]
) -> None:
    """Hold IDLE handshaken connections, re-dialling the ones the server closes."""
    # An attacker runs on its own machine: here it shares the clients' CPU, so it yields to the
    # load, whose latency should show the server's delays rather than the attacker's CPU time.
    os.nice(19)
    selector = selectors.DefaultSelector()
    opened = closed = held_max = 0
    end = start + seconds
    while time.time() < start:
        time.sleep(0.01)

    def dial() -> None:
        nonlocal opened
        try:
            sock = _connect(target)
        except OSError:
            return
        sock.setblocking(False)
        selector.register(sock, selectors.EVENT_READ)
        opened += 1

    next_dial = start
    while time.time() < end:
        # The server sends nothing to an idle connection but TLS session tickets and, when it
        # closes it, an alert, EOF or a reset: a readable socket without data has been closed.
        for key, _ in selector.select(timeout=0.005):
            sock = key.fileobj
            assert isinstance(sock, ssl.SSLSocket)
            try:
                if sock.recv(1) != b"":
                    continue
            except (ssl.SSLWantReadError, ssl.SSLWantWriteError):
                continue
            except OSError:
                pass
            selector.unregister(sock)
            sock.close()
            closed += 1
        if len(selector.get_map()) < IDLE and time.time() >= next_dial:
            dial()
            next_dial += 1 / DIAL_RATE
        next_dial = max(next_dial, time.time() - 1)  # no burst to catch up after a stall
        held_max = max(held_max, len(selector.get_map()))
    for key in list(selector.get_map().values()):
        key.fileobj.close()  # type: ignore[union-attr]
    queue.put(("attacker", {"opened": opened, "closed": closed, "held_max": held_max}))


def _paced_load(
    target: Target, start: float, seconds: float, queue: multiprocessing.Queue[Any]
) -> None:
    """RATE reviews a second over CLIENTS connections in turn, open loop."""
    connections: list[ssl.SSLSocket | None] = [None] * CLIENTS
    latencies: list[float] = []
    failed = redials = 0
    interval = 1 / RATE
    for n in range(int(seconds / interval)):
        scheduled = start + n * interval
        delay = scheduled - time.time()
        if delay > 0:
            time.sleep(delay)
        index = n % CLIENTS
        for attempt in range(2):
            sock = connections[index]
            if sock is None:
                sock = connections[index] = _connect(target)
            try:
                _review(sock, target.request)
            except (OSError, ConnectionError) as error:
                sock.close()
                connections[index] = None
                if attempt == 1:
                    failed += 1
                    print(f"review failed after a re-dial: {error}", file=sys.stderr)
                else:
                    redials += 1
                continue
            latencies.append(time.time() - scheduled)
            break
    for sock in connections:
        if sock is not None:
            sock.close()
    queue.put(("load", {"latencies": latencies, "failed": failed, "redials": redials}))


def _review(sock: ssl.SSLSocket, request: bytes) -> None:
    """One AdmissionReview on a keep-alive connection; ConnectionError if the server closed it."""
    sock.sendall(request)
    buffer = b""
    while (end := buffer.find(b"\r\n\r\n")) < 0:
        buffer += _recv(sock)
    head = buffer[:end].lower()
    if not head.startswith(b"http/1.1 200"):
        raise ConnectionError(f"unexpected answer: {head[:200]!r}")
    length = int(head.partition(b"content-length:")[2].split(b"\r\n")[0])
    while len(buffer) < end + 4 + length:
        buffer += _recv(sock)


def _recv(sock: ssl.SSLSocket) -> bytes:
    data = sock.recv(65536)
    if not data:
        raise ConnectionError("closed by the server")
    return data


def _health_port(server: Any) -> int:
    args: list[str] = server.args
    return int(args[args.index("--health-port") + 1])


def _metrics(port: int) -> list[str]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    conn.request("GET", "/metrics")
    text = conn.getresponse().read().decode()
    conn.close()
    return [line for line in text.splitlines() if line.startswith(METRICS)]


def _rss_mib(pid: int) -> float:
    return _status_mib(pid, "VmRSS")


def _status_mib(pid: int, field: str) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    raise SystemExit(f"no {field} in /proc/{pid}/status")


if __name__ == "__main__":
    sys.exit(main())
