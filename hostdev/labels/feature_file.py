"""The node labels as a Node Feature Discovery local feature file: `key=value` lines that
nfd-worker's `local` source turns into node labels, so clusters running NFD get them with no
RBAC of ours.

NFD reads every file in its `features.d` directory whose name does not start with `.` (so the
atomic writer's temporary file is never read half-written), up to 64 KiB each; lines starting
with `#` are comments, and `# +` starts a directive, which ours never does.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Mapping
from pathlib import Path

log = logging.getLogger(__name__)


def build_feature_file(labels: Mapping[str, str], writer: str) -> bytes:
    """The file's content: a comment naming its writer, then one `key=value` line per label."""
    lines = [f"# kubevirt-iommufd {writer}: written on every change, removed when it stops"]
    lines += [f"{key}={value}" for key, value in labels.items()]
    return ("\n".join(lines) + "\n").encode()


class FeatureFile:
    """One feature file, rewritten (atomically) only when its content changes."""

    def __init__(self, path: Path, writer: str) -> None:
        self.path = path
        self._writer = writer
        self._written: bytes | None = None
        self._failure: str | None = None

    def write(self, labels: Mapping[str, str]) -> None:
        """Write the labels when they differ from what is on disk; a failure is logged and the
        next call tries again (the labels must never take the component down)."""
        content = build_feature_file(labels, self._writer)
        if content == self._written:
            return
        # Loaded at the first write, after the kubelet knows the component: with tempfile, about
        # 3 ms of a start.
        from hostdev.atomic_file import write_file_atomically

        try:
            write_file_atomically(self.path, content)
        except OSError as error:
            self._written = None
            # Said once per kind of failure: the next call tries again, and may be seconds away.
            level = logging.DEBUG if str(error) == self._failure else logging.WARNING
            self._failure = str(error)
            log.log(
                level, "cannot write the NFD feature file path=%s error=%r", self.path, f"{error}"
            )
            return
        self._written = content
        self._failure = None
        log.info("NFD feature file written path=%s labels=%d", self.path, len(labels))

    def remove(self) -> None:
        """Take the file away (a clean stop): NFD then drops the labels."""
        from hostdev.atomic_file import sync_directory

        self._written = None
        try:
            self.path.unlink(missing_ok=True)
            with contextlib.suppress(FileNotFoundError):
                sync_directory(self.path.parent)
        except OSError as error:
            log.warning(
                "cannot remove the NFD feature file path=%s error=%r", self.path, f"{error}"
            )
            return
        log.info("NFD feature file removed path=%s", self.path)
