"""Plain data and decisions of the DRA kubelet stand-in (`sim.dra_kubelet`): what it records,
what its calls answer (values, so tests can compare v1 and v1beta1 answers), which service the
kubelet speaks, and `scan_registry`, its one directory read: which sockets the kubelet counts."""

from __future__ import annotations

import os
import stat
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

Identity = tuple[int, int, int]  # st_dev, st_ino, st_ctime_ns of a registration socket


class Claim(NamedTuple):
    namespace: str
    uid: str
    name: str


@dataclass(frozen=True)
class PreparedDevice:
    request_names: tuple[str, ...]
    pool_name: str
    device_name: str
    cdi_device_ids: tuple[str, ...]
    share_id: str | None = None  # v1 only, and only when the plugin set it


@dataclass(frozen=True)
class PrepareResult:
    devices: tuple[PreparedDevice, ...]
    error: str = ""


@dataclass(frozen=True)
class Registration:
    driver: str
    endpoint: str
    socket_path: Path
    supported_versions: tuple[str, ...]
    service: str  # the chosen one, e.g. "v1.DRAPlugin"
    at: float  # time.monotonic()

    @property
    def version(self) -> str:
        return self.service.split(".", 1)[0]


@dataclass(frozen=True)
class Refusal:
    socket_path: Path
    plugin_type: str
    name: str
    error: str
    at: float


@dataclass(frozen=True)
class Deregistration:
    registration: Registration
    reason: str
    at: float


def scan_registry(directory: Path) -> dict[Path, Identity]:
    """Every registration socket below `directory`, as the plugin watcher would see it."""
    found: dict[Path, Identity] = {}
    for parent, dirs, files in os.walk(directory):
        dirs[:] = [d for d in dirs if not d.startswith(".")]
        for name in files:
            if name.startswith("."):
                continue
            path = Path(parent, name)
            try:
                st = path.lstat()
            except FileNotFoundError:
                continue
            if stat.S_ISSOCK(st.st_mode):
                found[path] = (st.st_dev, st.st_ino, st.st_ctime_ns)
    return found


def choose_service(offered: Iterable[str], spoken: Iterable[str]) -> str:
    """The plugin's first service the kubelet speaks; ValueError (the kubelet's refusal) if none."""
    offered, spoken = list(offered), list(spoken)
    if not offered:
        raise ValueError("empty list of supported gRPC services (aka supported versions)")
    for service in offered:
        if service in spoken:
            return service
    raise ValueError(
        f"none of services supported by the plugin ({offered}) "
        f"are supported by the kubelet ({spoken})"
    )


def read_prepare_response(response: Any, *, with_share_id: bool) -> dict[str, PrepareResult]:
    return {
        uid: PrepareResult(
            devices=tuple(
                PreparedDevice(
                    request_names=tuple(d.request_names),
                    pool_name=d.pool_name,
                    device_name=d.device_name,
                    cdi_device_ids=tuple(d.cdi_device_ids),
                    share_id=d.share_id if with_share_id and d.HasField("share_id") else None,
                )
                for d in result.devices
            ),
            error=result.error,
        )
        for uid, result in response.claims.items()
    }
