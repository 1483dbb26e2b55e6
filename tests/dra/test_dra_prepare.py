"""NodePrepare and NodeUnprepare on a simulated node: files written, answers repeated, devices
never given twice, state kept across a restart, every failure named per claim."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from dra.claims import ClaimRef
from dra.devices import build_devices
from dra.state import PreparedClaim, StateError
from dra_cdi_schema_kit import validate_cdi_spec
from dra_kit import DRIVER, NODE, OTHER, REF, Node
from hostdev.bdf import Bdf
from hostdev.config import default_config
from hostdev.scan import scan_host
from sim.host import BuildHost, hgx_h100, unbind_driver

ScenarioRoot = Callable[[str], Path]


@pytest.fixture
def node(scenario_root: ScenarioRoot, tmp_path: Path) -> Node:
    return Node(scenario_root("hgx-h100"), tmp_path)


def test_prepare_writes_the_cdi_spec_and_metadata(node: Node) -> None:
    node.claims.add(REF, [("gpu", "pci-0000-18-00-0"), ("gpu2", "pci-0000-2a-00-0")], generation=1)
    answer = node.preparer.prepare([REF])[REF.uid]
    assert isinstance(answer, PreparedClaim)
    assert [(d.request, d.device, str(d.bdf)) for d in answer.devices] == [
        ("gpu", "pci-0000-18-00-0", "0000:18:00.0"),
        ("gpu2", "pci-0000-2a-00-0", "0000:2a:00.0"),
    ]
    kind = f"{DRIVER}/claim"
    assert answer.devices[0].cdi_ids == (
        f"{kind}={REF.uid}-pci-0000-18-00-0",
        f"{kind}={REF.uid}-metadata-gpu",
    )
    spec = json.loads((node.paths.cdi_dir / f"{DRIVER}-claim_{REF.uid}.json").read_text())
    validate_cdi_spec(spec)
    assert spec["kind"] == kind
    by_name = {d["name"]: d["containerEdits"] for d in spec["devices"]}
    group = scan_host(node.root).function(Bdf.parse("0000:18:00.0")).iommu_group  # type: ignore[union-attr]
    assert by_name[f"{REF.uid}-pci-0000-18-00-0"]["deviceNodes"] == [
        {"path": "/dev/vfio/devices/vfio0"},
        {"path": "/dev/iommu"},
        {"path": "/dev/vfio/vfio"},
        {"path": f"/dev/vfio/{group}"},
    ]
    mount = by_name[f"{REF.uid}-metadata-gpu"]["mounts"][0]
    assert mount["containerPath"] == (
        "/var/run/kubernetes.io/dra-device-attributes/resourceclaims/vm-gpus/gpu/"
        f"{DRIVER}-metadata.json"
    )
    metadata = json.loads(Path(mount["hostPath"]).read_text())
    assert metadata["kind"] == "DeviceMetadata"
    assert metadata["metadata"] == {
        "name": "vm-gpus",
        "namespace": "vms",
        "uid": REF.uid,
        "generation": 1,
    }
    (request,) = metadata["requests"]
    assert request["name"] == "gpu"
    (device,) = request["devices"]
    assert device["name"] == "pci-0000-18-00-0" and device["pool"] == NODE
    assert device["attributes"]["resource.kubernetes.io/pciBusID"] == {"string": "0000:18:00.0"}


def test_template_claims_put_metadata_under_the_pods_claim_name(node: Node) -> None:
    node.claims.add(
        REF,
        [("gpu", "pci-0000-18-00-0")],
        annotations={"resource.kubernetes.io/pod-claim-name": "gpus"},
    )
    answer = node.preparer.prepare([REF])[REF.uid]
    assert isinstance(answer, PreparedClaim)
    spec = json.loads(Path(answer.files[0]).read_text())
    validate_cdi_spec(spec)
    mount = next(d for d in spec["devices"] if "mounts" in d["containerEdits"])
    path = mount["containerEdits"]["mounts"][0]["containerPath"]
    assert path.startswith(
        "/var/run/kubernetes.io/dra-device-attributes/resourceclaimtemplates/gpus/gpu/"
    )
    assert (
        json.loads(Path(mount["containerEdits"]["mounts"][0]["hostPath"]).read_text())[
            "podClaimName"
        ]
        == "gpus"
    )


def test_a_repeated_prepare_answers_the_same_without_asking_the_api_again(node: Node) -> None:
    node.claims.add(REF, [("gpu", "pci-0000-18-00-0")])
    first = node.preparer.prepare([REF])[REF.uid]
    node.claims.down = True
    assert node.preparer.prepare([REF])[REF.uid] == first
    # After a restart of the driver too.
    assert node.start().prepare([REF])[REF.uid] == first


def test_a_device_prepared_for_one_claim_is_refused_to_another(node: Node) -> None:
    node.claims.add(REF, [("gpu", "pci-0000-18-00-0")])
    node.claims.add(OTHER, [("gpu", "pci-0000-18-00-0")])
    node.preparer.prepare([REF])
    answer = node.start().prepare([OTHER])[OTHER.uid]
    assert isinstance(answer, str)
    assert "already prepared for claim vms/vm-gpus" in answer
    assert not (node.paths.cdi_dir / f"{DRIVER}-claim_{OTHER.uid}.json").exists()
    # Freed by the first claim's unprepare.
    assert node.preparer.unprepare([REF]) == {REF.uid: None}
    assert isinstance(node.start().prepare([OTHER])[OTHER.uid], PreparedClaim)


def test_unprepare_removes_everything_and_is_idempotent(node: Node) -> None:
    node.claims.add(REF, [("gpu", "pci-0000-18-00-0")])
    answer = node.preparer.prepare([REF])[REF.uid]
    assert isinstance(answer, PreparedClaim)
    assert node.preparer.unprepare([REF]) == {REF.uid: None}
    assert not any(Path(f).exists() for f in answer.files)
    assert not list((node.state_dir / "claims").iterdir())
    assert node.preparer.unprepare([REF]) == {REF.uid: None}
    assert node.start().unprepare([REF]) == {REF.uid: None}


def test_metadata_files_lie_side_by_side_and_an_unprepare_takes_only_its_own(node: Node) -> None:
    """No directory per claim or request (one mkdir and one rmdir fewer per claim): each file is
    named after its claim and request, and the CDI spec mounts the file itself."""
    node.claims.add(REF, [("gpu", "pci-0000-18-00-0"), ("nic", "pci-0000-2a-00-0")])
    node.claims.add(OTHER, [("gpu", "pci-0000-3a-00-0")])
    for ref in (REF, OTHER):
        assert isinstance(node.preparer.prepare([ref])[ref.uid], PreparedClaim)
    suffix = f"{DRIVER}-metadata.json"
    assert sorted(p.name for p in node.paths.metadata_dir.iterdir()) == [
        f"{REF.uid}_gpu_{suffix}",
        f"{REF.uid}_nic_{suffix}",
        f"{OTHER.uid}_gpu_{suffix}",
    ]
    assert node.preparer.unprepare([REF]) == {REF.uid: None}
    assert [p.name for p in node.paths.metadata_dir.iterdir()] == [f"{OTHER.uid}_gpu_{suffix}"]


def test_files_written_before_a_crash_left_no_record_are_removed_by_the_unprepare(
    node: Node,
) -> None:
    node.claims.add(REF, [("gpu", "pci-0000-18-00-0")])
    node.claims.add(OTHER, [("gpu", "pci-0000-3a-00-0")])
    for ref in (REF, OTHER):
        assert isinstance(node.preparer.prepare([ref])[ref.uid], PreparedClaim)
    (node.state_dir / "claims" / f"{REF.uid}.json").unlink()
    assert node.start().unprepare([REF]) == {REF.uid: None}
    left = {p.name for d in (node.paths.cdi_dir, node.paths.metadata_dir) for p in d.iterdir()}
    assert left == {f"{DRIVER}-claim_{OTHER.uid}.json", f"{OTHER.uid}_gpu_{DRIVER}-metadata.json"}


def test_a_claim_prepared_with_a_metadata_directory_of_its_own_is_unprepared_whole(
    node: Node,
) -> None:
    """A claim a driver from before the files lay side by side prepared (`<uid>/<request>/`):
    after an upgrade its unprepare removes its directories too."""
    node.claims.add(REF, [("gpu", "pci-0000-18-00-0")])
    answer = node.preparer.prepare([REF])[REF.uid]
    assert isinstance(answer, PreparedClaim)
    spec, flat = answer.files
    legacy = node.paths.previous_metadata_dir / REF.uid / "gpu" / f"{DRIVER}-metadata.json"
    legacy.parent.mkdir(parents=True)
    Path(flat).rename(legacy)
    _rewrite_record(node, [spec, str(legacy)])
    assert node.start().unprepare([REF]) == {REF.uid: None}
    assert list(node.paths.previous_metadata_dir.iterdir()) == []
    assert list(node.paths.metadata_dir.iterdir()) == []


def _rewrite_record(node: Node, files: list[str]) -> None:
    """The claim REF's record as a release that wrote its files elsewhere left it."""
    record = node.state_dir / "claims" / f"{REF.uid}.json"
    document = json.loads(record.read_text())
    document["files"] = files
    record.write_text(json.dumps(document))


def _as_the_previous_release_left_it(node: Node) -> tuple[str, Path]:
    """REF prepared as by the release before the run directory: its metadata file under the
    state directory, named as now, the record naming it there, and a mark of an earlier
    unprepare beside it; the CDI spec and the new file."""
    node.claims.add(REF, [("gpu", "pci-0000-18-00-0")])
    answer = node.preparer.prepare([REF])[REF.uid]
    assert isinstance(answer, PreparedClaim)
    spec, metadata = answer.files
    previous = node.paths.previous_metadata_dir / Path(metadata).name
    previous.parent.mkdir(parents=True)
    Path(metadata).rename(previous)
    _rewrite_record(node, [spec, str(previous)])
    (node.state_dir / "unprepared").mkdir(mode=0o700)
    (node.state_dir / "unprepared" / OTHER.uid).write_bytes(b"\n")
    return spec, previous


def test_a_claim_the_previous_release_prepared_is_answered_and_unprepared_from_where_it_is(
    node: Node,
) -> None:
    spec, previous = _as_the_previous_release_left_it(node)
    restarted = node.start()
    answer = restarted.prepare([REF])[REF.uid]
    assert isinstance(answer, PreparedClaim) and answer.files == (spec, str(previous))
    assert list(node.paths.metadata_dir.iterdir()) == []
    assert restarted.unprepare([REF]) == {REF.uid: None}
    assert not Path(spec).exists() and not previous.exists()
    assert list(node.paths.metadata_dir.iterdir()) == []


def test_a_claim_the_previous_release_prepared_gets_its_files_here_after_a_reboot(
    node: Node,
) -> None:
    """The reboot empties the tmpfs (CDI spec, run directory); the retried prepare writes the
    metadata file into the run directory, and the unprepare removes the one the previous release
    left under the state directory too."""
    spec, previous = _as_the_previous_release_left_it(node)
    Path(spec).unlink()
    shutil.rmtree(node.run_dir)
    restarted = node.start()
    answer = restarted.prepare([REF])[REF.uid]
    assert isinstance(answer, PreparedClaim)
    (metadata,) = node.paths.metadata_dir.iterdir()
    assert answer.files == (spec, str(metadata)) and metadata.name == previous.name
    mounts = [m for d in json.loads(Path(spec).read_text())["devices"] for m in _mounts(d)]
    assert [m["hostPath"] for m in mounts] == [str(metadata)]
    assert restarted.unprepare([REF]) == {REF.uid: None}
    assert not Path(spec).exists() and not metadata.exists() and not previous.exists()


def _mounts(entry: dict[str, Any]) -> list[dict[str, Any]]:
    mounts: list[dict[str, Any]] = entry["containerEdits"].get("mounts", [])
    return mounts


def test_files_the_previous_release_wrote_before_a_crash_left_no_record_are_removed(
    node: Node,
) -> None:
    spec, previous = _as_the_previous_release_left_it(node)
    (node.state_dir / "claims" / f"{REF.uid}.json").unlink()
    assert node.start().unprepare([REF]) == {REF.uid: None}
    assert not Path(spec).exists() and not previous.exists()


def test_after_a_reboot_a_recorded_claim_gets_its_run_files_again(node: Node) -> None:
    """A reboot empties every tmpfs: the CDI spec and the run directory (metadata files, marks)
    are gone while the record on disk says the claim is prepared. The kubelet prepares it again
    at the driver's next start, which writes them all again from the claim."""
    node.claims.add(REF, [("gpu", "pci-0000-18-00-0")])
    answer = node.preparer.prepare([REF])[REF.uid]
    assert isinstance(answer, PreparedClaim)
    written = {Path(f): Path(f).read_bytes() for f in answer.files}
    for path in written:
        path.unlink()
    shutil.rmtree(node.run_dir)
    restarted = node.start()
    assert restarted.prepare([REF])[REF.uid] == answer
    assert {path: path.read_bytes() for path in written} == written
    assert restarted.unprepare([REF]) == {REF.uid: None}
    assert not any(path.exists() for path in written)


def test_lost_cdi_files_are_written_again(node: Node) -> None:
    node.claims.add(REF, [("gpu", "pci-0000-18-00-0")])
    answer = node.preparer.prepare([REF])[REF.uid]
    assert isinstance(answer, PreparedClaim)
    # /var/run is a tmpfs: a reboot empties it while the state directory stays.
    Path(answer.files[0]).unlink()
    assert node.preparer.prepare([REF])[REF.uid] == answer
    assert Path(answer.files[0]).exists()


@pytest.mark.parametrize(
    "loss",
    ["spec-gone", "metadata-gone", "spec-empty", "metadata-empty", "metadata-cut-short"],
)
def test_files_lost_to_a_power_loss_are_written_again_by_the_retry(node: Node, loss: str) -> None:
    """The spec and the metadata are written without a sync, the record durably: after a power
    loss the record may answer for files that are gone, empty or cut short (the rename reached the
    disk before the data). The kubelet's retry after the restart writes them again, whole."""
    node.claims.add(REF, [("gpu", "pci-0000-18-00-0")])
    answer = node.preparer.prepare([REF])[REF.uid]
    assert isinstance(answer, PreparedClaim)
    spec, metadata = (Path(f) for f in answer.files)
    written = {path: path.read_bytes() for path in (spec, metadata)}
    damaged = spec if loss.startswith("spec") else metadata
    if loss.endswith("gone"):
        damaged.unlink()
    else:
        damaged.write_bytes(written[damaged][: len(written[damaged]) // 2 if "cut" in loss else 0])
    assert node.start().prepare([REF])[REF.uid] == answer
    assert {path: path.read_bytes() for path in (spec, metadata)} == written


def _allocated_then_unbound(node: Node) -> None:
    node.claims.add(REF, [("gpu", "pci-0000-18-00-0")])
    unbind_driver(node.root, "0000:18:00.0")


@pytest.mark.parametrize(
    ("setup", "words"),
    [
        (lambda n: None, "not found"),
        (lambda n: n.claims.add(REF, [("gpu", "gpu-0")]), "not a name this driver publishes"),
        (
            _allocated_then_unbound,
            "cannot be given to a VM: bound to no driver",
        ),
        (lambda n: n.claims.add(REF, [("gpu", "pci-0000-77-00-0")]), "gone from the host"),
        (lambda n: setattr(n.claims, "down", True), "unreachable"),
    ],
    ids=["claim-missing", "foreign-device", "unbound", "gone", "api-down"],
)
def test_failures_are_the_claims_own_answer(
    node: Node, setup: Callable[[Node], object], words: str
) -> None:
    node.claims.add(OTHER, [("gpu", "pci-0000-2a-00-0")])
    setup(node)
    answers = node.preparer.prepare([REF, OTHER])
    assert isinstance(answers[REF.uid], str) and words in answers[REF.uid]  # type: ignore[operator]
    assert str(REF) in answers[REF.uid]  # type: ignore[operator]
    if words != "unreachable":
        assert isinstance(answers[OTHER.uid], PreparedClaim)
    assert not (node.paths.cdi_dir / f"{DRIVER}-claim_{REF.uid}.json").exists()


@pytest.mark.parametrize(
    "ref",
    [
        ClaimRef("vms", "x", "../../etc"),
        ClaimRef("vms", "x", ""),
        ClaimRef("../vms", "x", REF.uid),
        ClaimRef("vms", "a/b", REF.uid),
    ],
)
def test_malformed_claim_references_never_reach_a_path(node: Node, ref: ClaimRef) -> None:
    answer = node.preparer.prepare([ref])[ref.uid]
    assert isinstance(answer, str) and "not a" in answer
    assert node.preparer.unprepare([ref])[ref.uid]


def test_every_published_device_can_be_prepared(node: Node) -> None:
    devices = build_devices(scan_host(node.root), default_config(), node.names)
    node.claims.add(REF, [(f"r{i}", d.name) for i, d in enumerate(devices)])
    answer = node.preparer.prepare([REF])[REF.uid]
    assert isinstance(answer, PreparedClaim) and len(answer.devices) == len(devices) == 8


def test_a_function_of_a_group_another_claim_holds_is_refused(
    build_host: BuildHost, tmp_path: Path
) -> None:
    # Two GPUs in one IOMMU group (no ACS between them): the group goes to one VM, whole.
    spec = hgx_h100()
    shared = tuple(
        replace(f, group=99) if f.bdf in ("0000:18:00.0", "0000:2a:00.0") else f
        for f in spec.functions
    )
    node = Node(build_host(replace(spec, functions=shared)), tmp_path)
    node.claims.add(REF, [("gpu", "pci-0000-18-00-0")])
    node.claims.add(OTHER, [("gpu", "pci-0000-2a-00-0")])
    assert isinstance(node.preparer.prepare([REF])[REF.uid], PreparedClaim)
    answer = node.preparer.prepare([OTHER])[OTHER.uid]
    assert isinstance(answer, str)
    assert "shares IOMMU group 99 with pci-0000-18-00-0 (0000:18:00.0)" in answer
    assert "claim vms/vm-gpus" in answer


def test_a_write_failure_is_the_claims_answer_and_the_others_go_on(node: Node) -> None:
    node.claims.add(REF, [("gpu", "pci-0000-18-00-0")])
    node.claims.add(OTHER, [("gpu", "pci-0000-2a-00-0")])
    # The CDI directory cannot be made: a file stands where it should be.
    node.paths.cdi_dir.parent.mkdir(parents=True, exist_ok=True)
    node.paths.cdi_dir.write_text("not a directory")
    answers = node.preparer.prepare([REF, OTHER])
    assert all(isinstance(a, str) and "vms/" in a for a in answers.values())
    node.paths.cdi_dir.unlink()
    assert isinstance(node.preparer.prepare([OTHER])[OTHER.uid], PreparedClaim)


def test_an_unreadable_record_stops_the_driver_naming_the_file(node: Node) -> None:
    node.claims.add(REF, [("gpu", "pci-0000-18-00-0")])
    assert isinstance(node.preparer.prepare([REF])[REF.uid], PreparedClaim)
    record = node.state_dir / "claims" / f"{REF.uid}.json"
    record.write_text("{not json")
    with pytest.raises(StateError, match=f"unreadable prepared-claim record {record}"):
        node.start()


def test_a_known_claim_with_another_allocation_is_refused_and_the_first_is_kept(
    node: Node,
) -> None:
    node.claims.add(REF, [("gpu", "pci-0000-18-00-0")])
    first = node.preparer.prepare([REF])[REF.uid]
    assert isinstance(first, PreparedClaim)
    record = node.state_dir / "claims" / f"{REF.uid}.json"
    recorded = record.read_text()
    # Its spec lost (a reboot empties /var/run), and the API server now names another device.
    Path(first.files[0]).unlink()
    node.claims.add(REF, [("gpu", "pci-0000-2a-00-0")])
    for preparer in (node.preparer, node.start()):
        answer = preparer.prepare([REF])[REF.uid]
        assert isinstance(answer, str)
        assert str(REF) in answer
        assert "now allocates it 'pci-0000-2a-00-0' for request 'gpu'" in answer
        assert "prepared with 'pci-0000-18-00-0' for request 'gpu'" in answer
        assert record.read_text() == recorded
        assert not Path(first.files[0]).exists()
    # The first device stays held: another claim cannot have it.
    node.claims.add(OTHER, [("gpu", "pci-0000-18-00-0")])
    assert "already prepared" in str(node.preparer.prepare([OTHER])[OTHER.uid])
