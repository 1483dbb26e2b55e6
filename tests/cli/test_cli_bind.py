"""`kubevirt-iommufd bind` / `unbind`: table and JSON output and exit codes, with the kernel
simulated behind the writer seam."""

from __future__ import annotations

import argparse
import errno
import json
import os
import re
from pathlib import Path

import pytest

from binding_kit import held_elsewhere
from hostdev.binding.lock import LOCK_PATH, hold_binding_lock
from kubevirt_iommufd import bind_command
from sim.host import (
    CLASS_AUDIO,
    CLASS_VGA,
    NVIDIA,
    BuildHost,
    FunctionSpec,
    HostSpec,
    hgx_h100,
)
from sim.kernel import KernelSimulator, hold

GPU = "0000:3b:00.0"
AUDIO = "0000:3b:00.1"


def desktop() -> HostSpec:
    return HostSpec(
        (
            FunctionSpec(
                GPU, NVIDIA, 0x2204, CLASS_VGA, driver="nvidia", group=14, consumers=(AUDIO,)
            ),
            FunctionSpec(AUDIO, NVIDIA, 0x1AEF, CLASS_AUDIO, driver="snd_hda_intel", group=14),
        )
    )


class Cli:
    def __init__(self, root: Path, capsys: pytest.CaptureFixture[str]) -> None:
        self.root = root
        self.kernel = KernelSimulator(root, {GPU: "nvidia", AUDIO: "snd_hda_intel"})
        self.capsys = capsys
        parser = argparse.ArgumentParser(prog="kubevirt-iommufd")
        bind_command.add_parser(parser.add_subparsers(dest="command", required=True))
        self.parser = parser

    def __call__(self, *argv: str) -> tuple[int, str, str]:
        args = self.parser.parse_args([*argv, "--root", str(self.root)])
        code: int = args.run(args, writer=self.kernel, runner=self.kernel.run)
        out, err = self.capsys.readouterr()
        return code, out, err


@pytest.fixture
def cli(build_host: BuildHost, capsys: pytest.CaptureFixture[str]) -> Cli:
    return Cli(build_host(desktop()), capsys)


def test_bind_table(cli: Cli) -> None:
    code, out, err = cli("bind", GPU)
    assert (code, err) == (0, "")
    assert out.splitlines() == [
        "BDF           WHY                                     DRIVER             TARGET    STATUS",
        "0000:3b:00.0  requested                               nvidia         ->  vfio-pci  moved",
        "0000:3b:00.1  consumer of 0000:3b:00.0 (device link)  snd_hda_intel  ->  vfio-pci  moved",
        "modules loaded: vfio_pci",
        "bind: done, 2 functions moved",
    ]


def test_bind_json(cli: Cli) -> None:
    code, out, _ = cli("bind", GPU, "--json")
    assert code == 0
    document = json.loads(out)
    assert document["schema"] == "kubevirt-iommufd/bind/v1"
    assert (document["action"], document["result"]) == ("bind", "done")
    assert document["functions"][0] == {
        "bdf": GPU,
        "why": "requested",
        "from_driver": "nvidia",
        "to_driver": "vfio-pci",
        "status": "moved",
        "driver": "vfio-pci",
    }
    assert document["modules"] == ["vfio_pci"]
    assert document["writes"][0] == f"echo 1 > /proc/driver/nvidia/gpus/{GPU}/unbindLock"
    assert document["refusals"] == [] and document["restored"] == []
    assert document["error"] is None


def test_nothing_to_do_exits_0(cli: Cli) -> None:
    cli("bind", GPU)
    code, out, _ = cli("bind", GPU)
    assert code == 0
    assert out.splitlines()[-1] == "bind: nothing to do"
    assert "already on vfio-pci" in out


def test_refused_exits_1_and_names_the_holder(cli: Cli) -> None:
    hold(cli.root, 4242, "nvidia-smi", "/dev/nvidia0")
    code, out, _ = cli("bind", GPU)
    assert code == 1
    assert out.splitlines()[-2:] == [
        "bind: refused; nothing was changed",
        f"  {GPU}: in use: pid 4242 (nvidia-smi) holds /dev/nvidia0; stop those processes (or"
        " the VM), or pass --wait SECONDS",
    ]
    code, out, _ = cli("bind", GPU, "--json")
    (refusal,) = json.loads(out)["refusals"]
    assert refusal["holders"] == [{"pid": 4242, "command": "nvidia-smi", "path": "/dev/nvidia0"}]
    assert refusal["busy"] is True


def test_failure_exits_3_and_says_what_was_restored(cli: Cli) -> None:
    cli.kernel.fail(lambda path, text: path.endswith("vfio-pci/bind") and text == AUDIO)
    code, out, _ = cli("bind", GPU)
    assert code == 3
    assert out.splitlines()[-3:] == [
        f"bind: failed: {AUDIO}: `echo {AUDIO} > /sys/bus/pci/drivers/vfio-pci/bind` failed:"
        " Input/output error",
        f"  restored {GPU}: back on nvidia, override none",
        f"  restored {AUDIO}: back on snd_hda_intel, override none",
    ]


def test_failed_restore_exits_4(cli: Cli) -> None:
    cli.kernel.fail(lambda path, text: path.endswith("vfio-pci/bind") and text == AUDIO)
    cli.kernel.fail(lambda path, text: path.endswith("snd_hda_intel/bind"), errno.EBUSY)
    code, out, _ = cli("bind", GPU, "--json")
    assert code == 4
    document = json.loads(out)
    assert document["result"] == "failed-not-restored"
    assert [r["ok"] for r in document["restored"]] == [True, False]


def test_failed_restore_table_asks_for_a_person(cli: Cli) -> None:
    cli.kernel.fail(lambda path, text: path.endswith("vfio-pci/bind") and text == AUDIO)
    cli.kernel.fail(lambda path, text: path.endswith("snd_hda_intel/bind"), errno.EBUSY)
    code, out, _ = cli("bind", GPU)
    assert code == 4
    assert out.splitlines()[1:] == [
        "0000:3b:00.0  requested                               nvidia         ->  vfio-pci"
        "  restored",
        "0000:3b:00.1  consumer of 0000:3b:00.0 (device link)  snd_hda_intel  ->  vfio-pci"
        "  not-restored",
        "modules loaded: vfio_pci",
        f"bind: failed: {AUDIO}: `echo {AUDIO} > /sys/bus/pci/drivers/vfio-pci/bind` failed:"
        " Input/output error",
        f"  restored {GPU}: back on nvidia, override none",
        f"  NOT restored {AUDIO}: now on no driver, override none",
        f"    {AUDIO}: `echo {AUDIO} > /sys/bus/pci/drivers/snd_hda_intel/bind` failed: Device or"
        " resource busy: another driver holds it",
        "  the host needs attention: put the functions above back by hand",
    ]


def test_dry_run_lists_writes(cli: Cli) -> None:
    code, out, _ = cli("bind", GPU, "--dry-run")
    assert code == 0
    lines = out.splitlines()
    assert "modules would load: vfio_pci" in lines
    assert "bind: dry run, 2 functions would move with these writes:" in lines
    assert f"  echo vfio-pci > /sys/bus/pci/devices/{GPU}/driver_override" in lines
    assert cli.kernel.writes == []


def test_match_and_from_config(cli: Cli, tmp_path: Path) -> None:
    code, out, _ = cli("bind", "--match", "10de:2204", "--dry-run")
    assert code == 0 and "2 functions would move" in out
    code, _, err = cli("bind", "--match", "1af4:*")
    assert code == 1
    assert "no PCI function matches 1af4:* on this host" in err
    config = tmp_path / "reserved.yaml"
    config.write_text('devices:\n  - match: "vendor=10de,class=03"\n')
    code, out, _ = cli("bind", "--from-config", str(config))
    assert code == 0 and out.splitlines()[-1] == "bind: done, 2 functions moved"
    config.write_text('devices:\n  - match: "8086:*"\n')
    code, out, _ = cli("bind", "--from-config", str(config))
    assert code == 0 and "matches no function on this host; nothing to do" in out
    # A node that reserves nothing: the DaemonSet's init container runs and changes nothing.
    config.write_text("driver: auto\ndevices: []\n")
    writes_before = list(cli.kernel.writes)
    code, out, _ = cli("bind", "--from-config", str(config))
    assert code == 0 and "nothing to do" in out
    assert cli.kernel.writes == writes_before


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["bind"], "give BDFs, --match SELECTOR or --from-config FILE (one of them)"),
        (["bind", GPU, "--match", "10de:2204"], "(one of them)"),
        (["bind", "--from-config", "x.yaml", "--driver", "vfio-pci"], "set driver in the file"),
        (["bind", "--from-config", "/nonexistent.yaml"], "cannot read reservations"),
    ],
)
def test_usage_errors_exit_2(cli: Cli, argv: list[str], message: str) -> None:
    code, out, err = cli(*argv)
    assert (code, out) == (2, "")
    assert message in err


@pytest.mark.parametrize(
    "argv",
    [
        ["bind", "3b:00.0"],
        ["bind", "--match", "nvidia"],
        ["bind", GPU, "--wait", "-1"],
        ["unbind", GPU, "--reprobe", "--to-driver", "nvidia"],
        ["unbind"],
    ],
)
def test_bad_arguments_are_argparse_errors(cli: Cli, argv: list[str]) -> None:
    with pytest.raises(SystemExit) as caught:
        cli(*argv)
    assert caught.value.code == 2


def test_unbind_reprobe(cli: Cli) -> None:
    cli("bind", GPU)
    code, out, _ = cli("unbind", GPU, "--reprobe")
    assert code == 0
    lines = out.splitlines()
    assert lines[1].split() == [GPU, "requested", "vfio-pci", "->", "(kernel's", "choice)", "moved"]
    assert lines[-1] == "unbind: done, 2 functions moved"
    assert cli.kernel.driver(GPU) == "nvidia"


def test_missing_root_is_an_error(
    build_host: BuildHost, capsys: pytest.CaptureFixture[str]
) -> None:
    cli = Cli(build_host(hgx_h100()) / "nope", capsys)
    code, _, err = cli("bind", GPU)
    assert code == 1
    assert err.startswith("kubevirt-iommufd bind: error: host root")


@pytest.mark.parametrize(
    "argv",
    [["bind", GPU], ["unbind", GPU], ["bind", "--match", "10de:2204"], ["bind", "--from-config"]],
    ids=["bind", "unbind", "match", "from-config"],
)
def test_a_run_that_finds_the_lock_held_fails_at_once_naming_the_holder(
    cli: Cli, tmp_path: Path, argv: list[str]
) -> None:
    if argv[-1] == "--from-config":
        config = tmp_path / "reserved.yaml"
        config.write_text(f'devices:\n  - pciAddress: "{GPU}"\n')
        argv = [*argv, str(config)]
    lock_file = cli.root / LOCK_PATH
    with hold_binding_lock(cli.root, 0, who="unbind 0000:3b:00.0 (the other run)"):
        code, out, err = cli(*argv, "--wait", "0")
        json_code, document, _ = cli(*argv, "--json")
    assert (code, err, json_code) == (1, "", 1)
    assert out.splitlines()[-2] == f"{argv[0]}: refused; nothing was changed"
    assert re.fullmatch(
        rf"  another binding run holds {re.escape(str(lock_file))}: pid {os.getpid()} \(.+\),"
        r" unbind 0000:3b:00\.0 \(the other run\), since \d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ;"
        r" wait for it to finish, or pass --wait SECONDS",
        out.splitlines()[-1],
    )
    (refusal,) = json.loads(document)["refusals"]
    assert refusal["busy"] is True
    assert [(h["pid"], h["path"]) for h in refusal["holders"]] == [(os.getpid(), str(lock_file))]
    assert cli.kernel.writes == []


def test_a_waiting_run_names_the_holder_then_proceeds(cli: Cli) -> None:
    with held_elsewhere(cli.root, 0.5, "unbind 0000:3b:00.0") as other:
        code, out, err = cli("bind", GPU, "--wait", "10")
    assert code == 0
    assert out.splitlines()[-1] == "bind: done, 2 functions moved"
    (said,) = err.splitlines()
    assert said.startswith(
        f"kubevirt-iommufd bind: waiting up to 10 s for the binding lock, held by pid {other.pid} ("
    )
    assert "), unbind 0000:3b:00.0, since " in said


def test_the_wait_covers_the_lock_and_then_a_busy_device_together(cli: Cli) -> None:
    hold(cli.root, 4242, "nvidia-smi", "/dev/nvidia0")
    with held_elsewhere(cli.root, 0.5, "unbind 0000:3b:00.0"):
        code, out, err = cli("bind", GPU, "--wait", "1.5", "--json")
    document = json.loads(out)
    assert (code, document["result"]) == (1, "refused")
    assert "in use: pid 4242 (nvidia-smi)" in document["refusals"][0]["reason"]
    assert 1.5 <= document["waited_seconds"] < 3
    assert "waiting up to 1.5 s for the binding lock" in err


def test_a_dry_run_takes_no_lock(cli: Cli) -> None:
    with hold_binding_lock(cli.root, 0, who="bind --from-config"):
        code, out, err = cli("bind", GPU, "--dry-run")
    assert (code, err) == (0, "")
    assert "bind: dry run, 2 functions would move with these writes:" in out
