"""`kubevirt-iommufd certs` against a stand-in Kubernetes API server over real HTTP, through the
real kubernetes client."""

from __future__ import annotations

import base64
import datetime
import json
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import jsonpatch
import pytest
from cryptography import x509
from kubernetes import client

from kubevirt_iommufd.certs_command import CertsTarget, ensure_certificate, renewal_reason
from kubevirt_iommufd.cli import main

SECRETS = "/api/v1/namespaces/kubevirt-iommufd/secrets"
CONFIG = "/apis/admissionregistration.k8s.io/v1/mutatingwebhookconfigurations/kubevirt-iommufd"
TARGET = CertsTarget("kubevirt-iommufd", "webhook", "webhook-tls", "kubevirt-iommufd", 365, 30)


@dataclass
class FakeApi:
    secrets: dict[str, dict[str, Any]] = field(default_factory=dict)
    configuration: dict[str, Any] = field(default_factory=dict)
    writes: list[str] = field(default_factory=list)


@pytest.fixture
def api() -> Iterator[tuple[FakeApi, client.ApiClient]]:
    state = FakeApi(
        configuration={
            "apiVersion": "admissionregistration.k8s.io/v1",
            "kind": "MutatingWebhookConfiguration",
            "metadata": {"name": "kubevirt-iommufd"},
            "webhooks": [
                {
                    "name": name,
                    "admissionReviewVersions": ["v1"],
                    "sideEffects": "None",
                    "clientConfig": {
                        "service": {"namespace": "kubevirt-iommufd", "name": "webhook"}
                    },
                }
                for name in ("pods.kubevirt-iommufd.io", "vmis.kubevirt-iommufd.io")
            ],
        }
    )

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args: object) -> None:
            pass

        def reply(self, code: int, body: dict[str, Any]) -> None:
            data = json.dumps(body).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def body(self) -> Any:
            return json.loads(self.rfile.read(int(self.headers["Content-Length"])))

        def do_GET(self) -> None:
            if self.path == CONFIG:
                return self.reply(200, state.configuration)
            name = self.path.removeprefix(SECRETS + "/")
            if name in state.secrets:
                return self.reply(200, state.secrets[name])
            return self.reply(404, {"kind": "Status", "code": 404, "reason": "NotFound"})

        def do_POST(self) -> None:
            secret = self.body()
            state.secrets[secret["metadata"]["name"]] = secret
            state.writes.append("create secret")
            self.reply(201, secret)

        def do_PUT(self) -> None:
            secret = self.body()
            state.secrets[secret["metadata"]["name"]] = secret
            state.writes.append("replace secret")
            self.reply(200, secret)

        def do_PATCH(self) -> None:
            assert self.headers["Content-Type"] == "application/json-patch+json"
            state.configuration = jsonpatch.apply_patch(state.configuration, self.body())
            state.writes.append("patch configuration")
            self.reply(200, state.configuration)

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    configuration = client.Configuration(host=f"http://127.0.0.1:{server.server_port}")
    try:
        yield state, client.ApiClient(configuration)
    finally:
        server.shutdown()


def run(api_client: client.ApiClient) -> None:
    ensure_certificate(
        client.CoreV1Api(api_client), client.AdmissionregistrationV1Api(api_client), TARGET
    )


def test_issues_a_certificate_and_sets_the_ca_bundle(api: tuple[FakeApi, client.ApiClient]) -> None:
    state, api_client = api
    run(api_client)
    assert state.writes == ["create secret", "patch configuration"]
    secret = state.secrets["webhook-tls"]
    assert secret["type"] == "kubernetes.io/tls"
    cert = x509.load_pem_x509_certificate(base64.b64decode(secret["data"]["tls.crt"]))
    ca = x509.load_pem_x509_certificate(base64.b64decode(secret["data"]["ca.crt"]))
    cert.verify_directly_issued_by(ca)
    names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert "webhook.kubevirt-iommufd.svc" in names.get_values_for_type(x509.DNSName)
    bundles = {w["clientConfig"]["caBundle"] for w in state.configuration["webhooks"]}
    assert bundles == {secret["data"]["ca.crt"]}


def test_a_current_certificate_is_left_alone(api: tuple[FakeApi, client.ApiClient]) -> None:
    state, api_client = api
    run(api_client)
    state.writes.clear()
    run(api_client)
    assert state.writes == []


def test_an_expiring_certificate_is_renewed(api: tuple[FakeApi, client.ApiClient]) -> None:
    state, api_client = api
    run(api_client)
    first = state.secrets["webhook-tls"]["data"]["tls.crt"]
    state.writes.clear()
    soon = datetime.datetime.now(datetime.UTC) + datetime.timedelta(days=400)
    assert renewal_reason(state.secrets["webhook-tls"]["data"], TARGET, soon) is not None
    wrong_names = CertsTarget(
        "kubevirt-iommufd", "other", "webhook-tls", "kubevirt-iommufd", 365, 30
    )
    assert renewal_reason(
        state.secrets["webhook-tls"]["data"], wrong_names, soon - datetime.timedelta(days=399)
    ) == (
        "it does not name other, other.kubevirt-iommufd, other.kubevirt-iommufd.svc,"
        " other.kubevirt-iommufd.svc.cluster.local"
    )
    old_ca = base64.b64decode(state.secrets["webhook-tls"]["data"]["ca.crt"])
    state.secrets["webhook-tls"]["data"]["tls.crt"] = base64.b64encode(b"garbage").decode()
    run(api_client)
    assert state.writes == ["replace secret", "patch configuration"]
    assert state.secrets["webhook-tls"]["data"]["tls.crt"] != first
    # Until the pods pick up the new Secret they serve the old certificate: trust both CAs.
    new_ca = base64.b64decode(state.secrets["webhook-tls"]["data"]["ca.crt"])
    bundle = base64.b64decode(state.configuration["webhooks"][0]["clientConfig"]["caBundle"])
    assert new_ca != old_ca and bundle == new_ca + old_ca
    state.writes.clear()
    run(api_client)
    assert state.writes == ["patch configuration"]
    bundle = base64.b64decode(state.configuration["webhooks"][0]["clientConfig"]["caBundle"])
    assert bundle == new_ca


def test_validity_must_exceed_the_renewal_window(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(
        [
            "certs", "--namespace", "n", "--service", "s", "--secret", "t",
            "--webhook-configuration", "w", "--days", "30", "--renew-days", "30",
        ]
    )  # fmt: skip
    assert code == 2
    assert "--days 30 must exceed --renew-days 30" in capsys.readouterr().err


def test_without_a_cluster_it_fails_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text("apiVersion: v1\nkind: Config\nclusters: []\ncontexts: []\n")
    code = main(
        [
            "certs", "--namespace", "n", "--service", "s", "--secret", "t",
            "--webhook-configuration", "w", "--kubeconfig", str(kubeconfig),
        ]
    )  # fmt: skip
    assert code == 1
    err = capsys.readouterr().err
    assert err.startswith("kubevirt-iommufd certs: ") and err.count("\n") == 1
