"""A kubelet stand-in that behaves like the real device manager (kubernetes
pkg/kubelet/cm/devicemanager) toward a plugin, over real gRPC on unix sockets. The demo runs the
real plugin against it; the tests and benchmarks do too.

- serves Registration on `kubelet.sock`; on Register it dials the plugin's endpoint at once,
  calls GetDevicePluginOptions, then reads ListAndWatch in a thread, keeping every snapshot;
- when a stream ends, every device of that resource counts as unhealthy, and it never redials;
- `restart()` does what a starting kubelet does: stop, delete every socket file in the
  directory, recreate `kubelet.sock`.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent import futures
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from deviceplugin.v1beta1 import api_pb2, api_pb2_grpc


@dataclass
class Registration:
    request: api_pb2.RegisterRequest
    at: float
    options: api_pb2.DevicePluginOptions
    channel: grpc.Channel
    stub: api_pb2_grpc.DevicePluginStub
    snapshots: list[tuple[float, dict[str, str]]] = field(default_factory=list)
    topology: dict[str, list[int]] = field(default_factory=dict)
    stream_ended: bool = False


class KubeletStandIn:
    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.registrations: list[Registration] = []
        self._changed = threading.Condition()
        self._server: grpc.Server | None = None

    # Lifecycle -------------------------------------------------------------------------------
    def start(self) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        api_pb2_grpc.add_RegistrationServicer_to_server(_Registrar(self), server)
        server.add_insecure_port(f"unix://{self.directory / 'kubelet.sock'}")
        server.start()
        self._server = server

    def stop(self) -> None:
        if self._server is not None:
            self._server.stop(0).wait()
            self._server = None
        for registration in self.registrations:
            registration.channel.close()

    def restart(self) -> None:
        """Stop, delete every socket in the directory, recreate kubelet.sock."""
        self.stop()
        for entry in self.directory.iterdir():
            if entry.is_socket():
                entry.unlink()
        self.start()

    # What the kubelet saw ----------------------------------------------------------------------
    def latest(self, resource: str) -> Registration | None:
        with self._changed:
            matching = [r for r in self.registrations if r.request.resource_name == resource]
        return matching[-1] if matching else None

    def health(self, resource: str) -> dict[str, str]:
        """Device health as the kubelet would count it now (a dead stream: all unhealthy)."""
        registration = self.latest(resource)
        if registration is None or not registration.snapshots:
            return {}
        devices = registration.snapshots[-1][1]
        if registration.stream_ended:
            return dict.fromkeys(devices, "Unhealthy")
        return dict(devices)

    def wait_for(self, condition: Callable[[], bool], timeout: float = 5.0) -> float:
        """Seconds until `condition` held; fails the test after `timeout`."""
        start = time.monotonic()
        deadline = start + timeout
        with self._changed:
            while not condition():
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise AssertionError(f"condition not met within {timeout} s")
                self._changed.wait(remaining)
        return time.monotonic() - start

    def wait_registered(self, resource: str, count: int = 1, timeout: float = 5.0) -> Registration:
        def registered() -> bool:
            done = [
                r for r in self.registrations if r.request.resource_name == resource and r.snapshots
            ]
            return len(done) >= count

        self.wait_for(registered, timeout)
        registration = self.latest(resource)
        assert registration is not None
        return registration

    # Calls the kubelet makes -------------------------------------------------------------------
    def allocate(self, resource: str, *containers: list[str]) -> api_pb2.AllocateResponse:
        registration = self._require(resource)
        request = api_pb2.AllocateRequest(
            container_requests=[
                api_pb2.ContainerAllocateRequest(devices_ids=ids) for ids in containers
            ]
        )
        response: api_pb2.AllocateResponse = registration.stub.Allocate(request, timeout=5)
        return response

    def preferred(
        self, resource: str, available: list[str], must_include: list[str], size: int
    ) -> list[str]:
        registration = self._require(resource)
        request = api_pb2.PreferredAllocationRequest(
            container_requests=[
                api_pb2.ContainerPreferredAllocationRequest(
                    available_deviceIDs=available,
                    must_include_deviceIDs=must_include,
                    allocation_size=size,
                )
            ]
        )
        response = registration.stub.GetPreferredAllocation(request, timeout=5)
        return list(response.container_responses[0].deviceIDs)

    def _require(self, resource: str) -> Registration:
        registration = self.latest(resource)
        if registration is None:
            raise AssertionError(f"{resource} never registered")
        return registration

    # Called by the Registration service ---------------------------------------------------------
    def _accept(self, request: api_pb2.RegisterRequest) -> None:
        if request.version != "v1beta1":
            raise ValueError(f"unsupported version {request.version!r}")
        endpoint = self.directory / request.endpoint
        channel = grpc.insecure_channel(f"unix://{endpoint}")
        # As the kubelet: dial at once and block (10 s) - the plugin must already serve.
        grpc.channel_ready_future(channel).result(timeout=10)
        stub = api_pb2_grpc.DevicePluginStub(channel)
        options = stub.GetDevicePluginOptions(api_pb2.Empty(), timeout=10)
        registration = Registration(request, time.monotonic(), options, channel, stub)
        with self._changed:
            self.registrations.append(registration)
            self._changed.notify_all()
        threading.Thread(target=self._watch, args=(registration,), daemon=True).start()

    def _watch(self, registration: Registration) -> None:
        try:
            for response in registration.stub.ListAndWatch(api_pb2.Empty()):
                devices = {d.ID: d.health for d in response.devices}
                topology = {d.ID: [n.ID for n in d.topology.nodes] for d in response.devices}
                with self._changed:
                    registration.snapshots.append((time.monotonic(), devices))
                    registration.topology = topology
                    self._changed.notify_all()
        except grpc.RpcError:
            pass
        with self._changed:
            registration.stream_ended = True
            self._changed.notify_all()


class _Registrar:
    def __init__(self, kubelet: KubeletStandIn) -> None:
        self._kubelet = kubelet

    def Register(
        self, request: api_pb2.RegisterRequest, context: grpc.ServicerContext
    ) -> api_pb2.Empty:
        try:
            self._kubelet._accept(request)
        except (grpc.FutureTimeoutError, grpc.RpcError, ValueError) as error:
            context.abort(grpc.StatusCode.UNKNOWN, f"cannot reach plugin: {error!r}")
        return api_pb2.Empty()
