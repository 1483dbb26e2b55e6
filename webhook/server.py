"""The running webhook: a TLS listener for admissions, a plain one for probes, a cert watch."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import weakref
from pathlib import Path

from webhook.config import Config
from webhook.http_protocol import Handler, HttpProtocol
from webhook.metrics import Metrics
from webhook.routes import build_admission_handler, build_health_handler
from webhook.tls import CertificateReloader

# Checking two files' stat every few seconds costs nothing; cert-manager renews long before expiry.
RELOAD_INTERVAL = 5.0
HANDSHAKE_TIMEOUT = 10.0

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
    ) -> None:
        self.metrics = Metrics()
        self._reloader = CertificateReloader(cert, key, self.metrics.count_reload)
        self._config = config
        self._host = host
        self._port = port
        self._health_port = health_port
        self._reload_interval = reload_interval
        self._servers: list[asyncio.Server] = []
        self._connections: weakref.WeakSet[HttpProtocol] = weakref.WeakSet()
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
        self._servers.append(await self._listen(health, self._health_port, tls=False))
        self._servers.append(await self._listen(admission, self._port, tls=True))
        self._watch = asyncio.create_task(self._watch_certificate())
        self._serving = True
        log.info(
            "serving admissions on port %d (TLS), probes and metrics on port %d",
            self.port,
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
        for connection in list(self._connections):
            connection.close()
        for server in self._servers:
            await server.wait_closed()

    async def _listen(self, handler: Handler, port: int, *, tls: bool) -> asyncio.Server:
        def connect() -> HttpProtocol:
            protocol = HttpProtocol(handler)
            self._connections.add(protocol)
            return protocol

        loop = asyncio.get_running_loop()
        try:
            if tls:
                return await loop.create_server(
                    connect,
                    self._host,
                    port,
                    ssl=self._reloader.context,
                    ssl_handshake_timeout=HANDSHAKE_TIMEOUT,
                )
            return await loop.create_server(connect, self._host, port)
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
