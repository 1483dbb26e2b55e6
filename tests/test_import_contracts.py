"""Layers held by imports: hostdev below every component, components beside each other, the
simulated world (`sim`) beside them and used by nothing that runs on a node, the command on top.
Inside hostdev, the model and discovery stand below its two wings (`hostdev.binding`,
`hostdev.labels`), which do not import each other. A forbidden import anywhere fails here,
naming file and line. Inside a package, no module imports in a cycle (a function-level import
included): the command module stands on what it runs, never the other way round."""

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


def module_name(path: Path, root: Path) -> str:
    relative = path.relative_to(root).with_suffix("")
    return ".".join(relative.parts[:-1] if relative.name == "__init__" else relative.parts)


def import_graph(package: Path, root: Path) -> dict[str, set[str]]:
    """Each module of the package to the package's modules it imports, at any depth of its code.

    `from p import m` names `p.m` and `from p.m import f` names `p.m.f`: an import goes to the
    longest module its name starts with."""
    paths = {module_name(path, root): path for path in package.rglob("*.py")}
    return {
        module: {
            target
            for _, name in imported_modules(path)
            for target in [max((m for m in paths if within(name, m)), key=len, default=None)]
            if target is not None and target != module
        }
        for module, path in paths.items()
    }


def find_cycle(graph: dict[str, set[str]]) -> list[str]:
    """One import cycle as the modules along it (the first repeated at the end), or []."""
    finished: set[str] = set()

    def visit(module: str, path: list[str]) -> list[str]:
        if module in path:
            return [*path[path.index(module) :], module]
        if module in finished:
            return []
        for target in sorted(graph[module]):
            if cycle := visit(target, [*path, module]):
                return cycle
        finished.add(module)
        return []

    return next((cycle for module in sorted(graph) if (cycle := visit(module, []))), [])


@pytest.mark.parametrize("package", ["hostdev", *COMPONENTS, *ABOVE_PRODUCT])
def test_no_module_of_a_package_imports_in_a_cycle(package: str) -> None:
    assert find_cycle(import_graph(REPO / package, REPO)) == []


def test_cycle_check_sees_a_cycle_through_a_function_level_import(tmp_path: Path) -> None:
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "command.py").write_text("import os\nfrom pkg.flow import run\n")
    (package / "flow.py").write_text("from pkg import steps\n")
    (package / "steps.py").write_text("def run():\n    from pkg.command import main\n")
    graph = import_graph(package, tmp_path)
    assert graph == {
        "pkg": set(),
        "pkg.command": {"pkg.flow"},
        "pkg.flow": {"pkg.steps"},
        "pkg.steps": {"pkg.command"},
    }
    assert find_cycle(graph) == ["pkg.command", "pkg.flow", "pkg.steps", "pkg.command"]
    (package / "steps.py").write_text("def run():\n    import os\n")
    assert find_cycle(import_graph(package, tmp_path)) == []


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
