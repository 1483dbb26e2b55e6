"""A stand-in for the kubelet's pod resources API (`v1.PodResourcesLister` on
`pod-resources/kubelet.sock`) over real gRPC: tests say which pods hold which
devices, and the plugin's List calls see exactly that. Get and GetAllocatableResources answer
UNIMPLEMENTED (the generated servicer's default), since the plugin only lists."""

from __future__ import annotations

import threading
from concurrent import futures
from dataclasses import dataclass
from pathlib import Path

import grpc

from deviceplugin.podresources.v1 import api_pb2, api_pb2_grpc


@dataclass(frozen=True, slots=True)
class PodDevices:
    namespace: str
    pod: str
    container: str
    resource: str
    device_ids: tuple[str, ...]


class PodResourcesStandIn:
    def __init__(self, socket: Path) -> None:
        self.socket = socket
        self._pods: dict[tuple[str, str], list[PodDevices]] = {}
        self._lock = threading.Lock()
        self._listed = threading.Condition(self._lock)
        self._list_calls = 0
        self._server: grpc.Server | None = None

    def start(self) -> None:
        self.socket.parent.mkdir(parents=True, exist_ok=True)
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        api_pb2_grpc.add_PodResourcesListerServicer_to_server(_Lister(self), server)
        server.add_insecure_port(f"unix://{self.socket}")
        server.start()
        self._server = server

    def stop(self) -> None:
        if self._server is not None:
            self._server.stop(0).wait()
            self._server = None
        self.socket.unlink(missing_ok=True)

    def assign(
        self,
        pod: str,
        resource: str,
        device_ids: list[str],
        *,
        namespace: str = "default",
        container: str = "compute",
    ) -> None:
        """`pod` runs with these devices (added to what it already has)."""
        with self._lock:
            self._pods.setdefault((namespace, pod), []).append(
                PodDevices(namespace, pod, container, resource, tuple(device_ids))
            )

    def remove(self, pod: str, *, namespace: str = "default") -> None:
        """`pod` is gone, and so are its devices."""
        with self._lock:
            del self._pods[(namespace, pod)]

    @property
    def list_calls(self) -> int:
        with self._lock:
            return self._list_calls

    def wait_listed(self, after: int, timeout: float = 5.0) -> None:
        """Until a List call beyond the `after`-th one has been answered."""
        with self._listed:
            if not self._listed.wait_for(lambda: self._list_calls > after, timeout):
                raise AssertionError(f"no List call within {timeout} s")

    def _response(self) -> api_pb2.ListPodResourcesResponse:
        with self._lock:
            pods = [list(entries) for entries in self._pods.values()]
        response = api_pb2.ListPodResourcesResponse()
        for entries in pods:
            pod = response.pod_resources.add(name=entries[0].pod, namespace=entries[0].namespace)
            containers: dict[str, api_pb2.ContainerResources] = {}
            for entry in entries:
                container = containers.get(entry.container)
                if container is None:
                    container = pod.containers.add(name=entry.container)
                    containers[entry.container] = container
                container.devices.add(resource_name=entry.resource, device_ids=entry.device_ids)
        return response

    def _count_list(self) -> None:
        with self._listed:
            self._list_calls += 1
            self._listed.notify_all()


class _Lister(api_pb2_grpc.PodResourcesListerServicer):  # type: ignore[misc]
    def __init__(self, standin: PodResourcesStandIn) -> None:
        self._standin = standin

    def List(
        self, request: api_pb2.ListPodResourcesRequest, context: grpc.ServicerContext
    ) -> api_pb2.ListPodResourcesResponse:
        response = self._standin._response()
        self._standin._count_list()
        return response
