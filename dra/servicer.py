"""The kubelet-facing gRPC services: plugin registration, and DRAPlugin in both versions the
kubelet may speak. They only convert between protobuf messages and the preparer's values."""

from __future__ import annotations

import logging
from types import ModuleType
from typing import Any

import grpc

from dra.claims import ClaimRef
from dra.pluginregistration.v1 import api_pb2 as registration_pb2
from dra.prepare import ClaimPreparer
from dra.v1 import api_pb2 as v1_pb2
from dra.v1beta1 import api_pb2 as v1beta1_pb2
from hostdev.untrusted import quote_untrusted

log = logging.getLogger(__name__)

PLUGIN_TYPE = "DRAPlugin"
# The kubelet takes the first version it knows, so the newest comes first.
SUPPORTED_VERSIONS = ("v1.DRAPlugin", "v1beta1.DRAPlugin")


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

    def __init__(self, preparer: ClaimPreparer) -> None:
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
                for d in answer.devices
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


def _ref(claim: Any) -> ClaimRef:
    return ClaimRef(namespace=claim.namespace, name=claim.name, uid=claim.uid)
