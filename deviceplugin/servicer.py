"""gRPC servicers of the kubelet device plugin API v1beta1: they only convert between protobuf
messages and the core's values (deviceplugin.inventory, deviceplugin.allocation)."""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable, Iterator
from typing import Protocol

import grpc

from deviceplugin.allocation import AllocationError, plan_allocation, plan_preferred
from deviceplugin.feed import Feed
from deviceplugin.inventory import IOMMU_NODE, VfioResource
from deviceplugin.iommufd_handoff import CONTAINER_SOCKET_PATH, HandoffError, PreparedSocket
from deviceplugin.v1beta1 import api_pb2

log = logging.getLogger(__name__)

HEALTHY = "Healthy"
UNHEALTHY = "Unhealthy"
# How often a waiting ListAndWatch stream checks that its client is still there.
_STREAM_POLL_SECONDS = 5.0

AllocationObserver = Callable[[str, str], None]
"""Called with (resource name, "ok" | "refused") after each Allocate."""
AllocatedDevices = Callable[[str, tuple[str, ...]], None]
"""Called with (resource name, device ids) after an Allocate that succeeded."""


def _vfio_snapshot(resource: VfioResource) -> api_pb2.ListAndWatchResponse:
    devices = []
    for device in resource.devices.values():
        message = api_pb2.Device(ID=device.id, health=HEALTHY if device.healthy else UNHEALTHY)
        if device.numa_node is not None:
            message.topology.nodes.add(ID=device.numa_node)
        devices.append(message)
    return api_pb2.ListAndWatchResponse(devices=devices)


def _stream(
    feed: Feed[api_pb2.ListAndWatchResponse], context: grpc.ServicerContext
) -> Iterator[api_pb2.ListAndWatchResponse]:
    version, snapshot = feed.current()
    context.add_callback(feed.wake)
    yield snapshot
    while context.is_active():
        newer = feed.wait_newer(version, _STREAM_POLL_SECONDS)
        if newer is None:
            return
        if newer[0] != version:
            version, snapshot = newer
            yield snapshot


class _Streaming:
    """What every resource's servicer shares: its snapshots, streamed to each ListAndWatch, and
    the options it tells the kubelet."""

    snapshots: Feed[api_pb2.ListAndWatchResponse]

    @property
    def options(self) -> api_pb2.DevicePluginOptions:
        return api_pb2.DevicePluginOptions()

    def close(self) -> None:
        self.snapshots.close()

    def GetDevicePluginOptions(
        self, request: api_pb2.Empty, context: grpc.ServicerContext
    ) -> api_pb2.DevicePluginOptions:
        return self.options

    def ListAndWatch(
        self, request: api_pb2.Empty, context: grpc.ServicerContext
    ) -> Iterator[api_pb2.ListAndWatchResponse]:
        return _stream(self.snapshots, context)

    def PreStartContainer(
        self, request: api_pb2.PreStartContainerRequest, context: grpc.ServicerContext
    ) -> api_pb2.PreStartContainerResponse:
        return api_pb2.PreStartContainerResponse()


class VfioServicer(_Streaming):
    """One VFIO resource: its devices, Allocate and the preferred allocation."""

    def __init__(
        self,
        resource: VfioResource,
        observe: AllocationObserver,
        *,
        allocated: AllocatedDevices | None = None,
    ) -> None:
        self._resource = resource
        self._observe = observe
        self._allocated = allocated
        self.snapshots = Feed(_vfio_snapshot(resource))

    @property
    def resource(self) -> VfioResource:
        return self._resource

    def update(self, resource: VfioResource) -> None:
        """Hold the new state and send it to every stream; a full snapshot each time, since the
        kubelet drops whatever a snapshot leaves out."""
        self._resource = resource
        self.snapshots.publish(_vfio_snapshot(resource))

    @property
    def options(self) -> api_pb2.DevicePluginOptions:
        return api_pb2.DevicePluginOptions(
            pre_start_required=False, get_preferred_allocation_available=True
        )

    def Allocate(
        self, request: api_pb2.AllocateRequest, context: grpc.ServicerContext
    ) -> api_pb2.AllocateResponse:
        resource = self._resource
        responses = []
        try:
            for container in request.container_requests:
                plan = plan_allocation(resource, list(container.devices_ids))
                responses.append(
                    api_pb2.ContainerAllocateResponse(
                        envs=dict(plan.envs),
                        devices=[
                            api_pb2.DeviceSpec(container_path=p, host_path=p, permissions="mrw")
                            for p in plan.device_nodes
                        ],
                    )
                )
        except AllocationError as error:
            log.warning("allocate refused resource=%s error=%r", resource.name, str(error))
            self._observe(resource.name, "refused")
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(error))
        if not responses:
            self._observe(resource.name, "refused")
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"{resource.name}: empty request")
        for container, response in zip(request.container_requests, responses, strict=True):
            log.info(
                "allocated resource=%s devices=%s nodes=%d",
                resource.name,
                ",".join(container.devices_ids),
                len(response.devices),
            )
        self._observe(resource.name, "ok")
        if self._allocated is not None:
            ids = tuple(i for c in request.container_requests for i in c.devices_ids)
            self._allocated(resource.name, ids)
        return api_pb2.AllocateResponse(container_responses=responses)

    def GetPreferredAllocation(
        self, request: api_pb2.PreferredAllocationRequest, context: grpc.ServicerContext
    ) -> api_pb2.PreferredAllocationResponse:
        answers = []
        try:
            for container in request.container_requests:
                chosen = plan_preferred(
                    self._resource,
                    list(container.available_deviceIDs),
                    list(container.must_include_deviceIDs),
                    container.allocation_size,
                )
                answers.append(api_pb2.ContainerPreferredAllocationResponse(deviceIDs=chosen))
        except AllocationError as error:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(error))
        return api_pb2.PreferredAllocationResponse(container_responses=answers)


class Handoff(Protocol):
    """Prepares the one-shot socket that hands a launcher its iommufd fd."""

    def prepare(self, allocation_id: str) -> PreparedSocket: ...

    def cancel(self, allocation_id: str) -> None: ...


def _iommufd_snapshot(slots: int, healthy: bool) -> api_pb2.ListAndWatchResponse:
    health = HEALTHY if healthy else UNHEALTHY
    return api_pb2.ListAndWatchResponse(
        devices=[api_pb2.Device(ID=f"iommufd-{i:03d}", health=health) for i in range(slots)]
    )


class IommufdServicer(_Streaming):
    """`devices.kubevirt.io/iommufd`: N interchangeable slots; Allocate gives /dev/iommu and a
    fresh socket that hands over a prepared iommufd fd.

    Without /dev/iommu the slots are Unhealthy, unless `legacy_without_iommu`: then they stay
    allocatable and Allocate hands out nothing, so a launcher pod that asks for the resource still
    schedules on such a node and its VM stays on legacy VFIO (virt-launcher uses iommufd only
    when /dev/iommu is in the pod)."""

    def __init__(
        self,
        resource_name: str,
        slots: int,
        node_present: bool,
        handoff: Handoff,
        observe: AllocationObserver,
        *,
        legacy_without_iommu: bool = False,
    ) -> None:
        self.resource_name = resource_name
        self._slots = slots
        self._node_present = node_present
        self._legacy = legacy_without_iommu
        self._handoff = handoff
        self._observe = observe
        self.snapshots = Feed(_iommufd_snapshot(slots, self.healthy))

    @property
    def node_present(self) -> bool:
        return self._node_present

    @property
    def healthy(self) -> bool:
        return self._node_present or self._legacy

    def update(self, node_present: bool) -> None:
        self._node_present = node_present
        self.snapshots.publish(_iommufd_snapshot(self._slots, self.healthy))

    def Allocate(
        self, request: api_pb2.AllocateRequest, context: grpc.ServicerContext
    ) -> api_pb2.AllocateResponse:
        if not request.container_requests:
            self._observe(self.resource_name, "refused")
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"{self.resource_name}: empty request")
        if not self._node_present:
            if not self._legacy:
                self._observe(self.resource_name, "refused")
                context.abort(
                    grpc.StatusCode.FAILED_PRECONDITION,
                    f"{self.resource_name}: {IOMMU_NODE} is missing on this node; the kernel"
                    " needs CONFIG_IOMMUFD and the plugin pod needs the host's /dev",
                )
            log.info(
                "allocated resource=%s slots=%s without %s: the launcher stays on legacy VFIO",
                self.resource_name,
                ",".join(d for c in request.container_requests for d in c.devices_ids),
                IOMMU_NODE,
            )
            self._observe(self.resource_name, "ok")
            return api_pb2.AllocateResponse(
                container_responses=[
                    api_pb2.ContainerAllocateResponse() for _ in request.container_requests
                ]
            )
        responses = []
        prepared: list[str] = []
        for container in request.container_requests:
            allocation_id = uuid.uuid4().hex[:16]
            try:
                socket_path = self._handoff.prepare(allocation_id).host_path
            except (HandoffError, OSError) as error:
                # The kubelet gets no answer for the containers already prepared either: their
                # fds go back now instead of at expiry.
                for earlier in prepared:
                    self._handoff.cancel(earlier)
                self._observe(self.resource_name, "refused")
                log.error(
                    "iommufd hand-off failed allocation=%s error=%r", allocation_id, str(error)
                )
                context.abort(
                    grpc.StatusCode.UNAVAILABLE,
                    f"{self.resource_name}: cannot prepare an iommufd fd: {error}",
                )
            prepared.append(allocation_id)
            log.info(
                "allocated resource=%s slots=%s allocation=%s socket=%s",
                self.resource_name,
                ",".join(container.devices_ids),
                allocation_id,
                socket_path,
            )
            responses.append(
                api_pb2.ContainerAllocateResponse(
                    devices=[
                        api_pb2.DeviceSpec(
                            container_path=IOMMU_NODE, host_path=IOMMU_NODE, permissions="mrw"
                        )
                    ],
                    mounts=[
                        api_pb2.Mount(
                            container_path=CONTAINER_SOCKET_PATH,
                            host_path=str(socket_path),
                            read_only=False,
                        )
                    ],
                )
            )
        self._observe(self.resource_name, "ok")
        return api_pb2.AllocateResponse(container_responses=responses)

    def GetPreferredAllocation(
        self, request: api_pb2.PreferredAllocationRequest, context: grpc.ServicerContext
    ) -> api_pb2.PreferredAllocationResponse:
        context.abort(grpc.StatusCode.UNIMPLEMENTED, "slots are interchangeable")
