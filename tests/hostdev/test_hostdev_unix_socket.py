"""bind_unix_socket_path: the socket appears at its path with the asked mode under any umask, for
a plain socket and for a gRPC server, over real connections."""

from __future__ import annotations

import os
import socket
import stat
from concurrent import futures
from pathlib import Path

import grpc
import pytest

from hostdev.unix_socket import MAX_SOCKET_PATH, UnixSocketError, bind_unix_socket_path


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.lstat().st_mode)


@pytest.mark.parametrize("mode", [0o600, 0o660, 0o666], ids=oct)
def test_plain_socket_gets_exactly_its_mode_under_umask_000(
    tmp_path: Path, open_umask: None, mode: int
) -> None:
    path = tmp_path / "plain.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as listener:
        bind_unix_socket_path(path, listener.bind, mode)
        listener.listen(1)
        assert path.is_socket()
        assert _mode(path) == mode
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as client:
            client.connect(str(path))
            conn, _ = listener.accept()
            conn.sendall(b"hi")
            assert client.recv(2) == b"hi"
            conn.close()
    assert [p.name for p in tmp_path.iterdir()] == ["plain.sock"]


def _echo(request: bytes, context: grpc.ServicerContext) -> bytes:
    return request


def test_grpc_server_socket_gets_its_mode_and_serves_under_the_new_name(
    tmp_path: Path, open_umask: None
) -> None:
    path = tmp_path / "grpc.sock"
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    handler = grpc.method_handlers_generic_handler(
        "t.T", {"Echo": grpc.unary_unary_rpc_method_handler(_echo)}
    )
    server.add_generic_rpc_handlers((handler,))
    bind_unix_socket_path(path, lambda address: server.add_insecure_port(f"unix:{address}"), 0o600)
    server.start()
    try:
        assert _mode(path) == 0o600
        with grpc.insecure_channel(f"unix:{path}") as channel:
            echo: grpc.UnaryUnaryMultiCallable[bytes, bytes] = channel.unary_unary("/t.T/Echo")
            assert echo(b"ping", timeout=5) == b"ping"
    finally:
        server.stop(0).wait()
    assert [p.name for p in tmp_path.iterdir()] == ["grpc.sock"]


def test_bind_happens_in_a_private_directory_never_at_the_target(
    tmp_path: Path, open_umask: None
) -> None:
    path = tmp_path / "target.sock"
    stale = tmp_path / "stale"
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as old:
        old.bind(str(stale))
    stale.rename(path)
    seen: list[tuple[Path, int, int]] = []

    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as listener:

        def bind(address: str) -> None:
            staged = Path(address)
            # The target still holds the old socket: nobody can reach the new one there yet.
            seen.append((staged.parent, _mode(staged.parent), path.lstat().st_ino))
            listener.bind(address)

        before = path.lstat().st_ino
        bind_unix_socket_path(path, bind, 0o640)
        [(private, private_mode, inode_during_bind)] = seen
        assert private.parent == tmp_path and private.name.startswith(".")
        assert private_mode == 0o700
        assert inode_during_bind == before
        assert path.lstat().st_ino != before
        assert _mode(path) == 0o640
        assert not private.exists()


def test_owner_is_set_when_asked(tmp_path: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("chown to another user needs root")
    path = tmp_path / "owned.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as listener:
        bind_unix_socket_path(path, listener.bind, 0o660, uid=107, gid=108)
        info = path.lstat()
    assert (info.st_uid, info.st_gid, stat.S_IMODE(info.st_mode)) == (107, 108, 0o660)


def test_a_bind_that_makes_no_socket_is_an_error_and_leaves_nothing(tmp_path: Path) -> None:
    with pytest.raises(UnixSocketError, match="made no socket file"):
        bind_unix_socket_path(tmp_path / "x.sock", lambda address: None, 0o600)
    assert list(tmp_path.iterdir()) == []


def test_a_failing_bind_is_one_error_naming_the_path(tmp_path: Path) -> None:
    def refuse(address: str) -> None:
        raise RuntimeError("Failed to bind")

    with pytest.raises(UnixSocketError, match=r"cannot set up socket .*x\.sock: Failed to bind"):
        bind_unix_socket_path(tmp_path / "x.sock", refuse, 0o600)
    assert list(tmp_path.iterdir()) == []


def test_a_path_too_long_for_sun_path_is_refused(tmp_path: Path) -> None:
    path = tmp_path / ("a" * MAX_SOCKET_PATH)
    with pytest.raises(UnixSocketError, match="longer than 107 bytes"):
        bind_unix_socket_path(path, lambda address: None, 0o600)
    assert list(tmp_path.iterdir()) == []


def test_a_mode_out_of_range_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="expected 0 to 0o777"):
        bind_unix_socket_path(tmp_path / "x.sock", lambda address: None, 0o1777)
