"""The gRPC side of a resource: a server on its own unix socket in the kubelet's directory, and
the Register call that tells the kubelet where it is."""

from __future__ import annotations

import logging
from concurrent import futures
from pathlib import Path
from typing import Protocol

import grpc

from deviceplugin.v1beta1 import api_pb2, api_pb2_grpc
from hostdev.unix_socket import MAX_SOCKET_PATH, UnixSocketError, bind_unix_socket_path
from hostdev.untrusted import quote_untrusted

log = logging.getLogger(__name__)

API_VERSION = "v1beta1"
KUBELET_SOCKET = "kubelet.sock"
# One thread holds each open ListAndWatch stream; the rest serve Allocate and friends.
_WORKERS = 8
# Only the kubelet, which runs as root, dials the plugin: nobody else needs to connect.
SOCKET_MODE = 0o600


class RegistrationError(Exception):
    """The kubelet did not accept (or could not be asked about) a registration."""


class DevicePluginService(Protocol):
    @property
    def options(self) -> api_pb2.DevicePluginOptions:
        """What the servicer implements, as told to the kubelet on Register."""
        ...


class PluginServer:
    """Serves one resource's DevicePlugin service on `socket_path`."""

    def __init__(self, socket_path: Path, servicer: DevicePluginService) -> None:
        if len(str(socket_path)) > MAX_SOCKET_PATH:
            raise RegistrationError(
                f"socket path {socket_path} is longer than {MAX_SOCKET_PATH} bytes;"
                " use a shorter --kubelet-dir"
            )
        self.socket_path = socket_path
        self.servicer = servicer
        self._server: grpc.Server | None = None
        self._executor: futures.ThreadPoolExecutor | None = None
        self._inode: int | None = None

    def start(self) -> None:
        """Serve; the kubelet dials back as soon as it gets a Register, so this comes first."""
        executor = futures.ThreadPoolExecutor(max_workers=_WORKERS)
        server = grpc.server(executor)
        api_pb2_grpc.add_DevicePluginServicer_to_server(self.servicer, server)
        try:
            # Replaces a socket left at the path (ours from before a kubelet restart).
            bind_unix_socket_path(
                self.socket_path,
                lambda address: server.add_insecure_port(f"unix://{address}"),
                SOCKET_MODE,
            )
        except UnixSocketError:
            executor.shutdown(wait=False)
            raise
        server.start()
        self._server = server
        self._executor = executor
        try:
            self._inode = self.socket_path.stat().st_ino
        except FileNotFoundError:
            # Deleted as soon as made (a kubelet cleaning up): socket_present says so, and the
            # manager serves anew before it registers.
            self._inode = None

    def stop(self, grace: float | None = 0.2) -> None:
        server, self._server = self._server, None
        if server is None:
            return
        server.stop(grace).wait()
        # grpc never shuts down the pool it was given; without this every restart (each kubelet
        # restart) would leave its threads behind.
        if self._executor is not None:
            self._executor.shutdown(wait=False)
            self._executor = None
        # Remove the socket only if it is still ours: a restarted server may own the path now.
        try:
            if self._inode is not None and self.socket_path.stat().st_ino == self._inode:
                self.socket_path.unlink()
        except FileNotFoundError:
            pass

    @property
    def socket_present(self) -> bool:
        """False once someone (a restarting kubelet) removed our socket file."""
        try:
            return self.socket_path.stat().st_ino == self._inode
        except FileNotFoundError:
            return False


def register_with_kubelet(
    kubelet_dir: Path,
    resource_name: str,
    endpoint: str,
    options: api_pb2.DevicePluginOptions,
    timeout: float = 5.0,
) -> None:
    """Register `endpoint` (a socket name in `kubelet_dir`) for `resource_name`."""
    kubelet_socket = kubelet_dir / KUBELET_SOCKET
    if not kubelet_socket.exists():
        raise RegistrationError(f"{kubelet_socket} does not exist (is the kubelet running?)")
    request = api_pb2.RegisterRequest(
        version=API_VERSION, endpoint=endpoint, resource_name=resource_name, options=options
    )
    with grpc.insecure_channel(f"unix://{kubelet_socket}") as channel:
        try:
            api_pb2_grpc.RegistrationStub(channel).Register(request, timeout=timeout)
        except grpc.RpcError as error:
            detail = error.details() if isinstance(error, grpc.Call) else str(error)
            raise RegistrationError(
                f"kubelet at {kubelet_socket} refused {resource_name}:"
                f" {quote_untrusted(detail or '')}"
            ) from error


def socket_name(resource_name: str) -> str:
    """Our socket for a resource: prefixed so it never collides with another plugin's."""
    return "kubevirt-iommufd-" + resource_name.replace("/", "_") + ".sock"


def remove_stale_sockets(kubelet_dir: Path) -> None:
    """Sockets a previous run of ours left (after a crash); nothing else is touched."""
    for entry in kubelet_dir.glob("kubevirt-iommufd-*.sock"):
        entry.unlink(missing_ok=True)
