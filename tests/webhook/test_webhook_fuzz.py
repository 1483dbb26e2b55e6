"""Malformed reviews, from slightly damaged launcher pods to garbage: never a 500, never a crash.

Damage is done where it hurts: a realistic review has one or more of its fields (anywhere in the
tree) replaced by arbitrary JSON or deleted, so the planners' every reader gets exercised. Through
the real HTTPS server, well-formed but varied launcher pods (hostile names, odd uids, resources in
limits, requests or both, compute anywhere) must come back with their uid and a patch that
applies. VMIs requiring iommufd, with varied affinity damaged the same way, must get a refusal
or a patch that keeps them on iommufd nodes: anything else would admit them without it. Every
suite is seeded (`derandomize`) and bounded, so a run is the same run every time.
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


LABEL = "kubevirt-iommufd.io/iommufd"
MODE = "iommufd.kubevirt.io/mode"
REQUIRED = "requiredDuringSchedulingIgnoredDuringExecution"
ON_LABEL = [
    {"key": LABEL, "operator": "In", "values": ["true"]},
    {"key": LABEL, "operator": "In", "values": ["true", "false"]},
    {"key": LABEL, "operator": "In", "values": ["false"]},
    {"key": LABEL, "operator": "NotIn", "values": ["true"]},
    {"key": LABEL, "operator": "NotIn", "values": ["false"]},
    {"key": LABEL, "operator": "Exists"},
    {"key": LABEL, "operator": "DoesNotExist"},
]
OTHERS = [
    {"key": "topology.kubernetes.io/zone", "operator": "In", "values": ["a", "b"]},
    {"key": "nvidia.com/gpu.present", "operator": "Exists"},
]
expressions = st.sampled_from(ON_LABEL + OTHERS)
terms = st.fixed_dictionaries(
    {},
    optional={
        "matchExpressions": st.lists(expressions, max_size=3),
        "matchFields": st.just([{"key": "metadata.name", "operator": "In", "values": ["n1"]}]),
    },
)
node_affinities = st.fixed_dictionaries(
    {},
    optional={
        REQUIRED: st.fixed_dictionaries(
            {}, optional={"nodeSelectorTerms": st.lists(terms, max_size=4)}
        ),
        "preferredDuringSchedulingIgnoredDuringExecution": st.just(
            [{"weight": 5, "preference": {"matchExpressions": OTHERS[:1]}}]
        ),
    },
)
# Where the VMI planner reads: damage elsewhere is the generic suite's.
READ = (("spec", "affinity"), ("spec", "nodeSelector"), ("metadata", "annotations"))


@st.composite
def damaged_requiring_vmis(draw: st.DrawFn) -> Json:
    """A VMI annotated `require` with varied affinity, then damaged where the planner reads."""
    vmi = load(draw(st.sampled_from(["vmi-gpu.yaml", "vmi-hostdevice-with-sidecar.yaml"])))
    vmi["metadata"]["annotations"][MODE] = "require"
    if draw(st.booleans()):
        vmi["spec"]["affinity"] = {"nodeAffinity": draw(node_affinities)}
    if draw(st.booleans()):
        keys = st.sampled_from([LABEL, "pool"])
        vmi["spec"]["nodeSelector"] = draw(
            st.dictionaries(keys, st.sampled_from(["true", "false"]))
        )
    vmi = copy.deepcopy(vmi)  # the expressions drawn are the tables' own dicts
    for _ in range(draw(st.integers(0, 3))):
        candidates = [p for p in paths(vmi) if p[:2] in READ or p in (("spec",), ("metadata",))]
        path = draw(st.sampled_from(candidates))
        parent: Any = vmi
        for step in path[:-1]:
            parent = parent[step]
        target = parent[path[-1]]
        action = draw(st.sampled_from(["replace", "delete", "insert"]))
        if action == "insert" and isinstance(target, list):
            target.insert(draw(st.integers(0, len(target))), draw(json_values))
        elif action == "delete" and isinstance(parent, dict):
            del parent[path[-1]]
        else:
            parent[path[-1]] = draw(json_values)
    return admission_review(vmi, kind="VirtualMachineInstance")


def check_requiring_answer(vmi: Any, response: Json) -> None:
    """A VMI that requires iommufd is refused, or kept on iommufd nodes by its patch."""
    metadata = vmi.get("metadata") if isinstance(vmi, dict) else None
    annotations = metadata.get("annotations") if isinstance(metadata, dict) else None
    if not isinstance(annotations, dict) or annotations.get(MODE) != "require":
        return
    if not response["allowed"]:
        message = response["status"]["message"]
        assert message.isprintable()
        assert any(field in message for field in ("spec", "metadata", "annotation")), message
        return
    operations = json.loads(base64.b64decode(response.get("patch", "W10=")))
    patched = jsonpatch.JsonPatch(operations).apply(copy.deepcopy(vmi))
    if pinned_elsewhere(vmi):
        assert any("left unchanged" in w for w in response.get("warnings", [])), response
        return
    assert keeps_to_iommufd_nodes(patched), (vmi.get("spec"), response)
    for before, after in zip(required_terms(vmi), required_terms(patched), strict=False):
        if isinstance(before, dict) and not is_empty(before):
            kept = after.get("matchExpressions", [])[: len(before.get("matchExpressions") or [])]
            assert kept == (before.get("matchExpressions") or [])
        else:
            assert after == before  # an empty term selects no node: it must stay that way


def required_terms(vmi: Json) -> list[Any]:
    node: Any = vmi.get("spec")
    for key in ("affinity", "nodeAffinity", REQUIRED, "nodeSelectorTerms"):
        node = node.get(key) if isinstance(node, dict) else None
    return node if isinstance(node, list) else []


def is_empty(term: Json) -> bool:
    return not term.get("matchExpressions") and not term.get("matchFields")


def keeps_to_iommufd_nodes(vmi: Json) -> bool:
    spec = vmi.get("spec")
    selector = spec.get("nodeSelector") if isinstance(spec, dict) else None
    if isinstance(selector, dict) and selector.get(LABEL) == "true":
        return True
    terms = required_terms(vmi)
    return bool(terms) and all(
        isinstance(term, dict) and (is_empty(term) or any(map(requires_true, expressions_of(term))))
        for term in terms
    )


def pinned_elsewhere(vmi: Json) -> bool:
    """The owner asked for nodes without iommufd: that is theirs to say, and they are warned."""
    spec = vmi.get("spec")
    selector = spec.get("nodeSelector") if isinstance(spec, dict) else None
    if isinstance(selector, dict) and isinstance(selector.get(LABEL), str):
        return bool(selector[LABEL] != "true")
    return any(excludes_true(e) for term in required_terms(vmi) for e in expressions_of(term))


def expressions_of(term: object) -> list[Json]:
    found = term.get("matchExpressions") if isinstance(term, dict) else None
    return [e for e in found if isinstance(e, dict)] if isinstance(found, list) else []


def requires_true(expression: Json) -> bool:
    return expression.get("key") == LABEL and (
        expression.get("operator"),
        expression.get("values"),
    ) == ("In", ["true"])


def excludes_true(expression: Json) -> bool:
    """Kubernetes' meaning of a well-formed expression on the label, against the value true."""
    operator, values = expression.get("operator"), expression.get("values") or []
    if expression.get("key") != LABEL or not isinstance(values, list):
        return False
    return (
        (operator == "In" and "true" not in values)
        or (operator == "NotIn" and "true" in values)
        or operator in ("DoesNotExist", "Gt", "Lt")
    )


@settings(max_examples=500, deadline=None, derandomize=True, database=None)
@given(review=damaged_requiring_vmis(), config=st.sampled_from(CONFIGS))
def test_requiring_vmis_get_a_refusal_or_their_affinity(review: Json, config: Config) -> None:
    verdict = review_vmi(review, config)

    check_verdict(review, verdict)
    check_requiring_answer(review["request"]["object"], verdict.review["response"])


@settings(
    max_examples=80,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(review=damaged_requiring_vmis())
def test_over_https_requiring_vmis_get_a_refusal_or_their_affinity(
    conn: http.client.HTTPSConnection, review: Json
) -> None:
    status, text, _ = post(conn, "/mutate-vmi", json.dumps(review).encode())

    assert status == 200, text
    answer = json.loads(text)
    check_verdict_json(review, answer)
    check_requiring_answer(review["request"]["object"], answer["response"])
