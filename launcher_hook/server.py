"""The sidecar's gRPC face: Info and Callbacks v1alpha1..3 on one unix socket.

Servicers only convert between protobuf messages and bytes for `define_domain`, and between hook
errors and gRPC status codes. virt-launcher picks the newest version we offer; older launchers
get the older ones from the same socket.
"""

from __future__ import annotations

import logging
import shutil
import tempfile
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import NoReturn

import grpc

from launcher_hook.errors import InvalidInput, IommufdRequired
from launcher_hook.hooks.info import api_pb2 as info_pb2
from launcher_hook.hooks.info import api_pb2_grpc as info_grpc
from launcher_hook.hooks.v1alpha1 import api_pb2 as v1alpha1_pb2
from launcher_hook.hooks.v1alpha1 import api_pb2_grpc as v1alpha1_grpc
from launcher_hook.hooks.v1alpha2 import api_pb2 as v1alpha2_pb2
from launcher_hook.hooks.v1alpha2 import api_pb2_grpc as v1alpha2_grpc
from launcher_hook.hooks.v1alpha3 import api_pb2 as v1alpha3_pb2
from launcher_hook.hooks.v1alpha3 import api_pb2_grpc as v1alpha3_grpc
from launcher_hook.parse import MAX_DOMAIN_BYTES, MAX_VMI_BYTES

log = logging.getLogger(__name__)

VERSIONS = ("v1alpha1", "v1alpha2", "v1alpha3")
HOOK_POINTS = ("OnDefineDomain", "Shutdown")
# virt-launcher runs hooks of equal priority in the order it found them; we need no place.
PRIORITY = 0
# Above gRPC's 4 MiB default, so an oversized domain reaches our own check and its clear message.
_MAX_MESSAGE = MAX_DOMAIN_BYTES + MAX_VMI_BYTES + 64 * 1024
_SHUTDOWN_GRACE_S = 5.0
# Owner only: KubeVirt runs each hook sidecar as the compute container's user (107, or root for a
# root VMI), and virt-launcher in that container is the one peer.
SOCKET_MODE = 0o600

DefineDomain = Callable[[bytes, bytes], bytes]


class InfoServicer:
    def __init__(self, name: str) -> None:
        self._name = name

    def Info(
        self, request: info_pb2.InfoParams, context: grpc.ServicerContext
    ) -> info_pb2.InfoResult:
        return info_pb2.InfoResult(
            name=self._name,
            versions=VERSIONS,
            hookPoints=[info_pb2.HookPoint(name=p, priority=PRIORITY) for p in HOOK_POINTS],
        )


class CallbacksV1alpha1:
    def __init__(self, define: DefineDomain) -> None:
        self._define = define

    def OnDefineDomain(
        self, request: v1alpha1_pb2.OnDefineDomainParams, context: grpc.ServicerContext
    ) -> v1alpha1_pb2.OnDefineDomainResult:
        xml = _define(self._define, request.domainXML, request.vmi, context)
        return v1alpha1_pb2.OnDefineDomainResult(domainXML=xml)


class CallbacksV1alpha2:
    def __init__(self, define: DefineDomain) -> None:
        self._define = define

    def OnDefineDomain(
        self, request: v1alpha2_pb2.OnDefineDomainParams, context: grpc.ServicerContext
    ) -> v1alpha2_pb2.OnDefineDomainResult:
        xml = _define(self._define, request.domainXML, request.vmi, context)
        return v1alpha2_pb2.OnDefineDomainResult(domainXML=xml)

    def PreCloudInitIso(
        self, request: v1alpha2_pb2.PreCloudInitIsoParams, context: grpc.ServicerContext
    ) -> v1alpha2_pb2.PreCloudInitIsoResult:
        return v1alpha2_pb2.PreCloudInitIsoResult(
            cloudInitNoCloudSource=request.cloudInitNoCloudSource,
            cloudInitData=request.cloudInitData,
        )


class CallbacksV1alpha3:
    def __init__(self, define: DefineDomain, on_shutdown: Callable[[], None]) -> None:
        self._define = define
        self._on_shutdown = on_shutdown

    def OnDefineDomain(
        self, request: v1alpha3_pb2.OnDefineDomainParams, context: grpc.ServicerContext
    ) -> v1alpha3_pb2.OnDefineDomainResult:
        xml = _define(self._define, request.domainXML, request.vmi, context)
        return v1alpha3_pb2.OnDefineDomainResult(domainXML=xml)

    def PreCloudInitIso(
        self, request: v1alpha3_pb2.PreCloudInitIsoParams, context: grpc.ServicerContext
    ) -> v1alpha3_pb2.PreCloudInitIsoResult:
        return v1alpha3_pb2.PreCloudInitIsoResult(
            cloudInitNoCloudSource=request.cloudInitNoCloudSource,
            cloudInitData=request.cloudInitData,
        )

    def Shutdown(
        self, request: v1alpha3_pb2.ShutdownParams, context: grpc.ServicerContext
    ) -> v1alpha3_pb2.ShutdownResult:
        log.info("Shutdown: virt-launcher is done with the VMI, stopping")
        # The server stops from the serving thread once this answer is on its way.
        self._on_shutdown()
        return v1alpha3_pb2.ShutdownResult()


def _define(
    define: DefineDomain, domain_xml: bytes, vmi: bytes, context: grpc.ServicerContext
) -> bytes:
    try:
        return define(domain_xml, vmi)
    except InvalidInput as error:
        log.warning("OnDefineDomain refused: %s", error)
        _abort(context, grpc.StatusCode.INVALID_ARGUMENT, str(error))
    except IommufdRequired as error:
        log.warning("OnDefineDomain failed: %s", error)
        _abort(context, grpc.StatusCode.FAILED_PRECONDITION, str(error))


def _abort(context: grpc.ServicerContext, code: grpc.StatusCode, message: str) -> NoReturn:
    context.abort(code, message)
    raise AssertionError("grpc's abort returned")  # abort always raises


class HookServer:
    """The gRPC server on `<socket_dir>/<name>.sock`, until `stop()` or a Shutdown call."""

    def __init__(self, socket_path: Path, name: str, define: DefineDomain) -> None:
        self.socket_path = socket_path
        self._stopping = threading.Event()
        self._server = grpc.server(
            ThreadPoolExecutor(max_workers=4, thread_name_prefix="hook"),
            options=[
                ("grpc.max_receive_message_length", _MAX_MESSAGE),
                ("grpc.max_send_message_length", _MAX_MESSAGE),
            ],
        )
        info_grpc.add_InfoServicer_to_server(InfoServicer(name), self._server)
        v1alpha1_grpc.add_CallbacksServicer_to_server(CallbacksV1alpha1(define), self._server)
        v1alpha2_grpc.add_CallbacksServicer_to_server(CallbacksV1alpha2(define), self._server)
        v1alpha3_grpc.add_CallbacksServicer_to_server(
            CallbacksV1alpha3(define, self._stopping.set), self._server
        )

    def start(self) -> None:
        directory = self.socket_path.parent
        directory.mkdir(parents=True, exist_ok=True)
        # Bound in a private directory, given its mode there and renamed into place: the socket
        # never shows the umask's mode, and a file left by an earlier run is replaced at once.
        # virt-launcher dials every file in our directory but skips subdirectories.
        staging = Path(tempfile.mkdtemp(prefix=".", dir=directory))
        try:
            staged = staging / "s"
            self._server.add_insecure_port(f"unix:{staged}")
            staged.chmod(SOCKET_MODE)
            staged.rename(self.socket_path)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
        self._server.start()
        log.info("serving %s on %s", ", ".join(VERSIONS), self.socket_path)

    def stop(self) -> None:
        self._stopping.set()

    def wait(self) -> None:
        """Block until stopped, let calls in flight (the Shutdown answer) finish, clean up."""
        self._stopping.wait()
        self._server.stop(_SHUTDOWN_GRACE_S).wait()
        self.socket_path.unlink(missing_ok=True)
        log.info("stopped")
