"""Regenerate the committed Python gRPC stubs from the .proto files under proto/.

Run from anywhere::

    python proto/generate.py            # writes into the repository root
    python proto/generate.py --out DIR  # writes into DIR instead (used by the staleness test)

For every ``proto/<path>/<name>.proto`` (sorted) this writes ``<out>/<path>/<name>_pb2.py``,
``<name>_pb2.pyi`` and ``<name>_pb2_grpc.py`` with ``grpc_tools.protoc``, exactly as protoc
emits them. The include root is proto/, so descriptor file names such as
``deviceplugin/v1beta1/api.proto`` stay unique across packages. Every output directory below
``<out>`` that lacks an ``__init__.py`` gets one holding only a docstring; an existing one is
never touched. Exits non-zero, with one line on stderr, if protoc fails.
"""

from __future__ import annotations

import argparse
import importlib.resources
import sys
from pathlib import Path

import grpc_tools.protoc

PROTO_ROOT = Path(__file__).resolve().parent
REPO_ROOT = PROTO_ROOT.parent


def proto_files() -> list[Path]:
    """Every .proto file under proto/, relative to proto/, in a stable order."""
    return sorted(p.relative_to(PROTO_ROOT) for p in PROTO_ROOT.rglob("*.proto"))


def run_protoc(out: Path, protos: list[Path]) -> int:
    """Run protoc once over ``protos`` and return its exit status."""
    well_known = importlib.resources.files("grpc_tools") / "_proto"
    args = [
        "grpc_tools.protoc",
        f"-I{PROTO_ROOT}",
        f"-I{well_known}",
        f"--python_out={out}",
        f"--pyi_out={out}",
        f"--grpc_python_out={out}",
        *(str(PROTO_ROOT / p) for p in protos),
    ]
    return int(grpc_tools.protoc.main(args))


def add_init_files(out: Path, protos: list[Path]) -> None:
    """Create a docstring-only __init__.py in each package directory that has none."""
    package_dirs = {parent for p in protos for parent in p.parents if parent != Path()}
    for rel in sorted(package_dirs):
        init = out / rel / "__init__.py"
        if not init.exists():
            init.write_text(f'"""Generated from proto/{rel.as_posix()}; do not edit."""\n')


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Regenerate the Python gRPC stubs.")
    parser.add_argument(
        "--out", type=Path, default=REPO_ROOT, help="output root (default: the repository root)"
    )
    out: Path = parser.parse_args(argv).out.resolve()
    protos = proto_files()
    if not protos:
        print(f"generate.py: no .proto files under {PROTO_ROOT}", file=sys.stderr)
        return 1
    out.mkdir(parents=True, exist_ok=True)
    status = run_protoc(out, protos)
    if status != 0:
        print(f"generate.py: protoc failed with exit status {status}", file=sys.stderr)
        return 1
    add_init_files(out, protos)
    return 0


if __name__ == "__main__":
    sys.exit(main())
