"""The committed gRPC stubs must be exactly what proto/generate.py makes from proto/*.proto."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

REPO = Path(__file__).resolve().parents[1]
PROTO = REPO / "proto"
GENERATOR = PROTO / "generate.py"
SUFFIXES = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")
FIX = "run `python proto/generate.py` and commit the result"
# Every upstream API we speak; losing one of these files would silently drop its stubs.
EXPECTED_PROTOS = {
    "deviceplugin/podresources/v1/api.proto",
    "deviceplugin/v1beta1/api.proto",
    "dra/healthapi/v1/api.proto",
    "dra/healthapi/v1alpha1/api.proto",
    "dra/healthapi/v1beta1/api.proto",
    "dra/pluginregistration/v1/api.proto",
    "dra/v1/api.proto",
    "dra/v1beta1/api.proto",
    "launcher_hook/hooks/info/api.proto",
    "launcher_hook/hooks/v1alpha1/api.proto",
    "launcher_hook/hooks/v1alpha2/api.proto",
    "launcher_hook/hooks/v1alpha3/api.proto",
}
# Components whose package directory also holds generated stubs: their __init__.py is theirs.
COMPONENT_PACKAGES = ("deviceplugin", "dra", "launcher_hook")


def protos() -> list[Path]:
    return sorted(p.relative_to(PROTO) for p in PROTO.rglob("*.proto"))


def outputs(proto: Path) -> list[Path]:
    stem = proto.with_suffix("")
    return [stem.with_name(stem.name + suffix) for suffix in SUFFIXES]


def stub_files(root: Path) -> set[Path]:
    """Every generated stub below the top-level packages that proto/ generates into."""
    tops = {p.parts[0] for p in protos()}
    return {
        f.relative_to(root)
        for top in tops
        for f in (root / top).rglob("*")
        if f.is_file() and f.name.endswith(SUFFIXES)
    }


def load_generator() -> ModuleType:
    spec = importlib.util.spec_from_file_location("proto_generate", GENERATOR)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_protos_exist() -> None:
    assert {p.as_posix() for p in protos()} == EXPECTED_PROTOS


def test_component_packages_keep_a_hand_written_docstring() -> None:
    generated = [
        f"{name}/__init__.py"
        for name in COMPONENT_PACKAGES
        if "do not edit" in (REPO / name / "__init__.py").read_text()
    ]
    assert not generated, f"component packages with a generated __init__.py: {generated}"


def test_every_proto_has_committed_outputs() -> None:
    missing: list[str] = []
    for proto in protos():
        missing += [str(out) for out in outputs(proto) if not (REPO / out).is_file()]
        missing += [
            str(pkg / "__init__.py")
            for pkg in proto.parents
            if pkg != Path() and not (REPO / pkg / "__init__.py").is_file()
        ]
    assert not missing, f"missing generated files: {', '.join(missing)}; {FIX}"


def test_committed_stubs_match_generator(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, str(GENERATOR), "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0, f"generator failed:\n{result.stderr}"

    fresh = stub_files(tmp_path)
    expected = {out for proto in protos() for out in outputs(proto)}
    assert fresh == expected, f"generator wrote {sorted(map(str, fresh))}"

    committed = stub_files(REPO)
    stale = sorted(
        str(rel)
        for rel in fresh
        if not (REPO / rel).is_file() or (REPO / rel).read_bytes() != (tmp_path / rel).read_bytes()
    )
    orphans = sorted(str(rel) for rel in committed - fresh)
    problems = [f"stale or missing: {', '.join(stale)}"] if stale else []
    problems += [f"no .proto for: {', '.join(orphans)}"] if orphans else []
    assert not problems, "; ".join(problems) + f"; {FIX}"

    # Packages the generator had to create must exist in the repository too.
    inits = sorted(
        str(init.relative_to(tmp_path))
        for init in tmp_path.rglob("__init__.py")
        if not (REPO / init.relative_to(tmp_path)).is_file()
    )
    assert not inits, f"missing package files: {', '.join(inits)}; {FIX}"


def test_generator_never_overwrites_init(tmp_path: Path) -> None:
    top = protos()[0].parts[0]
    (tmp_path / top).mkdir()
    init = tmp_path / top / "__init__.py"
    init.write_text('"""Hand-written."""\n')
    subprocess.run([sys.executable, str(GENERATOR), "--out", str(tmp_path)], check=True)
    assert init.read_text() == '"""Hand-written."""\n'
    nested = tmp_path / protos()[0].parent / "__init__.py"
    assert nested.read_text() == (
        f'"""Generated from proto/{protos()[0].parent.as_posix()}; do not edit."""\n'
    )


def test_generator_reports_protoc_failure(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    generator = load_generator()
    broken = tmp_path / "proto"
    broken.mkdir()
    (broken / "broken.proto").write_text('syntax = "proto3";\nmessage {\n')
    monkeypatch.setattr(generator, "PROTO_ROOT", broken)
    assert generator.main(["--out", str(tmp_path / "out")]) == 1
    last = capfd.readouterr().err.strip().splitlines()[-1]
    assert last.startswith("generate.py: protoc failed"), last
