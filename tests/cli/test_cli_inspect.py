"""`kubevirt-iommufd inspect`: table, JSON and every error path, through the real entry point."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from kubevirt_iommufd.cli import main
from prepared_records_kit import BAD_RECORDS, UID, good_record, write_record
from sim.host import BuildHost, HostSpec

ScenarioRoot = Callable[[str], Path]
DOC = Path(__file__).resolve().parents[2] / "docs/inspect-json.md"
PCI_IDS = """\
10de  NVIDIA Corporation
	2204  GA102 [GeForce RTX 3090]
	1aef  GA102 High Definition Audio Controller
	2330  GH100[H100 SXM5 80GB]
C 03  Display controller
	00  VGA compatible controller
"""


@pytest.fixture
def pci_ids(tmp_path: Path) -> str:
    path = tmp_path / "pci.ids"
    path.write_text(PCI_IDS)
    return str(path)


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_table_for_a_vga_gpu_with_its_audio_function(
    capsys: pytest.CaptureFixture[str], scenario_root: ScenarioRoot, pci_ids: str
) -> None:
    root = scenario_root("vga-audio")
    code, out, err = run(capsys, "inspect", "--root", str(root), "--pci-ids", pci_ids)
    assert (code, err) == (0, "")
    assert out.splitlines() == [
        "host: kernel 6.12.0-kubevirt-iommufd; IOMMU on; iommufd yes (/dev/iommu 10:257);"
        " VFIO cdevs yes; legacy VFIO yes",
        "2 PCI functions in 1 IOMMU group; 0 assignable (0 over iommufd, 0 over legacy VFIO only)",
        "GROUP  BDF           ID         DEVICE                                          "
        "  DRIVER         CDEV   NUMA  ASSIGNABLE",
        "14     0000:3b:00.0  10de:2204  NVIDIA Corporation GA102 [GeForce RTX 3090]     "
        "  vfio-pci       vfio0  0     no: group 14 not viable: 0000:3b:00.1 is bound to"
        " snd_hda_intel",
        "       0000:3b:00.1  10de:1aef  NVIDIA Corporation GA102 High Definition Audio …"
        "  snd_hda_intel  -      0     no: bound to snd_hda_intel, not to a VFIO driver",
        "labels:",
        "  kubevirt-iommufd.io/iommufd=false",
        "  kubevirt-iommufd.io/vfio-cdev=true",
        "  kubevirt-iommufd.io/kernel=6.12",
        "  kubevirt-iommufd.io/iommufd-devices.nvidia.com_GA102_GEFORCE_RTX_3090=0",
    ]


def test_table_on_a_legacy_only_host_says_why(
    capsys: pytest.CaptureFixture[str], scenario_root: ScenarioRoot
) -> None:
    root = scenario_root("legacy-only")
    code, out, _ = run(capsys, "inspect", "--root", str(root), "--pci-ids", "none", "0000:18:00.0")
    assert code == 0
    lines = out.splitlines()
    assert lines[0] == (
        "host: kernel 6.1.0-18-amd64; IOMMU on; iommufd no;"
        " VFIO cdevs no (CONFIG_VFIO_DEVICE_CDEV off); legacy VFIO yes"
    )
    assert lines[3].endswith(
        "yes (legacy VFIO; no VFIO cdev: the kernel lacks CONFIG_VFIO_DEVICE_CDEV;"
        " no iommufd: the kernel lacks CONFIG_IOMMUFD)"
    )
    # Only the asked-for function and its (single-member) group, then the node's labels.
    assert lines[4:] == [
        "labels:",
        "  kubevirt-iommufd.io/iommufd=false",
        "  kubevirt-iommufd.io/vfio-cdev=false",
        "  kubevirt-iommufd.io/kernel=6.1",
        "  kubevirt-iommufd.io/iommufd-devices.nvidia.com_2330=0",
    ]


def test_nvidia_driver_reason(
    capsys: pytest.CaptureFixture[str], scenario_root: ScenarioRoot
) -> None:
    code, out, _ = run(
        capsys, "inspect", "--root", str(scenario_root("nvidia-driver")), "--pci-ids", "none"
    )
    assert code == 0
    rows = out.split("labels:")[0].splitlines()
    assert rows[-1].endswith("no: bound to nvidia, not to a VFIO driver")


def test_host_without_iommu_is_reported_plainly(
    capsys: pytest.CaptureFixture[str], scenario_root: ScenarioRoot
) -> None:
    code, out, err = run(capsys, "inspect", "--root", str(scenario_root("no-iommu")))
    assert (code, err) == (0, "")
    assert "IOMMU off" in out.splitlines()[0]
    rows = out.split("labels:")[0].splitlines()
    assert rows[-1].endswith(
        "no: no IOMMU: enable VT-d/AMD-Vi in the firmware and"
        " boot with intel_iommu=on (or amd_iommu=on)"
    )


def test_host_without_pci_devices(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    code, out, err = run(capsys, "inspect", "--root", str(tmp_path))
    assert (code, err) == (0, "")
    assert out.splitlines()[1:] == [
        "0 PCI functions in 0 IOMMU groups; 0 assignable (0 over iommufd, 0 over legacy VFIO only)",
        "no PCI functions found",
        "labels:",
        "  kubevirt-iommufd.io/iommufd=false",
    ]


def test_json_document(
    capsys: pytest.CaptureFixture[str], scenario_root: ScenarioRoot, pci_ids: str
) -> None:
    root = scenario_root("hgx-h100")
    code, out, _ = run(capsys, "inspect", "--root", str(root), "--json", "--pci-ids", pci_ids)
    assert code == 0
    document = json.loads(out)
    assert document["schema"] == "kubevirt-iommufd/inspect/v1"
    assert document["host"] == {
        "kernel": "6.12.0-kubevirt-iommufd",
        "iommu": True,
        "iommufd": True,
        "iommufd_node": "/dev/iommu",
        "iommufd_devnum": "10:257",
        "vfio_cdev": True,
        "legacy_vfio": True,
    }
    assert document["summary"] == {
        "functions": 26,
        "groups": 26,
        "assignable": 8,
        "iommufd": 8,
        "legacy": 0,
    }
    group = next(g for g in document["groups"] if g["group"] == 13)
    assert group["viable"] is True and group["legacy_node"] == "/dev/vfio/13"
    assert group["functions"] == [
        {
            "bdf": "0000:18:00.0",
            "vendor_id": "10de",
            "device_id": "2330",
            "vendor": "NVIDIA Corporation",
            "device": "GH100[H100 SXM5 80GB]",
            "subsystem_vendor_id": "10de",
            "subsystem_device_id": "16c1",
            "class": "030200",
            "class_name": "Display controller",
            "revision": "a1",
            "driver": "vfio-pci",
            "iommu_group": 13,
            "numa_node": 0,
            "vfio_cdev": "vfio0",
            "vfio_cdev_path": "/dev/vfio/devices/vfio0",
            "vfio_cdev_present": True,
            "sriov": None,
            "physfn": None,
            "consumers": [],
            "upstream": ["0000:15:01.0", "0000:16:00.0", "0000:17:00.0"],
            "modalias": "pci:v000010DEd00002330sv000010DEsd000016C1bc03sc02i00",
            "assignable": True,
            "backend": "iommufd",
            "reasons": [],
            "reset_methods": ["flr", "bus"],
            "warnings": [],
        }
    ]


def test_json_labels_follow_the_config(
    capsys: pytest.CaptureFixture[str], scenario_root: ScenarioRoot, tmp_path: Path
) -> None:
    root = str(scenario_root("hgx-h100"))
    _, out, _ = run(capsys, "inspect", "--root", root, "--json", "--pci-ids", "none")
    assert json.loads(out)["labels"] == {
        "kubevirt-iommufd.io/iommufd": "true",
        "kubevirt-iommufd.io/vfio-cdev": "true",
        "kubevirt-iommufd.io/kernel": "6.12",
        "kubevirt-iommufd.io/iommufd-devices.nvidia.com_2330": "8",
    }
    config = tmp_path / "plugin.yaml"
    config.write_text(
        "deviceMode: legacy\n"
        "resources:\n"
        "- resourceName: example.com/h100\n"
        "  selectors: {devices: ['2330']}\n"
    )
    _, out, _ = run(capsys, "inspect", "--root", root, "--json", "--config", str(config))
    assert json.loads(out)["labels"] == {
        "kubevirt-iommufd.io/iommufd": "false",
        "kubevirt-iommufd.io/vfio-cdev": "true",
        "kubevirt-iommufd.io/kernel": "6.12",
        "kubevirt-iommufd.io/iommufd-devices.example.com_h100": "0",
    }


def documented_fields(section: str) -> set[str]:
    text = DOC.read_text()
    body = text.split(f"## {section}\n", 1)[1].split("\n## ", 1)[0]
    return set(re.findall(r"^\| `([a-z_]+)` \|", body, re.MULTILINE))


def test_json_fields_are_the_documented_ones(
    capsys: pytest.CaptureFixture[str], scenario_root: ScenarioRoot
) -> None:
    root = scenario_root("sriov")
    # A node running the DRA driver: every documented field, `prepared_for` included.
    (root / "var/lib/kubevirt-iommufd/dra").mkdir(parents=True)
    _, out, _ = run(capsys, "inspect", "--root", str(root), "--json")
    document: dict[str, Any] = json.loads(out)
    assert set(document) == documented_fields("Top level")
    assert set(document["host"]) == documented_fields("`host`")
    assert set(document["summary"]) == documented_fields("`summary`")
    group = document["groups"][0]
    assert set(group) == documented_fields("`groups[]`")
    assert set(group["functions"][0]) == documented_fields("`groups[].functions[]`")


def test_example_node_needs_no_root(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "inspect", "--example", "sriov", "--json")
    assert code == 0
    assert json.loads(out)["summary"]["iommufd"] == 4


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["inspect", "--root", "/nonexistent/root"],
            "host root '/nonexistent/root' is not a directory; pass --root",
        ),
        (
            ["inspect", "--example", "sriov", "../../etc/passwd"],
            "invalid PCI address '../../etc/passwd': expected dddd:bb:ss.f",
        ),
        (
            ["inspect", "--example", "sriov", "0000:99:00.0"],
            "no PCI function 0000:99:00.0 on this host",
        ),
        (
            ["inspect", "--example", "sriov", "--pci-ids", "/nonexistent/pci.ids"],
            "pci.ids file '/nonexistent/pci.ids' not found",
        ),
        (
            ["inspect", "--example", "sriov", "--config", "/nonexistent/plugin.yaml"],
            "cannot read config /nonexistent/plugin.yaml",
        ),
    ],
    ids=["missing-root", "bdf-with-dotdot", "unknown-bdf", "missing-pci-ids", "missing-config"],
)
def test_errors_are_one_line_and_exit_1(
    capsys: pytest.CaptureFixture[str], argv: list[str], message: str
) -> None:
    code, out, err = run(capsys, *argv)
    assert code == 1 and out == ""
    assert err.count("\n") == 1
    assert err.startswith(f"kubevirt-iommufd: error: {message}")


def test_malformed_pci_ids_is_an_error(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    bad = tmp_path / "pci.ids"
    bad.write_text("10de  NVIDIA Corporation\n\tnot hex  device\n")
    code, out, err = run(capsys, "inspect", "--example", "sriov", "--pci-ids", str(bad))
    assert code == 1 and out == ""
    assert err == (
        f"kubevirt-iommufd: error: {bad}:2: unexpected line '\\tnot hex  device'; install a good"
        " copy (Debian package pci.ids) or pass --pci-ids none to go without device names\n"
    )


def test_unreadable_entry_is_an_error(
    capsys: pytest.CaptureFixture[str], scenario_root: ScenarioRoot
) -> None:
    root = scenario_root("vga-audio")
    numa = (root / "sys/bus/pci/devices/0000:3b:00.0").resolve() / "numa_node"
    numa.unlink()
    numa.mkdir()
    code, out, err = run(capsys, "inspect", "--root", str(root))
    assert code == 1 and out == ""
    assert re.fullmatch(
        r"kubevirt-iommufd: error: cannot read \S+/0000:3b:00.0/numa_node: Is a directory; run as"
        r" root, or point --root at a complete copy of the host's /sys and /dev\n",
        err,
    )


def test_usage_error_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as caught:
        main(["inspect", "--example", "no-such-node"])
    assert caught.value.code == 2
    assert "invalid choice: 'no-such-node'" in capsys.readouterr().err


def test_console_script_runs_as_a_module(build_host: BuildHost) -> None:
    root = build_host(HostSpec(()))
    done = subprocess.run(
        [sys.executable, "-m", "kubevirt_iommufd", "inspect", "--root", str(root), "--json"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["summary"]["functions"] == 0


@pytest.mark.parametrize("shape", sorted(BAD_RECORDS))
def test_a_dra_record_of_the_wrong_shape_is_one_warning_and_the_rest_is_shown(
    capsys: pytest.CaptureFixture[str], scenario_root: ScenarioRoot, tmp_path: Path, shape: str
) -> None:
    text, problem = BAD_RECORDS[shape]
    write_record(tmp_path, json.dumps(good_record()))
    bad = write_record(tmp_path, text, "a1b2c3d4-0000-4000-8000-0000000000ff")
    root = scenario_root("hgx-h100")
    code, out, err = run(
        capsys, "inspect", "--root", str(root), "--json", "--dra-state-dir", str(tmp_path)
    )
    assert code == 0
    assert err == (
        f"kubevirt-iommufd: warning: unreadable prepared-claim record {bad}: {problem}; the"
        " devices it names are shown as not prepared\n"
    )
    prepared = {
        f["bdf"]: f["prepared_for"] for g in json.loads(out)["groups"] for f in g["functions"]
    }
    assert prepared["0000:18:00.0"] == f"claim vms/vm-gpus (uid {UID})"
