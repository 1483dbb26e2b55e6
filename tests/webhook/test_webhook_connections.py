"""Connection limits through real sockets: the cap, the request deadline, the idle timeout."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import ssl
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from webhook.config import Config
from webhook.connections import Limits
from webhook.http_protocol import MAX_BODY
from webhook_kit import (
    RunningServer,
    Tls,
    admission_review,
    admit,
    get,
    https,
    load,
    make_tls,
    raw_tls,
    read_responses,
    request_bytes,
    running_server,
)

CAP = 8
REVIEW = json.dumps(admission_review(load("pod-gpu.yaml"))).encode()
CLOSED = "kubevirt_iommufd_webhook_connections_closed_total"
EVICTED = f'{CLOSED}{{listener="admission",reason="evicted"}}'
REQUEST_TIMEOUTS = f'{CLOSED}{{listener="admission",reason="request_timeout"}}'
IDLE_TIMEOUTS = f'{CLOSED}{{listener="admission",reason="idle_timeout"}}'


@pytest.fixture
def tls(tmp_path: Path) -> Tls:
    return make_tls(tmp_path)


@pytest.fixture
def sockets() -> Iterator[list[socket.socket]]:
    opened: list[socket.socket] = []
    yield opened
    for sock in opened:
        sock.close()


def eventually(condition: Callable[[], bool], seconds: float = 5.0) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.02)
    return condition()


def open_connections(server: RunningServer) -> int:
    """The admission listener's table, read on the server's own loop."""

    async def count() -> int:
        return len(server.server.admission_connections)

    return asyncio.run_coroutine_threadsafe(count(), server.loop).result(timeout=5)


def metric(server: RunningServer, prefix: str) -> float:
    _, text = get(server.health_port, "/metrics")
    lines = [line for line in text.splitlines() if line.startswith(prefix + " ")]
    return float(lines[0].rpartition(" ")[2]) if lines else 0.0


def closed_by_server(sock: socket.socket, within: float) -> bool:
    """True when the peer closes within `within` seconds (EOF, reset or a TLS close)."""
    sock.settimeout(within)
    try:
        return sock.recv(1) == b""
    except TimeoutError:
        return False
    except (ConnectionResetError, ssl.SSLError):
        return True


def socket_fds() -> int:
    count = 0
    for fd in Path("/proc/self/fd").iterdir():
        with contextlib.suppress(FileNotFoundError):  # the listing's own fd, closed meanwhile
            count += str(fd.readlink()).startswith("socket:")
    return count


def test_connections_past_the_cap_evict_the_oldest_idle_and_hold_no_more_state(
    tls: Tls, sockets: list[socket.socket]
) -> None:
    with running_server(Config(), tls, limits=Limits(max_connections=CAP)) as server:
        before = socket_fds()
        for _ in range(5 * CAP):
            sockets.append(raw_tls(server, tls))

        assert eventually(lambda: metric(server, EVICTED) == 4 * CAP)
        assert open_connections(server) == CAP
        assert metric(server, 'kubevirt_iommufd_webhook_connections{listener="admission"}') == CAP
        # Ours (5 * CAP) plus the server's: only CAP of those are left, the rest really closed.
        assert eventually(lambda: socket_fds() - before <= 5 * CAP + CAP)
        assert all(closed_by_server(sock, 2.0) for sock in sockets[: 4 * CAP])
        assert not any(closed_by_server(sock, 0.05) for sock in sockets[4 * CAP :])


def test_valid_reviews_are_answered_while_idle_connections_fill_the_cap(
    tls: Tls, sockets: list[socket.socket]
) -> None:
    with running_server(Config(), tls, limits=Limits(max_connections=CAP)) as server:
        for _ in range(CAP):
            sockets.append(raw_tls(server, tls))  # handshaken, then silent
        for _ in range(CAP):
            sockets.append(socket.create_connection(("127.0.0.1", server.port)))  # no handshake
        assert eventually(lambda: metric(server, EVICTED) == CAP)

        for _ in range(3 * CAP):
            sockets.append(raw_tls(server, tls))
            conn = https(server, tls)
            admit(conn, "/mutate-pod", admission_review(load("pod-gpu.yaml")))
            conn.close()

        assert open_connections(server) <= CAP


def test_a_request_under_way_outlives_a_flood_of_idle_connections(
    tls: Tls, sockets: list[socket.socket]
) -> None:
    with running_server(Config(), tls, limits=Limits(max_connections=CAP)) as server:
        request = request_bytes("/mutate-pod", REVIEW)
        started = raw_tls(server, tls)
        started.sendall(request[:100])  # the rest is still on its way
        assert eventually(lambda: open_connections(server) == 1)
        for _ in range(4 * CAP):
            sockets.append(raw_tls(server, tls))
        assert eventually(lambda: metric(server, EVICTED) == 3 * CAP + 1)

        started.sendall(request[100:])
        ((status, body),) = read_responses(started, 1)
        started.close()

        assert status == 200
        assert json.loads(body)["response"]["allowed"] is True


# Timing assertions below are lower bounds measured from before the client acts, so they hold
# however late the client runs on a loaded machine; which timer closed a connection is read from
# the server's metrics rather than guessed from the clock.


def send_quietly(sock: socket.socket, data: bytes) -> bool:
    """Send unless the server has already closed the connection; whether it went."""
    try:
        sock.sendall(data)
    except OSError:
        return False
    return True


@pytest.mark.parametrize(
    "sent", [b"", b"POST /mutate-pod HTTP/1.1\r\nhost: x\r\n"], ids=["nothing", "half-a-head"]
)
def test_a_connection_without_a_complete_request_is_cut_at_the_deadline(
    tls: Tls, sent: bytes
) -> None:
    limits = Limits(request_timeout=0.5, idle_timeout=30)
    with running_server(Config(), tls, limits=limits) as server:
        started = time.monotonic()
        sock = raw_tls(server, tls)
        send_quietly(sock, sent)

        assert closed_by_server(sock, 10.0)
        assert time.monotonic() - started >= 0.45
        sock.close()
        assert eventually(lambda: metric(server, REQUEST_TIMEOUTS) == 1)
        assert metric(server, IDLE_TIMEOUTS) == 0


def test_a_tls_handshake_never_finished_is_cut_at_the_deadline(tls: Tls) -> None:
    limits = Limits(request_timeout=0.5, idle_timeout=30)
    with running_server(Config(), tls, limits=limits) as server:
        started = time.monotonic()
        sock = socket.create_connection(("127.0.0.1", server.port))
        send_quietly(sock, b"\x16\x03\x01")  # the first bytes of a ClientHello, and no more

        assert closed_by_server(sock, 10.0)
        assert time.monotonic() - started >= 0.45
        sock.close()
        assert eventually(lambda: metric(server, REQUEST_TIMEOUTS) == 1)


def test_a_request_trickled_in_does_not_extend_its_deadline(tls: Tls) -> None:
    limits = Limits(request_timeout=0.5, idle_timeout=30)
    with running_server(Config(), tls, limits=limits) as server:
        sock = raw_tls(server, tls)
        head = request_bytes("/mutate-pod", REVIEW)[:200]
        sent = 0
        # A byte every 50 ms: 10 s for the 200, 20 times the deadline.
        while sent < len(head) and send_quietly(sock, head[sent : sent + 1]):
            sent += 1
            if closed_by_server(sock, 0.05):
                break
        sock.close()

        assert sent < len(head), "the trickle was never cut"
        assert eventually(lambda: metric(server, REQUEST_TIMEOUTS) == 1)


def test_an_idle_keep_alive_connection_is_closed_after_the_idle_timeout(tls: Tls) -> None:
    # The idle timeout is the longer one here: an answered connection must outlive the request
    # deadline and be closed by its own timer.
    limits = Limits(request_timeout=0.3, idle_timeout=1.0)
    with running_server(Config(), tls, limits=limits) as server:
        sock = raw_tls(server, tls)
        sent = time.monotonic()
        sock.sendall(request_bytes("/mutate-pod", REVIEW))
        assert read_responses(sock, 1)[0][0] == 200

        assert closed_by_server(sock, 10.0)
        assert time.monotonic() - sent >= 0.95
        sock.close()
        assert eventually(lambda: metric(server, IDLE_TIMEOUTS) == 1)
        assert metric(server, REQUEST_TIMEOUTS) == 0


def test_a_keep_alive_connection_used_again_gets_a_fresh_idle_timeout(tls: Tls) -> None:
    limits = Limits(request_timeout=5, idle_timeout=2.0)
    with running_server(Config(), tls, limits=limits) as server:
        conn = https(server, tls)
        admit(conn, "/mutate-pod", admission_review(load("pod-gpu.yaml")))
        first = conn.sock
        for _ in range(6):
            time.sleep(0.5)
            admit(conn, "/mutate-pod", admission_review(load("pod-gpu.yaml")))

        assert conn.sock is first  # 3 s in all, but never 2 s idle
        conn.close()
        assert metric(server, IDLE_TIMEOUTS) == 0


@pytest.mark.parametrize(
    "limits",
    [
        {"max_connections": 0},
        {"request_timeout": 0},
        {"idle_timeout": -1},
        {"max_buffered": 0},
    ],
)
def test_limits_refuse_values_that_would_disable_them(limits: dict[str, float]) -> None:
    with pytest.raises(ValueError, match="must be"):
        Limits(**limits)  # type: ignore[arg-type]


def buffered(server: RunningServer) -> int:
    async def count() -> int:
        return server.server.admission_connections.buffered

    return asyncio.run_coroutine_threadsafe(count(), server.loop).result(timeout=5)


def test_bytes_held_by_unfinished_requests_stay_under_the_budget(
    tls: Tls, sockets: list[socket.socket]
) -> None:
    body = REVIEW + b" " * (MAX_BODY - len(REVIEW))  # a valid review padded to the largest size
    request = request_bytes("/mutate-pod", body)
    part = len(request) - 100_000  # all but the last 100 kB: each such request holds ~0.9 MiB
    limits = Limits(max_connections=CAP, max_buffered=3 * MAX_BODY)
    with running_server(Config(), tls, limits=limits) as server:
        for count in range(1, 6):
            newest = raw_tls(server, tls)
            newest.sendall(request[:part])
            sockets.append(newest)
            assert eventually(lambda: buffered(server) == min(count, 3) * part)  # noqa: B023

        assert all(closed_by_server(sock, 2.0) for sock in sockets[:2])
        assert metric(server, EVICTED) == 2
        newest.sendall(request[part:])
        assert read_responses(newest, 1)[0][0] == 200
        assert eventually(lambda: buffered(server) == 2 * part)
