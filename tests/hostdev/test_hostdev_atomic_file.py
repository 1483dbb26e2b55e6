"""Whole-or-absent writes: the content and mode asked for, nothing left beside the file, and a
directory removed since start made again with its exact mode whatever the umask."""

from __future__ import annotations

import os
import stat
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from hostdev.atomic_file import write_file_atomically, write_file_whole

Write = Callable[..., None]


@pytest.fixture
def strict_umask() -> Iterator[None]:
    """A umask that would leave group and others without any access."""
    before = os.umask(0o077)
    try:
        yield
    finally:
        os.umask(before)


@pytest.mark.parametrize("write", [write_file_atomically, write_file_whole])
def test_the_file_replaces_the_old_one_with_its_mode_and_nothing_left_beside(
    tmp_path: Path, write: Write
) -> None:
    path = tmp_path / "spec.json"
    path.write_bytes(b"old")
    write(path, b'{"new":1}', 0o644)
    assert path.read_bytes() == b'{"new":1}'
    assert stat.S_IMODE(path.stat().st_mode) == 0o644
    write(path, b"", 0o600)
    assert path.read_bytes() == b""
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert [p.name for p in tmp_path.iterdir()] == ["spec.json"]


@pytest.mark.parametrize("write", [write_file_atomically, write_file_whole])
def test_a_missing_directory_is_made_again_with_its_exact_mode(
    tmp_path: Path, write: Write, strict_umask: None
) -> None:
    path = tmp_path / "metadata" / "uid" / "gpu" / "metadata.json"
    write(path, b"{}", 0o644, 0o755)
    assert path.read_bytes() == b"{}"
    for directory in (tmp_path / "metadata", path.parent.parent, path.parent):
        assert stat.S_IMODE(directory.stat().st_mode) == 0o755


def test_a_failed_write_leaves_no_temporary_file(tmp_path: Path) -> None:
    path = tmp_path / "record.json"
    with pytest.raises(TypeError):
        write_file_whole(path, "not bytes")  # type: ignore[arg-type]
    assert list(tmp_path.iterdir()) == []
