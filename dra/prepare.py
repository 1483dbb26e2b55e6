"""NodePrepareResources and NodeUnprepareResources, as the kubelet asks them: per claim, check
the allocation against the API server and the host, write the CDI spec and metadata, remember
the claim; later, take all of it back. Either call may come again at any time (kubelet retries,
restarts of either side) and must give the same answer without doing the work twice.

Every failure is the claim's own answer (an error string naming the claim, the device and the
fix); one bad claim never fails the others of the same call.
"""

from __future__ import annotations

import json
import logging
import re
import shutil
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from dra.api import ApiError
from dra.binding import BindingError, OnDemandBinder
from dra.cdi import PreparedDevice, build_cdi_ids, build_metadata, build_spec, spec_file_name
from dra.claims import ClaimAllocation, ClaimError, ClaimRef, parse_allocation
from dra.devices import DraDevice, bdf_of_device
from dra.state import ClaimStore, PreparedClaim, PreparedRecord, StateError
from hostdev.atomic_file import write_file_atomically
from hostdev.bdf import Bdf
from hostdev.errors import HostdevError
from hostdev.untrusted import quote_untrusted

log = logging.getLogger(__name__)
# Object names and UIDs as the API server allows them; anything else never reaches a path.
_UID = re.compile(r"[a-z0-9]([-a-z0-9]{0,62})")
_NAME = re.compile(r"[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?")


class ClaimReader(Protocol):
    def read_claim(self, namespace: str, name: str) -> dict[str, Any]: ...


JudgeDevices = Callable[[Iterable[Bdf]], Mapping[Bdf, DraDevice | str]]
"""Reads the named functions (and their groups) again and judges each as a published device."""


@dataclass(frozen=True, slots=True)
class Paths:
    cdi_dir: Path
    metadata_dir: Path

    def spec(self, driver: str, uid: str) -> Path:
        return self.cdi_dir / spec_file_name(driver, uid)

    def metadata_root(self, uid: str) -> Path:
        return self.metadata_dir / uid

    def metadata(self, uid: str, request: str, driver: str) -> Path:
        return self.metadata_root(uid) / request / f"{driver}-metadata.json"


class ClaimPreparer:
    def __init__(
        self,
        driver: str,
        pool: str,
        claims: ClaimReader,
        judge: JudgeDevices,
        store: ClaimStore,
        paths: Paths,
        on_change: Callable[[], None] = lambda: None,
        binder: OnDemandBinder | None = None,
    ) -> None:
        self._driver = driver
        self._pool = pool
        self._claims = claims
        self._judge = judge
        self._store = store
        self._paths = paths
        self._on_change = on_change
        """Told after a claim was prepared or forgotten: what may be published changed."""
        self._binder = binder
        """Binds on-demand devices; without one only devices already on VFIO are prepared."""
        # One claim at a time: two claims racing for one device must not both see it free.
        self._lock = threading.Lock()

    def prepare(self, refs: Sequence[ClaimRef]) -> dict[str, PreparedClaim | str]:
        answers: dict[str, PreparedClaim | str] = {}
        for ref in refs:
            try:
                answers[ref.uid] = self._prepare_one(ref)
            except (ClaimError, ApiError, StateError, BindingError, HostdevError, OSError) as error:
                # Every failure is this claim's answer; the others of the call go on.
                message = str(error) if isinstance(error, ClaimError) else f"{ref}: {error}"
                if isinstance(error, ApiError):
                    message += "; the kubelet retries"
                log.warning("prepare failed: %s", quote_untrusted(message, 500))
                answers[ref.uid] = message
        return answers

    def unprepare(self, refs: Sequence[ClaimRef]) -> dict[str, str | None]:
        answers: dict[str, str | None] = {}
        for ref in refs:
            try:
                self._unprepare_one(ref)
                answers[ref.uid] = None
            except (ClaimError, OSError, StateError, BindingError, HostdevError) as error:
                message = f"{ref}: cannot clean up: {error}"
                log.warning("unprepare failed: %s", quote_untrusted(message, 500))
                answers[ref.uid] = message
        return answers

    def _prepare_one(self, ref: ClaimRef) -> PreparedClaim:
        _check_ref(ref)
        with self._lock:
            known = self._store.get(ref.uid)
            if (
                known is not None
                and all(Path(f).exists() for f in known.files)
                and self._still_bound(known)
            ):
                return known
            allocation = parse_allocation(
                self._claims.read_claim(ref.namespace, ref.name), ref, self._driver, self._pool
            )
            devices = self._check_devices(allocation)
            try:
                prepared = self._write(allocation, devices)
                self._store.save(prepared)
            except (OSError, StateError):
                # Not recorded: devices bound for it must not stay on VFIO, unheld.
                if known is None and self._binder is not None:
                    self._binder.release(ref.uid)
                raise
        self._on_change()
        log.info(
            "prepared %s: %s",
            quote_untrusted(str(ref)),
            ", ".join(
                f"{d.device} ({d.bdf}) for request {quote_untrusted(d.request)}"
                for d in prepared.devices
            ),
        )
        return prepared

    def _check_devices(self, allocation: ClaimAllocation) -> list[tuple[PreparedDevice, Bdf, int]]:
        ref = allocation.ref
        wanted: dict[str, Bdf] = {}
        for item in allocation.devices:
            bdf = bdf_of_device(item.device)
            if bdf is None:
                raise ClaimError(
                    f"{ref}: device {quote_untrusted(item.device)} is not a name this driver"
                    " publishes; the allocation is from another driver's slice"
                )
            wanted[item.device] = bdf
        judged = self._judge(set(wanted.values()))
        devices: dict[Bdf, DraDevice] = {}
        for item in allocation.devices:
            bdf = wanted[item.device]
            device = judged.get(bdf, "gone from the host")
            if isinstance(device, str):
                raise ClaimError(
                    f"{ref}: device {item.device} ({bdf}) cannot be given to a VM: {device};"
                    " fix the device (inspect shows why) and recreate the pod"
                )
            self._check_group_free(ref, item.device, bdf, device.group)
            devices[bdf] = device
        to_bind = sorted(b for b, d in devices.items() if d.bind_on_demand)
        if to_bind:
            reset = any(devices[b].reset_after_use for b in to_bind)
            devices |= self._bind(ref, to_bind, reset)
        return [
            (
                PreparedDevice(
                    request=item.request,
                    pool=item.pool,
                    device=item.device,
                    device_nodes=devices[wanted[item.device]].device_nodes,
                    attributes=devices[wanted[item.device]].attributes,
                ),
                wanted[item.device],
                devices[wanted[item.device]].group,
            )
            for item in allocation.devices
        ]

    def _check_group_free(self, ref: ClaimRef, name: str, bdf: Bdf, group: int) -> None:
        held = self._store.holder_of(group, besides=ref.uid)
        if held is None:
            return
        holder, record = held
        what = (
            "is already prepared"
            if record.bdf == bdf
            else f"shares IOMMU group {group} with {record.device} ({record.bdf}), prepared"
        )
        raise ClaimError(
            f"{ref}: device {name} ({bdf}) {what} for claim {holder.namespace}/{holder.name}"
            f" (uid {holder.uid}); it is freed when that claim's pod is gone"
        )

    def _bind(self, ref: ClaimRef, bdfs: Sequence[Bdf], reset: bool) -> dict[Bdf, DraDevice]:
        """Bind on-demand devices to VFIO for the claim; their devices as they are then."""
        if self._binder is None:
            raise ClaimError(f"{ref}: devices {', '.join(map(str, bdfs))} are not on VFIO")
        latest: dict[Bdf, DraDevice | str] = {}

        def ready() -> bool:
            latest.update(self._judge(bdfs))
            return all(
                isinstance(d, DraDevice) and not d.bind_on_demand and not d.nodes_pending
                for d in latest.values()
            )

        try:
            self._binder.bind(ref.uid, bdfs, reset, ready)
        except (BindingError, HostdevError, OSError) as error:
            raise ClaimError(f"{ref}: {error}") from error
        return {b: d for b, d in latest.items() if isinstance(d, DraDevice)}

    def _still_bound(self, claim: PreparedClaim) -> bool:
        """Whether a claim's on-demand devices are still on VFIO (a reboot puts them back on
        their host drivers while the claim stays prepared)."""
        if self._binder is None or not self._binder.holds(claim.uid):
            return True
        judged = self._judge([d.bdf for d in claim.devices])
        return all(isinstance(d, DraDevice) and not d.bind_on_demand for d in judged.values())

    def _write(
        self, allocation: ClaimAllocation, devices: Sequence[tuple[PreparedDevice, Bdf, int]]
    ) -> PreparedClaim:
        ref, driver = allocation.ref, self._driver
        plain = [d for d, _, _ in devices]
        metadata_paths: dict[str, str] = {}
        for request in sorted({d.request for d in plain}):
            path = self._paths.metadata(ref.uid, request, driver)
            document = build_metadata(allocation, request, driver, plain)
            write_file_atomically(path, json.dumps(document, indent=1).encode(), 0o644)
            metadata_paths[request] = str(path)
        spec_path = self._paths.spec(driver, ref.uid)
        spec = build_spec(allocation, driver, plain, metadata_paths)
        write_file_atomically(spec_path, json.dumps(spec, indent=1).encode(), 0o644)
        return PreparedClaim(
            uid=ref.uid,
            namespace=ref.namespace,
            name=ref.name,
            devices=tuple(
                PreparedRecord(
                    request=d.request,
                    pool=d.pool,
                    device=d.device,
                    bdf=bdf,
                    cdi_ids=build_cdi_ids(driver, ref.uid, d),
                    group=group,
                )
                for d, bdf, group in devices
            ),
            files=(str(spec_path), *metadata_paths.values()),
        )

    def _unprepare_one(self, ref: ClaimRef) -> None:
        _check_ref(ref)
        with self._lock:
            known = self._store.get(ref.uid)
            # The files have fixed names, so a claim whose record was never written (a crash
            # between writing and recording) is still cleaned up.
            self._paths.spec(self._driver, ref.uid).unlink(missing_ok=True)
            for name in known.files if known else ():
                Path(name).unlink(missing_ok=True)
            shutil.rmtree(self._paths.metadata_root(ref.uid), ignore_errors=True)
            # The record goes last: while the devices are not back, their group stays held.
            if self._binder is not None:
                self._binder.release(ref.uid)
            self._store.forget(ref.uid)
        if known is not None:
            log.info("unprepared %s", quote_untrusted(str(ref)))
            self._on_change()


def _check_ref(ref: ClaimRef) -> None:
    if not _UID.fullmatch(ref.uid):
        raise ClaimError(f"claim uid {quote_untrusted(ref.uid)} is not a Kubernetes UID")
    if not _NAME.fullmatch(ref.namespace) or not _NAME.fullmatch(ref.name):
        raise ClaimError(
            f"claim {quote_untrusted(ref.namespace)}/{quote_untrusted(ref.name)}: not a valid"
            " namespace and object name"
        )
