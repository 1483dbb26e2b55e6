"""A rolling update's new instance registers only once it is ready: the kubelet calls the newest
registration, so a new instance registered before it recovered, read the host and loaded its API
client would take the kubelet's calls and keep them waiting while the old one, ready, could have
answered. Over real gRPC with the kubelet stand-in, the API server stand-in and a kernel simulator
(the `node` of test_dra_upgrade); the new instance is held back in its start by the test."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from dra.driver import DraDriver
from dra.health_stream import HealthStreams
from dra.kubelet_sockets import (
    KubeletSockets,
    PreparerWhenReady,
    dra_socket_path,
    registration_socket_path,
    serialize_lock_path,
)
from dra.serialize_lock import SerializeLock
from dra.servicer import DraServicerV1, DraServicerV1beta1
from dra_kit import DRIVER, NODE, short_directory
from test_dra_upgrade import NEW, OLD, Node, node  # noqa: F401  (node: the fixture)

UNREGISTERED = 0.5
"""Ten of the stand-in's scans of plugins_registry: a registration socket served meanwhile would
have been registered."""


def held_recovery(driver: DraDriver, monkeypatch: pytest.MonkeyPatch) -> threading.Event:
    """Hold `driver`'s start-up recovery (a slow node) until the returned event is set."""
    release = threading.Event()
    recover = driver.recover

    def slow() -> None:
        release.wait(30)
        recover()

    monkeypatch.setattr(driver, "recover", slow)
    return release


def written_by(world: Node) -> list[object]:
    """Which instance wrote each binding journal entry (a bind lasts as long as its claim)."""
    return [entry["writtenBy"]["instance"] for entry in world.journal()]  # type: ignore[index]


def test_a_new_instance_not_ready_is_not_registered_and_the_old_takes_the_calls(
    node: Node,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    node.driver(OLD)
    node.kubelet.wait_registered(DRIVER)
    new = node.driver(NEW, start=False)
    release = held_recovery(new, monkeypatch)
    claim = node.claim("vm-a")
    start = threading.Thread(target=new.start, name="starting")
    start.start()
    try:
        time.sleep(UNREGISTERED)
        assert not node.registration_path(NEW).exists()
        current = node.kubelet.current(DRIVER)
        assert current is not None and current.endpoint == str(node.dra_path(OLD))
        assert len(node.kubelet.registrations) == 1
        # Answered by the old instance at once, not held at the new one's gate.
        asked = time.monotonic()
        assert node.kubelet.node_prepare_resources([claim])[claim.uid].error == ""
        assert time.monotonic() - asked < 5
        assert written_by(node) == [OLD]
        assert node.kubelet.node_unprepare_resources([claim]) == {claim.uid: ""}
    finally:
        release.set()
        start.join(30)
    newest = node.kubelet.wait_registered(DRIVER, count=2)
    assert newest.endpoint == str(node.dra_path(NEW))
    assert node.kubelet.node_prepare_resources([claim])[claim.uid].error == ""
    assert written_by(node) == [NEW]
    assert node.kubelet.deregistrations == [] and node.kubelet.refusals == []


def test_alone_after_a_reboot_an_instance_registers_once_it_could_take_the_lock(
    node: Node,  # noqa: F811
) -> None:
    """No old instance (the node rebooted): the new one still registers, once ready. The lock is
    held here as another instance's bind would hold it; recovery waits for it."""
    lock = SerializeLock(serialize_lock_path(node.base / "kubelet", DRIVER), "test")
    new = node.driver(NEW, start=False)
    start = threading.Thread(target=new.start, name="starting")
    try:
        with lock.hold():
            start.start()
            time.sleep(UNREGISTERED)
            assert start.is_alive()
            assert node.kubelet.current(DRIVER) is None
            assert not node.registration_path(NEW).exists()
            # The DRA socket is served already, for the kubelet to dial as soon as it registers.
            assert node.dra_path(NEW).is_socket()
    finally:
        start.join(30)
    registration = node.kubelet.wait_registered(DRIVER)
    assert registration.endpoint == str(node.dra_path(NEW))
    claim = node.claim("vm-a")
    assert node.kubelet.node_prepare_resources([claim])[claim.uid].error == ""
    assert written_by(node) == [NEW]


def rolling_sockets(kubelet_dir: Path, health: HealthStreams) -> KubeletSockets:
    """The sockets of an instance of a rolling update, its calls held at a gate never opened."""
    gate = PreparerWhenReady()
    return KubeletSockets(
        kubelet_dir,
        DRIVER,
        DraServicerV1(gate),
        DraServicerV1beta1(gate),
        health,
        check_interval=0.05,
        instance_uid=NEW,
    )


def test_a_registration_removed_before_it_was_served_is_not_served_by_the_guard() -> None:
    """A restarting kubelet wipes plugins_registry: the guard serves again only what was served."""
    health = HealthStreams(NODE, timeout_seconds=30)
    with short_directory() as base:
        kubelet_dir = base / "kubelet"
        registration = registration_socket_path(kubelet_dir, DRIVER, NEW)
        sockets = rolling_sockets(kubelet_dir, health)
        sockets.start()
        try:
            time.sleep(0.3)
            assert dra_socket_path(kubelet_dir, DRIVER, NEW).is_socket()
            assert not registration.exists()
            sockets.register()
            assert registration.is_socket()
            registration.unlink()
            deadline = time.monotonic() + 5
            # The guard counts a restart once the socket is served again: wait for both.
            while (
                not registration.exists() or sockets.restarts == 0
            ) and time.monotonic() < deadline:
                time.sleep(0.02)
            assert registration.is_socket(), "served again after the kubelet removed it"
            assert sockets.restarts == 1
        finally:
            sockets.stop()
        assert not registration.exists()
