"""The prepared iommufd hand-off: one-shot unix sockets that each pass one configured /dev/iommu fd.

Used by both components: the device plugin per Allocate of its iommufd resource, the DRA driver
per prepared claim on its iommufd slots (dra.iommufd). For every Allocate of
`devices.kubevirt.io/iommufd`, `IommufdHandoff.prepare()` opens
`<root>/dev/iommu`, switches it to per-process memlock accounting (`IOMMU_OPTION`) and binds a fresh
socket `<socket_dir>/iommufd-<id>.sock`, which the plugin mounts at `CONTAINER_SOCKET_PATH` in the
launcher. The wire protocol is KubeVirt's launcher's (`ReceiveIOMMUFD`): the first client to connect
gets the fd as SCM_RIGHTS with a 1-byte payload and answers with a 1-byte ACK; then connection, fd
and socket file are gone. Sockets nobody claims expire.

One thread serves every pending socket from a selector, so 110 pending slots cost one thread and
110 listening sockets. Expiry and ACK deadlines are fixed durations set by that thread, so
insertion-ordered dicts are already sorted by deadline: the earliest is always the first entry.

Decisions:
- A failed `IOMMU_OPTION` never fails the Allocate: the fd is a working iommufd either way, only
  memlock is charged per user instead of per process. It is logged as a WARNING naming the fix.
- A missing socket dir is created (0755: only the plugin writes there; the launcher sees just its
  bind-mounted socket). Stale `iommufd-*.sock` files (a previous run's) are removed at start:
  nobody serves them any more.
- Each socket is bound and labelled in a private directory and only then renamed into the socket
  dir (`hostdev.unix_socket`): it appears there already listening with its owner, mode and
  (SELinux enforcing) label, whatever the plugin's umask, so no client ever finds it with weaker
  permissions.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import re
import selectors
import socket
import stat
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from hostdev.directories import make_directories
from hostdev.iommu_ioctl import set_rlimit_mode_per_process
from hostdev.unix_socket import MAX_SOCKET_PATH, bind_unix_socket_path

log = logging.getLogger(__name__)

CONTAINER_SOCKET_PATH = "/var/run/kubevirt/iommufd.sock"
LAUNCHER_PUBLIC_DIR = "/var/run/kubevirt"
"""KubeVirt's "public" emptyDir in the launcher pod, which holds the socket's mount point."""
SELINUX_LABEL = b"system_u:object_r:container_file_t:s0"
QEMU_UID = QEMU_GID = 107
_PAYLOAD = b"\x00"
_ALLOCATION_ID = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,63}")
_UCRED = struct.Struct("3i")
_Outcome = Literal["served", "expired", "failed"]
_IOMMU_FIX = (
    "the kernel needs CONFIG_IOMMUFD (modprobe iommufd), and the plugin pod must see the host's"
    " /dev (mount it, or pass --root with the directory that holds it)"
)


class HandoffError(Exception):
    """Base of every error raised by the hand-off."""


class IommuDeviceMissing(HandoffError):
    """`/dev/iommu` does not exist under the plugin's root."""

    def __init__(self, path: str) -> None:
        self.path = path
        super().__init__(f"{path} does not exist: {_IOMMU_FIX}")


class InvalidAllocationId(HandoffError, ValueError):
    """An allocation id that cannot name a socket file."""

    def __init__(self, allocation_id: str) -> None:
        self.allocation_id = allocation_id
        super().__init__(
            f"invalid allocation id {allocation_id[:80]!r}: expected 1-64 characters of"
            " A-Z a-z 0-9 _ . - , not starting with . or - and without '..'"
        )


class InvalidHandoffConfig(HandoffError, ValueError):
    """A hand-off setting out of range."""


class HandoffClosed(HandoffError):
    """`prepare()` called after `close()`."""

    def __init__(self) -> None:
        super().__init__("the iommufd hand-off is closed (the plugin is stopping)")


@dataclass(frozen=True)
class HandoffConfig:
    """Where the sockets live and who may connect. `root` is the host root for `/dev/iommu` and
    `/sys/fs/selinux`; `socket_dir` is a host path (the kubelet mounts it into the launcher)."""

    socket_dir: Path = Path("/var/run/kubevirt-iommufd")
    root: Path = Path("/")
    owner_uid: int = QEMU_UID
    owner_gid: int = QEMU_GID
    mode: int = 0o660
    expiry_seconds: float = 15 * 60.0
    ack_timeout_seconds: float = 10.0

    def __post_init__(self) -> None:
        if not 0 <= self.mode <= 0o777:
            raise InvalidHandoffConfig(f"socket mode {self.mode:#o}: expected 0 to 0o777")
        if self.mode & stat.S_IWOTH:
            raise InvalidHandoffConfig(
                f"socket mode {self.mode:#o} lets every user connect and take an iommufd;"
                " grant the launcher's uid/gid instead (default 107:107, mode 0o660)"
            )
        if self.owner_uid < 0 or self.owner_gid < 0:
            raise InvalidHandoffConfig("socket owner uid and gid must be >= 0")
        if self.expiry_seconds <= 0 or self.ack_timeout_seconds <= 0:
            raise InvalidHandoffConfig("expiry_seconds and ack_timeout_seconds must be > 0")
        if not self.socket_dir.is_absolute():
            raise InvalidHandoffConfig(f"socket_dir {self.socket_dir} must be an absolute path")


@dataclass(frozen=True)
class PreparedSocket:
    allocation_id: str
    host_path: Path


@dataclass(frozen=True)
class HandoffStats:
    """Counters since start; `pending` is prepared but neither served, expired, failed nor
    withdrawn (a withdrawn one's fd is closed moments later by the serving thread)."""

    served: int
    expired: int
    failed: int
    pending: int


@dataclass(eq=False)
class _Handoff:
    allocation_id: str
    path: Path
    listener: socket.socket
    iommu_fd: int
    deadline: float = 0.0
    conn: socket.socket | None = None
    peer: str = "-"


def read_selinux_enforcing(root: Path) -> bool:
    """Whether SELinux is enforcing on the host under `root`."""
    try:
        return (root / "sys/fs/selinux/enforce").read_text().strip() == "1"
    except FileNotFoundError:
        return False


def socket_path(socket_dir: Path, allocation_id: str) -> Path:
    """Where `prepare(allocation_id)` binds its socket."""
    return socket_dir / f"iommufd-{allocation_id}.sock"


def read_waiting_ids(socket_dir: Path) -> frozenset[str]:
    """The allocation ids whose sockets are in `socket_dir` now: hand-offs a previous run
    prepared and nobody took yet (a served or expired one leaves no file). Read before an
    `IommufdHandoff` on the directory removes them."""
    try:
        found = [p for p in socket_dir.glob("iommufd-*.sock") if stat.S_ISSOCK(p.lstat().st_mode)]
    except FileNotFoundError:
        return frozenset()
    return frozenset(p.name.removeprefix("iommufd-").removesuffix(".sock") for p in found)


def _check_allocation_id(allocation_id: str) -> None:
    if not _ALLOCATION_ID.fullmatch(allocation_id) or ".." in allocation_id:
        raise InvalidAllocationId(allocation_id)


class IommufdHandoff:
    """Serves prepared iommufd fds; thread-safe. `close()` (or leaving a `with`) stops it."""

    def __init__(
        self,
        config: HandoffConfig,
        *,
        set_rlimit_mode: Callable[[int], None] = set_rlimit_mode_per_process,
    ) -> None:
        self._config = config
        self._set_rlimit_mode = set_rlimit_mode
        self._iommu_path = str(config.root / "dev/iommu")
        self._lock = threading.Lock()
        self._incoming: list[_Handoff] = []
        self._cancelled: set[str] = set()
        self._ids: set[str] = set()
        self._served = self._expired = self._failed = 0
        self._closed = False
        _prepare_socket_dir(config.socket_dir)
        self._selector = selectors.DefaultSelector()
        self._wake_reader, self._wake_writer = socket.socketpair()
        self._wake_reader.setblocking(False)
        self._wake_writer.setblocking(False)
        self._selector.register(self._wake_reader, selectors.EVENT_READ, None)
        self._thread = threading.Thread(target=self._serve, name="iommufd-handoff", daemon=True)
        self._thread.start()

    def __enter__(self) -> IommufdHandoff:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    def prepare(self, allocation_id: str) -> PreparedSocket:
        """Open and configure an iommufd and start serving it once on a fresh socket."""
        _check_allocation_id(allocation_id)
        path = socket_path(self._config.socket_dir, allocation_id)
        if len(os.fsencode(path)) > MAX_SOCKET_PATH:
            raise HandoffError(
                f"socket path {path} is longer than {MAX_SOCKET_PATH} bytes, the limit of a unix"
                " socket address; use a shorter socket dir"
            )
        with self._lock:
            if self._closed:
                raise HandoffClosed
            if allocation_id in self._ids:
                raise HandoffError(f"allocation {allocation_id} already has a pending hand-off")
            self._ids.add(allocation_id)
        try:
            handoff = self._open(allocation_id, path)
            with self._lock:
                queued = not self._closed
                if queued:
                    self._incoming.append(handoff)
            if not queued:
                _release(handoff)
                raise HandoffClosed
        except BaseException:
            with self._lock:
                self._ids.discard(allocation_id)
            raise
        self._wake()
        return PreparedSocket(allocation_id, path)

    def cancel(self, allocation_id: str) -> bool:
        """Withdraw a prepared hand-off nobody will claim (its Allocate failed after all, or its
        slot went to another pod): its fd is closed and its socket removed now rather than at
        expiry. False when it was no longer pending (served, expired or failed)."""
        with self._lock:
            if allocation_id not in self._ids:
                return False
            self._cancelled.add(allocation_id)
        self._wake()
        return True

    def holds(self, allocation_id: str) -> bool:
        """Whether a hand-off for `allocation_id` is pending (prepared, not yet served, expired,
        failed or withdrawn)."""
        with self._lock:
            return allocation_id in self._ids and allocation_id not in self._cancelled

    def stats(self) -> HandoffStats:
        with self._lock:
            pending = len(self._ids - self._cancelled)
            return HandoffStats(self._served, self._expired, self._failed, pending)

    def close(self) -> None:
        """Stop serving: close every pending fd and connection, remove every pending socket."""
        with self._lock:
            self._closed = True
        self._wake()
        self._thread.join()

    def _open(self, allocation_id: str, path: Path) -> _Handoff:
        try:
            fd = os.open(self._iommu_path, os.O_RDWR | os.O_CLOEXEC)
        except FileNotFoundError:
            raise IommuDeviceMissing(self._iommu_path) from None
        except OSError as error:
            raise HandoffError(f"cannot open {self._iommu_path}: {error.strerror}") from error
        try:
            self._configure(fd, allocation_id)
            return _Handoff(allocation_id, path, self._listen(path), fd)
        except BaseException:
            os.close(fd)
            raise

    def _configure(self, fd: int, allocation_id: str) -> None:
        try:
            self._set_rlimit_mode(fd)
        except OSError as error:
            why = (
                "the plugin lacks CAP_SYS_RESOURCE; grant it that capability"
                if error.errno == errno.EPERM
                else f"{errno.errorcode.get(error.errno or 0, '?')} {error.strerror}"
            )
            log.warning(
                "iommufd hand-off allocation=%s: IOMMU_OPTION RLIMIT_MODE=per-process refused (%s);"
                " serving the fd anyway, its pinned memory is charged to the memlock limit of the"
                " launcher's user, not of its process",
                allocation_id,
                why,
            )

    def _listen(self, path: Path) -> socket.socket:
        config = self._config
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)

        def bind(address: str) -> None:
            listener.bind(address)
            listener.listen(1)

        label = {"security.selinux": SELINUX_LABEL} if read_selinux_enforcing(config.root) else {}
        try:
            bind_unix_socket_path(
                path, bind, config.mode, uid=config.owner_uid, gid=config.owner_gid, xattrs=label
            )
            listener.setblocking(False)
        except BaseException as error:
            listener.close()
            if isinstance(error, OSError):
                raise HandoffError(str(error)) from error
            raise
        return listener

    def _wake(self) -> None:
        # A full buffer already holds a wake-up; a closed one means the loop is gone.
        with contextlib.suppress(BlockingIOError, OSError):
            self._wake_writer.send(b"\x01")

    def _serve(self) -> None:
        listening: dict[_Handoff, None] = {}
        awaiting_ack: dict[_Handoff, None] = {}
        try:
            while self._take_incoming(listening):
                # Before blocking: a cancel may have come (and its wake-up been read) before
                # this loop took its hand-off in.
                self._withdraw(listening)
                waits = [next(iter(d)).deadline for d in (listening, awaiting_ack) if d]
                timeout = max(0.0, min(waits) - time.monotonic()) if waits else None
                for key, _ in self._selector.select(timeout):
                    handoff = key.data
                    if handoff is None:
                        with contextlib.suppress(BlockingIOError):
                            self._wake_reader.recv(4096)
                    elif handoff in listening:
                        self._send_fd(handoff, listening, awaiting_ack)
                    elif handoff in awaiting_ack:
                        del awaiting_ack[handoff]
                        self._read_ack(handoff)
                self._expire(listening, awaiting_ack)
        except Exception:
            log.exception("iommufd hand-off loop crashed; closing every pending hand-off")
        finally:
            with self._lock:
                self._closed = True
            self._take_incoming(listening)
            for handoff in [*listening, *awaiting_ack]:
                self._finish(handoff, None, "")
            self._selector.close()
            self._wake_reader.close()
            self._wake_writer.close()

    def _take_incoming(self, listening: dict[_Handoff, None]) -> bool:
        """Register newly prepared sockets; False once the hand-off is closed."""
        with self._lock:
            incoming, self._incoming = self._incoming, []
            closed = self._closed
        deadline = time.monotonic() + self._config.expiry_seconds
        for handoff in incoming:
            handoff.deadline = deadline
            listening[handoff] = None
            self._selector.register(handoff.listener, selectors.EVENT_READ, handoff)
        return not closed

    def _send_fd(
        self,
        handoff: _Handoff,
        listening: dict[_Handoff, None],
        awaiting_ack: dict[_Handoff, None],
    ) -> None:
        """Accept the one client, stop listening and send it the fd."""
        try:
            conn, _ = handoff.listener.accept()
        except BlockingIOError:
            return  # the client left before we got to it: keep listening for the real one
        except OSError as error:
            del listening[handoff]
            self._finish(handoff, "failed", f"accept failed: {error}")
            return
        del listening[handoff]
        handoff.conn = conn
        # Exactly one client: nobody else may find the socket once this one is in.
        self._stop_listening(handoff)
        with contextlib.suppress(OSError):
            pid, uid, _gid = _UCRED.unpack(
                conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size)
            )
            handoff.peer = f"{pid} uid={uid}"
        try:
            conn.setblocking(False)
            socket.send_fds(conn, [_PAYLOAD], [handoff.iommu_fd], socket.MSG_NOSIGNAL)
        except OSError as error:
            self._finish(handoff, "failed", f"sending the fd failed: {error}")
            return
        handoff.deadline = time.monotonic() + self._config.ack_timeout_seconds
        self._selector.register(conn, selectors.EVENT_READ, handoff)
        awaiting_ack[handoff] = None

    def _read_ack(self, handoff: _Handoff) -> None:
        assert handoff.conn is not None
        try:
            ack = handoff.conn.recv(1)
        except OSError as error:
            self._finish(handoff, "failed", f"reading the ACK failed: {error}")
            return
        if ack:
            self._finish(handoff, "served", "")
        else:
            self._finish(handoff, "failed", "the client closed the connection without an ACK")

    def _expire(self, listening: dict[_Handoff, None], awaiting_ack: dict[_Handoff, None]) -> None:
        now = time.monotonic()
        while listening and (first := next(iter(listening))).deadline <= now:
            del listening[first]
            self._finish(first, "expired", "")
        while awaiting_ack and (first := next(iter(awaiting_ack))).deadline <= now:
            del awaiting_ack[first]
            timeout = self._config.ack_timeout_seconds
            self._finish(first, "failed", f"no ACK within {timeout:g}s")

    def _withdraw(self, listening: dict[_Handoff, None]) -> None:
        # A hand-off cancelled before this loop took it in stays asked for until it is here.
        with self._lock:
            cancelled = set(self._cancelled)
        for handoff in [h for h in listening if h.allocation_id in cancelled]:
            del listening[handoff]
            self._finish(handoff, None, "")
            log.info(
                "iommufd hand-off withdrawn: allocation=%s socket=%s",
                handoff.allocation_id,
                handoff.path,
            )

    def _stop_listening(self, handoff: _Handoff) -> None:
        self._selector.unregister(handoff.listener)
        handoff.listener.close()
        handoff.path.unlink(missing_ok=True)

    def _finish(self, handoff: _Handoff, outcome: _Outcome | None, reason: str) -> None:
        """Release everything a hand-off holds; count and log it unless `outcome` is None."""
        for sock in (handoff.listener, handoff.conn):
            if sock is not None and sock.fileno() != -1:
                with contextlib.suppress(KeyError):
                    self._selector.unregister(sock)
        _release(handoff)
        with self._lock:
            self._ids.discard(handoff.allocation_id)
            self._cancelled.discard(handoff.allocation_id)
            if outcome == "served":
                self._served += 1
            elif outcome == "expired":
                self._expired += 1
            elif outcome == "failed":
                self._failed += 1
        if outcome == "failed":
            log.warning(
                "iommufd hand-off failed: allocation=%s socket=%s peer_pid=%s: %s",
                handoff.allocation_id,
                handoff.path,
                handoff.peer,
                reason,
            )
        elif outcome is not None:
            log.info(
                "iommufd hand-off %s: allocation=%s socket=%s peer_pid=%s",
                outcome,
                handoff.allocation_id,
                handoff.path,
                handoff.peer,
            )


def _release(handoff: _Handoff) -> None:
    """Close what a hand-off holds and remove its socket file; safe to repeat."""
    if handoff.listener.fileno() != -1:
        handoff.listener.close()
        handoff.path.unlink(missing_ok=True)
    if handoff.conn is not None:
        handoff.conn.close()
    if handoff.iommu_fd >= 0:
        os.close(handoff.iommu_fd)
        handoff.iommu_fd = -1


def _prepare_socket_dir(socket_dir: Path) -> None:
    try:
        make_directories(socket_dir, 0o755)
        for stale in socket_dir.glob("iommufd-*.sock"):
            if stat.S_ISSOCK(stale.lstat().st_mode):
                stale.unlink()
    except OSError as error:
        raise HandoffError(f"cannot prepare socket dir {socket_dir}: {error}") from error
