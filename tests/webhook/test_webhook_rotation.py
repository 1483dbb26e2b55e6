"""Certificate rotation: new handshakes get the new pair, open connections carry on undisturbed."""

from __future__ import annotations

import http.client
import logging
import ssl
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import trustme

import webhook.tls
from webhook.config import Config
from webhook.tls import CertificateReloader
from webhook_kit import (
    RunningServer,
    Tls,
    admission_review,
    admit,
    get,
    https,
    load,
    make_tls,
    running_server,
)


@pytest.fixture
def tls(tmp_path: Path) -> Tls:
    return make_tls(tmp_path)


@pytest.fixture
def server(tls: Tls) -> Iterator[RunningServer]:
    with running_server(Config(), tls, reload_interval=0.05) as running:
        yield running


def file_der(path: Path) -> bytes:
    """The DER of the first certificate in a PEM file: what a handshake shows the client."""
    return ssl.PEM_cert_to_DER_cert(path.read_text())


def peer_der(conn: http.client.HTTPSConnection) -> bytes:
    assert isinstance(conn.sock, ssl.SSLSocket)
    der = conn.sock.getpeercert(binary_form=True)
    assert der is not None
    return der


def handshake_der(server: RunningServer, tls: Tls) -> bytes:
    conn = https(server, tls)
    conn.connect()
    try:
        return peer_der(conn)
    finally:
        conn.close()


def eventually(condition: Callable[[], bool], seconds: float = 5.0) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.02)
    return False


def reloads(server: RunningServer, result: str) -> float:
    _, metrics = get(server.health_port, "/metrics")
    prefix = f'kubevirt_iommufd_webhook_certificate_reloads_total{{result="{result}"}} '
    lines = [line for line in metrics.splitlines() if line.startswith(prefix)]
    return float(lines[0].removeprefix(prefix)) if lines else 0.0


def test_rotation_keeps_open_connections_and_serves_the_new_cert_to_new_ones(
    server: RunningServer, tls: Tls
) -> None:
    held = https(server, tls)
    admit(held, "/mutate-pod", admission_review(load("pod-gpu.yaml")))
    old = file_der(tls.cert)
    assert peer_der(held) == old
    held_socket = held.sock

    tls.rotate()
    new = file_der(tls.cert)
    assert new != old

    assert eventually(lambda: handshake_der(server, tls) == new)
    for _ in range(3):
        admit(held, "/mutate-pod", admission_review(load("pod-gpu.yaml")))
    assert held.sock is held_socket, "the held connection was dropped and redialled"
    assert peer_der(held) == old
    assert reloads(server, "ok") == 1.0
    held.close()


def test_a_mismatched_pair_is_refused_loudly_and_the_old_cert_kept(
    server: RunningServer, tls: Tls, caplog: pytest.LogCaptureFixture
) -> None:
    old = file_der(tls.cert)
    caplog.set_level(logging.ERROR, logger="webhook.tls")

    tls.rotate(key_pem=tls.key.read_bytes())  # a new certificate published with the old key

    assert eventually(lambda: reloads(server, "failed") == 1.0)
    assert handshake_der(server, tls) == old
    assert any("certificate reload failed" in r.getMessage() for r in caplog.records)
    tls.rotate()  # the key arrives
    assert eventually(lambda: handshake_der(server, tls) == file_der(tls.cert))
    assert reloads(server, "ok") == 1.0


def test_files_briefly_missing_keep_the_current_cert(
    server: RunningServer, tls: Tls, caplog: pytest.LogCaptureFixture
) -> None:
    old = file_der(tls.cert)
    caplog.set_level(logging.WARNING, logger="webhook.tls")
    moved = tls.cert.with_suffix(".away")
    tls.cert.rename(moved)

    assert eventually(lambda: any("cannot stat" in r.getMessage() for r in caplog.records))
    assert handshake_der(server, tls) == old
    moved.rename(tls.cert)
    assert reloads(server, "failed") == 0.0


def write_pair(issued: trustme.LeafCert, cert: Path | None, key: Path | None) -> None:
    """Replace the files one by one (new inodes), as a non-atomic writer does."""
    for path, blob in (
        (cert, b"".join(p.bytes() for p in issued.cert_chain_pems)),
        (key, issued.private_key_pem.bytes()),
    ):
        if path is not None:
            fresh = path.with_suffix(".new")
            fresh.write_bytes(blob)
            fresh.replace(path)


@pytest.mark.parametrize("key_lands", ["before-the-load", "after-a-failed-load"])
def test_a_pair_replaced_while_it_is_being_loaded_is_reloaded_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, key_lands: str
) -> None:
    # The flaky rotation test's race, made deterministic: a check sees the new certificate with
    # the old key, and the new key lands while that check is loading the files.
    ca = trustme.CA()
    cert, key = tmp_path / "tls.crt", tmp_path / "tls.key"
    write_pair(ca.issue_cert("127.0.0.1"), cert, key)
    results: list[bool] = []
    reloader = CertificateReloader(cert, key, results.append)
    rotated = ca.issue_cert("127.0.0.1")
    write_pair(rotated, cert, None)
    load = webhook.tls.build_server_context

    def racing_load(cert_path: Path, key_path: Path) -> ssl.SSLContext:
        monkeypatch.setattr(webhook.tls, "build_server_context", load)
        if key_lands == "before-the-load":
            write_pair(rotated, None, key)
            return load(cert_path, key_path)
        try:
            return load(cert_path, key_path)
        finally:
            write_pair(rotated, None, key)

    monkeypatch.setattr(webhook.tls, "build_server_context", racing_load)
    for _ in range(3):
        reloader.check()

    assert results == [True]
