"""The gRPC side of a resource: a server on its own unix socket in the kubelet's directory, and
the Register call that tells the kubelet where it is."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Protocol

import grpc

from deviceplugin.v1beta1 import api_pb2, api_pb2_grpc
from hostdev.grpc_socket import GrpcSocketServer
from hostdev.unix_socket import MAX_SOCKET_PATH
from hostdev.untrusted import quote_untrusted

log = logging.getLogger(__name__)

API_VERSION = "v1beta1"
KUBELET_SOCKET = "kubelet.sock"


class RegistrationError(Exception):
    """The kubelet did not accept (or could not be asked about) a registration."""


class DevicePluginService(Protocol):
    @property
    def options(self) -> api_pb2.DevicePluginOptions:
        """What the servicer implements, as told to the kubelet on Register."""
        ...


class PluginServer(GrpcSocketServer):
    """Serves one resource's DevicePlugin service on `socket_path`.

    `start` comes before Register: the kubelet dials back as soon as it gets one.
    """

    def __init__(self, socket_path: Path, servicer: DevicePluginService) -> None:
        if len(str(socket_path)) > MAX_SOCKET_PATH:
            raise RegistrationError(
                f"socket path {socket_path} is longer than {MAX_SOCKET_PATH} bytes;"
                " use a shorter --kubelet-dir"
            )
        super().__init__(
            socket_path,
            lambda server: api_pb2_grpc.add_DevicePluginServicer_to_server(servicer, server),
        )
        self.servicer = servicer


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
