"""A kubeconfig's current context read as client-go reads it; whatever is wrong is named with the
fix, and no message repeats a value of the file."""

from __future__ import annotations

import base64
from pathlib import Path
from typing import Any

import pytest

from hostdev.labels.kubeconfig import ApiConfigError, ClusterAccess, OfficialOnly, parse_kubeconfig

HERE = Path("/etc/kube")
SECRET = "s3cr3t-t0ken"  # noqa: S105 - what no message may show


def kubeconfig(
    cluster: dict[str, Any] | None = None, user: dict[str, Any] | None = None, **top: Any
) -> dict[str, Any]:
    """A kubeconfig of one context `c` on cluster `k` as user `u`, changed by the arguments."""
    document: dict[str, Any] = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [
            {"name": "k", "cluster": {"server": "https://10.0.0.1:6443", **(cluster or {})}}
        ],
        "users": [{"name": "u", "user": {"token": SECRET, **(user or {})}}],
        "contexts": [{"name": "c", "context": {"cluster": "k", "user": "u"}}],
        "current-context": "c",
    }
    return {**document, **top}


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


@pytest.mark.parametrize(
    ("document", "expected"),
    [
        (kubeconfig(), ClusterAccess("https://10.0.0.1:6443", token=SECRET)),
        (
            kubeconfig({"server": "https://api.example:443/k8s/clusters/c-1/"}),
            ClusterAccess("https://api.example:443/k8s/clusters/c-1", token=SECRET),
        ),
        (
            kubeconfig(
                {"certificate-authority": "pki/ca.crt", "tls-server-name": "kubernetes"},
                {"tokenFile": "token", "token": "ignored"},
            ),
            ClusterAccess(
                "https://10.0.0.1:6443",
                ca=HERE / "pki/ca.crt",
                tls_server_name="kubernetes",
                token=HERE / "token",
            ),
        ),
        (
            kubeconfig(
                {"certificate-authority": "/abs/ca.crt", "certificate-authority-data": b64(b"PEM")},
                {"token": None, "client-certificate": "/abs/c.crt", "client-key": "c.key"},
            ),
            ClusterAccess(
                "https://10.0.0.1:6443",
                ca=b"PEM",
                client_cert=Path("/abs/c.crt"),
                client_key=HERE / "c.key",
            ),
        ),
        (
            kubeconfig(
                {"insecure-skip-tls-verify": True},
                {"client-certificate-data": b64(b"C"), "client-key-data": b64(b"K"), "token": ""},
            ),
            ClusterAccess(
                "https://10.0.0.1:6443", insecure=True, client_cert=b"C", client_key=b"K"
            ),
        ),
        (
            {
                **kubeconfig(),
                "contexts": [{"name": "c", "context": {"cluster": "k"}}],
                "users": None,
            },
            ClusterAccess("https://10.0.0.1:6443"),
        ),
        (
            kubeconfig(user={"exec": {"command": "aws"}}),
            OfficialOnly("user 'u' uses an exec credential plugin"),
        ),
        (
            kubeconfig(user={"auth-provider": {"name": "oidc"}}),
            OfficialOnly("user 'u' uses an auth-provider"),
        ),
        (
            kubeconfig({"proxy-url": "http://proxy:3128"}),
            OfficialOnly("cluster 'k' is reached through a proxy (proxy-url)"),
        ),
    ],
    ids=[
        "token",
        "path-prefix-kept-trailing-slash-dropped",
        "relative-files-token-file-wins",
        "data-wins-over-file-key-relative",
        "insecure-client-cert-data",
        "no-user-anonymous",
        "exec",
        "auth-provider",
        "proxy-url",
    ],
)
def test_the_current_context_is_read_as_client_go_reads_it(
    document: dict[str, Any], expected: ClusterAccess | OfficialOnly
) -> None:
    assert parse_kubeconfig(document, HERE) == expected


def test_the_current_context_is_the_one_read() -> None:
    document = kubeconfig()
    other = {"name": "other", "cluster": {"server": "https://10.9.9.9"}}
    document["clusters"].insert(0, other)
    document["contexts"].insert(0, {"name": "o", "context": {"cluster": "other", "user": "u"}})
    assert parse_kubeconfig(document, HERE) == ClusterAccess("https://10.0.0.1:6443", token=SECRET)
    document["current-context"] = "o"
    assert parse_kubeconfig(document, HERE) == ClusterAccess("https://10.9.9.9", token=SECRET)


@pytest.mark.parametrize(
    ("document", "message"),
    [
        (["a", "list"], "the file: expected a mapping"),
        (
            {**kubeconfig(), "current-context": ""},
            "no current-context: set one (kubectl config use-context NAME --kubeconfig FILE)",
        ),
        (
            {**kubeconfig(), "current-context": "missing"},
            "current-context 'missing' names context 'missing', which is not in contexts: add"
            " it, or correct the name",
        ),
        (
            kubeconfig(contexts=[{"name": "c", "context": {"cluster": "nope", "user": "u"}}]),
            "context 'c' names cluster 'nope', which is not in clusters: add it, or correct the"
            " name",
        ),
        (
            kubeconfig(contexts=[{"name": "c", "context": {"user": "u"}}]),
            "context 'c' names no cluster: add its cluster field",
        ),
        (
            kubeconfig(contexts=[{"name": "c", "context": {"cluster": "k", "user": "who"}}]),
            "context 'c' names user 'who', which is not in users: add it, or correct the name",
        ),
        (kubeconfig(clusters={"k": {}}), "clusters: expected a list of {name, cluster} entries"),
        (kubeconfig(clusters=["k"]), "clusters[0]: expected a mapping"),
        (
            kubeconfig({"server": "10.0.0.1:6443"}),
            "cluster 'k': server: expected the API server's URL, such as https://10.0.0.1:6443",
        ),
        (
            kubeconfig({"insecure-skip-tls-verify": "yes"}),
            "cluster 'k': insecure-skip-tls-verify: expected true or false",
        ),
        (
            kubeconfig({"insecure-skip-tls-verify": True, "certificate-authority": "ca.crt"}),
            "cluster 'k': insecure-skip-tls-verify with a certificate-authority: keep only one"
            " (better: the certificate authority)",
        ),
        (
            kubeconfig({"certificate-authority-data": "not base64!"}),
            "cluster 'k': certificate-authority-data is not base64: give the PEM file's content"
            " base64-encoded (base64 -w0 FILE), or its path as certificate-authority",
        ),
        (
            kubeconfig({"tls-server-name": 5}),
            "cluster 'k': tls-server-name: expected a host name",
        ),
        (
            kubeconfig(user={"client-certificate": "c.crt"}),
            "user 'u': client-certificate without client-key: give both",
        ),
        (
            kubeconfig(user={"client-key-data": b64(b"K")}),
            "user 'u': client-key without client-certificate: give both",
        ),
        (kubeconfig(user={"token": 12345}), "user 'u': token: expected a string"),
        (kubeconfig(user={"tokenFile": ["t"]}), "user 'u': tokenFile: expected a file's path"),
        (
            kubeconfig(user={"username": "admin", "password": SECRET}),
            "user 'u': username and password (basic auth) are not accepted by the API server"
            " since Kubernetes 1.19: give the user a token or a client certificate",
        ),
        (
            kubeconfig(user={"as": "system:admin", "as-groups": ["system:masters"]}),
            "user 'u': impersonation (as, as-groups) is not supported: give the driver a"
            " kubeconfig of the identity it should act as",
        ),
    ],
    ids=[
        "not-a-mapping",
        "no-current-context",
        "current-context-missing",
        "cluster-missing",
        "context-without-cluster",
        "user-missing",
        "clusters-not-a-list",
        "cluster-entry-not-a-mapping",
        "server-without-scheme",
        "insecure-not-bool",
        "insecure-and-ca",
        "ca-data-not-base64",
        "server-name-not-text",
        "cert-without-key",
        "key-without-cert",
        "token-not-text",
        "token-file-not-text",
        "basic-auth",
        "impersonation",
    ],
)
def test_what_cannot_be_used_is_named_with_its_fix(document: Any, message: str) -> None:
    with pytest.raises(ApiConfigError) as caught:
        parse_kubeconfig(document, HERE)
    assert str(caught.value) == message
    assert SECRET not in str(caught.value)
