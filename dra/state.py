"""The driver's memory of prepared claims, one JSON file per claim under the state directory.

A claim is recorded after its CDI spec and metadata are written and before the kubelet hears it
is prepared, so a retried call, or one after a restart of ours, gets the same answer and finds
the same devices taken; it is forgotten only after its files are gone. The files, not the memory,
are the truth: during a rolling update the other instance of the driver prepares and unprepares in
the same directory (`ClaimStore.refresh`), and marks each claim it unprepares
(`<run_dir>/unprepared/<uid>`), so a prepare of that claim in either instance that was already
reading it from the API server stops.

What each file must survive: a record is durable before NodePrepare answers and its removal
before NodeUnprepare answers (file and directory fsynced): a record lost to a power loss would
set a VM's devices free for another claim, and one coming back would hold them for a claim the
kubelet has let go of. An unprepared mark only needs to be seen by a prepare running at the same
time, which a reboot ends too: it lives in the run directory (a tmpfs, `--run-dir`), made or
grown without a sync. Releases before the run directory kept the marks under the state directory
(`<state_dir>/unprepared/`): those are still read, pruned, and for the first hour of a run (the
rolling update that started it, when an instance of such a release may run beside this one)
grown too where that directory is, so that neither instance misses the other's unprepare.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import stat
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeGuard

from hostdev.atomic_file import sync_directory, write_file_atomically
from hostdev.bdf import Bdf, is_bdf
from hostdev.directories import make_directories, make_private_directory
from hostdev.untrusted import quote_untrusted

log = logging.getLogger(__name__)
STATE_VERSION = 1
# Claim records and binding journals are root's alone: nobody else reads them, and nobody else may
# plant a file or a symbolic link among them.
RECORDS_MODE = 0o700
_MARKS_KEPT_SECONDS = 3600.0
# Old marks are looked for at most this often: not at every unprepare, which would read them all.
_MARKS_PRUNED_EVERY_SECONDS = 60.0
# Unprepared marks of the release before this one are grown for this long after a start (see the
# module's docstring); older marks go after it.
_PREVIOUS_MARKS_SECONDS = _MARKS_KEPT_SECONDS
# What a record's field holds when the record has no such key (JSON null is None).
_MISSING = object()


class StateError(Exception):
    """The state directory cannot be read or written; the message names the path."""


@dataclass(frozen=True, slots=True)
class PreparedDevice:
    """One device of a prepared claim, as recorded: what was asked (request, pool, device), the
    function it is, and what the kubelet hands the runtime for it."""

    request: str
    pool: str
    device: str
    bdf: Bdf
    cdi_ids: tuple[str, ...]
    group: int
    """The function's IOMMU group: no other claim may have a function of it."""


@dataclass(frozen=True, slots=True)
class PreparedSlot:
    """One iommufd slot of a prepared claim (dra.iommufd_slots): what was asked, and the CDI id
    of the claim's hand-off."""

    request: str
    pool: str
    device: str
    cdi_ids: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class PreparedClaim:
    uid: str
    namespace: str
    name: str
    devices: tuple[PreparedDevice, ...]
    files: tuple[str, ...]
    """Every file written for the claim (CDI spec, metadata), removed on unprepare."""
    slots: tuple[PreparedSlot, ...] = ()
    handoff: str = ""
    """The host path of the socket that hands the claim's pod its iommufd fd (claims with slots
    only); served once, so it may be gone while the claim stays prepared."""

    def to_json(self) -> dict[str, Any]:
        return {
            "version": STATE_VERSION,
            "uid": self.uid,
            "namespace": self.namespace,
            "name": self.name,
            "devices": [
                {
                    "request": d.request,
                    "pool": d.pool,
                    "device": d.device,
                    "bdf": str(d.bdf),
                    "cdiIds": list(d.cdi_ids),
                    "iommuGroup": d.group,
                }
                for d in self.devices
            ],
            "files": list(self.files),
            **self._handoff_json(),
        }

    @property
    def results(self) -> tuple[PreparedDevice | PreparedSlot, ...]:
        """Every device of the claim's allocation: its PCI devices, then its iommufd slots."""
        return (*self.devices, *self.slots)

    def _handoff_json(self) -> dict[str, Any]:
        # Only with slots: a claim without them is recorded as before the driver had slots.
        if not self.slots:
            return {}
        return {"slots": [_slot_json(s) for s in self.slots], "handoff": self.handoff}

    @classmethod
    def from_json(cls, data: object) -> PreparedClaim:
        """The record `to_json` wrote; any other JSON value raises ValueError naming the first
        field that is missing or of the wrong type."""
        record = _object(data, "the record")
        version = record.get("version", _MISSING)
        if not _is_int(version) or version != STATE_VERSION:
            raise ValueError(f"version: expected {STATE_VERSION}, found {_shown(version)}")
        return cls(
            uid=_text(record, "uid"),
            namespace=_text(record, "namespace"),
            name=_text(record, "name"),
            devices=tuple(
                _device(_object(item, f"devices[{index}]"), f"devices[{index}].")
                for index, item in enumerate(_array(record, "devices"))
            ),
            files=_texts(record, "files"),
            # Records written before the driver had iommufd slots have neither key.
            slots=tuple(
                _slot(_object(item, f"slots[{index}]"), f"slots[{index}].")
                for index, item in enumerate(_array(record, "slots") if "slots" in record else [])
            ),
            handoff=_text(record, "handoff") if "handoff" in record else "",
        )


def _device(record: dict[str, object], where: str) -> PreparedDevice:
    bdf = _text(record, "bdf", where)
    if not is_bdf(bdf):
        raise ValueError(f"{where}bdf: expected a PCI address, found {_shown(bdf)}")
    group = record.get("iommuGroup", _MISSING)
    if not _is_int(group) or group < 0:
        raise ValueError(f"{where}iommuGroup: expected a group number, found {_shown(group)}")
    return PreparedDevice(
        request=_text(record, "request", where),
        pool=_text(record, "pool", where),
        device=_text(record, "device", where),
        bdf=Bdf.parse(bdf),
        cdi_ids=_texts(record, "cdiIds", where),
        group=group,
    )


def _slot_json(slot: PreparedSlot) -> dict[str, Any]:
    return {
        "request": slot.request,
        "pool": slot.pool,
        "device": slot.device,
        "cdiIds": list(slot.cdi_ids),
    }


def _slot(record: dict[str, object], where: str) -> PreparedSlot:
    return PreparedSlot(
        request=_text(record, "request", where),
        pool=_text(record, "pool", where),
        device=_text(record, "device", where),
        cdi_ids=_texts(record, "cdiIds", where),
    )


def _object(value: object, where: str) -> dict[str, object]:
    if not isinstance(value, dict):
        raise ValueError(f"{where}: expected an object, found {_shown(value)}")
    return value


def _array(record: dict[str, object], key: str, where: str = "") -> list[object]:
    value = record.get(key, _MISSING)
    if not isinstance(value, list):
        raise ValueError(f"{where}{key}: expected an array, found {_shown(value)}")
    return value


def _text(record: dict[str, object], key: str, where: str = "") -> str:
    value = record.get(key, _MISSING)
    if not isinstance(value, str):
        raise ValueError(f"{where}{key}: expected a string, found {_shown(value)}")
    return value


def _texts(record: dict[str, object], key: str, where: str = "") -> tuple[str, ...]:
    values = _array(record, key, where)
    for index, value in enumerate(values):
        if not isinstance(value, str):
            raise ValueError(f"{where}{key}[{index}]: expected a string, found {_shown(value)}")
    return tuple(str(value) for value in values)


def _is_int(value: object) -> TypeGuard[int]:
    # JSON true is a Python bool, which is an int.
    return isinstance(value, int) and not isinstance(value, bool)


def _shown(value: object) -> str:
    """A JSON value in a one-line message: containers by their kind, scalars quoted short."""
    if value is _MISSING:
        return "nothing"
    if isinstance(value, dict | list):
        return "an object" if isinstance(value, dict) else "an array"
    if isinstance(value, str):
        return quote_untrusted(value, 40)
    return json.dumps(value)[:40]


class ClaimStore:
    """Prepared claims by UID, kept in memory and in `<state_dir>/claims/<uid>.json`; the
    unprepared marks in `<run_dir>/unprepared/`.

    The files are the truth: during a rolling update another instance of the driver prepares
    and unprepares claims in the same directory. `refresh` brings the memory up to the files,
    reading only the records that are new or changed since it last looked (by inode, size and
    times: a record is only ever replaced by a rename, never written in place)."""

    def __init__(self, state_dir: Path, run_dir: Path) -> None:
        self._dir = state_dir / "claims"
        self._unprepared = run_dir / "unprepared"
        self._previous_unprepared = state_dir / "unprepared"
        """Where releases before the run directory marked claims unprepared."""
        self._started = time.monotonic()
        self._claims: dict[str, PreparedClaim] = {}
        self._seen: dict[str, _Stamp] = {}
        """Record file name -> its stamp when last read, or written by us."""
        self._marks_pruned = -_MARKS_PRUNED_EVERY_SECONDS
        # The preparer writes while the publisher reads which groups are held, and a refresh
        # must not undo a save that came between its listing and its update.
        self._lock = threading.Lock()

    def load(self) -> None:
        """Make the records and marks directories and read every record. An unreadable one
        stops the driver (StateError naming the file): skipping it would set its devices free
        for another claim while a VM may have them."""
        for directory, what in (
            (self._dir, "claim records directory"),
            (self._unprepared, "unprepared marks directory"),
        ):
            try:
                make_private_directory(directory, RECORDS_MODE, what)
            except OSError as error:
                raise StateError(f"{what} {directory}: {error.strerror}") from error
        self.refresh()

    def refresh(self) -> bool:
        """Read what changed on disk; whether anything did. StateError as `load`."""
        with self._lock:
            stamps = _scan_stamps(self._dir)
            changed = False
            for name in [n for n in self._seen if n not in stamps]:
                del self._seen[name]
                self._claims.pop(name.removesuffix(".json"), None)
                changed = True
            for name, stamp in stamps.items():
                if self._seen.get(name) == stamp:
                    continue
                path = self._dir / name
                try:
                    claim = _read_record(path)
                except FileNotFoundError:
                    # Removed since the listing: the next refresh drops it.
                    continue
                except ValueError as error:
                    raise _unreadable(path, error) from error
                self._claims[claim.uid] = claim
                self._seen[name] = stamp
                changed = True
            return changed

    def get(self, uid: str) -> PreparedClaim | None:
        return self._claims.get(uid)

    def __iter__(self) -> Iterator[PreparedClaim]:
        return iter(self._snapshot())

    def _snapshot(self) -> list[PreparedClaim]:
        with self._lock:
            return list(self._claims.values())

    def held(self) -> tuple[frozenset[int], frozenset[Bdf]]:
        """The IOMMU groups and the functions prepared claims have."""
        records = [d for c in self._snapshot() for d in c.devices]
        return frozenset(d.group for d in records), frozenset(d.bdf for d in records)

    def save(self, claim: PreparedClaim) -> None:
        # Compact, for json's C encoder (an indent takes its pure-Python one, 5-8 times slower);
        # a person reads a record through `python -m json.tool` or `kubevirt-iommufd inspect`.
        data = json.dumps(claim.to_json(), separators=(",", ":")).encode()
        path = self._dir / f"{claim.uid}.json"
        with self._lock:
            try:
                write_file_atomically(path, data, 0o600, directory_mode=RECORDS_MODE)
                stamp = _stamp(path.stat())
            except OSError as error:
                raise StateError(
                    f"cannot record {claim.uid} in {self._dir}: {error.strerror}"
                ) from error
            self._claims[claim.uid] = claim
            self._seen[path.name] = stamp

    def forget(self, uid: str) -> None:
        path = self._dir / f"{uid}.json"
        with self._lock:
            try:
                path.unlink(missing_ok=True)
                sync_directory(self._dir)
            except OSError as error:
                raise StateError(f"cannot remove {path}: {error.strerror}") from error
            self._claims.pop(uid, None)
            self._seen.pop(path.name, None)

    def mark_unprepared(self, uid: str) -> None:
        """Note that the kubelet let go of a claim, for a prepare of it in any instance whose
        read of the claim from the API server is under way (`unprepared_mark` changes): that
        prepare must not go on. Marks older than an hour, far longer than any read may take, are
        removed (looked for once a minute)."""
        try:
            _append_mark(self._unprepared / uid)
            if time.monotonic() - self._started < _PREVIOUS_MARKS_SECONDS:
                _append_mark(self._previous_unprepared / uid, make_directory=False)
            if time.monotonic() - self._marks_pruned >= _MARKS_PRUNED_EVERY_SECONDS:
                self._marks_pruned = time.monotonic()
                self._prune_marks(time.time() - _MARKS_KEPT_SECONDS)
        except OSError as error:
            raise StateError(
                f"cannot mark {uid} unprepared in {self._unprepared}: {error.strerror}"
            ) from error

    def _prune_marks(self, cutoff: float) -> None:
        for mark in self._unprepared.iterdir():
            _remove_if_older(mark, cutoff)
        if time.monotonic() - self._started < _PREVIOUS_MARKS_SECONDS:
            return
        # No instance of the release before the run directory runs beside this one any more:
        # its marks go as they age, then their directory, and with it their cost.
        try:
            for mark in self._previous_unprepared.iterdir():
                _remove_if_older(mark, cutoff)
            self._previous_unprepared.rmdir()
        except FileNotFoundError:
            return
        except OSError as error:
            if error.errno not in (errno.ENOTEMPTY, errno.ENOTDIR):
                raise

    def unprepared_mark(self, uid: str) -> tuple[tuple[int, int] | None, ...]:
        """Changes whenever the claim is unprepared: its mark appears, or grows by a byte
        (`_append_mark`), here or where an instance of the release before the run directory
        marks it."""
        return _mark_of(self._unprepared / uid), _mark_of(self._previous_unprepared / uid)

    def follow(self, changed: Callable[[], None], stop: threading.Event, interval: float) -> None:
        """Until `stop`, refresh every `interval` seconds and call `changed` when another
        instance prepared or unprepared a claim: what is published follows what is held."""
        said = ""
        while not stop.wait(interval):
            try:
                if self.refresh():
                    changed()
                said = ""
            except StateError as error:
                # Said once, not every interval, until it is fixed or something else is wrong.
                if str(error) != said:
                    said = str(error)
                    log.error("re-reading the prepared claims failed: %s", error)


def _mark_of(mark: Path) -> tuple[int, int] | None:
    try:
        info = mark.lstat()
    except FileNotFoundError:
        return None
    except OSError as error:
        raise StateError(f"cannot read {mark}: {error.strerror}") from error
    return info.st_ino, info.st_size


def _append_mark(mark: Path, *, make_directory: bool = True) -> None:
    """Make `mark`, or make it a byte longer: a change no clock can hide (a filesystem that keeps
    whole seconds rounds a time set on it back to the one it had), in one file made and no rename
    (a mark needs no sync). O_NONBLOCK: a FIFO planted there must not hang the unprepare. Its
    directory is made again if someone removed it, unless `make_directory` is False: then no
    directory, no mark."""
    flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
    try:
        fd = os.open(mark, flags, 0o600)
    except FileNotFoundError:
        if not make_directory:
            return
        make_directories(mark.parent, RECORDS_MODE)
        fd = os.open(mark, flags, 0o600)
    except OSError as error:
        if error.errno != errno.ENXIO:  # a FIFO with no reader
            raise
        raise OSError(errno.EINVAL, "not a regular file") from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(errno.EINVAL, "not a regular file")
        os.write(fd, b"\n")
    finally:
        os.close(fd)


def _remove_if_older(mark: Path, cutoff: float) -> None:
    """A mark (or a link or file someone left among them) older than `cutoff` goes; a
    directory is not ours to remove and stays. One the other instance removed first is gone."""
    try:
        info = mark.lstat()
        if info.st_mtime < cutoff and not stat.S_ISDIR(info.st_mode):
            mark.unlink()
    except FileNotFoundError:
        return


_Stamp = tuple[int, int, int, int]
"""A record file's inode, size, mtime and ctime (ns)."""


def _stamp(info: os.stat_result) -> _Stamp:
    return info.st_ino, info.st_size, info.st_mtime_ns, info.st_ctime_ns


def _scan_stamps(directory: Path) -> dict[str, _Stamp]:
    """Each record file's stamp, by file name (one directory read and a stat per record)."""
    stamps: dict[str, _Stamp] = {}
    try:
        with os.scandir(directory) as entries:
            for entry in entries:
                if entry.name.endswith(".json"):
                    try:
                        stamps[entry.name] = _stamp(entry.stat(follow_symlinks=False))
                    except FileNotFoundError:
                        continue
    except OSError as error:
        raise StateError(f"state directory {directory}: {error.strerror}") from error
    return stamps


def _unreadable(path: Path, error: ValueError) -> StateError:
    return StateError(
        f"unreadable prepared-claim record {path}: {error}; check which device the"
        " claim had (kubevirt-iommufd inspect), then fix or remove the file"
    )


def read_prepared_claims(
    state_dir: Path, on_unreadable: Callable[[Path, str], None] | None = None
) -> tuple[PreparedClaim, ...]:
    """The prepared claims recorded under `state_dir` (none when it has no records), changing
    nothing. An unreadable record raises StateError naming the file and the fix, or, given
    `on_unreadable`, is handed to it (the file and what is wrong) and skipped."""
    directory = state_dir / "claims"
    try:
        paths = sorted(directory.glob("*.json"))
    except OSError as error:
        raise StateError(f"state directory {directory}: {error.strerror}") from error
    claims: list[PreparedClaim] = []
    for path in paths:
        try:
            claims.append(_read_record(path))
        except FileNotFoundError:
            continue  # unprepared since the listing
        except ValueError as error:
            if on_unreadable is None:
                raise _unreadable(path, error) from error
            on_unreadable(path, str(error))
    return tuple(claims)


def _read_record(path: Path) -> PreparedClaim:
    """One record; ValueError saying what is wrong with it, in one line (FileNotFoundError when
    it is gone: another instance unprepared its claim)."""
    try:
        data = json.loads(path.read_bytes())
    except FileNotFoundError:
        raise
    except OSError as error:
        raise ValueError(error.strerror) from error
    except RecursionError as error:
        raise ValueError("not JSON: nested too deeply") from error
    except ValueError as error:
        raise ValueError(f"not JSON: {error}") from error
    claim = PreparedClaim.from_json(data)
    if f"{claim.uid}.json" != path.name:
        raise ValueError(
            f"it records claim {quote_untrusted(claim.uid, 80)}, not the claim of its name"
        )
    return claim
