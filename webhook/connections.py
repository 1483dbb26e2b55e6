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
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

# The API server keeps up to a few dozen keep-alive connections per webhook host, several API
# servers share a webhook, and a TLS connection costs a few tens of KiB here: 256 of them stay far
# below the pod's 256 MiB limit (bench/webhook_idle.py) while leaving the API server ample room.
MAX_CONNECTIONS = 256
# The API server sends a review in one write right after connecting, so a request takes
# milliseconds to arrive; 10 s is the API server's default webhook timeout, after which it has
# given up on the answer anyway.
REQUEST_TIMEOUT = 10.0
# Longer than the API server's idle keep-alive timeout (90 s), so the server does not close a
# connection the client is about to reuse.
IDLE_TIMEOUT = 120.0


@dataclass(frozen=True, slots=True)
class Limits:
    """What one listener allows; checked when built, so a bad flag is a clear error."""

    max_connections: int = MAX_CONNECTIONS
    request_timeout: float = REQUEST_TIMEOUT
    idle_timeout: float = IDLE_TIMEOUT

    def __post_init__(self) -> None:
        if self.max_connections < 1:
            raise ValueError(f"max_connections must be 1 or more, not {self.max_connections}")
        for name in ("request_timeout", "idle_timeout"):
            value = getattr(self, name)
            if not value > 0:
                raise ValueError(f"{name} must be more than 0 seconds, not {value}")


class Connection(Protocol):
    def evict(self) -> None:
        """Drop the connection now, unanswered and unflushed."""


class ConnectionTable:
    """The open connections of one listener, each either waiting for a request or reading one.

    Both groups are dicts used as ordered sets: insertion order is the order in which the
    connections entered their current state, so the first key is the one to evict.
    """

    def __init__(
        self, limits: Limits, count_closed: Callable[[str], None] = lambda reason: None
    ) -> None:
        self.limits = limits
        # Called with why the server closed a connection: evicted, request_timeout, idle_timeout.
        self.count_closed = count_closed
        self._waiting: dict[Connection, None] = {}
        self._reading: dict[Connection, None] = {}

    def __len__(self) -> int:
        return len(self._waiting) + len(self._reading)

    def admit(self, connection: Connection) -> None:
        """Add a new connection, evicting one already open if the table is full."""
        if len(self) >= self.limits.max_connections:
            victim = next(iter(self._waiting or self._reading))
            self.remove(victim)
            self.count_closed("evicted")
            victim.evict()
        self._waiting[connection] = None

    def reading(self, connection: Connection) -> None:
        """The connection has started sending a request."""
        if connection in self._waiting:
            del self._waiting[connection]
            self._reading[connection] = None

    def waiting(self, connection: Connection) -> None:
        """The connection was answered and waits for its next request."""
        if connection in self._reading:
            del self._reading[connection]
            self._waiting[connection] = None

    def remove(self, connection: Connection) -> None:
        self._waiting.pop(connection, None)
        self._reading.pop(connection, None)

    def connections(self) -> list[Connection]:
        return [*self._waiting, *self._reading]
