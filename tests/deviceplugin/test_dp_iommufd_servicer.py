"""The iommufd servicer's Allocate when a hand-off cannot be prepared part-way through."""

from __future__ import annotations

from pathlib import Path
from typing import NoReturn

import grpc
import pytest

from deviceplugin.servicer import IommufdServicer
from deviceplugin.v1beta1 import api_pb2
from hostdev.iommufd_handoff import HandoffError, PreparedSocket


class Aborted(Exception):
    pass


class Context:
    def abort(self, code: grpc.StatusCode, details: str) -> NoReturn:
        raise Aborted(code, details)


class FlakyHandoff:
    """Prepares `works` hand-offs, then fails; remembers what was cancelled."""

    def __init__(self, works: int) -> None:
        self.works = works
        self.prepared: list[str] = []
        self.cancelled: list[str] = []

    def prepare(self, allocation_id: str) -> PreparedSocket:
        if len(self.prepared) == self.works:
            raise HandoffError("/dev/iommu vanished")
        self.prepared.append(allocation_id)
        return PreparedSocket(allocation_id, Path(f"/run/iommufd-{allocation_id}.sock"))

    def cancel(self, allocation_id: str) -> bool:
        self.cancelled.append(allocation_id)
        return True


def test_a_failed_container_withdraws_the_ones_prepared_before_it() -> None:
    handoff = FlakyHandoff(works=2)
    outcomes: list[str] = []
    servicer = IommufdServicer(
        "devices.kubevirt.io/iommufd", 4, True, handoff, lambda _r, result: outcomes.append(result)
    )
    request = api_pb2.AllocateRequest(
        container_requests=[
            api_pb2.ContainerAllocateRequest(devices_ids=[f"iommufd-00{i}"]) for i in range(3)
        ]
    )
    with pytest.raises(Aborted) as caught:
        servicer.Allocate(request, Context())  # type: ignore[arg-type]
    code, details = caught.value.args
    assert code is grpc.StatusCode.UNAVAILABLE
    assert "cannot prepare an iommufd fd: /dev/iommu vanished" in details
    assert handoff.cancelled == handoff.prepared and len(handoff.cancelled) == 2
    assert outcomes == ["refused"]
