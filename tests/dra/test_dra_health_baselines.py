"""The fatal-error baselines the driver keeps for the next judge: read back as written, and a
file someone mangled read as none (it is only a hint; a ValueError here would stop the start)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dra.driver import BASELINES_FILE, read_baselines
from dra.health_judge import Baseline, baselines_json


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
