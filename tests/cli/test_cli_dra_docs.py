"""docs/dra.md's flag table is the one `kubevirt-iommufd dra --help` prints: every flag, no
other, each with its default."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

from kubevirt_iommufd.cli import build_parser

DOC = Path(__file__).resolve().parents[2] / "docs" / "dra.md"
ROW = re.compile(r"^\| `(--[a-z-]+)[^`]*` \| ([^|]+) \|", re.MULTILINE)


def dra_options() -> dict[str, argparse.Action]:
    commands = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    dra = commands.choices["dra"]
    return {
        a.option_strings[-1]: a
        for a in dra._actions
        if a.option_strings and a.option_strings[-1] != "--help"
    }


def documented_flags(text: str) -> dict[str, str]:
    section = text.split("### Flags", 1)[1].split("\n### ", 1)[0]
    return {flag: default.strip() for flag, default in ROW.findall(section)}


def test_every_flag_is_documented_with_its_default() -> None:
    documented = documented_flags(DOC.read_text())
    options = dra_options()
    assert sorted(documented) == sorted(options)
    for flag, action in options.items():
        if action.required:
            assert documented[flag] == "required", flag
        elif action.default is None:
            assert documented[flag] != "required", flag
        elif isinstance(action, argparse._StoreTrueAction):
            assert documented[flag] == "off", flag
        else:
            assert documented[flag].strip("`") == str(action.default).removesuffix(".0"), flag


def test_the_check_sees_a_missing_flag() -> None:
    text = DOC.read_text()
    without = re.sub(r"^\| `--state-dir.*\n", "", text, flags=re.MULTILINE)
    assert "--state-dir" in documented_flags(text)
    assert "--state-dir" not in documented_flags(without)
