"""docs/architecture.md is true to the code: every module it names exists in the package whose
section names it, and every module of those packages is named there."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DOC = REPO / "docs" / "architecture.md"
SECTION = re.compile(r"^#{2,3} (\S+)", re.MULTILINE)
ROW = re.compile(r"^\| ([^|]+) \|", re.MULTILINE)
NAME = re.compile(r"`([a-z_0-9]+)`")


def documented() -> dict[str, set[str]]:
    """Package folder (`hostdev/binding`) -> the modules its table names."""
    text = DOC.read_text()
    found: dict[str, set[str]] = {}
    parts = SECTION.split(text)
    for heading, body in zip(parts[1::2], parts[2::2], strict=True):
        if (REPO / heading).is_dir():
            cells = [c for c in ROW.findall(body) if c.strip() not in {"module", "---"}]
            found[heading] = {name for cell in cells for name in NAME.findall(cell)}
    return found


def modules(package: str) -> set[str]:
    """The package's own modules: not its sub-packages, generated stubs or `__init__`."""
    return {
        path.stem
        for path in (REPO / package).glob("*.py")
        if path.stem != "__init__" and not path.stem.endswith(("_pb2", "_pb2_grpc"))
    }


def test_every_package_of_the_house_has_its_table() -> None:
    expected = {
        "kubevirt_iommufd", "sim", "deviceplugin", "dra", "launcher_hook", "webhook",
        "hostdev", "hostdev/binding", "hostdev/labels",
    }  # fmt: skip
    assert set(documented()) == expected


@pytest.mark.parametrize("package", sorted(documented()))
def test_the_table_names_exactly_the_packages_modules(package: str) -> None:
    assert documented()[package] == modules(package)
