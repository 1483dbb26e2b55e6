"""One binding at a time: every writer of driver bindings on a node — `bind`/`unbind`, the
DaemonSet's init container (`bind --from-config`), the device plugin's reset after use and the
DRA driver's on-demand binding — holds an exclusive `flock` on one file on the host for its whole
transaction (read the host → plan → write → verify).

The file is `<root>/var/lib/kubevirt-iommufd/binding.lock`: on the host, beside the node's other
kubevirt-iommufd state, and mounted into every pod that binds or resets. `flock` locks belong to
the open file, so they work across processes, containers and threads alike, and the kernel drops
them when their holder dies. The holder writes who it is into the file (one JSON line: pid,
command, what it is doing, since when), so a run that has to wait can say for whom. The file is
never removed: a lock on a removed file would no longer exclude one taken on its replacement.

    with hold_binding_lock(root, wait_seconds=30, who="bind 0000:3b:00.0") as lock:
        ...  # read the host, plan and write under the lock
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

from hostdev.directories import make_directories
from hostdev.errors import HostdevError, RootNotFound

LOCK_PATH = "var/lib/kubevirt-iommufd/binding.lock"
"""Relative to the root (`/` on a node)."""
POLL_SECONDS = 0.05
_MAX_TEXT = 300
_NOBODY_YET = object()


@dataclass(frozen=True, slots=True)
class LockHolder:
    """Who holds the lock, as it wrote itself into the lock file."""

    pid: int
    command: str
    doing: str
    since: str
    """UTC, ISO 8601 to the second."""

    def __str__(self) -> str:
        return f"pid {self.pid} ({self.command}), {self.doing}, since {self.since}"


class BindingLockError(HostdevError):
    """The lock file cannot be opened or created."""


class BindingLockBusy(HostdevError):
    """Another run held the lock for longer than this one was willing to wait."""

    def __init__(self, path: Path, holder: LockHolder | None, waited: float) -> None:
        self.path = path
        self.holder = holder
        self.waited = waited
        whom = str(holder) if holder is not None else "another process (it has not said who)"
        after = f" after waiting {waited:.1f} s" if waited >= 0.05 else ""
        super().__init__(f"another binding run holds {path}{after}: {whom}")


@dataclass(frozen=True, slots=True)
class BindingLock:
    """A held lock, for the duration of `hold_binding_lock`'s block."""

    path: Path
    fd: int
    waited: float
    """Seconds spent waiting for it."""

    def note(self, doing: str) -> None:
        """Say what the holder is doing now, for anyone waiting."""
        _write_holder(self.fd, doing)


@contextmanager
def hold_binding_lock(
    root: Path,
    wait_seconds: float,
    *,
    who: str,
    on_wait: Callable[[LockHolder | None], None] | None = None,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> Iterator[BindingLock]:
    """Hold the node's binding lock for the block.

    `who` says what this run is doing ("bind 0000:3b:00.0"), for waiters. While another run holds
    the lock, `on_wait` is called with its holder (again whenever the holder changes) and the lock
    is tried every 50 ms until `wait_seconds` have passed; then `BindingLockBusy` names the holder.
    `wait_seconds=0` tries once. Raises `BindingLockError` when the file cannot be opened (a
    read-only or missing host directory), `RootNotFound` when `root` is not a directory.
    """
    path = Path(root) / LOCK_PATH
    fd = _open_lock_file(Path(root), path)
    try:
        waited = _acquire(fd, path, wait_seconds, on_wait, clock, sleep)
        try:
            _write_holder(fd, who)
            yield BindingLock(path, fd, waited)
        finally:
            # Emptied before the unlock, so a waiter never reads a finished run as the holder.
            os.ftruncate(fd, 0)
            fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


def read_lock_holder(root: Path) -> LockHolder | None:
    """The holder named in the lock file, or None when it names none (free, or just taken)."""
    try:
        text = (Path(root) / LOCK_PATH).read_text(encoding="utf-8", errors="replace")
    except OSError:
        return None
    return parse_lock_holder(text)


def parse_lock_holder(text: str) -> LockHolder | None:
    try:
        data = json.loads(text)
    except (ValueError, RecursionError):
        return None
    if not isinstance(data, dict):
        return None
    pid, command, doing, since = (data.get(k) for k in ("pid", "command", "doing", "since"))
    if not isinstance(pid, int) or isinstance(pid, bool):
        return None
    return LockHolder(pid, _text(command), _text(doing), _text(since))


def _open_lock_file(root: Path, path: Path) -> int:
    if not root.is_dir():
        raise RootNotFound(str(root))
    try:
        make_directories(path.parent, 0o755)
        return os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o644)
    except OSError as error:
        raise BindingLockError(
            f"cannot open the binding lock {path}: {error.strerror or error}; run as root, and in"
            f" a container mount the host's /{Path(LOCK_PATH).parent} there, writable"
        ) from error


def _acquire(
    fd: int,
    path: Path,
    wait_seconds: float,
    on_wait: Callable[[LockHolder | None], None] | None,
    clock: Callable[[], float],
    sleep: Callable[[float], None],
) -> float:
    start = clock()
    announced: object = _NOBODY_YET
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return clock() - start
        except OSError as error:
            if error.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise BindingLockError(f"cannot lock {path}: {error.strerror or error}") from error
        holder = _read_fd_holder(fd)
        waited = clock() - start
        if waited >= wait_seconds:
            raise BindingLockBusy(path, holder, min(waited, wait_seconds))
        # Said once when the wait starts, again when another run takes over; a holder that has
        # not written itself yet (None) is not news after the first time.
        if on_wait is not None and (
            announced is _NOBODY_YET or (holder is not None and holder != announced)
        ):
            on_wait(holder)
            announced = holder
        sleep(min(POLL_SECONDS, wait_seconds - waited))


def _read_fd_holder(fd: int) -> LockHolder | None:
    try:
        return parse_lock_holder(os.pread(fd, 4096, 0).decode("utf-8", errors="replace"))
    except OSError:
        return None


def _write_holder(fd: int, doing: str) -> None:
    record = {
        "pid": os.getpid(),
        "command": _text(" ".join([Path(sys.argv[0]).name, *sys.argv[1:]]) if sys.argv else ""),
        "doing": _text(doing),
        "since": datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
    }
    data = (json.dumps(record) + "\n").encode()
    os.ftruncate(fd, 0)
    os.pwrite(fd, data, 0)


def _text(value: object) -> str:
    """One short printable line: the file is written by root, but a waiter prints it."""
    text = value if isinstance(value, str) else ""
    cleaned = "".join(c if c.isprintable() else "?" for c in text)
    return cleaned if len(cleaned) <= _MAX_TEXT else cleaned[: _MAX_TEXT - 1] + "…"
