"""The daemons serve the kubelet before loading what answering it does not need: when `dra` and
`plugin` first serve a socket, neither the `kubernetes` client, urllib3 nor prometheus_client is
imported (they cost most of a start: issue 22), and `dra` has loaded neither its configuration
(YAML) nor what recovers, reads the host and prepares: its GetInfo comes from grpc and the
stubs. `plugin` serves and registers each resource before loading what only comes after: the
metrics server, reset after use (for resources without it), the node labels and the writer
of their feature file, and the inotify watch (which then tells a socket removed before it
began). The daemons run as processes, each through a wrapper that notes the heavy modules
already imported whenever a gRPC socket starts serving."""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from dra.command import DEFAULT_DRIVER as DRIVER
from sim.dra_kubelet import DRAKubeletStandIn
from sim.kubelet import KubeletStandIn

NODE = "node-a"
HEAVY = ("kubernetes", "urllib3", "prometheus_client", "requests")
DRA_LATER = (
    "yaml",
    "hostdev.config",
    "hostdev.scan",
    "dra.driver",
    "dra.prepare",
    "dra.host_cache",
    "dra.state",
    "dra.binding",
    "dra.publisher",
)
PLUGIN_LATER = (
    "deviceplugin.resetter",
    "deviceplugin.podresources_client",
    "deviceplugin.reset_policy",
    "hostdev.binding.reset",
    "hostdev.binding.lock",
    "hostdev.labels.node_labels",
    "hostdev.atomic_file",
    "uuid",
    "inotify_simple",
)
WRAPPER = """
import json, sys
from hostdev.grpc_socket import GrpcSocketServer

notes, heavy = sys.argv[1], sys.argv[2].split(",")
serve = GrpcSocketServer.start

def noting(self):
    with open(notes, "a") as out:
        print(json.dumps([str(self.path), sorted(m for m in heavy if m in sys.modules)]), file=out)
    serve(self)

GrpcSocketServer.start = noting
from kubevirt_iommufd.cli import main
sys.exit(main(sys.argv[3:]))
"""


@contextmanager
def short_directory() -> Iterator[Path]:
    """Below /tmp: a unix socket's path must stay under 108 bytes."""
    path = Path(tempfile.mkdtemp(prefix="si-", dir="/tmp"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def run_noted(
    notes: Path, args: list[str], served: Callable[[], bool], heavy: tuple[str, ...] = HEAVY
) -> None:
    command = [sys.executable, "-c", WRAPPER, str(notes), ",".join(heavy), *args]
    process = subprocess.Popen(command, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 60
        while not served():
            assert process.poll() is None, process.communicate()[1].decode()
            assert time.monotonic() < deadline, "the daemon never registered"
            time.sleep(0.02)
    finally:
        process.terminate()
        process.wait(10)


def run_to_end(command: list[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(command, capture_output=True, text=True, timeout=60, check=False)


def read_notes(notes: Path) -> list[tuple[str, list[str]]]:
    return [tuple(json.loads(line)) for line in notes.read_text().splitlines()]


def unreachable_kubeconfig(path: Path) -> Path:
    """A kubeconfig whose server nobody answers at: loading it works, calls fail."""
    cluster = {"server": "https://127.0.0.1:9", "insecure-skip-tls-verify": True}
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "c", "cluster": cluster}],
        "users": [{"name": "u", "user": {"token": "t"}}],
        "contexts": [{"name": "c", "context": {"cluster": "c", "user": "u"}}],
        "current-context": "c",
    }
    path.write_text(json.dumps(config))
    return path


def dra_args(root: Path, base: Path, tmp_path: Path) -> list[str]:
    """`dra` on the simulated node at `root`, its directories under `base`, quiet."""
    kubeconfig = unreachable_kubeconfig(tmp_path / "kubeconfig")
    args = ["dra", "--node-name", NODE, "--root", str(root), "--kubeconfig", str(kubeconfig)]
    args += ["--kubelet-dir", str(base / "kubelet"), "--cdi-dir", str(base / "cdi")]
    args += ["--state-dir", str(base / "state"), "--run-dir", str(base / "run")]
    return [*args, "--log-level", "error"]


def test_dra_serves_the_kubelet_before_loading_the_api_client(
    scenario_root: Callable[[str], Path], tmp_path: Path
) -> None:
    notes = tmp_path / "notes"
    with short_directory() as base, DRAKubeletStandIn(base / "kubelet") as kubelet:
        args = dra_args(scenario_root("hgx-h100"), base, tmp_path)
        run_noted(notes, args, lambda: kubelet.current(DRIVER) is not None, HEAVY + DRA_LATER)
    served = read_notes(notes)
    assert [Path(path).name for path, _ in served] == ["dra.sock", f"{DRIVER}-reg.sock"]
    assert all(heavy == [] for _, heavy in served), served


def test_dra_that_fails_after_serving_exits_1_and_removes_its_sockets(
    scenario_root: Callable[[str], Path], tmp_path: Path
) -> None:
    """An unreadable claim record stops the start in recovery, after the kubelet was served."""
    notes = tmp_path / "notes"
    with short_directory() as base:
        record = base / "state" / "claims" / "a1b2c3d4-0000-4000-8000-0000000000aa.json"
        record.parent.mkdir(mode=0o700, parents=True)
        record.write_text("null")
        args = dra_args(scenario_root("hgx-h100"), base, tmp_path)
        done = run_to_end([sys.executable, "-c", WRAPPER, str(notes), ",".join(HEAVY), *args])
        left = sorted(p.name for p in (base / "kubelet").rglob("*.sock"))
    assert done.returncode == 1, done.stderr
    assert done.stderr == (
        f"kubevirt-iommufd dra: unreadable prepared-claim record {record}: the record: expected"
        " an object, found null; check which device the claim had (kubevirt-iommufd inspect),"
        " then fix or remove the file\n"
    )
    assert [Path(path).name for path, _ in read_notes(notes)] == ["dra.sock", f"{DRIVER}-reg.sock"]
    assert left == []


def test_dra_without_an_api_server_configuration_still_stops_with_the_fix(
    scenario_root: Callable[[str], Path], tmp_path: Path
) -> None:
    root = scenario_root("hgx-h100")
    with short_directory() as base:
        args = ["--node-name", NODE, "--root", str(root), "--kubelet-dir", str(base / "kubelet")]
        args += ["--cdi-dir", str(base / "cdi"), "--state-dir", str(base / "state")]
        args += ["--run-dir", str(base / "run")]
        args += ["--kubeconfig", str(tmp_path / "missing")]
        result = run_to_end([sys.executable, "-m", "kubevirt_iommufd", "dra", *args])
        left = sorted(p.name for p in (base / "kubelet").rglob("*.sock"))
    assert result.returncode == 2, result.stderr
    assert "kubevirt-iommufd dra: no API server configuration:" in result.stderr
    assert "pass --kubeconfig" in result.stderr
    assert left == []


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


def test_device_plugin_registers_before_loading_metrics_or_the_api_client(
    scenario_root: Callable[[str], Path], tmp_path: Path
) -> None:
    root = scenario_root("hgx-h100")
    notes = tmp_path / "notes"
    with short_directory() as base:
        config = tmp_path / "config.json"
        iommufd = {"socketDir": str(base / "fds"), "socketOwner": {"uid": 0, "gid": 0}}
        config.write_text(json.dumps({"deviceMode": "iommufd", "iommufd": iommufd}))
        kubelet = KubeletStandIn(base / "kubelet")
        kubelet.start()
        port = free_port()

        def started() -> bool:
            return len(kubelet.registrations) >= 2 and serves(f"http://127.0.0.1:{port}/metrics")

        try:
            args = ["plugin", "--root", str(root), "--kubelet-dir", str(kubelet.directory)]
            args += ["--config", str(config), "--metrics-port", str(port), "--log-level", "error"]
            run_noted(notes, args, started, HEAVY + PLUGIN_LATER)
        finally:
            kubelet.stop()
    served = read_notes(notes)
    assert len(served) == 2
    assert all(heavy == [] for _, heavy in served), served


def serves(url: str) -> bool:
    """The metrics answer: the plugin is past its start."""
    try:
        with urllib.request.urlopen(url, timeout=1) as answer:  # noqa: S310 - our own loopback URL
            return b"kubevirt_iommufd_registrations" in answer.read()
    except OSError:
        return False
