"""`inspect` names the claim the DRA driver prepared each device for, from its state directory."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest

from dra.state import PreparedClaim
from dra_kit import REF, Node
from kubevirt_iommufd.cli import main

ScenarioRoot = Callable[[str], Path]


@pytest.fixture
def node(scenario_root: ScenarioRoot, tmp_path: Path) -> Node:
    node = Node(scenario_root("hgx-h100"), tmp_path / "node")
    node.claims.add(REF, [("gpu", "pci-0000-18-00-0")])
    assert isinstance(node.preparer.prepare([REF])[REF.uid], PreparedClaim)
    return node


def test_json_names_the_claim_of_each_prepared_device(
    node: Node, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ["inspect", "--root", str(node.root), "--pci-ids", "none", "--json"]
    assert main([*args, "--dra-state-dir", str(node.state_dir)]) == 0
    report = json.loads(capsys.readouterr().out)
    prepared = {f["bdf"]: f["prepared_for"] for g in report["groups"] for f in g["functions"]}
    assert prepared["0000:18:00.0"] == f"claim vms/vm-gpus (uid {REF.uid})"
    assert prepared["0000:2a:00.0"] is None
    # Without a DRA state directory on the node, the field is not there at all.
    assert main(args) == 0
    report = json.loads(capsys.readouterr().out)
    assert all("prepared_for" not in f for g in report["groups"] for f in g["functions"])


def test_the_table_says_it_too(node: Node, capsys: pytest.CaptureFixture[str]) -> None:
    args = ["inspect", "0000:18:00.0", "--root", str(node.root), "--pci-ids", "none"]
    assert main([*args, "--dra-state-dir", str(node.state_dir)]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if "0000:18:00.0" in x)
    assert line.endswith(f"yes (iommufd); prepared for claim vms/vm-gpus (uid {REF.uid})")


def test_a_missing_state_directory_is_one_clear_error(
    node: Node, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["inspect", "--root", str(node.root), "--dra-state-dir", "/nonexistent"]) == 1
    assert "--dra-state-dir /nonexistent is not a directory" in capsys.readouterr().err
