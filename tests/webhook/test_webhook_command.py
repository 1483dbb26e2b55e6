"""`kubevirt-iommufd webhook` as a process: starts, serves, stops on SIGTERM, refuses bad input."""

from __future__ import annotations

import argparse
import http.client
import json
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from webhook import command
from webhook_kit import Tls, admission_review, decode_patch, load, make_tls, post

ROOT = Path(__file__).resolve().parents[2]
# The subcommand registered on a parser of its own, exactly as kubevirt_iommufd.cli does it.
RUN_WEBHOOK = (
    "import argparse, sys\n"
    "from webhook import command\n"
    "parser = argparse.ArgumentParser(prog='kubevirt-iommufd')\n"
    "command.add_parser(parser.add_subparsers(dest='command', required=True))\n"
    "args = parser.parse_args(sys.argv[1:])\n"
    "sys.exit(args.run(args))\n"
)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


@contextmanager
def webhook_process(*args: str) -> Iterator[subprocess.Popen[str]]:
    process = subprocess.Popen(
        [sys.executable, "-c", RUN_WEBHOOK, "webhook", *args],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        yield process
    finally:
        if process.poll() is None:
            process.kill()
        process.wait(timeout=10)


def wait_ready(port: int, process: subprocess.Popen[str]) -> None:
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        assert process.poll() is None, process.communicate()[1]
        try:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=1)
            conn.request("GET", "/readyz")
            if conn.getresponse().status == 200:
                return
        except OSError:
            time.sleep(0.05)
    pytest.fail("the webhook did not become ready in 20 s")


@pytest.fixture
def tls(tmp_path: Path) -> Tls:
    return make_tls(tmp_path)


def test_parser_defaults() -> None:
    parser = argparse.ArgumentParser()
    command.add_parser(parser.add_subparsers(dest="command"))

    args = parser.parse_args(["webhook", "--cert", "c.pem", "--key", "k.pem"])

    assert (args.port, args.health_port, args.config) == (8443, 8080, None)
    assert (args.max_connections, args.request_timeout, args.idle_timeout) == (256, 10.0, 120.0)
    assert args.run is command.run


@pytest.mark.parametrize(
    "flag",
    [
        ["--max-connections", "0"],
        ["--max-connections", "many"],
        ["--request-timeout", "0"],
        ["--idle-timeout", "-5"],
        ["--idle-timeout", "nan"],
    ],
)
def test_limits_that_would_disable_themselves_are_refused(
    flag: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    parser = argparse.ArgumentParser()
    command.add_parser(parser.add_subparsers(dest="command"))

    with pytest.raises(SystemExit):
        parser.parse_args(["webhook", "--cert", "c.pem", "--key", "k.pem", *flag])

    assert f"argument {flag[0]}: expected" in capsys.readouterr().err


def test_serves_with_a_config_until_sigterm(tls: Tls, tmp_path: Path) -> None:
    config = tmp_path / "webhook.yaml"
    config.write_text("managedResources:\n  names: [intel.com/qat_4xxx]\n")
    port, health = free_port(), free_port()
    cli = ["--cert", str(tls.cert), "--key", str(tls.key), "--config", str(config)]
    limits = ["--max-connections", "32", "--request-timeout", "2.5", "--idle-timeout", "95"]
    ports = ["--port", str(port), "--health-port", str(health)]
    with webhook_process(*cli, *limits, *ports) as process:
        wait_ready(health, process)
        conn = http.client.HTTPSConnection(
            "127.0.0.1", port, context=tls.client_context(), timeout=10
        )
        status, body, _ = post(
            conn, "/mutate-pod", json.dumps(admission_review(load("pod-hostdevice.yaml"))).encode()
        )
        conn.close()
        process.send_signal(signal.SIGTERM)
        _, stderr = process.communicate(timeout=10)

    assert status == 200
    assert decode_patch(json.loads(body)), "intel.com/qat_4xxx is managed by this config"
    assert process.returncode == 0
    assert f"serving admissions on port {port} (TLS; at most 32 connections" in stderr
    assert "request timeout 2.5 s, idle timeout 95 s" in stderr
    assert "intel.com/qat_4xxx" in stderr  # the patched pod is logged with its reason
    assert "Traceback" not in stderr


@pytest.mark.parametrize(
    ("problem", "message"),
    [
        pytest.param("config", "skip.namespace; expected one of", id="bad-config"),
        pytest.param("cert", "absent.crt: No such file or directory", id="missing-cert"),
        pytest.param("key", "the key must belong to the certificate", id="wrong-key"),
        pytest.param("port", "cannot listen on port", id="port-taken"),
    ],
)
def test_bad_input_exits_1_with_one_clear_line(
    tls: Tls, tmp_path: Path, problem: str, message: str
) -> None:
    config = tmp_path / "webhook.yaml"
    config.write_text("skip:\n  namespace: [ci]\n" if problem == "config" else "{}\n")
    cert = tmp_path / "absent.crt" if problem == "cert" else tls.cert
    key = tls.key
    if problem == "key":
        other = tmp_path / "other"
        other.mkdir()
        key = make_tls(other).key
    with socket.socket() as taken:
        taken.bind(("", 0))
        taken.listen()
        port = taken.getsockname()[1] if problem == "port" else free_port()
        args = ["--cert", str(cert), "--key", str(key), "--config", str(config)]
        with webhook_process(*args, "--port", str(port), "--health-port", "0") as process:
            _, stderr = process.communicate(timeout=20)

    assert process.returncode == 1
    assert message in stderr
    assert "Traceback" not in stderr
    assert stderr.strip().splitlines()[-1].startswith("kubevirt-iommufd webhook: error: ")
