"""Layers held by imports: hostdev below every component, components beside each other, the
command on top. A forbidden import anywhere in a package fails here, naming file and line."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
COMPONENTS = ("deviceplugin", "dra", "launcher_hook", "webhook")
FORBIDDEN = {
    "hostdev": {*COMPONENTS, "kubevirt_iommufd"},
    **{c: {*(o for o in COMPONENTS if o != c), "kubevirt_iommufd"} for c in COMPONENTS},
}


def imported_packages(path: Path) -> list[tuple[int, str]]:
    tree = ast.parse(path.read_text(), filename=str(path))
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.extend((node.lineno, alias.name.split(".")[0]) for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append((node.lineno, node.module.split(".")[0]))
    return found


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_package_imports_only_what_its_layer_allows(package: str) -> None:
    violations = [
        f"{path.relative_to(REPO)}:{line} imports {name}"
        for path in sorted((REPO / package).rglob("*.py"))
        for line, name in imported_packages(path)
        if name in FORBIDDEN[package]
    ]
    assert violations == []


def test_contract_check_sees_a_violation(tmp_path: Path) -> None:
    module = tmp_path / "bad.py"
    module.write_text("import os\nfrom webhook import review\nimport deviceplugin.v1beta1\n")
    assert imported_packages(module) == [(1, "os"), (2, "webhook"), (3, "deviceplugin")]
