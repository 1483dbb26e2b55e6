"""Benchmark the webhook against an amplification attempt while it admits launcher pods.

Run: .venv/bin/python -m bench.webhook_hostile  (about 30 s; loopback only; needs trustme, PyYAML)

The server runs as `kubevirt-iommufd webhook` with its shipped defaults in its own process (pinned
to one CPU when there are two or more). The attacker sends VMIs annotated
`iommufd.kubevirt.io/mode: require` whose required node affinity is nothing but empty
nodeSelectorTerms, as many as fit in the 1 MiB the webhook reads (about 340,000), one after
another on one keep-alive connection, each sent as soon as the last was answered; it runs at the
lowest priority, as if on a machine of its own. Meanwhile a paced load of 50 launcher-pod reviews a
second over 4 keep-alive connections, each in a thread of its own as the API server sends
concurrently, plays the API server, its latency measured from each review's scheduled time so a
stall cannot hide. The same load runs alone first. Reported: the
server's resident memory (sampled every 50 ms, and the kernel's high-water mark) against the pod's
256 MiB limit, the launcher pods' latencies, and what each hostile review cost and got back.
"""

from __future__ import annotations

import json
import math
import multiprocessing
import os
import ssl
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from bench.webhook import ROOT, Target, _connect, _start_server, format_table
from bench.webhook_idle import _recv, _review, _rss_mib, _status_mib

VMI = ROOT / "tests" / "webhook" / "data" / "vmi-gpu.yaml"
MAX_BODY = 1024 * 1024  # webhook.http_protocol.MAX_BODY
RATE = 50
CLIENTS = 4
CONTROL = 8.0
DURATION = 15.0
HOSTILE_TIMEOUT = 120.0
LIMIT_MIB = 256
TARGET_RSS_MIB = LIMIT_MIB / 2
# Each hostile review is parsed whole (about 0.1 s of CPU for 1 MiB of tiny objects, the cost
# of the body limit, whatever the planners do), and a launcher pod may wait behind one: the
# target is a tenth of the pod webhook's 5 s timeout, where before the fix pods timed out.
TARGET_P99_MS = 500.0


@dataclass(frozen=True)
class Phase:
    name: str
    latencies: list[float]
    failed: int
    rss_peak: float
    hostile: dict[str, Any]

    def percentile(self, q: float) -> float:
        ordered = sorted(self.latencies)
        return ordered[int(q * (len(ordered) - 1))] * 1000 if ordered else math.nan


def main() -> int:
    cpus = sorted(os.sched_getaffinity(0))
    server_cpus, client_cpus = (
        ({cpus[0]}, set(cpus[1:])) if len(cpus) > 1 else (set(cpus), set(cpus))
    )
    request, terms = _hostile_request()
    with tempfile.TemporaryDirectory(prefix="webhook-hostile-bench-") as tmp:
        target, server = _start_server(Path(tmp), server_cpus)
        try:
            os.sched_setaffinity(0, client_cpus)
            baseline = _rss_mib(server.pid)
            quiet = _phase("load alone", target, server.pid, CONTROL, None)
            attacked = _phase("load + hostile VMIs", target, server.pid, DURATION, request)
            high_water = _status_mib(server.pid, "VmHWM")
        finally:
            server.terminate()
            server.wait(timeout=10)
    hostile = attacked.hostile
    print(
        f"webhook amplification benchmark: shipped defaults, server on CPU {sorted(server_cpus)};"
        f" load: {RATE} launcher-pod reviews/s over {CLIENTS} concurrent keep-alive connections;"
        f" attack"
        f" ({DURATION:.0f} s): require VMIs of {len(request) / 1024:.0f} KiB with {terms}"
        f" empty nodeSelectorTerms, back to back on one connection"
    )
    print(_table([quiet, attacked]))
    seconds = hostile["seconds"]
    print(
        f"hostile VMIs: {hostile['answered']} answered"
        f" ({hostile['unanswered']} unanswered within {HOSTILE_TIMEOUT:.0f} s),"
        f" {sum(seconds) / max(1, len(seconds)) * 1000:.0f} ms each on average,"
        f" answers of {hostile['answer_bytes']} bytes: {hostile['verdict']}"
    )
    print(
        f"server RSS: {baseline:.1f} MiB before, high-water {high_water:.1f} MiB against the"
        f" {LIMIT_MIB} MiB limit"
    )
    worst = max(high_water, attacked.rss_peak)
    p99 = attacked.percentile(0.99)
    ok_rss = worst < TARGET_RSS_MIB
    ok_p99 = p99 < TARGET_P99_MS and attacked.failed == 0
    print(
        f"targets: RSS < {TARGET_RSS_MIB:.0f} MiB (half the limit): {worst:.1f}"
        f" {'ok' if ok_rss else 'MISSED'}; every launcher pod answered, p99 <"
        f" {TARGET_P99_MS:.0f} ms during the attack: {p99:.2f} {'ok' if ok_p99 else 'MISSED'}"
    )
    return 0 if ok_rss and ok_p99 else 1


def _hostile_request() -> tuple[bytes, int]:
    """A POST of a require VMI holding as many empty terms as fit in the body limit."""
    vmi = yaml.safe_load(VMI.read_text())
    vmi["metadata"]["annotations"]["iommufd.kubevirt.io/mode"] = "require"
    required: dict[str, list[object]] = {"nodeSelectorTerms": []}
    vmi["spec"]["affinity"] = {
        "nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": required}
    }
    gvk = {"group": "kubevirt.io", "version": "v1", "kind": "VirtualMachineInstance"}
    review = {
        "apiVersion": "admission.k8s.io/v1",
        "kind": "AdmissionReview",
        "request": {
            "uid": "6f1c2d3e-4a5b-4c6d-8e7f-9a0b1c2d3e4f",
            "kind": gvk,
            "resource": {
                "group": "kubevirt.io",
                "version": "v1",
                "resource": "virtualmachineinstances",
            },
            "namespace": vmi["metadata"]["namespace"],
            "operation": "CREATE",
            "object": vmi,
        },
    }
    envelope = len(json.dumps(review, separators=(",", ":")))
    terms = (MAX_BODY - envelope) // len("{},")
    required["nodeSelectorTerms"] = [{}] * terms
    body = json.dumps(review, separators=(",", ":")).encode()
    head = (
        f"POST /mutate-vmi?timeout=10s HTTP/1.1\r\nHost: webhook\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    )
    return head.encode() + body, terms


def _phase(name: str, target: Target, pid: int, seconds: float, hostile: bytes | None) -> Phase:
    queue: multiprocessing.Queue[Any] = multiprocessing.Queue()
    start = time.time() + 1.0
    workers = [multiprocessing.Process(target=_paced_pods, args=(target, start, seconds, queue))]
    if hostile is not None:
        workers.append(
            multiprocessing.Process(target=_attack, args=(target, hostile, start, seconds, queue))
        )
    for worker in workers:
        worker.start()
    peak = 0.0
    while any(worker.is_alive() for worker in workers) and time.time() < start + seconds + 5:
        peak = max(peak, _rss_mib(pid))
        time.sleep(0.05)
    results = dict(queue.get(timeout=HOSTILE_TIMEOUT + 60) for _ in workers)
    for worker in workers:
        worker.join(timeout=HOSTILE_TIMEOUT + 30)
    load = results["load"]
    return Phase(name, load["latencies"], load["failed"], peak, results.get("attacker", {}))


def _paced_pods(
    target: Target, start: float, seconds: float, queue: multiprocessing.Queue[Any]
) -> None:
    """RATE launcher-pod reviews a second, open loop, each of CLIENTS connections in a thread."""
    latencies: list[float] = []
    failed: list[str] = []

    def client(index: int) -> None:
        sock: ssl.SSLSocket | None = None
        interval = CLIENTS / RATE
        first = start + index / RATE  # the clients' sends interleave evenly
        for n in range(int(seconds / interval)):
            scheduled = first + n * interval
            delay = scheduled - time.time()
            if delay > 0:
                time.sleep(delay)
            try:
                sock = sock or _connect(target)
                _review(sock, target.request)
            except (OSError, ConnectionError) as error:
                failed.append(str(error))  # the API server would have given up on it (10 s)
                if sock is not None:
                    sock.close()
                sock = None
                continue
            latencies.append(time.time() - scheduled)
        if sock is not None:
            sock.close()

    threads = [threading.Thread(target=client, args=(index,)) for index in range(CLIENTS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    queue.put(("load", {"latencies": latencies, "failed": len(failed)}))


def _attack(
    target: Target, request: bytes, start: float, seconds: float, queue: multiprocessing.Queue[Any]
) -> None:
    """Send the hostile review back to back until the phase ends; time each answer."""
    os.nice(19)
    while time.time() < start:
        time.sleep(0.01)
    sock = _connect(target)
    sock.settimeout(HOSTILE_TIMEOUT)
    durations: list[float] = []
    unanswered = answer_bytes = 0
    verdict = "none"
    while time.time() < start + seconds:
        began = time.perf_counter()
        try:
            answer = _exchange(sock, request)
        except (OSError, ConnectionError) as error:
            unanswered += 1
            verdict = f"no answer: {error}"
            sock.close()
            sock = _connect(target)
            sock.settimeout(HOSTILE_TIMEOUT)
            continue
        durations.append(time.perf_counter() - began)
        answer_bytes = len(answer)
        verdict = _verdict(answer)
    sock.close()
    result = {
        "answered": len(durations),
        "unanswered": unanswered,
        "seconds": durations,
        "answer_bytes": answer_bytes,
        "verdict": verdict,
    }
    queue.put(("attacker", result))


def _exchange(sock: ssl.SSLSocket, request: bytes) -> bytes:
    sock.sendall(request)
    buffer = b""
    while (end := buffer.find(b"\r\n\r\n")) < 0:
        buffer += _recv(sock)
    length = int(buffer[:end].lower().partition(b"content-length:")[2].split(b"\r\n")[0])
    while len(buffer) < end + 4 + length:
        buffer += _recv(sock)
    return buffer[end + 4 : end + 4 + length]


def _verdict(answer: bytes) -> str:
    try:
        response = json.loads(answer)["response"]
    except (ValueError, KeyError, TypeError):
        return f"not an AdmissionReview: {answer[:80]!r}"
    if not response.get("allowed"):
        return f"refused: {response.get('status', {}).get('message', '')[:160]}"
    return f"allowed, patch of {len(response.get('patch', '')) / 1e6:.1f} MB (base64)"


def _table(phases: list[Phase]) -> str:
    rows = [("phase", "pod reviews", "failed", "p50 ms", "p99 ms", "max ms", "RSS peak")]
    for p in phases:
        rows.append(
            (
                p.name,
                str(len(p.latencies)),
                str(p.failed),
                f"{p.percentile(0.5):.2f}",
                f"{p.percentile(0.99):.2f}",
                f"{max(p.latencies, default=math.nan) * 1000:.2f}",
                f"{p.rss_peak:.1f} MiB",
            )
        )
    return format_table(rows)


if __name__ == "__main__":
    sys.exit(main())
