"""The driver's two sockets in the kubelet's directory, kept there for as long as it runs.

`plugins/<driver>/dra.sock` serves DRAPlugin (v1 and v1beta1) and DRAResourceHealth (v1,
v1beta1, v1alpha1); `plugins_registry/<driver>-reg.sock`
serves Registration, and its appearance is what makes the kubelet's plugin watcher call GetInfo.
A restarting kubelet may wipe either directory: a guard thread notices a socket that is gone (or
is no longer ours) within `check_interval` and serves it anew, which registers the driver again.
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path

import grpc

from dra.health_stream import HealthStreams
from dra.healthapi.v1 import api_pb2_grpc as health_v1_grpc
from dra.healthapi.v1alpha1 import api_pb2_grpc as health_v1alpha1_grpc
from dra.healthapi.v1beta1 import api_pb2_grpc as health_v1beta1_grpc
from dra.pluginregistration.v1 import api_pb2_grpc as registration_grpc
from dra.servicer import (
    DraServicerV1,
    DraServicerV1beta1,
    HealthServicerV1,
    HealthServicerV1alpha1,
    HealthServicerV1beta1,
    RegistrationServicer,
)
from dra.v1 import api_pb2_grpc as v1_grpc
from dra.v1beta1 import api_pb2_grpc as v1beta1_grpc
from hostdev.grpc_socket import GrpcSocketServer

log = logging.getLogger(__name__)


def dra_socket_path(kubelet_dir: Path, driver: str) -> Path:
    return kubelet_dir / "plugins" / driver / "dra.sock"


def registration_socket_path(kubelet_dir: Path, driver: str) -> Path:
    return kubelet_dir / "plugins_registry" / f"{driver}-reg.sock"


class KubeletSockets:
    def __init__(
        self,
        kubelet_dir: Path,
        driver: str,
        v1: DraServicerV1,
        v1beta1: DraServicerV1beta1,
        health: HealthStreams,
        check_interval: float = 0.2,
    ) -> None:
        dra_path = dra_socket_path(kubelet_dir, driver)
        self.registration = RegistrationServicer(driver, str(dra_path))

        def add_dra(server: grpc.Server) -> None:
            v1_grpc.add_DRAPluginServicer_to_server(v1, server)
            v1beta1_grpc.add_DRAPluginServicer_to_server(v1beta1, server)
            health_v1_grpc.add_DRAResourceHealthServicer_to_server(HealthServicerV1(health), server)
            health_v1beta1_grpc.add_DRAResourceHealthServicer_to_server(
                HealthServicerV1beta1(health), server
            )
            health_v1alpha1_grpc.add_DRAResourceHealthServicer_to_server(
                HealthServicerV1alpha1(health), server
            )

        def add_registration(server: grpc.Server) -> None:
            registration_grpc.add_RegistrationServicer_to_server(self.registration, server)

        # The DRA socket first: the kubelet dials it as soon as registration succeeds.
        self._served = (
            GrpcSocketServer(dra_path, add_dra),
            GrpcSocketServer(registration_socket_path(kubelet_dir, driver), add_registration),
        )
        self._interval = check_interval
        self._stop = threading.Event()
        self._guard: threading.Thread | None = None
        self.restarts = 0
        """How often a socket was found gone and served again (a kubelet restart, mostly)."""

    def start(self) -> None:
        for served in self._served:
            served.start()
        self._guard = threading.Thread(target=self._watch, name="dra-sockets", daemon=True)
        self._guard.start()

    def stop(self) -> None:
        self._stop.set()
        if self._guard is not None:
            self._guard.join()
        for served in reversed(self._served):
            served.stop()

    def _watch(self) -> None:
        while not self._stop.wait(self._interval):
            for served in self._served:
                if served.present:
                    continue
                log.warning("%s is gone (kubelet restart?): serving it again", served.path)
                try:
                    served.restart()
                    self.restarts += 1
                except OSError as error:
                    log.error("cannot serve %s again: %s; retrying", served.path, error)
