"""One prepare, unprepare or start-up recovery at a time across every instance of the driver on
the node: during a rolling update the old and the new pod both serve the kubelet, and a claim
prepared by one may be unprepared by the other.

The lock is an exclusive `flock` on `plugins/<driver>/serialize.lock` in the kubelet's directory,
which both pods mount, as the kubeletplugin helper serializes its instances
(k8s.io/dynamic-resource-allocation kubeletplugin/draplugin.go, `serializeGRPCIfEnabled`). The
kernel drops it when its holder dies, so whoever holds it is alive. The holder writes who it is
(pid, instance) into the file, for a waiter's message, unless the file says so already (the
node's only instance writes it once, not twice at every prepare and unprepare). A lock taken on
a file someone removed meanwhile (a kubelet wiping its plugin directory) is let go and taken
again on the file at the path: two holders of two different files would not exclude each other.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from hostdev.directories import make_directories

WAIT_SECONDS = 30.0
"""How long a call waits for the other instance: longer than its bind (the binding lock's wait,
the bind, the device nodes' wait) takes in practice, within the kubelet's 45 s."""
_POLL_SECONDS = 0.01
_DIRECTORY_MODE = 0o750


class SerializeLockBusy(OSError):
    """Another instance held the lock for longer than this one would wait; the message says who."""


class SerializeLock:
    def __init__(self, path: Path, instance: str, wait_seconds: float = WAIT_SECONDS) -> None:
        self.path = path
        self._holder = json.dumps({"pid": os.getpid(), "instance": instance or "(single)"}).encode()
        self._wait = wait_seconds

    @contextmanager
    def hold(self) -> Iterator[None]:
        """Hold the lock for the block; SerializeLockBusy after waiting `wait_seconds`."""
        deadline = time.monotonic() + self._wait
        while True:
            fd = self._open()
            try:
                if self._take(fd, deadline):
                    if os.pread(fd, len(self._holder) + 1, 0) != self._holder:
                        os.ftruncate(fd, 0)
                        os.pwrite(fd, self._holder, 0)
                    try:
                        yield
                    finally:
                        fcntl.flock(fd, fcntl.LOCK_UN)
                    return
            finally:
                os.close(fd)

    def _open(self) -> int:
        flags = os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW
        try:
            return os.open(self.path, flags, 0o600)
        except FileNotFoundError:
            make_directories(self.path.parent, _DIRECTORY_MODE)
            return os.open(self.path, flags, 0o600)

    def _take(self, fd: int, deadline: float) -> bool:
        """Lock `fd`; False when it no longer is the file at the path (open it again)."""
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except OSError as error:
                if error.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                    raise
            if time.monotonic() >= deadline:
                holder = os.pread(fd, 4096, 0).decode(errors="replace")[:200] or "unknown"
                raise SerializeLockBusy(
                    f"another instance of the driver ({holder}) has held {self.path} for more"
                    f" than {self._wait:.0f} s; the kubelet retries"
                )
            time.sleep(_POLL_SECONDS)
        try:
            current = self.path.lstat()
        except FileNotFoundError:
            return False
        mine = os.fstat(fd)
        return (current.st_dev, current.st_ino) == (mine.st_dev, mine.st_ino)
