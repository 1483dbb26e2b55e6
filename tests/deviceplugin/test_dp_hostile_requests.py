"""Requests a kubelet would never send, over real gRPC: huge and forged ids are refused with a
short INVALID_ARGUMENT and short, single-line logs; the iommufd resource accepts only its own
slots and never keeps more hand-offs waiting than it has slots."""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import grpc
import pytest

from deviceplugin.v1beta1 import api_pb2
from dp_kit import H100, IOMMUFD, Plugin
from hostdev.config import PluginConfig, default_config

MEGABYTE_ID = "0000:18:00.0" + "x" * 1_000_000
FORGED_ID = "0000:01:00.0\n2026-01-01 INFO deviceplugin.servicer allocated resource=forged"
# Longest line any of our records may make out of a request, whatever it held.
LOG_LINE_LIMIT = 1_000


def _slots(count: int) -> PluginConfig:
    config = default_config()
    return replace(config, iommufd=replace(config.iommufd, slots=count))


def _our_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name.startswith("deviceplugin")]


def _assert_logs_bounded(caplog: pytest.LogCaptureFixture) -> None:
    lines = _our_lines(caplog)
    assert lines, "nothing was logged"
    for line in lines:
        assert len(line) < LOG_LINE_LIMIT, line[:200]
        assert "\n" not in line and "\r" not in line, line


def _refusal(call: Callable[[], object]) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as caught:
        call()
    return caught.value


@pytest.mark.parametrize("resource", [H100, IOMMUFD])
def test_a_megabyte_id_is_invalid_argument_with_a_short_message(
    start_plugin: Callable[..., Plugin], caplog: pytest.LogCaptureFixture, resource: str
) -> None:
    plugin = start_plugin()
    plugin.kubelet.wait_registered(resource)
    caplog.set_level(logging.DEBUG)
    error = _refusal(lambda: plugin.kubelet.allocate(resource, [MEGABYTE_ID]))
    # Before ids were shortened, the echoed id made a trailer over gRPC's metadata limit and the
    # caller got RESOURCE_EXHAUSTED instead.
    assert error.code() is grpc.StatusCode.INVALID_ARGUMENT
    details = str(error.details())
    assert len(details) < 400
    assert "'0000:18:00.0xxx" in details and "chars]" in details
    _assert_logs_bounded(caplog)


@pytest.mark.parametrize("resource", [H100, IOMMUFD])
def test_a_newline_in_an_id_forges_no_log_line(
    start_plugin: Callable[..., Plugin], caplog: pytest.LogCaptureFixture, resource: str
) -> None:
    plugin = start_plugin()
    plugin.kubelet.wait_registered(resource)
    caplog.set_level(logging.DEBUG)
    error = _refusal(lambda: plugin.kubelet.allocate(resource, [FORGED_ID]))
    assert error.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert "\n" not in str(error.details())
    assert "\\n2026-01-01 INFO" in str(error.details())
    _assert_logs_bounded(caplog)
    assert any("\\n2026-01-01 INFO" in line for line in _our_lines(caplog))


def test_preferred_allocation_and_prestart_with_huge_ids_stay_bounded(
    start_plugin: Callable[..., Plugin], caplog: pytest.LogCaptureFixture
) -> None:
    plugin = start_plugin()
    registration = plugin.kubelet.wait_registered(H100)
    caplog.set_level(logging.DEBUG)
    # Unknown ids are only ranked last, never echoed into a log or an error.
    chosen = plugin.kubelet.preferred(H100, [FORGED_ID, "0000:18:00.0"], [], 1)
    assert chosen == ["0000:18:00.0"]
    error = _refusal(lambda: plugin.kubelet.preferred(H100, [MEGABYTE_ID], [MEGABYTE_ID] * 2, 1))
    assert error.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert len(str(error.details())) < 400
    request = api_pb2.PreStartContainerRequest(devices_ids=[MEGABYTE_ID, FORGED_ID])
    registration.stub.PreStartContainer(request, timeout=5)
    for line in _our_lines(caplog):
        assert len(line) < LOG_LINE_LIMIT and "\n" not in line


@pytest.mark.parametrize(
    ("containers", "message"),
    [
        ([["iommufd-999"]], "unknown slot 'iommufd-999': this node advertises iommufd-000 to"),
        ([["0000:18:00.0"]], "unknown slot '0000:18:00.0'"),
        ([[]], "a container request names no slot"),
        ([], "the request names no container"),
        ([["iommufd-001", "iommufd-001"]], "slot iommufd-001 is requested twice"),
        ([["iommufd-001"], ["iommufd-001"]], "slot iommufd-001 is requested twice"),
        ([["iommufd-000"]] * 500, "slot iommufd-000 is requested twice"),
    ],
    ids=[
        "unknown-slot",
        "another-resources-id",
        "empty-container",
        "no-container",
        "twice-in-a-container",
        "twice-across-containers",
        "500-containers",
    ],
)
def test_iommufd_allocate_accepts_only_its_own_slots(
    start_plugin: Callable[..., Plugin], containers: list[list[str]], message: str
) -> None:
    plugin = start_plugin()
    plugin.kubelet.wait_registered(IOMMUFD)
    error = _refusal(lambda: plugin.kubelet.allocate(IOMMUFD, *containers))
    assert error.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert message in str(error.details())
    assert plugin.handoff.stats().pending == 0
    assert list((plugin.kubelet.directory.parent / "fds").glob("iommufd-*.sock")) == []


def _wait(condition: Callable[[], bool], timeout: float = 3.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.01)


def _take_fd(socket_path: str) -> None:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as client:
        client.connect(socket_path)
        _, fds, _, _ = socket.recv_fds(client, 1, 1)
        for fd in fds:
            os.close(fd)
        client.sendall(b"\x00")


def test_allocating_a_slot_again_withdraws_its_unclaimed_hand_off(
    start_plugin: Callable[..., Plugin],
) -> None:
    plugin = start_plugin(config=_slots(2))
    kubelet = plugin.kubelet
    kubelet.wait_registered(IOMMUFD)
    first = kubelet.allocate(IOMMUFD, ["iommufd-000"], ["iommufd-001"]).container_responses
    assert plugin.handoff.stats().pending == 2
    # The same 500 times over (the kubelet re-allocates a slot only once its pod is gone):
    # never more than one hand-off waits per slot.
    for _ in range(500):
        again = kubelet.allocate(IOMMUFD, ["iommufd-000"]).container_responses
        assert plugin.handoff.stats().pending == 2
    _wait(lambda: plugin.handoff.stats().pending == 2)
    assert not Path(first[0].mounts[0].host_path).exists()
    # The newest hand-off of the slot and the other slot's still serve their fds.
    _take_fd(again[0].mounts[0].host_path)
    _take_fd(first[1].mounts[0].host_path)
    _wait(lambda: plugin.handoff.stats().served == 2)
    assert plugin.handoff.stats().pending == 0
    sockets = list((plugin.kubelet.directory.parent / "fds").iterdir())
    assert sockets == []


def test_a_slot_whose_fd_was_taken_is_allocated_again_without_withdrawing_anything(
    start_plugin: Callable[..., Plugin], caplog: pytest.LogCaptureFixture
) -> None:
    plugin = start_plugin(config=_slots(1))
    plugin.kubelet.wait_registered(IOMMUFD)
    (served,) = plugin.kubelet.allocate(IOMMUFD, ["iommufd-000"]).container_responses
    _take_fd(served.mounts[0].host_path)
    _wait(lambda: plugin.handoff.stats().served == 1)
    caplog.set_level(logging.INFO)
    (fresh,) = plugin.kubelet.allocate(IOMMUFD, ["iommufd-000"]).container_responses
    assert plugin.handoff.stats().pending == 1
    assert not any("superseded" in line for line in _our_lines(caplog))
    _take_fd(fresh.mounts[0].host_path)


def test_concurrent_allocates_of_one_slot_leave_one_hand_off(
    start_plugin: Callable[..., Plugin],
) -> None:
    plugin = start_plugin(config=_slots(1))
    plugin.kubelet.wait_registered(IOMMUFD)
    barrier = threading.Barrier(8)
    errors: list[BaseException] = []

    def allocate() -> None:
        barrier.wait()
        try:
            plugin.kubelet.allocate(IOMMUFD, ["iommufd-000"])
        except BaseException as error:
            errors.append(error)

    threads = [threading.Thread(target=allocate) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(10)
    assert errors == []
    _wait(lambda: plugin.handoff.stats().pending == 1)
    fds = plugin.kubelet.directory.parent / "fds"
    _wait(lambda: len(list(fds.glob("iommufd-*.sock"))) == 1)


def test_an_expired_hand_off_frees_its_slot(start_plugin: Callable[..., Plugin]) -> None:
    # Long enough that the second hand-off is still pending when it is taken, even on a
    # loaded machine (at 0.2 s it once expired first).
    plugin = start_plugin(config=_slots(1), expiry_seconds=2.0)
    plugin.kubelet.wait_registered(IOMMUFD)
    plugin.kubelet.allocate(IOMMUFD, ["iommufd-000"])
    _wait(
        lambda: plugin.handoff.stats() == replace(plugin.handoff.stats(), expired=1, pending=0),
        timeout=20.0,
    )
    (container,) = plugin.kubelet.allocate(IOMMUFD, ["iommufd-000"]).container_responses
    assert plugin.handoff.stats().pending == 1
    _take_fd(container.mounts[0].host_path)
