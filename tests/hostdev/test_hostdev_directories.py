"""Directories made with an exact mode whatever the umask, and refused when others can write."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from hostdev.directories import (
    UnsafeDirectory,
    check_private_directory,
    make_directories,
    make_private_directory,
)


def mode_of(path: Path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


@pytest.mark.usefixtures("open_umask")
def test_new_directories_get_the_exact_mode_under_umask_000(tmp_path: Path) -> None:
    make_directories(tmp_path / "a" / "b" / "c", 0o750)
    assert [mode_of(tmp_path / p) for p in ("a", "a/b", "a/b/c")] == [0o750] * 3


def test_existing_directories_are_left_as_they_are(tmp_path: Path) -> None:
    (tmp_path / "a").mkdir()
    (tmp_path / "a").chmod(0o711)
    make_directories(tmp_path / "a" / "b", 0o700)
    assert (mode_of(tmp_path / "a"), mode_of(tmp_path / "a" / "b")) == (0o711, 0o700)


@pytest.mark.parametrize("mode", [0o777, 0o775, 0o757, 0o1777], ids=oct)
def test_a_directory_others_can_write_is_refused(tmp_path: Path, mode: int) -> None:
    directory = tmp_path / "state"
    directory.mkdir()
    directory.chmod(mode)
    with pytest.raises(UnsafeDirectory) as caught:
        check_private_directory(directory, "state directory", "chmod go-w it")
    assert str(caught.value) == (
        f"state directory {directory} is writable by other users (mode {mode:04o}); chmod go-w it"
    )


def test_a_symlink_is_refused_even_to_a_good_directory(tmp_path: Path) -> None:
    (tmp_path / "real").mkdir(mode=0o755)
    (tmp_path / "link").symlink_to(tmp_path / "real")
    with pytest.raises(UnsafeDirectory, match="link is a symbolic link; fix"):
        check_private_directory(tmp_path / "link", "CDI directory", "fix")


def test_a_file_and_a_missing_path_are_refused(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("")
    with pytest.raises(UnsafeDirectory, match="is not a directory"):
        check_private_directory(tmp_path / "file", "CDI directory", "fix")
    with pytest.raises(UnsafeDirectory, match="No such file or directory"):
        check_private_directory(tmp_path / "gone", "CDI directory", "fix")


def test_another_users_directory_is_refused(tmp_path: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("giving a directory to another user needs root")
    directory = tmp_path / "theirs"
    directory.mkdir(mode=0o755)
    os.chown(directory, 12345, 12345)
    with pytest.raises(UnsafeDirectory, match="is owned by uid 12345"):
        check_private_directory(directory, "state directory", "fix")


@pytest.mark.usefixtures("open_umask")
def test_make_private_directory_makes_then_checks(tmp_path: Path) -> None:
    make_private_directory(tmp_path / "cdi", 0o755, "CDI directory", "fix")
    assert mode_of(tmp_path / "cdi") == 0o755
    (tmp_path / "cdi").chmod(0o777)
    with pytest.raises(UnsafeDirectory):
        make_private_directory(tmp_path / "cdi", 0o755, "CDI directory", "fix")


def test_without_a_fix_the_message_says_what_the_directory_must_be(tmp_path: Path) -> None:
    (tmp_path / "real").mkdir(mode=0o700)
    (tmp_path / "state").symlink_to(tmp_path / "real")
    with pytest.raises(UnsafeDirectory) as caught:
        make_private_directory(tmp_path / "state", 0o700, "state directory")
    assert str(caught.value) == (
        f"state directory {tmp_path / 'state'} is a symbolic link; make it a real directory"
        " owned by root with mode 0700"
    )
