"""Webhook test helpers: manifests, AdmissionReviews, patches, a live server and a client."""

from __future__ import annotations

import asyncio
import base64
import copy
import http.client
import json
import socket
import ssl
import threading
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import h11
import jsonpatch
import trustme
import yaml
from kubernetes.client import ApiClient, V1Pod, V1ResourceRequirements

from webhook.config import Config
from webhook.connections import Limits
from webhook.server import ADMISSION_LIMITS, WebhookServer

DATA = Path(__file__).parent / "data"
IOMMUFD = "devices.kubevirt.io/iommufd"
CONTROLLER = "system:serviceaccount:kubevirt:kubevirt-controller"

Json = dict[str, Any]


def load(name: str) -> Json:
    """A manifest from tests/webhook/data, as the API server would send it (JSON types)."""
    document = yaml.safe_load((DATA / name).read_text(encoding="utf-8"))
    assert isinstance(document, dict)
    return document


def admission_review(
    obj: object,
    *,
    kind: str = "Pod",
    operation: str = "CREATE",
    namespace: str | None = None,
    uid: str | None = None,
) -> Json:
    """An AdmissionReview v1 request as kube-apiserver sends it for a CREATE by virt-controller."""
    group, version, resource = {
        "Pod": ("", "v1", "pods"),
        "VirtualMachineInstance": ("kubevirt.io", "v1", "virtualmachineinstances"),
    }[kind]
    if namespace is None:
        metadata = obj.get("metadata", {}) if isinstance(obj, dict) else {}
        namespace = metadata.get("namespace", "default") if isinstance(metadata, dict) else ""
    gvk = {"group": group, "version": version, "kind": kind}
    gvr = {"group": group, "version": version, "resource": resource}
    return {
        "apiVersion": "admission.k8s.io/v1",
        "kind": "AdmissionReview",
        "request": {
            "uid": uid or str(uuid.uuid4()),
            "kind": gvk,
            "resource": gvr,
            "requestKind": gvk,
            "requestResource": gvr,
            "name": "",
            "namespace": namespace,
            "operation": operation,
            "userInfo": {
                "username": CONTROLLER,
                "uid": "4d2c1e8f-0b7a-4f6e-9c3d-8a5b2e1f7c60",
                "groups": [
                    "system:serviceaccounts",
                    "system:serviceaccounts:kubevirt",
                    "system:authenticated",
                ],
            },
            "object": obj,
            "oldObject": None,
            "dryRun": False,
            "options": {"apiVersion": "meta.k8s.io/v1", "kind": "CreateOptions"},
        },
    }


def decode_patch(response: Json) -> list[Json]:
    """The RFC 6902 operations of an AdmissionReview response (none when it has no patch)."""
    answer = response["response"]
    if "patch" not in answer:
        assert "patchType" not in answer
        return []
    assert answer["patchType"] == "JSONPatch"
    operations = json.loads(base64.b64decode(answer["patch"], validate=True))
    assert isinstance(operations, list)
    return operations


def apply_patch(obj: Json, response: Json) -> Json:
    """The object after the response's patch, applied as the API server would (RFC 6902)."""
    patched = jsonpatch.JsonPatch(decode_patch(response)).apply(copy.deepcopy(obj))
    assert isinstance(patched, dict)
    return patched


def as_v1_pod(pod: Json) -> V1Pod:
    """The pod through the kubernetes client's models, which refuse missing required fields."""
    model = ApiClient().deserialize(json.dumps(pod), "V1Pod", "application/json")
    assert isinstance(model, V1Pod)
    return model


def model_resources(pod: V1Pod, name: str) -> tuple[dict[str, str], dict[str, str]]:
    """Limits and requests of container `name` in a V1Pod model."""
    assert pod.spec is not None
    (found,) = [c for c in pod.spec.containers if c.name == name]
    resources = found.resources
    assert isinstance(resources, V1ResourceRequirements)
    return dict(resources.limits or {}), dict(resources.requests or {})


def model_container_names(pod: V1Pod) -> list[str]:
    assert pod.spec is not None
    return [c.name for c in pod.spec.containers]


def container(pod: Json, name: str) -> Json:
    matches = [c for c in pod["spec"]["containers"] if c["name"] == name]
    assert len(matches) == 1
    found = matches[0]
    assert isinstance(found, dict)
    return found


@dataclass
class Tls:
    """A test CA and the server's certificate and key files, reissued by `rotate()`.

    The files are laid out as the kubelet mounts a Secret: `tls.crt` and `tls.key` are symlinks
    into `..data`, itself a symlink to a directory of one version, so a rotation switches both
    files in one rename, as it does in a pod.
    """

    ca: trustme.CA
    cert: Path
    key: Path
    versions: int = 0

    def rotate(self, key_pem: bytes | None = None) -> None:
        """Publish a new pair atomically; `key_pem` replaces its key (to publish a bad pair)."""
        issued = self.ca.issue_cert("127.0.0.1", "localhost")
        directory = self.cert.parent
        self.versions += 1
        version = directory / f"..v{self.versions}"
        version.mkdir()
        (version / self.cert.name).write_bytes(b"".join(p.bytes() for p in issued.cert_chain_pems))
        (version / self.key.name).write_bytes(key_pem or issued.private_key_pem.bytes())
        staged = directory / "..data_tmp"
        staged.symlink_to(version.name)
        staged.replace(directory / "..data")
        for path in (self.cert, self.key):
            if not path.is_symlink():
                path.symlink_to(Path("..data") / path.name)

    def client_context(self) -> ssl.SSLContext:
        context = ssl.create_default_context()
        self.ca.configure_trust(context)
        return context


def make_tls(directory: Path) -> Tls:
    tls = Tls(trustme.CA(), directory / "tls.crt", directory / "tls.key")
    tls.rotate()
    return tls


@dataclass
class RunningServer:
    server: WebhookServer
    loop: asyncio.AbstractEventLoop

    @property
    def port(self) -> int:
        return self.server.port

    @property
    def health_port(self) -> int:
        return self.server.health_port


@contextmanager
def running_server(
    config: Config, tls: Tls, *, reload_interval: float = 0.05, limits: Limits = ADMISSION_LIMITS
) -> Iterator[RunningServer]:
    """A WebhookServer on loopback ports chosen by the kernel, its loop in a thread."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    server = WebhookServer(
        config,
        tls.cert,
        tls.key,
        port=0,
        health_port=0,
        host="127.0.0.1",
        reload_interval=reload_interval,
        limits=limits,
    )
    asyncio.run_coroutine_threadsafe(server.start(), loop).result(timeout=10)
    try:
        yield RunningServer(server, loop)
    finally:
        asyncio.run_coroutine_threadsafe(server.stop(), loop).result(timeout=10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=10)
        loop.close()


def https(server: RunningServer, tls: Tls) -> http.client.HTTPSConnection:
    """A keep-alive HTTPS connection to the admission port, trusting only the test CA."""
    return http.client.HTTPSConnection(
        "127.0.0.1", server.port, context=tls.client_context(), timeout=10
    )


def post(
    conn: http.client.HTTPConnection,
    path: str,
    body: bytes,
    content_type: str = "application/json",
) -> tuple[int, bytes, http.client.HTTPResponse]:
    conn.request("POST", path, body=body, headers={"Content-Type": content_type})
    response = conn.getresponse()
    return response.status, response.read(), response


def admit(conn: http.client.HTTPConnection, path: str, review: Json) -> Json:
    """POST a review, expect 200 with an AdmissionReview answering its uid."""
    status, body, response = post(conn, path, json.dumps(review).encode())
    assert status == 200, body
    assert response.getheader("Content-Type") == "application/json"
    answer = json.loads(body)
    assert isinstance(answer, dict)
    assert answer["response"]["uid"] == review["request"]["uid"]
    return answer


def get(port: int, path: str) -> tuple[int, str]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        conn.request("GET", path)
        response = conn.getresponse()
        return response.status, response.read().decode()
    finally:
        conn.close()


def raw_tls(server: RunningServer, tls: Tls) -> ssl.SSLSocket:
    """A bare TLS socket to the admission port, for exchanges http.client cannot make."""
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=10)
    return tls.client_context().wrap_socket(sock, server_hostname="127.0.0.1")


def request_bytes(path: str, body: bytes, *extra: tuple[str, str]) -> bytes:
    client = h11.Connection(h11.CLIENT)
    headers = [
        ("host", "127.0.0.1"),
        ("content-type", "application/json"),
        ("content-length", str(len(body))),
        *extra,
    ]
    head = client.send(h11.Request(method="POST", target=path, headers=headers))
    return (head or b"") + body


def read_responses(sock: ssl.SSLSocket, count: int) -> list[tuple[int, bytes]]:
    """Read `count` responses from `sock`, informational (1xx) ones included."""
    client = h11.Connection(h11.CLIENT)
    _pretend_request(client)
    responses: list[tuple[int, bytes]] = []
    status = 0
    body = b""
    while len(responses) < count:
        event = client.next_event()
        if event is h11.NEED_DATA:
            client.receive_data(sock.recv(65536))
        elif isinstance(event, h11.InformationalResponse):
            responses.append((event.status_code, b""))
        elif isinstance(event, h11.Response):
            status = event.status_code
        elif isinstance(event, h11.Data):
            body += event.data
        elif isinstance(event, h11.EndOfMessage):
            responses.append((status, body))
            body = b""
            if len(responses) < count:
                client.start_next_cycle()
                _pretend_request(client)
    return responses


def _pretend_request(client: h11.Connection) -> None:
    # h11 parses a response only after it has seen the request go out; the real one went raw.
    client.send(
        h11.Request(method="POST", target="/", headers=[("host", "x"), ("content-length", "0")])
    )
    client.send(h11.EndOfMessage())
