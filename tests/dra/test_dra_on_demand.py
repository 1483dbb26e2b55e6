"""On-demand binding: a GPU on its host driver is published, bound to VFIO (with its group and
companions) when a claim on it is prepared, and given back when the claim is released — through
the kernel simulator, with the node's binding lock, refusing and rolling back as `bind` does."""

from __future__ import annotations

import errno
import json
import threading
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from dra.binding import JournalEntry, Moved, Writer
from dra.devices import build_devices
from dra.serialize_lock import SerializeLock
from dra.state import ClaimStore, PreparedClaim
from dra_cdi_schema_kit import validate_cdi_spec
from dra_kit import OTHER, REF, Node
from hostdev.bdf import Bdf
from hostdev.binding.lock import hold_binding_lock
from hostdev.config import Binding, PluginConfig, ResourceConfig, Selectors
from hostdev.scan import scan_host
from sim.host import (
    CLASS_PCI_BRIDGE,
    BuildHost,
    FunctionSpec,
    HostSpec,
)
from sim.kernel import KernelSimulator, hold

NVIDIA = 0x10DE
GPU, AUDIO, BRIDGE = "0000:3b:00.0", "0000:3b:00.1", "0000:3a:00.0"
SECOND_GPU = "0000:5e:00.0"
GPU_DEVICE = "pci-0000-3b-00-0"
DEAD_PID = 4_194_305
"""Above the largest pid_max a kernel allows: no process has it."""
ON_DEMAND = PluginConfig(
    resources=(
        ResourceConfig(
            Selectors(vendors=(NVIDIA,), classes=("0300",)),
            resource_name="nvidia.com/GA102",
            binding=Binding.ON_DEMAND,
        ),
    )
)


def desktop_gpu() -> HostSpec:
    """A VGA GPU on nvidia with its HD-audio function on snd_hda_intel, in group 14 with the
    root port above them."""
    return HostSpec(
        (
            FunctionSpec(BRIDGE, 0x8086, 0x352A, CLASS_PCI_BRIDGE, driver="pcieport", group=14),
            FunctionSpec(
                GPU, NVIDIA, 0x2204, 0x030000, driver="nvidia", group=14, parent=BRIDGE,
                consumers=(AUDIO,),
            ),
            FunctionSpec(
                AUDIO, NVIDIA, 0x1AEF, 0x040300, driver="snd_hda_intel", group=14, parent=BRIDGE
            ),
        )
    )  # fmt: skip


@pytest.fixture
def node(build_host: BuildHost, tmp_path: Path) -> Node:
    spec = desktop_gpu()
    root = build_host(spec)
    native = {f.bdf: f.driver for f in spec.functions if f.driver is not None}
    return Node(root, tmp_path / "node", ON_DEMAND, KernelSimulator(root, native))


def drivers(node: Node) -> dict[str, tuple[str | None, str | None]]:
    assert node.kernel is not None
    return {b: (node.kernel.driver(b), node.kernel.override(b)) for b in (GPU, AUDIO)}


BEFORE = {GPU: ("nvidia", None), AUDIO: ("snd_hda_intel", None)}


def test_a_gpu_on_its_host_driver_is_published_with_its_driver(node: Node) -> None:
    (device,) = build_devices(scan_host(node.root), ON_DEMAND, node.names)
    assert device.name == GPU_DEVICE and device.bind_on_demand
    assert device.attributes["currentDriver"] == "nvidia"
    assert device.device_nodes == ()


def test_prepare_binds_the_group_and_unprepare_gives_it_back(node: Node) -> None:
    node.claims.add(REF, [("gpu", GPU_DEVICE)])
    answer = node.preparer.prepare([REF])[REF.uid]
    assert isinstance(answer, PreparedClaim), answer
    assert drivers(node) == {GPU: ("vfio-pci", "vfio-pci"), AUDIO: ("vfio-pci", "vfio-pci")}
    spec = json.loads(Path(answer.files[0]).read_text())
    validate_cdi_spec(spec)
    nodes = [n["path"] for n in spec["devices"][0]["containerEdits"]["deviceNodes"]]
    assert nodes[0].startswith("/dev/vfio/devices/vfio") and "/dev/vfio/14" in nodes
    for path in nodes:
        assert (node.root / path.lstrip("/")).exists(), path
    # The NVIDIA driver let go of the GPU through its unbindLock before the unbind.
    assert node.kernel is not None
    writes = [w for w, _ in node.kernel.writes]
    assert writes.index(f"proc/driver/nvidia/gpus/{GPU}/unbindLock") < writes.index(
        f"sys/bus/pci/devices/{GPU}/driver/unbind"
    )
    # A retry answers the same without binding again.
    count = len(node.kernel.writes)
    assert node.preparer.prepare([REF])[REF.uid] == answer
    assert len(node.kernel.writes) == count

    assert node.preparer.unprepare([REF]) == {REF.uid: None}
    assert drivers(node) == BEFORE
    assert not list((node.state_dir / "bindings").glob("*.json"))
    assert node.preparer.unprepare([REF]) == {REF.uid: None}


def test_a_held_device_is_refused_naming_the_holder_and_nothing_changes(node: Node) -> None:
    hold(node.root, 4242, "nvidia-smi", "/dev/nvidia0")
    (node.root / "proc/driver/nvidia/gpus" / GPU / "information").write_text("Device Minor: 0\n")
    node.claims.add(REF, [("gpu", GPU_DEVICE)])
    answer = node.preparer.prepare([REF])[REF.uid]
    assert isinstance(answer, str)
    assert "nvidia-smi" in answer and "4242" in answer and "vm-gpus" in answer
    assert "the kubelet retries" in answer and "--wait" not in answer
    assert drivers(node) == BEFORE
    assert not list((node.state_dir / "bindings").glob("*.json"))


def test_a_failed_bind_is_rolled_back(node: Node) -> None:
    assert node.kernel is not None
    node.kernel.fail(
        lambda path, text: path == "sys/bus/pci/drivers/vfio-pci/bind" and text == AUDIO
    )
    node.claims.add(REF, [("gpu", GPU_DEVICE)])
    answer = node.preparer.prepare([REF])[REF.uid]
    assert isinstance(answer, str) and "undone" in answer
    assert drivers(node) == BEFORE
    assert not list((node.state_dir / "bindings").glob("*.json"))


def test_another_binding_run_is_waited_for_then_named(node: Node) -> None:
    node.claims.add(REF, [("gpu", GPU_DEVICE)])
    node.lock_wait = 0.3
    preparer = node.start()
    taken, done = threading.Event(), threading.Event()

    def admin() -> None:
        with hold_binding_lock(node.root, 0, who="bind 0000:3b:00.0"):
            taken.set()
            done.wait(10)

    thread = threading.Thread(target=admin)
    thread.start()
    try:
        taken.wait(5)
        answer = preparer.prepare([REF])[REF.uid]
    finally:
        done.set()
        thread.join()
    assert isinstance(answer, str)
    assert "bind 0000:3b:00.0" in answer and "the kubelet retries" in answer
    assert drivers(node) == BEFORE
    # Once the other run is done, the kubelet's retry succeeds.
    assert isinstance(preparer.prepare([REF])[REF.uid], PreparedClaim)


def test_a_bind_interrupted_by_a_crash_is_put_back_at_start(node: Node) -> None:
    # The driver wrote its journal, moved the GPU, and died before the audio function.
    journal = JournalEntry(
        REF.uid,
        "binding",
        (Moved(Bdf.parse(GPU), "nvidia", None), Moved(Bdf.parse(AUDIO), "snd_hda_intel", None)),
        reset_after_use=False,
    )
    path = node.state_dir / "bindings" / f"{REF.uid}.json"
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps(journal.to_json()))
    assert node.kernel is not None
    devices = node.root / "sys/bus/pci/devices"
    node.kernel.run(["modprobe", "vfio_pci"])
    node.kernel.write(devices / GPU / "driver_override", "vfio-pci")
    node.kernel.write(devices / GPU / "driver/unbind", GPU)
    node.kernel.write(node.root / "sys/bus/pci/drivers/vfio-pci/bind", GPU)
    assert drivers(node)[GPU] == ("vfio-pci", "vfio-pci")
    binder = node.binder()
    assert binder is not None
    done = binder.recover(prepared=[])
    assert len(done) == 1 and "a bind was interrupted" in done[0] and GPU in done[0]
    assert drivers(node) == BEFORE
    assert not path.exists()


def test_a_restart_reports_its_dead_runs_bind_as_its_start_up_recovery(
    node: Node, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The entry names the dead run's pid: put back by the start-up recovery, whose lines the
    driver logs as such, not by the pass a prepare makes for a rolling update's killed pod."""
    journal = JournalEntry(
        REF.uid,
        "binding",
        (Moved(Bdf.parse(GPU), "nvidia", None), Moved(Bdf.parse(AUDIO), "snd_hda_intel", None)),
        reset_after_use=False,
        writer=Writer(DEAD_PID, ""),
    )
    path = node.state_dir / "bindings" / f"{REF.uid}.json"
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps(journal.to_json()))
    assert node.kernel is not None
    node.kernel.run(["modprobe", "vfio_pci"])
    devices = node.root / "sys/bus/pci/devices"
    node.kernel.write(devices / GPU / "driver_override", "vfio-pci")
    node.kernel.write(devices / GPU / "driver/unbind", GPU)
    node.kernel.write(node.root / "sys/bus/pci/drivers/vfio-pci/bind", GPU)
    preparer = node.start(SerializeLock(tmp_path / "serialize.lock", ""))
    done = preparer.recover()
    assert len(done) == 1 and f"a bind was interrupted, by pid {DEAD_PID}" in done[0]
    assert "recovery after another instance" not in caplog.text
    assert drivers(node) == BEFORE
    assert not path.exists()


def test_a_prepared_claims_binding_is_kept_at_start(node: Node) -> None:
    node.claims.add(REF, [("gpu", GPU_DEVICE)])
    assert isinstance(node.preparer.prepare([REF])[REF.uid], PreparedClaim)
    binder = node.binder()
    assert binder is not None
    assert binder.recover(prepared=[REF.uid]) == []
    assert drivers(node)[GPU][0] == "vfio-pci"
    # Not prepared any more (its record lost): given back.
    assert "no longer prepared" in binder.recover(prepared=[])[0]
    assert drivers(node) == BEFORE


def test_after_a_reboot_a_still_prepared_claim_is_bound_again(node: Node) -> None:
    node.claims.add(REF, [("gpu", GPU_DEVICE)])
    first = node.preparer.prepare([REF])[REF.uid]
    assert isinstance(first, PreparedClaim)
    assert node.kernel is not None
    # A reboot: every function back on the driver the kernel picks, no overrides.
    for bdf in (GPU, AUDIO):
        node.kernel.write(node.root / "sys/bus/pci/devices" / bdf / "driver_override", "\n")
        node.kernel.write(node.root / "sys/bus/pci/devices" / bdf / "driver/unbind", bdf)
        node.kernel.write(node.root / "sys/bus/pci/drivers_probe", bdf)
    assert drivers(node) == BEFORE
    again = node.start().prepare([REF])[REF.uid]
    assert isinstance(again, PreparedClaim)
    assert drivers(node)[GPU][0] == "vfio-pci"


def test_io_errors_on_give_back_keep_the_claim_and_say_so(node: Node) -> None:
    node.claims.add(REF, [("gpu", GPU_DEVICE)])
    assert isinstance(node.preparer.prepare([REF])[REF.uid], PreparedClaim)
    assert node.kernel is not None
    node.kernel.fail(lambda path, text: path.endswith("driver/unbind"), errno.EBUSY)
    answer = node.preparer.unprepare([REF])[REF.uid]
    assert answer is not None and "vm-gpus" in answer
    # Still recorded and journaled: the group stays held while it is on VFIO, and the
    # kubelet's retry gives it back once the device lets go.
    assert (node.state_dir / "claims" / f"{REF.uid}.json").exists()
    assert (node.state_dir / "bindings" / f"{REF.uid}.json").exists()
    node.kernel.clear_failures()
    assert node.start().unprepare([REF]) == {REF.uid: None}
    assert drivers(node) == BEFORE


def test_reset_after_use_resets_before_giving_back(build_host: BuildHost, tmp_path: Path) -> None:
    spec = desktop_gpu()
    root = build_host(spec)
    native = {f.bdf: f.driver for f in spec.functions if f.driver is not None}
    (resource,) = ON_DEMAND.resources
    config = PluginConfig(resources=(replace(resource, reset_after_use=True),))
    node = Node(root, tmp_path / "node", config, KernelSimulator(root, native))
    node.claims.add(REF, [("gpu", GPU_DEVICE)])
    assert isinstance(node.preparer.prepare([REF])[REF.uid], PreparedClaim)
    assert node.kernel is not None
    assert node.kernel.resets == []
    assert node.preparer.unprepare([REF]) == {REF.uid: None}
    assert node.kernel.resets == [GPU, AUDIO]
    writes = [w for w, _ in node.kernel.writes]
    assert writes.index(f"sys/bus/pci/devices/{GPU}/reset") < writes.index(
        f"sys/bus/pci/devices/{GPU}/driver/unbind", writes.index(f"sys/bus/pci/devices/{GPU}/reset")
    )
    assert drivers(node) == BEFORE


def test_a_bind_whose_undo_failed_is_not_tried_again_over_its_journal(node: Node) -> None:
    journal = JournalEntry(REF.uid, "binding", (Moved(Bdf.parse(GPU), "nvidia", None),), False)
    path = node.state_dir / "bindings" / f"{REF.uid}.json"
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps(journal.to_json()))
    node.claims.add(REF, [("gpu", GPU_DEVICE)])
    answer = node.preparer.prepare([REF])[REF.uid]
    assert isinstance(answer, str) and "needs a person" in answer
    assert json.loads(path.read_text()) == journal.to_json()
    assert drivers(node) == BEFORE


@pytest.mark.parametrize("step", ["write", "record"])
def test_any_error_after_the_bind_gives_the_devices_back(
    node: Node, monkeypatch: pytest.MonkeyPatch, step: str
) -> None:
    def bug(*args: object, **kwargs: object) -> None:
        raise RuntimeError("a bug")

    if step == "write":
        monkeypatch.setattr("dra.prepare.write_file_whole", bug)
    else:
        monkeypatch.setattr(ClaimStore, "save", bug)
    node.claims.add(REF, [("gpu", GPU_DEVICE)])
    with pytest.raises(RuntimeError, match="a bug"):
        node.preparer.prepare([REF])
    # Unrecorded, it would be published as free and taken from under the next claim's VM.
    assert drivers(node) == BEFORE
    assert not list((node.state_dir / "bindings").glob("*.json"))
    assert not (node.state_dir / "claims" / f"{REF.uid}.json").exists()
    monkeypatch.undo()
    assert isinstance(node.preparer.prepare([REF])[REF.uid], PreparedClaim)


def test_a_known_claim_with_another_allocation_keeps_its_first_bind(
    build_host: BuildHost, tmp_path: Path
) -> None:
    second = FunctionSpec(SECOND_GPU, NVIDIA, 0x2204, 0x030000, driver="nvidia", group=20)
    spec = HostSpec((*desktop_gpu().functions, second))
    root = build_host(spec)
    native = {f.bdf: f.driver for f in spec.functions if f.driver is not None}
    node = Node(root, tmp_path / "node", ON_DEMAND, KernelSimulator(root, native))
    node.claims.add(REF, [("gpu", GPU_DEVICE)])
    first = node.preparer.prepare([REF])[REF.uid]
    assert isinstance(first, PreparedClaim)
    journal = node.state_dir / "bindings" / f"{REF.uid}.json"
    journaled = journal.read_text()
    Path(first.files[0]).unlink()
    node.claims.add(REF, [("gpu", "pci-0000-5e-00-0")])
    answer = node.preparer.prepare([REF])[REF.uid]
    assert isinstance(answer, str) and "an allocation never changes" in answer
    assert journal.read_text() == journaled
    assert node.kernel is not None
    assert node.kernel.driver(SECOND_GPU) == "nvidia"
    assert drivers(node)[GPU][0] == "vfio-pci"
    # Released as the first allocation had it.
    assert node.preparer.unprepare([REF]) == {REF.uid: None}
    assert drivers(node) == BEFORE


def test_a_device_whose_give_back_failed_is_not_handed_to_another_claim(
    node: Node, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An error after the bind, and then the give-back fails too: the claim is not recorded,
    but its journal still holds the device on VFIO. Another claim must not get it, or the
    next start would take it back from under that claim's VM."""

    def bug(*args: object, **kwargs: object) -> None:
        assert node.kernel is not None
        node.kernel.fail(lambda path, text: path.endswith("driver/unbind"), errno.EBUSY)
        raise RuntimeError("a bug")

    monkeypatch.setattr("dra.prepare.write_file_whole", bug)
    node.claims.add(REF, [("gpu", GPU_DEVICE)])
    with pytest.raises(RuntimeError, match="a bug"):
        node.preparer.prepare([REF])
    monkeypatch.undo()
    assert drivers(node)[GPU][0] == "vfio-pci"
    assert not (node.state_dir / "claims" / f"{REF.uid}.json").exists()
    assert (node.state_dir / "bindings" / f"{REF.uid}.json").exists()
    node.claims.add(OTHER, [("gpu", GPU_DEVICE)])
    answer = node.preparer.prepare([OTHER])[OTHER.uid]
    assert isinstance(answer, str)
    assert f"is still on VFIO for claim uid {REF.uid}" in answer
    # Once the device lets go, the first claim's unprepare gives it back and frees it.
    assert node.kernel is not None
    node.kernel.clear_failures()
    assert node.preparer.unprepare([REF]) == {REF.uid: None}
    assert drivers(node) == BEFORE
    assert isinstance(node.preparer.prepare([OTHER])[OTHER.uid], PreparedClaim)


def test_an_unprepare_while_the_claim_is_being_read_stops_that_prepare(
    node: Node, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The kubelet gave up on a slow NodePrepare and the pod is gone: it unprepares while the
    claim GET is still under way. The prepare must not then bind and record the claim: nothing
    would ever unprepare it, and the device would stay on VFIO, held, for good."""
    node.claims.add(REF, [("gpu", GPU_DEVICE)])
    inside, go = threading.Event(), threading.Event()
    read = node.claims.read_claim

    def slow(namespace: str, name: str) -> dict[str, Any]:
        inside.set()
        assert go.wait(10)
        return read(namespace, name)

    monkeypatch.setattr(node.claims, "read_claim", slow)
    answers: dict[str, object] = {}
    preparing = threading.Thread(target=lambda: answers.update(node.preparer.prepare([REF])))
    preparing.start()
    assert inside.wait(10)
    assert node.preparer.unprepare([REF]) == {REF.uid: None}
    go.set()
    preparing.join(10)
    assert isinstance(answers[REF.uid], str) and "unprepared while" in str(answers[REF.uid])
    assert drivers(node) == BEFORE
    assert not (node.state_dir / "claims" / f"{REF.uid}.json").exists()
    # A later prepare (the kubelet's, for a pod that still needs it) goes through.
    monkeypatch.undo()
    assert isinstance(node.preparer.prepare([REF])[REF.uid], PreparedClaim)
