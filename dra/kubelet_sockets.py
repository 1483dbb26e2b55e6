"""The driver's two sockets in the kubelet's directory, kept there for as long as it runs.

`plugins/<driver>/dra.sock` serves DRAPlugin (v1 and v1beta1) and DRAResourceHealth (v1,
v1beta1, v1alpha1); `plugins_registry/<driver>-reg.sock`
serves Registration, and its appearance is what makes the kubelet's plugin watcher call GetInfo.
An instance started with its pod's UID (a DaemonSet's rolling update runs the old and the new pod
side by side) puts the UID in both names, as the kubeletplugin helper's `RollingUpdate(uid)` does
(k8s.io/dynamic-resource-allocation kubeletplugin/draplugin.go): the kubelet (1.33 and later)
keeps both registrations, calls the newest and falls back to the other when that one's
registration socket goes (pkg/kubelet/cm/dra/plugin/dra_plugin_manager.go `get` and `remove`).
A restarting kubelet may wipe either directory: a guard thread notices a socket that is gone (or
is no longer ours) within `check_interval` and serves it anew, which registers the driver again.

The node's only instance serves both sockets before the rest of the driver is loaded
(`build_kubelet_front`): the kubelet sees the driver (its plugin watcher calls GetInfo) from grpc
and the protocol stubs alone, nothing here importing the preparer, the host scan or the API
client, which load afterwards. A claim prepared before recovery finished could be given a device
an interrupted bind still holds, so NodePrepare and NodeUnprepare wait at a gate
(`PreparerWhenReady`) — at most `READY_WAIT_SECONDS`, under the kubelet's 45 s deadline, so that
it hears why from a start slower than that (and retries), and a start that failed answers them
with its error at once.

An instance of a rolling update serves its registration only once it is ready
(`KubeletFront.ready`): the kubelet calls the newest registration, so a new instance registered
early would take the calls and keep them at its gate — past the kubelet's deadline on a slow
node — while the old instance, ready, could have answered them. Unregistered, the new instance
leaves them to the old one until it can answer them itself; alone on the node (after a reboot)
it registers all the same, once ready. Its DRA socket is served from the start: nobody dials it
before the registration names it, and then it must be there.
"""

from __future__ import annotations

import base64
import logging
import math
import os
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import grpc

from dra.claims import ClaimRef
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
    Preparer,
    RegistrationServicer,
)
from dra.v1 import api_pb2_grpc as v1_grpc
from dra.v1beta1 import api_pb2_grpc as v1beta1_grpc
from hostdev.grpc_socket import GrpcSocketServer
from hostdev.unix_socket import MAX_SOCKET_PATH

if TYPE_CHECKING:
    from dra.state import PreparedClaim

log = logging.getLogger(__name__)


def dra_socket_path(kubelet_dir: Path, driver: str, instance_uid: str = "") -> Path:
    """`plugins/<driver>/dra.sock`, or `dra-<pod UID>.sock` for one of several instances (a
    hash of the UID when that path is too long for a unix socket)."""
    directory = kubelet_dir / "plugins" / driver
    if not instance_uid:
        return directory / "dra.sock"
    return _first_fitting(
        directory, (f"dra-{instance_uid}.sock", f"dra-{_hashed(instance_uid, 8)}.sock")
    )


def registration_socket_path(kubelet_dir: Path, driver: str, instance_uid: str = "") -> Path:
    """`plugins_registry/<driver>-reg.sock`, or for one of several instances the first that fits
    a unix socket's address of `<driver>-<pod UID>-reg.sock`,
    `<driver>-<base64url(sha256(UID))[:8 bytes]>-reg.sock` and
    `dra-<base64url(sha256(driver NUL UID))[:16 bytes]>-reg.sock`, as the kubeletplugin helper
    names them (`RollingUpdateRegistrarSocketFile`)."""
    directory = kubelet_dir / "plugins_registry"
    if not instance_uid:
        return directory / f"{driver}-reg.sock"
    return _first_fitting(
        directory,
        (
            f"{driver}-{instance_uid}-reg.sock",
            f"{driver}-{_hashed(instance_uid, 8)}-reg.sock",
            f"dra-{_hashed(driver + chr(0) + instance_uid, 16)}-reg.sock",
        ),
    )


def serialize_lock_path(kubelet_dir: Path, driver: str) -> Path:
    """The lock every instance of the driver holds around a prepare or unprepare and its start-up
    recovery, as the kubeletplugin helper's `serialize.lock` in the plugin's directory."""
    return kubelet_dir / "plugins" / driver / "serialize.lock"


def _hashed(text: str, size: int) -> str:
    # Imported here: only an instance of a rolling update needs it, and not to answer GetInfo.
    import hashlib

    digest = hashlib.sha256(text.encode()).digest()[:size]
    return base64.urlsafe_b64encode(digest).rstrip(b"=").decode()


def _first_fitting(directory: Path, names: tuple[str, ...]) -> Path:
    """The first name whose path fits a unix socket's address; the last if none does (serving
    it then fails, naming the path and the limit)."""
    for name in names:
        if len(os.fsencode(directory / name)) <= MAX_SOCKET_PATH:
            return directory / name
    return directory / names[-1]


class KubeletSockets:
    def __init__(
        self,
        kubelet_dir: Path,
        driver: str,
        v1: DraServicerV1,
        v1beta1: DraServicerV1beta1,
        health: HealthStreams,
        check_interval: float = 0.2,
        *,
        instance_uid: str = "",
    ) -> None:
        dra_path = dra_socket_path(kubelet_dir, driver, instance_uid)
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

        self._dra_socket = GrpcSocketServer(dra_path, add_dra)
        self._registration_socket = GrpcSocketServer(
            registration_socket_path(kubelet_dir, driver, instance_uid), add_registration
        )
        self._instance_uid = instance_uid
        # What the guard serves again when it goes: the DRA socket first (the kubelet dials it as
        # soon as registration succeeds), the registration once served.
        self._served: tuple[GrpcSocketServer, ...] = ()
        self._interval = check_interval
        self._stop = threading.Event()
        self._guard: threading.Thread | None = None
        self.restarts = 0
        """How often a socket was found gone and served again (a kubelet restart, mostly)."""

    @property
    def serving(self) -> bool:
        """Started and not stopped since."""
        return self._guard is not None and not self._stop.is_set()

    def start(self) -> None:
        """Serve the DRA socket and, for the node's only instance, the registration; an
        instance of a rolling update registers with `register`, once ready."""
        self._dra_socket.start()
        self._served = (self._dra_socket,)
        if not self._instance_uid:
            self._serve_registration()
        self._guard = threading.Thread(target=self._watch, name="dra-sockets", daemon=True)
        self._guard.start()

    def register(self) -> None:
        """The driver is ready for the kubelet's calls: serve the registration (an instance of
        a rolling update; the only instance serves it from the start). Raises OSError when the
        socket cannot be made."""
        if self._registration_socket in self._served:
            return
        self._serve_registration()
        log.info(
            "ready: serving the registration at %s; the kubelet calls instance %s from now on",
            self._registration_socket.path,
            self._instance_uid,
        )

    def _serve_registration(self) -> None:
        self._registration_socket.start()
        self._served = (self._dra_socket, self._registration_socket)

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


READY_WAIT_SECONDS = 40.0


class PreparerWhenReady:
    """Hands the kubelet's calls to the preparer once `ready` gave it; until then they wait."""

    def __init__(self, wait_seconds: float = READY_WAIT_SECONDS) -> None:
        self._wait_seconds = wait_seconds
        self._settled = threading.Event()
        self._settling = threading.Lock()
        self._preparer: Preparer | None = None
        self._failure = ""

    def ready(self, preparer: Preparer) -> None:
        """Recovery is done: let the calls through, the waiting ones first. Once `failed`, the
        calls keep their answer."""
        with self._settling:
            if not self._settled.is_set():
                self._preparer = preparer
                self._settled.set()

    def failed(self, reason: str) -> None:
        """The start failed (the driver stops): the waiting calls, and any later, get `reason`.
        Once `ready`, the calls keep going to the preparer until the sockets go."""
        with self._settling:
            if not self._settled.is_set():
                self._failure = reason
                self._settled.set()

    def prepare(self, refs: Sequence[ClaimRef]) -> dict[str, PreparedClaim | str]:
        preparer = self._wait()
        if isinstance(preparer, str):
            return {ref.uid: f"{ref}: {preparer}" for ref in refs}
        return preparer.prepare(refs)

    def unprepare(self, refs: Sequence[ClaimRef]) -> dict[str, str | None]:
        preparer = self._wait()
        if isinstance(preparer, str):
            return {ref.uid: f"{ref}: cannot clean up: {preparer}" for ref in refs}
        return preparer.unprepare(refs)

    def _wait(self) -> Preparer | str:
        """The preparer, or why there is none."""
        if not self._settled.wait(self._wait_seconds):
            return (
                f"the driver is still starting after {self._wait_seconds:g} s (recovering the"
                " prepared claims and reading the host); the kubelet retries"
            )
        if self._preparer is None:
            return (
                f"the driver failed to start: {self._failure}; it stops, and its pod is"
                " restarted (see its log)"
            )
        return self._preparer


@dataclass(frozen=True, slots=True)
class KubeletFront:
    gate: PreparerWhenReady
    health: HealthStreams
    sockets: KubeletSockets

    def ready(self, preparer: Preparer) -> None:
        """Everything the first prepare needs is there — the claims recovered, the host read,
        the API client loaded (the `dra` command loads it first when it has an instance UID):
        the calls go through, and an instance of a rolling update registers. Raises OSError
        when the registration cannot be served."""
        self.gate.ready(preparer)
        self.sockets.register()


def build_kubelet_front(
    kubelet_dir: Path,
    driver: str,
    node: str,
    rescan_interval: float,
    instance_uid: str = "",
    *,
    ready_wait_seconds: float = READY_WAIT_SECONDS,
) -> KubeletFront:
    """The sockets (not served yet), their health streams and the gate before the preparer."""
    gate = PreparerWhenReady(ready_wait_seconds)
    # Events re-judge a device at once, but the periodic re-scan is the one check that always
    # comes: three re-scans missed (a stuck event thread) is when the kubelet should stop
    # believing us, and never sooner than its own 30 s default.
    health = HealthStreams(node, timeout_seconds=max(30, math.ceil(3 * rescan_interval)))
    sockets = KubeletSockets(
        kubelet_dir,
        driver,
        DraServicerV1(gate),
        DraServicerV1beta1(gate),
        health,
        instance_uid=instance_uid,
    )
    return KubeletFront(gate, health, sockets)
