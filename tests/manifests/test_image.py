"""The Dockerfile builds what the manifests run: multi-stage, no tool chain in the final stage,
non-root, pci.ids in, and Python packages pinned to versions pyproject.toml accepts."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

REPO = Path(__file__).resolve().parents[2]
DOCKERFILE = (REPO / "Dockerfile").read_text()


def stages() -> list[str]:
    return re.split(r"^FROM ", DOCKERFILE, flags=re.MULTILINE)[1:]


def pinned() -> dict[str, str]:
    versions: dict[str, str] = {}
    for line in (REPO / "requirements/image.txt").read_text().splitlines():
        if line and not line.startswith("#"):
            name, _, version = line.partition("==")
            assert version, f"{line!r} is not pinned with =="
            versions[canonicalize_name(name)] = version
    return versions


def test_image_requirements_satisfy_pyproject() -> None:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    versions = pinned()
    for text in project["dependencies"]:
        requirement = Requirement(text)
        name = canonicalize_name(requirement.name)
        assert name in versions, f"{requirement.name} is in pyproject.toml but not in the image"
        assert requirement.specifier.contains(versions[name]), (
            f"the image pins {requirement.name}=={versions[name]}, outside {requirement.specifier}"
        )


def test_multi_stage_without_a_tool_chain_in_the_final_stage() -> None:
    build, final = stages()
    assert " AS build" in build.splitlines()[0]
    assert "gcc" in build and "libvirt-dev" in build
    for tool in ("gcc", "libc6-dev", "-dev ", "build-essential", "pkg-config"):
        assert tool not in final, f"{tool} in the final stage"
    assert "pci.ids" in final and "libvirt0" in final
    assert re.search(r"^USER 65532:65532$", final, re.MULTILINE)
    assert 'ENTRYPOINT ["kubevirt-iommufd"]' in final
    # The wheels are bind-mounted, so they never become a layer.
    assert "--mount=type=bind,from=build" in final and "COPY --from" not in final


def test_base_image_is_pinned_to_an_exact_tag() -> None:
    base = re.search(r"^ARG PYTHON_IMAGE=(\S+)$", DOCKERFILE, re.MULTILINE)
    assert base is not None
    assert re.fullmatch(r"python:3\.11\.\d+-slim-bookworm", base[1])


def test_every_package_the_image_needs_is_copied() -> None:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())
    packages = project["tool"]["setuptools"]["packages"]["find"]["include"]
    for package in packages:
        name = package.rstrip("*")
        assert f"COPY {name} {name}" in DOCKERFILE, f"{name} is not copied into the build stage"
