"""Hostile claims through the real preparer on a simulated node: claim data that would make a
path elsewhere, or name a device or a metadata file twice, is refused, and not one file is
written, changed or removed anywhere."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest

from dra.claims import POD_CLAIM_NAME_ANNOTATION
from dra.state import PreparedClaim
from dra_cdi_schema_kit import validate_cdi_spec
from dra_kit import DRIVER, OTHER, REF, Node

ScenarioRoot = Callable[[str], Path]
GPU = "pci-0000-18-00-0"
OTHER_GPU = "pci-0000-2a-00-0"


@pytest.fixture
def node(scenario_root: ScenarioRoot, tmp_path: Path) -> Node:
    return Node(scenario_root("hgx-h100"), tmp_path / "node")


def tree(top: Path) -> dict[str, bytes | None]:
    """Every file (its bytes) and directory (None) under `top`."""
    return {
        str(p.relative_to(top)): None if p.is_dir() else p.read_bytes()
        for p in sorted(top.rglob("*"))
    }


def add_hostile(node: Node, tmp_path: Path, case: str) -> None:
    outside = tmp_path / "outside"
    requests = {
        "absolute": [(str(outside / "gpu"), GPU)],
        "up-two": [("../..", GPU)],
        "up-three": [("../../..", GPU)],
        "other-claim": [(f"../{OTHER.uid}/gpu", GPU)],
        "same-device-twice": [("gpu", GPU), ("nic", GPU)],
        "two-subrequests": [("gpu/a", GPU), ("gpu/b", "pci-0000-3a-00-0")],
    }
    if case == "pod-claim-name":
        node.claims.add(REF, [("gpu", GPU)], annotations={POD_CLAIM_NAME_ANNOTATION: "../../x"})
    else:
        node.claims.add(REF, requests[case])


@pytest.mark.parametrize(
    ("case", "words"),
    [
        ("absolute", "results[0].request is '/"),
        ("up-two", "results[0].request is '../..': not a request name the API allows"),
        ("up-three", "results[0].request is '../../..'"),
        ("other-claim", f"results[0].request is '../{OTHER.uid}/gpu'"),
        ("pod-claim-name", "pod-claim-name] is '../../x': not a pod's claim name"),
        ("same-device-twice", f"device {GPU} (0000:18:00.0) is allocated twice"),
        ("two-subrequests", "requests 'gpu/a' and 'gpu/b' would share one metadata file"),
    ],
)
def test_a_hostile_claim_is_refused_and_writes_nothing_anywhere(
    node: Node, tmp_path: Path, case: str, words: str
) -> None:
    node.claims.add(OTHER, [("gpu", OTHER_GPU)])
    assert isinstance(node.preparer.prepare([OTHER])[OTHER.uid], PreparedClaim)
    (tmp_path / "outside").mkdir()
    before = tree(tmp_path)
    add_hostile(node, tmp_path, case)
    answer = node.preparer.prepare([REF])[REF.uid]
    assert isinstance(answer, str)
    assert answer.startswith(f"{REF}: ") and words in answer
    assert tree(tmp_path) == before
    # The other claim's VM still reads its own device's address.
    (metadata,) = node.paths.metadata_dir.glob(f"{OTHER.uid}_*-metadata.json")
    (request,) = json.loads(metadata.read_text())["requests"]
    assert [d["name"] for d in request["devices"]] == [OTHER_GPU]


def test_a_subrequest_is_prepared_under_its_main_request(node: Node) -> None:
    node.claims.add(REF, [("gpu/high-memory", GPU)])
    answer = node.preparer.prepare([REF])[REF.uid]
    assert isinstance(answer, PreparedClaim)
    metadata = node.paths.metadata_dir / f"{REF.uid}_gpu_{DRIVER}-metadata.json"
    assert answer.files[1:] == (str(metadata),)
    assert [r["name"] for r in json.loads(metadata.read_text())["requests"]] == ["gpu/high-memory"]
    spec = json.loads(Path(answer.files[0]).read_text())
    validate_cdi_spec(spec)
    (mount,) = (
        e["containerEdits"]["mounts"][0] for e in spec["devices"] if "mounts" in e["containerEdits"]
    )
    assert mount["containerPath"] == (
        "/var/run/kubernetes.io/dra-device-attributes/resourceclaims/vm-gpus/gpu/"
        f"{DRIVER}-metadata.json"
    )
    assert node.preparer.unprepare([REF]) == {REF.uid: None}
    assert list(node.paths.metadata_dir.iterdir()) == []
