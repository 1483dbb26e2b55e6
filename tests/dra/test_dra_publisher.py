"""The slice publisher with health: the real `kubernetes` client against the API server
stand-in over HTTPS (every object checked against the 1.37 schema), which stamps a taint's
`timeAdded` as the real server does."""

from __future__ import annotations

import re
import time
from collections.abc import Iterator, Sequence

import kubernetes.client
import pytest

import dra.publisher
from dra.api import ResourceApi
from dra.health import DeviceHealth, Health
from dra.publisher import SlicePublisher
from dra.slices import DeviceTaint, Object, Owner, TaintEffect, build_slices
from dra_kit import DRIVER, NODE
from dra_slices_kit import devices
from k8s_schema_kit import schema_errors
from sim.apiserver import ApiServerStandIn, running_apiserver

KEY = f"{DRIVER}/unhealthy"
POOL = devices(4)
NAMES = [d.name for d in POOL]
STAMP = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ$")


def verdicts(*unhealthy: int, at: float = 1000.0) -> list[DeviceHealth]:
    return [
        DeviceHealth(name, Health.UNHEALTHY, "lost its VFIO nodes", at)
        if index in unhealthy
        else DeviceHealth(name, Health.HEALTHY, "", at)
        for index, name in enumerate(NAMES)
    ]


def held_taints(apiserver: ApiServerStandIn) -> dict[str, list[Object]]:
    return {
        d["name"]: d["taints"]
        for s in apiserver.slices(NODE, DRIVER)
        for d in s["spec"]["devices"]
        if d.get("taints")
    }


def generations(apiserver: ApiServerStandIn) -> set[int]:
    return {s["spec"]["pool"]["generation"] for s in apiserver.slices(NODE, DRIVER)}


def writes(apiserver: ApiServerStandIn) -> int:
    return sum(r.method in ("POST", "PUT") for r in apiserver.requests)


@pytest.fixture
def api(apiserver: ApiServerStandIn, api_client: kubernetes.client.ApiClient) -> ResourceApi:
    apiserver.put_node(NODE)
    return ResourceApi(api_client)


def started(
    api: ResourceApi,
    health: Sequence[DeviceHealth],
    effect: TaintEffect = TaintEffect.NO_SCHEDULE,
) -> SlicePublisher:
    publisher = SlicePublisher(api, NODE, DRIVER, POOL, taint_effect=effect, backoff_first=0.05)
    publisher.update(POOL, health)
    publisher.start()
    return publisher


@pytest.fixture
def publishers() -> Iterator[list[SlicePublisher]]:
    running: list[SlicePublisher] = []
    yield running
    for publisher in running:
        publisher.stop()


def test_a_device_is_tainted_while_unhealthy_and_untainted_when_healthy_again(
    apiserver: ApiServerStandIn, api: ResourceApi, publishers: list[SlicePublisher]
) -> None:
    publisher = started(api, verdicts())
    publishers.append(publisher)
    assert apiserver.wait_until(lambda: generations(apiserver) == {1})
    assert held_taints(apiserver) == {}

    start = time.monotonic()
    publisher.update(POOL, verdicts(2))
    assert apiserver.wait_until(lambda: bool(held_taints(apiserver)))
    tainted = time.monotonic() - start
    ((taint,),) = held_taints(apiserver).values()
    assert set(held_taints(apiserver)) == {NAMES[2]}
    assert {k: v for k, v in taint.items() if k != "timeAdded"} == {
        "key": KEY,
        "effect": "NoSchedule",
    }
    assert STAMP.match(taint["timeAdded"]), taint
    assert generations(apiserver) == {2}

    start = time.monotonic()
    publisher.update(POOL, verdicts())
    assert apiserver.wait_until(lambda: not held_taints(apiserver))
    untainted = time.monotonic() - start
    assert generations(apiserver) == {3}
    # Event to taint and back, the publisher's share (the host's watch comes before it).
    assert tainted < 1.0 and untainted < 1.0, (tainted, untainted)


@pytest.mark.parametrize("effect", list(TaintEffect), ids=str)
def test_the_taint_has_the_configured_effect(
    apiserver: ApiServerStandIn,
    api: ResourceApi,
    publishers: list[SlicePublisher],
    effect: TaintEffect,
) -> None:
    publishers.append(started(api, verdicts(0, 3), effect))
    assert apiserver.wait_until(lambda: len(held_taints(apiserver)) == 2)
    assert {t[0]["effect"] for t in held_taints(apiserver).values()} == {effect.value}


def test_a_stamped_pool_is_not_written_again(
    apiserver: ApiServerStandIn, api: ResourceApi, publishers: list[SlicePublisher]
) -> None:
    publisher = started(api, verdicts(1))
    publishers.append(publisher)
    assert apiserver.wait_until(lambda: bool(held_taints(apiserver)))
    stamped = held_taints(apiserver)
    before = writes(apiserver)
    # A new check with the same verdict is no change of the slices.
    publisher.update(POOL, verdicts(1, at=2000.0))
    # Someone else touches the slice: the watch wakes the publisher, which lists, plans and
    # finds the stamped taint to be the one it wants.
    (item,) = apiserver.slices(NODE, DRIVER)
    apiserver.clear_requests()
    apiserver.put(item)
    assert apiserver.wait_until(lambda: any(r.method == "GET" for r in apiserver.requests))
    time.sleep(0.3)
    assert writes(apiserver) == 0 and before > 0
    assert held_taints(apiserver) == stamped
    assert generations(apiserver) == {1}


def test_two_instances_publishing_one_pool_settle_without_churn(
    apiserver: ApiServerStandIn, api: ResourceApi, publishers: list[SlicePublisher]
) -> None:
    """A rolling upgrade: the old and the new driver both publish the node's pool, each woken
    by the other's writes; with the same view of the host they agree after at most a write
    each."""
    publishers.append(started(api, verdicts(0, 2)))
    publishers.append(started(api, verdicts(0, 2)))
    assert apiserver.wait_until(lambda: len(held_taints(apiserver)) == 2)
    time.sleep(0.5)
    settled = generations(apiserver)
    apiserver.clear_requests()
    time.sleep(1.5)
    assert writes(apiserver) == 0
    assert generations(apiserver) == settled and max(settled) <= 2


def test_the_stand_in_stamps_a_taint_sent_without_time_added(api: ResourceApi) -> None:
    owner = Owner(NODE, api.read_node_uid(NODE))
    taint = {NAMES[0]: DeviceTaint(KEY, TaintEffect.NO_EXECUTE)}
    (item,) = build_slices(owner, DRIVER, POOL, 1, taint)
    created = api.create_slice(item)
    stamp = created["spec"]["devices"][0]["taints"][0]["timeAdded"]
    assert STAMP.match(stamp) and created["metadata"]["generation"] == 1
    # Sent back as held: nothing changes, not even the generation.
    kept = api.replace_slice(created)
    assert kept["metadata"]["resourceVersion"] == created["metadata"]["resourceVersion"]
    # Sent without the stamp: a change (the server stamps it anew before it compares).
    item["metadata"]["resourceVersion"] = kept["metadata"]["resourceVersion"]
    time.sleep(1.0)
    restamped = api.replace_slice(item)
    assert restamped["spec"]["devices"][0]["taints"][0]["timeAdded"] > stamp
    assert restamped["metadata"]["generation"] == 2


def test_taints_a_server_drops_are_not_sent_again_and_instances_do_not_fight(
    publishers: list[SlicePublisher], caplog: pytest.LogCaptureFixture
) -> None:
    """A server with the DRADeviceTaints gate off drops them without a word: sent on every
    reconcile, two instances would rewrite the pool for each other without end."""
    with running_apiserver(validate=schema_errors, device_taints=False) as apiserver:
        apiserver.put_node(NODE)
        with apiserver.api_client() as client:
            api = ResourceApi(client)
            publishers.append(started(api, verdicts(1)))
            publishers.append(started(api, verdicts(1)))
            assert apiserver.wait_until(lambda: bool(apiserver.slices(NODE, DRIVER)))
            time.sleep(0.5)
            settled = generations(apiserver)
            apiserver.clear_requests()
            time.sleep(1.5)
            assert writes(apiserver) == 0 and generations(apiserver) == settled
            assert held_taints(apiserver) == {}
            assert "dropped the taints of 1 unhealthy devices" in caplog.text
            # Another device turning unhealthy is tried once more.
            before = max(settled)
            publishers[0].update(POOL, verdicts(1, 3))
            publishers[1].update(POOL, verdicts(1, 3))
            assert apiserver.wait_until(lambda: max(generations(apiserver)) > before)
            time.sleep(0.5)
            apiserver.clear_requests()
            time.sleep(1.0)
            assert writes(apiserver) == 0
        for publisher in publishers:
            publisher.stop()


NO_SCHEDULE_EXISTS = {"key": KEY, "operator": "Exists", "effect": "NoSchedule"}


@pytest.mark.parametrize(
    ("effect", "tolerations", "picked"),
    [
        pytest.param(TaintEffect.NO_SCHEDULE, [], False, id="no-schedule-not-tolerated"),
        pytest.param(TaintEffect.NO_EXECUTE, [], False, id="no-execute-not-tolerated"),
        pytest.param(TaintEffect.NONE, [], True, id="none-only-shown"),
        pytest.param(
            TaintEffect.NO_SCHEDULE, [NO_SCHEDULE_EXISTS], True, id="tolerated-by-key-and-effect"
        ),
        pytest.param(
            TaintEffect.NO_EXECUTE, [NO_SCHEDULE_EXISTS], False, id="tolerating-another-effect"
        ),
        pytest.param(TaintEffect.NO_EXECUTE, [{"operator": "Exists"}], True, id="tolerating-all"),
        pytest.param(
            TaintEffect.NO_SCHEDULE,
            [{"key": KEY, "value": "x", "effect": "NoSchedule"}],
            False,
            id="equal-to-another-value",
        ),
    ],
)
def test_the_scheduler_leaves_an_unhealthy_device_to_claims_that_tolerate_it(
    apiserver: ApiServerStandIn,
    api: ResourceApi,
    publishers: list[SlicePublisher],
    effect: TaintEffect,
    tolerations: list[Object],
    picked: bool,
) -> None:
    publisher = started(api, verdicts(1), effect)
    publishers.append(publisher)
    assert apiserver.wait_until(lambda: bool(held_taints(apiserver)))
    others = [NAMES[0], *NAMES[2:]]
    expected = NAMES if picked else others
    assert apiserver.allocatable(NODE, DRIVER, tolerations) == expected
    publisher.update(POOL, verdicts())
    assert apiserver.wait_until(lambda: apiserver.allocatable(NODE, DRIVER) == NAMES)


def test_a_burst_of_changes_is_published_once_without_listing_our_own_writes(
    apiserver: ApiServerStandIn, api: ResourceApi, publishers: list[SlicePublisher]
) -> None:
    """Prepares and unprepares in quick succession (a group's companions leaving the pool and
    coming back) are one new generation of the pool, written without reading back the slices
    our last writes left."""
    pool = devices(300)
    publisher = SlicePublisher(api, NODE, DRIVER, pool, backoff_first=0.05)
    publishers.append(publisher)
    publisher.start()
    assert apiserver.wait_until(lambda: len(apiserver.slices(NODE, DRIVER)) == 3)
    assert generations(apiserver) == {1}
    assert apiserver.wait_until(lambda: any("watch" in r.query for r in apiserver.requests))
    apiserver.clear_requests()
    hidden = pool[:8] + pool[16:]
    for _ in range(20):
        publisher.update(hidden)
        publisher.update(pool)
        time.sleep(0.01)
    publisher.update(hidden)

    def published() -> list[str]:
        return [d["name"] for s in apiserver.slices(NODE, DRIVER) for d in s["spec"]["devices"]]

    assert apiserver.wait_until(lambda: published() == [d.name for d in hidden])
    time.sleep(0.3)
    assert generations(apiserver) == {2}
    assert writes(apiserver) == 3
    lists = [
        r
        for r in apiserver.requests
        if r.method == "GET" and r.path.endswith("/resourceslices") and "watch" not in r.query
    ]
    # Our writes coming back through the watch (even before their answers) are known as ours.
    assert lists == []


class SlowApi(ResourceApi):
    """An API server that takes `seconds` for every slice it is sent (loaded, or far away)."""

    seconds = 0.2

    def create_slice(self, item: Object) -> Object:
        time.sleep(self.seconds)
        return super().create_slice(item)

    def replace_slice(self, item: Object) -> Object:
        time.sleep(self.seconds)
        return super().replace_slice(item)


def slow_pool_changed(
    apiserver: ApiServerStandIn,
    api_client: kubernetes.client.ApiClient,
    publishers: list[SlicePublisher],
) -> tuple[SlicePublisher, float]:
    """A publisher on a slow API server, its pool published, then a change of the devices alone
    handed to it: the publisher and when."""
    apiserver.put_node(NODE)
    publisher = started(SlowApi(api_client), verdicts())
    publishers.append(publisher)
    assert apiserver.wait_until(lambda: generations(apiserver) == {1})
    first = time.monotonic()
    publisher.update(POOL[1:], verdicts())
    return publisher, first


def test_a_slow_api_server_gets_a_change_of_devices_later_and_one_of_taints_at_once(
    apiserver: ApiServerStandIn,
    api_client: kubernetes.client.ApiClient,
    publishers: list[SlicePublisher],
) -> None:
    """A write of the pool that took 0.2 s makes a change of the devices alone (a claim's group
    companions leaving it) wait 2 s, past the coalescing's 1 s, so the pool is written at most
    a tenth of the time; a device turned unhealthy is tainted without waiting."""
    publisher, first = slow_pool_changed(apiserver, api_client, publishers)
    time.sleep(1.3)
    assert generations(apiserver) == {1}
    assert apiserver.wait_until(lambda: generations(apiserver) == {2}, timeout=5.0)
    assert time.monotonic() - first >= 1.7
    start = time.monotonic()
    publisher.update(POOL[1:], verdicts(2))
    assert apiserver.wait_until(lambda: bool(held_taints(apiserver)))
    assert time.monotonic() - start < 1.0
    assert set(held_taints(apiserver)) == {NAMES[2]}


def test_the_wait_after_a_slow_write_has_a_ceiling(
    apiserver: ApiServerStandIn,
    api_client: kubernetes.client.ApiClient,
    publishers: list[SlicePublisher],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """One write slowed by a hiccup of the API server must not hold the next change of the
    devices for ten times as long: a device gone or back reaches the scheduler within
    WRITE_WAIT_MAX_SECONDS."""
    monkeypatch.setattr(dra.publisher, "WRITE_WAIT_MAX_SECONDS", 1.2)
    monkeypatch.setattr(SlowApi, "seconds", 0.4)
    _, first = slow_pool_changed(apiserver, api_client, publishers)
    assert apiserver.wait_until(lambda: generations(apiserver) == {2}, timeout=5.0)
    assert time.monotonic() - first < 2.5
