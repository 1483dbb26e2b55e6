"""The prepared-claim records: read back exactly as written, any other JSON refused with one line
naming the file and the field, and their directory made root's alone whatever the umask."""

from __future__ import annotations

import json
import os
import stat
import time
from pathlib import Path

import pytest

from dra.state import ClaimStore, PreparedClaim, StateError, read_prepared_claims
from hostdev.directories import UnsafeDirectory
from prepared_records_kit import BAD_RECORDS, UID, good_record, with_field, write_record

SOCKET = "/var/lib/kubevirt-iommufd/dra/iommufd/iommufd-x.sock"
SLOT = {"request": "iommufd", "pool": "node-a", "device": "iommufd-0", "cdiIds": ["k/c=x"]}
FIX = "check which device the claim had (kubevirt-iommufd inspect), then fix or remove the file"


def test_a_record_reads_back_as_written() -> None:
    claim = PreparedClaim.from_json(good_record())
    assert claim.to_json() == good_record()
    assert str(claim.devices[0].bdf) == "0000:18:00.0"


def test_a_record_with_iommufd_slots_reads_back_as_written() -> None:
    """A claim on iommufd slots records them and its socket; a record without (written before
    the driver had slots, or of a claim without any) reads back with none."""
    assert PreparedClaim.from_json(good_record()).slots == ()
    assert "slots" not in good_record() and "handoff" not in good_record()
    record = good_record() | {"slots": [SLOT], "handoff": SOCKET}
    claim = PreparedClaim.from_json(record)
    assert claim.to_json() == record
    (slot,) = claim.slots
    assert (slot.request, slot.device, claim.handoff) == ("iommufd", "iommufd-0", SOCKET)
    assert [d.device for d in claim.results] == [claim.devices[0].device, "iommufd-0"]


@pytest.mark.parametrize(
    ("data", "problem"),
    [
        (None, "the record: expected an object, found null"),
        ([], "the record: expected an object, found an array"),
        ("claim", "the record: expected an object, found 'claim'"),
        (3.5, "the record: expected an object, found 3.5"),
        (True, "the record: expected an object, found true"),
        ({}, "version: expected 1, found nothing"),
        (with_field("version", True), "version: expected 1, found true"),
        (with_field("version", "1"), "version: expected 1, found '1'"),
        (with_field("version", 2), "version: expected 1, found 2"),
        (with_field("uid", 7), "uid: expected a string, found 7"),
        (with_field("namespace", None), "namespace: expected a string, found null"),
        (with_field("name", ["vm"]), "name: expected a string, found an array"),
        (with_field("devices", "gpu"), "devices: expected an array, found 'gpu'"),
        (with_field("devices", [None]), "devices[0]: expected an object, found null"),
        (with_field("devices", ["gpu"]), "devices[0]: expected an object, found 'gpu'"),
        (with_field("files", {"a": 1}), "files: expected an array, found an object"),
        (with_field("files", ["/a", 1]), "files[1]: expected a string, found 1"),
        (with_field("slots", "x"), "slots: expected an array, found 'x'"),
        (with_field("slots", [SLOT | {"device": 0}]), "slots[0].device: expected a string"),
        (with_field("handoff", 7), "handoff: expected a string, found 7"),
        (
            with_field("bdf", "../../x", in_device=True),
            "devices[0].bdf: expected a PCI address, found '../../x'",
        ),
        (with_field("bdf", 24, in_device=True), "devices[0].bdf: expected a string, found 24"),
        (with_field("request", {}, in_device=True), "devices[0].request: expected a string"),
        (with_field("cdiIds", "x", in_device=True), "devices[0].cdiIds: expected an array"),
        (with_field("cdiIds", [None], in_device=True), "devices[0].cdiIds[0]: expected a string"),
        (
            with_field("iommuGroup", "3", in_device=True),
            "devices[0].iommuGroup: expected a group number, found '3'",
        ),
        (
            with_field("iommuGroup", False, in_device=True),
            "devices[0].iommuGroup: expected a group number, found false",
        ),
        (
            with_field("iommuGroup", -1, in_device=True),
            "devices[0].iommuGroup: expected a group number, found -1",
        ),
        (
            with_field("iommuGroup", 1.5, in_device=True),
            "devices[0].iommuGroup: expected a group number, found 1.5",
        ),
        (
            with_field("bdf", "0000:18:00.0\nforged line", in_device=True),
            "devices[0].bdf: expected a PCI address, found '0000:18:00.0\\nforged line'",
        ),
    ],
    # The field and what it holds: `dict-devices[0].bdf-expected a PCI address, found 24`.
    ids=lambda value: value.replace(": ", "-") if isinstance(value, str) else type(value).__name__,
)
def test_any_other_json_value_is_a_value_error_naming_the_field(data: object, problem: str) -> None:
    with pytest.raises(ValueError) as caught:
        PreparedClaim.from_json(data)
    assert str(caught.value).startswith(problem)
    assert "\n" not in str(caught.value)


@pytest.mark.parametrize("shape", sorted(BAD_RECORDS))
def test_the_store_refuses_a_bad_record_with_one_line_naming_the_file(
    tmp_path: Path, shape: str
) -> None:
    text, problem = BAD_RECORDS[shape]
    path = write_record(tmp_path, text)
    with pytest.raises(StateError) as caught:
        ClaimStore(tmp_path, tmp_path / "run").load()
    assert str(caught.value) == f"unreadable prepared-claim record {path}: {problem}; {FIX}"


@pytest.mark.parametrize(
    ("content", "problem"),
    [
        (b"{not json", "not JSON: Expecting property name enclosed in double quotes"),
        (b'{"uid": "\xff"}', "not JSON: 'utf-8' codec can't decode byte 0xff"),
        (b"[" * 100_000 + b"]" * 100_000, "not JSON: nested too deeply"),
        (b"", "not JSON: Expecting value: line 1 column 1 (char 0)"),
    ],
    ids=["broken", "not-utf8", "deep", "empty"],
)
def test_a_record_that_is_not_json_is_refused(tmp_path: Path, content: bytes, problem: str) -> None:
    path = write_record(tmp_path, "")
    path.write_bytes(content)
    with pytest.raises(StateError) as caught:
        read_prepared_claims(tmp_path)
    assert str(caught.value).startswith(f"unreadable prepared-claim record {path}: {problem}")
    assert "\n" not in str(caught.value)


def test_a_record_under_another_claims_name_is_refused(tmp_path: Path) -> None:
    other = "a1b2c3d4-0000-4000-8000-0000000000bb"
    path = write_record(tmp_path, json.dumps(good_record(other)))
    with pytest.raises(StateError) as caught:
        read_prepared_claims(tmp_path)
    assert str(caught.value) == (
        f"unreadable prepared-claim record {path}: it records claim '{other}', not the claim of"
        f" its name; {FIX}"
    )


def test_a_reader_given_somewhere_to_report_skips_bad_records(tmp_path: Path) -> None:
    good = "a1b2c3d4-0000-4000-8000-0000000000cc"
    write_record(tmp_path, json.dumps(good_record(good)), good)
    bad = write_record(tmp_path, "null")
    skipped: list[tuple[Path, str]] = []
    claims = read_prepared_claims(tmp_path, lambda path, why: skipped.append((path, why)))
    assert [c.uid for c in claims] == [good]
    assert skipped == [(bad, "the record: expected an object, found null")]


@pytest.mark.usefixtures("open_umask")
def test_the_records_directory_and_records_are_roots_alone_under_umask_000(
    tmp_path: Path,
) -> None:
    store = ClaimStore(tmp_path / "state", tmp_path / "run")
    store.load()
    store.save(PreparedClaim.from_json(good_record()))
    claims = tmp_path / "state" / "claims"
    assert stat.S_IMODE(claims.stat().st_mode) == 0o700
    assert stat.S_IMODE((claims / f"{UID}.json").stat().st_mode) == 0o600
    # Taken away while running (a careless clean-up): made again with the same mode.
    (claims / f"{UID}.json").unlink()
    claims.rmdir()
    store.save(PreparedClaim.from_json(good_record()))
    assert stat.S_IMODE(claims.stat().st_mode) == 0o700


@pytest.mark.parametrize("mode", [0o777, 0o770], ids=oct)
def test_a_records_directory_others_can_write_is_refused(tmp_path: Path, mode: int) -> None:
    claims = tmp_path / "claims"
    claims.mkdir()
    claims.chmod(mode)
    with pytest.raises(UnsafeDirectory) as caught:
        ClaimStore(tmp_path, tmp_path / "run").load()
    assert str(caught.value) == (
        f"claim records directory {claims} is writable by other users (mode {mode:04o}); make it"
        " a real directory owned by root with mode 0700"
    )


def test_a_symlinked_records_directory_is_refused(tmp_path: Path) -> None:
    (tmp_path / "elsewhere").mkdir(mode=0o700)
    (tmp_path / "claims").symlink_to(tmp_path / "elsewhere")
    with pytest.raises(UnsafeDirectory, match="claims is a symbolic link; make it a real"):
        ClaimStore(tmp_path, tmp_path / "run").load()
    assert not list((tmp_path / "elsewhere").iterdir())


def test_marking_unprepared_ignores_what_else_lies_among_old_marks(tmp_path: Path) -> None:
    # A directory or a link someone left among the marks, an hour old: the sweep of old marks
    # must neither fail the unprepare (the kubelet would retry it for ever) nor follow the link.
    store = ClaimStore(tmp_path, tmp_path / "run")
    store.load()
    store.mark_unprepared("first")
    marks = tmp_path / "run" / "unprepared"
    (marks / "a-directory").mkdir()
    (marks / "a-directory" / "inside").write_bytes(b"")
    target = tmp_path / "outside"
    target.write_bytes(b"kept")
    (marks / "a-link").symlink_to(target)
    old = time.time() - 7200
    for path in (marks / "first", marks / "a-directory", marks / "a-link"):
        os.utime(path, (old, old), follow_symlinks=False)
    # Old marks are pruned at most once a minute: this unprepare comes a minute later.
    monotonic = time.monotonic
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(time, "monotonic", lambda: monotonic() + 61)
        store.mark_unprepared("second")
    assert sorted(p.name for p in marks.iterdir()) == ["a-directory", "second"]
    assert target.read_bytes() == b"kept"
    assert store.unprepared_mark("second") != (None, None)


def test_each_unprepare_changes_the_mark_even_within_one_tick_of_the_clock(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A prepare compares the mark before and after its read of the claim: a second unprepare
    of the claim must change it even when the clock has not moved."""
    store = ClaimStore(tmp_path, tmp_path / "run")
    store.load()
    assert store.unprepared_mark("claim") == (None, None)
    monkeypatch.setattr(time, "time_ns", lambda: 1_000_000_000)
    store.mark_unprepared("claim")
    first = store.unprepared_mark("claim")
    store.mark_unprepared("claim")
    second = store.unprepared_mark("claim")
    assert (None, None) != first != second != (None, None)
    assert oct((tmp_path / "run" / "unprepared").stat().st_mode & 0o777) == "0o700"
    assert oct((tmp_path / "run" / "unprepared" / "claim").stat().st_mode & 0o777) == "0o600"


def test_each_unprepare_changes_the_mark_on_a_filesystem_with_coarse_timestamps(
    tmp_path: Path,
) -> None:
    """ext4 with 128-byte inodes, vfat and some NFS exports keep whole (or 2) seconds: the kernel
    rounds a time set on the mark down to that, so a mark told apart by its time alone would not
    change. Here each time is put back as such a filesystem would keep it."""
    store = ClaimStore(tmp_path, tmp_path / "run")
    store.load()
    mark = tmp_path / "run" / "unprepared" / "claim"
    store.mark_unprepared("claim")
    kept = mark.stat().st_mtime_ns // 1_000_000_000 * 1_000_000_000
    os.utime(mark, ns=(kept, kept))
    first = store.unprepared_mark("claim")
    store.mark_unprepared("claim")
    os.utime(mark, ns=(kept, kept))
    second = store.unprepared_mark("claim")
    assert (None, None) != first != second != (None, None)


def test_a_fifo_planted_as_the_mark_does_not_hang_the_unprepare(tmp_path: Path) -> None:
    """Opening a FIFO for writing waits for a reader, with the serialize lock held."""
    store = ClaimStore(tmp_path, tmp_path / "run")
    store.load()
    store.mark_unprepared("other")
    os.mkfifo(tmp_path / "run" / "unprepared" / "claim")
    with pytest.raises(StateError, match="not a regular file"):
        store.mark_unprepared("claim")


def _an_hour_later(patch: pytest.MonkeyPatch) -> None:
    monotonic = time.monotonic
    patch.setattr(time, "monotonic", lambda: monotonic() + 3601)


def test_marks_of_the_release_before_the_run_directory_are_seen_and_grown_during_its_update(
    tmp_path: Path,
) -> None:
    """During the rolling update from the release that marked claims under the state directory,
    each instance must see the other's unprepare: this one reads those marks too, and grows them
    where that release made their directory (it makes it at its first unprepare)."""
    store = ClaimStore(tmp_path / "state", tmp_path / "run")
    store.load()
    previous = tmp_path / "state" / "unprepared"
    before = store.unprepared_mark("claim")
    previous.mkdir(mode=0o700)
    (previous / "claim").write_bytes(b"\n")  # the previous release's unprepare
    seen = store.unprepared_mark("claim")
    assert before != seen
    store.mark_unprepared("claim")
    after = store.unprepared_mark("claim")
    assert seen != after
    assert (previous / "claim").read_bytes() == b"\n\n"
    assert (tmp_path / "run" / "unprepared" / "claim").read_bytes() == b"\n"


def test_without_their_directory_no_marks_are_made_where_the_previous_release_kept_them(
    tmp_path: Path,
) -> None:
    store = ClaimStore(tmp_path / "state", tmp_path / "run")
    store.load()
    store.mark_unprepared("claim")
    assert not (tmp_path / "state" / "unprepared").exists()
    assert [p.name for p in (tmp_path / "run" / "unprepared").iterdir()] == ["claim"]


def test_an_hour_after_the_start_marks_of_the_previous_release_go_as_they_age(
    tmp_path: Path,
) -> None:
    store = ClaimStore(tmp_path / "state", tmp_path / "run")
    store.load()
    previous = tmp_path / "state" / "unprepared"
    previous.mkdir(mode=0o700)
    for name in ("old", "young"):
        (previous / name).write_bytes(b"\n")
    old = time.time() - 7200
    os.utime(previous / "old", (old, old))
    with pytest.MonkeyPatch.context() as patch:
        _an_hour_later(patch)
        store.mark_unprepared("claim")
        assert [p.name for p in previous.iterdir()] == ["young"]
        (previous / "young").unlink()
        _an_hour_later(patch)
        store.mark_unprepared("other")
    # Empty, and nobody needs it: gone, and with it the second file each unprepare made.
    assert not previous.exists()
    assert sorted(p.name for p in (tmp_path / "run" / "unprepared").iterdir()) == [
        "claim",
        "other",
    ]


@pytest.mark.usefixtures("open_umask")
def test_marks_are_roots_alone_under_umask_000_and_a_symlinked_marks_directory_is_refused(
    tmp_path: Path,
) -> None:
    store = ClaimStore(tmp_path / "state", tmp_path / "run")
    store.load()
    store.mark_unprepared("claim")
    marks = tmp_path / "run" / "unprepared"
    assert stat.S_IMODE(marks.stat().st_mode) == 0o700
    assert stat.S_IMODE((marks / "claim").stat().st_mode) == 0o600
    (tmp_path / "elsewhere").mkdir(mode=0o700)
    (marks / "claim").unlink()
    marks.rmdir()
    marks.symlink_to(tmp_path / "elsewhere")
    with pytest.raises(UnsafeDirectory, match="unprepared is a symbolic link; make it a real"):
        ClaimStore(tmp_path / "state", tmp_path / "run").load()
