"""No lock over a network call: while one NodePrepare waits on a slow API server for its claim,
the driver's other work goes on (through the kubelet stand-in over gRPC, against the API server
stand-in over HTTPS, whose claim GET is held back); and two claims racing for one device still
never both get it."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import kubernetes.client
import pytest

from dra.api import ResourceApi
from dra.driver import DraDriver
from dra_kit import DRIVER, NODE, driver_settings, short_directory
from hostdev.config import default_config
from hostdev.pciids import PciIds
from sim.apiserver import AllocatedDevice, ApiServerStandIn, build_resource_claim
from sim.dra_kubelet import Claim, DRAKubeletStandIn

ScenarioRoot = Callable[[str], Path]
PROMPT = 3.0
"""Seconds a call that needs no API answer may take while another's GET is held back."""


class HeldGets:
    """Holds back the API server stand-in's answers to GETs of the named claims until let go."""

    def __init__(self, apiserver: ApiServerStandIn, monkeypatch: pytest.MonkeyPatch) -> None:
        self.names: set[str] = set()
        self.waiting = threading.Semaphore(0)
        self.go = threading.Event()
        serve = apiserver.take_failure

        def take_failure(method: str, path: str) -> object:
            if method == "GET" and path.rsplit("/", 1)[-1] in self.names:
                self.waiting.release()
                self.go.wait(30)
            return serve(method, path)

        monkeypatch.setattr(apiserver, "take_failure", take_failure)

    def wait_for(self, count: int) -> None:
        for _ in range(count):
            assert self.waiting.acquire(timeout=10), "the driver never asked for the claim"


@pytest.fixture
def kubelet(
    scenario_root: ScenarioRoot,
    apiserver: ApiServerStandIn,
    api_client: kubernetes.client.ApiClient,
) -> Iterator[DRAKubeletStandIn]:
    apiserver.put_node(NODE)
    with short_directory() as base:
        settings = driver_settings(scenario_root("hgx-h100"), base, 0.5)
        driver = DraDriver(settings, default_config(), PciIds(None), ResourceApi(api_client))
        driver.start()
        try:
            with DRAKubeletStandIn(base / "kubelet", info_poll_interval=None) as kubelet:
                kubelet.wait_registered(DRIVER)
                yield kubelet
        finally:
            driver.stop()


def allocated(apiserver: ApiServerStandIn, name: str, device: str) -> Claim:
    apiserver.put_claim(build_resource_claim("vms", name, ["gpu"], DRIVER))
    stored = apiserver.set_allocation(
        "vms", name, [AllocatedDevice("gpu", DRIVER, NODE, device)], NODE
    )
    return Claim("vms", stored["metadata"]["uid"], name)


def timed(call: Callable[[], object]) -> tuple[object, float]:
    start = time.monotonic()
    answer = call()
    return answer, time.monotonic() - start


def test_a_slow_claim_get_holds_up_no_other_claim(
    kubelet: DRAKubeletStandIn, apiserver: ApiServerStandIn, monkeypatch: pytest.MonkeyPatch
) -> None:
    done = allocated(apiserver, "done", "pci-0000-18-00-0")
    gone = allocated(apiserver, "gone", "pci-0000-2a-00-0")
    slow = allocated(apiserver, "slow", "pci-0000-3a-00-0")
    assert kubelet.node_prepare_resources([done, gone])[done.uid].error == ""
    held = HeldGets(apiserver, monkeypatch)
    held.names.add("slow")
    with ThreadPoolExecutor(1) as pool:
        stuck = pool.submit(kubelet.node_prepare_resources, [slow])
        held.wait_for(1)
        # Let go after a while in any case, so that a driver that waits fails on time, not hangs.
        threading.Timer(2.5 * PROMPT, held.go.set).start()
        try:
            unprepared, unprepare_took = timed(lambda: kubelet.node_unprepare_resources([gone]))
            again, again_took = timed(lambda: kubelet.node_prepare_resources([done]))
            still_stuck = not stuck.done()
        finally:
            held.go.set()
        assert stuck.result(timeout=30)[slow.uid].error == ""
    assert unprepared == {gone.uid: ""}
    assert unprepare_took < PROMPT
    assert again[done.uid].error == ""  # type: ignore[index]
    assert again_took < PROMPT
    assert still_stuck


def test_two_claims_racing_for_one_device_never_both_get_it(
    kubelet: DRAKubeletStandIn, apiserver: ApiServerStandIn, monkeypatch: pytest.MonkeyPatch
) -> None:
    first = allocated(apiserver, "first", "pci-0000-18-00-0")
    second = allocated(apiserver, "second", "pci-0000-18-00-0")
    held = HeldGets(apiserver, monkeypatch)
    held.names |= {"first", "second"}
    with ThreadPoolExecutor(2) as pool:
        calls = [pool.submit(kubelet.node_prepare_resources, [c]) for c in (first, second)]
        # Both have read the device as free, neither has its claim yet.
        held.wait_for(2)
        held.go.set()
        errors = sorted(c.result(timeout=30).popitem()[1].error for c in calls)
    assert errors[0] == ""
    assert "pci-0000-18-00-0 (0000:18:00.0) is already prepared for claim vms/" in errors[1]


def test_an_api_error_message_no_utf8_can_carry_fails_its_claim_only(
    kubelet: DRAKubeletStandIn, apiserver: ApiServerStandIn
) -> None:
    """A lone surrogate in a Status message is valid JSON but no protobuf string: it must not
    turn the whole call into gRPC UNKNOWN."""
    good = allocated(apiserver, "good", "pci-0000-18-00-0")
    bad = allocated(apiserver, "bad", "pci-0000-2a-00-0")
    body = b'{"kind":"Status","message":"claim \\ud800\\u001b[2J gone"}'
    apiserver.answer_next(body, status=404, method="GET", path="/resourceclaims/bad")
    answers = kubelet.node_prepare_resources([good, bad])
    assert answers[good.uid].error == ""
    assert "not found" in answers[bad.uid].error
    assert "\\ud800" in answers[bad.uid].error
    assert "\x1b" not in answers[bad.uid].error
