"""gRPC servicers of the kubelet device plugin API v1beta1: they only convert between protobuf
messages and the core's values (deviceplugin.inventory, deviceplugin.allocation)."""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Iterator
from types import MappingProxyType
from typing import NoReturn, Protocol

import grpc

from deviceplugin.allocation import (
    AllocationError,
    check_slot_request,
    iommufd_slot_ids,
    plan_allocation,
    plan_preferred,
)
from deviceplugin.feed import Feed
from deviceplugin.inventory import VfioResource
from deviceplugin.v1beta1 import api_pb2
from hostdev.device_nodes import IOMMU_NODE
from hostdev.iommufd_handoff import CONTAINER_SOCKET_PATH, HandoffError, PreparedSocket

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
    """Each snapshot of `feed`, the first once there is one (a resource is registered before
    its devices' health is judged, and the kubelet's first list must already tell it)."""
    version, snapshot = feed.current()
    context.add_callback(feed.wake)
    if snapshot is not None:
        yield snapshot
    while context.is_active():
        newer = feed.wait_newer(version, _STREAM_POLL_SECONDS)
        if newer is None:
            return
        if newer[0] != version and newer[1] is not None:
            version = newer[0]
            yield newer[1]


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

    @classmethod
    def awaiting(
        cls,
        name: str,
        observe: AllocationObserver,
        *,
        reset_after_use: bool = False,
        allocated: AllocatedDevices | None = None,
    ) -> VfioServicer:
        """A resource served and registered before its devices are judged: ListAndWatch answers
        at the first `update`, and until then Allocate knows no device."""
        servicer = cls(
            VfioResource(name, MappingProxyType({}), reset_after_use), observe, allocated=allocated
        )
        servicer.snapshots = Feed()
        return servicer

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

    def cancel(self, allocation_id: str) -> bool: ...


def _iommufd_snapshot(slots: int, healthy: bool) -> api_pb2.ListAndWatchResponse:
    health = HEALTHY if healthy else UNHEALTHY
    return api_pb2.ListAndWatchResponse(
        devices=[api_pb2.Device(ID=i, health=health) for i in iommufd_slot_ids(slots)]
    )


class IommufdServicer(_Streaming):
    """`devices.kubevirt.io/iommufd`: N interchangeable slots; Allocate gives /dev/iommu and a
    fresh socket that hands over a prepared iommufd fd.

    Without /dev/iommu the slots are Unhealthy, unless `legacy_without_iommu`: then they stay
    allocatable and Allocate hands out nothing, so a launcher pod that asks for the resource still
    schedules on such a node and its VM stays on legacy VFIO (virt-launcher uses iommufd only
    when /dev/iommu is in the pod).

    Allocate takes only advertised slot ids, each once, and keeps at most one hand-off waiting
    per slot, so a caller can never make it hold more prepared fds than there are slots."""

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
        self._slot_ids = frozenset(iommufd_slot_ids(slots))
        # Allocations are serialised: superseding reads and writes `_by_slot`.
        self._lock = threading.Lock()
        self._by_slot: dict[str, str] = {}
        """The newest allocation id handed out for each slot."""
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
        containers = [tuple(c.devices_ids) for c in request.container_requests]
        try:
            check_slot_request(self.resource_name, self._slot_ids, containers)
        except AllocationError as error:
            self._refuse(context, grpc.StatusCode.INVALID_ARGUMENT, str(error))
        if not self._node_present:
            if not self._legacy:
                self._refuse(
                    context,
                    grpc.StatusCode.FAILED_PRECONDITION,
                    f"{self.resource_name}: {IOMMU_NODE} is missing on this node; the kernel"
                    " needs CONFIG_IOMMUFD and the plugin pod needs the host's /dev",
                )
            log.info(
                "allocated resource=%s slots=%s without %s: the launcher stays on legacy VFIO",
                self.resource_name,
                ",".join(s for c in containers for s in c),
                IOMMU_NODE,
            )
            self._observe(self.resource_name, "ok")
            return api_pb2.AllocateResponse(
                container_responses=[api_pb2.ContainerAllocateResponse() for _ in containers]
            )
        with self._lock:
            prepared: list[str] = []
            responses = [self._hand_off(slots, prepared, context) for slots in containers]
            # Only once every container has its fd: a refused request keeps the hand-offs it
            # would have replaced.
            for slots, allocation_id in zip(containers, prepared, strict=True):
                self._supersede(slots, allocation_id)
        self._observe(self.resource_name, "ok")
        return api_pb2.AllocateResponse(container_responses=responses)

    def _hand_off(
        self, slots: tuple[str, ...], prepared: list[str], context: grpc.ServicerContext
    ) -> api_pb2.ContainerAllocateResponse:
        """Prepare one container's fd and note its allocation in `prepared`; on failure
        withdraw every allocation in `prepared` and abort."""
        allocation_id = os.urandom(8).hex()
        try:
            socket_path = self._handoff.prepare(allocation_id).host_path
        except (HandoffError, OSError) as error:
            # The kubelet gets no answer for the containers already prepared either: their
            # fds go back now instead of at expiry.
            for earlier in prepared:
                self._handoff.cancel(earlier)
            log.error("iommufd hand-off failed allocation=%s error=%r", allocation_id, str(error))
            self._refuse(
                context,
                grpc.StatusCode.UNAVAILABLE,
                f"{self.resource_name}: cannot prepare an iommufd fd: {error}",
            )
        prepared.append(allocation_id)
        log.info(
            "allocated resource=%s slots=%s allocation=%s socket=%s",
            self.resource_name,
            ",".join(slots),
            allocation_id,
            socket_path,
        )
        return api_pb2.ContainerAllocateResponse(
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

    def _supersede(self, slots: tuple[str, ...], allocation_id: str) -> None:
        """Hold `allocation_id` as the hand-off of `slots`, withdrawing what it replaces.

        The kubelet allocates a slot again only once the pod that held it is gone, so an earlier
        hand-off for the slot will never be claimed: keeping it would let pending hand-offs (two
        fds each) pile up beyond the slots until they expire."""
        replaced = {self._by_slot[s] for s in slots if s in self._by_slot} - {allocation_id}
        for slot in slots:
            self._by_slot[slot] = allocation_id
        for previous in sorted(replaced):
            if self._handoff.cancel(previous):
                log.info(
                    "iommufd hand-off superseded allocation=%s by=%s: the kubelet allocated its"
                    " slot again, so its pod is gone",
                    previous,
                    allocation_id,
                )

    def _refuse(
        self, context: grpc.ServicerContext, code: grpc.StatusCode, message: str
    ) -> NoReturn:
        self._observe(self.resource_name, "refused")
        log.warning("allocate refused resource=%s error=%r", self.resource_name, message)
        context.abort(code, message)
        raise AssertionError("grpc's abort returned")  # abort always raises

    def GetPreferredAllocation(
        self, request: api_pb2.PreferredAllocationRequest, context: grpc.ServicerContext
    ) -> api_pb2.PreferredAllocationResponse:
        context.abort(grpc.StatusCode.UNIMPLEMENTED, "slots are interchangeable")
