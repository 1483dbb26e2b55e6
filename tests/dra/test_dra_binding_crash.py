"""A driver killed (SIGKILL) or refused by the kernel at any sysfs write of an on-demand bind or
of its give-back strands nothing: the next start's recovery, by a fresh binder over the same
journal and host, puts every function exactly where it was before the bind (driver and
driver_override), the NVIDIA unbind lock released, and its log line says what it really wrote.

The kill and failure points come from the writes a clean bind and give-back of each device shape
make in the kernel simulator, so a step added to either plan is covered without touching this
file. Ids read `<shape>-<bind|give-back>-after-<n>-of-<total>-<the write n>`.
"""

from __future__ import annotations

import errno
import functools
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from dra.binding import BindingError, OnDemandBinder
from hostdev.bdf import Bdf
from hostdev.binding.bind import HostAccess
from hostdev.binding.sysfs_write import SIGKILL_AFTER_ENV
from sim.host import (
    CLASS_3D,
    CLASS_AUDIO,
    CLASS_PCI_BRIDGE,
    CLASS_VGA,
    NVIDIA,
    FunctionSpec,
    HostSpec,
    build_tree,
)
from sim.kernel import KernelSimulator, ProcessKilled, hold

UID = "a1b2c3d4-0000-4000-8000-00000000c0de"
OTHER_UID = "a1b2c3d4-0000-4000-8000-00000000beef"
AMD = 0x1002
REPO = Path(__file__).resolve().parents[2]
Writes = list[tuple[str, str]]
State = dict[str, tuple[str | None, str | None, str | None]]
"""BDF -> (driver, driver_override, the NVIDIA unbindLock as read, None without one)."""


@dataclass(frozen=True)
class Shape:
    name: str
    spec: HostSpec
    requested: tuple[str, ...]
    overrides: Mapping[str, str] = field(default_factory=dict)
    """driver_override values set before the bind."""
    reset_after_use: bool = False


def _function(
    bdf: str,
    vendor: int,
    klass: int,
    driver: str | None,
    group: int,
    parent: str | None = None,
    consumers: tuple[str, ...] = (),
) -> FunctionSpec:
    return FunctionSpec(
        bdf, vendor, 0x1234, klass, driver=driver, group=group, parent=parent, consumers=consumers
    )


GPU, AUDIO, PORT = "0000:3b:00.0", "0000:3b:00.1", "0000:3a:00.0"
_DESKTOP = HostSpec(
    (
        _function(PORT, 0x8086, CLASS_PCI_BRIDGE, "pcieport", group=14),
        _function(GPU, NVIDIA, CLASS_VGA, "nvidia", group=14, parent=PORT, consumers=(AUDIO,)),
        _function(AUDIO, NVIDIA, CLASS_AUDIO, "snd_hda_intel", group=14, parent=PORT),
    )
)
SHAPES = (
    Shape("no-driver", HostSpec((_function(GPU, AMD, CLASS_3D, None, group=30),)), (GPU,)),
    Shape("host-driver", HostSpec((_function(GPU, AMD, CLASS_3D, "amdgpu", group=30),)), (GPU,)),
    Shape(
        "host-driver-pinned",
        HostSpec((_function(GPU, AMD, CLASS_3D, "amdgpu", group=30),)),
        (GPU,),
        overrides={GPU: "amdgpu"},
    ),
    Shape("nvidia", HostSpec((_function(GPU, NVIDIA, CLASS_3D, "nvidia", group=40),)), (GPU,)),
    Shape("nvidia-group-with-audio", _DESKTOP, (GPU,)),
    Shape(
        "nvidia-audio-on-no-driver",
        HostSpec(
            (
                _DESKTOP.functions[0],
                _DESKTOP.functions[1],
                _function(AUDIO, NVIDIA, CLASS_AUDIO, None, group=14, parent=PORT),
            )
        ),
        (GPU,),
    ),
    Shape("nvidia-group-reset-after-use", _DESKTOP, (GPU,), reset_after_use=True),
)
BY_NAME = {s.name: s for s in SHAPES}


class World:
    """A host of one shape, its kernel simulator, and binders over one journal directory: each
    new binder is the driver process started again."""

    def __init__(self, shape: Shape, base: Path) -> None:
        self.shape = shape
        self.root = build_tree(shape.spec, base / "host")
        self.journal_dir = base / "state" / "bindings"
        native = {f.bdf: f.driver for f in shape.spec.functions if f.driver is not None}
        self.kernel = KernelSimulator(self.root, native)
        for bdf, value in shape.overrides.items():
            (self.root / "sys/bus/pci/devices" / bdf / "driver_override").write_text(value + "\n")

    def binder(self) -> OnDemandBinder:
        access = HostAccess(root=self.root, writer=self.kernel, runner=self.kernel.run)
        return OnDemandBinder(access, self.journal_dir, lock_wait=2.0, nodes_wait=1.0)

    def bind(self, binder: OnDemandBinder | None = None, uid: str = UID) -> None:
        bdfs = [Bdf.parse(b) for b in self.shape.requested]
        (binder or self.binder()).bind(uid, bdfs, self.shape.reset_after_use, lambda: True)

    def state(self) -> State:
        def lock(bdf: str) -> str | None:
            path = self.root / "proc/driver/nvidia/gpus" / bdf / "unbindLock"
            return path.read_text().strip() if path.exists() else None

        return {
            f.bdf: (self.kernel.driver(f.bdf), self.kernel.override(f.bdf), lock(f.bdf))
            for f in self.shape.spec.functions
        }

    def journal(self) -> list[dict[str, object]]:
        return [json.loads(p.read_text()) for p in sorted(self.journal_dir.glob("*.json"))]


@functools.cache
def reference(name: str) -> tuple[Writes, Writes]:
    """The writes of a clean bind of the shape and of its give-back."""
    with tempfile.TemporaryDirectory() as base:
        world = World(BY_NAME[name], Path(base))
        world.bind()
        bound = list(world.kernel.writes)
        world.binder().release(UID)
        return bound, world.kernel.writes[len(bound) :]


@functools.cache
def recovery_writes(name: str, killed_after: int) -> Writes:
    """The writes the recovery makes after a bind killed after `killed_after` writes."""
    with tempfile.TemporaryDirectory() as base:
        world = World(BY_NAME[name], Path(base))
        world.kernel.kill_after(killed_after)
        with pytest.raises(ProcessKilled):
            world.bind()
        mark = len(world.kernel.writes)
        world.binder().recover(prepared=[])
        return world.kernel.writes[mark:]


@functools.cache
def rollback_writes(name: str, failing: int) -> Writes:
    """The writes a bind makes after its `failing`-th write failed: its own undo."""
    with tempfile.TemporaryDirectory() as base:
        world = World(BY_NAME[name], Path(base))
        world.kernel.fail_at(failing, errno.EIO)
        with pytest.raises(BindingError):
            world.bind()
        return world.kernel.writes[failing:]


def describe(write: tuple[str, str]) -> str:
    path, text = write
    parts = path.split("/")
    value = text.strip()
    if path == "sys/bus/pci/drivers_probe":
        return f"{value[5:]}-probe"
    if parts[:4] == ["sys", "bus", "pci", "drivers"]:
        return f"{value[5:]}-{parts[5]}-{parts[4]}"
    if parts[:4] == ["proc", "driver", "nvidia", "gpus"]:
        return f"{parts[4][5:]}-unbindLock={value}"
    attribute = "/".join(parts[5:])
    if attribute == "driver_override":
        return f"{parts[4][5:]}-driver_override={value or 'null'}"
    return f"{parts[4][5:]}-{attribute.replace('driver/', '')}"


Case = tuple[str, Shape, int]
"""(id, shape, number of writes)."""


def cases(phase: int, *, start: int = 0, shapes: tuple[Shape, ...] = SHAPES) -> Iterator[Case]:
    """One case per write of each shape's bind (phase 0) or give-back (phase 1)."""
    label = ("bind", "give-back")[phase]
    for shape in shapes:
        writes = reference(shape.name)[phase]
        for n in range(start, len(writes) + 1):
            what = "before-any-write" if n == 0 else describe(writes[n - 1])
            yield f"{shape.name}-{label}-after-{n}-of-{len(writes)}-{what}", shape, n


def points(phase: int, *, start: int = 0) -> list[object]:
    return [pytest.param(shape, n, id=name) for name, shape, n in cases(phase, start=start)]


def phrase(write: tuple[str, str]) -> str | None:
    """How recovery words a write it made (a reset is logged on its own line)."""
    path, text = write
    value = text.strip()
    if path.endswith("/driver/unbind"):
        return "unbound from"
    if path.endswith("/driver_override"):
        return f"set driver_override to {value}" if value else "cleared driver_override"
    if path.endswith("/bind"):
        return f"bound to {path.split('/')[-2]}"
    if path.endswith("/unbindLock"):
        return "released the NVIDIA unbind lock"
    if path.endswith("drivers_probe"):
        return "asked the kernel to probe it"
    return None


def assert_said_what_it_did(world: World, lines: list[str], writes: Writes) -> None:
    """One line; for each function, exactly the writes made for it, in order, and where it is
    now as the host shows it."""
    assert len(lines) == 1 and lines[0].startswith(f"put back claim {UID}'s functions"), lines
    line = lines[0]
    for function in world.shape.spec.functions:
        bdf = function.bdf
        if function.class_code == CLASS_PCI_BRIDGE:
            assert bdf not in line
            continue
        said = re.search(rf"{re.escape(bdf)}: (.*?); now on (.*?) \(", line)
        assert said is not None, (bdf, line)
        made = [
            p for w in writes if bdf in w[0] or w[1].strip() == bdf if (p := phrase(w)) is not None
        ]
        steps = said[1].split(", ")
        wanted = made or ["nothing to do"]
        assert len(steps) == len(wanted), line
        assert all(step.startswith(w) for step, w in zip(steps, wanted, strict=True)), line
        assert said[2] == (world.kernel.driver(bdf) or "no driver"), line


# Kills ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(("shape", "killed_after"), points(0))
def test_a_kill_during_a_bind_is_undone_at_the_next_start(
    shape: Shape, killed_after: int, tmp_path: Path
) -> None:
    world = World(shape, tmp_path)
    before = world.state()
    world.kernel.kill_after(killed_after)
    with pytest.raises(ProcessKilled):
        world.bind()
    # Written down before the first write.
    assert [e["phase"] for e in world.journal()] == ["binding"]
    mark = len(world.kernel.writes)
    lines = world.binder().recover(prepared=[])
    assert world.state() == before
    assert world.journal() == []
    assert_said_what_it_did(world, lines, world.kernel.writes[mark:])


@pytest.mark.parametrize(("shape", "killed_after"), points(1))
def test_a_kill_while_giving_back_is_finished_at_the_next_start(
    shape: Shape, killed_after: int, tmp_path: Path
) -> None:
    world = World(shape, tmp_path)
    before = world.state()
    world.bind()
    world.kernel.kill_after(killed_after)
    with pytest.raises(ProcessKilled):
        world.binder().release(UID)
    assert [e["phase"] for e in world.journal()] == ["releasing"]
    mark = len(world.kernel.writes)
    # The claim's record outlived the kill: it is still "prepared", and given back all the same.
    lines = world.binder().recover(prepared=[UID])
    assert world.state() == before
    assert world.journal() == []
    assert_said_what_it_did(world, lines, world.kernel.writes[mark:])


_NESTED = tuple(s for s in SHAPES if s.name in ("nvidia-group-with-audio", "host-driver-pinned"))


def _nested_points() -> Iterator[object]:
    for name, shape, killed_after in cases(0, shapes=_NESTED):
        writes = recovery_writes(shape.name, killed_after)
        for n in range(len(writes) + 1) if writes else ():
            then = f"then-recovery-after-{n}-of-{len(writes)}"
            yield pytest.param(shape, killed_after, n, id=f"{name}-{then}")


@pytest.mark.parametrize(("shape", "killed_after", "recovery_killed_after"), list(_nested_points()))
def test_a_recovery_killed_midway_is_finished_by_the_next(
    shape: Shape, killed_after: int, recovery_killed_after: int, tmp_path: Path
) -> None:
    world = World(shape, tmp_path)
    before = world.state()
    world.kernel.kill_after(killed_after)
    with pytest.raises(ProcessKilled):
        world.bind()
    world.kernel.kill_after(recovery_killed_after)
    with pytest.raises(ProcessKilled):
        world.binder().recover(prepared=[])
    mark = len(world.kernel.writes)
    lines = world.binder().recover(prepared=[])
    assert world.state() == before and world.journal() == []
    assert_said_what_it_did(world, lines, world.kernel.writes[mark:])


def _rollback_points() -> Iterator[object]:
    for name, shape, failing in cases(0, start=1, shapes=_NESTED):
        writes = rollback_writes(shape.name, failing)
        for n in range(1, len(writes) + 1):
            then = f"fails-then-undo-killed-after-{n}-of-{len(writes)}"
            yield pytest.param(shape, failing, n, id=f"{name}-{then}")


@pytest.mark.parametrize(("shape", "failing", "undo_killed_after"), list(_rollback_points()))
def test_a_kill_while_undoing_a_failed_bind_is_undone_at_the_next_start(
    shape: Shape, failing: int, undo_killed_after: int, tmp_path: Path
) -> None:
    world = World(shape, tmp_path)
    before = world.state()
    world.kernel.fail_at(failing, errno.EIO)
    world.kernel.kill_after(failing - 1 + undo_killed_after)
    with pytest.raises(ProcessKilled):
        world.bind()
    world.kernel.clear_failures()
    world.binder().recover(prepared=[])
    assert world.state() == before and world.journal() == []


CHILD = """
import json, os, signal, sys
from pathlib import Path
from dra.binding import OnDemandBinder
from hostdev.bdf import Bdf
from hostdev.binding.bind import HostAccess
from hostdev.binding.sysfs_write import SIGKILL_AFTER_ENV
from sim.kernel import KernelSimulator

root, journal, native, count = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3], sys.argv[4]
kernel = KernelSimulator(root, json.loads(native), die=lambda: os.kill(os.getpid(), signal.SIGKILL))
kernel.kill_after(int(count))
access = HostAccess(root=root, writer=kernel, runner=kernel.run)
binder = OnDemandBinder(access, journal, lock_wait=5.0)
binder.bind(sys.argv[5], [Bdf.parse(b) for b in sys.argv[6:]], False, lambda: True)
print("not killed")
"""


@pytest.mark.parametrize("after", ["unbindLock", "driver_override", "unbind"])
def test_a_real_sigkill_mid_bind_is_undone_at_the_next_start(after: str, tmp_path: Path) -> None:
    """The driver process really dies: no `finally` of ours runs, the kernel drops its lock."""
    shape = BY_NAME["nvidia-group-with-audio"]
    world = World(shape, tmp_path)
    before = world.state()
    bind_writes, _ = reference(shape.name)
    count = next(i for i, (path, _) in enumerate(bind_writes, 1) if path.endswith("/" + after))
    argv = [
        sys.executable, "-c", CHILD, str(world.root), str(world.journal_dir),
        json.dumps(world.kernel.native), str(count), UID, *shape.requested,
    ]  # fmt: skip
    child = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=60, check=False)
    assert child.returncode == -signal.SIGKILL, child.stdout + child.stderr
    assert world.state() != before
    lines = world.binder().recover(prepared=[])
    assert world.state() == before and world.journal() == []
    assert len(lines) == 1 and "a bind was interrupted" in lines[0]


# Failures --------------------------------------------------------------------------------------


@pytest.mark.parametrize(("shape", "failing"), points(0, start=1))
def test_a_failed_write_during_a_bind_is_undone_at_once(
    shape: Shape, failing: int, tmp_path: Path
) -> None:
    world = World(shape, tmp_path)
    before = world.state()
    world.kernel.fail_at(failing, errno.EBUSY)
    with pytest.raises(BindingError, match="undone"):
        world.bind()
    assert world.state() == before and world.journal() == []
    assert world.binder().recover(prepared=[]) == []


@pytest.mark.parametrize(("shape", "failing"), points(0, start=1))
def test_writes_failing_from_one_on_are_put_back_at_the_next_start(
    shape: Shape, failing: int, tmp_path: Path
) -> None:
    world = World(shape, tmp_path)
    before = world.state()
    world.kernel.fail_at(failing, errno.EIO, and_after=True)
    with pytest.raises(BindingError):
        world.bind()
    world.kernel.clear_failures()
    world.binder().recover(prepared=[])
    assert world.state() == before and world.journal() == []


@pytest.mark.parametrize(("shape", "failing"), points(1, start=1))
def test_a_failed_write_while_giving_back_is_finished_later(
    shape: Shape, failing: int, tmp_path: Path
) -> None:
    world = World(shape, tmp_path)
    before = world.state()
    world.bind()
    world.kernel.fail_at(failing, errno.EBUSY)
    try:
        world.binder().release(UID)
    except BindingError as error:
        assert "giving back failed" in str(error) and "the kubelet retries" in str(error)
        assert [e["phase"] for e in world.journal()] == ["releasing"]
    world.kernel.clear_failures()
    world.binder().recover(prepared=[UID])
    assert world.state() == before and world.journal() == []


# The journal's record --------------------------------------------------------------------------


def test_a_give_back_refused_while_held_writes_nothing(tmp_path: Path) -> None:
    world = World(BY_NAME["nvidia-group-with-audio"], tmp_path)
    world.bind()
    bound, count = world.state(), len(world.kernel.writes)
    hold(world.root, 4242, "qemu-kvm", "/dev/vfio/devices/vfio0")
    with pytest.raises(BindingError, match=r"pid 4242 \(qemu-kvm\)"):
        world.binder().release(UID)
    assert len(world.kernel.writes) == count and world.state() == bound
    assert [e["phase"] for e in world.journal()] == ["bound"]


def test_a_bind_for_other_functions_under_a_known_claim_is_refused(tmp_path: Path) -> None:
    spec = HostSpec(
        (*_DESKTOP.functions, _function("0000:5e:00.0", AMD, CLASS_3D, "amdgpu", group=30))
    )
    world = World(Shape("two-gpus", spec, (GPU,)), tmp_path)
    world.bind()
    entry = (world.journal_dir / f"{UID}.json").read_bytes()
    bound, count = world.state(), len(world.kernel.writes)
    with pytest.raises(BindingError, match=r"already has 0000:3b:00\.0 bound") as refused:
        world.binder().bind(UID, [Bdf.parse("0000:5e:00.0")], False, lambda: True)
    assert "allocation never changes" in str(refused.value)
    assert (world.journal_dir / f"{UID}.json").read_bytes() == entry
    assert len(world.kernel.writes) == count and world.state() == bound
    # Another claim on that device is no concern of this one's record.
    world.binder().bind(OTHER_UID, [Bdf.parse("0000:5e:00.0")], False, lambda: True)
    assert world.kernel.driver("0000:5e:00.0") == "vfio-pci"


@pytest.mark.parametrize("killed_after", range(1, 4))
def test_binding_again_over_an_interrupted_give_back_keeps_where_they_were(
    killed_after: int, tmp_path: Path
) -> None:
    world = World(BY_NAME["nvidia-group-with-audio"], tmp_path)
    before = world.state()
    world.bind()
    recorded = world.journal()[0]["moved"]
    world.kernel.kill_after(killed_after)
    with pytest.raises(ProcessKilled):
        world.binder().release(UID)
    # The claim is prepared again (its pod came back before the kubelet unprepared it).
    world.bind()
    assert world.journal()[0]["moved"] == recorded
    assert world.journal()[0]["phase"] == "bound"
    world.binder().release(UID)
    assert world.state() == before and world.journal() == []


def test_an_override_naming_another_driver_is_put_back_after_the_bind(tmp_path: Path) -> None:
    """A function on its driver with driver_override naming another (set after the bind): the
    kernel binds only to the driver the override names, so the override goes back last."""
    shape = Shape(
        "odd-override",
        BY_NAME["host-driver"].spec,
        (GPU,),
        overrides={GPU: "vfio-pci"},
    )
    world = World(shape, tmp_path)
    before = world.state()
    world.bind()
    world.binder().release(UID)
    assert world.state() == before == {GPU: ("amdgpu", "vfio-pci", None)}


def test_a_function_its_driver_will_not_take_back_is_probed(tmp_path: Path) -> None:
    world = World(BY_NAME["host-driver"], tmp_path)
    world.bind()
    world.kernel.fail(lambda path, _text: path == "sys/bus/pci/drivers/amdgpu/bind", errno.EBUSY)
    world.binder().release(UID)
    assert world.state() == {GPU: ("amdgpu", None, None)}
    assert world.kernel.writes[-1] == ("sys/bus/pci/drivers_probe", GPU)


def test_a_function_no_driver_takes_back_is_reported_where_it_is(tmp_path: Path) -> None:
    world = World(BY_NAME["host-driver"], tmp_path)
    world.bind()
    world.kernel.rejects["amdgpu"] = {GPU}
    with pytest.raises(BindingError) as failed:
        world.binder().release(UID)
    said = str(failed.value)
    assert (
        "cleared driver_override, `echo 0000:3b:00.0 > /sys/bus/pci/drivers/amdgpu/bind` failed:"
        " No such device, asked the kernel to probe it; now on no driver"
        " (driver_override (null))"
    ) in said
    assert "not on amdgpu (driver_override (null))" in said
    assert [e["phase"] for e in world.journal()] == ["releasing"]
    # Once the driver takes it again, the next start finishes.
    world.kernel.rejects.clear()
    lines = world.binder().recover(prepared=[UID])
    assert world.state() == {GPU: ("amdgpu", None, None)} and world.journal() == []
    assert "bound to amdgpu" in lines[0]


KILLING_WRITER = """
import sys
from pathlib import Path
from hostdev.binding.sysfs_write import KernelSysfs

writer = KernelSysfs()
for name in sys.argv[1:]:
    writer.write(Path(name), "1")
    print("wrote", Path(name).name, flush=True)
"""


def test_the_test_only_kill_switch_kills_right_after_the_named_write(tmp_path: Path) -> None:
    """What the system test's crash checks rely on: with the variable set, the real writer
    dies right after the first write to the named attribute; unset, it does nothing."""
    names = [tmp_path / "driver_override", tmp_path / "unbind", tmp_path / "bind"]
    for path in names:
        path.write_text("")
    argv = [sys.executable, "-c", KILLING_WRITER, *map(str, names)]
    env = {k: v for k, v in os.environ.items() if k != SIGKILL_AFTER_ENV}
    run = functools.partial(
        subprocess.run, argv, cwd=REPO, capture_output=True, text=True, timeout=60, check=False
    )
    killed = run(env={**env, SIGKILL_AFTER_ENV: "unbind"})
    assert killed.returncode == -signal.SIGKILL
    assert killed.stdout.split("\n")[:-1] == ["wrote driver_override"]
    assert (tmp_path / "unbind").read_text() == "1" and (tmp_path / "bind").read_text() == ""
    unset = run(env=env)
    assert unset.returncode == 0 and unset.stdout.count("wrote") == 3
