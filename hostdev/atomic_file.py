"""Files that readers see whole or not at all, also across a crash: the DRA driver's state, the
CDI specs and metadata the container runtime reads, the node's feature file.

Two guarantees, so that no write pays for a sync it does not need:
- `write_file_atomically` (durable): the old or the new content, never a part, also after a
  power loss, and once it returns the new content survives one. The data is flushed before the
  rename, the directory after it: two fsyncs. For what must be found again after a reboot to give
  the same answer (the prepared-claim records, the binding journal) and what nothing rebuilds.
- `write_file_whole` (no sync): readers, and the next start after a crash of the process, see
  the old or the new content, never a part; after a power loss the file may be missing, or empty
  (the rename reached the disk before the data). For files rebuilt from a durable record by
  whoever finds them so: the CDI spec and the metadata file, rewritten by a retried NodePrepare
  (dra.prepare).

Both write into directories made at start; a missing one (someone removed it since) is made
again with exactly `directory_mode`, whatever the umask, and the write goes on.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path

from hostdev.directories import make_directories

# mkstemp makes the file with exactly this mode: no chmod needed when it is the one asked for.
_MKSTEMP_MODE = 0o600


def write_file_atomically(
    path: Path, data: bytes, mode: int = 0o644, directory_mode: int = 0o755
) -> None:
    """Durably: write `data` beside `path`, flush it to disk, rename it over `path` and flush
    the directory."""
    _write_and_rename(path, data, mode, directory_mode, durable=True)
    sync_directory(path.parent)


def write_file_whole(
    path: Path, data: bytes, mode: int = 0o644, directory_mode: int = 0o755
) -> None:
    """Whole or not at all, without a sync: write `data` beside `path` and rename it over."""
    _write_and_rename(path, data, mode, directory_mode, durable=False)


def sync_directory(directory: Path) -> None:
    """Make a rename or unlink in `directory` durable."""
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_and_rename(
    path: Path, data: bytes, mode: int, directory_mode: int, *, durable: bool
) -> None:
    try:
        fd, temporary = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    except FileNotFoundError:
        make_directories(path.parent, directory_mode)
        fd, temporary = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
            if mode != _MKSTEMP_MODE:
                os.fchmod(fd, mode)
            if durable:
                os.fsync(fd)
        finally:
            os.close(fd)
        Path(temporary).replace(path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            Path(temporary).unlink()
        raise
