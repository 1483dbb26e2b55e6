"""A client of the iommufd hand-off that talks like KubeVirt's launcher (`ReceiveIOMMUFD`)."""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Callable
from pathlib import Path

PAYLOAD = b"\x00"
ACK = b"\x00"
_PROC_FDS = Path("/proc/self/fd")


def receive_iommufd(path: Path, *, ack: bool = True, timeout: float = 5.0) -> int:
    """Connect, take the one fd from a 1-byte SCM_RIGHTS message and (by default) ACK it."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
        conn.settimeout(timeout)
        conn.connect(str(path))
        message, fds, _flags, _address = socket.recv_fds(conn, 1, 1)
        if message != PAYLOAD or len(fds) != 1:
            for fd in fds:
                os.close(fd)
            raise AssertionError(f"expected payload {PAYLOAD!r} and 1 fd, got {message!r}, {fds}")
        if ack:
            conn.sendall(ACK)
    return fds[0]


def wait_until(condition: Callable[[], bool], timeout: float = 5.0) -> None:
    """Poll `condition` until it holds; fail after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {timeout}s")
        time.sleep(0.002)


def open_fd_count() -> int:
    return sum(1 for _ in _PROC_FDS.iterdir())


def fds_open_on(path: Path) -> set[int]:
    """This process's fds that refer to `path`."""
    found: set[int] = set()
    for link in _PROC_FDS.iterdir():
        try:
            if link.readlink() == path:
                found.add(int(link.name))
        except FileNotFoundError:
            continue  # the fd listing itself, closed by now
    return found
