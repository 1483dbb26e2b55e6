"""What virt-launcher does with the prepared iommufd fd, for the demo: take it from the socket
mounted at /var/run/kubevirt/iommufd.sock (KubeVirt's `ReceiveIOMMUFD`: one fd as SCM_RIGHTS with
a 1-byte payload, then a 1-byte ACK)."""

from __future__ import annotations

import os
import socket
from pathlib import Path


def take_iommufd(socket_path: str, iommu_node: Path) -> bool:
    """Take the fd as the launcher does and ACK it; whether it is `iommu_node` opened."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as client:
        client.settimeout(5)
        client.connect(socket_path)
        payload, fds, _, _ = socket.recv_fds(client, 1, 1)
        try:
            same = (
                payload == b"\x00"
                and len(fds) == 1
                and os.fstat(fds[0]).st_ino == iommu_node.stat().st_ino
            )
        finally:
            for fd in fds:
                os.close(fd)
        client.sendall(b"\x00")
    return same
