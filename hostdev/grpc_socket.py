"""A gRPC server on one unix socket path, served again when someone takes the socket away.

A restarting kubelet deletes the sockets in its directories (sometimes the directories too), and
only a socket served anew gets it to dial back. The server remembers which file it made (device
and inode): `present` turns false once the path is gone or names another file, `restart` makes
the directory again if need be (mode 0750) and serves there, and `stop` removes the path only
while it is still ours — by then a newer server may hold it. The socket has its mode from the
start, whatever the umask (`bind_unix_socket_path`).
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent import futures
from pathlib import Path

import grpc

from hostdev.directories import make_directories
from hostdev.unix_socket import UnixSocketError, bind_unix_socket_path

# Only the kubelet, which runs as root, dials these sockets: nobody else needs to connect.
SOCKET_MODE = 0o600
# A socket directory made here (the kubelet wiped it, or has not made it yet) gets the mode the
# kubelet gives its own plugin directories, whatever the umask: only root writes into it.
SOCKET_DIRECTORY_MODE = 0o750
# One thread holds each open stream (ListAndWatch, health); the rest serve the unary calls.
_WORKERS = 8


class GrpcSocketServer:
    """Serves what `add_services` puts on a gRPC server at `path`, with mode 0600; restartable."""

    def __init__(self, path: Path, add_services: Callable[[grpc.Server], None]) -> None:
        self.path = path
        self._add_services = add_services
        self._server: grpc.Server | None = None
        self._executor: futures.ThreadPoolExecutor | None = None
        self._identity: tuple[int, int] | None = None

    def start(self) -> None:
        """Serve at the path, replacing whatever socket is left there; raises UnixSocketError
        (an OSError) when the socket cannot be made."""
        try:
            make_directories(self.path.parent, SOCKET_DIRECTORY_MODE)
        except OSError as error:
            raise UnixSocketError(f"cannot make {self.path.parent}: {error}") from error
        executor = futures.ThreadPoolExecutor(max_workers=_WORKERS)
        server = grpc.server(executor)
        self._add_services(server)
        try:
            bind_unix_socket_path(
                self.path, lambda address: server.add_insecure_port(f"unix:{address}"), SOCKET_MODE
            )
        except UnixSocketError:
            executor.shutdown(wait=False)
            raise
        server.start()
        self._server, self._executor = server, executor
        # Deleted as soon as made (a kubelet cleaning up): no identity, so `present` says it is
        # gone and the caller serves again.
        self._identity = _identity(self.path)

    def stop(self, grace: float | None = 0.2) -> None:
        """Stop serving (calls in flight get `grace` seconds) and remove the socket if ours."""
        server, self._server = self._server, None
        if server is not None:
            server.stop(grace).wait()
        # grpc never shuts down the pool it was given: without this every restart (each kubelet
        # restart) would leave its threads behind.
        if self._executor is not None:
            self._executor.shutdown(wait=False)
            self._executor = None
        if self.present:
            self.path.unlink(missing_ok=True)
        self._identity = None

    def restart(self, grace: float | None = 0.2) -> None:
        """Stop and serve anew: the socket at the path is a new file the kubelet's watch sees."""
        self.stop(grace)
        self.start()

    @property
    def present(self) -> bool:
        """Whether the path still names the socket this server made."""
        return self._identity is not None and _identity(self.path) == self._identity


def _identity(path: Path) -> tuple[int, int] | None:
    try:
        info = path.stat()
    except OSError:
        return None
    return info.st_dev, info.st_ino
