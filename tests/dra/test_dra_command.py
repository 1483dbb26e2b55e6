"""`kubevirt-iommufd dra` as a process: registers, publishes, prepares, stops cleanly on SIGTERM;
refuses bad arguments, directories another user could write and unreadable records with one
line naming the fix."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from dra_kit import DRIVER, NODE, short_directory
from prepared_records_kit import BAD_RECORDS, write_record
from sim.apiserver import ApiServerStandIn
from sim.dra_kubelet import DRAKubeletStandIn

ScenarioRoot = Callable[[str], Path]
REPO = Path(__file__).resolve().parents[2]


def dra(*args: str) -> list[str]:
    return [sys.executable, "-m", "kubevirt_iommufd", "dra", *args]


def test_runs_registers_publishes_and_stops_on_sigterm(
    scenario_root: ScenarioRoot, apiserver: ApiServerStandIn, tmp_path: Path
) -> None:
    apiserver.put_node(NODE)
    kubeconfig = apiserver.write_kubeconfig(tmp_path / "kubeconfig")
    root = scenario_root("hgx-h100")
    with short_directory() as base:
        kubelet_dir = base / "kubelet"
        process = subprocess.Popen(
            dra(
                "--node-name", NODE,
                "--root", str(root),
                # Relative directories, as a careless manifest might give them.
                "--kubelet-dir", "kubelet",
                "--cdi-dir", "cdi",
                "--state-dir", "state",
                "--run-dir", "run",
                "--kubeconfig", str(kubeconfig),
            ),
            stderr=subprocess.PIPE,
            text=True,
            cwd=base,
            # This checkout's code, not what the venv has installed, from outside it.
            env={**os.environ, "PYTHONPATH": str(REPO)},
        )  # fmt: skip
        try:
            with DRAKubeletStandIn(kubelet_dir, info_poll_interval=None) as kubelet:
                registration = kubelet.wait_registered(DRIVER, timeout=20)
                assert registration.service == "v1.DRAPlugin"
                # The kubelet dials the endpoint from its own working directory: absolute.
                assert registration.endpoint == str(kubelet_dir / "plugins" / DRIVER / "dra.sock")
                # The 8 GPUs, and the default configuration's iommufd slots after them.
                assert apiserver.wait_until(
                    lambda: (
                        [
                            d["name"].startswith("pci-")
                            for s in apiserver.slices(NODE)
                            for d in s["spec"]["devices"]
                        ].count(True)
                        == 8
                    ),
                    timeout=20,
                )
            process.send_signal(signal.SIGTERM)
            _, stderr = process.communicate(timeout=20)
        finally:
            process.kill()
        assert process.returncode == 0, stderr
        assert "stopping signal=SIGTERM" in stderr
        assert not list((kubelet_dir / "plugins_registry").iterdir())
        assert not (kubelet_dir / "plugins" / DRIVER / "dra.sock").exists()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--node-name", "Node_A"], "--node-name 'Node_A': expected a node name"),
        (["--node-name", "a", "--driver-name", "x" * 64], "at most 63 characters"),
        (["--node-name", "a", "--root", "/nonexistent"], "--root /nonexistent is not a directory"),
        (["--node-name", "a", "--rescan-interval", "0"], "--rescan-interval 0.0"),
        (["--node-name", "a", "--kubeconfig", "/nonexistent"], "pass --kubeconfig"),
    ],
    ids=["node-name", "driver-name", "root", "rescan", "kubeconfig"],
)
def test_bad_arguments_exit_2_with_one_line(args: list[str], message: str, tmp_path: Path) -> None:
    done = subprocess.run(
        dra(*args, "--state-dir", str(tmp_path / "state"), "--run-dir", str(tmp_path / "run")),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 2
    assert message in done.stderr
    assert "Traceback" not in done.stderr


def test_a_bad_config_exits_2_naming_the_key(tmp_path: Path) -> None:
    """Read once the kubelet is served (the configuration loads YAML): the sockets go again."""
    config = tmp_path / "config.yaml"
    config.write_text(
        "resources:\n  - resourceName: example.com/x\n    selectors: {vendors: [nvidia]}\n"
    )
    with short_directory() as base:
        done = subprocess.run(
            dra(
                "--node-name", "a",
                "--config", str(config),
                "--root", str(tmp_path),
                "--kubelet-dir", str(base / "kubelet"),
                "--cdi-dir", str(base / "cdi"),
                "--state-dir", str(base / "state"),
                "--run-dir", str(base / "run"),
            ),
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )  # fmt: skip
        left = list((base / "kubelet").rglob("*.sock"))
    assert done.returncode == 2
    assert "resources[0].selectors.vendors[0]" in done.stderr
    assert left == []


def start_refused(root: Path, base: Path, kubeconfig: Path) -> subprocess.CompletedProcess[str]:
    """`kubevirt-iommufd dra` over the directories under `base`, which must refuse to start."""
    return subprocess.run(
        dra(
            "--node-name", NODE,
            "--root", str(root),
            "--kubelet-dir", str(base / "kubelet"),
            "--cdi-dir", str(base / "cdi"),
            "--state-dir", str(base / "state"),
            "--run-dir", str(base / "run"),
            "--kubeconfig", str(kubeconfig),
        ),
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )  # fmt: skip


def make_world_writable(path: Path) -> None:
    path.mkdir()
    path.chmod(0o777)


def make_symlink(path: Path) -> None:
    real = path.with_name(f"{path.name}.real")
    real.mkdir(mode=0o755)
    path.symlink_to(real)


def give_to_another_user(path: Path) -> None:
    path.mkdir(mode=0o755)
    os.chown(path, 12345, 12345)


@pytest.mark.parametrize(
    ("directory", "spoil", "what", "problem", "mode"),
    [
        ("state", make_world_writable, "state", "is writable by other users (mode 0777)", 0o755),
        ("cdi", make_world_writable, "CDI", "is writable by other users (mode 0777)", 0o755),
        ("state", make_symlink, "state", "is a symbolic link", 0o755),
        ("cdi", make_symlink, "CDI", "is a symbolic link", 0o755),
        ("state", give_to_another_user, "state", "is owned by uid 12345, not by root or by"
         " this process", 0o755),
        ("run", make_world_writable, "run", "is writable by other users (mode 0777)", 0o755),
        ("run", make_symlink, "run", "is a symbolic link", 0o755),
        ("run", give_to_another_user, "run", "is owned by uid 12345, not by root or by"
         " this process", 0o755),
    ],
    ids=["state-0777", "cdi-0777", "state-symlink", "cdi-symlink", "state-other-user",
         "run-0777", "run-symlink", "run-other-user"],
)  # fmt: skip
def test_a_directory_another_user_could_write_stops_the_start_with_one_line(
    scenario_root: ScenarioRoot,
    apiserver: ApiServerStandIn,
    tmp_path: Path,
    directory: str,
    spoil: Callable[[Path], None],
    what: str,
    problem: str,
    mode: int,
) -> None:
    if spoil is give_to_another_user and os.geteuid() != 0:
        pytest.skip("giving a directory to another user needs root")
    kubeconfig = apiserver.write_kubeconfig(tmp_path / "kubeconfig")
    # A short directory: unrefused, the driver would serve (and this wait out its timeout).
    with short_directory() as base:
        spoil(base / directory)
        done = start_refused(scenario_root("hgx-h100"), base, kubeconfig)
        assert done.returncode == 1, done.stderr
        assert done.stderr == (
            f"kubevirt-iommufd dra: {what} directory {base / directory} {problem}; make it a"
            f" real directory owned by root with mode {mode:04o}\n"
        )
        # Nothing was written through the link.
        assert not list(base.glob("*.real/*"))


@pytest.mark.parametrize("shape", sorted(BAD_RECORDS))
def test_a_record_of_the_wrong_shape_stops_the_start_with_one_line(
    scenario_root: ScenarioRoot, apiserver: ApiServerStandIn, tmp_path: Path, shape: str
) -> None:
    text, problem = BAD_RECORDS[shape]
    kubeconfig = apiserver.write_kubeconfig(tmp_path / "kubeconfig")
    with short_directory() as base:
        record = write_record(base / "state", text)
        done = start_refused(scenario_root("hgx-h100"), base, kubeconfig)
    assert done.returncode == 1, done.stderr
    assert done.stderr == (
        f"kubevirt-iommufd dra: unreadable prepared-claim record {record}: {problem}; check which"
        " device the claim had (kubevirt-iommufd inspect), then fix or remove the file\n"
    )
