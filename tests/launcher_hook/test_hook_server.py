"""The sidecar over a real unix socket, with a client that behaves like virt-launcher."""

from __future__ import annotations

import stat
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest
from lxml import etree

from hook_kit import (
    VERSIONS,
    HookClient,
    build_cdevs,
    build_missing_cdev_node,
    canonical,
    capabilities,
    load_domain_schema,
    read_data,
    schema_errors,
    start_hook,
    vmi_json,
    wait_for_info,
)
from launcher_hook.capabilities import LibvirtVersionSource
from launcher_hook.domain import rewrite_domain
from launcher_hook.handler import HookConfig, define_domain
from launcher_hook.model import LibvirtVersion, Policy
from launcher_hook.parse import MAX_DOMAIN_BYTES
from launcher_hook.server import HookServer

V12_9 = LibvirtVersion(12, 9, 0)
Serve = Callable[..., HookClient]


@pytest.fixture(scope="session")
def rng() -> etree.RelaxNG:
    """libvirt 12.9's schema, fetched once per session; a failure to fetch fails the tests."""
    return load_domain_schema()


@pytest.fixture
def serve(tmp_path: Path) -> Iterator[Serve]:
    """Start in-process hook servers; each call gets its own socket directory."""
    servers: list[HookServer] = []
    clients: list[HookClient] = []

    def start(
        root: Path,
        name: str = "iommufd",
        policy: Policy = Policy.AUTO,
        libvirt: LibvirtVersion | None = V12_9,
    ) -> HookClient:
        config = HookConfig(policy, root, LibvirtVersionSource(None, libvirt))
        socket = tmp_path / f"hooks-{len(servers)}" / f"{name}.sock"
        server = HookServer(socket, name, lambda xml, vmi: define_domain(xml, vmi, config))
        server.start()
        servers.append(server)
        wait_for_info(socket)
        clients.append(HookClient(socket))
        return clients[-1]

    yield start
    for client in clients:
        client.close()
    for server in servers:
        server.stop()
        server.wait()


def test_info(serve: Serve, tmp_path: Path) -> None:
    info = serve(build_cdevs(tmp_path / "node"), name="iommufd")
    result = info.info()
    assert result.name == "iommufd"
    assert list(result.versions) == ["v1alpha1", "v1alpha2", "v1alpha3"]
    assert [(p.name, p.priority) for p in result.hookPoints] == [
        ("OnDefineDomain", 0),
        ("Shutdown", 0),
    ]
    assert info.newest_version() == "v1alpha3"


@pytest.mark.parametrize("version", VERSIONS)
def test_on_define_domain_every_version(
    version: str, serve: Serve, tmp_path: Path, rng: etree.RelaxNG
) -> None:
    root = build_missing_cdev_node(tmp_path / "node")
    client = serve(root)
    source, vmi = read_data("kubevirt-gpus.xml"), vmi_json()

    output = client.on_define_domain(version, source, vmi)

    expected = rewrite_domain(source, vmi, capabilities(root, source, V12_9), Policy.AUTO)
    assert output == expected.domain_xml
    assert b'<driver iommufd="no"/>' in output
    assert schema_errors(rng, output) is None


@pytest.mark.parametrize("version", ["v1alpha2", "v1alpha3"])
def test_pre_cloud_init_iso_is_unchanged(version: str, serve: Serve, tmp_path: Path) -> None:
    client = serve(build_cdevs(tmp_path / "node"))
    source, data = b'{"userData": "#cloud-config"}', b"\x00\x01cloud-init"
    assert client.pre_cloud_init_iso(version, source, data) == (source, data)


def test_chain_of_two_hooks(serve: Serve, tmp_path: Path, rng: etree.RelaxNG) -> None:
    """virt-launcher calls every OnDefineDomain hook in turn, each on the previous one's output.
    A first copy of the hook configured for libvirt 12.1 adds per-device opt-ins; the second,
    for 12.9, takes them back out and decides again, ending where it would have alone."""
    root = build_missing_cdev_node(tmp_path / "node")
    first = serve(root, name="iommufd-a", libvirt=LibvirtVersion(12, 1, 0))
    second = serve(root, name="iommufd-b")
    source, vmi = read_data("kubevirt-gpus.xml"), vmi_json()

    domain = source
    for hook in (first, second):
        domain = hook.on_define_domain(hook.newest_version(), domain, vmi)

    alone = rewrite_domain(source, vmi, capabilities(root, source, V12_9), Policy.AUTO)
    assert canonical(domain) == canonical(alone.domain_xml)
    assert second.on_define_domain("v1alpha3", domain, vmi) == domain
    assert schema_errors(rng, domain) is None


def test_malformed_domain_is_invalid_argument(serve: Serve, tmp_path: Path) -> None:
    client = serve(build_cdevs(tmp_path / "node"))
    with pytest.raises(grpc.RpcError) as raised:
        client.on_define_domain("v1alpha3", b"<domain><devices></domain>", vmi_json())
    assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert str(raised.value.details()).startswith(
        "domain XML is malformed: 'Opening and ending tag mismatch: devices line 1 and domain"
    )


def test_refusal_naming_a_huge_name_is_a_short_invalid_argument(
    serve: Serve, tmp_path: Path
) -> None:
    """libxml2 names the tag in its message; a 40,000-character one must not turn the answer
    into a trailer over gRPC's limit (the caller would see RESOURCE_EXHAUSTED or INTERNAL)."""
    client = serve(build_cdevs(tmp_path / "node"))
    with pytest.raises(grpc.RpcError) as raised:
        client.on_define_domain("v1alpha3", f"<domain><{'a' * 40_000}></b>".encode(), b"")
    assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert len(str(raised.value.details())) < 400


def test_oversized_domain_is_invalid_argument(serve: Serve, tmp_path: Path) -> None:
    client = serve(build_cdevs(tmp_path / "node"))
    big = read_data("kubevirt-gpus.xml").replace(
        b"<devices>", b"<!--" + b"x" * MAX_DOMAIN_BYTES + b"--><devices>", 1
    )
    with pytest.raises(grpc.RpcError) as raised:
        client.on_define_domain("v1alpha1", big, vmi_json())
    assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert f"over the {MAX_DOMAIN_BYTES} byte limit" in str(raised.value.details())


def test_require_unmet_is_failed_precondition(serve: Serve, tmp_path: Path) -> None:
    client = serve(build_missing_cdev_node(tmp_path / "node"), policy=Policy.REQUIRE)
    with pytest.raises(grpc.RpcError) as raised:
        client.on_define_domain("v1alpha3", read_data("kubevirt-gpus.xml"), vmi_json())
    assert raised.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "hostdev 'ua-hostdevice-gpu2' (0000:2a:00.0) cannot use iommufd" in str(
        raised.value.details()
    )


def test_one_log_line_per_vmi(
    serve: Serve, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    client = serve(build_missing_cdev_node(tmp_path / "node"))
    with caplog.at_level("INFO", logger="launcher_hook"):
        client.on_define_domain("v1alpha3", read_data("kubevirt-gpus.xml"), vmi_json())
    lines = [r.getMessage() for r in caplog.records if r.name == "launcher_hook"]
    assert len(lines) == 1
    assert lines[0].startswith(
        "vmi 'gpus/vmi-h100': policy auto: 'ua-gpu-gpu1' 0000:18:00.0 iommufd"
    )
    assert "'ua-hostdevice-gpu2' 0000:2a:00.0 legacy (no VFIO cdev node" in lines[0]
    assert "<domain" not in lines[0]


def test_process_serves_then_exits_cleanly_on_shutdown(tmp_path: Path) -> None:
    root = build_cdevs(tmp_path / "node")
    sockets = tmp_path / "hooks"
    process = start_hook(
        "--socket-dir", str(sockets), "--root", str(root), "--libvirt-version", "12.9.0"
    )
    try:
        socket = sockets / "iommufd.sock"
        wait_for_info(socket)
        client = HookClient(socket)
        output = client.on_define_domain("v1alpha3", read_data("kubevirt-gpus.xml"), vmi_json())
        assert b'<iommufd enabled="yes"/>' in output
        client.shutdown()  # answered: no exception
        client.close()
        assert process.wait(timeout=10) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    _, stderr = process.communicate()
    log = stderr.decode()
    assert "vmi 'gpus/vmi-h100': policy auto:" in log
    assert "Shutdown: virt-launcher is done with the VMI, stopping" in log
    assert not socket.exists()


def test_process_stops_on_sigterm(tmp_path: Path) -> None:
    sockets = tmp_path / "hooks"
    process = start_hook("--socket-dir", str(sockets), "--name", "x", "--root", str(tmp_path))
    try:
        wait_for_info(sockets / "x.sock")
        process.terminate()
        assert process.wait(timeout=10) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert not (sockets / "x.sock").exists()
    process.communicate()


@pytest.mark.parametrize("umask", [0o000, 0o077], ids=["umask-000", "umask-077"])
def test_socket_mode_does_not_follow_the_umask(tmp_path: Path, umask: int) -> None:
    """Owner only: KubeVirt runs every hook sidecar as the compute container's user (107, or
    root for a root VMI). The socket replaces a stale file at its path already with that mode,
    and nothing else is left in the directory (virt-launcher dials every file there)."""
    sockets = tmp_path / "hooks"
    sockets.mkdir()
    socket = sockets / "iommufd.sock"
    socket.write_text("left by an earlier run")
    process = start_hook("--socket-dir", str(sockets), "--root", str(tmp_path), umask=umask)
    try:
        deadline = time.monotonic() + 10
        while not stat.S_ISSOCK(socket.lstat().st_mode):
            assert time.monotonic() < deadline, "no socket within 10 s"
            time.sleep(0.001)
        assert stat.S_IMODE(socket.lstat().st_mode) == 0o600
        # The private staging directory goes right after the rename that put the socket in
        # place (virt-launcher skips directories meanwhile); then the socket is all there is.
        while [p.name for p in sockets.iterdir()] != ["iommufd.sock"]:
            assert time.monotonic() < deadline, f"left in {sockets}: {list(sockets.iterdir())}"
            time.sleep(0.001)
        wait_for_info(socket)
        process.terminate()
        assert process.wait(timeout=10) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        process.communicate()


def test_bad_socket_name_is_a_usage_error(tmp_path: Path) -> None:
    process = start_hook("--socket-dir", str(tmp_path), "--name", "../escape")
    _, stderr = process.communicate(timeout=30)
    assert process.returncode == 2
    assert b"'../escape' is not a plain file name" in stderr


def test_unusable_socket_dir_exits_1(tmp_path: Path) -> None:
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("")
    process = start_hook("--socket-dir", str(not_a_dir), "--root", str(tmp_path))
    _, stderr = process.communicate(timeout=30)
    assert process.returncode == 1
    assert stderr.decode().startswith(f"kubevirt-iommufd hook: error: cannot serve on {not_a_dir}")
