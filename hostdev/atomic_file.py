"""Files that readers see whole or not at all, also across a crash: the DRA driver's state and
the CDI specs and metadata the container runtime reads."""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path

from hostdev.directories import make_directories


def write_file_atomically(
    path: Path, data: bytes, mode: int = 0o644, directory_mode: int = 0o755
) -> None:
    """Write `data` to a temporary file beside `path`, flush it to disk, rename it over `path`
    and flush the directory, so `path` holds either the old or the new content, never a part.
    Missing directories are made with `directory_mode`, whatever the umask."""
    make_directories(path.parent, directory_mode)
    fd, temporary = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fchmod(handle.fileno(), mode)
            os.fsync(handle.fileno())
        Path(temporary).replace(path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            Path(temporary).unlink()
        raise
    sync_directory(path.parent)


def sync_directory(directory: Path) -> None:
    """Make a rename or unlink in `directory` durable."""
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
