"""The DRA driver's prepared-claim records as tests write them: a good one, and records of the
wrong JSON shape as a crash, a full disk or a careless hand could leave them, each with the
problem the one-line refusal names."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from dra.state import PreparedClaim, PreparedDevice
from hostdev.bdf import Bdf

UID = "a1b2c3d4-0000-4000-8000-0000000000aa"


def good_record(uid: str = UID) -> dict[str, Any]:
    device = PreparedDevice(
        "gpu", "node-a", "pci-0000-18-00-0", Bdf.parse("0000:18:00.0"), ("x/y=z",), 3
    )
    return PreparedClaim(uid, "vms", "vm-gpus", (device,), ("/cdi/spec.json",)).to_json()


def with_field(key: str, value: object, *, in_device: bool = False) -> dict[str, Any]:
    """A good record with one field of its own, or of its first device, replaced."""
    record = good_record()
    (record["devices"][0] if in_device else record)[key] = value
    return record


# id -> (the record file's text, the problem its one-line refusal names)
BAD_RECORDS: dict[str, tuple[str, str]] = {
    "null": ("null", "the record: expected an object, found null"),
    "array": ("[]", "the record: expected an object, found an array"),
    "string": ('"prepared"', "the record: expected an object, found 'prepared'"),
    "number": ("42", "the record: expected an object, found 42"),
    "wrong-field-types": (
        json.dumps(with_field("devices", {"gpu": "0000:18:00.0"})),
        "devices: expected an array, found an object",
    ),
}


def write_record(state_dir: Path, text: str, uid: str = UID) -> Path:
    path = state_dir / "claims" / f"{uid}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path
