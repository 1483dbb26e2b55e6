"""Binding journal entries of any JSON shape are reported by name at start, never a traceback,
and their functions are not taken for free while an entry is unreadable."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import pytest

from dra.binding import BindingError, JournalEntry, OnDemandBinder
from hostdev.bdf import Bdf
from hostdev.binding.bind import HostAccess
from sim.host import BuildHost, hgx_h100

UID = "a1b2c3d4-0000-4000-8000-000000000001"
GOOD = {
    "claimUID": UID,
    "phase": "bound",
    "resetAfterUse": False,
    "moved": [{"bdf": "0000:18:00.0", "driver": "nvidia", "override": None}],
}
SHAPES = {
    "null": "null",
    "list": "[]",
    "string": '"bound"',
    "number": "5",
    "deep": "[" * 100_000 + "]" * 100_000,
    "not-json": "{",
    "phase-unknown": json.dumps({**GOOD, "phase": "done"}),
    "uid-number": json.dumps({**GOOD, "claimUID": 5}),
    "moved-object": json.dumps({**GOOD, "moved": {"bdf": "0000:18:00.0"}}),
    "moved-null-item": json.dumps({**GOOD, "moved": [None]}),
    "driver-number": json.dumps({**GOOD, "moved": [{"bdf": "0000:18:00.0", "driver": 5}]}),
    "bdf-bad": json.dumps({**GOOD, "moved": [{"bdf": "../../etc"}]}),
    "reset-string": json.dumps({**GOOD, "resetAfterUse": "no"}),
    "requested-numbers": json.dumps({**GOOD, "requested": [1, 2]}),
}


def test_a_good_entry_reads_back() -> None:
    entry = JournalEntry.from_json(GOOD)
    assert (entry.claim_uid, entry.phase, entry.reset_after_use) == (UID, "bound", False)
    assert JournalEntry.from_json(entry.to_json()) == entry


@pytest.mark.parametrize("text", SHAPES.values(), ids=SHAPES.keys())
def test_an_entry_of_any_other_shape_is_named_at_start(
    build_host: BuildHost, tmp_path: Path, text: str
) -> None:
    journal = tmp_path / "bindings"
    journal.mkdir()
    path = journal / f"{UID}.json"
    path.write_text(text)
    binder = OnDemandBinder(HostAccess(root=build_host(hgx_h100())), journal)
    assert binder.recover([]) == [f"unreadable binding journal {path}: " + _reason(text)]
    assert path.exists()
    with pytest.raises(BindingError, match=f"binding journal {path} is unreadable"):
        binder.holds(UID)
    assert binder.journaled() == {}


def _reason(text: str) -> str:
    """The line names the file; what follows is the reader's own reason, whatever it is."""
    try:
        JournalEntry.from_json(json.loads(text))
    except (ValueError, RecursionError) as error:
        return f"{error}; left for a person"
    raise AssertionError("the shape was read")


def _listings(monkeypatch: pytest.MonkeyPatch) -> list[Path]:
    """Every listing of the journal directory the binder makes from now on."""
    listed: list[Path] = []
    real = os.listdir

    def counted(path: Any) -> list[str]:
        listed.append(Path(path))
        return real(path)

    monkeypatch.setattr(os, "listdir", counted)
    return listed


def test_the_journal_is_listed_again_only_when_it_changed(
    build_host: BuildHost, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Prepares look at the journal up to three times each: a directory that has not changed
    since well before the last listing is not listed again, and any entry written or removed
    since (by this instance or another) is seen at the next look."""
    journal = tmp_path / "bindings"
    journal.mkdir()
    long_ago = time.time() - 60
    os.utime(journal, (long_ago, long_ago))
    binder = OnDemandBinder(HostAccess(root=build_host(hgx_h100())), journal)
    listed = _listings(monkeypatch)
    assert binder.journaled() == {} and binder.recover([UID], others_only=True) == []
    assert listed == [journal]
    (journal / f"{UID}.json").write_text(json.dumps(GOOD))
    assert binder.journaled() == {Bdf.parse("0000:18:00.0"): UID}
    (journal / f"{UID}.json").unlink()
    assert binder.journaled() == {}


def test_a_journal_changed_within_the_last_second_is_listed_at_every_look(
    build_host: BuildHost, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A change in the same clock tick as a listing may leave the directory's stamp as it was:
    until the stamp is a second old, every look lists the directory."""
    journal = tmp_path / "bindings"
    journal.mkdir()
    binder = OnDemandBinder(HostAccess(root=build_host(hgx_h100())), journal)
    listed = _listings(monkeypatch)
    assert binder.journaled() == {} and binder.journaled() == {}
    assert listed == [journal, journal]
