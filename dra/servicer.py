"""The kubelet-facing gRPC services: plugin registration, DRAPlugin in both versions the kubelet
may speak, and DRAResourceHealth in all three. They only convert between protobuf messages and the
preparer's values or the health streams' lists. What they import is what the kubelet needs to see
the driver (dra.kubelet_sockets): grpc and the protocol stubs, nothing of the preparer."""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from types import ModuleType
from typing import TYPE_CHECKING, Any, Protocol

import grpc

from dra.claims import ClaimRef
from dra.health import DeviceHealth
from dra.health_stream import HealthStreams, TooManyWatchers, build_message
from dra.healthapi.v1 import api_pb2 as health_v1_pb2
from dra.healthapi.v1alpha1 import api_pb2 as health_v1alpha1_pb2
from dra.healthapi.v1beta1 import api_pb2 as health_v1beta1_pb2
from dra.pluginregistration.v1 import api_pb2 as registration_pb2
from dra.v1 import api_pb2 as v1_pb2
from dra.v1beta1 import api_pb2 as v1beta1_pb2
from hostdev.untrusted import quote_untrusted

if TYPE_CHECKING:
    from dra.state import PreparedClaim

log = logging.getLogger(__name__)

PLUGIN_TYPE = "DRAPlugin"
# The kubelet takes the first DRAPlugin version it knows, so the newest comes first; the health
# services follow (an older kubelet skips names it does not know) and the kubelet picks the newest
# of them it speaks: v1 where it can, v1alpha1 on 1.34-1.36 (pkg/kubelet/cm/dra/plugin,
# pickHealthService).
DRA_VERSIONS = ("v1.DRAPlugin", "v1beta1.DRAPlugin")
HEALTH_VERSIONS = (
    "v1.DRAResourceHealth",
    "v1beta1.DRAResourceHealth",
    "v1alpha1.DRAResourceHealth",
)
SUPPORTED_VERSIONS = DRA_VERSIONS + HEALTH_VERSIONS


class Preparer(Protocol):
    """What answers the kubelet's DRAPlugin calls (dra.prepare.ClaimPreparer), per claim UID:
    the prepared claim or an error message."""

    def prepare(self, refs: Sequence[ClaimRef]) -> dict[str, PreparedClaim | str]: ...

    def unprepare(self, refs: Sequence[ClaimRef]) -> dict[str, str | None]: ...


class RegistrationServicer:
    """Answers the kubelet's plugin watcher: who we are and where the DRA service is."""

    def __init__(self, driver: str, endpoint: str) -> None:
        self._info = registration_pb2.PluginInfo(
            type=PLUGIN_TYPE,
            name=driver,
            endpoint=endpoint,
            supported_versions=list(SUPPORTED_VERSIONS),
        )
        self.registered: bool | None = None
        """What the kubelet last said: True, False (refused), None (not yet)."""

    def GetInfo(
        self, request: registration_pb2.InfoRequest, context: grpc.ServicerContext
    ) -> registration_pb2.PluginInfo:
        return self._info

    def NotifyRegistrationStatus(
        self, request: registration_pb2.RegistrationStatus, context: grpc.ServicerContext
    ) -> registration_pb2.RegistrationStatusResponse:
        self.registered = request.plugin_registered
        if request.plugin_registered:
            log.info("kubelet registered driver %s", self._info.name)
        else:
            log.error(
                "kubelet refused driver %s: %s",
                self._info.name,
                quote_untrusted(request.error, 500),
            )
        return registration_pb2.RegistrationStatusResponse()


class _DraService:
    """NodePrepareResources and NodeUnprepareResources for one protocol version, whose messages
    come from `pb2` (v1 and v1beta1 differ only in v1's optional share_id, unused here)."""

    pb2: ModuleType

    def __init__(self, preparer: Preparer) -> None:
        self._preparer = preparer

    def NodePrepareResources(self, request: Any, context: grpc.ServicerContext) -> Any:
        answers = self._preparer.prepare([_ref(c) for c in request.claims])
        response = self.pb2.NodePrepareResourcesResponse()
        for uid, answer in answers.items():
            entry = response.claims[uid]
            if isinstance(answer, str):
                # Protobuf strings must be UTF-8: one unencodable character from a peer must not
                # fail the whole call (gRPC UNKNOWN) instead of this claim.
                entry.error = answer.encode("utf-8", "backslashreplace").decode("utf-8")
                continue
            entry.devices.extend(
                self.pb2.Device(
                    request_names=[d.request],
                    pool_name=d.pool,
                    device_name=d.device,
                    cdi_device_ids=list(d.cdi_ids),
                )
                for d in answer.results
            )
        return response

    def NodeUnprepareResources(self, request: Any, context: grpc.ServicerContext) -> Any:
        answers = self._preparer.unprepare([_ref(c) for c in request.claims])
        response = self.pb2.NodeUnprepareResourcesResponse()
        for uid, error in answers.items():
            response.claims[uid].error = error or ""
        return response


class DraServicerV1(_DraService):
    pb2 = v1_pb2


class DraServicerV1beta1(_DraService):
    pb2 = v1beta1_pb2


class _HealthService:
    """NodeWatchResources for one protocol version, whose messages come from `pb2` (the three
    versions' messages are the same): the current list at once, then every newer one."""

    pb2: ModuleType

    def __init__(self, streams: HealthStreams) -> None:
        self._streams = streams

    def NodeWatchResources(self, request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
        try:
            watch = self._streams.open()
        except TooManyWatchers as error:
            log.warning("refused a health stream: %s", error)
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(error))
        # Runs when the stream ends for any reason, the kubelet cancelling it included: wakes the
        # thread waiting for the next list so that it returns and frees the slot.
        if not context.add_callback(watch.end):
            watch.end()
        try:
            while (devices := watch.next()) is not None:
                yield self._response(devices)
        finally:
            self._streams.release(watch)

    def _response(self, devices: tuple[DeviceHealth, ...]) -> Any:
        pool, timeout = self._streams.pool, self._streams.timeout_seconds
        return self.pb2.NodeWatchResourcesResponse(
            devices=[
                self.pb2.DeviceHealth(
                    device=self.pb2.DeviceIdentifier(pool_name=pool, device_name=d.device),
                    health=int(d.health),
                    last_updated_time=int(d.checked_at),
                    health_check_timeout_seconds=timeout,
                    message=build_message(d.message),
                )
                for d in devices
            ]
        )


class HealthServicerV1(_HealthService):
    pb2 = health_v1_pb2


class HealthServicerV1beta1(_HealthService):
    pb2 = health_v1beta1_pb2


class HealthServicerV1alpha1(_HealthService):
    pb2 = health_v1alpha1_pb2


def _ref(claim: Any) -> ClaimRef:
    return ClaimRef(namespace=claim.namespace, name=claim.name, uid=claim.uid)
