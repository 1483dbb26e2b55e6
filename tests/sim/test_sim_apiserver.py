"""The API server stand-in through the real `kubernetes` client (ResourceV1Api, CoreV1Api,
watch.Watch) over HTTPS on loopback: every endpoint the DRA driver uses, the real server's
answers to conflicts, stale watches and invalid objects, and the injected failures."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import kubernetes.client
import kubernetes.config
import pytest
import urllib3
from kubernetes.client import ApiException, CoreV1Api, ResourceV1Api, V1ResourceSlice
from kubernetes.watch import Watch

from k8s_schema_kit import assert_valid, schema_errors
from sim.apiserver import (
    AllocatedDevice,
    ApiServerStandIn,
    build_resource_claim,
    running_apiserver,
)
from sim.apiserver_rules import validate_resource_slice

DRIVER = "vfio.kubevirt-iommufd.io"
Obj = dict[str, Any]


def device(bdf: str, **attributes: Obj) -> Obj:
    return {
        "name": "pci-" + bdf.replace(":", "-").replace(".", "-"),
        "attributes": {"resource.kubernetes.io/pciBusID": {"string": bdf}, **attributes},
    }


def resource_slice(
    name: str, node: str = "node-1", driver: str = DRIVER, devices: int = 2, **spec: Any
) -> Obj:
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceSlice",
        "metadata": {"name": name},
        "spec": {
            "driver": driver,
            "nodeName": node,
            "pool": {"name": node, "generation": 0, "resourceSliceCount": 1},
            "devices": [device(f"0000:{bus:02x}:00.0") for bus in range(devices)],
            **spec,
        },
    }


def model(body: Obj) -> V1ResourceSlice:
    """The client's model of a slice, as a driver builds it."""
    slice_ = V1ResourceSlice.from_dict(body)
    assert slice_ is not None
    return slice_


def status_of(error: ApiException) -> Obj:
    body: Obj = json.loads(error.body or "")
    return body


def refused(call: Any, *args: Any, **kwargs: Any) -> Obj:
    """The `Status` the server answered a refused call with."""
    with pytest.raises(ApiException) as caught:
        call(*args, **kwargs)
    status = status_of(caught.value)
    assert status["kind"] == "Status" and status["status"] == "Failure"
    assert status["code"] == caught.value.status
    return status


@pytest.fixture
def resources(api_client: kubernetes.client.ApiClient) -> ResourceV1Api:
    return ResourceV1Api(api_client)


def names(slice_list: Any) -> list[str]:
    return [s.metadata.name for s in slice_list.items]


# Nodes and claims ----------------------------------------------------------------------------
def test_a_seeded_node_is_read_with_its_uid(
    apiserver: ApiServerStandIn, api_client: kubernetes.client.ApiClient
) -> None:
    seeded = apiserver.put_node("node-1", labels={"zone": "a"})
    node = CoreV1Api(api_client).read_node("node-1")
    assert node.metadata.uid == seeded["metadata"]["uid"]
    assert node.metadata.resource_version == seeded["metadata"]["resourceVersion"]
    assert node.metadata.labels == {"kubernetes.io/hostname": "node-1", "zone": "a"}
    missing = refused(CoreV1Api(api_client).read_node, "node-2")
    assert (missing["reason"], missing["code"]) == ("NotFound", 404)
    assert missing["message"] == 'nodes "node-2" not found'


def test_a_claim_is_read_with_the_allocation_the_scheduler_wrote(
    apiserver: ApiServerStandIn, resources: ResourceV1Api
) -> None:
    apiserver.put_claim(build_resource_claim("vms", "gpus", ["gpu0", "gpu1"], "vfio.example"))
    unallocated = resources.read_namespaced_resource_claim("gpus", "vms")
    assert unallocated.status is None or unallocated.status.allocation is None
    apiserver.set_allocation(
        "vms",
        "gpus",
        [
            AllocatedDevice("gpu0", DRIVER, "node-1", "pci-0000-65-00-0"),
            AllocatedDevice("gpu1", DRIVER, "node-1", "pci-0000-66-00-0"),
        ],
        node_name="node-1",
    )
    claim = resources.read_namespaced_resource_claim("gpus", "vms")
    results = claim.status.allocation.devices.results or []
    assert [(r.request, r.driver, r.pool, r.device) for r in results] == [
        ("gpu0", DRIVER, "node-1", "pci-0000-65-00-0"),
        ("gpu1", DRIVER, "node-1", "pci-0000-66-00-0"),
    ]
    (term,) = claim.status.allocation.node_selector.node_selector_terms
    assert [f.values for f in term.match_fields or []] == [["node-1"]]
    stored = apiserver.read("ResourceClaim", "gpus", "vms")
    assert stored is not None and claim.metadata.uid == stored["metadata"]["uid"]
    assert_valid(stored)
    missing = refused(resources.read_namespaced_resource_claim, "gpus", "other")
    assert missing["message"] == 'resourceclaims.resource.k8s.io "gpus" not found'
    assert missing["details"] == {
        "name": "gpus",
        "group": "resource.k8s.io",
        "kind": "resourceclaims",
    }


# Create, list ----------------------------------------------------------------------------------
def test_create_fills_in_what_the_server_owns(
    apiserver: ApiServerStandIn, resources: ResourceV1Api
) -> None:
    body = resource_slice("")
    del body["metadata"]["name"]
    body["metadata"]["generateName"] = "node-1-vfio-"
    created = resources.create_resource_slice(model(body))
    assert created.metadata.name.startswith("node-1-vfio-")
    assert len(str(created.metadata.name)) == len("node-1-vfio-") + 5
    assert created.metadata.uid and created.metadata.creation_timestamp is not None
    assert created.metadata.generation == 1
    assert created.metadata.resource_version == str(apiserver.resource_version)
    assert created.kind == "ResourceSlice" and created.api_version == "resource.k8s.io/v1"
    assert apiserver.requests[-1].status == 201

    again = resource_slice(str(created.metadata.name))
    exists = refused(resources.create_resource_slice, again)
    assert (exists["reason"], exists["code"]) == ("AlreadyExists", 409)
    assert exists["message"] == (
        f'resourceslices.resource.k8s.io "{created.metadata.name}" already exists'
    )
    again["metadata"]["resourceVersion"] = "5"
    again["metadata"]["name"] = "other"
    assert refused(resources.create_resource_slice, again)["code"] == 500


def test_list_honours_field_and_label_selectors(
    apiserver: ApiServerStandIn, resources: ResourceV1Api
) -> None:
    for name, node, driver in [
        ("a", "node-1", DRIVER),
        ("b", "node-1", "gpu.example.com"),
        ("c", "node-2", DRIVER),
    ]:
        body = resource_slice(name, node, driver)
        body["metadata"]["labels"] = {"node": node}
        resources.create_resource_slice(model(body))
    everything = resources.list_resource_slice()
    assert names(everything) == ["a", "b", "c"]
    assert everything.kind == "ResourceSliceList"
    assert everything.metadata.resource_version == str(apiserver.resource_version)
    assert names(resources.list_resource_slice(field_selector="spec.nodeName=node-1")) == ["a", "b"]
    assert names(resources.list_resource_slice(field_selector=f"spec.driver={DRIVER}")) == [
        "a",
        "c",
    ]
    both = f"spec.nodeName=node-1,spec.driver={DRIVER}"
    assert names(resources.list_resource_slice(field_selector=both)) == ["a"]
    assert names(resources.list_resource_slice(field_selector="metadata.name!=a")) == ["b", "c"]
    assert names(resources.list_resource_slice(label_selector="node in (node-2)")) == ["c"]
    assert names(resources.list_resource_slice(label_selector="node!=node-2")) == ["a", "b"]
    unknown = refused(resources.list_resource_slice, field_selector="spec.pool.name=node-1")
    assert unknown["code"] == 400
    assert unknown["message"] == "field label not supported: spec.pool.name"
    # The real server sends list items without kind and apiVersion (kubernetes#3030).
    response: Any = resources.list_resource_slice(_preload_content=False)
    assert "kind" not in json.loads(response.data)["items"][0]


def test_list_pages_with_limit_and_continue(resources: ResourceV1Api) -> None:
    for name in ["s1", "s2", "s3"]:
        resources.create_resource_slice(model(resource_slice(name)))
    first = resources.list_resource_slice(limit=2)
    assert names(first) == ["s1", "s2"]
    assert first.metadata.remaining_item_count == 1
    rest = resources.list_resource_slice(limit=2, _continue=first.metadata._continue)
    assert names(rest) == ["s3"] and rest.metadata._continue is None


# Update ----------------------------------------------------------------------------------------
def test_update_with_a_stale_resource_version_is_a_conflict(
    apiserver: ApiServerStandIn, resources: ResourceV1Api
) -> None:
    created = resources.create_resource_slice(model(resource_slice("s")))
    created.spec.pool.generation = 1
    updated = resources.replace_resource_slice("s", created)
    assert int(str(updated.metadata.resource_version)) > int(str(created.metadata.resource_version))
    assert updated.metadata.generation == 2
    assert updated.metadata.uid == created.metadata.uid

    created.spec.pool.generation = 2  # still carries the first resourceVersion
    stale = refused(resources.replace_resource_slice, "s", created)
    assert (stale["reason"], stale["code"]) == ("Conflict", 409)
    assert stale["message"] == (
        'Operation cannot be fulfilled on resourceslices.resource.k8s.io "s": the object has'
        " been modified; please apply your changes to the latest version and try again"
    )

    unchanged = resources.replace_resource_slice("s", updated)
    assert unchanged.metadata.resource_version == updated.metadata.resource_version

    updated.metadata.resource_version = None  # unconditional: allowed for ResourceSlices
    updated.metadata.labels = {"touched": "yes"}
    touched = resources.replace_resource_slice("s", updated)
    assert touched.metadata.generation == 2  # metadata only: the spec's generation stays

    apiserver.conflict_next_update()
    forced = refused(resources.replace_resource_slice, "s", touched)
    assert forced["reason"] == "Conflict"
    assert resources.replace_resource_slice("s", touched).metadata.name == "s"
    missing = refused(resources.replace_resource_slice, "gone", model(resource_slice("gone")))
    assert missing["reason"] == "NotFound"


# Delete ----------------------------------------------------------------------------------------
def test_delete_returns_the_object_and_then_404(resources: ResourceV1Api) -> None:
    created = resources.create_resource_slice(model(resource_slice("s")))
    stale = kubernetes.client.V1DeleteOptions(
        preconditions=kubernetes.client.V1Preconditions(resource_version="1")
    )
    assert refused(resources.delete_resource_slice, "s", body=stale)["code"] == 409
    deleted = resources.delete_resource_slice("s")
    assert deleted.metadata.uid == created.metadata.uid
    assert refused(resources.delete_resource_slice, "s")["reason"] == "NotFound"
    assert refused(resources.read_resource_slice, "s")["code"] == 404


def test_deletecollection_deletes_only_the_selected_slices(
    apiserver: ApiServerStandIn, resources: ResourceV1Api
) -> None:
    for name, node in [("a", "node-1"), ("b", "node-1"), ("c", "node-2")]:
        resources.create_resource_slice(model(resource_slice(name, node)))
    resources.delete_collection_resource_slice(field_selector="spec.nodeName=node-1")
    assert names(resources.list_resource_slice()) == ["c"]
    assert apiserver.requests[-2].method == "DELETE"
    assert apiserver.requests[-2].query == {"fieldSelector": "spec.nodeName=node-1"}


# Watch -----------------------------------------------------------------------------------------
def watch_events(resources: ResourceV1Api, **kwargs: Any) -> Iterator[Obj]:
    yield from Watch().stream(resources.list_resource_slice, **kwargs)


def test_watch_streams_events_in_order_from_a_resource_version(
    apiserver: ApiServerStandIn, resources: ResourceV1Api
) -> None:
    resources.create_resource_slice(model(resource_slice("before")))
    start = resources.list_resource_slice().metadata.resource_version
    seen: list[tuple[str, str, str]] = []
    ready = threading.Event()

    def watch() -> None:
        ready.set()
        for event in watch_events(
            resources,
            resource_version=start,
            field_selector="spec.nodeName=node-1",
            timeout_seconds=2,
        ):
            meta = event["object"].metadata
            seen.append((event["type"], meta.name, meta.resource_version))

    watcher = threading.Thread(target=watch)
    watcher.start()
    ready.wait()
    created = resources.create_resource_slice(model(resource_slice("s")))
    resources.create_resource_slice(model(resource_slice("elsewhere", node="node-2")))
    created.spec.pool.generation = 1
    updated = resources.replace_resource_slice("s", created)
    assert apiserver.delete_slices(node_name="node-1") == 2  # as a starting kubelet does
    watcher.join(10)
    assert [(t, n) for t, n, _ in seen] == [
        ("ADDED", "s"),
        ("MODIFIED", "s"),
        ("DELETED", "before"),
        ("DELETED", "s"),
    ]
    assert seen[1][2] == updated.metadata.resource_version
    versions = [int(v) for _, _, v in seen]
    assert versions == sorted(versions) and versions[0] > int(str(start))


def test_watch_without_a_version_starts_with_the_current_slices(
    resources: ResourceV1Api,
) -> None:
    resources.create_resource_slice(model(resource_slice("a")))
    resources.create_resource_slice(model(resource_slice("b")))
    events = list(watch_events(resources, timeout_seconds=1))
    assert [(e["type"], e["object"].metadata.name) for e in events] == [
        ("ADDED", "a"),
        ("ADDED", "b"),
    ]
    assert events[0]["raw_object"]["kind"] == "ResourceSlice"


def test_a_watch_from_a_compacted_version_gets_410(
    apiserver: ApiServerStandIn, resources: ResourceV1Api
) -> None:
    old = resources.create_resource_slice(model(resource_slice("s"))).metadata.resource_version
    resources.delete_resource_slice("s")
    apiserver.compact()
    with pytest.raises(ApiException) as caught:
        list(watch_events(resources, resource_version=old, timeout_seconds=1))
    assert caught.value.status == 410
    assert f"too old resource version: {old}" in str(caught.value.reason)
    current = resources.list_resource_slice().metadata.resource_version
    assert list(watch_events(resources, resource_version=current, timeout_seconds=1)) == []


def test_watch_bookmarks_carry_the_current_version() -> None:
    with running_apiserver(bookmark_interval=0.2) as api, api.api_client() as client:
        resources = ResourceV1Api(client)
        resources.create_resource_slice(model(resource_slice("s")))
        start = str(api.resource_version)
        api.put_node("node-1")  # a write elsewhere moves the version on
        events = list(
            Watch().stream(
                resources.list_resource_slice,
                resource_version=start,
                allow_watch_bookmarks=True,
                timeout_seconds=1,
            )
        )
        bookmarks = [e for e in events if e["type"] == "BOOKMARK"]
        assert bookmarks
        assert bookmarks[-1]["raw_object"]["metadata"]["resourceVersion"] == str(
            api.resource_version
        )


# Validation ------------------------------------------------------------------------------------
def test_a_valid_slice_passes_the_schema_and_the_rules(resources: ResourceV1Api) -> None:
    body = resource_slice("s", devices=128)
    assert schema_errors(body) == [] and validate_resource_slice(body, None) == []
    assert len(resources.create_resource_slice(model(body)).spec.devices or []) == 128


def invalid(**changes: Any) -> Obj:
    body = resource_slice("s")
    spec = body["spec"]
    for key, value in changes.items():
        if value is None:
            spec.pop(key)
        else:
            spec[key] = value
    return body


# Slice → the start of the 422 message after `is invalid: `.
INVALID_SLICES = {
    "129 devices": (
        invalid(devices=[device(f"0000:{b // 32:02x}:{b % 32:02x}.0") for b in range(129)]),
        "spec.devices: Too many: 129: must have at most 128 items",
    ),
    "a BDF as device name": (
        invalid(devices=[{"name": "0000:65:00.0"}]),
        'spec.devices[0].name: Invalid value: "0000:65:00.0": a lowercase RFC 1123 label',
    ),
    "duplicate device names": (
        invalid(devices=[{"name": "gpu"}, {"name": "gpu"}]),
        'spec.devices[1]: Duplicate value: "gpu"',
    ),
    "no node selection": (
        invalid(nodeName=None),
        "spec: Required value: exactly one of `nodeName`, `nodeSelector`, `allNodes`,"
        " `perDeviceNodeSelection` is required",
    ),
    "two node selections": (
        invalid(allNodes=True),
        'spec: Invalid value: "{`nodeName`, `allNodes`}": exactly one of',
    ),
    "a 65-byte string attribute": (
        invalid(devices=[device("0000:65:00.0", model={"string": "x" * 65})]),
        "spec.devices[0].attributes[model].string: Too long: may not be more than 64 bytes",
    ),
    "a string attribute of 33 two-byte characters": (
        invalid(devices=[device("0000:65:00.0", model={"string": "\u00e9" * 33})]),
        "spec.devices[0].attributes[model].string: Too long: may not be more than 64 bytes",
    ),
    "an attribute without a value": (
        invalid(devices=[device("0000:65:00.0", numa={"int": None})]),
        'spec.devices[0].attributes[numa]: Invalid value: "": exactly one value must be specified',
    ),
    "an attribute name that is no C identifier": (
        invalid(devices=[device("0000:65:00.0", **{"9lives": {"int": 1}})]),
        'spec.devices[0].attributes: Invalid value: "9lives": a valid C identifier',
    ),
    "33 attributes": (
        invalid(devices=[device("0000:65:00.0", **{f"a{i}": {"int": i} for i in range(32)})]),
        "spec.devices[0]: Invalid value: 33: the total number of attributes and capacities must"
        " not exceed 32",
    ),
    "an attribute with two values": (
        invalid(devices=[device("0000:65:00.0", numa={"int": 0, "string": "0"})]),
        "spec.devices[0].attributes[numa]: Invalid value: {",
    ),
    "a driver that is not a DNS subdomain": (
        invalid(driver="vfio_driver"),
        'spec.driver: Invalid value: "vfio_driver": a lowercase RFC 1123 subdomain',
    ),
    "an attribute name with a bad domain": (
        invalid(devices=[device("0000:65:00.0", **{"Bad_Domain/x": {"int": 1}})]),
        'spec.devices[0].attributes: Invalid value: "Bad_Domain": a lowercase RFC 1123 subdomain',
    ),
    "a pool without slices": (
        invalid(pool={"name": "node-1", "generation": 0, "resourceSliceCount": 0}),
        "spec.pool.resourceSliceCount: Invalid value: 0: must be greater than zero",
    ),
}
# What the typed client already refuses before sending (its pydantic models forbid unknown fields
# and check types) reaches the server when an object is sent as JSON: the schema catches it.
# Without the schema: an unknown field is kept, a wrong type cannot be decoded (400).
SCHEMA_INVALID_SLICES = {
    "an unknown field": (
        invalid(bogus=1),
        "spec: Invalid value: null: Additional properties are not allowed ('bogus' was unexpected)",
        None,
    ),
    "a generation that is a string": (
        invalid(pool={"name": "node-1", "generation": "one", "resourceSliceCount": 1}),
        "spec.pool.generation: Invalid value: \"one\": 'one' is not of type 'integer'",
        400,
    ),
}


def create_as_json(client: kubernetes.client.ApiClient, body: Obj) -> None:
    """POST a slice as plain JSON through the client's own request machinery."""
    request = client.param_serialize(
        "POST",
        "/apis/resource.k8s.io/v1/resourceslices",
        header_params={"Content-Type": "application/json", "Accept": "application/json"},
        body=body,
        auth_settings=["BearerToken"],
    )
    response = client.call_api(*request)
    response.read()
    client.response_deserialize(response, {"201": "V1ResourceSlice"})


def assert_invalid(status: Obj, message: str) -> None:
    assert (status["reason"], status["code"]) == ("Invalid", 422)
    prefix = 'ResourceSlice.resource.k8s.io "s" is invalid: '
    assert status["message"].startswith(prefix), status["message"]
    assert status["message"].removeprefix(prefix).lstrip("[").startswith(message)
    assert status["details"]["causes"][0]["field"] == message.split(":", maxsplit=1)[0]


@pytest.mark.parametrize(("body", "message"), INVALID_SLICES.values(), ids=list(INVALID_SLICES))
def test_an_invalid_slice_is_refused_with_422_naming_the_field(
    apiserver: ApiServerStandIn, resources: ResourceV1Api, body: Obj, message: str
) -> None:
    assert_invalid(refused(resources.create_resource_slice, body), message)
    assert apiserver.read("ResourceSlice", "s") is None


@pytest.mark.parametrize(
    ("body", "message", "without_schema"),
    SCHEMA_INVALID_SLICES.values(),
    ids=list(SCHEMA_INVALID_SLICES),
)
def test_a_slice_the_schema_refuses_is_422(
    apiserver: ApiServerStandIn,
    api_client: kubernetes.client.ApiClient,
    body: Obj,
    message: str,
    without_schema: int | None,
) -> None:
    assert_invalid(refused(create_as_json, api_client, body), message)
    assert apiserver.read("ResourceSlice", "s") is None
    with running_apiserver(tls=False) as plain, plain.api_client() as client:
        if without_schema is None:
            create_as_json(client, body)
        else:
            assert refused(create_as_json, client, body)["code"] == without_schema


def test_an_update_cannot_change_the_driver(resources: ResourceV1Api) -> None:
    created = resources.create_resource_slice(model(resource_slice("s")))
    created.spec.driver = "gpu.example.com"
    status = refused(resources.replace_resource_slice, "s", created)
    assert status["details"]["causes"] == [
        {
            "reason": "FieldValueInvalid",
            "message": 'Invalid value: "gpu.example.com": field is immutable',
            "field": "spec.driver",
        }
    ]


def test_the_schema_helper_knows_the_other_dra_kinds() -> None:
    device_class = {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "DeviceClass",
        "metadata": {"name": "vfio"},
        "spec": {"selectors": [{"cel": {"expression": f'device.driver == "{DRIVER}"'}}]},
    }
    assert schema_errors(device_class) == []
    template: Obj = {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaimTemplate",
        "metadata": {"name": "gpu", "namespace": "vms"},
        "spec": {"spec": build_resource_claim("vms", "x", ["gpu"], "vfio")["spec"]},
    }
    assert schema_errors(template) == []
    template["spec"]["spec"]["devices"]["requests"][0]["deviceClass"] = "typo"
    (error,) = schema_errors(template)
    assert error.field == "spec.spec.devices.requests[0]"
    assert "deviceClass" in error.detail


# Failures, the log, the transport --------------------------------------------------------------
def test_injected_failures_answer_the_next_requests(
    apiserver: ApiServerStandIn, resources: ResourceV1Api
) -> None:
    apiserver.fail_next(2, 503, method="GET")
    resources.create_resource_slice(model(resource_slice("s")))  # a POST: not affected
    for _ in range(2):
        status = refused(resources.read_resource_slice, "s")
        assert (status["reason"], status["code"]) == ("ServiceUnavailable", 503)
    assert resources.read_resource_slice("s").metadata.name == "s"
    apiserver.fail_next(1, 500, path="/resourceslices")
    assert refused(resources.list_resource_slice)["reason"] == "InternalError"
    assert [(r.method, r.status) for r in apiserver.requests] == [
        ("POST", 201),
        ("GET", 503),
        ("GET", 503),
        ("GET", 200),
        ("GET", 500),
    ]
    logged = apiserver.requests[0]
    assert logged.path == "/apis/resource.k8s.io/v1/resourceslices"
    assert logged.body is not None and logged.body["metadata"] == {"name": "s"}


def test_a_stopped_server_is_unreachable_and_comes_back_on_the_same_port(
    apiserver: ApiServerStandIn, resources: ResourceV1Api
) -> None:
    resources.create_resource_slice(model(resource_slice("s")))
    port = apiserver.port
    watched: list[str] = []
    outcome: list[BaseException | None] = []
    ready = threading.Event()

    def watch() -> None:
        try:
            ready.set()
            for event in watch_events(resources, resource_version="0"):
                watched.append(event["type"])
            outcome.append(None)
        except Exception as e:
            outcome.append(e)

    watcher = threading.Thread(target=watch)
    watcher.start()
    ready.wait()
    assert apiserver.wait_until(lambda: watched == ["ADDED"])
    apiserver.stop()
    watcher.join(10)
    assert not watcher.is_alive() and watched == ["ADDED"]
    assert isinstance(outcome[0], urllib3.exceptions.ProtocolError)  # cut, not finished
    config = apiserver.configuration()
    config.retries = 0
    with kubernetes.client.ApiClient(config) as client, pytest.raises(urllib3.exceptions.HTTPError):
        ResourceV1Api(client).read_resource_slice("s")
    apiserver.start()
    assert apiserver.port == port
    assert resources.read_resource_slice("s").metadata.name == "s"


def test_a_wrong_token_is_401(apiserver: ApiServerStandIn) -> None:
    config = apiserver.configuration()
    config.api_key = {"BearerToken": "wrong"}
    with kubernetes.client.ApiClient(config) as client:
        status = refused(CoreV1Api(client).read_node, "node-1")
    assert (status["reason"], status["code"]) == ("Unauthorized", 401)


def test_a_kubeconfig_reaches_it(apiserver: ApiServerStandIn, tmp_path: Path) -> None:
    apiserver.put_node("node-1")
    config = kubernetes.client.Configuration()
    kubernetes.config.load_kube_config(
        config_file=str(apiserver.write_kubeconfig(tmp_path / "kubeconfig")),
        client_configuration=config,
    )
    with kubernetes.client.ApiClient(config) as client:
        assert CoreV1Api(client).read_node("node-1").metadata.name == "node-1"


def test_plain_http_serves_the_same() -> None:
    with running_apiserver(tls=False) as api, api.api_client() as client:
        assert api.url.startswith("http://")
        ResourceV1Api(client).create_resource_slice(model(resource_slice("s")))
        assert api.slices(node_name="node-1")[0]["metadata"]["name"] == "s"
