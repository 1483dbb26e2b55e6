from __future__ import annotations

from types import MappingProxyType

import pytest

from deviceplugin.allocation import (
    AllocationError,
    check_slot_request,
    iommufd_slot_ids,
    plan_allocation,
    plan_preferred,
)
from deviceplugin.inventory import VfioDevice, VfioResource
from hostdev.bdf import Bdf

B = Bdf.parse
SWITCH_A = (B("0000:15:01.0"), B("0000:16:00.0"))
SWITCH_B = (B("0000:37:01.0"), B("0000:38:00.0"))
SWITCH_C = (B("0000:97:01.0"), B("0000:98:00.0"))
SWITCH_D = (B("0000:b7:01.0"), B("0000:b8:00.0"))


def device(
    bdf: str, numa: int | None, switch: tuple[Bdf, ...], group: int, healthy: bool = True
) -> VfioDevice:
    index = group
    return VfioDevice(
        bdf=B(bdf),
        healthy=healthy,
        reason="" if healthy else "bound to no driver: bind it to vfio-pci to assign it",
        driver="vfio-pci" if healthy else None,
        numa_node=numa,
        switch=switch,
        device_nodes=(
            f"/dev/vfio/devices/vfio{index}",
            "/dev/iommu",
            "/dev/vfio/vfio",
            f"/dev/vfio/{group}",
        ),
    )


# The 8-GPU HGX layout: two GPUs per switch, two switches per NUMA node.
HGX = VfioResource(
    "nvidia.com/GH100",
    MappingProxyType(
        {
            d.id: d
            for d in (
                device("0000:18:00.0", 0, SWITCH_A, 0),
                device("0000:2a:00.0", 0, SWITCH_A, 1),
                device("0000:3a:00.0", 0, SWITCH_B, 2),
                device("0000:5d:00.0", 0, SWITCH_B, 3),
                device("0000:9a:00.0", 1, SWITCH_C, 4),
                device("0000:ab:00.0", 1, SWITCH_C, 5),
                device("0000:ba:00.0", 1, SWITCH_D, 6),
                device("0000:db:00.0", 1, SWITCH_D, 7, healthy=False),
            )
        }
    ),
)
ALL = list(HGX.devices)


def test_allocation_of_two_devices() -> None:
    result = plan_allocation(HGX, ["0000:9a:00.0", "0000:18:00.0"])
    assert result.device_nodes == (
        "/dev/vfio/devices/vfio4",
        "/dev/iommu",
        "/dev/vfio/vfio",
        "/dev/vfio/4",
        "/dev/vfio/devices/vfio0",
        "/dev/vfio/0",
    )
    assert dict(result.envs) == {"PCI_RESOURCE_NVIDIA_COM_GH100": "0000:9a:00.0,0000:18:00.0"}


@pytest.mark.parametrize(
    ("ids", "message"),
    [
        ([], "nvidia.com/GH100: the request names no device"),
        (
            ["0000:18:00.0", "0000:18:00.0"],
            "nvidia.com/GH100: device '0000:18:00.0' is requested twice",
        ),
        (
            ["0000:01:00.0"],
            "nvidia.com/GH100: unknown device '0000:01:00.0': this node does not advertise it",
        ),
        (
            ["0000:18:00.0", "0000:db:00.0"],
            "nvidia.com/GH100: device 0000:db:00.0 is unhealthy: bound to no driver: bind it to"
            " vfio-pci to assign it",
        ),
    ],
    ids=["empty", "twice", "unknown", "unhealthy"],
)
def test_allocation_refusals_name_the_device(ids: list[str], message: str) -> None:
    with pytest.raises(AllocationError) as caught:
        plan_allocation(HGX, ids)
    assert str(caught.value).startswith(message)


@pytest.mark.parametrize(
    "device_id",
    ["x" * 1_000_000, "0000:01:00.0\nWARNING forged line", "\u202e00.0:10:0000"],
    ids=["megabyte", "newline", "bidi-override"],
)
def test_a_requested_id_is_quoted_and_shortened_in_refusals(device_id: str) -> None:
    for ids in ([device_id], [device_id, device_id]):
        with pytest.raises(AllocationError) as caught:
            plan_allocation(HGX, ids)
        message = str(caught.value)
        assert len(message) < 400
        assert message.isprintable()


SLOTS = frozenset(iommufd_slot_ids(4))
IOMMUFD = "devices.kubevirt.io/iommufd"


def test_slot_ids_are_the_advertised_names() -> None:
    assert iommufd_slot_ids(3) == ("iommufd-000", "iommufd-001", "iommufd-002")
    assert len(set(iommufd_slot_ids(110))) == 110


def test_slot_request_naming_advertised_slots_passes() -> None:
    check_slot_request(IOMMUFD, SLOTS, [["iommufd-000"], ["iommufd-003", "iommufd-001"]])


@pytest.mark.parametrize(
    ("containers", "message"),
    [
        ([], "devices.kubevirt.io/iommufd: the request names no container"),
        ([["iommufd-000"], []], "devices.kubevirt.io/iommufd: a container request names no slot"),
        (
            [["iommufd-004"]],
            "devices.kubevirt.io/iommufd: unknown slot 'iommufd-004': this node advertises"
            " iommufd-000 to iommufd-003",
        ),
        ([["0000:18:00.0"]], "unknown slot '0000:18:00.0'"),
        ([["iommufd-1"]], "unknown slot 'iommufd-1'"),
        (
            [["iommufd-002", "iommufd-002"]],
            "devices.kubevirt.io/iommufd: slot iommufd-002 is requested twice",
        ),
        ([["iommufd-002"], ["iommufd-002"]], "slot iommufd-002 is requested twice"),
        ([["iommufd-000"]] * 500, "slot iommufd-000 is requested twice"),
        ([["x" * 1_000_000]], "unknown slot 'xxxx"),
    ],
    ids=[
        "no-container",
        "empty-container",
        "beyond-the-slots",
        "another-resources-id",
        "unpadded",
        "twice-in-a-container",
        "twice-across-containers",
        "500-containers",
        "megabyte-id",
    ],
)
def test_slot_request_refusals(containers: list[list[str]], message: str) -> None:
    with pytest.raises(AllocationError) as caught:
        check_slot_request(IOMMUFD, SLOTS, containers)
    assert message in str(caught.value)
    assert len(str(caught.value)) < 400


@pytest.mark.parametrize(
    ("available", "must", "size", "expected"),
    [
        (ALL, [], 2, ["0000:18:00.0", "0000:2a:00.0"]),
        (ALL, [], 4, ["0000:18:00.0", "0000:2a:00.0", "0000:3a:00.0", "0000:5d:00.0"]),
        (ALL, ["0000:ab:00.0"], 2, ["0000:ab:00.0", "0000:9a:00.0"]),
        (ALL, ["0000:ab:00.0"], 3, ["0000:ab:00.0", "0000:9a:00.0", "0000:ba:00.0"]),
        (
            ["0000:18:00.0", "0000:3a:00.0", "0000:5d:00.0"],
            [],
            2,
            ["0000:3a:00.0", "0000:5d:00.0"],
        ),
        (
            ["0000:18:00.0", "0000:9a:00.0", "0000:ab:00.0", "0000:ba:00.0"],
            [],
            2,
            ["0000:9a:00.0", "0000:ab:00.0"],
        ),
        (
            ["0000:18:00.0", "0000:3a:00.0", "0000:9a:00.0"],
            [],
            3,
            ["0000:18:00.0", "0000:3a:00.0", "0000:9a:00.0"],
        ),
        (["0000:18:00.0"], [], 2, ["0000:18:00.0"]),
        (ALL, ["0000:18:00.0", "0000:9a:00.0"], 2, ["0000:18:00.0", "0000:9a:00.0"]),
        (["0000:18:00.0", "0000:ee:00.0"], [], 2, ["0000:18:00.0", "0000:ee:00.0"]),
    ],
    ids=[
        "one-switch",
        "one-numa-node",
        "must-include-stays-on-its-switch",
        "then-its-numa-node",
        "best-fit-switch",
        "best-fit-numa-node",
        "spill-to-other-node",
        "too-few-available",
        "must-include-only",
        "unknown-id-last",
    ],
)
def test_preferred_allocation(
    available: list[str], must: list[str], size: int, expected: list[str]
) -> None:
    answer = plan_preferred(HGX, available, must, size)
    assert answer == expected
    assert set(answer) <= set(available)
    assert answer[: len(must)] == must


def test_preferred_allocation_refuses_too_many_required() -> None:
    with pytest.raises(AllocationError, match="3 devices must be included but only 2 are to be"):
        plan_preferred(HGX, ALL, ALL[:3], 2)
