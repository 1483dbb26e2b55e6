"""The driver's memory of prepared claims, one JSON file per claim under the state directory.

A claim is recorded after its CDI spec and metadata are written and before the kubelet hears it
is prepared, so a retried call, or one after a restart of ours, gets the same answer and finds
the same devices taken; it is forgotten only after its files are gone.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hostdev.atomic_file import sync_directory, write_file_atomically
from hostdev.bdf import Bdf

log = logging.getLogger(__name__)
STATE_VERSION = 1


class StateError(Exception):
    """The state directory cannot be read or written; the message names the path."""


@dataclass(frozen=True, slots=True)
class PreparedDevice:
    """One device of a prepared claim, as recorded: what was asked (request, pool, device), the
    function it is, and what the kubelet hands the runtime for it."""

    request: str
    pool: str
    device: str
    bdf: Bdf
    cdi_ids: tuple[str, ...]
    group: int
    """The function's IOMMU group: no other claim may have a function of it."""


@dataclass(frozen=True, slots=True)
class PreparedClaim:
    uid: str
    namespace: str
    name: str
    devices: tuple[PreparedDevice, ...]
    files: tuple[str, ...]
    """Every file written for the claim (CDI spec, metadata), removed on unprepare."""

    def to_json(self) -> dict[str, Any]:
        return {
            "version": STATE_VERSION,
            "uid": self.uid,
            "namespace": self.namespace,
            "name": self.name,
            "devices": [
                {
                    "request": d.request,
                    "pool": d.pool,
                    "device": d.device,
                    "bdf": str(d.bdf),
                    "cdiIds": list(d.cdi_ids),
                    "iommuGroup": d.group,
                }
                for d in self.devices
            ],
            "files": list(self.files),
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> PreparedClaim:
        if data.get("version") != STATE_VERSION:
            raise ValueError(f"state version {data.get('version')!r}, expected {STATE_VERSION}")
        return cls(
            uid=str(data["uid"]),
            namespace=str(data["namespace"]),
            name=str(data["name"]),
            devices=tuple(
                PreparedDevice(
                    request=str(d["request"]),
                    pool=str(d["pool"]),
                    device=str(d["device"]),
                    bdf=Bdf.parse(str(d["bdf"])),
                    cdi_ids=tuple(str(i) for i in d["cdiIds"]),
                    group=int(d["iommuGroup"]),
                )
                for d in data["devices"]
            ),
            files=tuple(str(f) for f in data["files"]),
        )


class ClaimStore:
    """Prepared claims by UID, kept in memory and in `<state_dir>/claims/<uid>.json`."""

    def __init__(self, state_dir: Path) -> None:
        self._dir = state_dir / "claims"
        self._claims: dict[str, PreparedClaim] = {}
        # The preparer writes while the publisher reads which groups are held.
        self._lock = threading.Lock()

    def load(self) -> None:
        """Read every record. An unreadable one stops the driver (StateError naming the file):
        skipping it would set its devices free for another claim while a VM may have them."""
        try:
            self._dir.mkdir(parents=True, exist_ok=True)
        except OSError as error:
            raise StateError(f"state directory {self._dir}: {error.strerror}") from error
        for claim in read_prepared_claims(self._dir.parent, strict=True):
            self._claims[claim.uid] = claim

    def get(self, uid: str) -> PreparedClaim | None:
        return self._claims.get(uid)

    def __iter__(self) -> Iterator[PreparedClaim]:
        return iter(self._snapshot())

    def _snapshot(self) -> list[PreparedClaim]:
        with self._lock:
            return list(self._claims.values())

    def held(self) -> tuple[frozenset[int], frozenset[Bdf]]:
        """The IOMMU groups and the functions prepared claims have."""
        records = [d for c in self._snapshot() for d in c.devices]
        return frozenset(d.group for d in records), frozenset(d.bdf for d in records)

    def save(self, claim: PreparedClaim) -> None:
        data = json.dumps(claim.to_json(), indent=1).encode()
        try:
            write_file_atomically(self._dir / f"{claim.uid}.json", data, 0o600)
        except OSError as error:
            raise StateError(
                f"cannot record {claim.uid} in {self._dir}: {error.strerror}"
            ) from error
        with self._lock:
            self._claims[claim.uid] = claim

    def forget(self, uid: str) -> None:
        path = self._dir / f"{uid}.json"
        try:
            path.unlink(missing_ok=True)
            sync_directory(self._dir)
        except OSError as error:
            raise StateError(f"cannot remove {path}: {error.strerror}") from error
        with self._lock:
            self._claims.pop(uid, None)


def read_prepared_claims(state_dir: Path, *, strict: bool = False) -> tuple[PreparedClaim, ...]:
    """The prepared claims recorded under `state_dir` (none when it has no records), changing
    nothing; an unreadable record raises StateError when `strict`, else is logged and skipped."""
    directory = state_dir / "claims"
    try:
        paths = sorted(directory.glob("*.json"))
    except OSError as error:
        raise StateError(f"state directory {directory}: {error.strerror}") from error
    claims: list[PreparedClaim] = []
    for path in paths:
        try:
            claims.append(PreparedClaim.from_json(json.loads(path.read_text())))
        except (OSError, ValueError, KeyError, TypeError) as error:
            if strict:
                raise StateError(
                    f"unreadable prepared-claim record {path}: {error}; check which device the"
                    " claim had (kubevirt-iommufd inspect), then fix or remove the file"
                ) from error
            log.error("unreadable prepared-claim record %s: %s; left in place", path, error)
    return tuple(claims)
