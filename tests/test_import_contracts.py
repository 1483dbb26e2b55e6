"""Layers held by imports: hostdev below every component, components beside each other, the
simulated world (`sim`) beside them and used by nothing that runs on a node, the command on top.
Inside hostdev, the model and discovery stand below its two wings (`hostdev.binding`,
`hostdev.labels`), which do not import each other. A forbidden import anywhere fails here,
naming file and line."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
COMPONENTS = ("deviceplugin", "dra", "launcher_hook", "webhook")
ABOVE_PRODUCT = ("kubevirt_iommufd", "sim")
FORBIDDEN: dict[str, set[str]] = {
    "hostdev": {*COMPONENTS, *ABOVE_PRODUCT},
    **{c: {*(o for o in COMPONENTS if o != c), *ABOVE_PRODUCT} for c in COMPONENTS},
    "sim": {"kubevirt_iommufd"},
}
HOSTDEV_WINGS = ("hostdev.binding", "hostdev.labels")


def imported_modules(path: Path) -> list[tuple[int, str]]:
    tree = ast.parse(path.read_text(), filename=str(path))
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.extend((node.lineno, alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.extend((node.lineno, f"{node.module}.{alias.name}") for alias in node.names)
    return found


def within(module: str, package: str) -> bool:
    return module == package or module.startswith(f"{package}.")


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_package_imports_only_what_its_layer_allows(package: str) -> None:
    violations = [
        f"{path.relative_to(REPO)}:{line} imports {name}"
        for path in sorted((REPO / package).rglob("*.py"))
        for line, name in imported_modules(path)
        if any(within(name, forbidden) for forbidden in FORBIDDEN[package])
    ]
    assert violations == []


def hostdev_part(path: Path) -> str:
    """`hostdev.binding`, `hostdev.labels`, or `hostdev` for the model and discovery."""
    relative = path.relative_to(REPO).with_suffix("")
    dotted = ".".join(relative.parts)
    return next((wing for wing in HOSTDEV_WINGS if within(dotted, wing)), "hostdev")


@pytest.mark.parametrize("part", ["hostdev", *HOSTDEV_WINGS])
def test_hostdev_model_stands_below_its_wings(part: str) -> None:
    """The model imports neither wing; a wing imports the model but not the other wing."""
    forbidden = [w for w in HOSTDEV_WINGS if w != part]
    violations = [
        f"{path.relative_to(REPO)}:{line} imports {name}"
        for path in sorted((REPO / "hostdev").rglob("*.py"))
        if hostdev_part(path) == part
        for line, name in imported_modules(path)
        if any(within(name, wing) for wing in forbidden)
    ]
    assert violations == []


def test_contract_check_sees_a_violation(tmp_path: Path) -> None:
    module = tmp_path / "bad.py"
    module.write_text("import os\nfrom webhook import review\nimport deviceplugin.v1beta1\n")
    assert imported_modules(module) == [
        (1, "os"),
        (2, "webhook.review"),
        (3, "deviceplugin.v1beta1"),
    ]
    assert within("hostdev.binding.plan", "hostdev.binding")
    assert not within("hostdev.bindings", "hostdev.binding")
    assert hostdev_part(REPO / "hostdev" / "binding" / "plan.py") == "hostdev.binding"
    assert hostdev_part(REPO / "hostdev" / "scan.py") == "hostdev"
