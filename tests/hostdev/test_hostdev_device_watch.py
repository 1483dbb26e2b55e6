"""The inotify device watch on a simulated node: driver links, device nodes, and a caller's own
directory, as events."""

from __future__ import annotations

import queue
from collections.abc import Iterator
from pathlib import Path

import pytest

from hostdev.bdf import Bdf
from hostdev.device_events import DevicesChanged
from hostdev.device_watch import DeviceWatch
from sim.host import BuildHost, hgx_h100, unbind_driver

GPU = "0000:2a:00.0"

Events = queue.SimpleQueue[DevicesChanged | str]


@pytest.fixture
def watched(build_host: BuildHost, tmp_path: Path) -> Iterator[tuple[Path, Path, Events]]:
    root = build_host(hgx_h100())
    extra = tmp_path / "extra"
    extra.mkdir()
    events: Events = queue.SimpleQueue()

    def said(name: str, appeared: bool) -> str | None:
        return f"{name} {'+' if appeared else '-'}" if name.endswith(".sock") else None

    watch = DeviceWatch[str](root, events.put, {extra: said})
    watch.start()
    try:
        yield root, extra, events
    finally:
        watch.stop()


def take(events: Events, count: int) -> list[DevicesChanged | str]:
    return [events.get(timeout=2) for _ in range(count)]


def test_an_unbind_names_the_function_and_its_nodes(watched: tuple[Path, Path, Events]) -> None:
    root, _, events = watched
    unbind_driver(root, GPU)
    seen = take(events, 3)
    # The driver links go first, then the cdev; the group node stays (the group has no other).
    by_function = [e for e in seen if isinstance(e, DevicesChanged) and e.bdfs]
    assert by_function == [
        DevicesChanged(frozenset({Bdf.parse(GPU)}), f"{GPU} unbound from vfio-pci", reprobed=True)
    ]
    nodes = [e for e in seen if isinstance(e, DevicesChanged) and not e.bdfs]
    assert nodes and all(not e.reprobed and "disappeared" in e.reason for e in nodes)


def test_functions_in_a_driver_directory_new_since_the_start_are_reported(
    watched: tuple[Path, Path, Events],
) -> None:
    """A driver's directory can come with functions already in it (here it is moved in whole,
    as a module loading binds at once): their links sent events to no watch, so the watch
    reports what the new directory holds once it watches it."""
    root, _, events = watched
    staged = root / "nvidia-staged"
    staged.mkdir()
    (staged / GPU).symlink_to(root / "sys/bus/pci/devices" / GPU)
    staged.rename(root / "sys/bus/pci/drivers/nvidia")
    assert events.get(timeout=2) == DevicesChanged(
        frozenset({Bdf.parse(GPU)}), "bound to nvidia", reprobed=True
    )


def test_a_callers_directory_is_translated_by_the_caller(
    watched: tuple[Path, Path, Events],
) -> None:
    _, extra, events = watched
    (extra / "ignored.txt").touch()
    (extra / "kubelet.sock").touch()
    (extra / "kubelet.sock").unlink()
    assert take(events, 2) == ["kubelet.sock +", "kubelet.sock -"]
