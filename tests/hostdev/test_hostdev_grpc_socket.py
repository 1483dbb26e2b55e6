"""GrpcSocketServer over real gRPC on unix sockets: served with mode 0600 under any umask, served
again after its socket or its directory is wiped, and only ever removing the file it made."""

from __future__ import annotations

import shutil
import stat
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from hostdev.grpc_socket import GrpcSocketServer
from hostdev.unix_socket import UnixSocketError


def _echo(request: bytes, context: grpc.ServicerContext) -> bytes:
    return request


def _add_echo(server: grpc.Server) -> None:
    handler = grpc.method_handlers_generic_handler(
        "t.T", {"Echo": grpc.unary_unary_rpc_method_handler(_echo)}
    )
    server.add_generic_rpc_handlers((handler,))


def _call(path: Path) -> bytes:
    with grpc.insecure_channel(f"unix:{path}") as channel:
        echo: grpc.UnaryUnaryMultiCallable[bytes, bytes] = channel.unary_unary("/t.T/Echo")
        return echo(b"ping", timeout=5)


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.lstat().st_mode)


@pytest.fixture
def path(tmp_path: Path) -> Path:
    return tmp_path / "kubelet" / "plugins" / "p.sock"


@pytest.fixture
def served(path: Path) -> Iterator[GrpcSocketServer]:
    server = GrpcSocketServer(path, _add_echo)
    server.start()
    yield server
    server.stop(grace=0)


def test_serves_at_its_path_in_a_directory_it_makes(served: GrpcSocketServer, path: Path) -> None:
    assert served.present
    assert path.is_socket()
    assert _call(path) == b"ping"
    # No private staging directory is left beside the socket.
    assert [p.name for p in path.parent.iterdir()] == ["p.sock"]


def test_the_socket_is_0600_under_umask_000(tmp_path: Path, open_umask: None) -> None:
    path = tmp_path / "open.sock"
    server = GrpcSocketServer(path, _add_echo)
    server.start()
    try:
        assert _mode(path) == 0o600
        assert _call(path) == b"ping"
        server.restart(grace=0)
        assert _mode(path) == 0o600
    finally:
        server.stop(grace=0)


@pytest.mark.parametrize("wipe", ["socket", "directory"])
def test_a_wiped_socket_is_seen_gone_and_served_again(
    served: GrpcSocketServer, path: Path, wipe: str
) -> None:
    if wipe == "socket":
        path.unlink()
    else:
        shutil.rmtree(path.parent)
        assert not path.parent.exists()
    assert not served.present
    served.restart(grace=0)
    assert served.present
    assert _call(path) == b"ping"


def test_a_socket_replaced_by_another_file_is_not_ours_to_remove(
    served: GrpcSocketServer, path: Path
) -> None:
    theirs = path.with_name("theirs")
    theirs.write_text("another server's")
    theirs.rename(path)
    assert not served.present
    served.stop(grace=0)
    assert path.read_text() == "another server's"


def test_stop_removes_its_own_socket_once(path: Path) -> None:
    server = GrpcSocketServer(path, _add_echo)
    server.start()
    server.stop(grace=0)
    assert not path.exists() and not server.present
    server.stop(grace=0)
    assert list(path.parent.iterdir()) == []


def test_a_socket_left_at_the_path_is_replaced(path: Path) -> None:
    first = GrpcSocketServer(path, _add_echo)
    first.start()
    second = GrpcSocketServer(path, _add_echo)
    second.start()
    try:
        assert second.present and not first.present
        # The first, stopping late, leaves the second's socket alone.
        first.stop(grace=0)
        assert _call(path) == b"ping"
    finally:
        second.stop(grace=0)
    assert not path.exists()


def test_restarts_leave_no_worker_threads_behind(served: GrpcSocketServer, path: Path) -> None:
    def workers() -> int:
        return sum(t.name.startswith("ThreadPoolExecutor") for t in threading.enumerate())

    assert _call(path) == b"ping"
    baseline = workers()
    for _ in range(5):
        served.restart(grace=0)
        assert _call(path) == b"ping"
    deadline = time.monotonic() + 5
    while workers() > baseline and time.monotonic() < deadline:
        time.sleep(0.02)
    assert workers() <= baseline


def test_a_socket_that_cannot_be_made_is_one_error(tmp_path: Path) -> None:
    blocker = tmp_path / "not-a-directory"
    blocker.write_text("")
    server = GrpcSocketServer(blocker / "p.sock", _add_echo)
    with pytest.raises(UnixSocketError, match="not-a-directory"):
        server.start()
    assert not server.present
    server.stop(grace=0)
