"""Malformed reviews, from slightly damaged launcher pods to garbage: never a 500, never a crash.

Damage is done where it hurts: a realistic review has one or more of its fields (anywhere in the
tree) replaced by arbitrary JSON or deleted, so the planners' every reader gets exercised. Through
the real HTTPS server, well-formed but varied launcher pods (hostile names, odd uids, resources in
limits, requests or both, compute anywhere) must come back with their uid and a patch that
applies. Every suite is seeded (`derandomize`) and bounded, so a run is the same run every time.
"""

from __future__ import annotations

import base64
import copy
import http.client
import json
from collections.abc import Iterator
from typing import Any

import jsonpatch
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from webhook.config import Config, HookSidecar
from webhook.review import BadReview, Verdict, review_pod, review_vmi
from webhook_kit import (
    IOMMUFD,
    Json,
    RunningServer,
    Tls,
    admission_review,
    container,
    https,
    load,
    make_tls,
    post,
    raw_tls,
    running_server,
)

SIDECAR = HookSidecar(image="ghcr.io/kubevirt-iommufd/kubevirt-iommufd:v0.1.0")
CONFIGS = [Config(hook_sidecar=SIDECAR), Config(hook_sidecar=SIDECAR, strict=True)]
REVIEWS = [
    admission_review(load(name))
    for name in (
        "pod-gpu.yaml",
        "pod-hostdevice.yaml",
        "pod-hook-sidecars.yaml",
        "pod-compute-not-first.yaml",
        "pod-already-iommufd.yaml",
    )
] + [
    admission_review(load(name), kind="VirtualMachineInstance")
    for name in ("vmi-gpu.yaml", "vmi-hostdevice-with-sidecar.yaml")
]

scalars = (
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False)
    | st.text(max_size=20)
    | st.sampled_from(["compute", "virt-launcher", "nvidia.com/GH100_H100", "CREATE", "[", "[]"])
)
json_values = st.recursive(
    scalars,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12), inner, max_size=4)
    ),
    max_leaves=12,
)


def paths(document: Any, prefix: tuple[Any, ...] = ()) -> Iterator[tuple[Any, ...]]:
    yield prefix
    if isinstance(document, dict):
        for key, value in document.items():
            yield from paths(value, (*prefix, key))
    elif isinstance(document, list):
        for index, value in enumerate(document):
            yield from paths(value, (*prefix, index))


@st.composite
def damaged_reviews(draw: st.DrawFn) -> Json:
    review = copy.deepcopy(draw(st.sampled_from(REVIEWS)))
    for _ in range(draw(st.integers(1, 3))):
        candidates = list(paths(review))[1:]
        path = draw(st.sampled_from(candidates))
        parent: Any = review
        for step in path[:-1]:
            parent = parent[step]
        if draw(st.booleans()) and isinstance(parent, dict):
            del parent[path[-1]]
        else:
            parent[path[-1]] = draw(json_values)
        if not isinstance(review, dict) or not review:
            break
    return review


def check_verdict(body: Json, verdict: Verdict) -> None:
    """What every answer must be, whatever it decided."""
    encoded = json.dumps(verdict.review)
    answer = json.loads(encoded)
    response = answer["response"]
    assert response["uid"] == body["request"]["uid"]
    assert isinstance(response["allowed"], bool)
    assert verdict.outcome in {"patched", "unchanged", "warned", "denied"}
    assert response["allowed"] is (verdict.outcome != "denied")
    if "patch" in response:
        assert verdict.outcome == "patched"
        operations = json.loads(base64.b64decode(response["patch"], validate=True))
        # The patch must apply to the very object it was computed from.
        jsonpatch.JsonPatch(operations).apply(copy.deepcopy(body["request"]["object"]))
    for warning in response.get("warnings", []):
        assert "\n" not in warning


@settings(max_examples=600, deadline=None, derandomize=True, database=None)
@given(review=damaged_reviews(), config=st.sampled_from(CONFIGS))
def test_damaged_reviews_get_an_answer_or_a_bad_review(review: Json, config: Config) -> None:
    for reviewer in (review_pod, review_vmi):
        try:
            verdict = reviewer(review, config)
        except BadReview:
            request = review.get("request")
            uid = request.get("uid") if isinstance(request, dict) else None
            assert not (isinstance(uid, str) and uid)
            continue
        check_verdict(review, verdict)


@settings(max_examples=300, deadline=None, derandomize=True, database=None)
@given(body=json_values, config=st.sampled_from(CONFIGS))
def test_arbitrary_json_gets_an_answer_or_a_bad_review(body: object, config: Config) -> None:
    for reviewer in (review_pod, review_vmi):
        try:
            verdict = reviewer(body, config)
        except BadReview:
            continue
        assert isinstance(body, dict)
        check_verdict(body, verdict)


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[RunningServer, Tls]]:
    tls = make_tls(tmp_path_factory.mktemp("fuzz-tls"))
    with running_server(Config(hook_sidecar=SIDECAR), tls) as server:
        yield server, tls


@pytest.fixture(scope="module")
def conn(live: tuple[RunningServer, Tls]) -> Iterator[http.client.HTTPSConnection]:
    connection = https(*live)
    yield connection
    connection.close()


@settings(
    max_examples=150,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(
    body=damaged_reviews().map(lambda r: json.dumps(r).encode()) | st.binary(max_size=300),
    path=st.sampled_from(["/mutate-pod", "/mutate-vmi"]),
)
def test_over_https_a_bad_body_is_a_4xx_and_the_connection_lives_on(
    conn: http.client.HTTPSConnection, body: bytes, path: str
) -> None:
    status, text, _ = post(conn, path, body)

    assert status in (200, 400), text
    if status == 200:
        answer = json.loads(text)
        assert answer["kind"]
        sent = json.loads(body)
        check_verdict_json(sent, answer)


def check_verdict_json(sent: Json, answer: Json) -> None:
    """What every answer over the wire must be: the uid back, a patch that applies."""
    response = answer["response"]
    assert response["uid"] == sent["request"]["uid"]
    assert isinstance(response["allowed"], bool)
    if "patch" in response:
        assert response["patchType"] == "JSONPatch"
        operations = json.loads(base64.b64decode(response["patch"], validate=True))
        jsonpatch.JsonPatch(operations).apply(copy.deepcopy(sent["request"]["object"]))
    for warning in response.get("warnings", []):
        assert warning.isprintable()


hostile_text = st.text(
    st.characters(codec="utf-8")
    | st.sampled_from(["\n", "\r", "\x00", "\x1b", "\u202e", "'", "/"]),
    min_size=1,
    max_size=30,
)
resource_names = (
    st.sampled_from(["nvidia.com/GH100_H100", "nvidia.com/GA102GL_A10", "intel.com/qat_4xxx"])
    | st.builds(lambda name: "nvidia.com/" + name, hostile_text)
    | st.builds(lambda domain, name: f"{domain}/{name}", hostile_text, hostile_text)
    | st.just(IOMMUFD)
)
quantities = st.sampled_from(["1", "2", "8", "0"]) | st.integers(0, 16).map(str)


@st.composite
def launcher_reviews(draw: st.DrawFn) -> Json:
    """A well-formed launcher pod review with varied resources, position of compute and text."""
    pod = copy.deepcopy(draw(st.sampled_from(LAUNCHER_PODS)))
    compute = container(pod, "compute")
    resources: dict[str, dict[str, str]] = {}
    for section in draw(st.sampled_from([("limits",), ("requests",), ("limits", "requests")])):
        resources[section] = draw(st.dictionaries(resource_names, quantities, max_size=4))
    compute["resources"] = resources
    others = [c for c in pod["spec"]["containers"] if c is not compute]
    position = draw(st.integers(0, len(others)))
    pod["spec"]["containers"] = [*others[:position], compute, *others[position:]]
    pod["metadata"]["generateName"] = draw(hostile_text)
    uid = draw(st.text(min_size=1, max_size=40))
    return admission_review(pod, namespace=draw(hostile_text), uid=uid)


LAUNCHER_PODS = [
    load(name)
    for name in (
        "pod-gpu.yaml",
        "pod-hostdevice.yaml",
        "pod-hook-sidecars.yaml",
        "pod-compute-not-first.yaml",
    )
]


@settings(
    max_examples=120,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(review=launcher_reviews())
def test_over_https_launcher_pods_get_their_uid_and_a_patch_that_applies(
    conn: http.client.HTTPSConnection, review: Json
) -> None:
    status, text, _ = post(conn, "/mutate-pod", json.dumps(review).encode())

    assert status == 200, text
    answer = json.loads(text)
    check_verdict_json(review, answer)
    pod = review["request"]["object"]
    resources = container(pod, "compute")["resources"]
    managed = any(
        name.startswith("nvidia.com/") for section in resources.values() for name in section
    )
    has_iommufd = IOMMUFD in resources.get("limits", {})
    assert ("patch" in answer["response"]) is (managed and not has_iommufd)
    if "patch" in answer["response"]:
        operations = json.loads(base64.b64decode(answer["response"]["patch"]))
        patched = jsonpatch.JsonPatch(operations).apply(copy.deepcopy(pod))
        result = container(patched, "compute")["resources"]
        # A request the pod already has sets the value: an extended resource's two must agree.
        assert result["limits"][IOMMUFD] == resources.get("requests", {}).get(IOMMUFD, "1")
        if "requests" in result:
            assert result["requests"][IOMMUFD] == result["limits"][IOMMUFD]
        others = [c for c in patched["spec"]["containers"] if c["name"] != "compute"]
        assert others == [c for c in pod["spec"]["containers"] if c["name"] != "compute"]


@settings(
    max_examples=100,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(garbage=st.binary(min_size=1, max_size=200))
def test_garbage_http_is_refused_and_the_server_carries_on(
    live: tuple[RunningServer, Tls], garbage: bytes
) -> None:
    server, tls = live
    sock = raw_tls(server, tls)
    sock.sendall(garbage + b"\r\n\r\n")
    sock.settimeout(0.2)
    received = b""
    try:
        while chunk := sock.recv(4096):
            received += chunk
    except TimeoutError:
        pass  # still waiting for the rest of a request that looked valid so far
    sock.close()

    assert not received.startswith(b"HTTP/1.1 5"), received[:200]
    fresh = https(server, tls)
    assert post(fresh, "/mutate-pod", json.dumps(REVIEWS[0]).encode())[0] == 200
    fresh.close()
