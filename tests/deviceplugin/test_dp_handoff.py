"""The prepared iommufd hand-off over real unix sockets, with a regular file standing in for
/dev/iommu (this machine has none) and a recording stand-in for the IOMMU_OPTION ioctl."""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import shutil
import socket
import stat
import sys
import tempfile
import threading
from collections.abc import Callable, Iterator
from dataclasses import FrozenInstanceError
from pathlib import Path

import pytest

from handoff_kit import fds_open_on, open_fd_count, receive_iommufd, wait_until
from hostdev.iommu_ioctl import (
    IOMMU_OPTION,
    build_option,
    parse_option_val64,
    read_rlimit_mode,
    set_rlimit_mode_per_process,
)
from hostdev.iommufd_handoff import (
    SELINUX_LABEL,
    HandoffClosed,
    HandoffConfig,
    HandoffError,
    HandoffStats,
    InvalidAllocationId,
    InvalidHandoffConfig,
    IommuDeviceMissing,
    IommufdHandoff,
)


class RecordingSetter:
    """Stands in for IOMMU_OPTION: records the fds it was given, optionally failing like it."""

    def __init__(self, fail_with: int | None = None) -> None:
        self.fail_with = fail_with
        self.calls: list[os.stat_result] = []

    def __call__(self, fd: int) -> None:
        self.calls.append(os.fstat(fd))
        if self.fail_with is not None:
            raise OSError(self.fail_with, os.strerror(self.fail_with))


MakeHandoff = Callable[..., IommufdHandoff]


@pytest.fixture
def host_root(tmp_path: Path) -> Path:
    root = tmp_path / "host"
    (root / "dev").mkdir(parents=True)
    (root / "dev/iommu").write_bytes(b"")
    return root


@pytest.fixture
def setter() -> RecordingSetter:
    return RecordingSetter()


@pytest.fixture
def make_handoff(tmp_path: Path, host_root: Path, setter: RecordingSetter) -> Iterator[MakeHandoff]:
    """Build a hand-off over the stand-in root; every one is closed at teardown."""
    made: list[IommufdHandoff] = []

    def make(**overrides: object) -> IommufdHandoff:
        rlimit_setter = overrides.pop("set_rlimit_mode", setter)
        settings: dict[str, object] = {"socket_dir": tmp_path / "sockets", "root": host_root}
        settings.update(overrides)
        handoff = IommufdHandoff(HandoffConfig(**settings), set_rlimit_mode=rlimit_setter)  # type: ignore[arg-type]
        made.append(handoff)
        return handoff

    yield make
    for handoff in made:
        handoff.close()


def same_file(fd: int, path: Path) -> bool:
    fd_stat, path_stat = os.fstat(fd), path.stat()
    return (fd_stat.st_dev, fd_stat.st_ino) == (path_stat.st_dev, path_stat.st_ino)


# --- the IOMMU_OPTION ioctl --------------------------------------------------------------------


@pytest.mark.skipif(sys.byteorder != "little", reason="literal bytes are little-endian")
def test_option_struct_packs_to_the_kernels_layout() -> None:
    expected = bytes.fromhex(
        "18000000"  # size 24
        "00000000"  # option_id RLIMIT_MODE
        "0000"  # op SET
        "0000"  # __reserved
        "00000000"  # object_id
        "0100000000000000"  # val64 1: per process
    )
    assert build_option(0, 0, 1) == expected
    assert build_option(0, 1)[8:10] == b"\x01\x00"
    assert (ord(";") << 8) | 0x87 == IOMMU_OPTION


@pytest.mark.skipif(sys.byteorder != "little", reason="literal bytes are little-endian")
def test_a_get_answer_decodes_to_its_val64() -> None:
    answer = bytes.fromhex("18000000 00000000 0100 0000 00000000 0100000000000000")
    assert parse_option_val64(answer) == 1
    assert parse_option_val64(bytearray(build_option(0, 1, 0))) == 0
    with pytest.raises(ValueError, match="24 bytes"):
        parse_option_val64(answer[:16])


@pytest.mark.parametrize("call", [set_rlimit_mode_per_process, read_rlimit_mode])
def test_the_real_ioctl_reaches_the_kernel(tmp_path: Path, call: Callable[[int], object]) -> None:
    # A regular file has no ioctls: ENOTTY proves the call went through to the kernel.
    path = tmp_path / "not-iommu"
    path.write_bytes(b"")
    fd = os.open(path, os.O_RDWR)
    try:
        with pytest.raises(OSError) as caught:
            call(fd)
    finally:
        os.close(fd)
    assert caught.value.errno == errno.ENOTTY


# --- serving -----------------------------------------------------------------------------------


def test_the_launcher_receives_the_fd_once_and_the_socket_goes_away(
    make_handoff: MakeHandoff, host_root: Path, setter: RecordingSetter, tmp_path: Path
) -> None:
    handoff = make_handoff()
    prepared = handoff.prepare("alloc-1")
    assert prepared.host_path == tmp_path / "sockets/iommufd-alloc-1.sock"
    assert prepared.allocation_id == "alloc-1"
    assert handoff.stats() == HandoffStats(served=0, expired=0, failed=0, pending=1)

    fd = receive_iommufd(prepared.host_path)
    try:
        assert same_file(fd, host_root / "dev/iommu")
        assert fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_ACCMODE == os.O_RDWR
        wait_until(lambda: handoff.stats().served == 1)
        assert not prepared.host_path.exists()
        assert fds_open_on(host_root / "dev/iommu") == {fd}
    finally:
        os.close(fd)
    assert handoff.stats() == HandoffStats(served=1, expired=0, failed=0, pending=0)
    [configured] = setter.calls
    assert configured.st_ino == (host_root / "dev/iommu").stat().st_ino
    assert list((tmp_path / "sockets").iterdir()) == []


def test_a_second_client_finds_no_socket(make_handoff: MakeHandoff) -> None:
    handoff = make_handoff()
    path = handoff.prepare("one").host_path
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as first:
        first.settimeout(5)
        first.connect(str(path))
        _message, fds, _flags, _address = socket.recv_fds(first, 1, 1)
        os.close(fds[0])
        with (
            socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as second,
            pytest.raises(FileNotFoundError),
        ):
            second.connect(str(path))
        first.sendall(b"\x00")
    wait_until(lambda: handoff.stats().served == 1)


def test_a_hand_off_is_logged_with_allocation_socket_and_peer(
    make_handoff: MakeHandoff, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="hostdev.iommufd_handoff")
    handoff = make_handoff()
    path = handoff.prepare("logged").host_path
    os.close(receive_iommufd(path))
    wait_until(lambda: handoff.stats().served == 1)
    # Counted, then logged: on a busy machine the line may come a moment after the count.
    wait_until(lambda: any("served" in r.getMessage() for r in caplog.records))
    [line] = [r.getMessage() for r in caplog.records if "served" in r.getMessage()]
    assert f"allocation=logged socket={path} peer_pid={os.getpid()} uid=0" in line


def test_unclaimed_sockets_expire(
    make_handoff: MakeHandoff, host_root: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="hostdev.iommufd_handoff")
    handoff = make_handoff(expiry_seconds=0.2)
    path = handoff.prepare("unclaimed").host_path
    assert path.exists()
    wait_until(lambda: handoff.stats().expired == 1)
    assert not path.exists()
    assert handoff.stats() == HandoffStats(served=0, expired=1, failed=0, pending=0)
    assert fds_open_on(host_root / "dev/iommu") == set()
    assert any("expired: allocation=unclaimed" in r.getMessage() for r in caplog.records)


def test_a_cancelled_hand_off_gives_its_fd_back_at_once(
    make_handoff: MakeHandoff, host_root: Path
) -> None:
    handoff = make_handoff(expiry_seconds=60)
    withdrawn = handoff.prepare("withdrawn").host_path
    kept = handoff.prepare("kept").host_path
    assert len(fds_open_on(host_root / "dev/iommu")) == 2
    assert handoff.cancel("withdrawn")
    assert not handoff.cancel("never-prepared")
    # Its room is free at once, before the serving thread has closed its fd.
    assert handoff.stats().pending == 1
    wait_until(lambda: len(fds_open_on(host_root / "dev/iommu")) == 1)
    assert not withdrawn.exists() and kept.exists()
    assert not handoff.cancel("withdrawn")
    os.close(receive_iommufd(kept))
    wait_until(lambda: handoff.stats().served == 1)
    # A withdrawal is neither served, expired nor failed.
    assert handoff.stats() == HandoffStats(served=1, expired=0, failed=0, pending=0)


def test_served_and_unclaimed_sockets_are_tracked_apart(make_handoff: MakeHandoff) -> None:
    handoff = make_handoff(expiry_seconds=0.5)
    claimed = handoff.prepare("claimed").host_path
    unclaimed = handoff.prepare("unclaimed").host_path
    os.close(receive_iommufd(claimed))
    wait_until(lambda: handoff.stats().expired == 1)
    assert not unclaimed.exists()
    assert handoff.stats() == HandoffStats(served=1, expired=1, failed=0, pending=0)


def test_a_client_that_never_acks_is_cut_off(
    make_handoff: MakeHandoff, host_root: Path, caplog: pytest.LogCaptureFixture
) -> None:
    handoff = make_handoff(ack_timeout_seconds=0.2)
    path = handoff.prepare("silent").host_path
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
        conn.settimeout(5)
        conn.connect(str(path))
        _message, fds, _flags, _address = socket.recv_fds(conn, 1, 1)
        os.close(fds[0])
        assert conn.recv(1) == b""  # the server hung up on us
    wait_until(lambda: handoff.stats().failed == 1)
    assert handoff.stats() == HandoffStats(served=0, expired=0, failed=1, pending=0)
    assert fds_open_on(host_root / "dev/iommu") == set()
    assert not path.exists()
    assert any("no ACK within 0.2s" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("takes_fd", [True, False], ids=["after-receiving", "before-receiving"])
def test_a_client_that_hangs_up_without_ack_counts_as_failed(
    make_handoff: MakeHandoff, host_root: Path, takes_fd: bool
) -> None:
    handoff = make_handoff()
    path = handoff.prepare("hangup").host_path
    if takes_fd:
        os.close(receive_iommufd(path, ack=False))
    else:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
            conn.connect(str(path))
    wait_until(lambda: handoff.stats().failed == 1)
    assert handoff.stats() == HandoffStats(served=0, expired=0, failed=1, pending=0)
    assert fds_open_on(host_root / "dev/iommu") == set()
    assert not path.exists()


# --- IOMMU_OPTION failures -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("error", "hint"),
    [(errno.EPERM, "grant it that capability"), (errno.EINVAL, "EINVAL")],
    ids=["no-CAP_SYS_RESOURCE", "other-error"],
)
def test_a_refused_rlimit_mode_is_logged_and_the_fd_still_served(
    make_handoff: MakeHandoff,
    host_root: Path,
    caplog: pytest.LogCaptureFixture,
    error: int,
    hint: str,
) -> None:
    failing = RecordingSetter(fail_with=error)
    handoff = make_handoff(set_rlimit_mode=failing)
    path = handoff.prepare("nocap").host_path
    fd = receive_iommufd(path)
    try:
        assert same_file(fd, host_root / "dev/iommu")
    finally:
        os.close(fd)
    [warning] = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert hint in warning.getMessage()
    assert "charged to the memlock limit of the launcher's user" in warning.getMessage()
    assert len(failing.calls) == 1


# --- who may connect -----------------------------------------------------------------------------


def test_the_socket_belongs_to_the_launcher_by_default(make_handoff: MakeHandoff) -> None:
    path = make_handoff().prepare("owned").host_path
    info = path.lstat()
    assert stat.S_ISSOCK(info.st_mode)
    assert (stat.S_IMODE(info.st_mode), info.st_uid, info.st_gid) == (0o660, 107, 107)


def test_owner_and_mode_are_configurable(make_handoff: MakeHandoff) -> None:
    path = make_handoff(owner_uid=1234, owner_gid=5678, mode=0o600).prepare("custom").host_path
    info = path.lstat()
    assert (stat.S_IMODE(info.st_mode), info.st_uid, info.st_gid) == (0o600, 1234, 5678)


def test_under_umask_000_the_socket_is_never_seen_with_a_wider_mode(
    make_handoff: MakeHandoff,
    tmp_path: Path,
    open_umask: None,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    socket_dir = tmp_path / "sockets"
    handoff = make_handoff(mode=0o660)
    seen: dict[str, int] = {}
    chown = os.chown

    def chown_and_look(path: str | os.PathLike[str], uid: int, gid: int) -> None:
        # The moment between bind() and the socket getting its owner and mode.
        seen.update(
            (entry.name, stat.S_IMODE(entry.lstat().st_mode))
            for entry in socket_dir.iterdir()
            if entry.is_socket()
        )
        chown(path, uid, gid)

    monkeypatch.setattr(os, "chown", chown_and_look)
    path = handoff.prepare("umask").host_path
    monkeypatch.undo()
    assert {name: mode for name, mode in seen.items() if mode & stat.S_IWOTH} == {}
    assert stat.S_IMODE(path.lstat().st_mode) == 0o660
    assert sorted(p.name for p in socket_dir.iterdir()) == ["iommufd-umask.sock"]
    os.close(receive_iommufd(path))


@pytest.mark.parametrize(
    "settings",
    [
        {"mode": 0o666},
        {"mode": 0o662},
        {"mode": 0o1660},
        {"owner_uid": -1},
        {"expiry_seconds": 0},
        {"ack_timeout_seconds": -1.0},
        {"socket_dir": Path("relative/dir")},
    ],
    ids=["0666", "o+w", "sticky", "negative-uid", "no-expiry", "negative-ack", "relative-dir"],
)
def test_unsafe_or_nonsense_settings_are_refused(settings: dict[str, object]) -> None:
    with pytest.raises(InvalidHandoffConfig):
        HandoffConfig(**settings)  # type: ignore[arg-type]


@pytest.fixture
def traversable_dir() -> Iterator[Path]:
    # tmp_path sits under a 0700 directory, which would refuse other uids before the socket
    # mode is even looked at.
    path = Path(tempfile.mkdtemp(prefix="iommufd-handoff-"))
    path.chmod(0o755)
    yield path
    shutil.rmtree(path)


def connect_as(uid: int, gid: int, path: Path) -> int:
    """Receive and ACK the fd in a child running as uid:gid; 0 on success, else the errno."""
    pid = os.fork()
    if pid == 0:
        code = 0
        try:
            os.setgroups([])
            os.setgid(gid)
            os.setuid(uid)
            os.close(receive_iommufd(path))
        except OSError as error:
            code = error.errno or 255
        except BaseException:
            code = 255
        os._exit(code)
    _pid, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


@pytest.mark.skipif(os.geteuid() != 0, reason="switching uid needs root")
@pytest.mark.parametrize(
    ("uid", "gid", "outcome"),
    [
        (107, 107, 0),
        (107, 60000, 0),
        (60000, 107, 0),
        (60000, 60000, errno.EACCES),
    ],
    ids=["launcher", "launcher-uid", "launcher-gid", "stranger"],
)
def test_only_the_launchers_uid_or_gid_may_connect(
    make_handoff: MakeHandoff, traversable_dir: Path, uid: int, gid: int, outcome: int
) -> None:
    handoff = make_handoff(socket_dir=traversable_dir / "sockets")
    path = handoff.prepare("who").host_path
    assert connect_as(uid, gid, path) == outcome
    if outcome == 0:
        wait_until(lambda: handoff.stats().served == 1)
    else:
        assert path.exists()
        assert handoff.stats().pending == 1


@pytest.mark.parametrize(
    ("enforce", "labelled"),
    [("1\n", True), ("0\n", False), (None, False)],
    ids=["enforcing", "permissive", "no-selinux"],
)
def test_the_socket_is_relabelled_only_where_selinux_enforces(
    make_handoff: MakeHandoff, host_root: Path, enforce: str | None, labelled: bool
) -> None:
    if enforce is not None:
        (host_root / "sys/fs/selinux").mkdir(parents=True)
        (host_root / "sys/fs/selinux/enforce").write_text(enforce)
    path = make_handoff().prepare("label").host_path
    try:
        label: bytes | None = os.getxattr(path, "security.selinux")
    except OSError as error:
        if error.errno != errno.ENODATA:
            raise
        label = None
    assert (label == SELINUX_LABEL) is labelled


# --- errors --------------------------------------------------------------------------------------


def test_a_missing_dev_iommu_names_the_path_and_the_fix(
    make_handoff: MakeHandoff, host_root: Path, tmp_path: Path
) -> None:
    (host_root / "dev/iommu").unlink()
    handoff = make_handoff()
    with pytest.raises(IommuDeviceMissing) as caught:
        handoff.prepare("nodev")
    assert str(host_root / "dev/iommu") in str(caught.value)
    assert "CONFIG_IOMMUFD" in str(caught.value)
    assert handoff.stats().pending == 0
    assert list((tmp_path / "sockets").iterdir()) == []


@pytest.mark.parametrize(
    "allocation_id",
    ["", "a/b", "..", "a..b", ".hidden", "-rf", "x\0y", "caf\u00e9", "a b", "a" * 65],
    ids=[
        "empty",
        "slash",
        "dotdot",
        "inner-dotdot",
        "dot",
        "dash",
        "nul",
        "non-ascii",
        "space",
        "long",
    ],
)
def test_invalid_allocation_ids_are_refused(make_handoff: MakeHandoff, allocation_id: str) -> None:
    handoff = make_handoff()
    with pytest.raises(InvalidAllocationId):
        handoff.prepare(allocation_id)
    assert handoff.stats().pending == 0


@pytest.mark.parametrize("allocation_id", ["iommufd0", "a" * 64, "7c9e6679-7425-40de.944b_e07f"])
def test_valid_allocation_ids_are_accepted(
    make_handoff: MakeHandoff, traversable_dir: Path, allocation_id: str
) -> None:
    path = make_handoff(socket_dir=traversable_dir).prepare(allocation_id).host_path
    assert path.name == f"iommufd-{allocation_id}.sock"


def test_a_pending_allocation_id_cannot_be_reused(make_handoff: MakeHandoff) -> None:
    handoff = make_handoff()
    handoff.prepare("twice")
    with pytest.raises(HandoffError, match="already has a pending hand-off"):
        handoff.prepare("twice")
    assert handoff.stats().pending == 1


def test_a_socket_path_too_long_for_a_unix_address_is_refused(
    make_handoff: MakeHandoff, tmp_path: Path
) -> None:
    handoff = make_handoff(socket_dir=tmp_path / ("d" * 100))
    with pytest.raises(HandoffError, match="longer than 107 bytes"):
        handoff.prepare("x")
    assert handoff.stats().pending == 0


def test_the_socket_dir_is_created_and_stale_sockets_removed(
    make_handoff: MakeHandoff, tmp_path: Path
) -> None:
    socket_dir = tmp_path / "new/sockets"
    make_handoff(socket_dir=socket_dir).close()
    assert stat.S_IMODE(socket_dir.stat().st_mode) == 0o755 & ~_umask()
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as stale:
        stale.bind(str(socket_dir / "iommufd-old.sock"))
    (socket_dir / "iommufd-notes.sock").write_text("not a socket")
    make_handoff(socket_dir=socket_dir)
    assert sorted(p.name for p in socket_dir.iterdir()) == ["iommufd-notes.sock"]


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


# --- lifecycle -----------------------------------------------------------------------------------


def test_a_thousand_allocations_leave_no_fds_and_no_sockets(
    make_handoff: MakeHandoff, tmp_path: Path
) -> None:
    handoff = make_handoff()
    os.close(receive_iommufd(handoff.prepare("warm-up").host_path))
    wait_until(lambda: handoff.stats().served == 1)
    before = open_fd_count()
    for number in range(1000):
        os.close(receive_iommufd(handoff.prepare(f"alloc-{number}").host_path))
    wait_until(lambda: handoff.stats().served == 1001)
    assert open_fd_count() == before
    assert list((tmp_path / "sockets").iterdir()) == []
    assert handoff.stats() == HandoffStats(served=1001, expired=0, failed=0, pending=0)


def test_close_removes_every_pending_socket_and_fd(
    make_handoff: MakeHandoff, host_root: Path, tmp_path: Path
) -> None:
    before = open_fd_count()
    handoff = make_handoff()
    paths = [handoff.prepare(f"pending-{n}").host_path for n in range(5)]
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as waiting:
        waiting.settimeout(5)
        waiting.connect(str(paths[0]))
        _message, fds, _flags, _address = socket.recv_fds(waiting, 1, 1)
        os.close(fds[0])
        handoff.close()
        assert waiting.recv(1) == b""
    assert list((tmp_path / "sockets").iterdir()) == []
    assert fds_open_on(host_root / "dev/iommu") == set()
    assert open_fd_count() == before
    assert handoff.stats().pending == 0
    with pytest.raises(HandoffClosed):
        handoff.prepare("late")
    handoff.close()


def test_concurrent_prepares_each_get_their_own_socket(
    make_handoff: MakeHandoff, host_root: Path
) -> None:
    handoff = make_handoff()
    results: dict[str, Path] = {}
    errors: list[BaseException] = []
    start = threading.Barrier(8)

    def allocate(worker: int) -> None:
        start.wait()
        try:
            for n in range(25):
                allocation_id = f"w{worker}-{n}"
                results[allocation_id] = handoff.prepare(allocation_id).host_path
        except BaseException as error:
            errors.append(error)

    threads = [threading.Thread(target=allocate, args=(w,)) for w in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    assert len(set(results.values())) == 200
    assert handoff.stats().pending == 200
    for path in list(results.values())[:20]:
        os.close(receive_iommufd(path))
    wait_until(lambda: handoff.stats().served == 20)
    assert handoff.stats().pending == 180
    assert len(fds_open_on(host_root / "dev/iommu")) == 180


def test_close_racing_prepares_leaves_nothing_behind(
    make_handoff: MakeHandoff, host_root: Path, tmp_path: Path
) -> None:
    handoff = make_handoff()
    prepared = threading.Semaphore(0)
    refused: list[int] = []

    def allocate(worker: int) -> None:
        for n in range(10_000):
            try:
                handoff.prepare(f"r{worker}-{n}")
            except HandoffClosed:
                refused.append(worker)
                return
            prepared.release()

    threads = [threading.Thread(target=allocate, args=(w,)) for w in range(4)]
    for thread in threads:
        thread.start()
    for _ in range(40):
        assert prepared.acquire(timeout=5)
    handoff.close()
    for thread in threads:
        thread.join()
    assert sorted(refused) == [0, 1, 2, 3]
    assert list((tmp_path / "sockets").iterdir()) == []
    assert fds_open_on(host_root / "dev/iommu") == set()
    assert handoff.stats().pending == 0


def test_one_thread_serves_every_pending_socket(make_handoff: MakeHandoff) -> None:
    before = threading.active_count()
    handoff = make_handoff()
    for n in range(110):
        handoff.prepare(f"slot-{n}")
    assert threading.active_count() == before + 1
    handoff.close()
    assert threading.active_count() == before


def test_stats_are_a_frozen_snapshot(make_handoff: MakeHandoff) -> None:
    handoff = make_handoff()
    snapshot = handoff.stats()
    handoff.prepare("later")
    assert snapshot.pending == 0
    with pytest.raises(FrozenInstanceError):
        snapshot.served = 1  # type: ignore[misc]
