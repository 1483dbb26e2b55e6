"""The connection the DRA driver's calls go through, made from a kubeconfig or a pod's service
account and used against the API server stand-in over real HTTPS: the CA checked, the token
sent and re-read as the kubelet rotates it, client certificates presented, the official client
loaded only for what needs it."""

from __future__ import annotations

import base64
import json
import logging
import os
import ssl
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import trustme
import urllib3
from cryptography.hazmat.primitives import serialization

import sim.apiserver
from hostdev.labels.kube_connection import (
    ApiConfigError,
    KubeConnection,
    build_in_cluster_server,
    connect,
    load_kube_connection,
    read_in_cluster_access,
)
from sim.apiserver import ApiServerStandIn, running_apiserver
from sim.apiserver_http import build_server_context
from webhook.certs import build_serving_certificate

NODE = "node-1"


@pytest.fixture
def apiserver() -> Iterator[ApiServerStandIn]:
    with running_apiserver() as api:
        api.put_node(NODE)
        yield api


def get_node(connection: KubeConnection) -> int:
    """The status of a GET of the node through `connection`."""
    response = connection.pool.request(
        "GET",
        f"{connection.server}/api/v1/nodes/{NODE}",
        headers=connection.headers(),
        retries=False,
    )
    return response.status


def write_kubeconfig(
    path: Path, apiserver: ApiServerStandIn, cluster: dict[str, Any], user: dict[str, Any]
) -> Path:
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "k", "cluster": {"server": apiserver.url, **cluster}}],
        "users": [{"name": "u", "user": user}],
        "contexts": [{"name": "c", "context": {"cluster": "k", "user": "u"}}],
        "current-context": "c",
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(config))
    return path


def ca_data(apiserver: ApiServerStandIn) -> dict[str, str]:
    assert apiserver.ca_pem is not None
    return {"certificate-authority-data": base64.b64encode(apiserver.ca_pem).decode()}


def test_the_stand_ins_own_kubeconfig_reaches_it_with_the_token(
    apiserver: ApiServerStandIn, tmp_path: Path
) -> None:
    connection = load_kube_connection(apiserver.write_kubeconfig(tmp_path / "kubeconfig"))
    assert connection.server == apiserver.url
    assert get_node(connection) == 200
    request = apiserver.requests[-1]
    assert (request.method, request.path, request.status) == ("GET", f"/api/v1/nodes/{NODE}", 200)


def test_a_kubeconfig_without_a_token_is_refused_by_the_server(
    apiserver: ApiServerStandIn, tmp_path: Path
) -> None:
    kubeconfig = write_kubeconfig(tmp_path / "kubeconfig", apiserver, ca_data(apiserver), {})
    assert get_node(load_kube_connection(kubeconfig)) == 401


def test_relative_files_are_found_beside_the_kubeconfig(
    apiserver: ApiServerStandIn, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert apiserver.ca_pem is not None
    (tmp_path / "conf" / "pki").mkdir(parents=True)
    (tmp_path / "conf" / "pki" / "ca.crt").write_bytes(apiserver.ca_pem)
    (tmp_path / "conf" / "token").write_text(apiserver.token + "\n")
    kubeconfig = write_kubeconfig(
        tmp_path / "conf" / "kubeconfig",
        apiserver,
        {"certificate-authority": "pki/ca.crt"},
        {"tokenFile": "token"},
    )
    monkeypatch.chdir("/")
    assert get_node(load_kube_connection(kubeconfig)) == 200


def test_tls_is_verified_unless_the_kubeconfig_says_otherwise(
    apiserver: ApiServerStandIn, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Without its CA, the stand-in's certificate is refused; with insecure-skip-tls-verify the
    call goes through, and the start says what that means."""
    token = {"token": apiserver.token}
    unverified = load_kube_connection(write_kubeconfig(tmp_path / "a", apiserver, {}, token))
    with pytest.raises(urllib3.exceptions.SSLError, match="CERTIFICATE_VERIFY_FAILED"):
        get_node(unverified)
    insecure = {"insecure-skip-tls-verify": True}
    with caplog.at_level(logging.WARNING):
        connection = load_kube_connection(
            write_kubeconfig(tmp_path / "b", apiserver, insecure, token)
        )
    assert "the API server's certificate is not checked" in caplog.text
    with pytest.warns(urllib3.exceptions.InsecureRequestWarning):
        assert get_node(connection) == 200


@pytest.fixture
def named_apiserver(monkeypatch: pytest.MonkeyPatch) -> Iterator[ApiServerStandIn]:
    """A stand-in whose certificate also names api.cluster.test, as a server behind an address
    its certificate does not name would."""
    monkeypatch.setattr(
        sim.apiserver,
        "build_serving_certificate",
        lambda names: build_serving_certificate(["api.cluster.test"]),
    )
    with running_apiserver() as api:
        api.put_node(NODE)
        yield api


@pytest.mark.parametrize(("name", "works"), [("api.cluster.test", True), ("other.test", False)])
def test_tls_server_name_is_the_name_checked(
    named_apiserver: ApiServerStandIn, tmp_path: Path, name: str, works: bool
) -> None:
    cluster = {**ca_data(named_apiserver), "tls-server-name": name}
    token = {"token": named_apiserver.token}
    connection = load_kube_connection(
        write_kubeconfig(tmp_path / "kubeconfig", named_apiserver, cluster, token)
    )
    if works:
        assert get_node(connection) == 200
    else:
        with pytest.raises(urllib3.exceptions.SSLError, match="CERTIFICATE_VERIFY_FAILED"):
            get_node(connection)


@pytest.fixture
def client_ca() -> trustme.CA:
    return trustme.CA()


@pytest.fixture
def mtls_apiserver(
    client_ca: trustme.CA, monkeypatch: pytest.MonkeyPatch
) -> Iterator[ApiServerStandIn]:
    """A stand-in that completes a TLS handshake only with a client certificate of `client_ca`."""

    def requiring_client_certificates(cert_pem: bytes, key_pem: bytes) -> ssl.SSLContext:
        context = build_server_context(cert_pem, key_pem)
        context.verify_mode = ssl.CERT_REQUIRED
        context.load_verify_locations(cadata=client_ca.cert_pem.bytes().decode())
        return context

    monkeypatch.setattr(sim.apiserver, "build_server_context", requiring_client_certificates)
    with running_apiserver() as api:
        api.put_node(NODE)
        yield api


@pytest.mark.parametrize("given_as", ["files", "data"])
def test_a_client_certificate_is_presented(
    mtls_apiserver: ApiServerStandIn, client_ca: trustme.CA, tmp_path: Path, given_as: str
) -> None:
    leaf = client_ca.issue_cert("node-1.test", common_name="system:node:node-1")
    cert, key = leaf.cert_chain_pems[0].bytes(), leaf.private_key_pem.bytes()
    if given_as == "files":
        (tmp_path / "client.crt").write_bytes(cert)
        (tmp_path / "client.key").write_bytes(key)
        user = {"client-certificate": "client.crt", "client-key": "client.key"}
    else:
        user = {
            "client-certificate-data": base64.b64encode(cert).decode(),
            "client-key-data": base64.b64encode(key).decode(),
        }
    user["token"] = mtls_apiserver.token
    cluster = ca_data(mtls_apiserver)
    connection = load_kube_connection(
        write_kubeconfig(tmp_path / "kubeconfig", mtls_apiserver, cluster, user)
    )
    assert get_node(connection) == 200
    # Data never reaches a file: TLS reads it from memory.
    held = [str(Path(f"/proc/self/fd/{file.fileno()}").readlink()) for file in connection.held]
    assert all(target.startswith("/memfd:") for target in held)
    assert len(held) == (2 if given_as == "data" else 0)
    without = load_kube_connection(
        write_kubeconfig(tmp_path / "plain", mtls_apiserver, cluster, {"token": user["token"]})
    )
    with pytest.raises((urllib3.exceptions.SSLError, urllib3.exceptions.ProtocolError)):
        get_node(without)


def service_account(directory: Path, token: str, ca_pem: bytes) -> Path:
    """A service account volume as the kubelet writes it: each file a link through `..data` to
    a timestamped directory, replaced whole by swapping the `..data` link."""
    directory.mkdir(parents=True, exist_ok=True)
    swap_service_account(directory, token, ca_pem, "..2026_01_01_00_00_00.000000001")
    for name in ("token", "ca.crt"):
        (directory / name).symlink_to(f"..data/{name}")
    return directory


def swap_service_account(directory: Path, token: str, ca_pem: bytes, version: str) -> None:
    (directory / version).mkdir()
    (directory / version / "token").write_text(token)
    (directory / version / "ca.crt").write_bytes(ca_pem)
    (directory / "..data_tmp").symlink_to(version)
    (directory / "..data_tmp").rename(directory / "..data")


def in_cluster_environ(apiserver: ApiServerStandIn) -> dict[str, str]:
    return {
        "KUBERNETES_SERVICE_HOST": apiserver.host,
        "KUBERNETES_SERVICE_PORT": str(apiserver.port),
    }


def test_in_a_pod_the_service_account_reaches_the_server(
    apiserver: ApiServerStandIn, tmp_path: Path
) -> None:
    assert apiserver.ca_pem is not None
    account = service_account(tmp_path / "sa", apiserver.token, apiserver.ca_pem)
    connection = connect(read_in_cluster_access(in_cluster_environ(apiserver), account))
    assert connection.server == f"https://127.0.0.1:{apiserver.port}"
    assert get_node(connection) == 200


def test_a_rotated_token_is_read_again_after_the_refresh_period(
    apiserver: ApiServerStandIn, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The kubelet swaps the token; the server takes only the new one from then on. The old one
    is sent until the period has passed, then the new one, read from the file."""
    assert apiserver.ca_pem is not None
    account = service_account(tmp_path / "sa", apiserver.token, apiserver.ca_pem)
    access = read_in_cluster_access(in_cluster_environ(apiserver), account)
    connection = connect(access, token_refresh_seconds=0.5)
    assert get_node(connection) == 200
    old = apiserver.token
    apiserver.token = "rotated-" + old
    swap_service_account(account, apiserver.token, apiserver.ca_pem, "..2026_01_01_00_10_00.0")
    assert get_node(connection) == 401
    assert apiserver.wait_until(lambda: get_node(connection) == 200)
    # A token file gone (or unreadable) at the next re-read: the token read before stays.
    (account / "..data").unlink()
    with caplog.at_level(logging.WARNING):
        assert apiserver.wait_until(
            lambda: get_node(connection) == 200 and "the token read before is kept" in caplog.text
        )
    assert apiserver.token not in caplog.text
    assert f"cannot read the token file {account / 'token'}: No such file" in caplog.text


@pytest.mark.parametrize(
    ("host", "port", "server"),
    [
        ("10.96.0.1", "443", "https://10.96.0.1:443"),
        ("fd00:10:96::1", "443", "https://[fd00:10:96::1]:443"),
        ("fe80::1%eth0", "6443", "https://[fe80::1%eth0]:6443"),
        ("kubernetes.default.svc", "443", "https://kubernetes.default.svc:443"),
    ],
    ids=["ipv4", "ipv6", "ipv6-zone", "name"],
)
def test_the_in_cluster_server_brackets_an_ipv6_address(host: str, port: str, server: str) -> None:
    assert build_in_cluster_server(host, port) == server


@pytest.mark.parametrize("port", ["https", "0", "65536", "-1"])
def test_an_in_cluster_port_that_is_no_port_is_refused(port: str) -> None:
    with pytest.raises(ApiConfigError, match=f"KUBERNETES_SERVICE_PORT '{port}' is not a port"):
        build_in_cluster_server("10.96.0.1", port)


def test_outside_a_pod_without_a_kubeconfig_says_so() -> None:
    with pytest.raises(ApiConfigError) as caught:
        load_kube_connection(None, environ={"KUBERNETES_SERVICE_HOST": "10.96.0.1"})
    assert str(caught.value) == (
        "not in a pod: KUBERNETES_SERVICE_HOST and KUBERNETES_SERVICE_PORT are not set"
    )


SECRET = "do-not-show-this-token"  # noqa: S105 - what no message may show


def encrypted(key_pem: bytes) -> bytes:
    key = serialization.load_pem_private_key(key_pem, None)
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.BestAvailableEncryption(b"password"),
    )


@pytest.mark.parametrize(
    ("files", "cluster", "user", "message"),
    [
        (
            {},
            {"certificate-authority": "ca.crt"},
            {},
            "cannot read certificate-authority {dir}/ca.crt: No such file or directory",
        ),
        (
            {"ca.crt": b"not a certificate"},
            {"certificate-authority": "ca.crt"},
            {},
            "certificate-authority {dir}/ca.crt holds no PEM certificate",
        ),
        (
            {},
            {"certificate-authority-data": base64.b64encode(b"not a certificate").decode()},
            {},
            "certificate-authority-data holds no PEM certificate",
        ),
        (
            {},
            {},
            {"tokenFile": "token"},
            "cannot read the token file {dir}/token: No such file or directory",
        ),
        ({"token": b" \n"}, {}, {"tokenFile": "token"}, "the token file {dir}/token is empty"),
        (
            {"token": SECRET.encode() + b"\n" + SECRET.encode()},
            {},
            {"tokenFile": "token"},
            "the token file {dir}/token holds characters no bearer token has (spaces, line"
            " breaks or beyond ASCII): is it the right file?",
        ),
        (
            {},
            {},
            {"token": f"{SECRET} {SECRET}"},
            "the kubeconfig's token holds characters no bearer token has",
        ),
        (
            {"c.crt": "cert", "c.key": "other-key"},
            {},
            {"client-certificate": "c.crt", "client-key": "c.key"},
            "client-certificate {dir}/c.crt and client-key {dir}/c.key: not a PEM certificate"
            " and its private key (KEY_VALUES_MISMATCH)",
        ),
        (
            {"c.crt": "cert", "c.key": "encrypted-key"},
            {},
            {"client-certificate": "c.crt", "client-key": "c.key"},
            "client-certificate {dir}/c.crt and client-key {dir}/c.key: the key is encrypted;"
            " give it unencrypted",
        ),
        (
            {"c.crt": "cert"},
            {},
            {"client-certificate": "c.crt", "client-key": "c.key"},
            "cannot read client-certificate {dir}/c.crt and client-key {dir}/c.key: No such"
            " file or directory",
        ),
    ],
    ids=[
        "ca-missing",
        "ca-not-pem",
        "ca-data-not-pem",
        "token-file-missing",
        "token-file-empty",
        "token-file-two-lines",
        "token-with-space",
        "key-of-another-certificate",
        "key-encrypted",
        "key-missing",
    ],
)
def test_a_connection_that_cannot_be_made_is_refused_at_load_naming_the_file(
    apiserver: ApiServerStandIn,
    tmp_path: Path,
    files: dict[str, Any],
    cluster: dict[str, Any],
    user: dict[str, Any],
    message: str,
) -> None:
    ca = trustme.CA()
    leaf, other = ca.issue_cert("a"), ca.issue_cert("b")
    made = {
        "cert": leaf.cert_chain_pems[0].bytes(),
        "other-key": other.private_key_pem.bytes(),
        "encrypted-key": encrypted(leaf.private_key_pem.bytes()),
    }
    for name, content in files.items():
        (tmp_path / name).write_bytes(made[content] if isinstance(content, str) else content)
    kubeconfig = write_kubeconfig(tmp_path / "kubeconfig", apiserver, cluster, user)
    with pytest.raises(ApiConfigError) as caught:
        load_kube_connection(kubeconfig)
    assert str(caught.value).startswith(message.format(dir=tmp_path))
    assert SECRET not in str(caught.value)


def test_an_unreadable_kubeconfig_is_named(tmp_path: Path) -> None:
    with pytest.raises(ApiConfigError) as caught:
        load_kube_connection(tmp_path / "missing")
    assert str(caught.value) == (
        f"cannot read kubeconfig {tmp_path / 'missing'}: No such file or directory"
    )
    (tmp_path / "bad").write_text("clusters: [\n")
    with pytest.raises(ApiConfigError, match=f"kubeconfig {tmp_path / 'bad'}"):
        load_kube_connection(tmp_path / "bad")
    (tmp_path / "empty").write_text("{}\n")
    with pytest.raises(ApiConfigError) as caught:
        load_kube_connection(tmp_path / "empty")
    assert str(caught.value) == (
        f"kubeconfig {tmp_path / 'empty'}: no current-context: set one (kubectl config"
        " use-context NAME --kubeconfig FILE)"
    )


def test_an_exec_plugin_is_run_by_the_official_client(
    apiserver: ApiServerStandIn, tmp_path: Path
) -> None:
    credential = {
        "apiVersion": "client.authentication.k8s.io/v1",
        "kind": "ExecCredential",
        "status": {"token": apiserver.token},
    }
    plugin = {
        "apiVersion": "client.authentication.k8s.io/v1",
        "command": sys.executable,
        "args": ["-c", f"print({json.dumps(json.dumps(credential))})"],
        "interactiveMode": "Never",
    }
    kubeconfig = write_kubeconfig(
        tmp_path / "kubeconfig", apiserver, ca_data(apiserver), {"exec": plugin}
    )
    assert get_node(load_kube_connection(kubeconfig)) == 200


def test_a_proxy_in_the_environment_is_left_to_the_official_client(
    apiserver: ApiServerStandIn, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HTTPS_PROXY", "http://127.0.0.1:9")
    connection = load_kube_connection(apiserver.write_kubeconfig(tmp_path / "kubeconfig"))
    assert type(connection.pool) is urllib3.ProxyManager
    assert connection.server == apiserver.url
    assert connection.headers()["Authorization"] == f"Bearer {apiserver.token}"


def test_the_official_client_is_not_loaded_for_a_plain_kubeconfig(
    apiserver: ApiServerStandIn, tmp_path: Path
) -> None:
    kubeconfig = apiserver.write_kubeconfig(tmp_path / "kubeconfig")
    script = (
        "import sys\n"
        "from pathlib import Path\n"
        "from hostdev.labels.kube_connection import load_kube_connection\n"
        f"connection = load_kube_connection(Path({str(kubeconfig)!r}))\n"
        f"status = connection.pool.request('GET', connection.server + '/api/v1/nodes/{NODE}',"
        " headers=connection.headers()).status\n"
        "heavy = ('kubernetes', 'requests', 'oauthlib')\n"
        "print(status, sorted(m for m in heavy if m in sys.modules))\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.lower().endswith("_proxy")}
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=env, check=False
    )
    assert done.stdout == "200 []\n", done.stderr
