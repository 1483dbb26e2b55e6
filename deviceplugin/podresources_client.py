"""Which devices pods hold, from the kubelet's pod resources API (`v1.PodResourcesLister/List`
on `<pod-resources dir>/kubelet.sock`), polled in a thread that posts what it sees as events."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType

import grpc

from deviceplugin.podresources.v1 import api_pb2, api_pb2_grpc

log = logging.getLogger(__name__)

_LIST_TIMEOUT_SECONDS = 5.0


class PodResourcesError(Exception):
    """The kubelet's pod resources API could not be asked."""


@dataclass(frozen=True, slots=True)
class AssignmentsSeen:
    """Device ids held by pods, by resource name, as of `at` (monotonic seconds)."""

    assigned: Mapping[str, frozenset[str]]
    at: float


@dataclass(frozen=True, slots=True)
class AssignmentsUnavailable:
    error: str


def read_assignments(
    socket: Path, timeout: float = _LIST_TIMEOUT_SECONDS
) -> dict[str, frozenset[str]]:
    """One List call: every device id any container of a running pod holds, by resource."""
    if not socket.exists():
        raise PodResourcesError(
            f"{socket} does not exist: is the kubelet running, and is its pod-resources"
            " directory mounted into the plugin's pod?"
        )
    # A fresh channel per call: gRPC's reconnect back-off could otherwise leave us minutes
    # behind a restarted kubelet.
    with grpc.insecure_channel(f"unix://{socket}") as channel:
        stub = api_pb2_grpc.PodResourcesListerStub(channel)
        try:
            response = stub.List(api_pb2.ListPodResourcesRequest(), timeout=timeout)
        except grpc.RpcError as error:
            detail = error.details() if isinstance(error, grpc.Call) else str(error)
            raise PodResourcesError(f"List on {socket} failed: {detail}") from error
    assigned: dict[str, set[str]] = {}
    for pod in response.pod_resources:
        for container in pod.containers:
            for devices in container.devices:
                assigned.setdefault(devices.resource_name, set()).update(devices.device_ids)
    return {name: frozenset(ids) for name, ids in assigned.items()}


class AssignmentPoller:
    """Calls List every `interval` seconds, and soon after `poke()` (an Allocate just
    happened), posting AssignmentsSeen or AssignmentsUnavailable."""

    def __init__(
        self,
        socket: Path,
        interval: float,
        emit: Callable[[AssignmentsSeen | AssignmentsUnavailable], None],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._socket = socket
        self._interval = interval
        self._emit = emit
        self._clock = clock
        self._wake = threading.Event()
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="pod-resources", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def poke(self) -> None:
        self._wake.set()

    def stop(self) -> None:
        self._stopping.set()
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join()

    def _run(self) -> None:
        while not self._stopping.is_set():
            at = self._clock()
            try:
                assigned = read_assignments(self._socket)
            except PodResourcesError as error:
                self._emit(AssignmentsUnavailable(str(error)))
            else:
                self._emit(AssignmentsSeen(MappingProxyType(assigned), at))
            self._wake.wait(self._interval)
            self._wake.clear()
