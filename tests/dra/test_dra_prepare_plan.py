"""NodePrepare's plan as a pure function: allocations, judged devices and held groups as plain
values in, a refusal, a bind or the files and record out. No filesystem."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from dra.claims import Allocated, ClaimAllocation, ClaimRef
from dra.devices import DraDevice, device_name
from dra.prepare_plan import (
    BindFirst,
    Paths,
    Refusal,
    WritePlan,
    bdfs_named,
    is_still_on_vfio,
    plan_prepare,
)
from dra.state import PreparedClaim, PreparedDevice
from hostdev.bdf import Bdf

DRIVER = "vfio.kubevirt-iommufd.io"
POOL = "node-a"
REF = ClaimRef("vms", "vm-gpus", "uid-1")
PATHS = Paths(Path("/cdi"), Path("/run/metadata"), Path("/state/metadata"))
GPU_A, GPU_B, GPU_C = (
    Bdf.parse("0000:18:00.0"),
    Bdf.parse("0000:2a:00.0"),
    Bdf.parse("0000:3b:00.0"),
)


def on_vfio(bdf: Bdf, group: int) -> DraDevice:
    return DraDevice(
        name=device_name(bdf),
        bdf=bdf,
        resource="nvidia.com/GH100",
        attributes={"resource.kubernetes.io/pciBusID": str(bdf)},
        device_nodes=(
            "/dev/vfio/devices/vfio0",
            "/dev/iommu",
            "/dev/vfio/vfio",
            f"/dev/vfio/{group}",
        ),
        group=group,
    )


def on_host_driver(bdf: Bdf, group: int, reset: bool = False) -> DraDevice:
    return replace(on_vfio(bdf, group), device_nodes=(), bind_on_demand=True, reset_after_use=reset)


def allocation(*devices: tuple[str, Bdf | str]) -> ClaimAllocation:
    return ClaimAllocation(
        ref=REF,
        generation=3,
        pod_claim_name=None,
        devices=tuple(
            Allocated(request, POOL, b if isinstance(b, str) else device_name(b))
            for request, b in devices
        ),
    )


def prepared(uid: str, name: str, bdf: Bdf, group: int) -> PreparedClaim:
    device = PreparedDevice("gpu", POOL, device_name(bdf), bdf, (), group)
    return PreparedClaim(uid, "vms", name, (device,), ())


def plan(
    wanted: ClaimAllocation,
    judged: dict[Bdf, DraDevice | str],
    others: tuple[PreparedClaim, ...] = (),
    can_bind: bool = True,
    recorded: PreparedClaim | None = None,
) -> Refusal | BindFirst | WritePlan:
    return plan_prepare(
        wanted, recorded, judged, others, driver=DRIVER, paths=PATHS, can_bind=can_bind
    )


@pytest.mark.parametrize(
    ("wanted", "judged", "others", "can_bind", "words"),
    [
        (allocation(("gpu", "gpu-0")), {}, (), True, "device 'gpu-0' is not a name this driver"),
        (allocation(("gpu", GPU_A)), {}, (), True, "cannot be given to a VM: gone from the host"),
        (
            allocation(("gpu", GPU_A)),
            {GPU_A: "bound to no driver"},
            (),
            True,
            "pci-0000-18-00-0 (0000:18:00.0) cannot be given to a VM: bound to no driver;",
        ),
        (
            allocation(("gpu", GPU_A)),
            {GPU_A: replace(on_vfio(GPU_A, 7), unusable="group 7 not viable: x is bound to y")},
            (),
            True,
            "(0000:18:00.0) cannot be given to a VM: group 7 not viable: x is bound to y;",
        ),
        (
            allocation(("gpu", GPU_A)),
            {GPU_A: on_vfio(GPU_A, 7)},
            (prepared("uid-2", "other", GPU_A, 7),),
            True,
            "(0000:18:00.0) is already prepared for claim vms/other (uid uid-2)",
        ),
        (
            allocation(("gpu", GPU_B)),
            {GPU_B: on_vfio(GPU_B, 7)},
            (prepared("uid-2", "other", GPU_A, 7),),
            True,
            "shares IOMMU group 7 with pci-0000-18-00-0 (0000:18:00.0), prepared for claim"
            " vms/other",
        ),
        (
            allocation(("gpu", GPU_C)),
            {GPU_C: on_host_driver(GPU_C, 14)},
            (),
            False,
            "devices 0000:3b:00.0 are not on VFIO",
        ),
    ],
    ids=[
        "foreign-name",
        "gone",
        "unusable",
        "published-unusable",
        "taken",
        "group-taken",
        "no-binder",
    ],
)
def test_refusals_name_the_claim_the_device_and_why(
    wanted: ClaimAllocation,
    judged: dict[Bdf, DraDevice | str],
    others: tuple[PreparedClaim, ...],
    can_bind: bool,
    words: str,
) -> None:
    answer = plan(wanted, judged, others, can_bind)
    assert isinstance(answer, Refusal)
    assert answer.message.startswith(f"{REF}: ") and words in answer.message


def test_a_claims_own_earlier_record_does_not_hold_its_group_against_it() -> None:
    wanted = allocation(("gpu", GPU_A))
    answer = plan(wanted, {GPU_A: on_vfio(GPU_A, 7)}, others=())
    assert isinstance(answer, WritePlan)


@pytest.mark.parametrize(
    ("resets", "expected"),
    [((False, False), False), ((False, True), True)],
    ids=["keep", "reset-after-use"],
)
def test_devices_on_their_host_drivers_are_bound_first(
    resets: tuple[bool, bool], expected: bool
) -> None:
    wanted = allocation(("a", GPU_C), ("b", GPU_B), ("c", GPU_A))
    judged: dict[Bdf, DraDevice | str] = {
        GPU_C: on_host_driver(GPU_C, 14, resets[0]),
        GPU_B: on_host_driver(GPU_B, 15, resets[1]),
        GPU_A: on_vfio(GPU_A, 7),
    }
    assert plan(wanted, judged) == BindFirst((GPU_B, GPU_C), expected)


def test_devices_on_vfio_get_their_files_and_record() -> None:
    wanted = allocation(("gpu", GPU_A), ("gpu", GPU_B), ("nic", GPU_C))
    judged: dict[Bdf, DraDevice | str] = {
        b: on_vfio(b, g) for b, g in ((GPU_A, 7), (GPU_B, 8), (GPU_C, 9))
    }
    answer = plan(wanted, judged)
    assert isinstance(answer, WritePlan)
    suffix = f"{DRIVER}-metadata.json"
    assert [str(f.path) for f in answer.files] == [
        f"/run/metadata/uid-1_gpu_{suffix}",
        f"/run/metadata/uid-1_nic_{suffix}",
        f"/cdi/{DRIVER}-claim_uid-1.json",
    ]
    gpu_metadata = json.loads(answer.files[0].content)
    assert [d["name"] for d in gpu_metadata["requests"][0]["devices"]] == [
        "pci-0000-18-00-0",
        "pci-0000-2a-00-0",
    ]
    spec = json.loads(answer.files[2].content)
    assert [e["name"] for e in spec["devices"]] == [
        "uid-1-pci-0000-18-00-0",
        "uid-1-pci-0000-2a-00-0",
        "uid-1-pci-0000-3b-00-0",
        "uid-1-metadata-gpu",
        "uid-1-metadata-nic",
    ]
    assert answer.claim == PreparedClaim(
        uid="uid-1",
        namespace="vms",
        name="vm-gpus",
        devices=tuple(
            PreparedDevice(
                request,
                POOL,
                device_name(bdf),
                bdf,
                (
                    f"{DRIVER}/claim=uid-1-{device_name(bdf)}",
                    f"{DRIVER}/claim=uid-1-metadata-{request}",
                ),
                group,
            )
            for request, bdf, group in (("gpu", GPU_A, 7), ("gpu", GPU_B, 8), ("nic", GPU_C, 9))
        ),
        files=(
            f"/cdi/{DRIVER}-claim_uid-1.json",
            f"/run/metadata/uid-1_gpu_{suffix}",
            f"/run/metadata/uid-1_nic_{suffix}",
        ),
    )


def test_the_functions_to_read_are_those_the_allocation_names() -> None:
    assert bdfs_named(allocation(("a", GPU_A), ("b", "gpu-0"), ("c", GPU_B))) == {GPU_A, GPU_B}


@pytest.mark.parametrize(
    ("judged", "expected"),
    [
        ({GPU_A: on_vfio(GPU_A, 7)}, True),
        ({GPU_A: on_vfio(GPU_A, 7), GPU_B: on_host_driver(GPU_B, 8)}, False),
        ({GPU_A: "gone from the host"}, False),
    ],
    ids=["on-vfio", "back-on-host-driver", "gone"],
)
def test_a_prepared_claim_is_still_on_vfio_only_while_every_device_is(
    judged: dict[Bdf, DraDevice | str], expected: bool
) -> None:
    assert is_still_on_vfio(judged) is expected


def test_a_claim_prepared_before_is_planned_again_only_for_the_same_allocation() -> None:
    wanted = allocation(("gpu", GPU_A))
    judged: dict[Bdf, DraDevice | str] = {GPU_A: on_vfio(GPU_A, 7), GPU_B: on_vfio(GPU_B, 8)}
    same = prepared(REF.uid, REF.name, GPU_A, 7)
    assert isinstance(plan(wanted, judged, recorded=same), WritePlan)
    moved = allocation(("gpu", GPU_B))
    answer = plan(moved, judged, recorded=same)
    assert isinstance(answer, Refusal)
    assert answer.message == (
        f"{REF}: the API server now allocates it 'pci-0000-2a-00-0' for request 'gpu', but it"
        " was prepared with 'pci-0000-18-00-0' for request 'gpu'; an allocation never changes,"
        " so the first preparation is kept; delete the pod so that the kubelet unprepares the"
        " claim, then it is prepared anew"
    )


def written(answer: Refusal | BindFirst | WritePlan) -> dict[str, object]:
    assert isinstance(answer, WritePlan)
    return {str(f.path): json.loads(f.content) for f in answer.files}


def test_a_subrequest_writes_where_the_kep_and_kubevirt_read_it() -> None:
    wanted = allocation(("gpu/high-memory", GPU_A), ("nic", GPU_B))
    answer = plan(wanted, {GPU_A: on_vfio(GPU_A, 7), GPU_B: on_vfio(GPU_B, 8)})
    files = written(answer)
    suffix = f"{DRIVER}-metadata.json"
    metadata = files[f"/run/metadata/uid-1_gpu_{suffix}"]
    assert isinstance(metadata, dict)
    # The file is the main request's; the document names the subrequest allocated.
    assert [r["name"] for r in metadata["requests"]] == ["gpu/high-memory"]
    spec = files[f"/cdi/{DRIVER}-claim_uid-1.json"]
    assert isinstance(spec, dict)
    mounts = {e["name"]: e["containerEdits"]["mounts"][0] for e in spec["devices"][2:]}
    assert mounts["uid-1-metadata-gpu"] == {
        "hostPath": f"/run/metadata/uid-1_gpu_{suffix}",
        "containerPath": "/var/run/kubernetes.io/dra-device-attributes/resourceclaims/vm-gpus/gpu/"
        + suffix,
        "options": ["ro", "nosuid", "nodev", "bind"],
    }
    assert isinstance(answer, WritePlan)
    assert answer.claim.devices[0].request == "gpu/high-memory"
    assert answer.claim.devices[0].cdi_ids[1] == f"{DRIVER}/claim=uid-1-metadata-gpu"


OTHER_UID = "uid-2"


@pytest.mark.parametrize(
    "request_name",
    ["/abs/dir", "..", "../..", f"../{OTHER_UID}/gpu", "../../../etc/cron.d/x", ".", "/"],
)
def test_a_request_whose_metadata_would_not_be_the_claims_own_file_is_refused(
    request_name: str,
) -> None:
    answer = plan(allocation((request_name, GPU_A)), {GPU_A: on_vfio(GPU_A, 7)})
    assert isinstance(answer, Refusal)
    assert answer.message.startswith(f"{REF}: request ")
    assert "its metadata would be written at" in answer.message
    assert "not as the claim's own file in /run/metadata" in answer.message
    assert "something other than the API server answered" in answer.message


@pytest.mark.parametrize("pod_claim_name", ["../../../../etc/x", "..", "a/b", "/etc"])
def test_a_pod_claim_name_whose_mount_leaves_the_metadata_root_is_refused(
    pod_claim_name: str,
) -> None:
    wanted = replace(allocation(("gpu", GPU_A)), pod_claim_name=pod_claim_name)
    answer = plan(wanted, {GPU_A: on_vfio(GPU_A, 7)})
    assert isinstance(answer, Refusal)
    assert answer.message.startswith(f"{REF}: request 'gpu': its metadata would be mounted at ")
    assert (
        "not in /var/run/kubernetes.io/dra-device-attributes/resourceclaimtemplates/"
        in answer.message
    )


@pytest.mark.parametrize(
    ("devices", "words"),
    [
        (
            (("gpu", GPU_A), ("gpu", GPU_A)),
            "device pci-0000-18-00-0 (0000:18:00.0) is allocated twice, for requests 'gpu'"
            " and 'gpu'",
        ),
        (
            (("gpu", GPU_A), ("nic", GPU_A)),
            "device pci-0000-18-00-0 (0000:18:00.0) is allocated twice, for requests 'gpu'"
            " and 'nic'",
        ),
        (
            (("gpu", GPU_A), ("nic", "pci-00000000-18-00-0")),
            "device pci-00000000-18-00-0 (0000:18:00.0) is allocated twice",
        ),
        (
            (("gpu/a", GPU_A), ("gpu/b", GPU_B)),
            "requests 'gpu/a' and 'gpu/b' would share one metadata file",
        ),
        (
            (("gpu", GPU_A), ("gpu/b", GPU_B)),
            "requests 'gpu' and 'gpu/b' would share one metadata file",
        ),
    ],
    ids=["same-request", "two-requests", "two-spellings", "two-subrequests", "main-and-sub"],
)
def test_duplicates_are_refused_naming_the_claim_and_what_is_duplicated(
    devices: tuple[tuple[str, Bdf | str], ...], words: str
) -> None:
    judged: dict[Bdf, DraDevice | str] = {GPU_A: on_vfio(GPU_A, 7), GPU_B: on_vfio(GPU_B, 8)}
    answer = plan(allocation(*devices), judged)
    assert isinstance(answer, Refusal)
    assert answer.message.startswith(f"{REF}: ") and words in answer.message
    assert "something other than the API server answered" in answer.message


def test_the_cdi_specs_device_names_are_unique() -> None:
    wanted = allocation(("gpu", GPU_A), ("gpu", GPU_B), ("metadata-gpu", GPU_C))
    judged: dict[Bdf, DraDevice | str] = {
        b: on_vfio(b, g) for b, g in ((GPU_A, 7), (GPU_B, 8), (GPU_C, 9))
    }
    spec = written(plan(wanted, judged))[f"/cdi/{DRIVER}-claim_uid-1.json"]
    assert isinstance(spec, dict)
    names = [e["name"] for e in spec["devices"]]
    assert len(names) == len(set(names)) == 5
