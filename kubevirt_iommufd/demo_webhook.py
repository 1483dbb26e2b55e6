"""The real webhook over HTTPS for the demo: one AdmissionReview posted as the API server posts
it, the JSON patch of the answer decoded, and applied as the API server applies it."""

from __future__ import annotations

import asyncio
import base64
import copy
import http.client
import json
import ssl
import tempfile
import uuid
from pathlib import Path
from typing import Any

from webhook.certs import build_serving_certificate
from webhook.config import Config
from webhook.server import WebhookServer

Object = dict[str, Any]
Patch = list[Object]
KINDS = {
    "/mutate-pod": ({"group": "", "version": "v1", "kind": "Pod"}, "pods"),
    "/mutate-vmi": (
        {"group": "kubevirt.io", "version": "v1", "kind": "VirtualMachineInstance"},
        "virtualmachineinstances",
    ),
}


def admit(config: Config, path: str, obj: Object, namespace: str = "demo") -> Patch:
    """The patch the webhook answers for a CREATE of `obj` posted to `path`."""
    return asyncio.run(_admit(config, path, obj, namespace))


def apply_patch(obj: Object, patch: Patch) -> Object:
    """`obj` with the webhook's `add` and `replace` operations (the only ones it sends) applied,
    as the API server applies an RFC 6902 patch."""
    patched = copy.deepcopy(obj)
    for operation in patch:
        if operation["op"] not in ("add", "replace"):
            raise ValueError(f"the webhook sends no {operation['op']!r} operation")
        *parents, last = [
            p.replace("~1", "/").replace("~0", "~") for p in operation["path"].split("/")[1:]
        ]
        target: Any = patched
        for part in parents:
            target = target[int(part)] if isinstance(target, list) else target[part]
        target[last] = operation["value"]
    return patched


async def _admit(config: Config, path: str, obj: Object, namespace: str) -> Patch:
    certificate = build_serving_certificate(["127.0.0.1"])
    kind, resource = KINDS[path]
    with tempfile.TemporaryDirectory(prefix="kid-tls-") as tls:
        cert, key = Path(tls) / "tls.crt", Path(tls) / "tls.key"
        cert.write_bytes(certificate.cert_pem)
        key.write_bytes(certificate.key_pem)
        server = WebhookServer(config, cert, key, port=0, health_port=0, host="127.0.0.1")
        await server.start()
        try:
            review = {
                "apiVersion": "admission.k8s.io/v1",
                "kind": "AdmissionReview",
                "request": {
                    "uid": str(uuid.uuid4()),
                    "kind": kind,
                    "resource": {**kind, "resource": resource},
                    "namespace": namespace,
                    "operation": "CREATE",
                    "object": obj,
                },
            }
            body = json.dumps(review).encode()
            answer = await asyncio.to_thread(_post, server.port, certificate.ca_pem, path, body)
        finally:
            await server.stop()
    response = answer["response"]
    if "patch" not in response:
        return []
    patch: Patch = json.loads(base64.b64decode(response["patch"]))
    return patch


def _post(port: int, ca_pem: bytes, path: str, body: bytes) -> Object:
    context = ssl.create_default_context(cadata=ca_pem.decode())
    connection = http.client.HTTPSConnection("127.0.0.1", port, context=context, timeout=10)
    try:
        connection.request("POST", path, body, headers={"Content-Type": "application/json"})
        answer: Object = json.loads(connection.getresponse().read())
        return answer
    finally:
        connection.close()
