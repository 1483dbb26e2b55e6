"""Unix sockets that appear at their path with an exact mode and owner, whatever the umask.

`bind()` makes a socket file with mode 0777 & ~umask: under umask 000 anyone may connect until a
later chmod, and a gRPC server (`add_insecure_port("unix:…")`) binds the file itself with no say
in its mode. So the socket is bound in a fresh private directory (0700, beside the target so the
rename stays on one filesystem), given its mode, owner and label there, then renamed onto the
target path: the path only ever names a socket that already has its final permissions. A listening
socket stays reachable under its new name (connect() finds it by inode). The private directory's
name starts with a dot, which the kubelet's plugin watcher and KubeVirt's hook poller skip.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Callable
from pathlib import Path

# sockaddr_un.sun_path holds 108 bytes including the terminating NUL.
MAX_SOCKET_PATH = 107


class UnixSocketError(OSError):
    """The socket could not be made at its path with its mode; the message says why."""


def bind_unix_socket_path(
    path: Path,
    bind: Callable[[str], object],
    mode: int,
    *,
    uid: int | None = None,
    gid: int | None = None,
    xattrs: dict[str, bytes] | None = None,
) -> None:
    """Have `bind(address)` create a listening unix socket, then put it at `path` with `mode`
    (and `uid`/`gid`, extended attributes such as `security.selinux`, when given).

    `bind` gets a filesystem path and must leave a socket file there: `sock.bind` for a plain
    socket, `lambda a: server.add_insecure_port(f"unix:{a}")` for a gRPC server (which binds and
    listens when the port is added, before `start()`). An existing file at `path` (a stale
    socket) is replaced atomically.
    """
    if not 0 <= mode <= 0o777:
        raise ValueError(f"socket mode {mode:#o}: expected 0 to 0o777")
    _check_length(path)
    parent = path.parent
    try:
        private = Path(tempfile.mkdtemp(prefix=".", dir=parent))
    except OSError as error:
        raise UnixSocketError(f"cannot make a private directory in {parent}: {error}") from error
    staged = private / "s"
    try:
        # mkdtemp asks for 0700 but the umask could take bits away from that too.
        private.chmod(0o700)
        _check_length(staged)
        bind(str(staged))
        if not staged.is_socket():
            raise UnixSocketError(f"binding {path} made no socket file")
        if uid is not None or gid is not None:
            os.chown(staged, -1 if uid is None else uid, -1 if gid is None else gid)
        staged.chmod(mode)
        for name, value in (xattrs or {}).items():
            os.setxattr(staged, name, value)
        staged.rename(path)
    except UnixSocketError:
        raise
    except (OSError, RuntimeError) as error:  # grpc reports a failed bind as RuntimeError
        raise UnixSocketError(f"cannot set up socket {path}: {error}") from error
    finally:
        with contextlib.suppress(FileNotFoundError):
            staged.unlink()
        with contextlib.suppress(OSError):
            private.rmdir()


def _check_length(path: Path) -> None:
    if len(os.fsencode(path)) > MAX_SOCKET_PATH:
        raise UnixSocketError(
            f"socket path {path} is longer than {MAX_SOCKET_PATH} bytes, the limit of a unix"
            " socket address; use a shorter directory"
        )
