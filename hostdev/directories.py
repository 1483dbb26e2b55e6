"""Directories the node's daemons write into as root: made with an exact mode whatever the
umask, and refused when another user could write into them — a user who can write into a
directory root writes into can plant a symlink there and have root write through it."""

from __future__ import annotations

import os
import stat
from pathlib import Path

from hostdev.errors import HostdevError


class UnsafeDirectory(HostdevError):
    """A directory the daemon must write into is not safe to write into; the message names it,
    what is wrong and the fix."""


def make_directories(path: Path, mode: int) -> None:
    """Create `path` and its missing parents with exactly `mode`; directories that exist are
    left as they are (check them with `check_private_directory`)."""
    missing: list[Path] = []
    current = path
    while not _exists(current):
        missing.append(current)
        if current.parent == current:
            break
        current = current.parent
    for directory in reversed(missing):
        try:
            directory.mkdir(mode)
        except FileExistsError:
            continue
        # mkdir's mode passes through the umask; the exact mode is set on what was just made,
        # opened without following a link.
        fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
        try:
            os.fchmod(fd, mode)
        finally:
            os.close(fd)


def check_private_directory(path: Path, what: str, fix: str) -> None:
    """Refuse `path` unless it is a real directory owned by root or by us that no other user can
    write into. `what` names it for a person (`state directory`), `fix` says what to change."""
    try:
        info = os.lstat(path)
    except OSError as error:
        raise UnsafeDirectory(f"{what} {path}: {error.strerror}; {fix}") from error
    problem = _problem(info)
    if problem is not None:
        raise UnsafeDirectory(f"{what} {path} {problem}; {fix}")


def make_private_directory(path: Path, mode: int, what: str, fix: str = "") -> None:
    """`make_directories`, then `check_private_directory`: what the daemon writes into at start.
    Without `fix`, the message says what the directory must be (`private_directory_fix`)."""
    make_directories(path, mode)
    check_private_directory(path, what, fix or private_directory_fix(mode))


def private_directory_fix(mode: int) -> str:
    """What a directory refused by `check_private_directory` must be instead."""
    return f"make it a real directory owned by root with mode {mode:04o}"


def _problem(info: os.stat_result) -> str | None:
    if stat.S_ISLNK(info.st_mode):
        return "is a symbolic link"
    if not stat.S_ISDIR(info.st_mode):
        return "is not a directory"
    if info.st_uid not in (0, os.geteuid()):
        return f"is owned by uid {info.st_uid}, not by root or by this process"
    if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return f"is writable by other users (mode {stat.S_IMODE(info.st_mode):04o})"
    return None


def _exists(path: Path) -> bool:
    try:
        os.lstat(path)
    except FileNotFoundError:
        return False
    return True
