"""The one-shot rewrite as KubeVirt's sidecar-shim runs it, and `hook on-define-domain`."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from hook_kit import REPO, build_cdevs, build_missing_cdev_node, hook_argv, read_data, vmi_json
from launcher_hook import command


def test_on_define_domain_executable(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> None:
    domain = read_data("kubevirt-gpus.xml").decode()
    vmi = vmi_json(**{"iommufd.kubevirt.io/libvirt-version": "12.9.0"}).decode()
    root = build_cdevs(tmp_path)

    with caplog.at_level("INFO", logger="launcher_hook"):
        assert command.main(["--root", str(root), "--vmi", vmi, "--domain", domain]) == 0

    out, _ = capsys.readouterr()
    assert out.startswith('<domain xmlns:qemu="http://libvirt.org/schemas/domain/qemu/1.0"')
    assert '<iommufd enabled="yes"/>' in out
    assert [r.getMessage()[:33] for r in caplog.records] == ["vmi 'gpus/vmi-h100': policy auto:"]


def test_require_unmet_exits_1_with_the_reason(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = build_missing_cdev_node(tmp_path)
    args = ["--root", str(root), "--policy", "require", "--libvirt-version", "12.9.0"]
    args += ["--cdev-check", "node"]
    domain = read_data("kubevirt-gpus.xml").decode()

    assert command.main([*args, "--vmi", vmi_json().decode(), "--domain", domain]) == 1

    out, err = capsys.readouterr()
    assert out == ""
    assert "error: vmi 'gpus/vmi-h100': iommufd is required" in err
    assert "hostdev 'ua-hostdevice-gpu2' (0000:2a:00.0) cannot use iommufd" in err


def test_hook_on_define_domain_subcommand(tmp_path: Path) -> None:
    """Options before the action apply; given again after it, they override."""
    root = build_cdevs(tmp_path)
    argv = hook_argv(
        "--root", str(root), "--libvirt-version", "12.1.0", "--log-level", "warning",
        "on-define-domain",
        "--policy", "disable",
        "--vmi", vmi_json().decode(),
        "--domain", read_data("kubevirt-gpus.xml").decode(),
    )  # fmt: skip
    done = subprocess.run(argv, cwd=REPO, capture_output=True, check=False)
    assert done.returncode == 0, done.stderr
    assert b'libvirt="12.1.0"' in done.stdout
    assert b'policy="disable" policy-source="--policy"' in done.stdout
    assert done.stderr == b""


def test_malformed_domain_exits_1(tmp_path: Path) -> None:
    argv = hook_argv(
        "on-define-domain", "--root", str(tmp_path), "--vmi", "{}", "--domain", "<domain>"
    )
    done = subprocess.run(argv, cwd=REPO, capture_output=True, check=False)
    assert done.returncode == 1
    assert done.stdout == b""
    assert done.stderr.startswith(b"kubevirt-iommufd hook: error: domain XML is malformed:")


def test_entry_point_runs_as_a_program(tmp_path: Path) -> None:
    """What [project.scripts] onDefineDomain = "launcher_hook.command:main" will run."""
    code = "import sys; from launcher_hook.command import main; sys.exit(main())"
    argv = [sys.executable, "-c", code, "--root", str(tmp_path), "--vmi", "{}", "--domain"]
    done = subprocess.run(
        [*argv, read_data("kubevirt-mdev-usb.xml").decode()],
        cwd=REPO,
        capture_output=True,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout == read_data("kubevirt-mdev-usb.xml")


def test_payloads_only_at_debug_and_shortened(tmp_path: Path) -> None:
    domain = read_data("kubevirt-gpus.xml").decode()
    argv = hook_argv(
        "on-define-domain", "--root", str(build_cdevs(tmp_path)), "--log-level", "debug",
        "--vmi", vmi_json().decode(), "--domain", domain,
    )  # fmt: skip
    done = subprocess.run(argv, cwd=REPO, capture_output=True, check=False)
    assert done.returncode == 0
    debug = [line for line in done.stderr.decode().splitlines() if " DEBUG " in line]
    assert [line.split(": ", 2)[1] for line in debug] == [
        "OnDefineDomain vmi",
        "OnDefineDomain domain",
        "OnDefineDomain result",
    ]
    assert all(len(line) < 2200 for line in debug)
    assert debug[1].endswith(f" chars] ({len(domain)} bytes)")


@pytest.mark.parametrize(("check", "backend"), [("sysfs", "iommufd"), ("node", "legacy")])
def test_cdev_check_in_a_sidecar_without_vfio_nodes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], check: str, backend: str
) -> None:
    """A sidecar's /dev holds no VFIO nodes; `--cdev-check sysfs` judges by sysfs instead."""
    root = build_missing_cdev_node(tmp_path)
    args = ["--root", str(root), "--libvirt-version", "12.9.0", "--cdev-check", check]
    domain = read_data("kubevirt-gpus.xml").decode()

    assert command.main([*args, "--vmi", vmi_json().decode(), "--domain", domain]) == 0

    out, _ = capsys.readouterr()
    assert f'alias="ua-hostdevice-gpu2" bdf="0000:2a:00.0" backend="{backend}"' in out


def test_the_shim_executable_judges_cdevs_by_sysfs(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """KubeVirt's shim passes no flags, and its sidecar never sees the compute container's
    VFIO nodes: `onDefineDomain` must not require them."""
    root = build_missing_cdev_node(tmp_path)
    args = ["--root", str(root), "--libvirt-version", "12.9.0"]
    domain = read_data("kubevirt-gpus.xml").decode()

    assert command.main([*args, "--vmi", vmi_json().decode(), "--domain", domain]) == 0

    out, _ = capsys.readouterr()
    assert 'alias="ua-hostdevice-gpu2" bdf="0000:2a:00.0" backend="iommufd"' in out
