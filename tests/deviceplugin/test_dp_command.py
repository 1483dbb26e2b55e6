"""`kubevirt-iommufd plugin` as a process: starts, registers, stops cleanly on SIGTERM."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from sim.host import BuildHost, hgx_h100
from sim.kubelet import KubeletStandIn


def plugin(*args: str) -> list[str]:
    return [sys.executable, "-m", "kubevirt_iommufd", "plugin", *args]


def write_config(tmp_path: Path, short_dir: Path) -> Path:
    """Hand-off sockets in the short directory, owned by whoever runs the tests."""
    config = tmp_path / "config.yaml"
    config.write_text(
        f"iommufd:\n  socketDir: {short_dir / 'fds'}\n  socketOwner: {{uid: 0, gid: 0}}\n"
    )
    return config


def test_runs_registers_and_stops_on_sigterm(
    build_host: BuildHost, short_dir: Path, tmp_path: Path
) -> None:
    root = build_host(hgx_h100())
    config = write_config(tmp_path, short_dir)
    kubelet = KubeletStandIn(short_dir / "kubelet")
    kubelet.start()
    process = subprocess.Popen(
        plugin(
            "--root", str(root), "--kubelet-dir", str(kubelet.directory), "--config", str(config)
        ),
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        kubelet.wait_registered("devices.kubevirt.io/iommufd", timeout=15)
        registration = kubelet.wait_registered("nvidia.com/GH100H100_SXM5_80GB", timeout=15)
        assert len(registration.snapshots[-1][1]) == 8
        process.send_signal(signal.SIGTERM)
        _, stderr = process.communicate(timeout=15)
    finally:
        process.kill()
        kubelet.stop()
    assert process.returncode == 0, stderr
    assert "registered resource=nvidia.com/GH100H100_SXM5_80GB" in stderr
    assert "stopping signal=SIGTERM" in stderr
    assert list(kubelet.directory.glob("kubevirt-iommufd-*")) == []


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ("deviceMode: fast\n", 'deviceMode: expected "both", "iommufd" or "legacy"'),
        ("resources: [\n", "is not valid YAML"),
    ],
)
def test_bad_config_exits_2_with_the_key(tmp_path: Path, config: str, message: str) -> None:
    path = tmp_path / "config.yaml"
    path.write_text(config)
    done = subprocess.run(
        plugin("--config", str(path), "--root", str(tmp_path)),
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert done.returncode == 2
    assert message in done.stderr
    assert done.stderr.count("\n") == 1


def test_missing_root_exits_2(tmp_path: Path) -> None:
    done = subprocess.run(
        plugin("--root", str(tmp_path / "nope")),
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert done.returncode == 2
    assert "--root" in done.stderr and "is not a directory" in done.stderr


def test_metrics_port_taken_exits_1_with_the_port_and_removes_its_sockets(
    build_host: BuildHost, short_dir: Path, tmp_path: Path
) -> None:
    """The metrics are served after the kubelet was told of the plugin: a port another process
    holds stops the plugin with the port named, and takes its registered sockets back."""
    root = build_host(hgx_h100())
    config = write_config(tmp_path, short_dir)
    kubelet = KubeletStandIn(short_dir / "kubelet")
    kubelet.start()
    with socket.socket() as taken:
        taken.bind(("0.0.0.0", 0))  # noqa: S104 - where the plugin serves its metrics
        taken.listen()
        port = taken.getsockname()[1]
        try:
            done = subprocess.run(
                plugin(
                    *("--root", str(root), "--kubelet-dir", str(kubelet.directory)),
                    *("--config", str(config), "--metrics-port", str(port)),
                    *("--log-level", "error"),
                ),
                capture_output=True,
                text=True,
                timeout=30,
                check=False,
            )
        finally:
            kubelet.stop()
    assert done.returncode == 1, done.stderr
    assert done.stderr == (
        f"kubevirt-iommufd plugin: cannot serve metrics on port {port}: Address already in use\n"
    )
    assert len(kubelet.registrations) == 2
    assert list(kubelet.directory.glob("kubevirt-iommufd-*")) == []
