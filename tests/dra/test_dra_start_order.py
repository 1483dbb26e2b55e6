"""The driver's start: the kubelet sees it (GetInfo) before it recovers and reads the host, and a
NodePrepare or NodeUnprepare arriving meanwhile waits for recovery, bounded, and is answered
with the reason when the start fails or takes too long."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from concurrent import futures
from pathlib import Path

import kubernetes.client

from dra.api import ResourceApi
from dra.claims import ClaimRef
from dra.driver import DraDriver
from dra.kubelet_sockets import PreparerWhenReady, serialize_lock_path
from dra.serialize_lock import SerializeLock
from dra.state import PreparedClaim
from dra_kit import DRIVER, NODE, REF, driver_settings, short_directory
from hostdev.config import default_config
from hostdev.pciids import PciIds
from sim.apiserver import AllocatedDevice, ApiServerStandIn, build_resource_claim
from sim.dra_kubelet import Claim, DRAKubeletStandIn

ScenarioRoot = Callable[[str], Path]
PROMPT = 0.5
"""Long enough for an answer that is not held back to come."""


class Recorder:
    """A preparer that notes what it was asked."""

    def __init__(self) -> None:
        self.asked: list[str] = []

    def prepare(self, refs: Sequence[ClaimRef]) -> dict[str, PreparedClaim | str]:
        self.asked += [f"prepare {r.uid}" for r in refs]
        return {r.uid: "prepared" for r in refs}

    def unprepare(self, refs: Sequence[ClaimRef]) -> dict[str, str | None]:
        self.asked += [f"unprepare {r.uid}" for r in refs]
        return {r.uid: None for r in refs}


def test_calls_before_ready_wait_and_then_go_to_the_preparer() -> None:
    gate, preparer = PreparerWhenReady(), Recorder()
    with futures.ThreadPoolExecutor(2) as pool:
        prepared = pool.submit(gate.prepare, [REF])
        unprepared = pool.submit(gate.unprepare, [REF])
        time.sleep(PROMPT)
        assert not prepared.done() and not unprepared.done()
        gate.ready(preparer)
        assert prepared.result(5) == {REF.uid: "prepared"}
        assert unprepared.result(5) == {REF.uid: None}
    assert sorted(preparer.asked) == [f"prepare {REF.uid}", f"unprepare {REF.uid}"]


def test_a_failed_start_answers_the_waiting_calls_with_its_error() -> None:
    gate = PreparerWhenReady()
    with futures.ThreadPoolExecutor(1) as pool:
        waiting = pool.submit(gate.prepare, [REF])
        time.sleep(PROMPT)
        gate.failed("claim records directory /x: Permission denied")
        assert waiting.result(5) == {
            REF.uid: f"{REF}: the driver failed to start: claim records directory /x: Permission"
            " denied; it stops, and its pod is restarted (see its log)"
        }
    # A later call too, and a late `ready` (nothing after a failure) changes nothing.
    gate.ready(Recorder())
    assert gate.unprepare([REF])[REF.uid] == (
        f"{REF}: cannot clean up: the driver failed to start: claim records directory /x:"
        " Permission denied; it stops, and its pod is restarted (see its log)"
    )


def test_a_start_slower_than_the_wait_is_answered_before_the_kubelet_gives_up() -> None:
    gate = PreparerWhenReady(wait_seconds=0.2)
    start = time.monotonic()
    answer = gate.prepare([REF])[REF.uid]
    assert 0.2 <= time.monotonic() - start < 2
    assert answer == (
        f"{REF}: the driver is still starting after 0.2 s (recovering the prepared claims and"
        " reading the host); the kubelet retries"
    )


def test_the_kubelet_sees_the_driver_before_recovery_and_its_prepare_is_answered_after_it(
    scenario_root: ScenarioRoot,
    apiserver: ApiServerStandIn,
    api_client: kubernetes.client.ApiClient,
) -> None:
    """Recovery holds the node's serialize lock: held here (another instance's bind, as far as
    the driver can tell), the start waits in recovery while the kubelet already registered it."""
    apiserver.put_node(NODE)
    apiserver.put_claim(build_resource_claim("vms", "vm-gpu", ["gpu"], DRIVER))
    stored = apiserver.set_allocation(
        "vms", "vm-gpu", [AllocatedDevice("gpu", DRIVER, NODE, "pci-0000-18-00-0")], NODE
    )
    claim = Claim("vms", stored["metadata"]["uid"], "vm-gpu")
    with short_directory() as base:
        settings = driver_settings(scenario_root("hgx-h100"), base, 0.2)
        driver = DraDriver(settings, default_config(), PciIds(None), ResourceApi(api_client))
        lock = SerializeLock(serialize_lock_path(settings.kubelet_dir, DRIVER), "test")
        released = threading.Event()
        held = threading.Event()

        def hold() -> None:
            with lock.hold():
                held.set()
                released.wait(20)

        holder = threading.Thread(target=hold)
        holder.start()
        assert held.wait(5)
        starting = threading.Thread(target=driver.start)
        try:
            starting.start()
            with (
                DRAKubeletStandIn(settings.kubelet_dir, info_poll_interval=None) as kubelet,
                futures.ThreadPoolExecutor(1) as pool,
            ):
                kubelet.wait_registered(DRIVER, timeout=10)
                assert driver.store.get(claim.uid) is None
                answer = pool.submit(kubelet.node_prepare_resources, [claim])
                time.sleep(PROMPT)
                assert not answer.done()
                assert starting.is_alive()
                released.set()
                result = answer.result(20)[claim.uid]
                assert result.error == ""
                assert [d.device_name for d in result.devices] == ["pci-0000-18-00-0"]
        finally:
            released.set()
            holder.join()
            starting.join(20)
            driver.stop()
