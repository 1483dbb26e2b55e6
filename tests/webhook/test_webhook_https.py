"""The server through real sockets: HTTPS with a test CA on loopback; probes in plain HTTP."""

from __future__ import annotations

import http.client
import json
import logging
import re
import ssl
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest

from webhook import review as review_module
from webhook.config import Config, HookSidecar
from webhook.http_protocol import MAX_BODY, Request
from webhook.metrics import Metrics
from webhook.plan import Plan
from webhook.routes import build_health_handler
from webhook_kit import (
    IOMMUFD,
    RunningServer,
    Tls,
    admission_review,
    admit,
    apply_patch,
    as_v1_pod,
    container,
    decode_patch,
    get,
    https,
    load,
    make_tls,
    model_resources,
    post,
    raw_tls,
    read_responses,
    request_bytes,
    running_server,
)

REQUIRED = "requiredDuringSchedulingIgnoredDuringExecution"
# Manifest → whether the webhook must change it.
POD_MANIFESTS = {
    "pod-gpu.yaml": True,
    "pod-hostdevice.yaml": True,
    "pod-no-devices.yaml": False,
    "pod-hook-sidecars.yaml": True,
    "pod-already-iommufd.yaml": False,
    "pod-compute-not-first.yaml": True,
}
CONFIG = Config(hook_sidecar=HookSidecar(image="ghcr.io/kubevirt-iommufd/kubevirt-iommufd:v0.1.0"))


@pytest.fixture
def tls(tmp_path: Path) -> Tls:
    return make_tls(tmp_path)


@pytest.fixture
def server(tls: Tls) -> Iterator[RunningServer]:
    with running_server(CONFIG, tls) as running:
        yield running


@pytest.fixture
def conn(server: RunningServer, tls: Tls) -> Iterator[http.client.HTTPSConnection]:
    connection = https(server, tls)
    yield connection
    connection.close()


def test_every_manifest_over_one_keep_alive_connection(
    conn: http.client.HTTPSConnection,
) -> None:
    first_socket = None
    for manifest, needs_iommufd in POD_MANIFESTS.items():
        pod = load(manifest)

        answer = admit(conn, "/mutate-pod", admission_review(pod))

        first_socket = first_socket or conn.sock
        assert conn.sock is first_socket, f"{manifest}: the connection was not kept alive"
        patched = apply_patch(pod, answer)
        assert (patched != pod) is needs_iommufd, manifest
        if needs_iommufd:
            assert container(patched, "compute")["resources"]["limits"][IOMMUFD] == "1"
        limits, _ = model_resources(as_v1_pod(patched), "compute")
        assert (IOMMUFD in limits) is (needs_iommufd or manifest == "pod-already-iommufd.yaml")


def test_the_vmi_endpoint_adds_the_sidecar(conn: http.client.HTTPSConnection) -> None:
    vmi = load("vmi-gpu.yaml")

    answer = admit(conn, "/mutate-vmi", admission_review(vmi, kind="VirtualMachineInstance"))

    annotation = apply_patch(vmi, answer)["metadata"]["annotations"][
        "hooks.kubevirt.io/hookSidecars"
    ]
    assert [entry["image"] for entry in json.loads(annotation)] == [
        "ghcr.io/kubevirt-iommufd/kubevirt-iommufd:v0.1.0"
    ]


def test_the_api_servers_timeout_query_is_ignored(conn: http.client.HTTPSConnection) -> None:
    answer = admit(conn, "/mutate-pod?timeout=10s", admission_review(load("pod-gpu.yaml")))

    assert len(decode_patch(answer)) == 2


@pytest.mark.parametrize(
    ("body", "status", "message"),
    [
        pytest.param(b'{"request": {"uid": ', 400, "not valid JSON", id="truncated-json"),
        pytest.param(b"\xff\xfe\x00garbage", 400, "not valid JSON", id="not-utf8"),
        pytest.param(b"[" * 100_000, 400, "not valid JSON", id="nested-too-deep"),
        pytest.param(b'{"kind": "AdmissionReview"}', 400, "no request", id="no-request"),
        pytest.param(b'{"request": {"operation": "CREATE"}}', 400, "request.uid", id="no-uid"),
    ],
)
def test_bad_bodies_get_400_with_a_message_and_keep_the_connection(
    conn: http.client.HTTPSConnection, body: bytes, status: int, message: str
) -> None:
    got, text, _ = post(conn, "/mutate-pod", body)

    assert got == status
    assert message in text.decode()
    sock = conn.sock
    admit(conn, "/mutate-pod", admission_review(load("pod-gpu.yaml")))
    assert conn.sock is sock


def test_only_application_json_is_accepted(conn: http.client.HTTPSConnection) -> None:
    body = json.dumps(admission_review(load("pod-gpu.yaml"))).encode()

    assert post(conn, "/mutate-pod", body, "text/plain")[0] == 415
    assert post(conn, "/mutate-pod", body, "application/json; charset=utf-8")[0] == 200


def test_a_body_over_one_mebibyte_is_refused_before_it_is_read(
    server: RunningServer, tls: Tls
) -> None:
    head = request_bytes("/mutate-pod", b"")
    head = head.replace(b"content-length: 0", f"content-length: {MAX_BODY + 1}".encode())
    sock = raw_tls(server, tls)

    sock.sendall(head + b"{")  # the body never comes: the answer must not wait for it
    ((status, text),) = read_responses(sock, 1)

    assert status == 413
    assert "over 1048576 bytes" in text.decode()
    assert sock.recv(1) == b""  # and the connection is closed
    sock.close()


def test_a_chunked_body_over_one_mebibyte_is_refused(server: RunningServer, tls: Tls) -> None:
    # A bare socket: the server answers 413 and closes as soon as the body passes the limit,
    # which can be while the client is still sending (http.client would raise on the send and
    # never read the answer).
    with raw_tls(server, tls) as sock:
        sock.sendall(
            b"POST /mutate-pod HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            b"Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n"
        )
        chunk = b"10000\r\n" + b" " * 65536 + b"\r\n"
        try:
            for _ in range(17):
                sock.sendall(chunk)
            sock.sendall(b"0\r\n\r\n")
        except (BrokenPipeError, ConnectionResetError, ssl.SSLError):
            pass
        answer = b""
        try:
            while data := sock.recv(65536):
                answer += data
        except (ConnectionResetError, ssl.SSLError):
            pass
    assert answer.startswith(b"HTTP/1.1 413 "), answer[:100]


def test_exactly_one_mebibyte_is_read(conn: http.client.HTTPSConnection) -> None:
    review = json.dumps(admission_review(load("pod-gpu.yaml"))).encode()
    body = review + b" " * (MAX_BODY - len(review))

    status, _, _ = post(conn, "/mutate-pod", body)

    assert status == 200


def test_unknown_paths_and_methods(conn: http.client.HTTPSConnection) -> None:
    assert post(conn, "/mutate", b"{}")[0] == 404
    conn.request("GET", "/mutate-pod")
    response = conn.getresponse()
    response.read()
    assert response.status == 405
    assert response.getheader("Allow") == "POST"


def test_pipelined_requests_are_answered_in_order(server: RunningServer, tls: Tls) -> None:
    reviews = [admission_review(load(name)) for name in ("pod-gpu.yaml", "pod-no-devices.yaml")]
    sock = raw_tls(server, tls)

    sock.sendall(b"".join(request_bytes("/mutate-pod", json.dumps(r).encode()) for r in reviews))
    answers = [json.loads(body) for _, body in read_responses(sock, 2)]
    sock.close()

    assert [a["response"]["uid"] for a in answers] == [r["request"]["uid"] for r in reviews]
    assert "patch" in answers[0]["response"]
    assert "patch" not in answers[1]["response"]


def test_expect_100_continue_is_honoured(server: RunningServer, tls: Tls) -> None:
    body = json.dumps(admission_review(load("pod-gpu.yaml"))).encode()
    head = request_bytes("/mutate-pod", body, ("expect", "100-continue"))[: -len(body)]
    sock = raw_tls(server, tls)

    sock.sendall(head)
    assert read_responses(sock, 1) == [(100, b"")]
    sock.sendall(body)
    ((status, answer),) = read_responses(sock, 1)
    sock.close()

    assert status == 200
    assert "patch" in json.loads(answer)["response"]


def test_tls_1_2_is_served(server: RunningServer, tls: Tls) -> None:
    context = tls.client_context()
    context.maximum_version = ssl.TLSVersion.TLSv1_2
    conn = http.client.HTTPSConnection("127.0.0.1", server.port, context=context, timeout=10)

    admit(conn, "/mutate-pod", admission_review(load("pod-gpu.yaml")))

    assert isinstance(conn.sock, ssl.SSLSocket)
    assert conn.sock.version() == "TLSv1.2"
    conn.close()


@pytest.mark.filterwarnings("ignore:ssl.TLSVersion.TLSv1_1 is deprecated:DeprecationWarning")
def test_tls_1_1_is_refused(server: RunningServer, tls: Tls) -> None:
    context = tls.client_context()
    context.set_ciphers("DEFAULT:@SECLEVEL=0")  # let the client offer TLS 1.1 at all
    context.minimum_version = ssl.TLSVersion.TLSv1_1
    context.maximum_version = ssl.TLSVersion.TLSv1_1
    conn = http.client.HTTPSConnection("127.0.0.1", server.port, context=context, timeout=10)

    with pytest.raises(ssl.SSLError):
        conn.connect()


def test_probes_and_metrics(server: RunningServer, conn: http.client.HTTPSConnection) -> None:
    for _ in range(3):
        admit(conn, "/mutate-pod", admission_review(load("pod-gpu.yaml")))
    admit(conn, "/mutate-pod", admission_review(load("pod-no-devices.yaml")))
    post(conn, "/mutate-pod", b"{}")

    assert get(server.health_port, "/healthz") == (200, "ok\n")
    assert get(server.health_port, "/readyz") == (200, "ok\n")
    status, metrics = get(server.health_port, "/metrics")

    assert status == 200
    counts = {
        outcome: float(value)
        for outcome, value in re.findall(
            r'kubevirt_iommufd_webhook_admissions_total\{endpoint="pod",outcome="(\w+)"\} (\S+)',
            metrics,
        )
    }
    assert counts == {"patched": 3.0, "unchanged": 1.0, "rejected": 1.0}
    assert (
        'kubevirt_iommufd_webhook_admission_duration_seconds_count{endpoint="pod"} 4.0' in metrics
    )
    assert "process_cpu_seconds_total" in metrics
    assert get(server.health_port, "/nothing")[0] == 404


def test_readyz_answers_503_while_the_admission_port_is_not_serving() -> None:
    handler = build_health_handler(Metrics(), ready=lambda: False)

    response = handler(Request("GET", "/readyz", "", b""))

    assert response.status == 503
    assert handler(Request("GET", "/healthz", "", b"")).status == 200


def test_what_the_request_names_is_logged_on_one_short_line(
    conn: http.client.HTTPSConnection, caplog: pytest.LogCaptureFixture
) -> None:
    forged = "\n2026-01-01 00:00:00 INFO webhook.routes: /mutate-pod default/x uid=y patched"
    pod = load("pod-gpu.yaml")
    pod["metadata"]["generateName"] = "virt-launcher-" + forged + "z" * 10_000
    limits = container(pod, "compute")["resources"]["limits"]
    limits["nvidia.com/GA102" + forged] = "1"
    review = admission_review(pod, namespace="vms" + forged, uid="u" + forged)
    caplog.set_level(logging.INFO, logger="webhook.routes")

    admit(conn, "/mutate-pod", review)

    (record,) = [r for r in caplog.records if r.name == "webhook.routes"]
    message = record.getMessage()
    assert "\n" not in message
    assert message.isprintable()
    assert len(message) < 1_000
    assert "patched" in message
    assert message.count("INFO webhook.routes") == 4  # all four, quoted inside the one line


def test_a_hostile_one_mebibyte_vmi_gets_a_short_refusal_and_pods_carry_on(
    server: RunningServer, tls: Tls
) -> None:
    vmi = load("vmi-gpu.yaml")
    vmi["metadata"]["annotations"]["iommufd.kubevirt.io/mode"] = "require"
    review = admission_review(vmi, kind="VirtualMachineInstance")
    envelope = len(json.dumps(review))
    count = (MAX_BODY - envelope - 200) // len("{},")  # about 340,000 empty terms
    required: dict[str, list[dict[str, object]]] = {"nodeSelectorTerms": [{}] * count}
    vmi["spec"]["affinity"] = {"nodeAffinity": {REQUIRED: required}}
    body = json.dumps(review, separators=(",", ":")).encode()
    assert MAX_BODY - 1000 < len(body) <= MAX_BODY
    hostile, launcher = https(server, tls), https(server, tls)

    status, text, _ = post(hostile, "/mutate-vmi", body)

    assert status == 200
    assert len(text) < 2_000  # no amplification: it once was a 73 MB patch
    response = json.loads(text)["response"]
    assert response["allowed"] is False
    assert f"has {count} terms, over the webhook's limit of" in response["status"]["message"]
    pod = admit(launcher, "/mutate-pod", admission_review(load("pod-gpu.yaml")))
    assert "patch" in pod["response"]
    hostile.close()
    launcher.close()


def test_a_bug_planning_a_vmi_denies_it_over_https_never_500(
    conn: http.client.HTTPSConnection, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A 500 under the VMI webhook's failurePolicy Ignore admits a `require` VMI without its
    affinity; a bug must deny instead, and a launcher pod still gets through with a warning."""

    def bug(*_: object) -> Plan:
        raise KeyError("spec")

    monkeypatch.setattr(review_module, "VMI", replace(review_module.VMI, planner=bug))
    monkeypatch.setattr(review_module, "POD", replace(review_module.POD, planner=bug))
    review = admission_review(load("vmi-gpu.yaml"), kind="VirtualMachineInstance")
    vmi = admit(conn, "/mutate-vmi", review)["response"]
    assert vmi["allowed"] is False
    assert "internal error planning this VMI (KeyError" in vmi["status"]["message"]
    pod = admit(conn, "/mutate-pod", admission_review(load("pod-gpu.yaml")))["response"]
    assert pod["allowed"] is True and "patch" not in pod
    assert "internal error planning this pod" in pod["warnings"][0]
