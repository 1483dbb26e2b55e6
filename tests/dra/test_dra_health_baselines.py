"""What the driver keeps for the next instance (the fatal-error baselines, the published
devices): read back as written, and a file someone mangled read as what it holds of the shape
(it is only a hint; a ValueError here would stop the start)."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from types import MappingProxyType

import pytest

from dra.devices import DraDevice, device_name
from dra.driver import BASELINES_FILE, read_baselines
from dra.health_judge import Baseline, baselines_json
from dra.host_cache import parse_published, published_json
from hostdev.bdf import Bdf


def test_baselines_read_back_as_written(tmp_path: Path) -> None:
    baselines = {"pci-0000-18-00-0": Baseline("vfio-pci", 3), "pci-0000-2a-00-0": Baseline("", 0)}
    (tmp_path / BASELINES_FILE).write_text(json.dumps(baselines_json(baselines)))
    assert read_baselines(tmp_path / BASELINES_FILE) == baselines


@pytest.mark.parametrize(
    ("content", "kept"),
    [
        (b"", {}),
        (b"\xff\xfe", {}),
        (b"[1, 2]", {}),
        (b"[" * 100000, {}),
        (
            b'{"a": {"driver": "vfio-pci", "fatal": -1}, "b": {"driver": 1, "fatal": 0},'
            b' "c": {"driver": "x", "fatal": true}, "d": 5,'
            b' "e": {"driver": "vfio-pci", "fatal": 2}}',
            {"e": Baseline("vfio-pci", 2)},
        ),
    ],
    ids=["empty", "not UTF-8", "not an object", "nested too deeply", "bad entries left out"],
)
def test_a_mangled_file_is_read_as_what_it_holds_of_the_shape(
    tmp_path: Path, content: bytes, kept: dict[str, Baseline]
) -> None:
    (tmp_path / BASELINES_FILE).write_bytes(content)
    assert read_baselines(tmp_path / BASELINES_FILE) == kept


def test_no_file_is_no_baselines(tmp_path: Path) -> None:
    assert read_baselines(tmp_path / BASELINES_FILE) == {}


def test_the_published_devices_read_back_as_an_unusable_device_keeps_them() -> None:
    bdf = Bdf.parse("0000:3b:00.0")
    device = DraDevice(
        device_name(bdf),
        bdf,
        "nvidia.com/GA102",
        MappingProxyType({"vendorID": "10de", "iommuGroup": 14, "iommufd": True}),
        ("/dev/iommu",),
        14,
        reset_after_use=True,
    )
    (back,) = parse_published(json.loads(json.dumps(published_json([device]))))
    assert back == replace(device, device_nodes=())


@pytest.mark.parametrize(
    "data",
    [
        None,
        {"bdf": "0000:3b:00.0"},
        [1, "x", None],
        [{"bdf": "../etc", "resource": "r", "attributes": {}, "group": 1, "resetAfterUse": False}],
        [{"bdf": "0000:3b:00.0", "resource": "r", "attributes": {"a": []}, "group": 1}],
        [{"bdf": "0000:3b:00.0", "resource": "r", "attributes": {}, "group": True}],
    ],
    ids=["nothing", "not a list", "no objects", "no address", "a list attribute", "no group"],
)
def test_published_devices_of_another_shape_are_left_out(data: object) -> None:
    assert parse_published(data) == ()
