"""The running webhook: a TLS listener for admissions, a plain one for probes, a cert watch."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import ssl
from collections.abc import Callable
from pathlib import Path

from webhook.config import Config
from webhook.connections import ConnectionTable, Limits
from webhook.http_protocol import Handler, HttpProtocol
from webhook.metrics import Metrics
from webhook.routes import build_admission_handler, build_health_handler
from webhook.tls import CertificateReloader

# Checking two files' stat every few seconds costs nothing; cert-manager renews long before expiry.
RELOAD_INTERVAL = 5.0
# The kubelet's probes and one Prometheus scraper need a handful; the port is not for admissions.
HEALTH_LIMITS = Limits(max_connections=16)
ADMISSION_LIMITS = Limits()

log = logging.getLogger(__name__)


class ListenError(Exception):
    """A port the webhook cannot listen on."""


class WebhookServer:
    """Both listeners and the certificate watch; `start()` binds, `stop()` closes everything."""

    def __init__(
        self,
        config: Config,
        cert: Path,
        key: Path,
        *,
        port: int,
        health_port: int,
        host: str | None = None,
        reload_interval: float = RELOAD_INTERVAL,
        limits: Limits = ADMISSION_LIMITS,
    ) -> None:
        self.metrics = Metrics()
        self.admission_connections = ConnectionTable(
            limits, self.metrics.counter_of_closed("admission")
        )
        self.health_connections = ConnectionTable(
            HEALTH_LIMITS, self.metrics.counter_of_closed("health")
        )
        self.metrics.watch_connections("admission", self.admission_connections.__len__)
        self.metrics.watch_connections("health", self.health_connections.__len__)
        self._reloader = CertificateReloader(cert, key, self.metrics.count_reload)
        self._config = config
        self._host = host
        self._port = port
        self._health_port = health_port
        self._reload_interval = reload_interval
        self._servers: list[asyncio.Server] = []
        self._watch: asyncio.Task[None] | None = None
        self._serving = False

    @property
    def port(self) -> int:
        """The bound admission port (useful when asked for port 0)."""
        return _bound_port(self._servers[1])

    @property
    def health_port(self) -> int:
        return _bound_port(self._servers[0])

    def ready(self) -> bool:
        return self._serving

    async def start(self) -> None:
        health = build_health_handler(self.metrics, self.ready)
        admission = build_admission_handler(self._config, self.metrics)
        self._servers.append(await self._listen(health, self._health_port, self.health_connections))
        self._servers.append(
            await self._listen(
                admission, self._port, self.admission_connections, self._reloader.current
            )
        )
        self._watch = asyncio.create_task(self._watch_certificate())
        self._serving = True
        limits = self.admission_connections.limits
        log.info(
            "serving admissions on port %d (TLS; at most %d connections, request timeout %g s,"
            " idle timeout %g s), probes and metrics on port %d",
            self.port,
            limits.max_connections,
            limits.request_timeout,
            limits.idle_timeout,
            self.health_port,
        )

    async def stop(self) -> None:
        self._serving = False
        if self._watch is not None:
            self._watch.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watch
        for server in self._servers:
            server.close()
        for table in (self.admission_connections, self.health_connections):
            for connection in table.connections():
                connection.evict()
        for server in self._servers:
            await server.wait_closed()

    async def _listen(
        self,
        handler: Handler,
        port: int,
        table: ConnectionTable,
        tls_context: Callable[[], ssl.SSLContext] | None = None,
    ) -> asyncio.Server:
        # TLS is done by the protocol itself (webhook.tls_session), not by asyncio: see there why.
        loop = asyncio.get_running_loop()
        try:
            return await loop.create_server(
                lambda: HttpProtocol(handler, table, tls_context), self._host, port
            )
        except OSError as error:
            raise ListenError(
                f"cannot listen on port {port}: {error.strerror or error}; choose another"
                " with --port / --health-port"
            ) from error

    async def _watch_certificate(self) -> None:
        while True:
            await asyncio.sleep(self._reload_interval)
            self._reloader.check()


def _bound_port(server: asyncio.Server) -> int:
    port: int = server.sockets[0].getsockname()[1]
    return port


async def serve_until_signalled(server: WebhookServer) -> None:
    """Start, serve until SIGTERM or SIGINT, then close every listener and connection."""
    stopping = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stopping.set)
    try:
        await server.start()
        await stopping.wait()
        log.info("stopping")
    finally:
        await server.stop()
