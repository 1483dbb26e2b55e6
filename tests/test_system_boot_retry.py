"""The system test's harness boots again when the emulator, not the code under test, ended a run.

QEMU 10.0's TCG sometimes aborted early in the boot (docs/system-test.md); a CI run must not fail
by chance. tests/system/run.py is driven here with a stand-in for vng (a script that plays one
scripted boot per call), through the same pipe and parsing as a real boot.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

RUN_PY = Path(__file__).resolve().parent / "system" / "run.py"
ASSERTION = (
    "qemu-system-x86_64: system/physmem.c:2678: iotlb_to_section: Assertion"
    " 'section_index < d->map.sections_nb' failed."
)
REPORT = {
    "kernel": "6.12.118",
    "qemu": "QEMU emulator version 10.0.2",
    "uptime_at_start": 20.0,
    "loop_ms": 150.0,
    "host_loop_ms": 7.0,
    "devices": [],
    "checks": [{"name": "find 2 edu devices", "ok": True, "seconds": 0.0, "detail": ""}],
}


@pytest.fixture(scope="module")
def run() -> Iterator[ModuleType]:
    """tests/system/run.py, loaded from its file (tests/system is no package on sys.path)."""
    name = "system_test_run"
    spec = importlib.util.spec_from_file_location(name, RUN_PY)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # its dataclasses look their module up there
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        del sys.modules[name]


def fake_vng(tmp_path: Path, boots: list[str]) -> Path:
    """A vng that prints the next scripted boot's output and exits with its code."""
    script = tmp_path / "vng"
    plays = tmp_path / "plays.json"
    plays.write_text(json.dumps(boots))
    counter = tmp_path / "count"
    counter.write_text("0")
    script.write_text(
        f"#!{sys.executable}\n"
        "import json, sys\n"
        f"n = int(open({str(counter)!r}).read())\n"
        f"open({str(counter)!r}, 'w').write(str(n + 1))\n"
        f"output, _, code = json.load(open({str(plays)!r}))[n].rpartition('|exit ')\n"
        "sys.stdout.write(output)\n"
        "sys.exit(int(code))\n"
    )
    script.chmod(0o755)
    return script


def crash(before_guest: bool = True) -> str:
    started = "" if before_guest else "SYSTEM-TEST-GUEST-STARTED\n"
    return f"SeaBIOS\n{started}{ASSERTION}\n|exit 1"


def good() -> str:
    report = json.dumps(REPORT)
    return f"SYSTEM-TEST-GUEST-STARTED\n--- checks\nSYSTEM-TEST-REPORT {report}\n|exit 0"


def boots_of(run: Any, tmp_path: Path, plays: list[str]) -> list[Any]:
    vng = fake_vng(tmp_path, plays)
    guest = run.Guest(edu=2, bind="sysfs", strict=False, chroot=tmp_path / "libvirt-chroot")
    boots: list[Any] = run.boot_until_the_guest_reports(vng, tmp_path / "bzImage", guest, 60.0)
    return boots


def test_an_emulator_crash_before_the_guest_started_is_booted_again(
    run: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    boots = boots_of(run, tmp_path, [crash(), good()])
    assert [(b.code, b.guest_started, b.retriable) for b in boots] == [
        (1, False, True),
        (0, True, False),
    ]
    assert boots[0].qemu_error == ASSERTION
    capsys.readouterr()
    assert run.print_report(boots, None, tmp_path / "bzImage") is True
    report = capsys.readouterr().out
    assert "retried: this is boot attempt 2 of at most 3" in report
    assert "attempt 1: vng exit 1 after " in report
    assert f"before the guest started: {ASSERTION}" in report
    assert report.rstrip().endswith("RESULT: PASS")


def test_a_qemu_abort_after_the_guest_started_is_booted_again(run: Any, tmp_path: Path) -> None:
    boots = boots_of(run, tmp_path, [crash(before_guest=False), good()])
    assert [b.retriable for b in boots] == [True, False]


def test_a_guest_that_ends_without_a_report_is_not_booted_again(run: Any, tmp_path: Path) -> None:
    """A guest-side failure is the code under test's: reported at once, never retried away."""
    boots = boots_of(run, tmp_path, ["SYSTEM-TEST-GUEST-STARTED\nTraceback\n|exit 1", good()])
    assert len(boots) == 1
    assert boots[0].report is None and not boots[0].retriable


def test_three_crashes_fail_the_run(
    run: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    boots = boots_of(run, tmp_path, [crash(), crash(), crash(), good()])
    assert len(boots) == 3
    capsys.readouterr()
    assert run.print_report(boots, None, tmp_path / "bzImage") is False
    report = capsys.readouterr().out
    assert "no report from the guest (vng exit code 1)" in report
    assert report.count("before the guest started") == 2
    assert report.rstrip().endswith("RESULT: FAIL")
