"""How many connections a listener keeps, how long each may take, and which one goes when full.

Without a cap, idle connections were the webhook's denial of service: each one held memory for
minutes, and enough of them got the pod OOM-killed (with `failurePolicy: Fail`, no launcher pod is
admitted then). The table below holds at most `max_connections`. When a new connection arrives at
the cap, one already open is evicted, never the newcomer: the API server cannot be told apart
from an attacker before it has sent its request, and refusing newcomers would let a few hundred
idle sockets lock it out. The victim is the connection that has waited longest without sending a
request (a fresh one in its handshake, or an idle keep-alive one: closing either loses nothing,
and the API server's HTTP client retries a request on a connection closed while idle); only when
every connection is part-way through a request does the one that started its request longest ago
go, which also ends the slow senders first. A request being answered is never interrupted:
answers are computed inline, so no connection is "busy" when another arrives.

Requests under way hold their bytes until they are complete (a body may be 1 MiB), so the table
also bounds the bytes held by all of them together: past `max_buffered`, the requests that
started longest ago are dropped, never the one whose bytes just came.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

# Each API server keeps up to 25 idle connections per webhook host (client-go's transport
# default) and opens more only for concurrent reviews; a TLS connection costs about 28 KiB here,
# so 256 of them stay far below the pod's 256 MiB limit (bench/webhook_idle.py) while leaving a
# few API servers ample room.
MAX_CONNECTIONS = 256
# The API server sends a review in one write right after connecting, so a request takes
# milliseconds to arrive; 10 s is the API server's default webhook timeout, after which it has
# given up on the answer anyway.
REQUEST_TIMEOUT = 10.0
# Longer than the API server's idle keep-alive timeout (90 s), so the server does not close a
# connection the client is about to reuse.
IDLE_TIMEOUT = 120.0
# 64 full-size (1 MiB) reviews at once, far more than an API server sends concurrently to one
# replica (reviews of launcher pods are about 10 KB), and a quarter of the pod's memory limit.
MAX_BUFFERED = 64 * 1024 * 1024


@dataclass(frozen=True, slots=True)
class Limits:
    """What one listener allows; checked when built, so a bad flag is a clear error."""

    max_connections: int = MAX_CONNECTIONS
    request_timeout: float = REQUEST_TIMEOUT
    idle_timeout: float = IDLE_TIMEOUT
    max_buffered: int = MAX_BUFFERED

    def __post_init__(self) -> None:
        for name in ("max_connections", "max_buffered"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be 1 or more, not {getattr(self, name)}")
        for name in ("request_timeout", "idle_timeout"):
            value = getattr(self, name)
            if not value > 0:
                raise ValueError(f"{name} must be more than 0 seconds, not {value}")


class Connection(Protocol):
    def evict(self) -> None:
        """Drop the connection now, unanswered and unflushed."""


class ConnectionTable:
    """The open connections of one listener, each either waiting for a request or reading one.

    Both groups are insertion-ordered dicts: the order is that in which the connections entered
    their current state, so the first key is the one to evict. A reading connection maps to the
    bytes of its request received so far.
    """

    def __init__(
        self, limits: Limits, count_closed: Callable[[str], None] = lambda reason: None
    ) -> None:
        self.limits = limits
        # Called with why the server closed a connection: evicted, request_timeout, idle_timeout.
        self.count_closed = count_closed
        self._waiting: dict[Connection, None] = {}
        self._reading: dict[Connection, int] = {}
        self.buffered = 0

    def __len__(self) -> int:
        return len(self._waiting) + len(self._reading)

    def admit(self, connection: Connection) -> None:
        """Add a new connection, evicting one already open if the table is full."""
        if len(self) >= self.limits.max_connections:
            self._evict(next(iter(self._waiting or self._reading)))
        self._waiting[connection] = None

    def reading(self, connection: Connection) -> None:
        """The connection has started sending a request."""
        if connection in self._waiting:
            del self._waiting[connection]
            self._reading[connection] = 0

    def received(self, connection: Connection, size: int) -> None:
        """`size` more bytes of the connection's request are held; drop others if over budget."""
        if connection not in self._reading:
            return
        self._reading[connection] += size
        self.buffered += size
        while self.buffered > self.limits.max_buffered:
            victim = next((c for c in self._reading if c is not connection), None)
            if victim is None:
                return  # its own size is bounded by the request size limit
            self._evict(victim)

    def released(self, connection: Connection) -> None:
        """The connection's request was answered: its bytes are no longer held."""
        if connection in self._reading:
            self.buffered -= self._reading[connection]
            self._reading[connection] = 0

    def waiting(self, connection: Connection) -> None:
        """The connection was answered and waits for its next request."""
        if connection in self._reading:
            self.buffered -= self._reading.pop(connection)
            self._waiting[connection] = None

    def remove(self, connection: Connection) -> None:
        self._waiting.pop(connection, None)
        self.buffered -= self._reading.pop(connection, 0)

    def _evict(self, victim: Connection) -> None:
        self.remove(victim)
        self.count_closed("evicted")
        victim.evict()

    def connections(self) -> list[Connection]:
        return [*self._waiting, *self._reading]
