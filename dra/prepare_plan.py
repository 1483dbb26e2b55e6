"""NodePrepare's decision for one claim. Pure: the parsed allocation, the devices as the host
has them now, and what other claims hold in; a refusal, or what to do, out.

What to do comes in two kinds: devices on their host drivers are bound to VFIO first (then the
claim is planned again with the devices as the bind left them), and devices on VFIO get their
files (CDI spec, metadata per request) and the claim's record. Every refusal names the claim,
the device and the fix.

Claim data becomes paths (request names, the pod's name for the claim): however it was checked
on the way in, every path made of it is checked here to lie where it belongs.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path, PurePath, PurePosixPath
from typing import Any

from dra.cdi import (
    build_cdi_ids,
    build_metadata,
    build_spec,
    cdi_id,
    main_request,
    metadata_container_base,
    metadata_container_path,
    metadata_file_name,
    spec_file_name,
)
from dra.claims import Allocated, ClaimAllocation, ClaimRef
from dra.devices import DraDevice, bdf_of_device
from dra.iommufd_slots import build_handoff_entry, check_slots, handoff_cdi_name, slot_index
from dra.state import PreparedClaim, PreparedDevice, PreparedSlot
from hostdev.bdf import Bdf
from hostdev.iommufd_handoff import socket_path
from hostdev.untrusted import quote_untrusted

GONE = "gone from the host"
"""Why a function the host no longer has cannot be given to a VM."""
NOT_FROM_THE_API = "the API server never sends this; something other than the API server answered"


@dataclass(frozen=True, slots=True)
class Paths:
    """Where a claim's files go; every name the driver writes is made here."""

    cdi_dir: Path
    metadata_dir: Path
    """In the run directory (a tmpfs): rebuilt from the record after a reboot, as the CDI spec."""
    previous_metadata_dir: Path
    """Where releases before the run directory wrote the metadata files (under the state
    directory): claims they prepared still have theirs there, until unprepared."""
    handoff_dir: Path | None = None
    """Where the sockets of claims' iommufd hand-offs are; None when the driver publishes no
    iommufd slots."""
    slots: int = 0
    """How many iommufd slots the driver publishes (`iommufd-0` …)."""

    def spec(self, driver: str, uid: str) -> Path:
        return self.cdi_dir / spec_file_name(driver, uid)

    def metadata(self, uid: str, request: str, driver: str) -> Path:
        """The host file of a main request's metadata: side by side with every other claim's,
        named by the claim and the request (neither holds a `_`), so that no directory is made
        for a prepare nor removed for an unprepare. The CDI spec mounts the file itself, where
        the container looks for it."""
        return self.metadata_dir / f"{uid}_{request}_{metadata_file_name(driver)}"

    def files_of(self, driver: str, uid: str) -> tuple[Path, ...]:
        """Every file on the host a prepare of the claim writes, found without its record (a
        crash between writing them and recording it), this release's or an earlier one's."""
        return (
            self.spec(driver, uid),
            *sorted(self.metadata_dir.glob(f"{uid}_*")),
            *sorted(self.previous_metadata_dir.glob(f"{uid}_*")),
        )

    def with_earlier_places(self, files: Iterable[str]) -> set[str]:
        """A record's files, and where an earlier release wrote its metadata files: a claim it
        prepared whose files were written again here (after a reboot) has them there still."""
        named = set(files)
        metadata_dir = str(self.metadata_dir)
        for name in list(named):
            directory, _, file = name.rpartition("/")
            if directory == metadata_dir:
                named.add(f"{self.previous_metadata_dir}/{file}")
        return named

    def legacy_metadata_root(self, uid: str) -> Path:
        """The directory a claim prepared by a driver from before the files lay side by side has
        its metadata in (`<uid>/<request>/<file>`)."""
        return self.previous_metadata_dir / uid

    def handoff(self, uid: str) -> Path | None:
        """The socket of the claim's iommufd hand-off."""
        return None if self.handoff_dir is None else socket_path(self.handoff_dir, uid)


@dataclass(frozen=True, slots=True)
class Refusal:
    message: str


@dataclass(frozen=True, slots=True)
class BindFirst:
    """Bind these functions (with their groups) to VFIO for the claim, then plan again."""

    bdfs: tuple[Bdf, ...]
    reset_after_use: bool


@dataclass(frozen=True, slots=True)
class FileToWrite:
    path: Path
    content: bytes


@dataclass(frozen=True, slots=True)
class WritePlan:
    files: tuple[FileToWrite, ...]
    """The metadata files, then the CDI spec that mounts them."""
    claim: PreparedClaim
    """The record to keep once the files are written."""


def bdfs_named(allocation: ClaimAllocation) -> frozenset[Bdf]:
    """The functions the allocation names, to be read again before planning."""
    return frozenset(
        bdf for item in allocation.devices if (bdf := bdf_of_device(item.device)) is not None
    )


def is_still_on_vfio(judged: Mapping[Bdf, DraDevice | str]) -> bool:
    """Whether a prepared claim's devices are all still on VFIO (a reboot puts on-demand ones
    back on their host drivers while the claim stays prepared)."""
    return all(isinstance(d, DraDevice) and not d.bind_on_demand for d in judged.values())


def same_allocation(recorded: PreparedClaim, allocation: ClaimAllocation) -> bool:
    return sorted((d.request, d.pool, d.device) for d in recorded.results) == sorted(
        (d.request, d.pool, d.device) for d in allocation.devices
    )


def plan_prepare(
    allocation: ClaimAllocation,
    recorded: PreparedClaim | None,
    judged: Mapping[Bdf, DraDevice | str],
    others: Iterable[PreparedClaim],
    *,
    driver: str,
    paths: Paths,
    can_bind: bool,
    journaled: Mapping[Bdf, str] | None = None,
) -> Refusal | BindFirst | WritePlan:
    """What to do for `allocation`, given this claim's own record (when it was prepared
    before), its devices as judged now (by address; missing ones are gone) and the other
    prepared claims; `can_bind` says whether devices on their host drivers may be bound on
    demand; `journaled` names the functions a binding journal holds on VFIO, by claim UID."""
    ref = allocation.ref
    if recorded is not None and not same_allocation(recorded, allocation):
        # Preparing over it would lose the record, and the bind journal, of the devices the
        # claim has: they would be published as free while its VM may have them.
        return Refusal(
            f"{ref}: the API server now allocates it {_listed(allocation.devices)}, but it was"
            f" prepared with {_listed(recorded.results)}; an allocation never changes, so the"
            " first preparation is kept; delete the pod so that the kubelet unprepares the"
            " claim, then it is prepared anew"
        )
    split = _split_slots(allocation, driver, paths.slots)
    if isinstance(split, Refusal):
        return split
    allocation, slots = split
    held = _held_groups(others)
    devices: dict[str, DraDevice] = {}
    for item in allocation.devices:
        device = _device_for(ref, item, judged, held, journaled or {})
        if isinstance(device, Refusal):
            return device
        devices[item.device] = device
    to_bind = sorted({d.bdf for d in devices.values() if d.bind_on_demand})
    if to_bind:
        if not can_bind:
            return Refusal(f"{ref}: devices {', '.join(map(str, to_bind))} are not on VFIO")
        return BindFirst(
            tuple(to_bind),
            any(d.reset_after_use for d in devices.values() if d.bind_on_demand),
        )
    return _write_plan(allocation, devices, driver, paths, slots)


def _split_slots(
    allocation: ClaimAllocation, driver: str, published: int
) -> Refusal | tuple[ClaimAllocation, tuple[Allocated, ...]]:
    """The allocation of the claim's PCI devices, and its iommufd slots; a refusal when the
    allocation names anything twice or slots that cannot be prepared."""
    duplicate = _duplicate(allocation, driver)
    if duplicate is not None:
        return Refusal(f"{allocation.ref}: {duplicate}: refused; {NOT_FROM_THE_API}")
    slots = tuple(item for item in allocation.devices if slot_index(item.device) is not None)
    if not slots:
        return allocation, slots
    refused = check_slots(((s.request, s.device) for s in slots), published)
    if refused is not None:
        return Refusal(f"{allocation.ref}: {refused}")
    pci = tuple(item for item in allocation.devices if item not in slots)
    return replace(allocation, devices=pci), slots


def _bound_for_another(ref: ClaimRef, item: Allocated, bdf: Bdf, other: str) -> Refusal:
    return Refusal(
        f"{ref}: device {item.device} ({bdf}) is still on VFIO for claim uid {other}, whose"
        " devices could not be given back yet; it is freed once they are (the driver tries"
        " again when that claim is unprepared and at its next start); the kubelet retries"
    )


def _device_for(
    ref: ClaimRef,
    item: Allocated,
    judged: Mapping[Bdf, DraDevice | str],
    held: Mapping[int, _Holder],
    journaled: Mapping[Bdf, str],
) -> DraDevice | Refusal:
    bdf = bdf_of_device(item.device)
    if bdf is None:
        return Refusal(
            f"{ref}: device {quote_untrusted(item.device)} is not a name this driver"
            " publishes; the allocation is from another driver's slice"
        )
    other = journaled.get(bdf)
    if other is not None and other != ref.uid:
        return _bound_for_another(ref, item, bdf, other)
    device = judged.get(bdf, GONE)
    if isinstance(device, DraDevice) and device.unusable:
        device = device.unusable
    if isinstance(device, str):
        return Refusal(
            f"{ref}: device {item.device} ({bdf}) cannot be given to a VM: {device};"
            " fix the device (inspect shows why) and recreate the pod"
        )
    holder = held.get(device.group)
    if holder is not None:
        return Refusal(_taken(ref, item.device, bdf, holder))
    return device


def _write_plan(
    allocation: ClaimAllocation,
    devices: Mapping[str, DraDevice],
    driver: str,
    paths: Paths,
    slots: tuple[Allocated, ...],
) -> WritePlan | Refusal:
    """The files and record of a claim: `allocation` holds its PCI devices, `slots` its iommufd
    slots (checked: all of one request, all published), which share the claim's hand-off."""
    ref = allocation.ref
    handoff = paths.handoff(ref.uid) if slots else None
    files: list[FileToWrite] = []
    metadata_paths: dict[str, str] = {}
    for request in sorted({main_request(d.request) for d in allocation.devices}):
        path = paths.metadata(ref.uid, request, driver)
        misplaced = _misplaced(allocation, request, path, driver, paths)
        if misplaced is not None:
            return Refusal(f"{ref}: request {quote_untrusted(request)}: {misplaced}")
        files.append(FileToWrite(path, _json(build_metadata(allocation, request, driver, devices))))
        metadata_paths[request] = str(path)
    spec_path = paths.spec(driver, ref.uid)
    spec = build_spec(allocation, driver, devices, metadata_paths)
    if handoff is not None:
        spec["devices"].append(build_handoff_entry(ref.uid, str(handoff)))
    files.append(FileToWrite(spec_path, _json(spec)))
    return WritePlan(
        files=tuple(files),
        claim=PreparedClaim(
            uid=ref.uid,
            namespace=ref.namespace,
            name=ref.name,
            devices=tuple(
                PreparedDevice(
                    request=item.request,
                    pool=item.pool,
                    device=item.device,
                    bdf=devices[item.device].bdf,
                    cdi_ids=build_cdi_ids(driver, ref.uid, item),
                    group=devices[item.device].group,
                )
                for item in allocation.devices
            ),
            files=(str(spec_path), *metadata_paths.values()),
            slots=tuple(
                PreparedSlot(
                    request=item.request,
                    pool=item.pool,
                    device=item.device,
                    cdi_ids=(cdi_id(driver, handoff_cdi_name(ref.uid)),),
                )
                for item in slots
            ),
            handoff=str(handoff or ""),
        ),
    )


def _duplicate(allocation: ClaimAllocation, driver: str) -> str | None:
    """What the allocation names twice: a device (under any spelling of its address), or two
    requests whose metadata would be one file. The CDI spec would define them twice, and the
    runtime refuses such a spec when the container starts."""
    by_bdf: dict[Bdf, Allocated] = {}
    by_file: dict[str, Allocated] = {}
    for item in allocation.devices:
        bdf = bdf_of_device(item.device)
        if bdf is not None and bdf in by_bdf:
            return (
                f"device {item.device} ({bdf}) is allocated twice, for requests"
                f" {quote_untrusted(by_bdf[bdf].request)} and {quote_untrusted(item.request)};"
                " this driver publishes each device for one allocation only"
            )
        if bdf is not None:
            by_bdf[bdf] = item
        request = main_request(item.request)
        first = by_file.setdefault(request, item)
        if first.request != item.request:
            return (
                f"requests {quote_untrusted(first.request)} and {quote_untrusted(item.request)}"
                f" would share one metadata file ({quote_untrusted(request)}/"
                f"{metadata_file_name(driver)}); the API allocates one subrequest per request"
            )
    return None


def _misplaced(
    allocation: ClaimAllocation, request: str, host_path: Path, driver: str, paths: Paths
) -> str | None:
    """Why a request's metadata would go elsewhere than its claim's own file in the metadata
    directory, on the host, or its claim's directory in the container; None when both are where
    they belong. A pure check on the paths."""
    # Names made of the request stay apart only while it is one plain name without a `_`.
    plain = request not in ("", ".", "..") and "/" not in request and "_" not in request
    if not (plain and _lies_in(host_path, paths.metadata_dir, 1)):
        return (
            f"its metadata would be written at {quote_untrusted(str(host_path))}, not as the"
            f" claim's own file in {paths.metadata_dir}: refused; {NOT_FROM_THE_API}"
        )
    container_path = PurePosixPath(metadata_container_path(allocation, request, driver))
    base = metadata_container_base(allocation)
    if not _lies_in(container_path, base, 3):
        return (
            f"its metadata would be mounted at {quote_untrusted(str(container_path))}, not in"
            f" {base}/ under the claim's name: refused; {NOT_FROM_THE_API}"
        )
    return None


def _lies_in(path: PurePath, directory: PurePath, levels: int) -> bool:
    """Whether `path` is `directory` joined with `levels` plain names (none empty, `.` or `..`)."""
    for _ in range(levels):
        if path.name in ("", ".", ".."):
            return False
        path = path.parent
    return path == directory


@dataclass(frozen=True, slots=True)
class _Holder:
    claim: PreparedClaim
    device: PreparedDevice


def _held_groups(others: Iterable[PreparedClaim]) -> dict[int, _Holder]:
    """Each IOMMU group other claims have, with one claim and device holding it: a group goes
    to one VM, whole."""
    held: dict[int, _Holder] = {}
    for claim in others:
        for device in claim.devices:
            held.setdefault(device.group, _Holder(claim, device))
    return held


def _taken(ref: ClaimRef, name: str, bdf: Bdf, holder: _Holder) -> str:
    claim, record = holder.claim, holder.device
    what = (
        "is already prepared"
        if record.bdf == bdf
        else f"shares IOMMU group {record.group} with {record.device} ({record.bdf}), prepared"
    )
    return (
        f"{ref}: device {name} ({bdf}) {what} for claim {claim.namespace}/{claim.name}"
        f" (uid {claim.uid}); it is freed when that claim's pod is gone"
    )


def _listed(devices: Iterable[Allocated | PreparedDevice | PreparedSlot]) -> str:
    return ", ".join(
        f"{quote_untrusted(d.device)} for request {quote_untrusted(d.request)}" for d in devices
    )


def _json(document: Any) -> bytes:
    """Compact: only the runtime and KubeVirt read these, and without an indent json uses its C
    encoder (a prepare spent more time indenting its spec than writing it)."""
    return json.dumps(document, separators=(",", ":")).encode()
